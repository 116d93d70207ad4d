// mxmla — RoPE forward / backward kernel (SPEC §3), fp32 semantics of include/mxmla/rope.h.
// Arch-neutral (plain loads and stores): built for every architecture in MXMLA_CUDA_ARCHS.
//
// Elementwise and memory-bound. A head's rope part is split over R/16 threads (the element sets of
// rope_common.cuh); the same threads copy the head's pass-through (nope) part as raw 16-byte
// chunks when the output is not the input (for DeepSeek heads, a warp's 8 heads two whole heads
// per instruction: the cache lines an instruction touches decide this kernel's speed). A
// thread's data loads (nope chunks, rope inputs) are issued before its first store, so each
// thread keeps ~100 bytes in flight.
#include "cuda/cuda_check.h"
#include "cuda/rope_common.cuh"
#include "cuda/heuristics.h"

namespace mxmla::detail {
namespace {

using namespace rope_dev;

constexpr int kThreads = 256;
constexpr int kNopeBatch = 4;  // nope chunks per thread loaded up front (DeepSeek: 128 of 192 -> 16 chunks / 4 threads)

// Resident blocks per SM: 4 (64 registers, half the SM's threads) for 16-bit data; fp32 data holds
// twice the bytes per thread and gets 3.
template <typename T>
constexpr int kMinBlocks = sizeof(T) == 4 ? 3 : 4;

// One thread per (token, head, q); 32-bit index math (the launcher checks the count fits).
template <typename T, typename TT>
__global__ void __launch_bounds__(kThreads, kMinBlocks<T>) rope_kernel(const RopeKernelParams p, const int64_t* cu,
                                                                         int64_t ncu, int nthreads) {
  const int lanes = static_cast<int>(p.R / 16), half = static_cast<int>(p.R / 2);
  const int idx = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (idx >= nthreads) return;
  const int q = idx % lanes, th = idx / lanes, H = static_cast<int>(p.H);
  const int h = th % H, t = th / H;  // head, token in x's order
  int s, b;
  token_sb(p, t, s, b);
  const int64_t row = table_row(p, cu, ncu, t, s);
  const T* x = static_cast<const T*>(p.in) + s * p.in_st[0] + b * p.in_st[1] + h * p.in_st[2];
  T* y = static_cast<T*>(p.out) + s * p.out_st[0] + b * p.out_st[1] + h * p.out_st[2];
  const int nope = static_cast<int>(p.D - p.R);
  // 1. loads: nope chunks (raw), rope inputs, tables
  const int nchunks = p.copy_nope ? nope * static_cast<int>(sizeof(T)) / 16 : 0;
  const uint4* xs = reinterpret_cast<const uint4*>(x);
  uint4* ys = reinterpret_cast<uint4*>(y);
  uint4 nv[kNopeBatch];
  // DeepSeek heads (nope = 16 chunks, 4 lanes per head; a warp = 8 heads of one token when
  // H % 8 == 0): the warp copies its heads' nope parts two whole heads (512 contiguous bytes) per
  // instruction instead of 64 bytes of each of 8 heads — load i of lane l is chunk l % 16 of the
  // warp's head 2i + l / 16, which is 2i + hd heads from lane l's own head (l / 4). Fewer cache
  // lines per instruction: +4 % forward and backward (measured on the H200: git history of docs/performance.md).
  // 32-bit head offsets: the strides are checked to fit.
  const int lane = static_cast<int>(threadIdx.x & 31);
  const bool wide = nchunks == 16 && lanes == 4 && H % 8 == 0 && p.in_st[2] >= 0 && p.in_st[2] < (1 << 27) &&
                    p.out_st[2] >= 0 && p.out_st[2] < (1 << 27) && __activemask() == 0xFFFFFFFFu;
  const int hd = (lane >> 4) - (lane >> 2);
  if (wide) {
#pragma unroll
    for (int i = 0; i < kNopeBatch; ++i)
      nv[i] = __ldcs(reinterpret_cast<const uint4*>(x + (2 * i + hd) * static_cast<int>(p.in_st[2])) + (lane & 15));
  } else {
#pragma unroll
    for (int i = 0; i < kNopeBatch; ++i)
      if (q + i * lanes < nchunks) nv[i] = __ldcs(xs + q + i * lanes);
  }
  const SetChoice sc = sets_of(p.style, p.backward);
  float in[16], c[16], sn[16], o[16];
  const Raw8<T> r0 = load_raw8<T>(x + nope + set_part(sc.in_c, q, half, 0));
  const Raw8<T> r1 = load_raw8<T>(x + nope + set_part(sc.in_c, q, half, 1));
  // 2. the nope stores (their loads and the rope loads are in flight together), then the tables
  // (mostly cache hits) and the rope part: fewer values live at once than loading all first
  if (wide) {
#pragma unroll
    for (int i = 0; i < kNopeBatch; ++i)
      __stcs(reinterpret_cast<uint4*>(y + (2 * i + hd) * static_cast<int>(p.out_st[2])) + (lane & 15), nv[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kNopeBatch; ++i)
      if (q + i * lanes < nchunks) __stcs(ys + q + i * lanes, nv[i]);
  }
  for (int k = q + kNopeBatch * lanes; k < nchunks; k += lanes) ys[k] = xs[k];  // heads wider than DeepSeek's
  load_table16<TT>(p.cos, row, p.tab_row_stride, sc.tab_c, q, half, c);
  load_table16<TT>(p.sin, row, p.tab_row_stride, sc.tab_c, q, half, sn);
  unpack8<T>(r0, in), unpack8<T>(r1, in + 8);
  rotate16(p.style, p.backward, in, c, sn, o);
  const Raw8<T> a0 = pack8<T>(o), a1 = pack8<T>(o + 8);
  T* out = y + nope;
  if (sizeof(T) == 2 && sc.out_c && lanes % 2 == 0 && __activemask() == 0xFFFFFFFFu) {
    // A thread's C set is one 32-byte sector written as two 16-byte halves. Lanes 2k, 2k+1 (the
    // same head: lanes is even) swap halves so each store instruction writes whole sectors:
    // first the even lane's sector (its half 0, the odd lane sends half 1), then the odd lane's.
    const int odd = q & 1;
    const uint4 give = odd ? a0.v[0] : a1.v[0];
    uint4 got;
    got.x = __shfl_xor_sync(0xFFFFFFFFu, give.x, 1), got.y = __shfl_xor_sync(0xFFFFFFFFu, give.y, 1);
    got.z = __shfl_xor_sync(0xFFFFFFFFu, give.z, 1), got.w = __shfl_xor_sync(0xFFFFFFFFu, give.w, 1);
    uint4* even_sector = reinterpret_cast<uint4*>(out + 16 * (q - odd));
    __stcs(even_sector + odd, odd ? got : a0.v[0]);      // even lane's sector
    __stcs(even_sector + 2 + odd, odd ? a1.v[0] : got);  // odd lane's sector
  } else {
    store_raw8<T>(out + set_part(sc.out_c, q, half, 0), a0);
    store_raw8<T>(out + set_part(sc.out_c, q, half, 1), a1);
  }
}

template <typename T, typename TT>
void launch(const RopeKernelParams& p, const int64_t* cu, int64_t ncu, cudaStream_t stream) {
  const int64_t threads = p.S * p.B * p.H * (p.R / 16);
  if (threads > 0x7FFFFFFF - kThreads)
    throw Error(p.backward ? "mxmla.rope_backward" : "mxmla.apply_rope", p.backward ? "grad" : "x",
                "has too many heads x tokens for one launch (tokens * heads * rope_dim / 16 must be < 2^31)");
  const int64_t blocks = heuristics::elementwise_grid(threads, kThreads);
  rope_kernel<T, TT><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, cu, ncu, static_cast<int>(threads));
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_table(const RopeKernelParams& p, const int64_t* cu, int64_t ncu, cudaStream_t s) {
  if (p.tab_t == DType::kFloat32) launch<T, float>(p, cu, ncu, s);
  else launch<T, __nv_bfloat16>(p, cu, ncu, s);
}

}  // namespace

void rope_cuda(const RopeKernelParams& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  if (p.S * p.B * p.H == 0) return;
  DeviceCuSeqlens cu(p.cu, stream, p.backward ? "mxmla.rope_backward" : "mxmla.apply_rope");
  switch (p.io_t) {
    case DType::kBFloat16: return dispatch_table<__nv_bfloat16>(p, cu.ptr, cu.n, stream);
    case DType::kFloat16: return dispatch_table<__half>(p, cu.ptr, cu.n, stream);
    default: return dispatch_table<float>(p, cu.ptr, cu.n, stream);
  }
}

}  // namespace mxmla::detail
