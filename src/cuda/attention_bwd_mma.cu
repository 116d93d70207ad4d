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
// Operands are converted to bf16 on their way into shared memory: a thread takes 16 consecutive
// values of one token (bf16: copied; FP8: code · 2^(e−127) rounded to nearest even, exact for values
// in bf16's normal range, through the copy's scale geometry as elem() reads it: one scale per chunk
// for a rowwise copy, one per column for a columnwise one; cuda/sm90/dequant_mxfp8_bf16.cuh). Rows
// past a sequence's end are zeros. The GEMMs are mma.sync m16n8k16 bf16 -> fp32 with ldmatrix
// fragments (FA2 style), every shared tile row padded by 8 bf16 (16 bytes) so the eight rows of an
// 8x8 ldmatrix land in distinct banks. Two kernels, as in the CUDA-core path, both 8 warps:
//
//   dK/dV  CTA = (64 keys j0.., kv head hk, sequence b). K_s [64][d_qk], V_s [64][d_v] stay in
//          shared memory; for every head h of the GQA group and every 64-row query tile from the
//          first that sees key j0 (causal):
//            Q_s, Q_g [64][d_qk], dO_s, dO_g [64][d_v], LSE, D [64]            -> shared
//            Sᵀ = K_s·Q_sᵀ, dPᵀ = V_s·dO_sᵀ [64 keys][64 rows]: warps 4 (keys) x 2 (rows), 16 x 32
//            P̂ᵀ, dŜᵀ bf16 [64 keys][64 rows]                                    -> shared
//            dV += P̂ᵀ·dO_g, dK += dŜᵀ·Q_g: warp = 16 keys x half the columns, fp32 registers
//          then dK, dV -> bf16 (the dk / dv views).
//   dQ     CTA = (64 query rows i0.., head h, sequence b). Q_s [64][d_qk], dO_s [64][d_v], LSE, D
//          stay; for every 64-key tile up to the causal limit: K_s, K_g [64][d_qk], V_s [64][d_v]
//          -> shared; S, dP [64 rows][64 keys] (warps 4 x 2, 16 x 32); dŜ -> shared [64][64];
//          dQ += dŜ·K_g (warp = 16 rows x d_qk / 2); then dQ -> bf16.
//
// bf16 operands (and FP8 ones with a single copy) have one copy for both GEMMs: it is loaded once.
// Shared memory (d_qk 192, d_v 128): dK/dV 144.5 KB, dQ 118.5 KB, one CTA per SM. Nothing is
// accumulated across CTAs (no atomics): the result does not depend on scheduling (deterministic).
// Arch-neutral (mma.sync sm_80+, FP8 decode and bf16x2 multiply sm_90+).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "common/attention_ops.h"
#include "cuda/attention_bwd_common.cuh"
#include "cuda/cuda_check.h"
#include "cuda/ptx/common.cuh"
#include "cuda/ptx/mma_sync.cuh"
#include "cuda/sm90/dequant_mxfp8_bf16.cuh"
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
  static_assert((kTile * (kDqk / 16)) % kThreads == 0 && (kTile * (kDv / 16)) % kThreads == 0,
                "the loader's 16-value chunks of a tile divide among the threads");
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
  AttentionBwdProblem p;
  const float* D;        // [rows] (row_index)
  uint32_t vec;          // bit r: read r may use 16-byte loads (data pointer and strides 16-byte aligned)
  bool q_once, k_once, do_once;  // the gradient GEMM's copy holds the score GEMM's values: loaded once
};
static_assert(sizeof(Params) <= 4000, "kernel parameter space");

// ---------------------------------------------------------------- loading (global -> bf16 shared)
// 16 FP8 codes (byte i = element i) with their scale bytes (byte i of e = element i's) -> 16 bf16 at
// the shared address `at` (32 bytes). Fast path: exact bit construction and one bf16 multiply;
// NaN / Inf codes and scales beyond the fast range take the exact fp32 path.
template <bool kE4M3>
__device__ __forceinline__ void store_fp8_chunk(const uint4& codes, const uint4& e, uint32_t at) {
  const uint32_t ew[4] = {e.x, e.y, e.z, e.w};
  uint32_t f[8], out[8];
  bool exact = false;
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // the factors of elements 2i, 2i+1
    const uint32_t e0 = (ew[i / 2] >> (16 * (i % 2))) & 0xFFu, e1 = (ew[i / 2] >> (16 * (i % 2) + 8)) & 0xFFu;
    exact |= (e0 > sm90::Fp8Bf16<kE4M3>::kMaxFastE) | (e1 > sm90::Fp8Bf16<kE4M3>::kMaxFastE);
    f[i] = sm90::fast_factor_bits<kE4M3>(e0) | (sm90::fast_factor_bits<kE4M3>(e1) << 16);
  }
  const uint32_t special = sm90::dequant16_fast<kE4M3>(codes, f, out);
  if (exact || special != 0) {
    sm90::dequant16_exact_store<kE4M3>(codes, e, at, at + 16);
  } else {
    ptx::st_shared_v4(at, out[0], out[1], out[2], out[3]);
    ptx::st_shared_v4(at + 16, out[4], out[5], out[6], out[7]);
  }
}

