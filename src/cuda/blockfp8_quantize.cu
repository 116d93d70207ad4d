// mxmla — block-FP8 quantization on CUDA (include/mxmla/blockfp8.h): one kernel for every form,
// one 512-thread block per 128 x 128 tile of in. The tile is read once (16-byte loads where the rows
// allow) into registers, thread t holding 8 adjacent values (columns c0 + 8 (t % 16) ..) of 4
// adjacent rows (r0 + 4 (t / 16) ..). From there it writes in's quantization (rowwise: a row's 1 x
// 128 block spans the 16 threads of a half warp) and / or inᵀ's (transposed: a column's block
// through a per-column amax in shared memory; the thread's 4 x 8 codes leave as one 4-byte word per
// column, through a swizzled shared tile that turns them into 16-byte stores of inᵀ's rows), or,
// with 128 x 128 blocks, both with the tile's one scale. The scale rule is the CPU reference's
// (common/blockfp8_common.h); the conversion is cvt.rn.satfinite on fp32(v · scale).
#include <cuda_runtime.h>

#include "common/blockfp8_common.h"
#include "common/blockfp8_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/ptx/convert.cuh"

namespace mxmla::detail {
namespace {

constexpr int kTile = 128;                 // rows and columns of in per thread block
constexpr int kRows = 4;                   // rows per thread (a row group)
constexpr int kThreads = 16 * kTile / kRows;  // 16 column chunks of 8 x 32 row groups
constexpr int kWarps = kThreads / 32;
static_assert(kTile == kBlockFp8K && kWarps == 16, "the thread map covers the tile; the swizzle wants 16 warps");

struct Args {
  const void* in;
  bool f32;
  int64_t rows, cols, in_st;
  bool vec;  // in's rows start 16-byte aligned: 16-byte loads of interior tiles
  bool pow2, square;
  uint8_t* codes;  // in's quantization [rows, cols] (or null), scale_inv[i * s_st + j]
  float* scale_inv;
  int64_t s_st;
  uint8_t* codes_t;  // inᵀ's [cols, rows] (or null), scale_inv_t[i * s_st_t + j]
  float* scale_inv_t;
  int64_t s_st_t;
};

__device__ __forceinline__ float bf16_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// v[i][k] = in[r0 + i][c + k] (i < kRows, k < 8); 0 outside in.
__device__ __forceinline__ void load_tile(const Args& a, int64_t r0, int64_t c, bool interior, float (&v)[kRows][8]) {
  if (interior && a.vec) {
    if (a.f32) {
      const float* p = static_cast<const float*>(a.in) + r0 * a.in_st + c;
      float4 q[kRows][2];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        q[i][0] = *reinterpret_cast<const float4*>(p + i * a.in_st);
        q[i][1] = *reinterpret_cast<const float4*>(p + i * a.in_st + 4);
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        v[i][0] = q[i][0].x, v[i][1] = q[i][0].y, v[i][2] = q[i][0].z, v[i][3] = q[i][0].w;
        v[i][4] = q[i][1].x, v[i][5] = q[i][1].y, v[i][6] = q[i][1].z, v[i][7] = q[i][1].w;
      }
    } else {
      const uint16_t* p = static_cast<const uint16_t*>(a.in) + r0 * a.in_st + c;
      uint4 q[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) q[i] = *reinterpret_cast<const uint4*>(p + i * a.in_st);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const uint32_t w[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) v[i][2 * k] = bf16_to_f32(w[k] & 0xFFFFu), v[i][2 * k + 1] = bf16_to_f32(w[k] >> 16);
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t r = r0 + i, cc = c + k;
      const int64_t o = r * a.in_st + cc;
      v[i][k] = r >= a.rows || cc >= a.cols ? 0.f
                : a.f32                     ? static_cast<const float*>(a.in)[o]
                                            : bf16_to_f32(static_cast<const uint16_t*>(a.in)[o]);
    }
}

// Codes of fp32(v[k] · s), four to a little-endian 32-bit word (byte k % 4 of word k / 4 = code k).
template <int kN>
__device__ __forceinline__ void codes(const float (&v)[kN], float s, uint32_t (&out)[kN / 4]) {
#pragma unroll
  for (int k = 0; k < kN / 4; ++k)
    out[k] = uint32_t{ptx::cvt_fp8x2<true>(__fmul_rn(v[4 * k], s), __fmul_rn(v[4 * k + 1], s))} |
             uint32_t{ptx::cvt_fp8x2<true>(__fmul_rn(v[4 * k + 2], s), __fmul_rn(v[4 * k + 3], s))} << 16;
}

// n (<= 8 or 16) bytes of `word` to dst: one store where the destination is aligned and whole.
template <typename W>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const W& word, int64_t n) {
  if (n >= int64_t{sizeof(W)} && reinterpret_cast<uintptr_t>(dst) % sizeof(W) == 0) {
    *reinterpret_cast<W*>(dst) = word;
    return;
  }
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&word);
  for (int64_t k = 0; k < n && k < int64_t{sizeof(W)}; ++k) dst[k] = b[k];
}

