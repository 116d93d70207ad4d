// mxmla — the attention backward's main kernel on SM90 (sm_90a): warp-specialized, bf16 wgmma with
// fp32 accumulation, dK and dV in registers, dQ summed across key blocks by bulk fp32 reductions
// from shared memory (FlashAttention-3's structure). It reads the bf16 views that the launcher's
// preprocess (attention_bwd_mma.cu) made of the query-side reads, and K, V (K_s, K_g, V) as bf16
// views or as FP8 reads that the CTA converts itself (below); the math is the one
// attention_bwd_mma.cu states:
//
//   P_ij = exp(s_ij − LSE_i),  dS_ij = P_ij · (dP_ij − D_i) · scale;  P̂, dŜ = bf16(P), bf16(dS)
//   dV = P̂ᵀ·dO_g,  dK = dŜᵀ·Q_g,  dQ = dŜ·K_g
//
// CTA = (96 keys j0.., kv head hk, sequence b); grid (key blocks, Hkv, B), started in chunks of a few
// heads, key block by key block inside a chunk (heuristics::attn_bwd_order_heads): the CTAs in flight
// share their heads' query-side tiles in L2, the key blocks with the most query rows (causal: the
// first) start first, and a launch ends on short ones. 384 threads:
//   all          FP8 K_s, K_g, V: converted once by every thread before the roles split (the
//                conversion pass's bits; rows past a sequence's end zero), into the layouts below
//   WG0          producer: cp.async copies into shared memory (rows past a sequence's end
//                zero-filled); once a set has landed, each thread fences (generic -> async proxy)
//                and arrives on the set's mbarrier:
//                bf16 K_s, K_g, V once; per query tile t (64 rows of head h, for every head of the GQA
//                group and every tile from the first that sees key j0): Q_s, dO, LSE, D into stage
//                t % 2, Q_g into its single buffer (once the consumers are done with tile t − 1's).
//   WG1, WG2     consumers c = 0, 1, keys 48c .. 48c + 47 of the block each; per tile:
//       S_c = Q_s·K_cᵀ, dP_c = dO·V_cᵀ          [64 rows][48 keys] wgmma m64n48, operands K-major
//       P̂, dŜ (fp32 registers -> bf16)          -> P̂ᵀ, dŜᵀ [key][row] in shared memory (stmatrix.trans)
//       dV_cᵀ += dOᵀ·P̂_c (issued under dŜ's math)  [d_v][48 keys] fp32 registers; A = dO read M-major
//       dQ[:, cols_c] = dŜ·K_g[:, cols_c]         [64 rows][d_qk / 2 columns] over all 96 keys (both
//                consumers' dŜᵀ, after a barrier), then dK_cᵀ += Q_gᵀ·dŜ_c ([d_qk][48 keys], A = Q_g
//                read M-major); once both consumers' dV and dQ GEMMs are done (a barrier), each
//                consumer writes its dQ part to shared memory while its dK GEMM runs (rows 0-15 over
//                its P̂ᵀ, 16-31 over a third of the stage's dO, 32-63 over half of the Q tile dK does
//                not read: Q_g when q_once, else the stage's Q_s) and one thread adds it into the fp32
//                dQ accumulator with three bulk reductions (cp.reduce.async.bulk .add.f32), then
//                waits, still under dK, until the first has been read (the next tile's P̂ᵀ store
//                follows a barrier); the stage's release waits until the others have been read (half
//                a tile later: they run under the next tile's S, dP GEMMs and softmax)
//   then dK, dV -> bf16. A postprocess kernel rounds the accumulator to bf16 into dq. The query
//   tiles of a head start at a rotation per key block, so that the CTAs of a head in flight add
//   into different rows.
// dQ accumulator: [consumer c][row (row_index order)][d_qk / 2] fp32, each row's 32-byte chunks
// rotated by row % 8 (chunk j at (j + row % 8) % (d_qk / 16)), so that the consumers' fragment
// stores to shared memory, whose rows are the accumulator's, meet no bank conflicts.
// Shared memory (d_qk 192): K_s, K_g 36 KB each, V 24 KB, two Q_s / dO stages 80 KB, Q_g 24 KB,
// P̂ᵀ and dŜᵀ 24 KB (per consumer, its 48 keys of each: 12 KB): 226 KB, one CTA per SM. Tiles of
// 64-column blocks [rows][128 bytes] with the 128-byte swizzle (K_g: 32-column blocks, 64-byte
// swizzle). dQ's fp32 additions run in scheduling order (not bitwise reproducible), or with kDet
// in a fixed one: every query tile's dQ parts are added by the key blocks that see it in descending
// key-block order. A consumer's threads wait (gpu-scope acquire) until its tile's flag counts the
// key blocks above its own that see the tile, its issuer adds, and once its additions have completed
// (half a tile later, where it frees the stage) the producer publishes them by incrementing the flag
// (after a gpu-scope release fence). The grid then runs the key blocks of a head last first
// (blockIdx.x = last − key block): a CTA waits only on CTAs of lower blockIdx.x, which the GPU
// dispatches before it (the order FlashAttention-3's deterministic backward relies on too), so no
// wait depends on a CTA that cannot start however few fit. Each walks its query tiles from its
// first without rotation: causal, block j reaches tile i one to two tiles after block j + 1 (its
// first tile is one or two later), so its wait is normally over before it begins; without a mask
// every block walks the same tiles and block j follows j + 1 one tile behind.
#include "cuda/sm90_attention_bwd.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/attention_bwd_common.cuh"
#include "cuda/attention_stage.cuh"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/numerics.cuh"
#include "cuda/ptx/common.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {
namespace {

using namespace attn_bwd;  // Seq, seq_of, row_index, write_bf16, imin, imax, grid_dim

constexpr const char* kOp = "mxmla.attention_backward";

// ---------------------------------------------------------------- configuration
template <int kDqk_, int kDv_>
struct Cfg {
  static constexpr int kDqk = kDqk_, kDv = kDv_;
  static constexpr int kBM = 64;            // query rows per tile (the wgmma M of S, dP, dQ)
  static constexpr int kBN = 96;            // keys per CTA
  static constexpr int kWN = kBN / 2;       // keys per consumer (the wgmma N of S, dP, dV, dK)
  static constexpr int kQkBlocks = kDqk / 64, kVBlocks = kDv / 64;  // 64-column blocks
  static constexpr int kDqN = kDqk / 2;  // dQ columns per consumer (wgmma N; K_g's 32-column blocks)
  static constexpr int kThreads = 384;
  static constexpr int kRegsProducer = 40, kRegsConsumer = 232;
  static constexpr int kBarPair = 1;  // named barriers: both consumers; consumer c's warpgroup: 2 + c
  static_assert(kDqk % 64 == 0 && kDv % 64 == 0 && kDqk <= 192 && kDv <= 128, "head dims");
  static_assert(kWN == 48, "consumer tiles are m64n48 (wgmma_m64n48k16)");
  // setmaxnreg.inc waits (for ever) for registers that the CTA's launch allocation does not hold
  static_assert(kRegsProducer * 128 + 2 * kRegsConsumer * 128 <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg moves registers inside the CTA's launch allocation");
};

template <class C>
struct alignas(1024) Smem {
  uint8_t ks[C::kQkBlocks][C::kBN * 128];  // K_s [key][d] (S)
  uint8_t kg[2 * C::kQkBlocks][C::kBN * 64];  // K_g [key][d] in 32-column blocks, 64-byte swizzle (dQ)
  uint8_t vs[C::kVBlocks][C::kBN * 128];   // V [key][d_v] (dP)
  uint8_t qs[2][C::kQkBlocks][C::kBM * 128];  // Q_s [row][d] per stage (S; dK when q_once)
  uint8_t dos[2][C::kVBlocks][C::kBM * 128];  // dO [row][d_v] per stage (dP, dV)
  uint8_t qg[C::kQkBlocks][C::kBM * 128];     // Q_g (dK; when q_once: dQ rows 32-63)
  uint8_t pd[2][2][C::kWN * 128];             // consumer c: P̂ᵀ, dŜᵀ of its keys [key][row] (P̂ᵀ: dQ rows 0-15)
  static_assert(C::kWN * 128 % 1024 == 0, "swizzled tiles start at 1024-byte boundaries");
  static_assert(16 * C::kDqN * 4 <= C::kWN * 128, "a consumer's dQ rows 0-15 fit over its P̂ᵀ");
  static_assert(2 * 16 * C::kDqN * 4 <= C::kVBlocks * C::kBM * 128, "both consumers' dQ rows 16-31 fit a dO stage");
  static_assert(2 * 32 * C::kDqN * 4 == C::kQkBlocks * C::kBM * 128, "both consumers' dQ rows 32-63 fit a Q_s stage (or Q_g)");
  float lse[2][C::kBM], dd[2][C::kBM];        // LSE, D of the tile's rows per stage
  // kDet (in shared memory: the consumers have no registers to spare): the first row that sees key
  // j0 (j0 − off), the count of key blocks after this one, the flag of each consumer's tile per stage
  int64_t det_a;
  int det_cap;
  int* flag[2][2];
  uint64_t kv_full, full[2], empty[2], g_full, g_empty;
};

struct Params {
  AttentionBwdProblem p;
  const float* D;
  float* dq_acc;  // fp32 [2][dq_rows][d_qk / 2] (see above), zeroed: rows dq_row0 .. dq_row0 + dq_rows − 1
  int* dq_flag;   // deterministic: int32 [2][dq_rows], zeroed (a query tile's count at its first row)
  int64_t dq_rows, dq_row0;
  int64_t hk0;  // the first KV head of the launch
  uint32_t order_g;  // not kDet: the launch's KV heads in chunks of this many, key-block-major inside (below)
  bool q_once;    // Q_g is Q_s (read from the stage; no Q_g copies)
};
static_assert(sizeof(Params) <= 4000, "kernel parameter space");

// ---------------------------------------------------------------- producer pieces
// Tokens tok0 .. tok0 + kRows − 1 (packed) of sequence b, head h of a bf16 view -> dst: kD / 64
// blocks of [kRows][128 bytes], 16-byte chunk c of row r at chunk c ^ (r % 8) (the 128-byte swizzle
// wgmma reads); rows n and later zero-filled. 128 threads (tid): chunk tid % 8 of rows tid / 8 + 16 i
// of every block (eight threads read a row's 128 bytes; the swizzled chunk is the same for all i).
template <int kD, int kRows>
__device__ __forceinline__ void load_tile(uint8_t* dst, const AttnTensorView& v, int64_t b, int64_t h, int64_t tok0,
                                          int n, int tid) {
  static_assert(kD % 64 == 0 && kRows % 16 == 0, "64-column blocks, 16-row passes");
  const int r = tid / 8, ch = tid % 8;
  const uint16_t* src = static_cast<const uint16_t*>(v.data) + b * v.st_b + (tok0 + r) * v.st_s + h * v.st_h + ch * 8;
  uint8_t* to = dst + r * 128 + ((ch ^ (r % 8)) * 16);
  const int64_t step = 16 * v.st_s;
#pragma unroll
  for (int i = 0; i < kRows / 16; ++i, src += step) {
    const bool in = r + 16 * i < n;
#pragma unroll
    for (int blk = 0; blk < kD / 64; ++blk)
      ptx::cp_async<16>(to + blk * (kRows * 128) + i * (16 * 128), in ? static_cast<const void*>(src + blk * 64) : v.data,
                        in ? 16u : 0u);
  }
}

// The same into kD / 32 blocks of [kRows][64 bytes] with the 64-byte swizzle (chunk c of row r at
// c ^ ((r / 2) % 4)): K_g, whose dQ GEMM reads it N-major in 32-column steps (each consumer's
// d_qk / 2 columns start at a block).
template <int kD, int kRows>
__device__ __forceinline__ void load_tile_sw64(uint8_t* dst, const AttnTensorView& v, int64_t b, int64_t h,
                                              int64_t tok0, int n, int tid) {
  constexpr int kPieces = kD / 8, kIters = kRows * kPieces / 128;
  static_assert(kRows * kPieces % 128 == 0, "a tile's 16-byte pieces divide among the producer's threads");
  const uint16_t* src = static_cast<const uint16_t*>(v.data) + b * v.st_b + tok0 * v.st_s + h * v.st_h;
#pragma unroll 4
  for (int it = 0; it < kIters; ++it) {
    const int x = tid + it * 128;
    const int row = x / kPieces, c = x % kPieces;
    const bool in = row < n;
    const void* from = in ? static_cast<const void*>(src + row * v.st_s + c * 8) : v.data;
    ptx::cp_async<16>(dst + (c / 4) * (kRows * 64) + row * 64 + (((c % 4) ^ ((row >> 1) & 3)) * 16), from,
                      in ? 16u : 0u);
  }
}

// A key-side FP8 read (K_s, K_g or V: the key block's kRows tokens from tok0, sequence b, KV head h)
// converted to bf16 by the whole CTA before the roles split, into the layout the producer's copies
// give a bf16 read (kSw64: load_tile_sw64's, else load_tile's; rows n and later zero), with the
// conversion pass's bits (cuda/attention_stage.cuh), in two steps so that every read's loads are in
// flight together: load() issues this thread's code and scale loads, store() converts and stores.
// Thread tid takes chunk tid % kChunks (16 values) of kPer consecutive keys, so that a columnwise
// read's 16 scale bytes are fetched once per 32-row block they share. The exact path (NaN / Inf
// codes, extreme scales) inline, the scale cursor with 32-bit divisions (the launcher checked the
// map's columns): a call (the out-of-line exact path, a 64-bit division's subroutine) makes ptxas
// spill in the roles' loops. The caller fences and synchronizes.
template <int kD, int kRows, int kThreads, bool kSw64>
struct KeyReadChunks {
  static constexpr int kChunks = kD / 16, kPer = kRows * kChunks / kThreads;
  static_assert(kRows * kChunks % kThreads == 0 && kThreads % kChunks == 0, "whole chunks a thread");
  uint4 codes[kPer];
  uint32_t sb[kPer];  // rowwise: each chunk's scale byte
  int64_t rb[kPer];   // columnwise: each chunk's 32-row block (-1: past the end)
  uint4 ec;           // columnwise: the scale bytes of block rb[0]
  ScaleCursor cur;
  int c, key0;

