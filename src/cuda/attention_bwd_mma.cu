// mxmla — the attention backward on tensor cores (include/mxmla/attention.h: attention_backward) for
// the head dims (d_qk, d_v) = (192, 128) (DeepSeek-V3 MLA), (128, 128) and (64, 64); every other
// head dim, and MXMLA_ATTN_BWD=simt, take the CUDA-core kernel (attention_bwd_simt.cu), whose
// inputs, outputs and math this kernel shares:
//
//   D_i   = Σ_d O_id · dO_row,id                (attention_bwd_prologue: the CUDA-core preprocess)
//   s_ij  = (Q_row,i · K_row,j) · scale,  P_ij = exp(s_ij − LSE_i),  dP_ij = dO_row,i · V_row,j
//   dS_ij = P_ij · (dP_ij − D_i) · scale;  P̂, dŜ = bf16(P), bf16(dS)   (0: invisible keys, padding)
//   dV_j = Σ_i P̂_ij · dO_col,i,  dK_j = Σ_i dŜ_ij · Q_col,i,  dQ_i = Σ_j dŜ_ij · K_col,j
//
// Three steps, on the caller's stream:
//
//   preprocess  (stage_reads: cuda/attention_stage.h) every read (q_s, q_g, k_s, k_g, v_s, do_s, do_g) that is
//          FP8, or bf16 without 16-byte aligned data and strides, is converted once to bf16 in
//          stream-ordered scratch: [B][heads][S][d] (thd [heads][total tokens][d]), valid tokens
//          only, one thread per 16 consecutive values of a token (bf16: copied; FP8: code · 2^(e−127)
//          rounded to nearest even, exact for values in bf16's normal range, through the copy's
//          scale geometry as elem() reads it: one scale per chunk for a rowwise copy, one per
//          column for a columnwise one; cuda/sm90/dequant_mxfp8_bf16.cuh). Reads with the same
//          values (q_once, k_once, do_once) share one copy; aligned bf16 reads are used in place.
//          The SM90 kernel converts the key-side FP8 reads (k_s, k_g, v_s) itself, once per CTA
//          with the same device code (cuda/attention_stage.cuh), where their codes allow 16-byte
//          loads: only the query-side reads are copied for it.
//   dK/dV, dQ  the main kernels read only those bf16 views: 16-byte cp.async copies into shared
//          memory (rows past a sequence's end zero-filled), software-pipelined so that each tile's
//          loads overlap the previous GEMM phase (below). The GEMMs are mma.sync m16n8k16 bf16 ->
//          fp32 with ldmatrix fragments (FA2 style), every shared tile row padded by 8 bf16 (16
//          bytes) so the eight rows of an 8x8 ldmatrix land in distinct banks. Both kernels 8 warps:
//
//   dK/dV  CTA = (64 keys j0.., kv head hk, sequence b). K_s [64][d_qk], V_s [64][d_v] stay in
//          shared memory; for every head h of the GQA group and every 64-row query tile from the
//          first that sees key j0 (causal), tile t:
//            phase 1  Sᵀ = K_s·Q_sᵀ, dPᵀ = V_s·dO_sᵀ [64 keys][64 rows]: warps 4 (keys) x 2 (rows),
//                     16 x 32; P̂ᵀ, dŜᵀ bf16 [64 keys][64 rows] -> shared
//                     (meanwhile Q_g, dO_g [64][d] of tile t land)
//            phase 2  dV += P̂ᵀ·dO_g, dK += dŜᵀ·Q_g: warp = 16 keys x half the columns, fp32 registers
//                     (meanwhile Q_s, dO_s [64][d], LSE, D [64] of tile t + 1 land)
//          then dK, dV -> bf16 (the dk / dv views).
//   dQ     CTA = (64 query rows i0.., head h, sequence b). Q_s [64][d_qk], dO_s [64][d_v], LSE, D
//          stay; for every 64-key tile up to the causal limit: phase 1 S, dP [64 rows][64 keys]
//          (warps 4 x 2, 16 x 32), dŜ -> shared [64][64] (meanwhile K_g [64][d_qk] lands); phase 2
//          dQ += dŜ·K_g (warp = 16 rows x d_qk / 2; meanwhile the next K_s, V_s land); then dQ -> bf16.
//
// One copy for both GEMMs (bf16 operands, FP8 ones with a single copy) is loaded once per tile and
// alternates between the two buffers of the operand from tile to tile (the next tile's lands while
// this one's phase 2 reads). Shared memory (d_qk 192, d_v 128): dK/dV 144.5 KB, dQ 118.5 KB, one CTA
// per SM. Nothing is accumulated across CTAs (no atomics): the result does not depend on scheduling
// (deterministic). Arch-neutral (mma.sync, cp.async sm_80+; FP8 decode and bf16x2 multiply sm_90+).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "common/attention_ops.h"
#include "cuda/attention_bwd_common.cuh"
#include "cuda/attention_stage.h"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/ptx/common.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mma_sync.cuh"
#include "cuda/sm90/dequant_mxfp8_bf16.cuh"
#include "cuda/sm90_attention_bwd.h"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {
namespace {

using namespace attn_bwd;  // Seq, seq_of, row_index, write_bf16, imin, imax, grid_dim, ...

constexpr const char* kOp = "mxmla.attention_backward";

// ---------------------------------------------------------------- configuration
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kTile = 64;  // query rows and keys per tile
constexpr int kPad = 8;    // bf16 elements of padding after every shared row
// Every GEMM of a tile: warps 4 (16-row blocks) x 2 (column halves); a score tile [64][64] gives a
// warp 16 x 32 (four 8-column MMA tiles).
constexpr int kWarpRows = 4, kWarpCols = 2;
static_assert(kWarpRows * kWarpCols == kWarps, "one warp per (row block, column half)");
static_assert(kWarpRows * 16 == kTile && kWarpCols * 32 == kTile, "score tile = 4 x 16 rows, 2 x 32 columns");

template <int kDqk_, int kDv_>
struct Cfg {
  static constexpr int kDqk = kDqk_, kDv = kDv_;
  // shared row strides (bf16 elements): Q / K rows, V / dO rows, score rows (P̂ᵀ, dŜᵀ, dŜ)
  static constexpr int kLdQk = kDqk + kPad, kLdV = kDv + kPad, kLdT = kTile + kPad;
  // 8-column MMA tiles of a warp's output half: dK / dQ (d_qk / 2 columns), dV (d_v / 2)
  static constexpr int kNtQk = kDqk / kWarpCols / 8, kNtV = kDv / kWarpCols / 8;
  static_assert(kDqk % 32 == 0 && kDv % 32 == 0, "a warp's column half is whole 16-column ldmatrix.x4 pairs");
  static_assert((kTile * (kDqk / 8)) % kThreads == 0 && (kTile * (kDv / 8)) % kThreads == 0,
                "the loader's 16-byte pieces of a tile divide among the threads");
  // 16-byte aligned rows (ldmatrix rows, 16-byte stores); a stride of 16 mod 128 bytes puts the
  // eight rows of an 8x8 ldmatrix in distinct bank groups
  static_assert(kLdQk * 2 % 128 == 16 && kLdV * 2 % 128 == 16 && kLdT * 2 % 128 == 16, "padded rows");
};

// Shared memory (bf16 bit patterns; every array a multiple of 16 bytes).
template <class C>
struct alignas(16) SmemKV {
  uint16_t ks[kTile][C::kLdQk], vs[kTile][C::kLdV];    // the CTA's keys
  uint16_t qs[kTile][C::kLdQk], qg[kTile][C::kLdQk];   // a query tile: Q for S, Q for dK
  uint16_t dos[kTile][C::kLdV], dog[kTile][C::kLdV];   // dO for dP, dO for dV
  uint16_t pt[kTile][C::kLdT], dst[kTile][C::kLdT];    // P̂ᵀ, dŜᵀ [key][row]
  float lse[kTile], d[kTile];
};
template <class C>
struct alignas(16) SmemQ {
  uint16_t qs[kTile][C::kLdQk], dos[kTile][C::kLdV];   // the CTA's query rows
  uint16_t ks[kTile][C::kLdQk], kg[kTile][C::kLdQk];   // a key tile: K for S, K for dQ
  uint16_t vs[kTile][C::kLdV];
  uint16_t ds[kTile][C::kLdT];                         // dŜ [row][key]
  float lse[kTile], d[kTile];
};

// The reads, as bits of Params::vec.
enum Read : uint32_t { kQs, kQg, kKs, kKg, kVs, kDOs, kDOg };

struct Params {
  AttentionBwdProblem p;  // its seven reads: bf16 views, data and strides 16-byte aligned (stage_reads)
  const float* D;         // [rows] (row_index)
  bool q_once, k_once, do_once;  // the gradient GEMM's copy holds the score GEMM's values: loaded once
};
static_assert(sizeof(Params) <= 4000, "kernel parameter space");

// ---------------------------------------------------------------- loading (bf16 global -> shared, cp.async)
// Tokens tok0 .. tok0 + 63 (packed) of sequence b, head h of a bf16 view whose data and strides
// are 16-byte aligned -> rows of dst [kTile][kD + kPad], 16 bytes a cp.async; rows n and later are
// zero-filled (src-size 0: nothing read). Consecutive threads take consecutive 16-byte pieces of a
// row. The caller commits the group.
template <int kD>
__device__ __forceinline__ void load_tile_async(uint16_t* dst, const AttnTensorView& v, int64_t b, int64_t h,
                                                int64_t tok0, int n) {
  constexpr int kPieces = kD / 8, kIters = kTile * kPieces / kThreads;
  static_assert(kD % 8 == 0 && kTile * kPieces % kThreads == 0, "a tile's 16-byte pieces divide among the threads");
  const uint16_t* src = static_cast<const uint16_t*>(v.data) + b * v.st_b + tok0 * v.st_s + h * v.st_h;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int x = static_cast<int>(threadIdx.x) + it * kThreads;
    const int row = x / kPieces, c = x % kPieces;
    const bool in = row < n;
    const void* from = in ? static_cast<const void*>(src + row * v.st_s + c * 8) : v.data;
    ptx::cp_async<16>(dst + row * (kD + kPad) + c * 8, from, in ? 16u : 0u);
  }
}