// Thread block (x: the 128 rows of in from r0, y: the 128 columns from c0). kRow: in's quantization;
// kCol: inᵀ's. 1 x 128 blocks (square false): a scale per row of the tile (kRow) and per column
// (kCol); 128 x 128 (square): one scale for the tile, both directions.
template <bool kRow, bool kCol>
__global__ void __launch_bounds__(kThreads) quantize_tile(const Args a) {
  __shared__ float red[kWarps][kTile];  // per warp: its two row groups' column amaxes
  __shared__ float col_scale[kTile];    // the tile's scale per column (kCol, 1 x 128)
  __shared__ float tile_max[4];         // (square)
  // inᵀ's codes: row cl (in's column c0 + cl) holds 32 words, word g = rows 4 g .. 4 g + 3, stored
  // at word g ^ 2 (cl / 8): the 32 lanes of a store (16 columns 8 apart, two row groups) hit 32 banks
  __shared__ alignas(16) uint32_t tq[kCol ? kTile : 1][kCol ? kTile / 4 : 4];
  const int t = threadIdx.x, w = t / 32, lane = t % 32, sub = t % 16, g = t / 16;
  const int64_t r0 = int64_t{blockIdx.x} * kTile, c0 = int64_t{blockIdx.y} * kTile;
  const int64_t rt = r0 + kRows * g, ct = c0 + 8 * sub;  // the thread's first row and column
  float v[kRows][8];
  load_tile(a, rt, ct, r0 + kTile <= a.rows && c0 + kTile <= a.cols, v);

  float s_tile = 1.f;
  if (a.square || kCol) {  // column amaxes -> red; then the column scales or the tile's
    float cm[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      cm[k] = 0.f;
#pragma unroll
      for (int i = 0; i < kRows; ++i) cm[k] = fmaxf(cm[k], fabsf(v[i][k]));  // (NaN ignored)
      cm[k] = fmaxf(cm[k], __shfl_xor_sync(0xFFFFFFFFu, cm[k], 16));       // the warp's other row group
    }
    if (lane < 16) {
#pragma unroll
      for (int k = 0; k < 8; ++k) red[w][8 * sub + k] = cm[k];
    }
    __syncthreads();
    if (t < kTile) {
      float m = red[0][t];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) m = fmaxf(m, red[i][t]);
      if (a.square) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (lane == 0) tile_max[w] = m;
      } else {
        const float s = block_fp8_scale(m, a.pow2);
        col_scale[t] = s;
        if (c0 + t < a.cols) a.scale_inv_t[(c0 + t) * a.s_st_t + blockIdx.x] = block_fp8_scale_inv(s);
      }
    }
    __syncthreads();
    if (a.square) {
      s_tile = block_fp8_scale(fmaxf(fmaxf(tile_max[0], tile_max[1]), fmaxf(tile_max[2], tile_max[3])), a.pow2);
      if (t == 0) {
        if (kRow) a.scale_inv[int64_t{blockIdx.x} * a.s_st + blockIdx.y] = block_fp8_scale_inv(s_tile);
        if (kCol) a.scale_inv_t[int64_t{blockIdx.y} * a.s_st_t + blockIdx.x] = block_fp8_scale_inv(s_tile);
      }
    }
  }

  if constexpr (kRow) {  // in's rows rt .. rt + 3, columns ct .. ct + 7: a row's block is the half warp's
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float s = s_tile;
      if (!a.square) {
        float m = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(v[i][k]));
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        s = block_fp8_scale(m, a.pow2);
        if (sub == 0 && rt + i < a.rows) a.scale_inv[(rt + i) * a.s_st + blockIdx.y] = block_fp8_scale_inv(s);
      }
      uint32_t q[2];
      codes(v[i], s, q);
      if (rt + i < a.rows && ct < a.cols) store_bytes(a.codes + (rt + i) * a.cols + ct, make_uint2(q[0], q[1]), a.cols - ct);
    }
  }

  if constexpr (kCol) {  // column 8 sub + k of the tile: rows 4 g .. 4 g + 3 = word g of inᵀ's row, at g ^ 2 sub
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float col[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) col[i] = v[i][k];
      uint32_t q[1];
      codes(col, a.square ? s_tile : col_scale[8 * sub + k], q);
      tq[8 * sub + k][g ^ (2 * sub)] = q[0];
    }
    __syncthreads();
    // inᵀ's rows c0 .. c0 + 127, 16 bytes (words 4 j .. 4 j + 3) a thread per step: stored at words
    // 4 (j ^ (m / 4)) .. + 3 with m = 2 (cl / 8), the two halves swapped when m % 4 == 2
