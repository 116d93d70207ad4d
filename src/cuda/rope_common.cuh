// mxmla — device helpers shared by the RoPE kernels (rope.cu, rope_quantize.cu): element
// conversion, 8-element vector access, the table row of a token, and the per-thread element sets
// every style closes over. The rounding rules and the fp32 RoPE term come from cuda/numerics.cuh.
//
// The rope part of a head (R elements, R % 16 == 0) is split over R/16 threads; thread q owns 16
// elements of each of the sets it reads or writes:
//   C = [16q, 16q + 16)                              (contiguous)
//   P = [8q, 8q + 8) and [R/2 + 8q, R/2 + 8q + 8)    (one 8-element chunk of each half)
// Every style closes over these sets (interleaved_in_halves_out: in C, out P forward and the
// reverse backward; rotate_half: P -> P; interleaved: C -> C), so a thread needs no neighbour.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <vector>

#include "common/rope_cuda.h"
#include "cuda/numerics.cuh"
#include "cuda/cuda_check.h"
#include "cuda/stream_scratch.h"

namespace mxmla::detail::rope_dev {

template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  __device__ static float to_float(uint16_t b) { return bf16_lo(b); }
  __device__ static uint16_t from_float(float f) { return bf16_out(f); }
};
template <>
struct Elem<__half> {
  __device__ static float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  __device__ static uint16_t from_float(float f) { return f16_out(f); }
};

