// mxmla — the MXFP8 GEMM for SM90 (sm_90a): the launcher of the three designs (SPEC §7).
//   design C (dequant_bf16 + sm90_bf16_gemm.cuh): each operand dequantized once into a K-major bf16
//            copy in stream-ordered scratch, then a TMA + bf16 wgmma GEMM on the copies;
//   design A (sm90_mxfp8_gemm_bf16.cuh): the codes dequantized to bf16 in shared memory for every
//            tile that reads them, bf16 wgmma;
//   design B (sm90_mxfp8_gemm.cuh): FP8 wgmma per 32-wide block, an fp32 rescale per block;
//   design D (sm90_mxfp8_gemm_rs.cuh): A's codes (K-major, or a columnwise copy's) dequantized in
//            registers (RS bf16 wgmma), B design C's bf16 copy; the same sums as design C's, bit for bit.
// C is the default (measured fastest: A converts each code once per tile that reads it, N / 256
// times for A's rows, and its conversion does not hide behind the tensor cores; docs/notes-gemm.md)
// except where TMA can read A's codes and N is small (heuristics::kGemmDesignDMaxN; K at least
// kGemmDesignDMinK: the Q up-projection's dgrad and wgrad): there D, whose
// register conversion (also N / 256 times) overlaps the previous stage's wgmmas and costs less than
// C's pass over A. D checks A's scales itself (in the kernel, setting the same flag, design B queued
// after it then redoing all of D); it is not used to accumulate into D, nor with a prepared A.
// C and A hold every dequantized value exactly as a bf16 number unless a block with non-zero codes
// has a scale byte below min_exact_e (its smallest codes fall below bf16's normal range). Design
// C's dequantizing passes, which every call runs, check for such blocks as they convert (reading
// each operand's scales as stored, compact or swizzled) and set a flag in device memory; both the
// bf16 design and B are launched and the one the flag does not pick returns at once (no host
// synchronisation). MXMLA_GEMM_DESIGN=A, B, C or D in the environment forces one design (A/B
// measurements; A, C and D then round such values to bf16).
// Designs A and B read the operands K-major with F8_128x4-swizzled scales (gathered into the
// swizzled rowwise layout of op(X) = [R, K]); per call those gathers, like B's K-major copies,
// return at once unless the flag is set. An operand given the other way (a columnwise copy:
// dgrad's W, wgrad's dY and x) goes through design C's dequantizing pass directly (the transposing
// dequant_bf16_trans: one pass); design B's and A's K-major copy of it (codes transposed in 32 x 32
// tiles, scratch) is made only when they run. An operand whose rows TMA cannot take (not 16-byte
// aligned) is repacked for every design.
// Instantiations: E4M3 and E5M2 of each.
#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include "common/gemm_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/mxfp8_bf16_operands.h"
#include "cuda/numerics.cuh"
#include "cuda/sm90_mxfp8_gemm.cuh"
#include "cuda/ptx/convert.cuh"
#include "cuda/sm90_bf16_gemm.cuh"
#include "cuda/sm90_mxfp8_gemm_bf16.cuh"
#include "cuda/sm90_mxfp8_gemm_rs.cuh"
#include "cuda/stream_scratch.h"
#include "cuda/tma_desc.h"