// LSE and D of rows i0 .. i0 + 63 of head h -> lse, d by cp.async (4 bytes each; zero past the
// sequence's end: those rows are masked). The caller commits the group.
__device__ __forceinline__ void load_rows_async(float* lse, float* d, const Params& prm, const Seq& s, int64_t b,
                                                int64_t h, int64_t i0) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kTile) {
    const bool in = i0 + i < s.sq;
    const int64_t ri = in ? row_index(prm.p, s, b, h, i0 + i) : 0;
    ptx::cp_async<4>(lse + i, prm.p.lse + ri, in ? 4u : 0u);
    ptx::cp_async<4>(d + i, prm.D + ri, in ? 4u : 0u);
  }
}

// ---------------------------------------------------------------- warp GEMMs (shared -> registers)
// acc [16 x 32] += A[m0.., :kK] · B[n0.., :kK]ᵀ: A and B both [.][kLd] with the contraction
// contiguous (K / Q / V / dO rows): ldmatrix without .trans for both.
template <int kK, int kLd>
__device__ __forceinline__ void gemm_abt(float (&acc)[4][4], uint32_t A, uint32_t B, int m0, int n0, int lane) {
  // A: lanes 0-15 rows m0 + lane, columns k..k+7; lanes 16-31 the same rows, columns k+8.. (a0..a3)
  const uint32_t a_at = A + 2u * ((m0 + lane % 16) * kLd + (lane / 16) * 8);
  // B: matrices (n0..+7, k..), (n0..+7, k+8..), (n0+8.., k..), (n0+8.., k+8..) = b0, b1 of MMA tile
  // 2np, b0, b1 of tile 2np+1
  const uint32_t b_at = B + 2u * ((n0 + lane % 8 + (lane / 16) * 8) * kLd + ((lane / 8) % 2) * 8);
#pragma unroll
  for (int k = 0; k < kK; k += 16) {
    uint32_t a0, a1, a2, a3;
    ptx::ldmatrix_x4(a_at + 2u * k, a0, a1, a2, a3);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t b0, b1, b2, b3;
      ptx::ldmatrix_x4(b_at + 2u * (np * 16 * kLd + k), b0, b1, b2, b3);
      ptx::mma_m16n8k16_bf16(acc[2 * np], a0, a1, a2, a3, b0, b1);
      ptx::mma_m16n8k16_bf16(acc[2 * np + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

// Row g + 8·half of a warp's kNt 8-column accumulator tiles (m16n8 fragments) -> bf16 at columns
// col0 + 8 nt + 2 t + {0, 1} of token `tok`, head h of an output (its view).
template <int kNt>
__device__ __forceinline__ void store_fragment_row(uint16_t* base, const AttnTensorView& v, int64_t b, int64_t tok,
                                                   int64_t h, int col0, int t, int half, const float (&acc)[kNt][4]) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int u = 0; u < 2; ++u) write_bf16(base, v, b, tok, h, col0 + 8 * nt + 2 * t + u, acc[nt][2 * half + u]);
}

// acc [16 x 8 kNt] += A[m0.., :kTile] · B[:kTile, n0..]: A [.][kLdA] (a score tile, contraction
// contiguous), B [kTile][kLdB] with the output columns contiguous (dO / Q / K rows): ldmatrix.trans.
template <int kNt, int kLdA, int kLdB>
__device__ __forceinline__ void gemm_ab(float (&acc)[kNt][4], uint32_t A, uint32_t B, int m0, int n0, int lane) {
  static_assert(kNt % 2 == 0, "MMA tiles in pairs (one ldmatrix.x4.trans)");
  const uint32_t a_at = A + 2u * ((m0 + lane % 16) * kLdA + (lane / 16) * 8);
  // B (.trans): matrices (k..+7, n), (k+8.., n), (k..+7, n+8), (k+8.., n+8) = b0, b1 of tile n,
  // b0, b1 of tile n + 8
  const uint32_t b_at = B + 2u * ((lane % 16) * kLdB + n0 + (lane / 16) * 8);
#pragma unroll
  for (int k = 0; k < kTile; k += 16) {
    uint32_t a0, a1, a2, a3;
    ptx::ldmatrix_x4(a_at + 2u * k, a0, a1, a2, a3);
#pragma unroll
    for (int np = 0; np < kNt / 2; ++np) {
      uint32_t b0, b1, b2, b3;
      ptx::ldmatrix_x4_trans(b_at + 2u * (k * kLdB + np * 16), b0, b1, b2, b3);
      ptx::mma_m16n8k16_bf16(acc[2 * np], a0, a1, a2, a3, b0, b1);
      ptx::mma_m16n8k16_bf16(acc[2 * np + 1], a0, a1, a2, a3, b2, b3);
    }
  }
}

template <int kR, int kC>
__device__ __forceinline__ void zero(float (&a)[kR][kC]) {
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int c = 0; c < kC; ++c) a[r][c] = 0.f;
}

// Which (query row il, key jl) of a tile pair (rows i0.., keys j0..) count: il < rows, jl < keys and
// (causal) j0 + jl <= i0 + il + off, i.e. jl − il <= diag (diag clamped: |jl − il| < 64).
struct TileMask {
  int rows, keys, diag;
  __device__ __forceinline__ bool on(int il, int jl) const { return il < rows && jl < keys && jl - il <= diag; }
};
__device__ __forceinline__ TileMask tile_mask(const AttentionBwdProblem& p, const Seq& s, int64_t i0, int64_t j0) {
  const int64_t diag = p.causal ? imin(imax(i0 + s.off - j0, -2 * kTile), 2 * kTile) : 2 * kTile;
  return {static_cast<int>(imin(kTile, s.sq - i0)), static_cast<int>(imin(kTile, s.skv - j0)), static_cast<int>(diag)};
}

// P̂ and dŜ of the two visible elements (u = 0, 1) of a fragment pair, as bf16x2 (low half: u = 0).
__device__ __forceinline__ void p_ds_pair(const float (&sacc)[2], const float (&dpacc)[2], const float (&lse)[2],
                                          const float (&dd)[2], const bool (&on)[2], float scale, uint32_t& p2,
                                          uint32_t& ds2) {
  float pv[2], dsv[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const float P = expf(sacc[u] * scale - lse[u]);
    pv[u] = on[u] ? P : 0.f;
    dsv[u] = on[u] ? P * (dpacc[u] - dd[u]) * scale : 0.f;
  }
  const __nv_bfloat162 pb = __floats2bfloat162_rn(pv[0], pv[1]), db = __floats2bfloat162_rn(dsv[0], dsv[1]);
  p2 = *reinterpret_cast<const uint32_t*>(&pb);
  ds2 = *reinterpret_cast<const uint32_t*>(&db);
}

// ---------------------------------------------------------------- dK, dV
// grid (ceil(Skv / 64), Hkv, B). The tiles t = 0 .. tiles − 1 run over the heads h of the GQA group
// (outer) and the query tiles i0 = i_begin, i_begin + 64, .. (inner). cp.async groups, committed by
// every thread in this order (empty ones too, so that the wait counts hold):
//   prologue  K_s, V_s and tile 0's score operands (Q_s, dO_s, LSE, D)
//   tile t    G_t: tile t's gradient operands (Q_g, dO_g), issued once tile t − 1's GEMMs are done
//             S_t+1: tile t + 1's score operands, issued once tile t's score GEMMs are done
// so the score operands of tile t + 1 land under tile t's gradient GEMMs and the gradient operands
// of tile t under its score GEMMs. A single copy (q_once / do_once) serves both GEMMs of a tile:
// its tiles alternate between the two buffers (tile t in buffer t % 2), so that tile t + 1's lands
// while tile t's gradient GEMM still reads.
template <class C>
__global__ void __launch_bounds__(kThreads, 1) bwd_dkdv_mma(const __grid_constant__ Params prm) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  SmemKV<C>& sm = *reinterpret_cast<SmemKV<C>*>(smem_raw);
  const AttentionBwdProblem& p = prm.p;
  const int64_t b = blockIdx.z, hk = blockIdx.y, j0 = int64_t{blockIdx.x} * kTile;
  const Seq s = seq_of(p, b);
  if (j0 >= s.skv) return;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wm = warp % kWarpRows, wn = warp / kWarpRows;  // 16-key block, column half
  const int g = lane / 4, t = lane % 4;
  const int nj = static_cast<int>(imin(kTile, s.skv - j0));
  const uint32_t ks = ptx::smem_u32(sm.ks), vs = ptx::smem_u32(sm.vs), pt = ptx::smem_u32(sm.pt),
                 dst = ptx::smem_u32(sm.dst);
  // buffer 0: the score GEMM's copy, 1: the gradient GEMM's (one copy: tile t's in buffer t % 2)
  auto qbuf = [&](int i) { return i == 0 ? &sm.qs[0][0] : &sm.qg[0][0]; };  // (selects: no local arrays)
  auto dobuf = [&](int i) { return i == 0 ? &sm.dos[0][0] : &sm.dog[0][0]; };

  float dk[C::kNtQk][4], dv[C::kNtV][4];
  zero(dk), zero(dv);
  const int64_t group = p.H / p.Hkv;
  const float scale = p.softmax_scale;
  // the first row that sees key j0 (causal); its tile is the first with work
  const int64_t i_first = p.causal ? imax(0, j0 - s.off) : 0;
  const int64_t i_begin = i_first < s.sq ? i_first / kTile * kTile : s.sq;
  const int64_t tiles = group * ((s.sq - i_begin + kTile - 1) / kTile);
  // tile (h, i0)'s score operands -> Q_s, dO_s (buffer `buf` of a single copy, else 0), LSE, D
  auto load_score_operands = [&](int64_t h, int64_t i0, int buf) {
    const int ni = static_cast<int>(imin(kTile, s.sq - i0));
    load_tile_async<C::kDqk>(qbuf(prm.q_once ? buf : 0), p.q_s.view, b, h, s.q0 + i0, ni);
    load_tile_async<C::kDv>(dobuf(prm.do_once ? buf : 0), p.do_s.view, b, h, s.q0 + i0, ni);
    load_rows_async(sm.lse, sm.d, prm, s, b, h, i0);
  };

  if (tiles > 0) {
    load_tile_async<C::kDqk>(&sm.ks[0][0], p.k_s.view, b, hk, s.kv0 + j0, nj);
    load_tile_async<C::kDv>(&sm.vs[0][0], p.v_s.view, b, hk, s.kv0 + j0, nj);
    load_score_operands(hk * group, i_begin, 0);
  }
  ptx::cp_async_commit();
  int64_t h = hk * group, i0 = i_begin;  // tile t
  for (int64_t ti = 0; ti < tiles; ++ti) {
    const int cur = static_cast<int>(ti & 1);
    const uint32_t qs = ptx::smem_u32(qbuf(prm.q_once ? cur : 0)), qg = ptx::smem_u32(qbuf(prm.q_once ? cur : 1));
    const uint32_t dos = ptx::smem_u32(dobuf(prm.do_once ? cur : 0)), dog = ptx::smem_u32(dobuf(prm.do_once ? cur : 1));
    ptx::cp_async_wait<0>();  // S_t (t = 0: and K_s, V_s): nothing else is in flight
    // tile t's score operands have landed for every thread; tile t − 1's gradient GEMMs are done
    // (Q_g, dO_g, P̂ᵀ, dŜᵀ and the other buffer of a single copy are free)
    __syncthreads();
    const int ni = static_cast<int>(imin(kTile, s.sq - i0));
    if (!prm.q_once) load_tile_async<C::kDqk>(&sm.qg[0][0], p.q_g.view, b, h, s.q0 + i0, ni);
    if (!prm.do_once) load_tile_async<C::kDv>(&sm.dog[0][0], p.do_g.view, b, h, s.q0 + i0, ni);
    ptx::cp_async_commit();  // G_t

    {  // Sᵀ, dPᵀ: this warp's keys 16 wm.., rows 32 wn..
      float sacc[4][4], dpacc[4][4];
      zero(sacc), zero(dpacc);
      gemm_abt<C::kDqk, C::kLdQk>(sacc, ks, qs, 16 * wm, 32 * wn, lane);
      gemm_abt<C::kDv, C::kLdV>(dpacc, vs, dos, 16 * wm, 32 * wn, lane);
      const TileMask mask = tile_mask(p, s, i0, j0);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int il = 32 * wn + 8 * nt + 2 * t;  // rows il, il + 1 (the fragment's columns)
        const float lse[2] = {sm.lse[il], sm.lse[il + 1]}, dd[2] = {sm.d[il], sm.d[il + 1]};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int jl = 16 * wm + g + 8 * half;  // the fragment's row: a key
          const float sv[2] = {sacc[nt][2 * half], sacc[nt][2 * half + 1]};
          const float dpv[2] = {dpacc[nt][2 * half], dpacc[nt][2 * half + 1]};
          const bool on[2] = {mask.on(il, jl), mask.on(il + 1, jl)};
          uint32_t p2, ds2;
          p_ds_pair(sv, dpv, lse, dd, on, scale, p2, ds2);
          *reinterpret_cast<uint32_t*>(&sm.pt[jl][il]) = p2;  // il even: 4-byte aligned
          *reinterpret_cast<uint32_t*>(&sm.dst[jl][il]) = ds2;
        }
      }
    }
    __syncthreads();  // P̂ᵀ, dŜᵀ complete; Q_s, dO_s, LSE, D consumed
    // the next tile: the next query tile of head h, else head h + 1's first
    int64_t h_next = h, i0_next = i0 + kTile;
    if (i0_next >= s.sq) h_next = h + 1, i0_next = i_begin;
    if (ti + 1 < tiles) load_score_operands(h_next, i0_next, cur ^ 1);
    ptx::cp_async_commit();  // S_t+1
    if (!(prm.q_once && prm.do_once)) {  // (uniform) G_t has copies
      ptx::cp_async_wait<1>();  // G_t (S_t+1 may stay in flight)
      __syncthreads();
    }
    // dV += P̂ᵀ·dO_g, dK += dŜᵀ·Q_g: keys 16 wm.., column half wn
    gemm_ab<C::kNtV, C::kLdT, C::kLdV>(dv, pt, dog, 16 * wm, (C::kDv / 2) * wn, lane);
    gemm_ab<C::kNtQk, C::kLdT, C::kLdQk>(dk, dst, qg, 16 * wm, (C::kDqk / 2) * wn, lane);
    h = h_next, i0 = i0_next;
  }
  ptx::cp_async_wait<0>();  // (every group is empty or waited for by now)

  // fragment (row g / g + 8: key, columns 2t, 2t + 1) -> bf16
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int jl = 16 * wm + g + 8 * half;
    if (jl >= nj) continue;
    const int64_t tok = s.kv0 + j0 + jl;
    store_fragment_row<C::kNtV>(p.dv, p.dv_v, b, tok, hk, (C::kDv / 2) * wn, t, half, dv);
    store_fragment_row<C::kNtQk>(p.dk, p.dk_v, b, tok, hk, (C::kDqk / 2) * wn, t, half, dk);
  }
}