// Raw 8 elements (16 bytes for 16-bit types, 32 bytes for fp32).
template <typename T>
struct Raw8 {
  uint4 v[sizeof(T) == 4 ? 2 : 1];
};
// Data is read once (streaming); table rows are re-read by every head of a token (kCached).
template <typename T, bool kCached = false>
__device__ __forceinline__ Raw8<T> load_raw8(const T* p) {
  Raw8<T> r;
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < (sizeof(T) == 4 ? 2 : 1); ++i) r.v[i] = kCached ? __ldg(q + i) : __ldcs(q + i);
  return r;
}
template <typename T>
__device__ __forceinline__ void unpack8(const Raw8<T>& r, float* v) {
  if constexpr (sizeof(T) == 4) {
    v[0] = __uint_as_float(r.v[0].x), v[1] = __uint_as_float(r.v[0].y), v[2] = __uint_as_float(r.v[0].z);
    v[3] = __uint_as_float(r.v[0].w), v[4] = __uint_as_float(r.v[1].x), v[5] = __uint_as_float(r.v[1].y);
    v[6] = __uint_as_float(r.v[1].z), v[7] = __uint_as_float(r.v[1].w);
  } else {
    const uint32_t w[4] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = Elem<T>::to_float(static_cast<uint16_t>(w[k] & 0xFFFF));
      v[2 * k + 1] = Elem<T>::to_float(static_cast<uint16_t>(w[k] >> 16));
    }
  }
}
// 8 fp32 values -> T (round to nearest even; NaN -> the canonical pattern of the reference).
template <typename T>
__device__ __forceinline__ Raw8<T> pack8(const float* v) {
  Raw8<T> r;
  if constexpr (sizeof(T) == 4) {
    uint32_t o[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = f32_out(v[k]);
    r.v[0] = make_uint4(o[0], o[1], o[2], o[3]), r.v[1] = make_uint4(o[4], o[5], o[6], o[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = Elem<T>::from_float(v[2 * k]) | (static_cast<uint32_t>(Elem<T>::from_float(v[2 * k + 1])) << 16);
    r.v[0] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  return r;
}
template <typename T>
__device__ __forceinline__ void store_raw8(T* p, const Raw8<T>& r) {
  uint4* q = reinterpret_cast<uint4*>(p);
  __stcs(q, r.v[0]);
  if constexpr (sizeof(T) == 4) __stcs(q + 1, r.v[1]);
}

// Set C (contiguous) or P (two half chunks) of thread q: element offsets of its two 8-element parts.
__device__ __forceinline__ int set_part(bool contig, int q, int half, int part) {
  return contig ? 16 * q + 8 * part : half * part + 8 * q;
}

// Which sets a style and direction read (in), look up (tab) and write (out).
struct SetChoice {
  bool in_c, out_c, tab_c;
};
__device__ __forceinline__ SetChoice sets_of(RopeStyle st, bool backward) {
  const bool ilv = st == RopeStyle::kInterleaved, iho = st == RopeStyle::kInterleavedInHalvesOut;
  return {ilv || (iho && !backward), ilv || (iho && backward), ilv};
}

// The 16 outputs of thread q (in its out set) from its 16 inputs and table values.
__device__ __forceinline__ void rotate16(RopeStyle st, bool backward, const float* in, const float* c,
                                         const float* sn, float* o) {
  if (st == RopeStyle::kInterleavedInHalvesOut) {
    if (!backward) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        o[k] = rope_term(-sn[k], in[2 * k + 1], c[k], in[2 * k]);
        o[8 + k] = rope_term(sn[8 + k], in[2 * k], c[8 + k], in[2 * k + 1]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        o[2 * k] = rope_term(sn[8 + k], in[8 + k], c[k], in[k]);
        o[2 * k + 1] = rope_term(-sn[k], in[k], c[8 + k], in[8 + k]);
      }
    }
  } else if (st == RopeStyle::kRotateHalf) {
    // constant indices only: a run-time choice of sine index puts the arrays in local memory
    if (!backward) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        o[k] = rope_term(-sn[k], in[8 + k], c[k], in[k]);
        o[8 + k] = rope_term(sn[8 + k], in[k], c[8 + k], in[8 + k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        o[k] = rope_term(sn[8 + k], in[8 + k], c[k], in[k]);
        o[8 + k] = rope_term(-sn[k], in[k], c[8 + k], in[8 + k]);
      }
    }
  } else {  // interleaved
#pragma unroll
    for (int l = 0; l < 16; l += 2) {
      if (!backward) {
        o[l] = rope_term(-sn[l], in[l + 1], c[l], in[l]);
        o[l + 1] = rope_term(sn[l + 1], in[l], c[l + 1], in[l + 1]);
      } else {
        o[l] = rope_term(sn[l + 1], in[l + 1], c[l], in[l]);
        o[l + 1] = rope_term(-sn[l], in[l], c[l + 1], in[l + 1]);
      }
    }
  }
}

// Token (s, b) of token index t in x's token order.
// 32-bit: the launchers check that the token count fits.
__device__ __forceinline__ void token_sb(const RopeKernelParams& p, int t, int& s, int& b) {
  if (p.B == 1) s = t, b = 0;
  else if (p.sbhd) s = t / static_cast<int>(p.B), b = t % static_cast<int>(p.B);
  else b = t / static_cast<int>(p.S), s = t % static_cast<int>(p.S);
}
// Table row of token t = (s, b): s, t itself, or t minus its sequence's start (cu: the device
// copy of cu_seqlens, ncu entries; the last start <= t, so empty sequences are skipped).
__device__ __forceinline__ int64_t table_row(const RopeKernelParams& p, const int64_t* cu, int64_t ncu, int64_t t,
                                             int64_t s) {
  if (p.row_per_token) return t;
  if (cu == nullptr) return s;
  int64_t lo = 0, hi = ncu - 1;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= t) lo = mid;
    else hi = mid;
  }
  return t - cu[lo];
}

// The 16 table values of thread q's set (cos or sin), from fp32 or bf16 tables.
template <typename TT>
__device__ __forceinline__ void load_table16(const void* tab, int64_t row, int64_t row_stride, bool contig, int q,
                                             int half, float* v) {
  const TT* r = static_cast<const TT*>(tab) + row * row_stride;
  unpack8<TT>(load_raw8<TT, true>(r + set_part(contig, q, half, 0)), v);
  unpack8<TT>(load_raw8<TT, true>(r + set_part(contig, q, half, 1)), v + 8);
}

}  // namespace mxmla::detail::rope_dev

namespace mxmla::detail {
// cu_seqlens on the device for one launch: stream-ordered allocation, copied from the host values
// (a pageable copy returns once the source is staged) and freed after the kernel. Not on a stream
// that a CUDA graph is capturing: the copy from this call's host buffer (gone after the call) is
// host work that no replay could redo with another call's values (op names the caller in the error).
struct DeviceCuSeqlens {
  StreamScratch buf;
  int64_t* ptr = nullptr;
  int64_t n = 0;
  DeviceCuSeqlens(const std::vector<int64_t>* host, cudaStream_t s, const char* op)
      : buf(host == nullptr ? 0 : static_cast<int64_t>(host->size() * sizeof(int64_t)), s) {
    if (buf.ptr == nullptr) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MXMLA_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
    if (capture != cudaStreamCaptureStatusNone)
      throw Error(op, "cu_seqlens", "is a host list, copied to the device at each call, which a CUDA graph "
                                    "cannot capture: run packed sequences outside the capture");
    ptr = reinterpret_cast<int64_t*>(buf.ptr), n = static_cast<int64_t>(host->size());
    MXMLA_CUDA_CHECK(cudaMemcpyAsync(ptr, host->data(), n * sizeof(int64_t), cudaMemcpyHostToDevice, s));
  }
};
}  // namespace mxmla::detail
