// mxmla — block-FP8 quantization on CUDA (include/mxmla/blockfp8.h): one warp per 1 x 128 block
// (4 values a lane), or one 256-thread block per 128 x 128 block (64 values a thread, kept in
// registers between the amax and the conversion); transposed (the quantization of inᵀ), one
// 256-thread block per 128 x 128 tile of in for either block shape, its codes transposed through
// shared memory. The scale rule is the CPU reference's (common/blockfp8_common.h); the conversion
// is cvt.rn.satfinite on fp32(v · scale).
#include <cuda_runtime.h>

#include "common/blockfp8_common.h"
#include "common/blockfp8_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/ptx/convert.cuh"

namespace mxmla::detail {
namespace {

struct Args {
  const void* in;
  bool f32;
  int64_t rows, cols, in_st;
  uint8_t* codes;
  float* scale_inv;
  int64_t s_st, nbc;
  bool pow2;
};

__device__ __forceinline__ float load(const Args& a, int64_t r, int64_t c) {
  const int64_t o = r * a.in_st + c;
  return a.f32 ? static_cast<const float*>(a.in)[o]
               : __uint_as_float(uint32_t{static_cast<const uint16_t*>(a.in)[o]} << 16);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Values v[0..3] of row r at columns c .. c + 3 (those < cols) -> codes.
__device__ __forceinline__ void store4(const Args& a, int64_t r, int64_t c, const float (&v)[4], float s) {
  const uint16_t lo = ptx::cvt_fp8x2<true>(__fmul_rn(v[0], s), __fmul_rn(v[1], s));
  const uint16_t hi = ptx::cvt_fp8x2<true>(__fmul_rn(v[2], s), __fmul_rn(v[3], s));
  uint8_t* dst = a.codes + r * a.cols + c;
  if (c + 3 < a.cols && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {  // one 4-byte store where aligned
    *reinterpret_cast<uint32_t*>(dst) = uint32_t{lo} | (uint32_t{hi} << 16);
  } else {
    const uint8_t b[4] = {uint8_t(lo), uint8_t(lo >> 8), uint8_t(hi), uint8_t(hi >> 8)};
    for (int i = 0; i < 4 && c + i < a.cols; ++i) dst[i] = b[i];
  }
}

// 1 x 128: warp w of the launch takes block (row, j), j fastest.
__global__ void __launch_bounds__(256) quantize_1x128(const Args a) {
  const int64_t blk = (int64_t{blockIdx.x} * 256 + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= a.rows * a.nbc) return;  // (whole warps)
  const int64_t r = blk / a.nbc, j = blk % a.nbc, c = j * kBlockFp8K + 4 * lane;
  float v[4], amax = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = c + i < a.cols ? load(a, r, c + i) : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));  // (NaN ignored)
  }
  amax = warp_max(amax);
  const float s = block_fp8_scale(amax, a.pow2);
  if (lane == 0) a.scale_inv[r * a.s_st + j] = block_fp8_scale_inv(s);
  if (c < a.cols) store4(a, r, c, v, s);
}

// 128 x 128: thread block (i, j); warp w takes rows 8 k + w, lane the columns 4 lane .. 4 lane + 3.
__global__ void __launch_bounds__(256) quantize_128x128(const Args a) {
  __shared__ float red[8];
  const int64_t i = blockIdx.y, j = blockIdx.x;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c = j * kBlockFp8K + 4 * lane;
  float v[16][4], amax = 0.f;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int64_t r = i * 128 + 8 * k + w;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[k][e] = r < a.rows && c + e < a.cols ? load(a, r, c + e) : 0.f;
      amax = fmaxf(amax, fabsf(v[k][e]));
    }
  }
  amax = warp_max(amax);
  if (lane == 0) red[w] = amax;
  __syncthreads();
  amax = red[0];
#pragma unroll
  for (int k = 1; k < 8; ++k) amax = fmaxf(amax, red[k]);
  const float s = block_fp8_scale(amax, a.pow2);
  if (threadIdx.x == 0) a.scale_inv[i * a.s_st + j] = block_fp8_scale_inv(s);
  if (c >= a.cols) return;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int64_t r = i * 128 + 8 * k + w;
    if (r < a.rows) store4(a, r, c, v[k], s);
  }
}