// ---------------------------------------------------------------- dQ
// grid (ceil(Sq / 64), H, B). Key tiles t = 0 .. tiles − 1 (j0 = 64 t up to the causal limit);
// cp.async groups as in the dK/dV kernel: prologue Q_s, dO_s, LSE, D and tile 0's K_s, V_s; tile t:
// G_t = K_g of tile t (issued once tile t − 1's dQ GEMM is done), S_t+1 = K_s, V_s of tile t + 1
// (issued once tile t's score GEMMs are done). A single K copy (k_once) alternates between the two
// K buffers.
template <class C>
__global__ void __launch_bounds__(kThreads, 1) bwd_dq_mma(const __grid_constant__ Params prm) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  SmemQ<C>& sm = *reinterpret_cast<SmemQ<C>*>(smem_raw);
  const AttentionBwdProblem& p = prm.p;
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = int64_t{blockIdx.x} * kTile;
  const Seq s = seq_of(p, b);
  if (i0 >= s.sq) return;
  const int64_t hk = h / (p.H / p.Hkv);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wm = warp % kWarpRows, wn = warp / kWarpRows;  // 16-row block, column half
  const int g = lane / 4, t = lane % 4;
  const int ni = static_cast<int>(imin(kTile, s.sq - i0));
  const uint32_t qs = ptx::smem_u32(sm.qs), dos = ptx::smem_u32(sm.dos), vs = ptx::smem_u32(sm.vs),
                 ds = ptx::smem_u32(sm.ds);
  // buffer 0: the score GEMM's copy, 1: the dQ GEMM's (one copy: tile t's in buffer t % 2)
  auto kbuf = [&](int i) { return i == 0 ? &sm.ks[0][0] : &sm.kg[0][0]; };  // (selects: no local arrays)

  float dq[C::kNtQk][4];
  zero(dq);
  const float scale = p.softmax_scale;
  // keys any row of the tile sees: j <= i0 + ni - 1 + off (causal)
  const int64_t j_end = p.causal ? imin(imax(i0 + ni + s.off, 0), s.skv) : s.skv;
  const int64_t tiles = (j_end + kTile - 1) / kTile;
  if (tiles > 0) {
    load_tile_async<C::kDqk>(&sm.qs[0][0], p.q_s.view, b, h, s.q0 + i0, ni);
    load_tile_async<C::kDv>(&sm.dos[0][0], p.do_s.view, b, h, s.q0 + i0, ni);
    load_rows_async(sm.lse, sm.d, prm, s, b, h, i0);
    const int nj = static_cast<int>(imin(kTile, s.skv));
    load_tile_async<C::kDqk>(kbuf(0), p.k_s.view, b, hk, s.kv0, nj);
    load_tile_async<C::kDv>(&sm.vs[0][0], p.v_s.view, b, hk, s.kv0, nj);
  }
  ptx::cp_async_commit();
  for (int64_t ti = 0; ti < tiles; ++ti) {
    const int64_t j0 = ti * kTile;
    const int cur = static_cast<int>(ti & 1);
    const uint32_t ks = ptx::smem_u32(kbuf(prm.k_once ? cur : 0)), kg = ptx::smem_u32(kbuf(prm.k_once ? cur : 1));
    ptx::cp_async_wait<0>();  // S_t (t = 0: and Q_s, dO_s, LSE, D): nothing else is in flight
    // tile t's K_s, V_s have landed for every thread; tile t − 1's dQ GEMM is done (K_g, dŜ and
    // the other buffer of a single copy are free)
    __syncthreads();
    if (!prm.k_once)
      load_tile_async<C::kDqk>(&sm.kg[0][0], p.k_g.view, b, hk, s.kv0 + j0, static_cast<int>(imin(kTile, s.skv - j0)));
    ptx::cp_async_commit();  // G_t

    {  // S, dP: this warp's rows 16 wm.., keys 32 wn..
      float sacc[4][4], dpacc[4][4];
      zero(sacc), zero(dpacc);
      gemm_abt<C::kDqk, C::kLdQk>(sacc, qs, ks, 16 * wm, 32 * wn, lane);
      gemm_abt<C::kDv, C::kLdV>(dpacc, dos, vs, 16 * wm, 32 * wn, lane);
      const TileMask mask = tile_mask(p, s, i0, j0);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int il = 16 * wm + g + 8 * half;  // the fragment's row: a query row
        const float lse[2] = {sm.lse[il], sm.lse[il]}, dd[2] = {sm.d[il], sm.d[il]};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int jl = 32 * wn + 8 * nt + 2 * t;  // keys jl, jl + 1 (the fragment's columns)
          const float sv[2] = {sacc[nt][2 * half], sacc[nt][2 * half + 1]};
          const float dpv[2] = {dpacc[nt][2 * half], dpacc[nt][2 * half + 1]};
          const bool on[2] = {mask.on(il, jl), mask.on(il, jl + 1)};
          uint32_t p2, ds2;
          p_ds_pair(sv, dpv, lse, dd, on, scale, p2, ds2);
          *reinterpret_cast<uint32_t*>(&sm.ds[il][jl]) = ds2;  // jl even: 4-byte aligned
        }
      }
    }
    __syncthreads();  // dŜ complete; K_s, V_s consumed
    if (ti + 1 < tiles) {
      const int nj = static_cast<int>(imin(kTile, s.skv - j0 - kTile));
      load_tile_async<C::kDqk>(kbuf(prm.k_once ? cur ^ 1 : 0), p.k_s.view, b, hk, s.kv0 + j0 + kTile, nj);
      load_tile_async<C::kDv>(&sm.vs[0][0], p.v_s.view, b, hk, s.kv0 + j0 + kTile, nj);
    }
    ptx::cp_async_commit();  // S_t+1
    if (!prm.k_once) {  // (uniform) G_t has copies
      ptx::cp_async_wait<1>();  // G_t (S_t+1 may stay in flight)
      __syncthreads();
    }
    // dQ += dŜ·K_g: rows 16 wm.., column half wn
    gemm_ab<C::kNtQk, C::kLdT, C::kLdQk>(dq, ds, kg, 16 * wm, (C::kDqk / 2) * wn, lane);
  }
  ptx::cp_async_wait<0>();  // (every group is empty or waited for by now)

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int il = 16 * wm + g + 8 * half;
    if (il >= ni) continue;
    const int64_t tok = s.q0 + i0 + il;
    store_fragment_row<C::kNtQk>(p.dq, p.dq_v, b, tok, h, (C::kDqk / 2) * wn, t, half, dq);
  }
}