// Values d0 .. d0 + 15 of token `tok` (packed) of sequence b, head h of read r -> bf16 at `at`.
__device__ __forceinline__ void load_chunk(const AttnRead& r, bool vec, int64_t b, int64_t h, int64_t tok, int64_t d0,
                                           uint32_t at) {
  const int64_t off = b * r.view.st_b + tok * r.view.st_s + h * r.view.st_h + d0;
  if (!r.fp8) {
    const uint16_t* src = static_cast<const uint16_t*>(r.view.data) + off;
    if (vec) {
      const uint4 lo = reinterpret_cast<const uint4*>(src)[0], hi = reinterpret_cast<const uint4*>(src)[1];
      ptx::st_shared_v4(at, lo.x, lo.y, lo.z, lo.w);
      ptx::st_shared_v4(at + 16, hi.x, hi.y, hi.z, hi.w);
    } else {
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = static_cast<uint32_t>(src[2 * i]) | (static_cast<uint32_t>(src[2 * i + 1]) << 16);
      ptx::st_shared_v4(at, w[0], w[1], w[2], w[3]);
      ptx::st_shared_v4(at + 16, w[4], w[5], w[6], w[7]);
    }
    return;
  }
  const uint8_t* src = static_cast<const uint8_t*>(r.view.data) + off;
  uint4 codes;
  if (vec) {
    codes = *reinterpret_cast<const uint4*>(src);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(src[4 * i]) | (static_cast<uint32_t>(src[4 * i + 1]) << 8) |
             (static_cast<uint32_t>(src[4 * i + 2]) << 16) | (static_cast<uint32_t>(src[4 * i + 3]) << 24);
    codes = make_uint4(w[0], w[1], w[2], w[3]);
  }
  // the scales, through the geometry elem() uses (column `col` is a multiple of 16: host-checked)
  const AttnScaleView& sc = r.sc;
  const int64_t bi = b * sc.bi_b;
  const int64_t row = tok * sc.row_s + b * sc.row_b + h * sc.row_h + sc.row0;
  const int64_t col = b * sc.col_b + h * sc.col_h + d0;
  uint4 e;
  if (r.rowwise) {  // the 16 columns lie in one 32-column block of the row
    const uint32_t s = ptx::ld_global_nc_u8(sc.ptr + row_scale_offset(sc.map, bi, row, col / 32)) * 0x01010101u;
    e = make_uint4(s, s, s, s);
  } else {  // a block per column (32 rows of it): 16 bytes through one cursor (BHSD: inside col's head)
    const ScaleCursor cur = col_cursor(sc.map, bi, row / 32, col);
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < 16; ++k)
      w[k / 4] |= static_cast<uint32_t>(ptx::ld_global_nc_u8(sc.ptr + cursor_offset(cur, k))) << (8 * (k % 4));
    e = make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (r.fmt == Fp8Format::kE4M3)
    store_fp8_chunk<true>(codes, e, at);
  else
    store_fp8_chunk<false>(codes, e, at);
}

// Tokens tok0 .. tok0 + 63 (packed) of sequence b, head h of read r -> bf16 rows of dst
// [kTile][kD + kPad]; rows n and later are zeros. Consecutive threads take consecutive chunks of
// a row.
template <int kD>
__device__ __forceinline__ void load_tile(uint16_t* dst, const AttnRead& r, bool vec, int64_t b, int64_t h,
                                          int64_t tok0, int n) {
  constexpr int kChunks = kD / 16, kIters = kTile * kChunks / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int x = static_cast<int>(threadIdx.x) + it * kThreads;
    const int row = x / kChunks, c = x % kChunks;
    const uint32_t at = ptx::smem_u32(dst + row * (kD + kPad) + c * 16);
    if (row < n) {
      load_chunk(r, vec, b, h, tok0 + row, int64_t{c} * 16, at);
    } else {
      ptx::st_shared_v4(at, 0, 0, 0, 0);
      ptx::st_shared_v4(at + 16, 0, 0, 0, 0);
    }
  }
}