  __device__ __forceinline__ void load(const AttnRead& r, int64_t b, int64_t h, int64_t tok0, int n, int tid) {
    c = tid % kChunks, key0 = (tid / kChunks) * kPer;
    cur = attn_fp8::chunk_cursor<uint32_t>(r, b, h, c);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      codes[i] = make_uint4(0, 0, 0, 0), sb[i] = 0, rb[i] = -1;
      if (key0 + i >= n) continue;
      const int64_t tok = tok0 + key0 + i;
      codes[i] = attn_fp8::fp8_codes(r, true, attn_fp8::value_offset(r, b, h, tok, 16 * c));
      const int64_t row = attn_fp8::scale_row(r.sc, b, h, tok);
      if (r.rowwise)
        sb[i] = ptx::ld_global_nc_u8(r.sc.ptr + cursor_offset(cur, row));
      else
        rb[i] = row / 32;
    }
    ec = make_uint4(0, 0, 0, 0);
    if (!r.rowwise && rb[0] >= 0) ec = attn_fp8::col_scales(r.sc.ptr, cur, r.sc.map.cols, rb[0]);
  }

  __device__ __forceinline__ void store(uint8_t* dst, const AttnRead& r, int n) {
    uint4 unused[2];  // (the out-of-line exact path's slot)
    int64_t cached = rb[0];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int key = key0 + i;
      uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (key < n) {
        if (r.rowwise) {
          attn_fp8::fp8_words<true, true>(r, codes[i], make_uint4(sb[i], 0, 0, 0), unused, w);
        } else {
          if (rb[i] != cached) ec = attn_fp8::col_scales(r.sc.ptr, cur, r.sc.map.cols, rb[i]), cached = rb[i];
          attn_fp8::fp8_words<false, true>(r, codes[i], ec, unused, w);
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {  // the chunk's two 16-byte pieces (8 values each)
        const int pc = 2 * c + hf;      // piece index along d
        uint8_t* to = kSw64 ? dst + (pc / 4) * (kRows * 64) + key * 64 + (((pc % 4) ^ ((key >> 1) & 3)) * 16)
                            : dst + (pc / 8) * (kRows * 128) + key * 128 + (((pc % 8) ^ (key % 8)) * 16);
        *reinterpret_cast<uint4*>(to) = make_uint4(w[4 * hf], w[4 * hf + 1], w[4 * hf + 2], w[4 * hf + 3]);
      }
    }
  }
};

// Every FP8 key-side read of the key block (tokens tok0.., n of them) converted by the whole CTA
// (the caller synchronizes).
template <class C>
__device__ __forceinline__ void convert_key_reads(Smem<C>& sm, const AttentionBwdProblem& p, int64_t b, int64_t hk,
                                               int64_t tok0, int n) {
  const int tid = static_cast<int>(threadIdx.x);
  KeyReadChunks<C::kDqk, C::kBN, C::kThreads, false> ks;
  KeyReadChunks<C::kDqk, C::kBN, C::kThreads, true> kg;
  KeyReadChunks<C::kDv, C::kBN, C::kThreads, false> vs;
  if (p.k_s.fp8) ks.load(p.k_s, b, hk, tok0, n, tid);
  if (p.k_g.fp8) kg.load(p.k_g, b, hk, tok0, n, tid);
  if (p.v_s.fp8) vs.load(p.v_s, b, hk, tok0, n, tid);
  if (p.k_s.fp8) ks.store(sm.ks[0], p.k_s, n);
  if (p.k_g.fp8) kg.store(sm.kg[0], p.k_g, n);
  if (p.v_s.fp8) vs.store(sm.vs[0], p.v_s, n);
  ptx::fence_proxy_async();  // generic stores, read by wgmma (async proxy) after the caller's barrier
}

// Query tile i0 (ni rows) of head h into stage st: Q_s, dO, LSE (threads 0-63) and D (64-127) of its
// rows, zero past the sequence's end (the producer's 128 threads, cp.async; the caller commits).
template <class C>
__device__ __forceinline__ void load_query_tile(Smem<C>& sm, const Params& prm, const Seq& s, int64_t b, int64_t h,
                                                int64_t i0, int ni, int st, int tid) {
  const AttentionBwdProblem& p = prm.p;
  load_tile<C::kDqk, C::kBM>(sm.qs[st][0], p.q_s.view, b, h, s.q0 + i0, ni, tid);
  load_tile<C::kDv, C::kBM>(sm.dos[st][0], p.do_s.view, b, h, s.q0 + i0, ni, tid);
  const int r = tid % 64;
  const bool in = r < ni;
  const int64_t ri = in ? row_index(p, s, b, h, i0 + r) : 0;
  if (tid < 64)
    ptx::cp_async<4>(&sm.lse[st][r], p.lse + ri, in ? 4u : 0u);
  else
    ptx::cp_async<4>(&sm.dd[st][r], prm.D + ri, in ? 4u : 0u);
}

// The iteration order both roles follow: for every head of the GQA group, the query tiles from the
// first one that sees key j0 (causal) to the sequence's end, starting at tile `rot` (the key block's
// index modulo their count) and wrapping around, so that the CTAs of one head in flight add into
// different dQ rows.
struct TileWalk {
  int64_t h, i_begin, n, rot, k = 0;  // head, first row, query tiles per head, rotation, tile of the head
  __device__ __forceinline__ int64_t i0() const {
    const int64_t x = k + rot;
    return i_begin + (x < n ? x : x - n) * 64;
  }
  __device__ __forceinline__ void next() {
    if (++k == n) ++h, k = 0;
  }
};

template <int N>
__device__ __forceinline__ void fence_acc(float (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::fence_reg(a[i]);
}

// acc [64 rows][48 keys] = A·Bᵀ over kD columns, both K-major in 64-column blocks with the 128-byte
// swizzle: A a stage's tile (blocks kBM · 128 bytes apart), B this consumer's keys of a key-side tile
// (blocks kBN · 128 bytes apart); one commit group. (S = Q_s·K_cᵀ, dP = dO·V_cᵀ.)
template <class C, int kD>
__device__ __forceinline__ void gemm_rows_keys(float (&acc)[24], uint64_t desc_a, uint64_t desc_b) {
  constexpr uint32_t kRowBlk = C::kBM * 128 / 16, kKeyBlk = C::kBN * 128 / 16;  // block strides (descriptor units)
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
    ptx::wgmma_m64n48k16_f32_bf16_bf16_ss<0, 0>(acc, desc_a + (kk / 4) * kRowBlk + 2 * (kk % 4),
                                                desc_b + (kk / 4) * kKeyBlk + 2 * (kk % 4), kk > 0);
  ptx::wgmma_commit();
}

// dQ[:, col0 .. col0 + kN) of a query tile, over the block's 96 keys: A = dŜ (M-major from dŜᵀ:
// rows of 64 query rows, 8-key groups 1024 bytes apart; 16 keys = 2048 bytes; keys 0-47 in consumer
// 0's dŜᵀ, 48-95 in consumer 1's), B = K_g (N-major: 32-column blocks kBN · 64 bytes apart, 8-key
// groups 512 apart; 16 keys = 1024 bytes). One commit group, issued before dK's, so that the
// fragment is staged while dK's GEMM runs (the caller fences and waits).
template <int kN>
__device__ __forceinline__ void dq_gemm_issue(float (&acc)[kN / 2], const uint8_t* dst0, const uint8_t* dst1,
                                              const uint8_t* kg_block0) {
  const uint64_t da0 = ptx::wgmma_desc(dst0, ptx::SmemSwizzle::k128B, 8192, 1024);
  const uint64_t da1 = ptx::wgmma_desc(dst1, ptx::SmemSwizzle::k128B, 8192, 1024);
  const uint64_t db = ptx::wgmma_desc(kg_block0, ptx::SmemSwizzle::k64B, 96 * 64, 512);
#pragma unroll
  for (int kk = 0; kk < 6; ++kk) {
    const uint64_t da = (kk < 3 ? da0 : da1) + (kk % 3) * 128;
    if constexpr (kN == 96)
      ptx::wgmma_m64n96k16_f32_bf16_bf16_ss<1, 1>(acc, da, db + kk * 64, kk > 0);
    else
      ptx::wgmma_m64n64k16_f32_bf16_bf16_ss<1, 1>(acc, da, db + kk * 64, kk > 0);
  }
  ptx::wgmma_commit();
}

// The fragment -> shared memory in the accumulator's row layout: rows 0-15 at buf0, 16-31 at
// buf1, 32-63 at buf2 ([rows][kN] fp32 each; warp w holds rows 16w .. 16w + 15), the 32-byte chunk
// j of a row at (j + rot) % (kN / 8), rot = the global row index % 8 (the same for this thread's rows
// r0, r0 + 8). The 8 rows of a store meet each bank twice: 2 wavefronts per 256 bytes.
template <int kN>
__device__ __forceinline__ void dq_stage(const float (&acc)[kN / 2], uint8_t* buf0, uint8_t* buf1, uint8_t* buf2,
                                         int warp, int lane, int64_t row0) {
  constexpr int kChunks = kN / 8;
  const int rot = static_cast<int>((row0 + lane / 4) % 8);
  uint8_t* const buf = warp == 0 ? buf0 : warp == 1 ? buf1 : buf2;
  const uint32_t base = ptx::smem_u32(buf) + ((warp == 3 ? 16 : 0) + lane / 4) * (kN * 4) + (lane % 4) * 8;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int jr = j + rot < kChunks ? j + rot : j + rot - kChunks;
      ptx::st_shared_v2_f32(base + hh * 8 * (kN * 4) + jr * 32, acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
    }
}

// ---------------------------------------------------------------- the kernel
// kDet: dQ's additions in the fixed order (its own instantiation: the default one keeps its registers).
// kFp8Kv: K_s, K_g or V FP8 reads, converted before the roles split (its own instantiation: the
// roles' code of the other, whose schedule ptxas changes around any prologue, stays as it was)
template <int kDqk, int kDv, bool kDet, bool kFp8Kv>
__global__ void __launch_bounds__(384, 1) bwd_sm90(const __grid_constant__ Params prm) {
  using C = Cfg<kDqk, kDv>;
  extern __shared__ uint8_t smem_raw[];
  Smem<C>& sm = *reinterpret_cast<Smem<C>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const AttentionBwdProblem& p = prm.p;
  // the key block and KV head. kDet: blockIdx.x = the last key block − kb (see above), blockIdx.y the
  // head. Else the CTAs in the GPU's start order (x fastest) take the launch's heads in chunks of
  // prm.order_g, key-block-major inside a chunk (heuristics::attn_bwd_order_heads: the launch ends on
  // short key blocks; order_g 1 is the heads one after another)
  int64_t kb, hk;
  if constexpr (kDet) {
    kb = int64_t{gridDim.x} - 1 - blockIdx.x, hk = prm.hk0 + blockIdx.y;
  } else if (prm.order_g == 1) {  // (also where the launch's CTAs outnumber 32 bits: see the launcher)
    kb = blockIdx.x, hk = prm.hk0 + blockIdx.y;
  } else {
    const heuristics::AttnBwdCta x =
        heuristics::attn_bwd_cta(blockIdx.y * gridDim.x + blockIdx.x, gridDim.x, gridDim.y, prm.order_g);
    kb = x.kb, hk = prm.hk0 + x.head;
  }
  const int64_t j0 = kb * C::kBN, b = blockIdx.z;
  const Seq s = seq_of(p, b);
  if (j0 >= s.skv) return;  // (uniform: the whole CTA)
  const int nj = static_cast<int>(imin(C::kBN, s.skv - j0));
  const int64_t group = p.H / p.Hkv;
  const int64_t i_first = p.causal ? imax(0, j0 - s.off) : 0;  // the first row that sees key j0
  const int64_t i_begin = i_first < s.sq ? i_first / C::kBM * C::kBM : s.sq;
  const int64_t per_head = (s.sq - i_begin + C::kBM - 1) / C::kBM, tiles = group * per_head;
  const int64_t rot = per_head > 0 && !kDet ? kb % per_head : 0;
  // (not ptx::warpgroup_index(): with it the consumer loop is 17 % shorter, but neither instantiation
  // timed faster beyond the run-to-run spread: docs/notes-sm90-parts.md, the warp-uniform index's A/B)
  const int wg = static_cast<int>(threadIdx.x) / 128;
  // dV's GEMM issued after dŜ's math (FlashAttention-4's order: one warpgroup barrier a tile fewer)
  // or before it, under that math. The same MMAs in the same order either way: the same bits. Chosen
  // per instantiation by a same-run A/B (H100, docs/notes-attention.md): after, with FP8 K / V reads
  // (MXFP8 inputs 0.967 / 0.986x the time at s 4096 / 8192), before without them (bf16 inputs
  // 1.009 / 1.026x with it after).
  constexpr bool kDvAfterDs = kFp8Kv;

  if (threadIdx.x == 0) {
    ptx::mbar_init(&sm.kv_full, 128);
    ptx::mbar_init(&sm.g_full, 128);
    ptx::mbar_init(&sm.g_empty, 8);
    for (int i = 0; i < 2; ++i) ptx::mbar_init(&sm.full[i], 128), ptx::mbar_init(&sm.empty[i], 256);
    if constexpr (kDet) {
      sm.det_a = j0 - s.off;
      sm.det_cap = static_cast<int>((s.skv + C::kBN - 1) / C::kBN - 1 - kb);
    }
  }
  // FP8 key-side reads (the launcher leaves them unconverted where their codes allow 16-byte
  // loads): converted once per CTA by every thread, with the launch's registers, before the roles
  // split; the producer copies the bf16 ones.
  if constexpr (kFp8Kv) {
    if (tiles > 0) {
      if (wg == 0) {  // the producer's first query tile, in flight during the conversion
        const TileWalk w0{hk * group, i_begin, per_head, rot};
        const int64_t i0 = w0.i0();
        load_query_tile<C>(sm, prm, s, b, w0.h, i0, static_cast<int>(imin(C::kBM, s.sq - i0)), 0,
                           static_cast<int>(threadIdx.x));
        ptx::cp_async_commit();
      }
      convert_key_reads<C>(sm, p, b, hk, s.kv0 + j0, nj);
    }
  }
  __syncthreads();

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    ptx::setmaxnreg_dec<C::kRegsProducer>();
    const int tid = static_cast<int>(threadIdx.x);
    if (tiles == 0) return;
    // this thread's copies have landed: the proxy fence (cp.async writes through the generic proxy,
    // wgmma reads through the async one), then the arrival the consumers acquire
    const auto landed = [](uint64_t* bar) {
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      ptx::fence_proxy_async();
      ptx::mbar_arrive(bar);
    };
    if (!kFp8Kv || !p.k_s.fp8) load_tile<kDqk, C::kBN>(sm.ks[0], p.k_s.view, b, hk, s.kv0 + j0, nj, tid);
    if (!kFp8Kv || !p.k_g.fp8)  // (one K copy: read twice)
      load_tile_sw64<kDqk, C::kBN>(sm.kg[0], p.k_g.view, b, hk, s.kv0 + j0, nj, tid);
    if (!kFp8Kv || !p.v_s.fp8) load_tile<kDv, C::kBN>(sm.vs[0], p.v_s.view, b, hk, s.kv0 + j0, nj, tid);
    landed(&sm.kv_full);
    TileWalk w{hk * group, i_begin, per_head, rot};
    // kDet: two more turns, which publish the last two tiles' flags
    for (int64_t t = 0; t < tiles + (kDet ? 2 : 0); ++t, w.next()) {
      const int st = static_cast<int>(t & 1);
      if (t >= 2) {  // tile t − 2's dQ parts have been read (kDet: added), its stage is free
        ptx::mbar_wait(&sm.empty[st], static_cast<uint32_t>(((t >> 1) - 1) & 1));
        if constexpr (kDet) {  // publish them: the next key block below may add (the release is here,
                               // off the consumers' path: a fence at gpu scope costs them 8 %)
          if (tid == 0) {
            ptx::fence_acq_rel_gpu();
            ptx::red_relaxed_gpu_add_s32(sm.flag[0][st], 1);
            ptx::red_relaxed_gpu_add_s32(sm.flag[1][st], 1);
          }
        }
      }
      if (kDet && t >= tiles) continue;
      const int64_t i0 = w.i0();
      const int ni = static_cast<int>(imin(C::kBM, s.sq - i0));
      if (!kFp8Kv || t > 0) load_query_tile<C>(sm, prm, s, b, w.h, i0, ni, st, tid);  // (kFp8Kv: tile 0 in flight)
      landed(&sm.full[st]);
      if (!prm.q_once) {
        if (t >= 1) ptx::mbar_wait(&sm.g_empty, static_cast<uint32_t>((t - 1) & 1));
        load_tile<kDqk, C::kBM>(sm.qg[0], p.q_g.view, b, w.h, s.q0 + i0, ni, tid);
        landed(&sm.g_full);
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int c = wg - 1, warp = (static_cast<int>(threadIdx.x) / 32) % 4, lane = static_cast<int>(threadIdx.x) % 32;
  const int r0 = 16 * warp + lane / 4;  // accumulator rows r0, r0 + 8 (of a 64-row wgmma tile)
  float dk[C::kQkBlocks][24], dv[C::kVBlocks][24];  // dKᵀ, dVᵀ: [64 d of the block][48 keys]
#pragma unroll
  for (int m = 0; m < C::kQkBlocks; ++m)
#pragma unroll
    for (int i = 0; i < 24; ++i) dk[m][i] = 0.f;
#pragma unroll
  for (int m = 0; m < C::kVBlocks; ++m)
#pragma unroll
    for (int i = 0; i < 24; ++i) dv[m][i] = 0.f;

  const float scale = p.softmax_scale, scale_log2 = p.softmax_scale * 1.4426950408889634f;
  const uint32_t pt = ptx::smem_u32(sm.pd[c][0]), dst = ptx::smem_u32(sm.pd[c][1]);
  // descriptor bases (K-major, 128-byte swizzle): this consumer's keys start 48 rows in
  const uint64_t dk_s = ptx::wgmma_desc_k_sw128(sm.ks[0] + c * C::kWN * 128);
  const uint64_t dv_s = ptx::wgmma_desc_k_sw128(sm.vs[0] + c * C::kWN * 128);
  const uint64_t dpt = ptx::wgmma_desc_k_sw128(sm.pd[c][0]);
  const uint64_t ddst = ptx::wgmma_desc_k_sw128(sm.pd[c][1]);
  const bool issuer = threadIdx.x % 128 == 0;  // adds this consumer's dQ parts, completes the stages' release
  // kDet: the issuer's additions have completed (before its arrival on the stage's empty barrier,
  // after which the producer publishes them)
  const auto completed = [] {
    ptx::bulk_wait_all();
    ptx::fence_proxy_async_global();
  };

  if (tiles > 0) ptx::mbar_wait(&sm.kv_full, 0);
  TileWalk w{hk * group, i_begin, per_head, rot};
  for (int64_t t = 0; t < tiles; ++t, w.next()) {
    const int st = static_cast<int>(t & 1);
    const int64_t i0 = w.i0();
    const int ni = static_cast<int>(imin(C::kBM, s.sq - i0));
    ptx::mbar_wait(&sm.full[st], static_cast<uint32_t>((t >> 1) & 1));

    // S_c = Q_s·K_cᵀ, dP_c = dO·V_cᵀ: [64 rows][48 keys], two groups (P̂ is computed under dP's)
    float sacc[24], dpacc[24];
    fence_acc(sacc), fence_acc(dpacc);
    ptx::wgmma_fence();
    gemm_rows_keys<C, kDqk>(sacc, ptx::wgmma_desc_k_sw128(sm.qs[st][0]), dk_s);
    gemm_rows_keys<C, kDv>(dpacc, ptx::wgmma_desc_k_sw128(sm.dos[st][0]), dv_s);
    ptx::wgmma_wait<1>();  // S
    fence_acc(sacc);

    // key kw (of the block) is visible to row r iff r < ni, kw < nj, (causal) kw − r <= diag
    const int diag = static_cast<int>(p.causal ? imin(imax(i0 + s.off - j0, -256), 256) : 256);
    const auto on = [&](int hh, int j, int e) {
      const int r = r0 + 8 * hh, kw = c * C::kWN + 8 * j + 2 * (lane % 4) + e;
      return r < ni && kw < nj && kw - r <= diag;
    };
    // P (fp32, in sacc) and P̂ as bf16 pairs: pair 2j + hh = keys 8j + 2(lane % 4) + {0, 1} of row r0 + 8 hh
    uint32_t pair[12];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float lse2 = ptx::ld_shared_f32(ptx::smem_u32(&sm.lse[st][r0 + 8 * hh])) * 1.4426950408889634f;
#pragma unroll
      for (int j = 0; j < 6; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float P = ptx::ex2_approx(fmaf(sacc[4 * j + 2 * hh + e], scale_log2, -lse2));
          sacc[4 * j + 2 * hh + e] = on(hh, j, e) ? P : 0.f;
        }
        pair[2 * j + hh] = bf16x2_rn(sacc[4 * j + 2 * hh], sacc[4 * j + 2 * hh + 1]);
      }
    }
    // 8x8 matrices (hh, j = 2jp + i / 2), i = lane / 8, stored transposed: [key][row]
    const auto store_t = [&](uint32_t base) {
#pragma unroll
      for (int jp = 0; jp < 3; ++jp) {
        const int i = lane / 8, key = 8 * (2 * jp + i / 2) + lane % 8, chunk = 2 * warp + i % 2;
        ptx::stmatrix_x4_trans(base + key * 128 + ((chunk ^ (lane % 8)) * 16), pair[4 * jp], pair[4 * jp + 1],
                               pair[4 * jp + 2], pair[4 * jp + 3]);
      }
    };
    // dV_cᵀ += dOᵀ·P̂_c: A M-major (rows of 64 d_v, 8-row groups 1024 bytes apart)
    const auto issue_dv = [&] {
#pragma unroll
      for (int m = 0; m < C::kVBlocks; ++m) fence_acc(dv[m]);
      ptx::wgmma_fence();
#pragma unroll
      for (int m = 0; m < C::kVBlocks; ++m) {
        const uint64_t da = ptx::wgmma_desc(sm.dos[st][m], ptx::SmemSwizzle::k128B, 8192, 1024);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          ptx::wgmma_m64n48k16_f32_bf16_bf16_ss<1, 0>(dv[m], da + kk * 128, dpt + 2 * kk, true);
      }
      ptx::wgmma_commit();
    };
    store_t(pt);
    if constexpr (kDvAfterDs) {
      ptx::wgmma_wait<0>();  // dP (P̂ᵀ reaches dV's GEMM through the pair barrier below)
    } else {  // dV under dŜ's math, behind this consumer's own barrier
      ptx::fence_proxy_async();
      ptx::named_barrier(2 + c, 128);  // this consumer's P̂ᵀ is complete
      issue_dv();
      ptx::wgmma_wait<1>();  // dP
    }
    fence_acc(dpacc);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float d_row = ptx::ld_shared_f32(ptx::smem_u32(&sm.dd[st][r0 + 8 * hh]));
#pragma unroll
      for (int j = 0; j < 6; ++j) {
        float ds[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          ds[e] = on(hh, j, e) ? sacc[4 * j + 2 * hh + e] * (dpacc[4 * j + 2 * hh + e] - d_row) * scale : 0.f;
        pair[2 * j + hh] = bf16x2_rn(ds[0], ds[1]);
      }
    }
    if (t > 0) {  // the previous tile's bulk reductions have read its dQ part: the previous stage is free
      if (issuer) {
        if constexpr (kDet)
          completed();
        else
          ptx::bulk_wait_read_all();
        ptx::mbar_arrive(&sm.empty[st ^ 1]);
      }
    }
    store_t(dst);  // (this consumer's dK GEMM and the other's dQ GEMM of the previous tile are done)
    ptx::fence_proxy_async();
    ptx::named_barrier(C::kBarPair, 256);  // both consumers' dŜᵀ (kDvAfterDs: and P̂ᵀ) are complete
    if constexpr (kDvAfterDs) issue_dv();

    // dQ[:, cols_c] = dŜ·K_g[:, cols_c] (consumer c the columns c · d_qk / 2 ..), then dK_cᵀ += Q_gᵀ·dŜ_c
    // (A M-major as dV's): the dQ fragment is staged and its reductions issued while dK's GEMM runs
    float acc[C::kDqN / 2];
    fence_acc(acc);
#pragma unroll
    for (int m = 0; m < C::kQkBlocks; ++m) fence_acc(dk[m]);
    if (!prm.q_once) ptx::mbar_wait(&sm.g_full, static_cast<uint32_t>(t & 1));
    ptx::wgmma_fence();
    dq_gemm_issue<C::kDqN>(acc, sm.pd[0][1], sm.pd[1][1], sm.kg[c * (C::kDqN / 32)]);
    {
      const uint8_t* qg = prm.q_once ? sm.qs[st][0] : sm.qg[0];
#pragma unroll
      for (int m = 0; m < C::kQkBlocks; ++m) {
        const uint64_t da = ptx::wgmma_desc(qg + m * C::kBM * 128, ptx::SmemSwizzle::k128B, 8192, 1024);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          ptx::wgmma_m64n48k16_f32_bf16_bf16_ss<1, 0>(dk[m], da + kk * 128, ddst + 2 * kk, true);
      }
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // dV, dQ (dK still running)
    fence_acc(acc);
    {
      // both consumers' dV and dQ GEMMs are done: both P̂ᵀ, the stage's dO and the Q tile that dK
      // does not read (q_once: Q_g, unused; else the stage's Q_s) are free
      ptx::named_barrier(C::kBarPair, 256);
      const int64_t row0 = row_index(p, s, b, w.h, i0);
      uint8_t* const buf0 = sm.pd[c][0];                                                       // rows 0-15
      uint8_t* const buf1 = sm.dos[st][0] + c * (16 * C::kDqN * 4);                           // rows 16-31
      uint8_t* const buf2 = (prm.q_once ? sm.qg[0] : sm.qs[st][0]) + c * (32 * C::kDqN * 4);  // rows 32-63
      dq_stage<C::kDqN>(acc, buf0, buf1, buf2, warp, lane, row0);
      ptx::fence_proxy_async();
      if constexpr (kDet) {  // wait for the key blocks after this one that see the tile (block j sees it
                             // iff j·96 <= i0 + ni − 1 + off, the tile's last row: those up to
                             // kb + (i0 + ni − 1 − det_a) / 96; a block past the last row has no tile and
                             // publishes nothing, e.g. top-left causal with s_kv > s_q, found by the GPU
                             // fuzzer as a hang). Every thread spins (a loop in the issuer's branch costs
                             // the consumers their uniform registers; see ptx::spin_until_ge_acquire_gpu)
        const int n = p.causal ? static_cast<int>(imin((i0 + ni - 1 - sm.det_a) / C::kBN, sm.det_cap)) : sm.det_cap;
        int* const flag = prm.dq_flag + c * prm.dq_rows + row0 - prm.dq_row0;
        ptx::spin_until_ge_acquire_gpu(flag, n);
        if (issuer) sm.flag[c][st] = flag;
      }
      ptx::named_barrier(2 + c, 128);
      if (issuer) {  // rows i0 .. i0 + ni − 1: [2][rows][d_qk / 2] at (c, row0), in pieces of 16, 16, 32 rows,
                     // one commit group each; then wait until the first (over P̂ᵀ, which the next
                     // tile's P̂ store overwrites) has been read, under dK's GEMM
        float* to = prm.dq_acc + (c * prm.dq_rows + row0 - prm.dq_row0) * C::kDqN;
        constexpr uint32_t kRow = C::kDqN * 4;
        if constexpr (kDet) ptx::fence_proxy_async_global();
        ptx::bulk_reduce_add_f32_s2g(to, buf0, static_cast<uint32_t>(imin(ni, 16)) * kRow);
        ptx::bulk_commit();
        if (ni > 16) {
          ptx::bulk_reduce_add_f32_s2g(to + 16 * C::kDqN, buf1, static_cast<uint32_t>(imin(ni, 32) - 16) * kRow);
          ptx::bulk_commit();
        }
        if (ni > 32) {
          ptx::bulk_reduce_add_f32_s2g(to + 32 * C::kDqN, buf2, static_cast<uint32_t>(ni - 32) * kRow);
          ptx::bulk_commit();
        }
        if (ni > 32)
          ptx::bulk_wait_read<2>();
        else if (ni > 16)
          ptx::bulk_wait_read<1>();
        else
          ptx::bulk_wait_read<0>();
      }
    }
    ptx::wgmma_wait<0>();  // dK
    if (!prm.q_once) {  // Q_g is free
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&sm.g_empty);
    }
    ptx::named_barrier(2 + c, 128);  // P̂ᵀ's staged rows have been read
    // every consumer thread releases the stage for its own dQ staging stores (the issuer once the
    // reductions have read them, at the next tile): each store is then ordered before the producer's
    // next loads into the stage by its own thread's arrival, the form racecheck follows
    // (dev/cuda/05_sm90_racecheck_chain.cu: it does not follow a release through a named barrier)
    if (!issuer) ptx::mbar_arrive(&sm.empty[st]);
#pragma unroll
    for (int m = 0; m < C::kVBlocks; ++m) fence_acc(dv[m]);
#pragma unroll
    for (int m = 0; m < C::kQkBlocks; ++m) fence_acc(dk[m]);
  }

  if (issuer) {  // (the shared sources stay until read)
    ptx::bulk_wait_all();
    if (kDet && tiles > 0) {  // the last tile's additions: the producer publishes them
      ptx::fence_proxy_async_global();
      ptx::mbar_arrive(&sm.empty[(tiles - 1) & 1]);
    }
  }
  // dKᵀ, dVᵀ [d][key] fragments -> dk, dv (bf16): d = 64 m + r0 + 8 hh, key 48 c + 8 j + 2 (lane % 4) + e
#pragma unroll
  for (int j = 0; j < 6; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int kw = c * C::kWN + 8 * j + 2 * (lane % 4) + e;
      if (kw >= nj) continue;
      const int64_t tok = s.kv0 + j0 + kw;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
        for (int m = 0; m < C::kVBlocks; ++m)
          write_bf16(p.dv, p.dv_v, b, tok, hk, 64 * m + r0 + 8 * hh, dv[m][4 * j + 2 * hh + e]);
#pragma unroll
        for (int m = 0; m < C::kQkBlocks; ++m)
          write_bf16(p.dk, p.dk_v, b, tok, hk, 64 * m + r0 + 8 * hh, dk[m][4 * j + 2 * hh + e]);
      }
    }
}

// dq (bf16, its view) from the fp32 accumulator ([2][rows][d_qk / 2], chunks rotated: see above),
// rows in row_index order (thd: [H][total_q], tokens outside every sequence hold 0). Grid
// (ceil(tokens / 8), H, B) (thd: tokens = total_q, B 1), block (d_qk / 8, 8): a thread rounds 8
// consecutive values of one row — one rotated 32-byte chunk of the accumulator, two 16-byte loads;
// one 16-byte store where dq's data and strides allow it (vec), else 8 element stores. No division
// by a runtime value (they made this pass instruction-bound).
__global__ void __launch_bounds__(192) bwd_dq_round(const __grid_constant__ AttentionBwdProblem p, const float* acc,
                                                    int64_t rows, int64_t row_first, int64_t h0, bool vec) {
  const int64_t tok = int64_t{blockIdx.x} * 8 + threadIdx.y;
  if (tok >= (p.thd ? p.total_q : p.Sq)) return;
  const int64_t h = h0 + blockIdx.y, b = blockIdx.z;
  const int64_t row = p.thd ? h * p.total_q + tok : (b * p.H + h) * p.Sq + tok;
  const int half = static_cast<int>(p.Dqk / 2), d0 = 8 * static_cast<int>(threadIdx.x);
  const int c = d0 >= half, dc = d0 - c * half;
  const int jr = (dc / 8 + static_cast<int>(row % 8)) % (half / 8);
  const float4* src = reinterpret_cast<const float4*>(acc + (c * rows + row - row_first) * half + jr * 8);
  const float4 lo = src[0], hi = src[1];
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  uint16_t* dst = p.dq + b * p.dq_v.st_b + tok * p.dq_v.st_s + h * p.dq_v.st_h + d0;
  uint16_t o[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = __bfloat16_as_ushort(__float2bfloat16_rn(v[k]));
  if (vec) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(o[0] | (uint32_t{o[1]} << 16), o[2] | (uint32_t{o[3]} << 16),
                                                o[4] | (uint32_t{o[5]} << 16), o[6] | (uint32_t{o[7]} << 16));
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) dst[k] = o[k];
  }
}

template <int kDqk, int kDv, bool kDet, bool kFp8Kv>
void launch(const Params& prm, int64_t n_kv, cudaStream_t s) {
  using C = Cfg<kDqk, kDv>;
  constexpr size_t kSmem = sizeof(Smem<C>) + 1024;  // + the 1024-byte alignment of the swizzled tiles
  static_assert(kSmem <= 232448, "227 KB of shared memory per block on SM90");
  const AttentionBwdProblem& p = prm.p;
  MXMLA_CUDA_CHECK(cudaFuncSetAttribute(bwd_sm90<kDqk, kDv, kDet, kFp8Kv>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmem)));
  // the CTAs in flight share a few heads' Q, dO (and LSE, D) in L2; within a head the first key blocks
  // (causal: the most query tiles) start first (kDet: the last, see the kernel), and (not kDet) the
  // heads run in chunks, key block by key block, so that a launch ends on short CTAs
  const unsigned key_blocks = grid_dim(kOp, (p.Skv + C::kBN - 1) / C::kBN, true, "keys"),
                 heads = grid_dim(kOp, n_kv, false, "heads");
  const bool fits32 = uint64_t{key_blocks} * heads <= UINT32_MAX;  // (the kernel's CTA index)
  const auto order_g = fits32 ? static_cast<uint32_t>(heuristics::attn_bwd_order_heads(key_blocks, heads)) : 1u;
  for_sequence_chunks(kOp, p.B, p.thd, [&](int64_t b0, unsigned n) {
    Params c = prm;
    c.p = attn_bwd::sequence_chunk(p, b0, n);
    c.order_g = order_g;
    bwd_sm90<kDqk, kDv, kDet, kFp8Kv><<<dim3(key_blocks, heads, n), C::kThreads, kSmem, s>>>(c);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace

bool sm90_attention_bwd_supported(const AttentionBwdProblem& p, bool do_once) {
  if (!do_once || p.Dv != 128 || (p.Dqk != 192 && p.Dqk != 128)) return false;
  if (p.Hkv > 65535 || (!p.thd && p.B > kMaxGridSequences)) return false;  // grid y, z (thd: in chunks)
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return false;
  return major == 9;
}

Sm90DqAcc sm90_attention_bwd_acc(const AttentionBwdProblem& p, cudaStream_t s, int64_t h0, int64_t heads) {
  Sm90DqAcc acc;
  const int64_t tokens = p.thd ? p.total_q : p.Sq;
  if (heads == p.H) {
    acc.rows = p.thd ? p.H * p.total_q : p.B * p.H * p.Sq;
  } else {  // the rows of heads h0 .. h0 + heads − 1: contiguous for one sequence (bshd, sbhd, bhsd) or thd
    if (!p.thd && p.B != 1) throw Error(kOp, "q", "internal: a dQ accumulator for a range of heads needs b = 1 or thd");
    acc.h0 = h0, acc.row0 = h0 * tokens, acc.rows = heads * tokens;
  }
  acc.heads = heads;
  // deterministic: the tiles' flags ([2][rows] int32) after the sums, zeroed with them
  const int64_t bytes = acc.rows * p.Dqk * 4 + (p.deterministic ? acc.rows * 2 * 4 : 0);
  acc.mem = std::make_unique<StreamScratch>(bytes, s);  // freed on the stream after the kernels
  if (p.deterministic) acc.flag = reinterpret_cast<int*>(static_cast<uint8_t*>(acc.mem->ptr) + acc.rows * p.Dqk * 4);
  if (acc.rows > 0) MXMLA_CUDA_CHECK(cudaMemsetAsync(acc.mem->ptr, 0, bytes, s));
  return acc;
}

void sm90_attention_bwd_heads(const Sm90BwdArgs& a, const Sm90DqAcc& acc, int64_t hk0, int64_t n_kv, cudaStream_t s) {
  const AttentionBwdProblem& p = a.p;  // none: dK = dV = 0 still to write
  Params prm;
  prm.p = p;
  prm.D = a.D;
  prm.dq_acc = reinterpret_cast<float*>(acc.mem->ptr);
  prm.dq_rows = acc.rows, prm.dq_row0 = acc.row0;
  prm.hk0 = hk0;
  prm.q_once = a.q_once;
  prm.dq_flag = acc.flag;
  if (p.Skv > 0 && p.B > 0 && n_kv > 0) {
    using Launch = void (*)(const Params&, int64_t, cudaStream_t);
    static constexpr Launch kLaunch[2][2][2] = {  // [d_qk 192][deterministic][FP8 key-side reads]
        {{launch<128, 128, false, false>, launch<128, 128, false, true>},
         {launch<128, 128, true, false>, launch<128, 128, true, true>}},
        {{launch<192, 128, false, false>, launch<192, 128, false, true>},
         {launch<192, 128, true, false>, launch<192, 128, true, true>}}};
    const bool fp8_kv = p.k_s.fp8 || p.k_g.fp8 || p.v_s.fp8;
    kLaunch[p.Dqk == 192][p.deterministic][fp8_kv](prm, n_kv, s);
  }
}

void sm90_attention_bwd_finish(const AttentionBwdProblem& p, const Sm90DqAcc& acc, cudaStream_t s) {
  const int64_t tokens = p.thd ? p.total_q : p.Sq, batches = p.thd ? 1 : p.B;
  if (acc.rows == 0 || tokens == 0 || acc.heads == 0 || batches == 0) return;
  const bool vec = reinterpret_cast<uintptr_t>(p.dq) % 16 == 0 && p.dq_v.st_b % 8 == 0 && p.dq_v.st_s % 8 == 0 &&
                   p.dq_v.st_h % 8 == 0;  // (element strides: 16 bytes = 8 values)
  const dim3 grid(grid_dim(kOp, (tokens + 7) / 8, true, "rows"), grid_dim(kOp, acc.heads, false, "heads"),
                  grid_dim(kOp, batches, false, "sequences"));
  bwd_dq_round<<<grid, dim3(static_cast<unsigned>(p.Dqk / 8), 8), 0, s>>>(p, reinterpret_cast<const float*>(acc.mem->ptr),
                                                                           acc.rows, acc.row0, acc.h0, vec);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mxmla::detail