// ---------------------------------------------------------------- host
template <int kDqk, int kDv>
void launch(const Params& prm, cudaStream_t s) {
  using C = Cfg<kDqk, kDv>;
  constexpr size_t kKvSmem = sizeof(SmemKV<C>), kQSmem = sizeof(SmemQ<C>);
  static_assert(kKvSmem <= 227 * 1024 && kQSmem <= 227 * 1024, "an SM's shared memory (sm_90: 227 KB per CTA)");
  const AttentionBwdProblem& p = prm.p;
  const unsigned H = grid_dim(kOp, p.H, false, "heads"), Hkv = grid_dim(kOp, p.Hkv, false, "heads");
  const unsigned key_blocks = grid_dim(kOp, (p.Skv + kTile - 1) / kTile, true, "keys"),
                 row_blocks = grid_dim(kOp, (p.Sq + kTile - 1) / kTile, true, "rows");
  MXMLA_CUDA_CHECK(
      cudaFuncSetAttribute(bwd_dkdv_mma<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kKvSmem)));
  MXMLA_CUDA_CHECK(
      cudaFuncSetAttribute(bwd_dq_mma<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kQSmem)));
  for_sequence_chunks(kOp, p.B, p.thd, [&](int64_t b0, unsigned n) {
    Params c = prm;
    c.p = sequence_chunk(p, b0, n);
    if (p.Skv > 0) {
      bwd_dkdv_mma<C><<<dim3(key_blocks, Hkv, n), kThreads, kKvSmem, s>>>(c);
      MXMLA_CUDA_CHECK(cudaGetLastError());
    }
    if (p.Sq > 0) {
      bwd_dq_mma<C><<<dim3(row_blocks, H, n), kThreads, kQSmem, s>>>(c);
      MXMLA_CUDA_CHECK(cudaGetLastError());
    }
  });
}