// LSE and D of rows i0 .. i0 + 63 of head h (0 past the sequence's end: those rows are masked).
__device__ __forceinline__ void load_rows(float* lse, float* d, const Params& prm, const Seq& s, int64_t b, int64_t h,
                                          int64_t i0) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kTile) {
    const bool in = i0 + i < s.sq;
    const int64_t ri = in ? row_index(prm.p, s, b, h, i0 + i) : 0;
    lse[i] = in ? prm.p.lse[ri] : 0.f;
    d[i] = in ? prm.D[ri] : 0.f;
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
// grid (ceil(Skv / 64), Hkv, B).
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
  const uint32_t ks = ptx::smem_u32(sm.ks), vs = ptx::smem_u32(sm.vs), qs = ptx::smem_u32(sm.qs),
                 dos = ptx::smem_u32(sm.dos), pt = ptx::smem_u32(sm.pt), dst = ptx::smem_u32(sm.dst);
  const uint32_t qg = prm.q_once ? qs : ptx::smem_u32(sm.qg), dog = prm.do_once ? dos : ptx::smem_u32(sm.dog);

  load_tile<C::kDqk>(&sm.ks[0][0], p.k_s, (prm.vec >> kKs) & 1, b, hk, s.kv0 + j0, nj);
  load_tile<C::kDv>(&sm.vs[0][0], p.v_s, (prm.vec >> kVs) & 1, b, hk, s.kv0 + j0, nj);

  float dk[C::kNtQk][4], dv[C::kNtV][4];
  zero(dk), zero(dv);
  const int64_t group = p.H / p.Hkv;
  const float scale = p.softmax_scale;
  // the first row that sees key j0 (causal); its tile is the first with work
  const int64_t i_first = p.causal ? imax(0, j0 - s.off) : 0;
  const int64_t i_begin = i_first < s.sq ? i_first / kTile * kTile : s.sq;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
    for (int64_t i0 = i_begin; i0 < s.sq; i0 += kTile) {
      __syncthreads();  // the previous tile's Q, dO, P̂ᵀ, dŜᵀ are consumed
      const int ni = static_cast<int>(imin(kTile, s.sq - i0));
      load_tile<C::kDqk>(&sm.qs[0][0], p.q_s, (prm.vec >> kQs) & 1, b, h, s.q0 + i0, ni);
      if (!prm.q_once) load_tile<C::kDqk>(&sm.qg[0][0], p.q_g, (prm.vec >> kQg) & 1, b, h, s.q0 + i0, ni);
      load_tile<C::kDv>(&sm.dos[0][0], p.do_s, (prm.vec >> kDOs) & 1, b, h, s.q0 + i0, ni);
      if (!prm.do_once) load_tile<C::kDv>(&sm.dog[0][0], p.do_g, (prm.vec >> kDOg) & 1, b, h, s.q0 + i0, ni);
      load_rows(sm.lse, sm.d, prm, s, b, h, i0);
      __syncthreads();

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
      __syncthreads();
      // dV += P̂ᵀ·dO_g, dK += dŜᵀ·Q_g: keys 16 wm.., column half wn
      gemm_ab<C::kNtV, C::kLdT, C::kLdV>(dv, pt, dog, 16 * wm, (C::kDv / 2) * wn, lane);
      gemm_ab<C::kNtQk, C::kLdT, C::kLdQk>(dk, dst, qg, 16 * wm, (C::kDqk / 2) * wn, lane);
    }

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
// grid (ceil(Sq / 64), H, B).
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
  const uint32_t qs = ptx::smem_u32(sm.qs), dos = ptx::smem_u32(sm.dos), ks = ptx::smem_u32(sm.ks),
                 vs = ptx::smem_u32(sm.vs), ds = ptx::smem_u32(sm.ds);
  const uint32_t kg = prm.k_once ? ks : ptx::smem_u32(sm.kg);

  load_tile<C::kDqk>(&sm.qs[0][0], p.q_s, (prm.vec >> kQs) & 1, b, h, s.q0 + i0, ni);
  load_tile<C::kDv>(&sm.dos[0][0], p.do_s, (prm.vec >> kDOs) & 1, b, h, s.q0 + i0, ni);
  load_rows(sm.lse, sm.d, prm, s, b, h, i0);

  float dq[C::kNtQk][4];
  zero(dq);
  const float scale = p.softmax_scale;
  // keys any row of the tile sees: j <= i0 + ni - 1 + off (causal)
  const int64_t j_end = p.causal ? imin(imax(i0 + ni + s.off, 0), s.skv) : s.skv;
  for (int64_t j0 = 0; j0 < j_end; j0 += kTile) {
    __syncthreads();  // the previous tile's K, V, dŜ are consumed
    const int nj = static_cast<int>(imin(kTile, s.skv - j0));
    load_tile<C::kDqk>(&sm.ks[0][0], p.k_s, (prm.vec >> kKs) & 1, b, hk, s.kv0 + j0, nj);
    if (!prm.k_once) load_tile<C::kDqk>(&sm.kg[0][0], p.k_g, (prm.vec >> kKg) & 1, b, hk, s.kv0 + j0, nj);
    load_tile<C::kDv>(&sm.vs[0][0], p.v_s, (prm.vec >> kVs) & 1, b, hk, s.kv0 + j0, nj);
    __syncthreads();

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
    __syncthreads();
    // dQ += dŜ·K_g: rows 16 wm.., column half wn
    gemm_ab<C::kNtQk, C::kLdT, C::kLdQk>(dq, ds, kg, 16 * wm, (C::kDqk / 2) * wn, lane);
  }

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
  const unsigned B = grid_dim(kOp, p.B, false, "sequences"), H = grid_dim(kOp, p.H, false, "heads"),
                 Hkv = grid_dim(kOp, p.Hkv, false, "heads");
  if (p.Skv > 0) {
    MXMLA_CUDA_CHECK(cudaFuncSetAttribute(bwd_dkdv_mma<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kKvSmem)));
    bwd_dkdv_mma<C><<<dim3(grid_dim(kOp, (p.Skv + kTile - 1) / kTile, true, "keys"), Hkv, B), kThreads, kKvSmem, s>>>(
        prm);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
  if (p.Sq > 0) {
    MXMLA_CUDA_CHECK(
        cudaFuncSetAttribute(bwd_dq_mma<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kQSmem)));
    bwd_dq_mma<C><<<dim3(grid_dim(kOp, (p.Sq + kTile - 1) / kTile, true, "rows"), H, B), kThreads, kQSmem, s>>>(prm);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
}