// Transposed: Q = inᵀ [cols, rows]. Thread block (x: 128 rows of in from r0, y: 128 columns from
// c0); warp w holds rows r0 + 16 w .. + 15 of in's columns c0 + lane + 32 e (e < 4), each a load
// of 32 adjacent values per warp. Per column of in (a row of Q): amax over the tile's rows, through
// shared memory (red); 1 x 128 blocks of Q take one scale per column, 128 x 128 blocks one for the
// tile. The thread's 16 codes of a column go to t[column][16 w ..] as one 16-byte store (a row
// pitch of 144 bytes: the 8 lanes of a store phase hit distinct banks), then each warp writes 16 of
// Q's rows, 128 bytes (4 a lane) a row.
__global__ void __launch_bounds__(256) quantize_transposed(const Args a, bool square) {
  constexpr int kPitch = 144;
  __shared__ float red[8][128];
  __shared__ alignas(16) uint8_t t[128][kPitch];
  const int64_t r0 = int64_t{blockIdx.x} * 128, c0 = int64_t{blockIdx.y} * 128;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  float v[16][4], am[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int64_t r = r0 + 16 * w + k;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t c = c0 + lane + 32 * e;
      v[k][e] = r < a.rows && c < a.cols ? load(a, r, c) : 0.f;
      am[e] = fmaxf(am[e], fabsf(v[k][e]));  // (NaN ignored)
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) red[w][lane + 32 * e] = am[e];
  __syncthreads();
  float s[4];
  if (square) {  // one scale for the tile
    float m = 0.f;
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) m = fmaxf(m, red[i][lane + 32 * e]);
    m = warp_max(m);
    const float sc = block_fp8_scale(m, a.pow2);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = sc;
    if (threadIdx.x == 0) a.scale_inv[int64_t{blockIdx.y} * a.s_st + blockIdx.x] = block_fp8_scale_inv(sc);
  } else {  // a scale per column of in (a 1 x 128 block of Q's row c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float m = 0.f;
      for (int i = 0; i < 8; ++i) m = fmaxf(m, red[i][lane + 32 * e]);
      s[e] = block_fp8_scale(m, a.pow2);
      const int64_t c = c0 + lane + 32 * e;
      if (w == 0 && c < a.cols) a.scale_inv[c * a.s_st + blockIdx.x] = block_fp8_scale_inv(s[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    uint32_t q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = ptx::cvt_fp8x2<true>(__fmul_rn(v[4 * i][e], s[e]), __fmul_rn(v[4 * i + 1][e], s[e]));
      const uint16_t hi = ptx::cvt_fp8x2<true>(__fmul_rn(v[4 * i + 2][e], s[e]), __fmul_rn(v[4 * i + 3][e], s[e]));
      q[i] = uint32_t{lo} | (uint32_t{hi} << 16);
    }
    *reinterpret_cast<uint4*>(&t[lane + 32 * e][16 * w]) = make_uint4(q[0], q[1], q[2], q[3]);
  }
  __syncthreads();
  // Q's rows c0 + 16 w .. + 15 (in's columns), their bytes r0 + 4 lane .. + 3
  const int64_t r = r0 + 4 * lane;
  if (r >= a.rows) return;
  for (int i = 0; i < 16; ++i) {
    const int cl = 16 * w + i;
    if (c0 + cl >= a.cols) break;
    const uint32_t word = *reinterpret_cast<const uint32_t*>(&t[cl][4 * lane]);
    uint8_t* dst = a.codes + (c0 + cl) * a.rows + r;
    if (r + 3 < a.rows && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
      for (int b = 0; b < 4 && r + b < a.rows; ++b) dst[b] = uint8_t(word >> (8 * b));
    }
  }
}

}  // namespace

void block_quantize_cuda(const BlockQuantizeProblem& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  Args a{p.in, p.in_t == DType::kFloat32, p.rows, p.cols, p.in_st, p.codes, p.scale_inv, p.s_st,
         (p.cols + kBlockFp8K - 1) / kBlockFp8K, p.pow2};
  if (p.transpose) {
    const dim3 grid(unsigned((p.rows + 127) / 128), unsigned((p.cols + 127) / 128));
    if (grid.y > 65535u) throw Error("mxmla.quantize_blockwise", "input", "has more than 65535 * 128 columns (transpose)");
    quantize_transposed<<<grid, 256, 0, stream>>>(a, p.block_rows == 128);
  } else if (p.block_rows == 1) {
    const int64_t warps = p.rows * a.nbc;
    quantize_1x128<<<unsigned((warps + 7) / 8), 256, 0, stream>>>(a);
  } else {
    const dim3 grid(unsigned(a.nbc), unsigned((p.rows + 127) / 128));
    quantize_128x128<<<grid, 256, 0, stream>>>(a);
  }
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mxmla::detail