namespace mxmla::detail {
namespace {

constexpr const char* kOp = "mxmla.gemm";

// dst [R, Kp] (K contiguous, zero beyond K) from src: [R, K] row-major (!trans) or [K, R] (trans),
// row stride ld. 32 x 32 byte tiles through shared memory, a block taking tiles blockIdx.x,
// blockIdx.x + gridDim.x, … (a grid of at most kRepackBlocks). The copy design B reads: per call in
// gated_prep's launch (below), which the design flag gates.
constexpr int64_t kRepackBlocks = 2048;
struct RepackArgs {
  const uint8_t* src;
  int64_t ld;
  bool trans;
  uint8_t* dst;
  int64_t R, K, Kp;
  int64_t tiles() const { return (Kp + 31) / 32 * ((R + 31) / 32); }
};
// The tiles first, first + stride, ... of one copy; (tx, ty): the thread's place in a 32 x 8 block.
__device__ __forceinline__ void repack_tiles(const RepackArgs& a, int64_t first, int64_t stride, int tx, int ty) {
  __shared__ uint8_t t[32][33];
  const int64_t tiles_k = (a.Kp + 31) / 32, tiles = tiles_k * ((a.R + 31) / 32);
  for (int64_t tile = first; tile < tiles; tile += stride) {
    const int64_t r0 = tile / tiles_k * 32, k0 = tile % tiles_k * 32;
    __syncthreads();  // the previous tile's reads of t
    for (int i = ty; i < 32; i += 8) {  // load: rows of the source
      if (a.trans) {
        const int64_t k = k0 + i, r = r0 + tx;
        t[i][tx] = (k < a.K && r < a.R) ? a.src[k * a.ld + r] : uint8_t{0};
      } else {
        const int64_t r = r0 + i, k = k0 + tx;
        t[tx][i] = (k < a.K && r < a.R) ? a.src[r * a.ld + k] : uint8_t{0};
      }
    }
    __syncthreads();
    for (int i = ty; i < 32; i += 8) {  // store: rows of dst (t[k][r])
      const int64_t r = r0 + i, k = k0 + tx;
      if (r < a.R && k < a.Kp) a.dst[r * a.Kp + k] = t[tx][i];
    }
  }
}
__global__ void __launch_bounds__(256) repack_kmajor(const RepackArgs a) {
  repack_tiles(a, blockIdx.x, gridDim.x, threadIdx.x, threadIdx.y);
}

// The scale check (the launcher's note): sets *small when a block with a non-zero code (w: codes of
// the block, those past K zero) has a scale byte e below min_e (0: no check).
__device__ __forceinline__ void check_scale(uint32_t e, const uint32_t (&w)[4], uint32_t min_e, uint32_t* small) {
  if (e < min_e && ((w[0] | w[1] | w[2] | w[3]) & 0x7F7F7F7Fu) != 0) atomicOr(small, 1u);  // ±0: no
}

// The swizzled rowwise scales of op(X) = [R, K] (every padded byte written; padding zero) for
// designs A, B and D, from the operand's own (at index: OpScaleIndex, rowwise of [R, K] when
// contract_cols, else columnwise of [K, R]): design D's of A, at every call; designs A's and B's
// when forced; per call design B's are in gated_prep's launch (below), which the flag gates.
// A block of 128 threads takes groups of 128 rows x 16 block columns (four 512-byte swizzle tiles,
// contiguous in dst) through shared memory. Loads: 16 bytes a thread along the source's contiguous
// direction (one row's 16 block columns, or 16 rows of one block column), one 16-byte load where
// the source is compact and those bytes are whole and aligned (vec16), else byte by byte.
// Stores: one 16-byte chunk of the swizzle tiles a thread (chunk c of tile q: rows c, c + 32,
// c + 64, c + 96, block columns 4q .. 4q + 3).
constexpr int64_t kGatherBlocks = 8192;
constexpr int kGatherThreads = 128;
struct GatherArgs {
  const uint8_t* src;
  OpScaleIndex index;
  bool contract_cols, vec16;
  uint8_t* dst;
  int64_t R, kb_count, rows_pad, cols_pad;
  int64_t groups() const { return rows_pad / 128 * ((cols_pad + 15) / 16); }
};
// The groups first, first + stride, ... of one gather; threads tid < kGatherThreads do the work, the
// block's other threads (a wider block) only take part in its barriers.
__device__ __forceinline__ void gather_groups(const GatherArgs& a, int64_t first, int64_t stride, int tid) {
  // [row][block column of the group], rows 20 bytes apart: the 4-byte reads down a column of
  // words (rows c + 32k) fall in distinct banks
  __shared__ __align__(16) uint32_t t[128 * 5];
  uint8_t* const tb = reinterpret_cast<uint8_t*>(t);
  const int64_t tiles_x = a.cols_pad / 4, groups_x = (a.cols_pad + 15) / 16, groups = a.rows_pad / 128 * groups_x;
  const bool worker = tid < kGatherThreads;
  for (int64_t g = first; g < groups; g += stride) {
    const int64_t i0 = g / groups_x * 128, j0 = g % groups_x * 16;
    __syncthreads();  // the previous group's reads of t
    if (worker && a.contract_cols) {  // row i0 + tid, block columns j0 .. j0 + 15 (contiguous in a compact source)
      const int64_t i = i0 + tid;
      uint32_t w[4] = {0, 0, 0, 0};
      if (a.vec16 && i < a.R && j0 + 16 <= a.kb_count) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(a.src + a.index.at(i, j0)));
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
      } else if (i < a.R) {
#pragma unroll
        for (int b = 0; b < 16; ++b)
          if (j0 + b < a.kb_count) w[b / 4] |= uint32_t{a.src[a.index.at(i, j0 + b)]} << (8 * (b % 4));
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) t[tid * 5 + k] = w[k];
    } else if (worker) {  // block column j0 + tid / 8, rows i0 + 16 (tid % 8) .. + 15 (contiguous in a compact source)
      const int64_t j = j0 + tid / 8, r0 = i0 + 16 * (tid % 8);
      uint8_t v[16];
      if (a.vec16 && j < a.kb_count && r0 + 16 <= a.R) {
        *reinterpret_cast<uint4*>(v) = __ldg(reinterpret_cast<const uint4*>(a.src + a.index.at(r0, j)));
      } else {
#pragma unroll
        for (int b = 0; b < 16; ++b) v[b] = (j < a.kb_count && r0 + b < a.R) ? a.src[a.index.at(r0 + b, j)] : uint8_t{0};
      }
#pragma unroll
      for (int b = 0; b < 16; ++b) tb[(16 * (tid % 8) + b) * 20 + tid / 8] = v[b];
    }
    __syncthreads();
    const int q = tid / 32, c = tid % 32;
    if (worker && j0 + 4 * q < a.cols_pad)
      *reinterpret_cast<uint4*>(a.dst + (i0 / 128 * tiles_x + j0 / 4 + q) * 512 + 16 * c) =
          make_uint4(t[c * 5 + q], t[(c + 32) * 5 + q], t[(c + 64) * 5 + q], t[(c + 96) * 5 + q]);
  }
}
// zero: null, or the call's design flag, which block 0 clears first (design D's call: its gather
// of A's scales is the call's first launch, before any scale check can set the flag).
__global__ void __launch_bounds__(kGatherThreads) gather_scales(const GatherArgs a, uint32_t* zero) {
  if (zero != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *zero = 0;
  gather_groups(a, blockIdx.x, gridDim.x, threadIdx.x);
}

// Design B's gathers and K-major copies of one call (at most four jobs: each operand's scales and
// codes), in one launch that returns at once while the design flag is clear: block (x, j) takes
// job j's work units x, x + gridDim.x, ... (256 threads: a repack's 32 x 8, a gather's 128 and 128
// that only take part in its barriers).
struct PrepJob {
  bool gather;
  GatherArgs g;
  RepackArgs r;
};
struct PrepJobs {
  PrepJob job[4];
  int n;
};
__global__ void __launch_bounds__(256) gated_prep(const __grid_constant__ PrepJobs jobs, const uint32_t* run_if) {
  if (*run_if == 0) return;
  const PrepJob& j = jobs.job[blockIdx.y];
  if (j.gather) gather_groups(j.g, blockIdx.x, gridDim.x, threadIdx.x);
  else repack_tiles(j.r, blockIdx.x, gridDim.x, threadIdx.x % 32, threadIdx.x / 32);
}

// 4·kWords codes (byte i of w = value k0 + i) times the block's factor f -> as many bf16 (out[i]:
// values k0 + 2i, k0 + 2i + 1): code · 2^(e − 127) in fp32 (exact), rounded to bf16; values at K and
// past it are 0 (also under a NaN factor).
template <bool kE4M3, int kWords>
__device__ __forceinline__ void dequant_words(const uint32_t (&w)[kWords], float f, int64_t k0, int64_t K,
                                              uint32_t (&out)[2 * kWords]) {
#pragma unroll
  for (int i = 0; i < 2 * kWords; ++i) {
    const uint32_t h2 = ptx::cvt_f16x2_from_fp8x2<kE4M3>(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
    const __half2 h = *reinterpret_cast<const __half2*>(&h2);
    const float lo = k0 + 2 * i < K ? __low2float(h) * f : 0.f, hi = k0 + 2 * i + 1 < K ? __high2float(h) * f : 0.f;
    out[i] = bf16x2_rn(lo, hi);
  }
}

// Where design C's dequantizing passes read op(X)'s scales (the operand's own, compact or swizzled:
// OpScaleIndex, common/mxfp8_common.h), and the scale check's bound (0: no check) and flag.
struct ScaleSrc {
  const uint8_t* scales;
  OpScaleIndex index;
  uint32_t min_e;
  uint32_t* small;
  __device__ __forceinline__ uint32_t at(int64_t r, int64_t kb) const { return scales[index.at(r, kb)]; }
};

// Design C's copy of op(X): bf16 [R, Kp] (Kp = K rounded up to 16, zeros past K) from the K-major
// codes of kmajor() and the operand's own scales (exact unless the scale check, run here, sends
// the call to design B). One thread per 16 codes.
template <bool kE4M3>
__global__ void __launch_bounds__(256) dequant_bf16(const uint8_t* __restrict__ codes, int64_t ld, const ScaleSrc ss,
                                                    uint32_t* __restrict__ dst, int64_t R, int64_t K, int64_t Kp) {
  const int64_t chunks = Kp / 16, x = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (x >= R * chunks) return;
  const int64_t r = x / chunks, k0 = (x % chunks) * 16;
  const uint32_t e = ss.at(r, k0 / 32);
  uint32_t w[4];
  if (k0 + 16 <= K) {
    const uint4 v = *reinterpret_cast<const uint4*>(codes + r * ld + k0);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (k0 + 4 * i + j < K) w[i] |= static_cast<uint32_t>(codes[r * ld + k0 + 4 * i + j]) << (8 * j);
    }
  }
  check_scale(e, w, ss.min_e, ss.small);
  uint32_t out[8];
  dequant_words<kE4M3, 4>(w, e8m0_factor(e), k0, K, out);
  uint4* d = reinterpret_cast<uint4*>(dst + (r * Kp + k0) / 2);
  d[0] = make_uint4(out[0], out[1], out[2], out[3]);
  d[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

// The same copy straight from a columnwise operand's codes X [K, R] (row stride ld; data and ld
// multiples of 16 bytes), transposed through shared memory: one pass instead of repack_kmajor +
// dequant_bf16. Block = 64 of K (blockIdx.x) x 128 of R (blockIdx.y), 256 threads, so that both sides
// move whole 128-byte lines: each thread loads 16 codes of two K rows (8 threads a row, both loads
// issued before either is used); then takes 8 consecutive K (one 16-byte store) of 4 consecutive R
// rows: 8 words read down the tile (one per K row, 4 R bytes each), two 4 x 4 byte transposes give
// each R row its 8 codes, and the 8 threads of an R group store 128 contiguous bytes of each row. The
// shared tile [64 k][128 r] has its 16-byte chunks XOR-swizzled by (k / 8) % 8, so that both the
// chunk stores and the word reads (a warp: 8 K groups x 4 R words) meet no bank conflict. Six blocks
// an SM: 40 registers, no spills (eight, at 32, spill 24 bytes).
template <bool kE4M3>
__global__ void __launch_bounds__(256, 6) dequant_bf16_trans(const uint8_t* __restrict__ codes, int64_t ld,
                                                          const ScaleSrc ss, uint32_t* __restrict__ dst, int64_t R,
                                                          int64_t K, int64_t Kp) {
  constexpr int kBK = 64, kBR = 128;
  __shared__ __align__(16) uint32_t t[kBK][kBR / 4];  // [k][r / 4]: chunk j of row k at j ^ ((k / 8) % 8)
  const int64_t k0 = int64_t{blockIdx.x} * kBK, r0 = int64_t{blockIdx.y} * kBR;
  const int tid = static_cast<int>(threadIdx.x);
  const int c = tid % 8, q4 = tid / 8;  // the conversion's K values k0 + 8c .. + 7 of rows r0 + 4 q4 + i
  const int64_t kc = k0 + 8 * c;
  // its four scale bytes, loaded with the codes (an operand's own scales come from memory the codes'
  // loads do not warm)
  uint32_t e[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t gr = r0 + 4 * q4 + i;
    if (gr < R && kc < Kp) e[i] = ss.at(gr, kc / 32);
  }
  {
    const int l8 = tid % 8;
    const int64_t gq = r0 + 16 * l8;  // the load's 16 R bytes
    uint4 v[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = h * 32 + tid / 8;
      const int64_t gk = k0 + k;
      v[h] = make_uint4(0, 0, 0, 0);
      if (gk < K) {
        const uint8_t* src = codes + gk * ld + gq;
        if (gq + 16 <= R) {
          v[h] = *reinterpret_cast<const uint4*>(src);
        } else {
          uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
          for (int i = 0; i < 16; ++i)
            if (gq + i < R) w[i / 4] |= static_cast<uint32_t>(src[i]) << (8 * (i % 4));
          v[h] = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = h * 32 + tid / 8;
      *reinterpret_cast<uint4*>(&t[k][4 * (l8 ^ ((k / 8) % 8))]) = v[h];
    }
  }
  __syncthreads();
  if (kc >= Kp) return;
  // word j: the codes (k0 + 8c + j, rows 4 q4 .. + 3), one byte a row; chunk q4 / 4 of row 8c + j
  // sits at (q4 / 4) ^ c
  const int col = 4 * ((q4 / 4) ^ c) + q4 % 4;
  uint32_t w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) w[j] = t[8 * c + j][col];
  // 4 x 4 byte transposes: row i's codes k0 + 8c + 4h .. + 3 as one word (byte n = value 4h + n)
  uint32_t rows[4][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t* a = w + 4 * h;
    const uint32_t t0 = __byte_perm(a[0], a[1], 0x5140), t1 = __byte_perm(a[0], a[1], 0x7362);
    const uint32_t t2 = __byte_perm(a[2], a[3], 0x5140), t3 = __byte_perm(a[2], a[3], 0x7362);
    rows[0][h] = __byte_perm(t0, t2, 0x5410), rows[1][h] = __byte_perm(t0, t2, 0x7632);
    rows[2][h] = __byte_perm(t1, t3, 0x5410), rows[3][h] = __byte_perm(t1, t3, 0x7632);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t gr = r0 + 4 * q4 + i;
    if (gr >= R) break;
    const uint32_t cw[4] = {rows[i][0], rows[i][1], 0, 0};
    check_scale(e[i], cw, ss.min_e, ss.small);
    uint32_t out[4];
    dequant_words<kE4M3, 2>(rows[i], e8m0_factor(e[i]), kc, K, out);
    *reinterpret_cast<uint4*>(dst + (gr * Kp + kc) / 2) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

struct KMajor {
  const uint8_t* codes;   // [R, K] K-major: the operand's own, repack()'s copy, or null (not made yet)
  int64_t ld;             // bytes
  const uint8_t* scales;  // designs A and B: gathered, swizzled rowwise, [round_up(R, 128), 4 * ceil(K / 128)]
  const uint8_t* cols;    // a columnwise operand's own codes [K, R] when design C reads them directly, else null
  int64_t cols_ld;
};

// How the passes index op(X)'s own scales (the GEMM's operands have compact or swizzled maps, one
// batch: gemm.cpp's view_of).
OpScaleIndex scale_index(const GemmOperandView& v) {
  if (v.map.mode != MapMode::kCompact && v.map.mode != MapMode::kSwizzled)
    throw Error(kOp, "a", "internal: a GEMM operand's scales must be compact or swizzled");
  return op_scale_index(v.map, v.contract_cols);
}

// What designs A and B read besides design C's copies, launched per call (gated: at most four jobs
// in one gated_prep launch, returning at once while the design flag is clear; the grid one block
// per SM at most for each job, so that the launch that returns costs little) or at once (ungated).
struct PrepBatch {
  PrepJobs jobs{};
  int64_t units = 0;  // the most work units of a job
  void add(const PrepJob& j, int64_t n) { jobs.job[jobs.n++] = j, units = std::max(units, n); }
  void launch(const uint32_t* run_if, cudaStream_t s) const {
    if (jobs.n == 0) return;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(units, device_sms())), static_cast<unsigned>(jobs.n));
    gated_prep<<<grid, 256, 0, s>>>(jobs, run_if);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
};

// op(X)'s swizzled scales for designs A, B and D (scratch): into `batch` when given (design B's,
// per call), else launched now; zero: as gather_scales'.
const uint8_t* gather(const GemmOperandView& v, int64_t R, int64_t K, cudaStream_t s,
                      std::unique_ptr<StreamScratch>& scales, PrepBatch* batch, uint32_t* zero = nullptr) {
  const int64_t kb = (K + 31) / 32, rows_pad = (R + 127) / 128 * 128, cols_pad = (kb + 3) / 4 * 4;
  scales = std::make_unique<StreamScratch>(rows_pad * cols_pad, s);
  const OpScaleIndex index = scale_index(v);
  // 16-byte loads: a compact source whose contiguous direction's stride and base are 16-byte multiples
  const int64_t line = v.contract_cols ? index.sr : index.skb;
  const bool vec16 = !index.swizzled && line % 16 == 0 && reinterpret_cast<uintptr_t>(v.scales) % 16 == 0 &&
                     (v.contract_cols ? index.skb == 1 : index.sr == 1);
  const GatherArgs a{static_cast<const uint8_t*>(v.scales), index, v.contract_cols, vec16, scales->ptr,
                     R, kb, rows_pad, cols_pad};
  if (batch != nullptr) {
    batch->add(PrepJob{true, a, RepackArgs{}}, a.groups());
  } else {
    gather_scales<<<static_cast<unsigned>(std::min<int64_t>(a.groups(), kGatherBlocks)), kGatherThreads, 0, s>>>(a, zero);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
  return scales->ptr;
}

// How the kernels read op(X): its own codes when they are K-major with rows TMA can take; a
// columnwise operand with aligned rows: design C converts its codes directly (dequant_bf16_trans),
// and only designs A and B need a K-major copy (codes null until repack()); rows TMA cannot take:
// every design reads repack()'s copy (codes null, cols null).
KMajor kmajor(const GemmOperandView& v, int64_t R) {
  KMajor out{static_cast<const uint8_t*>(v.data), v.ld, nullptr, nullptr, 0};
  const bool aligned = reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && v.ld % 16 == 0;
  if (v.contract_cols && aligned) return out;
  if (!v.contract_cols && aligned && (R + 127) / 128 <= 65535)  // dequant_bf16_trans's grid
    out.cols = static_cast<const uint8_t*>(v.data), out.cols_ld = v.ld;
  out.codes = nullptr;
  return out;
}

// op(X)'s K-major copy [R, round_up(K, 16)] into scratch (x.codes): into `batch` when given
// (design B's, per call), else launched now.
void repack(const GemmOperandView& v, int64_t R, int64_t K, KMajor& x, cudaStream_t s,
            std::unique_ptr<StreamScratch>& codes, PrepBatch* batch) {
  const int64_t Kp = (K + 15) / 16 * 16;
  codes = std::make_unique<StreamScratch>(R * Kp, s);
  x.codes = codes->ptr, x.ld = Kp;
  const RepackArgs a{static_cast<const uint8_t*>(v.data), v.ld, !v.contract_cols, codes->ptr, R, K, Kp};
  if (batch != nullptr) {
    batch->add(PrepJob{false, GatherArgs{}, a}, a.tiles());
  } else {
    repack_kmajor<<<static_cast<unsigned>(std::min(a.tiles(), kRepackBlocks)), dim3(32, 8), 0, s>>>(a);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
}

// What designs A and B read of op(X) besides what design C made: its gathered scales and, where
// its own codes are not K-major, their repacked copy (batch: as gather's).
void for_design_b(const GemmOperandView& v, int64_t R, int64_t K, KMajor& x, cudaStream_t s,
                  std::unique_ptr<StreamScratch>& scales, std::unique_ptr<StreamScratch>& codes, PrepBatch* batch) {
  if (x.scales == nullptr) x.scales = gather(v, R, K, s, scales, batch);  // (design D gathered A's)
  if (x.codes == nullptr) repack(v, R, K, x, s, codes, batch);
}

// Design B: [128 rows][128 codes] boxes, 128-byte swizzle; design A: [rows][64 codes], 64-byte swizzle.
CUtensorMap operand_map(const KMajor& x, int64_t R, int64_t K, bool design_a, int rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(R)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(x.ld)};
  const cuuint32_t box[2] = {design_a ? 64u : 128u, static_cast<cuuint32_t>(rows)};
  return make_tma_desc(x.codes, DType::kUInt8, 2, dims, strides, box,
                       design_a ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B);
}

// How designs C's and D's kernels read op(A)'s rows by TMA, so that a launch can take rows
// [row0, row1) of it: 2-D, inner dimension first; rows along dims[1] (K-major: base + row · ld
// bytes) or, for a columnwise A's own codes [K, M] (cols), along dims[0] (base + row bytes).
struct RowsMap {
  const uint8_t* base;
  int64_t ld;  // bytes between consecutive K (cols) or rows (K-major)
  int64_t K;
  DType dtype;
  bool cols;
  cuuint32_t box_k, box_rows;
  CUtensorMapSwizzle swizzle;
  CUtensorMap at(int64_t row0, int64_t row1) const {
    const int64_t esz = dtype == DType::kBFloat16 ? 2 : 1, R = row1 - row0;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols ? R : K), static_cast<cuuint64_t>(cols ? K : R)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld)};
    const cuuint32_t box[2] = {cols ? box_rows : box_k, cols ? box_k : box_rows};
    return make_tma_desc(base + (cols ? row0 * esz : row0 * ld), dtype, 2, dims, strides, box, swizzle);
  }
};

template <ptx::MmaDtype kFmt>
void launch_b(const CUtensorMap& ta, const CUtensorMap& tb, const mxgemm::Params& p, cudaStream_t s) {
  using K = mxgemm::Kernel;
  const void* kernel = reinterpret_cast<const void*>(&mxgemm::sm90_mxfp8_gemm_kernel<K, kFmt>);
  const KernelFit fit = kernel_fit(kernel, K::C::kThreads, K::kSmemBytes, K::kSmemBytes);
  const int grid = static_cast<int>(heuristics::persistent_grid(fit.resident(), p.num_tiles));
  mxgemm::sm90_mxfp8_gemm_kernel<K, kFmt><<<grid, K::C::kThreads, K::kSmemBytes, s>>>(ta, tb, p);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

// Design C: op(X)'s bf16 copy [R, round_up(K, 16)] into scratch `keep` (the dequantizing pass, with
// the scale check against min_e: 0, none), reading the operand's own scales.
void dequant_copy(const GemmOperandView& v, const KMajor& x, int64_t R, int64_t K, bool e4m3, uint32_t min_e,
                  uint32_t* small, cudaStream_t s, std::unique_ptr<StreamScratch>& keep) {
  const int64_t Kp = (K + 15) / 16 * 16, n = R * (Kp / 16);
  keep = std::make_unique<StreamScratch>(R * Kp * 2, s);
  uint32_t* dst = reinterpret_cast<uint32_t*>(keep->ptr);
  const ScaleSrc ss{v.scales, scale_index(v), min_e, small};
  if (x.cols != nullptr) {
    const dim3 grid(static_cast<unsigned>((Kp + 63) / 64), static_cast<unsigned>((R + 127) / 128));
    if (e4m3)
      dequant_bf16_trans<true><<<grid, 256, 0, s>>>(x.cols, x.cols_ld, ss, dst, R, K, Kp);
    else
      dequant_bf16_trans<false><<<grid, 256, 0, s>>>(x.cols, x.cols_ld, ss, dst, R, K, Kp);
  } else {
    const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
    if (e4m3)
      dequant_bf16<true><<<blocks, 256, 0, s>>>(x.codes, x.ld, ss, dst, R, K, Kp);
    else
      dequant_bf16<false><<<blocks, 256, 0, s>>>(x.codes, x.ld, ss, dst, R, K, Kp);
  }
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

// A bf16 copy [R, K] with row stride ld elements as designs C and D read it: box [rows][64 bf16],
// 128-byte swizzle.
RowsMap bf16_rows(const void* x16, int64_t ld, int64_t K, int rows) {
  return RowsMap{static_cast<const uint8_t*>(x16), ld * 2, K, DType::kBFloat16, false, 64u,
                 static_cast<cuuint32_t>(rows), CU_TENSOR_MAP_SWIZZLE_128B};
}

// The same and its TMA map, box [rows][64 bf16], 128-byte swizzle.
CUtensorMap bf16_copy(const GemmOperandView& v, const KMajor& x, int64_t R, int64_t K, bool e4m3, uint32_t min_e,
                      uint32_t* small, int rows, cudaStream_t s, std::unique_ptr<StreamScratch>& keep) {
  dequant_copy(v, x, R, K, e4m3, min_e, small, s, keep);
  return bf16_rows(keep->ptr, (K + 15) / 16 * 16, K, rows).at(0, R);
}

// Design C's split-K reduction: D = alpha · (partial[0] + ... + partial[k_splits − 1]) (+ D for
// fp32 with accumulate), in that order (deterministic), rounded as store_accumulators rounds. Returns
// at once when the design flag picked design B (which wrote D itself).
__global__ void __launch_bounds__(256) reduce_splits(const mxgemm::Params p) {
  if (mxgemm::other_design(p)) return;
  const int64_t mn = int64_t{p.M} * p.N;
  for (int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x; i < mn; i += int64_t{gridDim.x} * 256) {
    float v = p.partial[i];
    for (int k = 1; k < p.k_splits; ++k) v += p.partial[k * mn + i];
    v *= p.alpha;
    const int64_t o = i / p.N * p.ld_out + i % p.N;
    if (p.out_f32) {
      float* d = static_cast<float*>(p.out) + o;
      *d = p.accumulate ? *d + v : v;
    } else {
      static_cast<uint16_t*>(p.out)[o] = bf16_out(v);
    }
  }
}

// Designs C's and D's K split, decided per call: K in `splits` parts when that fills the SMs better
// (heuristics::gemm_k_splits; MXMLA_GEMM_SPLITS=1..4 in the environment forces it, for tests), and
// then only for the rows past whole_rows: the m-tile rows that the complete waves hold run whole in
// a launch of their own (heuristics::gemm_whole_rows; no partial sums, no reduction for them).
struct SplitPlan {
  int splits;
  int64_t whole_rows;  // rows [0, whole_rows) unsplit (a multiple of 128; 0: one launch)
};
SplitPlan split_plan(const mxgemm::Params& p, int64_t resident) {
  const int64_t tiles = int64_t{p.m_tiles} * p.n_tiles;
  const int64_t whole_mt = heuristics::gemm_whole_rows(p.m_tiles, p.n_tiles, resident);
  const int forced = static_cast<int>(heuristics::env_forced("MXMLA_GEMM_SPLITS", 4));
  int splits = forced != 0 ? std::min(forced, p.kblocks)
                           : heuristics::gemm_k_splits(tiles, whole_mt * p.n_tiles, p.kblocks, int64_t{p.M} * p.N,
                                                       resident);
  const int per = (p.kblocks + splits - 1) / splits;
  splits = (p.kblocks + per - 1) / per;  // no empty part
  if (splits <= 1 || whole_mt >= p.m_tiles) return {1, 0};
  return {splits, whole_mt * mxgemm_c::Cfg::kBM};
}
// Sets a launch's k_splits, kb_per_split, num_tiles (p.m_tiles · p.n_tiles output tiles times the
// split) and partial: the fp32 partials in stream-ordered scratch `part` (freed on the stream after
// the reduction).
void split_k(mxgemm::Params& p, int splits, cudaStream_t s, std::unique_ptr<StreamScratch>& part) {
  const int64_t tiles = int64_t{p.m_tiles} * p.n_tiles;
  p.k_splits = splits;
  p.kb_per_split = (p.kblocks + p.k_splits - 1) / p.k_splits;
  p.k_splits = (p.kblocks + p.kb_per_split - 1) / p.kb_per_split;  // no empty part
  if (tiles * p.k_splits > 0x7FFFFFFF) throw Error(kOp, "out", "has too many 128 x 256 output tiles");
  p.num_tiles = static_cast<int>(tiles * p.k_splits);
  if (p.k_splits > 1) {
    part = std::make_unique<StreamScratch>(int64_t{p.k_splits} * p.M * p.N * 4, s);
    p.partial = reinterpret_cast<float*>(part->ptr);
  }
}
// ... and the reduction of the parts into D (none unsplit).
void reduce_parts(const mxgemm::Params& p, cudaStream_t s) {
  if (p.k_splits <= 1) return;
  const int64_t blocks = std::min<int64_t>(heuristics::elementwise_grid(int64_t{p.M} * p.N, 256), 4096);
  reduce_splits<<<static_cast<unsigned>(blocks), 256, 0, s>>>(p);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

// Designs C's and D's bf16 output by TMA stores where it can (sets p.tma_out): [64 rows][64 columns]
// boxes, 128-byte swizzle.
CUtensorMap output_map(mxgemm::Params& p) {
  // TMA stores whole 16-byte chunks of a row: a row whose end (N columns) falls inside a chunk would
  // get the chunk's last columns written past N, i.e. into a strided view's gap (found by the GPU
  // fuzzer: zeros between N and the row stride). So N · 2 bytes must be a multiple of 16 too.
  p.tma_out = !p.out_f32 && !p.accumulate && reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && p.ld_out * 2 % 16 == 0 &&
              p.N * 2 % 16 == 0;
  CUtensorMap to{};
  if (p.tma_out) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.N), static_cast<cuuint64_t>(p.M)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.ld_out * 2)};
    const cuuint32_t box[2] = {64u, 64u};
    to = make_tma_desc(p.out, DType::kBFloat16, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  }
  return to;
}

// Designs C's and D's launches over op(A)'s rows as split_plan says: one launch, or the whole rows
// unsplit and then the other rows with K split; each launch with its own view of A (a.at), of A's
// gathered scales (design D), of D and its reduction. launch(ta, to, q, grid) launches the kernel.
template <typename Launch>
void launch_rows(const RowsMap& a, const mxgemm::Params& p, int64_t resident, cudaStream_t s, Launch&& launch) {
  const SplitPlan plan = split_plan(p, resident);
  const auto rows = [&](int64_t row0, int64_t row1, int splits) {
    mxgemm::Params q = p;
    q.M = static_cast<int>(row1 - row0), q.m_tiles = static_cast<int>((row1 - row0 + 127) / 128);
    q.out = static_cast<uint8_t*>(p.out) + row0 * p.ld_out * (p.out_f32 ? 4 : 2);
    if (p.sa != nullptr) q.sa = p.sa + row0 / 128 * p.tiles_x * 512;  // whole 128-row scale tiles
    std::unique_ptr<StreamScratch> part;
    split_k(q, splits, s, part);
    const CUtensorMap to = output_map(q);
    launch(a.at(row0, row1), to, q, static_cast<int>(heuristics::persistent_grid(resident, q.num_tiles)));
    MXMLA_CUDA_CHECK(cudaGetLastError());
    reduce_parts(q, s);
  };
  if (plan.whole_rows > 0) rows(0, plan.whole_rows, 1);
  rows(plan.whole_rows, p.M, plan.splits);
}

// Design C's GEMM (K split as split_plan says) on op(A)'s bf16 copy (a). Unsplit, its epilogue stores
// by TMA (box [64 rows][64 columns], 128-byte swizzle) when D is bf16 without accumulation and its
// rows can be described (data and row stride multiples of 16 bytes); else from the registers.
void launch_c(const RowsMap& a, const CUtensorMap& tb, const mxgemm::Params& p, cudaStream_t s) {
  using K = mxgemm_c::Kernel;
  const void* kernel = reinterpret_cast<const void*>(&mxgemm_c::sm90_bf16_gemm_kernel<K>);
  const KernelFit fit = kernel_fit(kernel, K::C::kThreads, K::kSmemBytes, K::kSmemBytes);
  launch_rows(a, p, fit.resident(), s, [&](const CUtensorMap& ta, const CUtensorMap& to, const mxgemm::Params& q, int grid) {
    mxgemm_c::sm90_bf16_gemm_kernel<K><<<grid, K::C::kThreads, K::kSmemBytes, s>>>(ta, tb, to, q);
  });
}

// Design D's GEMM (sm90_mxfp8_gemm_rs.cuh; K split as design C's): a A's K-major codes, box
// [128 rows][64 codes] with the 64-byte swizzle, or (kColsA) a columnwise A's codes [K, M], box
// [64 of K][128 rows] with the 128-byte one; tb design C's bf16 copy of B, [256 rows][64], 128-byte.
template <bool kE4M3, bool kColsA>
void launch_d(const RowsMap& a, const CUtensorMap& tb, const mxgemm::Params& p, cudaStream_t s) {
  using K = mxgemm_d::Kernel;
  const void* kernel = reinterpret_cast<const void*>(&mxgemm_d::sm90_mxfp8_gemm_rs_kernel<K, kE4M3, kColsA>);
  const KernelFit fit = kernel_fit(kernel, K::C::kThreads, K::kSmemBytes, K::kSmemBytes);
  launch_rows(a, p, fit.resident(), s, [&](const CUtensorMap& ta, const CUtensorMap& to, const mxgemm::Params& q, int grid) {
    mxgemm_d::sm90_mxfp8_gemm_rs_kernel<K, kE4M3, kColsA><<<grid, K::C::kThreads, K::kSmemBytes, s>>>(ta, tb, to, q);
  });
}

template <bool kE4M3>
void launch_a(const CUtensorMap& ta, const CUtensorMap& tb, const mxgemm::Params& p, cudaStream_t s) {
  using K = mxgemm_a::Kernel;
  const void* kernel = reinterpret_cast<const void*>(&mxgemm_a::sm90_mxfp8_gemm_bf16_kernel<K, kE4M3>);
  const KernelFit fit = kernel_fit(kernel, K::C::kThreads, K::kSmemBytes, K::kSmemBytes);
  const int grid = static_cast<int>(heuristics::persistent_grid(fit.resident(), p.num_tiles));
  mxgemm_a::sm90_mxfp8_gemm_bf16_kernel<K, kE4M3><<<grid, K::C::kThreads, K::kSmemBytes, s>>>(ta, tb, p);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

// MXMLA_GEMM_DESIGN: 'A', 'B', 'C' or 'D' forces a design; anything else (or unset): chosen per call.
// Read at every call (a test can switch it).
char forced_design() {
  const char* e = std::getenv("MXMLA_GEMM_DESIGN");
  return (e != nullptr && (e[0] == 'A' || e[0] == 'B' || e[0] == 'C' || e[0] == 'D')) ? e[0] : '\0';
}


}  // namespace

void mxfp8_gemm_cuda(const GemmProblem& pr, Stream stream, const GemmPrepared* prep) {
  if (!pr.fp8) throw Error(kOp, "a", "bf16 operands: the SM90 kernel takes MXFP8 operands");
  if (pr.M == 0 || pr.N == 0) return;
  check_cuda_gemm_extents(kOp, pr.M, pr.N, pr.K);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (pr.K == 0) {  // D = 0 (+ D)
    if (!pr.accumulate) {
      const int64_t esz = pr.out_t == DType::kFloat32 ? 4 : 2;
      MXMLA_CUDA_CHECK(cudaMemset2DAsync(pr.out, pr.ld_out * esz, 0, pr.N * esz, pr.M, s));
    }
    return;
  }
  const bool e4m3 = pr.fmt == Fp8Format::kE4M3;
  const char forced = forced_design();
  std::unique_ptr<StreamScratch> flag;  // set by the scale check: design B does the work
  uint32_t* small = prep != nullptr ? prep->flag : nullptr;
  const bool own_flag = small == nullptr;  // cleared below: by design D's gather, else a memset
  if (own_flag) {
    flag = std::make_unique<StreamScratch>(4, s);
    small = reinterpret_cast<uint32_t*>(flag->ptr);
  }
  const bool a_ready = prep != nullptr && prep->a16 != nullptr;
  std::unique_ptr<StreamScratch> ca, sa, cb, sb;
  KMajor a = kmajor(pr.a, pr.M), b = kmajor(pr.b, pr.N);
  // rows TMA cannot take: every design reads the K-major copy
  if (a.codes == nullptr && a.cols == nullptr) repack(pr.a, pr.M, pr.K, a, s, ca, nullptr);
  if (b.codes == nullptr && b.cols == nullptr) repack(pr.b, pr.N, pr.K, b, s, cb, nullptr);
  mxgemm::Params p{};
  p.M = static_cast<int>(pr.M), p.N = static_cast<int>(pr.N), p.K = static_cast<int>(pr.K);
  p.tiles_x = static_cast<int>((pr.K + 127) / 128);
  p.out = pr.out, p.ld_out = pr.ld_out;
  p.out_f32 = pr.out_t == DType::kFloat32, p.accumulate = pr.accumulate;
  p.alpha = static_cast<float>(pr.alpha);
  p.m_tiles = static_cast<int>((pr.M + 127) / 128);
  p.design_flag = forced != 0 ? nullptr : small;
  // design D where TMA can read A's codes (K-major, or a columnwise copy's) and N is small
  // (heuristics::kGemmDesignDMaxN; K at least kGemmDesignDMinK), unless D is to be accumulated into (its output
  // may be overwritten by design B's, after its own check) or a prepared call (the Linear's: A's bf16
  // copy exists) -- or when forced
  const bool design_d = forced == 'D' || (forced == 0 && prep == nullptr && (a.codes != nullptr || a.cols != nullptr) &&
                                          !pr.accumulate && pr.N <= heuristics::kGemmDesignDMaxN &&
                                          pr.K >= heuristics::kGemmDesignDMinK);
  bool a_codes_done = false;
  if (own_flag && !design_d) MXMLA_CUDA_CHECK(cudaMemsetAsync(small, 0, 4, s));
  if (design_d) {  // design D: 128 x 256 tiles, 64 of K per stage; runs unless the flag is set
    // (forced on a prepared call: A's codes first, which the caller then always writes)
    if (prep != nullptr && prep->a_codes) prep->a_codes(), a_codes_done = true;
    // A's gathered scales, the call's first launch that knows the flag: it clears it
    a.scales = gather(pr.a, pr.M, pr.K, s, sa, nullptr, own_flag ? small : nullptr);
    const uint32_t min_e = forced == 0 ? min_exact_e(e4m3) : 0u;  // B's pass checks B, the kernel A
    mxgemm::Params pd = p;
    pd.kblocks = static_cast<int>((pr.K + 63) / 64);
    pd.n_tiles = static_cast<int>((pr.N + 255) / 256);  // num_tiles: launch_d (times the K split)
    pd.run_on_flag = false;
    pd.sa = a.scales;
    pd.check_flag = forced == 0 ? small : nullptr;
    std::unique_ptr<StreamScratch> b16;  // freed on the stream after the kernel
    const CUtensorMap tb = bf16_copy(pr.b, b, pr.N, pr.K, e4m3, min_e, small, 256, s, b16);
    if (a.codes != nullptr) {  // A's K-major codes: box [128 rows][64 codes], 64-byte swizzle (operand_map's)
      const RowsMap ta{a.codes, a.ld, pr.K, DType::kUInt8, false, 64u, 128u, CU_TENSOR_MAP_SWIZZLE_64B};
      if (e4m3) launch_d<true, false>(ta, tb, pd, s);
      else launch_d<false, false>(ta, tb, pd, s);
    } else {  // a columnwise A's own codes [K, M]: box [64 of K][128 rows], 128-byte swizzle
      const RowsMap ta{a.cols, a.cols_ld, pr.K, DType::kUInt8, true, 64u, 128u, CU_TENSOR_MAP_SWIZZLE_128B};
      if (e4m3) launch_d<true, true>(ta, tb, pd, s);
      else launch_d<false, true>(ta, tb, pd, s);
    }
  } else if (forced == 0 || forced == 'C') {  // design C: 128 x 256 tiles, 64 of K per stage; runs unless the flag is set
    // per call the dequantizing passes run the scale check (forced: none)
    const uint32_t min_e = forced == 0 ? min_exact_e(e4m3) : 0u;
    mxgemm::Params pc = p;
    pc.kblocks = static_cast<int>((pr.K + 63) / 64);
    pc.n_tiles = static_cast<int>((pr.N + 255) / 256);  // num_tiles: launch_c (times the K split)
    pc.run_on_flag = false;
    std::unique_ptr<StreamScratch> a16, b16;  // freed on the stream after the kernels
    if (!a_ready) dequant_copy(pr.a, a, pr.M, pr.K, e4m3, min_e, small, s, a16);
    const RowsMap ta = a_ready ? bf16_rows(prep->a16, prep->a_ld, pr.K, 128)
                               : bf16_rows(a16->ptr, (pr.K + 15) / 16 * 16, pr.K, 128);
    const CUtensorMap tb = bf16_copy(pr.b, b, pr.N, pr.K, e4m3, min_e, small, 256, s, b16);
    launch_c(ta, tb, pc, s);
  }
  if (forced == 'C' || forced == 'D') return;
  if (prep != nullptr && prep->a_codes && !a_codes_done) prep->a_codes();  // A's codes (every check has run)
  // designs A and B: gathered scales and K-major codes; per call (design B behind the flag, set by
  // the check above) in one launch that returns at once unless the flag is set
  const uint32_t* run_if = forced == 0 ? small : nullptr;
  PrepBatch batch;
  for_design_b(pr.a, pr.M, pr.K, a, s, sa, ca, run_if != nullptr ? &batch : nullptr);
  for_design_b(pr.b, pr.N, pr.K, b, s, sb, cb, run_if != nullptr ? &batch : nullptr);
  batch.launch(run_if, s);
  p.sa = a.scales, p.sb = b.scales;
  if (forced == 'A') {  // design A: 128 x 256 tiles, 64 of K per stage
    mxgemm::Params pa = p;
    pa.kblocks = static_cast<int>((pr.K + 63) / 64);
    pa.n_tiles = static_cast<int>((pr.N + 255) / 256), pa.num_tiles = pa.m_tiles * pa.n_tiles;
    pa.run_on_flag = false;
    const CUtensorMap ta = operand_map(a, pr.M, pr.K, true, 128), tb = operand_map(b, pr.N, pr.K, true, 256);
    if (e4m3) launch_a<true>(ta, tb, pa, s);
    else launch_a<false>(ta, tb, pa, s);
    return;
  }
  // design B: 128 x 128 tiles, 128 of K per stage; runs iff the flag is set (or forced)
  mxgemm::Params pb = p;
  pb.kblocks = static_cast<int>((pr.K + 127) / 128);
  pb.n_tiles = static_cast<int>((pr.N + 127) / 128), pb.num_tiles = pb.m_tiles * pb.n_tiles;
  pb.run_on_flag = true;
  const CUtensorMap ta = operand_map(a, pr.M, pr.K, false, 128), tb = operand_map(b, pr.N, pr.K, false, 128);
  if (e4m3) launch_b<ptx::MmaDtype::kE4M3>(ta, tb, pb, s);
  else launch_b<ptx::MmaDtype::kE5M2>(ta, tb, pb, s);
}

void mxfp8_bf16_operands(const GemmProblem& pr, cudaStream_t s, Mxfp8Bf16Operands& o) {
  check_cuda_gemm_extents(kOp, pr.M, pr.N, pr.K);
  const bool e4m3 = pr.fmt == Fp8Format::kE4M3;
  o.keep[0] = std::make_unique<StreamScratch>(4, s);
  uint32_t* flag = reinterpret_cast<uint32_t*>(o.keep[0]->ptr);
  MXMLA_CUDA_CHECK(cudaMemsetAsync(flag, 0, 4, s));
  const uint32_t min_e = min_exact_e(e4m3);
  KMajor a = kmajor(pr.a, pr.M), b = kmajor(pr.b, pr.N);
  if (a.codes == nullptr && a.cols == nullptr) repack(pr.a, pr.M, pr.K, a, s, o.keep[3], nullptr);
  if (b.codes == nullptr && b.cols == nullptr) repack(pr.b, pr.N, pr.K, b, s, o.keep[4], nullptr);
  // the copies, with the scale check (the consumer makes its own tensor maps)
  dequant_copy(pr.a, a, pr.M, pr.K, e4m3, min_e, flag, s, o.keep[5]);
  dequant_copy(pr.b, b, pr.N, pr.K, e4m3, min_e, flag, s, o.keep[6]);
  o.a16 = reinterpret_cast<const uint16_t*>(o.keep[5]->ptr), o.b16 = reinterpret_cast<const uint16_t*>(o.keep[6]->ptr);
  o.ld = (pr.K + 15) / 16 * 16;
  // what the exact path reads, made only when the check set the flag (one launch)
  PrepBatch batch;
  for_design_b(pr.a, pr.M, pr.K, a, s, o.keep[1], o.keep[3], &batch);
  for_design_b(pr.b, pr.N, pr.K, b, s, o.keep[2], o.keep[4], &batch);
  batch.launch(flag, s);
  const int64_t tiles_x = (pr.K + 127) / 128;
  o.exact.flag = flag;
  o.exact.a = {a.codes, a.ld, a.scales, tiles_x};
  o.exact.b = {b.codes, b.ld, b.scales, tiles_x};
  o.exact.K = static_cast<int>(pr.K);
  o.exact.e4m3 = e4m3;
}

// ---------------------------------------------------------------- the MXFP8 Linear
// One quantize pass writes the GEMM's bf16 copies of x (forward: its rowwise copy, with x's
// columnwise codes for the backward) or of dy (both directions, no codes), exactly the values that
// design C's dequantizing passes would make from the codes, and flags a block that bf16 cannot hold
// exactly (a flag per direction); a second quantize launch per direction, which returns at once
// unless that direction's flag is set, writes the codes design B then reads (with MXMLA_GEMM_DESIGN=A, B or D it always writes them). So the common
// case moves 2 bytes a value for each copy instead of 1 for the codes plus 3 for their dequantizing
// pass, and a call gives the bits of quantize + gemm in every case.
namespace {
// The fallback codes and compact scales of one direction of x [T, C] in `buf` (codes first).
GemmOperandView fallback_view(uint8_t* buf, int64_t T, int64_t C, bool rowwise) {
  GemmOperandView v;
  v.data = buf, v.rows = T, v.cols = C, v.ld = C, v.contract_cols = rowwise;
  v.scales = buf + T * C;
  v.map = rowwise ? make_row_map(MapMode::kCompact, 1, T, C) : make_col_map(MapMode::kCompact, 1, T, C);
  return v;
}
int64_t fallback_bytes(int64_t T, int64_t C, bool rowwise) {
  return T * C + (rowwise ? T * (C / 32) : ceil_div(T, 32) * C);
}
bool codes_always() {
  const char d = forced_design();
  return d == 'A' || d == 'B' || d == 'D';
}
}  // namespace

void linear_forward_cuda(const QuantizeProblem& q, GemmProblem g, Stream stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t T = q.rows, K = q.cols;
  // x's rowwise bf16 copy [T, K]; where the design flag is set (x's check or W's), x's fallback codes
  // and compact scales overwrite it once design C's kernel has returned (design B reads them)
  StreamScratch flags(8, s), copy(std::max(T * K * 2, fallback_bytes(T, K, true)), s);  // freed after the GEMM
  uint32_t* inexact = reinterpret_cast<uint32_t*>(flags.ptr);  // [0]: the rowwise copy's check
  MXMLA_CUDA_CHECK(cudaMemsetAsync(inexact, 0, 8, s));
  g.a = fallback_view(copy.ptr, T, K, true);
  QuantizeProblem qr = q;  // the rowwise codes, for design B
  qr.col_codes = nullptr, qr.col_scales = nullptr;
  qr.row_codes = copy.ptr, qr.row_scales = copy.ptr + T * K;
  qr.row_map = g.a.map;
  qr.run_if = codes_always() ? nullptr : inexact;
  GemmPrepared prep;
  prep.a16 = reinterpret_cast<const uint16_t*>(copy.ptr), prep.a_ld = K, prep.flag = inexact;
  if (T > 0) {
    QuantizeProblem qc = q;  // x's columnwise codes (x_saved) and its rowwise bf16 copy
    qc.row_codes = nullptr, qc.row_scales = nullptr;
    qc.row_copy = reinterpret_cast<uint16_t*>(copy.ptr), qc.row_copy_ld = K, qc.inexact = inexact;
    quantize_cuda(qc, stream);
    prep.a_codes = [&qr, stream] { quantize_cuda(qr, stream); };
  }
  mxfp8_gemm_cuda(g, stream, &prep);
}

void linear_backward_cuda(const QuantizeProblem& q, const GemmProblem* dgrad, GemmProblem wgrad, Stream stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t T = q.rows, N = q.cols, Tp = round_up(T, 32);
  const bool dg = dgrad != nullptr;
  StreamScratch flags(8, s);
  // dy's copies: rowwise [T, N] (dgrad), columnwise transposed [N, Tp] (wgrad); where a GEMM's design
  // flag is set (its copy's check or its B operand's), that direction's fallback codes and compact
  // scales overwrite its copy once design C's kernel has returned (design B reads them). The rowwise
  // copy is freed after dgrad, before wgrad's GEMM takes its own scratch.
  auto row_copy = std::make_unique<StreamScratch>(dg ? std::max(T * N * 2, fallback_bytes(T, N, true)) : 0, s);
  StreamScratch col_copy(std::max(N * Tp * 2, fallback_bytes(T, N, false)), s);
  // [0]: the rowwise copy's check, dgrad's design flag; [1]: the columnwise copy's, wgrad's
  uint32_t* inexact = reinterpret_cast<uint32_t*>(flags.ptr);
  MXMLA_CUDA_CHECK(cudaMemsetAsync(inexact, 0, 8, s));
  const GemmOperandView rv = fallback_view(row_copy->ptr, T, N, true), cv = fallback_view(col_copy.ptr, T, N, false);
  if (T > 0) {
    QuantizeProblem qc = q;
    qc.row_copy = dg ? reinterpret_cast<uint16_t*>(row_copy->ptr) : nullptr, qc.row_copy_ld = N;
    qc.col_copy = reinterpret_cast<uint16_t*>(col_copy.ptr), qc.col_copy_ld = Tp;
    qc.inexact = inexact;
    quantize_cuda(qc, stream);
  }
  const bool always = codes_always();
  if (dg) {
    GemmProblem g = *dgrad;
    g.a = rv;
    QuantizeProblem qr = q;  // the rowwise codes, for design B
    qr.row_codes = row_copy->ptr, qr.row_scales = const_cast<uint8_t*>(rv.scales), qr.row_map = rv.map;
    qr.run_if = always ? nullptr : inexact;
    GemmPrepared prep;
    prep.a16 = reinterpret_cast<const uint16_t*>(row_copy->ptr), prep.a_ld = N, prep.flag = inexact;
    if (T > 0) prep.a_codes = [&qr, stream] { quantize_cuda(qr, stream); };
    mxfp8_gemm_cuda(g, stream, &prep);
    row_copy.reset();  // (stream-ordered: after the dgrad kernels)
  }
  wgrad.a = cv;
  QuantizeProblem qr = q;  // the columnwise codes, for design B
  qr.col_codes = col_copy.ptr, qr.col_scales = const_cast<uint8_t*>(cv.scales), qr.col_map = cv.map;
  qr.run_if = always ? nullptr : inexact + 1;
  GemmPrepared prep;
  prep.a16 = reinterpret_cast<const uint16_t*>(col_copy.ptr), prep.a_ld = Tp, prep.flag = inexact + 1;
  if (T > 0) prep.a_codes = [&qr, stream] { quantize_cuda(qr, stream); };
  mxfp8_gemm_cuda(wgrad, stream, &prep);
}

void rope_linear_backward_cuda(const RopeQuantizeParams& r, const GemmProblem* dgrad, GemmProblem wgrad,
                               Stream stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t T = r.rope.S * r.rope.B, N = r.rope.H * r.rope.D, Tp = round_up(T, 32);
  const bool dg = dgrad != nullptr;
  RopeQuantizeParams k = r;
  k.fmt = Fp8Format::kE4M3;
  k.row_map = make_row_map(MapMode::kCompact, 1, T, N), k.col_map = make_col_map(MapMode::kCompact, 1, T, N);
  StreamScratch flags(8, s);
  // dy's copies: rowwise [T, N] (dgrad), columnwise transposed [N, Tp] (wgrad); when a direction's
  // check fails, its fallback codes and compact scales overwrite its copy (which no design then reads)
  StreamScratch row_copy(dg ? T * N * 2 : 0, s), col_copy(N * Tp * 2, s);
  uint32_t* inexact = reinterpret_cast<uint32_t*>(flags.ptr);  // [0]: rowwise / dgrad, [1]: columnwise / wgrad
  MXMLA_CUDA_CHECK(cudaMemsetAsync(inexact, 0, 8, s));
  const GemmOperandView rv = fallback_view(row_copy.ptr, T, N, true), cv = fallback_view(col_copy.ptr, T, N, false);
  RopeQuantizeParams kc = k;
  kc.row_copy = dg ? reinterpret_cast<uint16_t*>(row_copy.ptr) : nullptr, kc.row_copy_ld = N;
  kc.col_copy = reinterpret_cast<uint16_t*>(col_copy.ptr), kc.col_copy_ld = Tp;
  kc.inexact = inexact;
  if (!rope_quantize_copies_cuda(kc, stream)) {  // not the fast path: the codes, and the GEMMs' own passes
    StreamScratch codes(fallback_bytes(T, N, true) + fallback_bytes(T, N, false), s);
    const GemmOperandView rc = fallback_view(codes.ptr, T, N, true);
    const GemmOperandView cc = fallback_view(codes.ptr + fallback_bytes(T, N, true), T, N, false);
    k.row_codes = const_cast<uint8_t*>(static_cast<const uint8_t*>(rc.data)), k.row_scales = const_cast<uint8_t*>(rc.scales);
    k.col_codes = const_cast<uint8_t*>(static_cast<const uint8_t*>(cc.data)), k.col_scales = const_cast<uint8_t*>(cc.scales);
    rope_quantize_cuda(k, stream);
    if (dg) {
      GemmProblem g = *dgrad;
      g.a = rc;
      mxfp8_gemm_cuda(g, stream);
    }
    wgrad.a = cc;
    mxfp8_gemm_cuda(wgrad, stream);
    return;
  }
  // each direction's codes for design B, launched by its GEMM once every check has run (its copy's and
  // its B operand's) and after design C's kernel (the codes overwrite the copy)
  const bool always = codes_always();
  if (dg) {
    GemmProblem g = *dgrad;
    g.a = rv;
    RopeQuantizeParams kr = k;
    kr.row_codes = row_copy.ptr, kr.row_scales = const_cast<uint8_t*>(rv.scales);
    kr.run_if = always ? nullptr : inexact;
    GemmPrepared prep;
    prep.a16 = reinterpret_cast<const uint16_t*>(row_copy.ptr), prep.a_ld = N, prep.flag = inexact;
    prep.a_codes = [&kr, stream] { rope_quantize_cuda(kr, stream); };
    mxfp8_gemm_cuda(g, stream, &prep);
  }
  wgrad.a = cv;
  RopeQuantizeParams kk = k;
  kk.col_codes = col_copy.ptr, kk.col_scales = const_cast<uint8_t*>(cv.scales);
  kk.run_if = always ? nullptr : inexact + 1;
  GemmPrepared prep;
  prep.a16 = reinterpret_cast<const uint16_t*>(col_copy.ptr), prep.a_ld = Tp, prep.flag = inexact + 1;
  prep.a_codes = [&kk, stream] { rope_quantize_cuda(kk, stream); };
  mxfp8_gemm_cuda(wgrad, stream, &prep);
}

}  // namespace mxmla::detail