// 16-byte loads of a read: its data pointer and strides (bytes) multiples of 16.
bool vec_ok(const AttnRead& r) {
  const int64_t es = r.fp8 ? 1 : 2;
  const AttnTensorView& v = r.view;
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && v.st_b * es % 16 == 0 && v.st_s * es % 16 == 0 &&
         v.st_h * es % 16 == 0;
}

// The loader's scale lookups: a 16-value chunk starts at a column that is a multiple of 16, so it
// lies in one rowwise 32-column block; a columnwise chunk stays inside its head (BHSD cursors).
bool chunk_scales_ok(const AttnRead& r) {
  if (!r.fp8) return true;
  const AttnScaleView& sc = r.sc;
  if (sc.col_b % 16 != 0 || sc.col_h % 16 != 0) return false;
  if (sc.map.mode == MapMode::kBHSD)
    return sc.map.D % 16 == 0 && sc.col_b % sc.map.D == 0 && sc.col_h % sc.map.D == 0;
  return true;
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

}  // namespace

// MXMLA_ATTN_BWD=simt in the environment forces the CUDA-core kernel (A/B comparisons and tests);
// read at every call.
void attention_bwd_cuda(const AttentionBwdProblem& p, Stream stream) {
  const char* env = std::getenv("MXMLA_ATTN_BWD");
  const bool force_simt = env != nullptr && std::strcmp(env, "simt") == 0;
  const AttnRead* reads[] = {&p.q_s, &p.q_g, &p.k_s, &p.k_g, &p.v_s, &p.do_s, &p.do_g};  // in Read order
  bool scales_ok = true;
  for (const AttnRead* r : reads) scales_ok = scales_ok && chunk_scales_ok(*r);
  if (force_simt || !shape_instantiated(p.Dqk, p.Dv) || !scales_ok) return attention_bwd_simt_cuda(p, stream);

  auto s = reinterpret_cast<cudaStream_t>(stream);
  const std::unique_ptr<StreamScratch> D = attn_bwd::attention_bwd_prologue(p, s);
  if (D == nullptr) return;
  Params prm;
  prm.p = p;
  prm.D = reinterpret_cast<const float*>(D->ptr);
  prm.vec = 0;
  for (uint32_t r = 0; r < 7; ++r) prm.vec |= static_cast<uint32_t>(vec_ok(*reads[r])) << r;
  prm.q_once = same_values(p.q_s, p.q_g);
  prm.k_once = same_values(p.k_s, p.k_g);
  prm.do_once = same_values(p.do_s, p.do_g);
  if (p.Dqk == 192)
    launch<192, 128>(prm, s);
  else if (p.Dqk == 128)
    launch<128, 128>(prm, s);
  else
    launch<64, 64>(prm, s);
}

}  // namespace mxmla::detail