#pragma unroll
    for (int step = 0; step < kTile * kTile / 16 / kThreads; ++step) {
      const int idx = t + step * kThreads, cl = idx / 8, j = idx % 8, m = 2 * (cl / 8);
      if (c0 + cl >= a.cols || r0 + 16 * j >= a.rows) continue;
      const uint4 p = *reinterpret_cast<const uint4*>(&tq[cl][4 * (j ^ (m / 4))]);
      const uint4 word = m % 4 ? make_uint4(p.z, p.w, p.x, p.y) : p;
      store_bytes(a.codes_t + (c0 + cl) * a.rows + r0 + 16 * j, word, a.rows - (r0 + 16 * j));
    }
  }
}

}  // namespace

void block_quantize_cuda(const BlockQuantizeProblem& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  const int64_t esize = p.in_t == DType::kFloat32 ? 4 : 2;
  Args a{p.in, p.in_t == DType::kFloat32, p.rows, p.cols, p.in_st,
         reinterpret_cast<uintptr_t>(p.in) % 16 == 0 && (p.in_st * esize) % 16 == 0, p.pow2, p.block_rows == 128,
         nullptr, nullptr, 0, nullptr, nullptr, 0};
  const bool row = !p.transpose || p.codes_t != nullptr, col = p.transpose || p.codes_t != nullptr;
  if (p.transpose) {  // inᵀ's only: the problem's codes / scale_inv are inᵀ's
    a.codes_t = p.codes, a.scale_inv_t = p.scale_inv, a.s_st_t = p.s_st;
  } else {
    a.codes = p.codes, a.scale_inv = p.scale_inv, a.s_st = p.s_st;
    a.codes_t = p.codes_t, a.scale_inv_t = p.scale_inv_t, a.s_st_t = p.s_st_t;
  }
  const int64_t gx = (p.rows + kTile - 1) / kTile, gy = (p.cols + kTile - 1) / kTile;
  if (gx > 0x7FFFFFFF || gy > 65535)
    throw Error("mxmla.quantize_blockwise", "input", "has more than 65535 * 128 columns or 2^31 * 128 rows");
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  if (row && col)
    quantize_tile<true, true><<<grid, kThreads, 0, stream>>>(a);
  else if (col)
    quantize_tile<false, true><<<grid, kThreads, 0, stream>>>(a);
  else
    quantize_tile<true, false><<<grid, kThreads, 0, stream>>>(a);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mxmla::detail