// Two reads that give the same values (bf16: the same tensor; FP8: the same copy).
bool same_values(const AttnRead& a, const AttnRead& b) {
  const bool view = a.view.data == b.view.data && a.view.st_b == b.view.st_b && a.view.st_s == b.view.st_s &&
                    a.view.st_h == b.view.st_h;
  if (!a.fp8 || !b.fp8) return !a.fp8 && !b.fp8 && view;
  const AttnScaleView &x = a.sc, &y = b.sc;
  return view && a.rowwise == b.rowwise && a.fmt == b.fmt && x.ptr == y.ptr && x.map.mode == y.map.mode &&
         x.bi_b == y.bi_b && x.row_s == y.row_s && x.row_b == y.row_b && x.row_h == y.row_h && x.row0 == y.row0 &&
         x.col_b == y.col_b && x.col_h == y.col_h;
}

bool shape_instantiated(int64_t Dqk, int64_t Dv) {
  return (Dqk == 192 && Dv == 128) || (Dqk == 128 && Dv == 128) || (Dqk == 64 && Dv == 64);
}

// The preprocess: every read (Read order) that is FP8, or bf16 without 16-byte alignment, is
// converted once into bf16 stream-ordered scratch (stage_attn_reads, one launch; owned by keep[r])
// and prm.p's read becomes a plain bf16 view of it; a gradient GEMM's read with the score GEMM's
// values (q_once, k_once, do_once: set before) takes the score read's view. Aligned bf16 reads are read in place.
// Only the KV heads hk0 .. hk0 + n_kv − 1 (and their query heads) are converted (the views address
// every head; only those may be read); returns the bytes converted (with convert = false: only counts
// them, changing nothing). kv_fp8_in_kernel: the SM90 kernel converts the key-side FP8 reads (K_s,
// K_g, V) itself where their codes allow 16-byte loads; those stay FP8 reads.
int64_t stage_reads(Params& prm, const AttentionBwdProblem& p, cudaStream_t s,
                    std::unique_ptr<StreamScratch> (&keep)[7], int64_t hk0, int64_t n_kv, bool convert = true,
                    bool kv_fp8_in_kernel = false) {
  const AttnRead* const in[] = {&p.q_s, &p.q_g, &p.k_s, &p.k_g, &p.v_s, &p.do_s, &p.do_g};
  AttnRead* const out[] = {&prm.p.q_s, &prm.p.q_g, &prm.p.k_s, &prm.p.k_g, &prm.p.v_s, &prm.p.do_s, &prm.p.do_g};
  static_assert(kQg == kQs + 1 && kKg == kKs + 1 && kDOg == kDOs + 1, "a gradient read follows its score read");
  StageSeqs seqs;
  seqs.B = p.B, seqs.Sq = p.Sq, seqs.Skv = p.Skv, seqs.thd = p.thd, seqs.cu_q = p.cu_q, seqs.cu_kv = p.cu_kv;
  seqs.total_q = p.total_q, seqs.total_kv = p.total_kv;
  const int64_t group = p.Hkv > 0 ? p.H / p.Hkv : 1;
  int64_t bytes = 0;
  StageRequest req[7];
  AttnRead staged[7];  // bf16 (fp8 = false), no scales
  bool converted[7] = {};
  int n = 0;
  // a gradient GEMM's read that takes its score read's values (and view)
  const auto once = [&](int r) {
    return (r == kQg && prm.q_once) || (r == kKg && prm.k_once) || (r == kDOg && prm.do_once);
  };
  for (int r = 0; r < 7; ++r) {
    if (once(r)) continue;
    if (!in[r]->fp8 && attn_read_vec_ok(*in[r])) continue;
    const bool kv = r == kKs || r == kKg || r == kVs;
    // (the kernel's scale cursors divide in 32 bits: the map's columns below 2^31)
    if (kv && kv_fp8_in_kernel && in[r]->fp8 && attn_read_vec_ok(*in[r]) && in[r]->sc.map.cols < (int64_t{1} << 31))
      continue;
    const int64_t h0 = kv ? hk0 : hk0 * group, heads = kv ? n_kv : n_kv * group;
    const int64_t d = (r == kVs || r == kDOs || r == kDOg) ? p.Dv : p.Dqk;
    bytes += stage_attn_bytes(seqs, kv, heads, d);
    req[n].src = in[r], req[n].kv = kv, req[n].heads = heads, req[n].d = d, req[n].h0 = h0;
    req[n].view = &staged[r].view, req[n].keep = &keep[r];
    converted[r] = true, ++n;
  }
  if (!convert) return bytes;
  stage_attn_reads(kOp, seqs, req, n, s);
  for (int r = 0; r < 7; ++r) {
    if (once(r))
      *out[r] = *out[r - 1];  // in Read order: the score read's (converted) view is set before
    else if (converted[r]) *out[r] = staged[r];
  }
  return bytes;
}

}  // namespace

