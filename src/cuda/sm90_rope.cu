// mxmla — RoPE forward / backward kernel (SPEC §3), fp32 semantics of include/mxmla/rope.h.
//
// Elementwise and memory-bound. The rope part of a head (R elements, R % 16 == 0) is split over
// R/16 threads; thread q owns 16 elements of each of the sets it reads or writes:
//   C = [16q, 16q + 16)                      (contiguous)
//   P = [8q, 8q + 8) and [R/2 + 8q, R/2 + 8q + 8)   (one 8-element chunk of each half)
// and every style closes over these sets (interleaved_in_halves_out: in C, out P forward and the
// reverse backward; rotate_half: P -> P; interleaved: C -> C), so a thread needs no neighbour.
// The same threads copy the pass-through (nope) part when the output is not the input.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/rope_cuda.h"
#include "cuda/cuda_check.h"

namespace mxmla::detail {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  __device__ static float to_float(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
  __device__ static uint16_t from_float(float f) {
    return isnan(f) ? 0x7FC0 : __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};
template <>
struct Elem<__half> {
  __device__ static float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  __device__ static uint16_t from_float(float f) { return isnan(f) ? 0x7E00 : __half_as_ushort(__float2half_rn(f)); }
};

// 8 elements at p (16-byte aligned for 16-bit types, 32 bytes of two aligned float4 for fp32).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* v) {
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = Elem<T>::to_float(static_cast<uint16_t>(w[k] & 0xFFFF));
      v[2 * k + 1] = Elem<T>::to_float(static_cast<uint16_t>(w[k] >> 16));
    }
  }
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float* v) {
  if constexpr (sizeof(T) == 4) {
    float o[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = isnan(v[k]) ? __uint_as_float(0x7FC00000u) : v[k];
    reinterpret_cast<float4*>(p)[0] = make_float4(o[0], o[1], o[2], o[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(o[4], o[5], o[6], o[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = Elem<T>::from_float(v[2 * k]) | (static_cast<uint32_t>(Elem<T>::from_float(v[2 * k + 1])) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
// 16 elements of set C (contig) or P (two half chunks) at element offsets of `base`.
template <typename T>
__device__ __forceinline__ void load_set(const T* base, bool contig, int q, int half, float* v) {
  if (contig) {
    load8(base + 16 * q, v), load8(base + 16 * q + 8, v + 8);
  } else {
    load8(base + 8 * q, v), load8(base + half + 8 * q, v + 8);
  }
}
template <typename T>
__device__ __forceinline__ void store_set(T* base, bool contig, int q, int half, const float* v) {
  if (contig) {
    store8(base + 16 * q, v), store8(base + 16 * q + 8, v + 8);
  } else {
    store8(base + 8 * q, v), store8(base + half + 8 * q, v + 8);
  }
}

__device__ __forceinline__ float term(float sgn_s, float xb, float c, float xa) {
  return __fmaf_rn(sgn_s, xb, __fmul_rn(c, xa));  // a rounded product, then one fma
}

template <typename T, typename TT>
__global__ void __launch_bounds__(kThreads) sm90_rope_kernel(const RopeKernelParams p) {
  const int lanes = static_cast<int>(p.R / 16), half = static_cast<int>(p.R / 2);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.S * p.B * p.H * lanes) return;
  const int q = static_cast<int>(idx % lanes);
  int64_t t = idx / lanes;
  const int64_t h = t % p.H;
  t /= p.H;
  const int64_t inner_n = p.sbhd ? p.B : p.S;
  const int64_t inner = t % inner_n, outer = t / inner_n;
  const int64_t s = p.sbhd ? outer : inner, b = p.sbhd ? inner : outer;
  const int64_t row = p.row_per_token ? (p.sbhd ? s * p.B + b : b * p.S + s) : s;
  const T* x = static_cast<const T*>(p.in) + s * p.in_st[0] + b * p.in_st[1] + h * p.in_st[2];
  T* y = static_cast<T*>(p.out) + s * p.out_st[0] + b * p.out_st[1] + h * p.out_st[2];
  const int64_t nope = p.D - p.R;
  if (p.copy_nope) {
    for (int64_t c = 8 * q; c < nope; c += 8 * lanes) {
      float v[8];
      load8(x + c, v);
      store8(y + c, v);
    }
  }
  // Which sets this style and direction read (in), look up (tab) and write (out).
  const bool ilv = p.style == RopeStyle::kInterleaved, iho = p.style == RopeStyle::kInterleavedInHalvesOut;
  const bool in_c = ilv || (iho && !p.backward), out_c = ilv || (iho && p.backward), tab_c = ilv;
  float in[16], c[16], sn[16], o[16];
  load_set(x + nope, in_c, q, half, in);
  const TT* crow = static_cast<const TT*>(p.cos) + row * p.tab_row_stride;
  const TT* srow = static_cast<const TT*>(p.sin) + row * p.tab_row_stride;
  load_set(crow, tab_c, q, half, c);
  load_set(srow, tab_c, q, half, sn);
  if (iho && !p.backward) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      o[k] = term(-sn[k], in[2 * k + 1], c[k], in[2 * k]);
      o[8 + k] = term(sn[8 + k], in[2 * k], c[8 + k], in[2 * k + 1]);
    }
  } else if (iho) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      o[2 * k] = term(sn[8 + k], in[8 + k], c[k], in[k]);
      o[2 * k + 1] = term(-sn[k], in[k], c[8 + k], in[8 + k]);
    }
  } else if (!ilv) {  // rotate_half
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (!p.backward) {
        o[k] = term(-sn[k], in[8 + k], c[k], in[k]);
        o[8 + k] = term(sn[8 + k], in[k], c[8 + k], in[8 + k]);
      } else {
        o[k] = term(sn[8 + k], in[8 + k], c[k], in[k]);
        o[8 + k] = term(-sn[k], in[k], c[8 + k], in[8 + k]);
      }
    }
  } else {  // interleaved
#pragma unroll
    for (int l = 0; l < 16; l += 2) {
      if (!p.backward) {
        o[l] = term(-sn[l], in[l + 1], c[l], in[l]);
        o[l + 1] = term(sn[l + 1], in[l], c[l + 1], in[l + 1]);
      } else {
        o[l] = term(sn[l + 1], in[l + 1], c[l], in[l]);
        o[l + 1] = term(-sn[l], in[l], c[l + 1], in[l + 1]);
      }
    }
  }
  store_set(y + nope, out_c, q, half, o);
}

template <typename T, typename TT>
void launch(const RopeKernelParams& p, cudaStream_t stream) {
  const int64_t threads = p.S * p.B * p.H * (p.R / 16);
  if (threads == 0) return;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  if (blocks > 0x7FFFFFFF) throw Error("mxmla.apply_rope", "x", "too many elements for one launch");
  sm90_rope_kernel<T, TT><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_table(const RopeKernelParams& p, cudaStream_t s) {
  if (p.tab_t == DType::kFloat32) launch<T, float>(p, s);
  else launch<T, __nv_bfloat16>(p, s);
}

}  // namespace

void rope_cuda(const RopeKernelParams& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  switch (p.io_t) {
    case DType::kBFloat16: return dispatch_table<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return dispatch_table<__half>(p, stream);
    default: return dispatch_table<float>(p, stream);
  }
}

}  // namespace mxmla::detail