// The main kernels: sm90_attention_bwd.cu's (wgmma, dQ by fp32 reductions, in a fixed order when
// deterministic) where it serves the problem (see sm90_attention_bwd_supported: its head dims, one
// dO copy, an SM90 device), in groups of KV heads whose bf16 copies are made, read and freed one
// group after the other (heuristics::attn_bwd_head_groups; MXMLA_ATTN_BWD_GROUPS=n in the
// environment forces n, for tests), else this file's two mma.sync kernels (deterministic). MXMLA_ATTN_BWD in the environment,
// read at every call: "simt" forces the CUDA-core kernel, "mma" this file's kernels (A/B comparisons
// and tests).
void attention_bwd_cuda(const AttentionBwdProblem& p, Stream stream) {
  const char* env = std::getenv("MXMLA_ATTN_BWD");
  const bool force_simt = env != nullptr && std::strcmp(env, "simt") == 0;
  const bool force_mma = env != nullptr && std::strcmp(env, "mma") == 0;
  const AttnRead* reads[] = {&p.q_s, &p.q_g, &p.k_s, &p.k_g, &p.v_s, &p.do_s, &p.do_g};  // in Read order
  bool scales_ok = true;
  for (const AttnRead* r : reads) scales_ok = scales_ok && attn_read_chunk_scales_ok(*r);
  if (force_simt || !shape_instantiated(p.Dqk, p.Dv) || !scales_ok) return attention_bwd_simt_cuda(p, stream);

  auto s = reinterpret_cast<cudaStream_t>(stream);
  const std::unique_ptr<StreamScratch> D = attn_bwd::attention_bwd_prologue(p, s);
  if (D == nullptr) return;
  Params prm;
  prm.p = p;
  prm.D = reinterpret_cast<const float*>(D->ptr);
  prm.q_once = same_values(p.q_s, p.q_g);
  prm.k_once = same_values(p.k_s, p.k_g);
  prm.do_once = same_values(p.do_s, p.do_g);
  if (!force_mma && sm90_attention_bwd_supported(p, prm.do_once)) {
    std::unique_ptr<StreamScratch> none[7];
    // MXMLA_ATTN_BWD_STAGE_KV=1: the preprocess converts K and V too (tests compare the bits)
    const bool kv_in_kernel = heuristics::env_forced("MXMLA_ATTN_BWD_STAGE_KV", 1) == 0;
    const int64_t forced = heuristics::env_forced("MXMLA_ATTN_BWD_GROUPS", int64_t{1} << 30);
    const int64_t group = p.H / std::max<int64_t>(p.Hkv, 1);
    // one accumulator, or with b = 1 or thd (a group's query rows contiguous) one per group: made
    // before the group's kernel, rounded into dq and freed on the stream after it
    const bool acc_splits = p.thd || p.B == 1;
    const int64_t acc_bytes_per_kv_head = acc_splits ? group * (p.thd ? p.total_q : p.Sq) * p.Dqk * 4 : 0;
    const int64_t groups =
        forced != 0 ? std::min(forced, std::max<int64_t>(p.Hkv, 1))
                    : heuristics::attn_bwd_head_groups(stage_reads(prm, p, s, none, 0, 1, false, kv_in_kernel),
                                                       acc_bytes_per_kv_head, std::max<int64_t>(p.Hkv, 1));
    const int64_t per = (p.Hkv + groups - 1) / groups;  // (no group without KV heads)
    const bool acc_per_group = per < p.Hkv && acc_splits;
    Sm90DqAcc acc;
    if (!acc_per_group) acc = sm90_attention_bwd_acc(p, s, 0, p.H);
    for (int64_t hk0 = 0; hk0 < p.Hkv; hk0 += per) {
      const int64_t n = std::min(per, p.Hkv - hk0);
      if (acc_per_group) acc = sm90_attention_bwd_acc(p, s, hk0 * group, n * group);
      std::unique_ptr<StreamScratch> staged[7];  // this group's copies: freed on the stream after its kernel
      Params g = prm;
      stage_reads(g, p, s, staged, hk0, n, true, kv_in_kernel);
      Sm90BwdArgs a;
      a.p = g.p;
      a.D = prm.D;
      a.q_once = prm.q_once;
      sm90_attention_bwd_heads(a, acc, hk0, n, s);
      if (acc_per_group) sm90_attention_bwd_finish(p, acc, s);
    }
    if (!acc_per_group) sm90_attention_bwd_finish(p, acc, s);
    return;
  }
  std::unique_ptr<StreamScratch> staged[7];  // the preprocess's copies: freed on the stream after the kernels
  stage_reads(prm, p, s, staged, 0, p.Hkv);
  if (p.Dqk == 192)
    launch<192, 128>(prm, s);
  else if (p.Dqk == 128)
    launch<128, 128>(prm, s);
  else
    launch<64, 64>(prm, s);
}

}  // namespace mxmla::detail
