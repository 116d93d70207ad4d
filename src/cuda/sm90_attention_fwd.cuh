// mxmla internal — the SM90 attention forward kernel (include/mxmla/attention.h, SPEC §5): traits,
// parameters and the body. Launcher: sm90_attention_fwd.cu.
//
// One CTA per SM, persistent; a work tile is (sequence b, head h, 128 query rows). Four warpgroups:
//   WG0 warp 0  producer: TMA loads of the codes (FP8) or of the bf16 operands;
//   WG1         dequantizer: FP8 codes + E8M0 scales -> bf16 tiles in the wgmma layout, one thread
//               per tile row (cuda/sm90/dequant_mxfp8_bf16.cuh), scales read from global memory
//               through the operand's scale geometry while the codes are in flight. Fused path
//               (p.fp8): Q, K, V from the FP8 stages; staged path (p.q_fp8: K, V bf16 copies):
//               Q only, its codes expanded in place in the Q tile; bf16 inputs: idle;
//   WG2, WG3    consumers: 64 query rows each; S = Q·Kᵀ (wgmma bf16, Q and K from shared memory),
//               online softmax in fp32, O += P·V (P from registers, V from shared memory N-major);
//               the softmax of S_j runs while O += P_{j-1}·V_{j-1} is on the tensor cores
//               (FlashAttention-3's intra-warpgroup overlap). O / l as bf16: staged in the V slot of
//               the tile's last P·V and stored by TMA (FlashAttention-3's epilogue; bf16 slots, tiles
//               whose rows TMA may write), else stored from the registers.
// Shared memory (d_qk 192, d_v 128): Q bf16 48 KB, K and V bf16 (48 + 32 KB), and either two FP8
// stages (K codes 24 KB, also Q's, + V codes 16 KB; FP8 inputs) or second K / V slots (bf16 inputs),
// the V scale factors. bf16 tiles are 64-column blocks of
// [128 rows][128 B] with the 128-byte swizzle; FP8 staging tiles 64-byte blocks with the 64-byte
// swizzle (conflict-free row-per-thread reads).
// thd: a sequence's last key tile may reach into the next sequence's tokens; those keys are masked
// (P = 0), and their V rows are zeros (0·Inf = NaN otherwise): the FP8 dequantizer writes zeros for
// rows outside the sequence, and on bf16 tiles the consumers zero those rows before the tile's P·V.
// Work order: heads in groups whose K/V fit in L2 together; inside a group the query blocks with
// the most keys first (causal), all heads of the group per query block; causal and thd launches
// claim their tiles in that order from a counter (TileFeed below), others take every G-th.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)

#include <cstdint>

#include "common/attention_ops.h"
#include "cuda/numerics.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/dequant_mxfp8_bf16.cuh"
#include "cuda/sm90/pipeline.cuh"

namespace mxmla::detail::attn {

// ---------------------------------------------------------------- configuration
template <int kDqk_, int kDv_>
struct Cfg {
  static constexpr int kDqk = kDqk_, kDv = kDv_;
  static constexpr int kBM = 128;  // query rows per tile (two consumer warpgroups of 64)
  static constexpr int kBN = 128;  // keys per K/V tile (a BHSD scale tile, SPEC §2.2)
  static constexpr int kQkBlocks = kDqk / 64, kVBlocks = kDv / 64;  // 64-column bf16 blocks
  static constexpr int kThreads = 512;
  static constexpr int kFirstConsumerWG = 2;
  static constexpr int kRegsProducer = 24, kRegsDequant = 72, kRegsConsumer = 208;
  static constexpr int kMaxVScaleRows = kBN / 32 + 1;  // 32-key scale rows a tile can touch (thd)
  static_assert(kDqk % 64 == 0 && kDv % 64 == 0 && kDqk <= 192 && kDv <= 128, "head dims");
  static_assert(kRegsProducer * 128 + kRegsDequant * 128 + 2 * kRegsConsumer * 128 <= 65536, "register file");
};

// Named barriers (0 is __syncthreads'): the dequantizer warpgroup's, the two consumer warpgroups'.
constexpr uint32_t kDequantBarrier = 1, kConsumerBarrier = 2;
// ... and each consumer warpgroup's own (O staged for its TMA store): kOStagedBarrier + its index.
constexpr uint32_t kOStagedBarrier = 3;

// The softmax's exponent folds the scale into one FFMA while every |row maximum of S·scale·log2 e|
// of a warp stays below this (the consumers' softmax says why).
constexpr float kFoldLimit = 1024.f;

struct OperandParams {
  AttnTensorView view;
  AttnScaleView sc;
};

struct Params {
  int B, H, Hkv, Sq, Skv;  // thd: Sq / Skv are max lengths
  int num_mblocks, heads_per_group, num_tiles;
  bool thd, causal, bottom_right, e4m3_p;
  bool fp8;     // Q, K, V FP8 codes (the fused path: the dequantizer converts every tile)
  bool q_fp8;   // with fp8 false: Q FP8 codes (the dequantizer converts Q in place), K, V bf16
  const int32_t* cu_q;
  const int32_t* cu_kv;
  int64_t total_q, total_kv;  // thd: the packed token counts (every range is clamped to them)
  float scale_log2;  // softmax_scale * log2(e)
  OperandParams q, k, v;
  uint16_t* o;
  int64_t o_st_b, o_st_s, o_st_h;
  bool tma_o;  // O by TMA stores (tmap_o) where a tile's rows allow it (bf16 K / V slots only)
  float* lse;
  int* tile_counter;  // non-null: tiles claimed from this counter (zero at launch), else t = b, b + G, ...
};

// The inputs an instantiation takes: kBf16, bf16 Q, K, V only (p.fp8 and p.q_fp8 false), the
// producer without the FP8 branches and the dequantizer idle at compile time; kQCodes, the staged
// path's (Q's FP8 codes, expanded in place by the dequantizer, K and V bf16: p.q_fp8 true, p.fp8
// false); kAny, every mode, chosen by p.fp8 / p.q_fp8 (the fused path's).
enum class Inputs { kBf16, kQCodes, kAny };

template <int kDqk, int kDv, bool kE4M3Codes, Inputs kInputs = Inputs::kAny>
struct Kernel {
  using C = Cfg<kDqk, kDv>;
  static constexpr bool kE4M3 = kE4M3Codes;
  static constexpr Inputs kIn = kInputs;
  // When O takes a key block's rescale: false, once the previous P·V has landed (before the next S
  // GEMM's issue); true, after the next S GEMM's issue, under it (FlashAttention-3's place). Either
  // way the multiplication falls between the same two P·V accumulations: the same bits. Chosen per
  // instantiation by a same-run A/B (H200, ptxas of CUDA 13.0): the FP8 inputs' instantiation
  // 1.1-1.6 % faster with true, the bf16-only one 2.9-4.6 % slower (docs/notes-attention.md).
  static constexpr bool kRescaleUnderS = kInputs != Inputs::kBf16;  // true in the FP8 instantiations
  // The producer's and the dequantizer's register budgets (their sum is Cfg's). The bf16-only
  // instantiation's dequantizer is idle, so its producer takes its registers: ptxas spills nothing
  // where 24 spilled 364 bytes, and a same-run A/B (H100, 3 rounds) timed bf16 inputs 0.9-2.8 %
  // faster. With every mode Cfg's 24 / 72 stay: 40 / 56 or 32 / 64 (fewer spills) made the fused
  // path, whose dequantizer is on the critical path, 13 % slower (dev/patches/attn_fwd_producer_regs.patch).
  // The staged path's instantiation, whose dequantizer expands Q only: 48 / 48 (ptxas, d_qk 192:
  // 156 bytes of spills; 436 with 24 / 72, 712 in the every-mode instantiation it ran on before).
  // Same-run A/B against it there (H100, 3 rounds): 0.957 / 0.981 / 0.990x the time at s 2048 /
  // 4096 / 8192; 40 / 56, 0.955 / 0.980 / 0.998x (dev/patches/attn_fwd_staged_instantiation.patch).
  static constexpr int kRegsProducer =
      kInputs == Inputs::kBf16 ? 72 : (kInputs == Inputs::kQCodes ? 48 : C::kRegsProducer);
  static constexpr int kRegsDequant =
      kInputs == Inputs::kBf16 ? 24 : (kInputs == Inputs::kQCodes ? 48 : C::kRegsDequant);
  static_assert(kRegsProducer + kRegsDequant == C::kRegsProducer + C::kRegsDequant, "register file");
  struct alignas(1024) Smem {
    uint8_t q[C::kQkBlocks][C::kBM * 128];   // bf16 Q, 128-byte swizzle
    uint8_t k0[C::kQkBlocks][C::kBN * 128];  // bf16 K, slot 0
    uint8_t v0[C::kVBlocks][C::kBN * 128];   // bf16 V, slot 0 (read N-major by the P·V wgmma)
    union {
      // FP8 inputs: two stages of codes (K's also carry Q's), 64-byte blocks with the 64-byte swizzle
      struct {
        uint8_t kc[C::kQkBlocks][C::kBN * 64];
        uint8_t vc[C::kVBlocks][C::kBN * 64];
      } fp8[2];
      // bf16 inputs: the second K and V slots
      struct {
        uint8_t k[C::kQkBlocks][C::kBN * 128];
        uint8_t v[C::kVBlocks][C::kBN * 128];
      } bf16;
    } x;
    uint16_t vf[C::kMaxVScaleRows][128];     // V fast factors (bf16 bits) per 32-key scale row and column
    uint8_t vf_raw[C::kMaxVScaleRows][128];  // the scale bytes (exact path)
    sm90::Handoff fp8_stage[2], q_tile, k_tile[2], v_tile[2];
    sm90::Handoff q_codes;  // q_fp8: Q's codes landed in the Q tile (full only: q_tile orders the reuse)
    sm90::Handoff feed[2];  // the producer's claimed tiles, handed to the other roles (dynamic order)
    int feed_tile[2];
  };
  // K / V slot s (FP8 inputs use slot 0 only: the FP8 stages take the second slots' memory)
  __device__ __forceinline__ static uint8_t* k_slot(Smem& sm, int s) { return s ? sm.x.bf16.k[0] : sm.k0[0]; }
  __device__ __forceinline__ static uint8_t* v_slot(Smem& sm, int s) { return s ? sm.x.bf16.v[0] : sm.v0[0]; }
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");
};

// ---------------------------------------------------------------- work tiles
struct Tile {
  int b, h, hk, m;        // sequence, head, kv head, query block
  int q0, len_q;          // first packed query row of the sequence (thd), rows of the sequence
  int kv0, len_kv;
  int n_blocks;           // key tiles to visit (0: rows without keys)
  int key_off;            // causal: key j visible to query i iff j <= i + key_off
  bool valid;             // the query block holds rows of the sequence
};

__device__ __forceinline__ Tile tile_at(const Params& p, int t) {
  Tile w;
  const int BH = p.B * p.H, G = p.heads_per_group, per_group = G * p.num_mblocks;
  const int g = t / per_group, r = t % per_group;
  const int g_heads = min(G, BH - g * G);
  const int mi = r / g_heads, bh = g * G + r % g_heads;
  w.m = p.causal ? p.num_mblocks - 1 - mi : mi;
  w.b = bh / p.H, w.h = bh % p.H;
  w.hk = w.h / (p.H / p.Hkv);
  if (p.thd) {  // cu_seqlens clamped to the tensors: a bad one cannot reach outside them
    const auto clamp_to = [](int64_t v, int64_t lo, int64_t hi) { return static_cast<int>(v < lo ? lo : (v > hi ? hi : v)); };
    w.q0 = clamp_to(p.cu_q[w.b], 0, p.total_q);
    w.len_q = clamp_to(p.cu_q[w.b + 1], w.q0, p.total_q) - w.q0;
    w.kv0 = clamp_to(p.cu_kv[w.b], 0, p.total_kv);
    w.len_kv = clamp_to(p.cu_kv[w.b + 1], w.kv0, p.total_kv) - w.kv0;
  } else {
    w.q0 = 0, w.len_q = p.Sq, w.kv0 = 0, w.len_kv = p.Skv;
  }
  w.valid = w.m * 128 < w.len_q;
  w.key_off = p.bottom_right ? w.len_kv - w.len_q : 0;
  int n_end = w.len_kv;
  if (p.causal) n_end = min(n_end, min(w.len_q, (w.m + 1) * 128) - 1 + w.key_off + 1);
  w.n_blocks = n_end > 0 ? (n_end + 127) / 128 : 0;
  return w;
}

// ---------------------------------------------------------------- scales (global -> registers)
// The scale geometry of one (b, h) of an operand, resolved once per work tile (the runtime
// divisions of the ScaleMap) so that a row's offsets are shifts and adds.
// Rowwise: byte of (packed row s, column block j) = cursor_offset(cur, row(s)) + step(j).
struct RowScaleCursor {
  ScaleCursor cur;
  int64_t row_base, row_s;
  __device__ __forceinline__ RowScaleCursor(const AttnScaleView& v, int b, int h) {
    row_base = b * v.row_b + h * v.row_h + v.row0, row_s = v.row_s;
    cur = row_cursor(v.map, b * v.bi_b, (b * v.col_b + h * v.col_h) / 32);
  }
  __device__ __forceinline__ int64_t at(int64_t s_packed, int j) const {
    const int64_t off = cursor_offset(cur, row_base + s_packed * row_s);
    if (cur.compact) return off + j;
    const int64_t j1 = cur.j + j;  // F8_128x4: column j's tile (j / 4) and slot (j % 4)
    return off + (j1 / 4 - cur.j / 4) * 512 + (j1 % 4 - cur.j % 4);
  }
};
// Columnwise: byte of (32-row block rb, column d) = at(rb) for this thread's column.
struct ColScaleCursor {
  int64_t off0, rb0, step;  // offset of block rb0; compact: bytes per block row (0: swizzled)
  __device__ __forceinline__ ColScaleCursor(const AttnScaleView& v, int b, int h, int64_t rb, int d) {
    const ScaleCursor c = col_cursor(v.map, b * v.bi_b, rb, b * v.col_b + h * v.col_h + d);
    off0 = cursor_offset(c, 0), rb0 = rb, step = c.compact ? v.map.cols : 0;
  }
  __device__ __forceinline__ int64_t at(int64_t rb) const {
    if (step != 0) return off0 + (rb - rb0) * step;
    return off0 + (rb / 4 - rb0 / 4) * 512 + (rb % 4 - rb0 % 4);
  }
};
__device__ __forceinline__ int64_t col_row0(const AttnScaleView& v, int b, int h) {
  return b * v.row_b + h * v.row_h + v.row0;
}

// ---------------------------------------------------------------- small pieces
// A row's 64-code block cb, its four 16-code chunks in x -> bf16 by the fast path (fac(q, f): the
// bf16x2 fast factors of chunk q's 8 pairs) into bf16 block cb of the tile at dst (128-byte rows,
// 128-byte swizzle); ORs the chunks' special-code masks (dequant16_fast's) into `special`.
template <bool kE4M3, class Fac>
__device__ __forceinline__ void dequant_block_fast(const uint4 (&x)[4], int cb, Fac& fac, uint8_t* __restrict__ dst,
                                                   int row, uint32_t& special) {
  const auto dst_at = [&](int half) {  // half = 16-byte chunk 0..7 of the 128-byte row
    return reinterpret_cast<uint4*>(dst + cb * 128 * 128 + row * 128 + ((half ^ (row & 7)) * 16));
  };
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t f[8], out[8];
    fac(cb * 4 + c, f);
    special |= sm90::dequant16_fast<kE4M3>(x[c], f, out);
    *dst_at(2 * c) = make_uint4(out[0], out[1], out[2], out[3]);
    *dst_at(2 * c + 1) = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// One row of FP8 codes (kBlocks 64-code blocks, 64-byte swizzle) -> bf16 (kBlocks 64-column blocks,
// 128-byte swizzle). For 16-code chunk q: fac(q, f) gives the bf16x2 fast factors of its 8 pairs,
// ebytes(q) its 16 scale bytes (uint4) for the exact path. `valid` false writes zeros (rows outside
// the sequence).
template <bool kE4M3, int kBlocks, class Fac, class Ebytes>
__device__ __forceinline__ void dequant_row(const uint8_t* __restrict__ codes, uint8_t* __restrict__ dst, int row,
                                            bool valid, bool exact, Fac&& fac, Ebytes&& ebytes) {
  // plain C++ shared-memory accesses (not volatile asm): the compiler may run the loads of later
  // chunks ahead of the arithmetic of earlier ones
  const auto src_at = [&](int cb, int c) {
    return reinterpret_cast<const uint4*>(codes + cb * 128 * 64 + row * 64 + ((c ^ ((row >> 1) & 3)) * 16));
  };
  const auto dst_at = [&](int cb, int half) {  // half = 16-byte chunk 0..7 of the 128-byte row
    return reinterpret_cast<uint4*>(dst + cb * 128 * 128 + row * 128 + ((half ^ (row & 7)) * 16));
  };
  if (!valid) {
#pragma unroll
    for (int cb = 0; cb < kBlocks; ++cb)
#pragma unroll
      for (int h = 0; h < 8; ++h) *dst_at(cb, h) = make_uint4(0, 0, 0, 0);
    return;
  }
  uint32_t special = 0;
  if (!exact) {
#pragma unroll
    for (int cb = 0; cb < kBlocks; ++cb) {
      uint4 x[4];  // a 64-code block's loads first: four in flight, not one
#pragma unroll
      for (int c = 0; c < 4; ++c) x[c] = *src_at(cb, c);
      dequant_block_fast<kE4M3>(x, cb, fac, dst, row, special);
    }
  }
  if (exact || special != 0) {  // rare: NaN / Inf codes, NaN or very large scales
#pragma unroll 1
    for (int cb = 0; cb < kBlocks; ++cb)
#pragma unroll 1
      for (int c = 0; c < 4; ++c)
        sm90::dequant16_exact_store<kE4M3>(*src_at(cb, c), ebytes(cb * 4 + c), ptx::smem_u32(dst_at(cb, 2 * c)),
                                           ptx::smem_u32(dst_at(cb, 2 * c + 1)));
  }
}

// Q's codes in place (q_fp8): the producer lands them (kBlocks 64-code blocks, 64-byte swizzle) in
// the upper half of the bf16 Q tile (kQCodes on), and each dequantizer thread expands its row, block
// by block. bf16 block cb covers only code blocks up to cb (block 0 none), so a thread reads code
// block cb into registers, and from block 1 on every thread has read it (and those before it) at the
// dequantizer's barrier before any writes over them. The exact path (NaN / Inf codes, large
// scales) converts from those registers too.
template <bool kE4M3, int kBlocks, class Fac, class Ebytes>
__device__ __forceinline__ void dequant_q_in_place(uint8_t* __restrict__ q, int row, bool valid, bool exact,
                                                   Fac&& fac, Ebytes&& ebytes) {
  static_assert(kBlocks >= 2, "block 0's bf16 must lie below the codes");
#pragma unroll
  for (int cb = 0; cb < kBlocks; ++cb) {
    const auto dst_at = [&](int half) {
      return reinterpret_cast<uint4*>(q + cb * 128 * 128 + row * 128 + ((half ^ (row & 7)) * 16));
    };
    uint4 x[4];
#pragma unroll
    for (int c = 0; c < 4; ++c)
      x[c] = *reinterpret_cast<const uint4*>(q + kBlocks * 128 * 64 + cb * 128 * 64 + row * 64 +
                                             ((c ^ ((row >> 1) & 3)) * 16));
    if (cb > 0) ptx::named_barrier(kDequantBarrier, 128);  // every thread's code block cb (and before) read
    if (!valid) {
#pragma unroll
      for (int h = 0; h < 8; ++h) *dst_at(h) = make_uint4(0, 0, 0, 0);
      continue;
    }
    uint32_t special = 0;
    if (!exact) dequant_block_fast<kE4M3>(x, cb, fac, q, row, special);
    if (exact || special != 0) {
#pragma unroll  // (x indexed by constants: it stays in registers)
      for (int c = 0; c < 4; ++c)
        sm90::dequant16_exact_store<kE4M3>(x[c], ebytes(cb * 4 + c), ptx::smem_u32(dst_at(2 * c)),
                                           ptx::smem_u32(dst_at(2 * c + 1)));
    }
  }
}

// The rowwise scales of one row (kDqk / 32 blocks): bytes and bf16x2 fast factors.
template <bool kE4M3, int kNB>
struct RowScales {
  uint8_t e[kNB];
  bool exact = false;
  __device__ __forceinline__ void load(const uint8_t* ptr, const RowScaleCursor& c, int64_t s_packed, bool valid) {
#pragma unroll
    for (int j = 0; j < kNB; ++j) e[j] = valid ? ptx::ld_global_nc_u8(ptr + c.at(s_packed, j)) : uint8_t{127};
  }
  __device__ __forceinline__ void finish() {
    exact = false;
#pragma unroll
    for (int j = 0; j < kNB; ++j) exact |= e[j] > sm90::Fp8Bf16<kE4M3>::kMaxFastE;
  }
  // chunk q = 16 columns: block q / 2
  __device__ __forceinline__ void fac(int q, uint32_t (&f)[8]) const {
    const uint32_t b = sm90::fast_factor_bits<kE4M3>(e[q / 2]);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = b | (b << 16);
  }
  __device__ __forceinline__ uint4 bytes(int q) const {
    const uint32_t b = e[q / 2] * 0x01010101u;
    return make_uint4(b, b, b, b);
  }
};

// e4m3 P (the reference system's): p * 2^8 -> E4M3 (nearest even, saturating) -> / 2^8, as bf16.
__device__ __forceinline__ uint32_t p_e4m3_bf16x2(float lo, float hi) {
  const uint16_t c = ptx::cvt_fp8x2<true>(lo * 256.0f, hi * 256.0f);
  const uint32_t h2 = ptx::cvt_f16x2_from_fp8x2<true>(c);
  const __half2 hv = *reinterpret_cast<const __half2*>(&h2);
  return bf16x2_rn(__low2float(hv) * (1.0f / 256.0f), __high2float(hv) * (1.0f / 256.0f));
}

// ---------------------------------------------------------------- tile order
// Static: CTA b takes tiles b, b + G, ... (G CTAs). Dynamic (p.tile_counter): the producer claims
// its next tile from the launch's counter (G + the counter's old value: the first tile is b), so
// that a CTA that drew short tiles takes more; it hands each tile index (num_tiles or more: done)
// to the other roles through a two-slot ring. A causal launch's tiles differ in length by up to
// s / 128 times: counted in key blocks, the static order gives the busiest CTA 26 % more than the
// mean at s 2048 (h 128), a greedy dynamic one 2 %.
template <class Smem>
struct TileFeed {
  Smem& sm;
  const Params& p;
  uint32_t n = 0;
  // A reading thread's next tile: it waits for the slot, reads it and releases it (every reading
  // thread arrives on `empty`).
  __device__ __forceinline__ int next(int t) {
    if (p.tile_counter == nullptr) return t < 0 ? static_cast<int>(blockIdx.x) : t + static_cast<int>(gridDim.x);
    const int slot = n & 1;
    sm.feed[slot].consumer_wait(n >> 1);
    const int r = *reinterpret_cast<volatile const int*>(&sm.feed_tile[slot]);
    sm.feed[slot].consumer_release();
    ++n;
    return r;
  }
  // The producer: publish tile t (dynamic order).
  __device__ __forceinline__ void publish(int t) {
    if (p.tile_counter == nullptr) return;
    const int slot = n & 1;
    sm.feed[slot].producer_wait(n >> 1);
    *reinterpret_cast<volatile int*>(&sm.feed_tile[slot]) = t;
    sm.feed[slot].producer_commit();
    ++n;
  }
};

// ---------------------------------------------------------------- the kernel
template <class K>
__global__ void __launch_bounds__(512, 1)
    sm90_attention_fwd_kernel(const __grid_constant__ CUtensorMap tmap_q, const __grid_constant__ CUtensorMap tmap_k,
                              const __grid_constant__ CUtensorMap tmap_v, const __grid_constant__ CUtensorMap tmap_o,
                              const Params p) {
  using C = typename K::C;
  constexpr int kDqk = C::kDqk, kDv = C::kDv;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = sm90::aligned_shared<typename K::Smem>(smem_raw);
  const int wg = ptx::warpgroup_index();
  // the modes, read from the parameters at each use (compile-time constants but in the every-mode
  // instantiation: both false with bf16 inputs, q_fp8 true and fp8 false on the staged path)
  const auto fp8 = [&] { return K::kIn == Inputs::kAny && p.fp8; };
  const auto q_fp8 = [&] { return K::kIn == Inputs::kQCodes || (K::kIn == Inputs::kAny && p.q_fp8); };
  const uint32_t kv_mask = fp8() ? 0u : 1u, kv_shift = fp8() ? 0u : 1u;  // K / V slots: 1 (FP8) or 2
  constexpr int kQCodes = C::kQkBlocks * 128 * 64;  // q_fp8: where Q's codes land in the Q tile

  sm90::init_barriers_once([&] {
    const uint32_t filled_by = fp8() ? 4 : 1;  // dequantizer warps, or the producer's expect_tx
    const bool dequant_q = fp8() || q_fp8();
    for (int i = 0; i < 2; ++i) {
      sm.fp8_stage[i].init(1, 4);
      sm.k_tile[i].init(filled_by, 8);
      sm.v_tile[i].init(filled_by, 8);
    }
    // q_tile is filled by the producer's expect_tx (bf16 Q), the dequantizer's warps (fused path), or
    // every dequantizer thread (q_fp8: each thread's bf16 stores cover codes that other threads read
    // in the next tile, so each storing thread arrives itself, the form compute-sanitizer's racecheck
    // follows through an mbarrier)
    sm.q_tile.init(fp8() ? 4 : (q_fp8() ? 128 : 1), 8);
    sm.q_codes.init(1, 1);
    for (int i = 0; i < 2; ++i) sm.feed[i].init(1, dequant_q ? 384 : 256);  // consumer (+ dequantizer) threads
  });

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    ptx::setmaxnreg_dec<K::kRegsProducer>();
    if (threadIdx.x != 0) return;
    ptx::prefetch_tmap(&tmap_q);
    ptx::prefetch_tmap(&tmap_k);
    ptx::prefetch_tmap(&tmap_v);
    uint32_t n_fp8 = 0, n_q = 0, n_k = 0, n_v = 0;
    TileFeed<typename K::Smem> feed{sm, p};
    const int G = static_cast<int>(gridDim.x);
    // the next tile is claimed as this one starts and read once its loads are issued
    for (int t = blockIdx.x, claim = 0;; t = p.tile_counter != nullptr ? G + claim : t + G) {
      feed.publish(t);
      if (t >= p.num_tiles) break;
      if (p.tile_counter != nullptr) claim = atomicAdd(p.tile_counter, 1);
      const Tile w = tile_at(p, t);
      if (!w.valid || w.n_blocks == 0) continue;
      const int qs = w.q0 + w.m * 128;
      const int bc = p.thd ? 0 : w.b;  // thd: one packed batch in the tensor maps
      if (fp8()) {
        {
          auto& st = sm.fp8_stage[n_fp8 & 1];
          st.producer_wait(n_fp8 >> 1);
          ptx::mbar_arrive_expect_tx(&st.full, 128 * kDqk);
          for (int cb = 0; cb < C::kQkBlocks; ++cb)
            ptx::tma_load_4d(sm.x.fp8[n_fp8 & 1].kc[cb], &tmap_q, &st.full, cb * 64, w.h, qs, bc);
          ++n_fp8;
        }
        for (int j = 0; j < w.n_blocks; ++j, ++n_fp8) {
          const int ks = w.kv0 + j * 128;
          auto& st = sm.fp8_stage[n_fp8 & 1];
          auto& buf = sm.x.fp8[n_fp8 & 1];
          st.producer_wait(n_fp8 >> 1);
          ptx::mbar_arrive_expect_tx(&st.full, 128 * (kDqk + kDv));
          for (int cb = 0; cb < C::kQkBlocks; ++cb) ptx::tma_load_4d(buf.kc[cb], &tmap_k, &st.full, cb * 64, w.hk, ks, bc);
          for (int cb = 0; cb < C::kVBlocks; ++cb) ptx::tma_load_4d(buf.vc[cb], &tmap_v, &st.full, cb * 64, w.hk, ks, bc);
        }
      } else {
        sm.q_tile.producer_wait(n_q++);
        if (q_fp8()) {  // the codes into the Q tile's upper half; the dequantizer expands them in place
          ptx::mbar_arrive_expect_tx(&sm.q_codes.full, 128 * kDqk);
          for (int cb = 0; cb < C::kQkBlocks; ++cb)
            ptx::tma_load_4d(reinterpret_cast<uint8_t*>(sm.q) + kQCodes + cb * 128 * 64, &tmap_q, &sm.q_codes.full,
                             cb * 64, w.h, qs, bc);
        } else {
          ptx::mbar_arrive_expect_tx(&sm.q_tile.full, 128 * kDqk * 2);
          for (int cb = 0; cb < C::kQkBlocks; ++cb)
            ptx::tma_load_4d(sm.q[cb], &tmap_q, &sm.q_tile.full, cb * 64, w.h, qs, bc);
        }
        for (int j = 0; j < w.n_blocks; ++j) {
          const int ks = w.kv0 + j * 128, kslot = n_k & 1, vslot = n_v & 1;
          sm.k_tile[kslot].producer_wait(n_k++ >> 1);
          ptx::mbar_arrive_expect_tx(&sm.k_tile[kslot].full, 128 * kDqk * 2);
          for (int cb = 0; cb < C::kQkBlocks; ++cb)
            ptx::tma_load_4d(K::k_slot(sm, kslot) + cb * C::kBN * 128, &tmap_k, &sm.k_tile[kslot].full, cb * 64, w.hk, ks, bc);
          sm.v_tile[vslot].producer_wait(n_v++ >> 1);
          ptx::mbar_arrive_expect_tx(&sm.v_tile[vslot].full, 128 * kDv * 2);
          for (int cb = 0; cb < C::kVBlocks; ++cb)
            ptx::tma_load_4d(K::v_slot(sm, vslot) + cb * C::kBN * 128, &tmap_v, &sm.v_tile[vslot].full, cb * 64, w.hk, ks, bc);
        }
      }
    }
    return;
  }

  if (wg == 1) {  // ---------------------------------------------------------------- dequantizer
    ptx::setmaxnreg_dec<K::kRegsDequant>();
    if (!fp8() && !q_fp8()) return;
    constexpr bool kE4 = K::kE4M3;
    const int row = threadIdx.x - 128, lane = threadIdx.x % 32;
    uint32_t n_fp8 = 0, n_q = 0, n_k = 0, n_v = 0;
    TileFeed<typename K::Smem> feed{sm, p};
    for (int t = feed.next(-1); t < p.num_tiles; t = feed.next(t)) {
      const Tile w = tile_at(p, t);
      if (!w.valid || w.n_blocks == 0) continue;
      if (!fp8()) {  // q_fp8: Q only (K, V are bf16 tiles the producer loads)
        const int s = w.m * 128 + row;
        const bool valid = s < w.len_q;
        RowScales<kE4, kDqk / 32> sc;
        sc.load(p.q.sc.ptr, RowScaleCursor(p.q.sc, w.b, w.h), w.q0 + s, valid);
        sm.q_codes.consumer_wait(n_q++);
        sc.finish();
        dequant_q_in_place<kE4, C::kQkBlocks>(reinterpret_cast<uint8_t*>(sm.q), row, valid, sc.exact,
                                              [&](int q, uint32_t(&f)[8]) { sc.fac(q, f); },
                                              [&](int q) { return sc.bytes(q); });
        ptx::fence_proxy_async();
        sm.q_tile.producer_commit();  // every thread (q_tile's count 128)
        continue;
      }
      {  // Q
        const int s = w.m * 128 + row;
        const bool valid = s < w.len_q;
        RowScales<kE4, kDqk / 32> sc;
        sc.load(p.q.sc.ptr, RowScaleCursor(p.q.sc, w.b, w.h), w.q0 + s, valid);
        const int stage = n_fp8 & 1;
        sm.fp8_stage[stage].consumer_wait(n_fp8++ >> 1);
        sc.finish();
        sm.q_tile.producer_wait(n_q++);
        dequant_row<kE4, C::kQkBlocks>(sm.x.fp8[stage].kc[0], sm.q[0], row, valid, sc.exact,
                                       [&](int q, uint32_t(&f)[8]) { sc.fac(q, f); },
                                       [&](int q) { return sc.bytes(q); });
        ptx::fence_proxy_async();
        __syncwarp();
        if (lane == 0) sm.q_tile.producer_commit(), sm.fp8_stage[stage].consumer_release();
      }
      const int64_t vr0 = col_row0(p.v.sc, w.b, w.hk);
      const RowScaleCursor kcur(p.k.sc, w.b, w.hk);
      const ColScaleCursor vcur(p.v.sc, w.b, w.hk, (vr0 + w.kv0) / 32, row < kDv ? row : 0);
      // this thread's scale bytes of key tile j: its K row; its V column in each 32-key scale row
      // the tile touches (issued one tile ahead of their use)
      struct KvScales {
        RowScales<kE4, kDqk / 32> k;
        uint8_t v[C::kMaxVScaleRows];
        int64_t rb0;
      };
      const auto load_scales = [&](int j, KvScales& sc) {
        const int key = j * 128 + row;
        sc.k.load(p.k.sc.ptr, kcur, w.kv0 + key, key < w.len_kv);
        const int64_t first = vr0 + w.kv0 + j * 128;
        const int64_t last_valid = vr0 + w.kv0 + min(j * 128 + 127, w.len_kv - 1);
        sc.rb0 = first / 32;
        const int64_t nrb = last_valid / 32 - sc.rb0 + 1;
#pragma unroll
        for (int r = 0; r < C::kMaxVScaleRows; ++r)
          sc.v[r] = (row < kDv && r < nrb) ? ptx::ld_global_nc_u8(p.v.sc.ptr + vcur.at(sc.rb0 + r)) : uint8_t{127};
      };
      KvScales cur;
      load_scales(0, cur);
      for (int j = 0; j < w.n_blocks; ++j) {
        const int key = j * 128 + row;
        const bool valid = key < w.len_kv;
        KvScales next;
        if (j + 1 < w.n_blocks) load_scales(j + 1, next);
        RowScales<kE4, kDqk / 32>& ks = cur.k;
        const uint8_t(&ve)[C::kMaxVScaleRows] = cur.v;
        const int64_t rb0 = cur.rb0, first = vr0 + w.kv0 + j * 128;
        const int stage = n_fp8 & 1;
        sm.fp8_stage[stage].consumer_wait(n_fp8++ >> 1);
        ks.finish();
        sm.k_tile[0].producer_wait(n_k++);
        dequant_row<kE4, C::kQkBlocks>(sm.x.fp8[stage].kc[0], sm.k0[0], row, valid, ks.exact,
                                       [&](int q, uint32_t(&f)[8]) { ks.fac(q, f); },
                                       [&](int q) { return ks.bytes(q); });
        ptx::fence_proxy_async();
        __syncwarp();
        if (lane == 0) sm.k_tile[0].producer_commit();
        // V factors to shared memory (after every dequantizer thread is done with the last tile's)
        ptx::named_barrier(kDequantBarrier, 128);
        bool slow = false;
        if (row < kDv) {
          uint16_t* vf = reinterpret_cast<uint16_t*>(sm.vf);
          uint8_t* vb = reinterpret_cast<uint8_t*>(sm.vf_raw);
#pragma unroll
          for (int r = 0; r < C::kMaxVScaleRows; ++r) {
            slow |= ve[r] > sm90::Fp8Bf16<kE4>::kMaxFastE;
            vf[r * 128 + row] = static_cast<uint16_t>(sm90::fast_factor_bits<kE4>(ve[r]));
            vb[r * 128 + row] = ve[r];
          }
        }
        slow = ptx::named_barrier_or(kDequantBarrier, 128, slow);
        const int vrow = static_cast<int>((first + row) / 32 - rb0);
        const uint16_t* vf = reinterpret_cast<const uint16_t*>(sm.vf) + vrow * 128;
        const uint8_t* vb = reinterpret_cast<const uint8_t*>(sm.vf_raw) + vrow * 128;
        sm.v_tile[0].producer_wait(n_v++);
        dequant_row<kE4, C::kVBlocks>(
            sm.x.fp8[stage].vc[0], sm.v0[0], row, valid, slow,
            [&](int q, uint32_t(&f)[8]) {
              const uint4 a = *reinterpret_cast<const uint4*>(vf + q * 16);
              const uint4 b = *reinterpret_cast<const uint4*>(vf + q * 16 + 8);
              f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
            },
            [&](int q) { return *reinterpret_cast<const uint4*>(vb + q * 16); });
        ptx::fence_proxy_async();
        __syncwarp();
        if (lane == 0) sm.v_tile[0].producer_commit(), sm.fp8_stage[stage].consumer_release();
        cur = next;
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 query rows each
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const bool zero_v_tail = p.thd && !fp8();
  const int cw = wg - C::kFirstConsumerWG, warp = ptx::warp_in_warpgroup(), lane = threadIdx.x % 32;
  const int r_in = 64 * cw + 16 * warp + lane / 4;  // tile row of accumulator half 0 (half 1: +8)
  uint32_t n_q = 0, n_k = 0, n_v = 0;
  // Q's and K's descriptors differ in their low word only (the start address; the high word is the
  // 128-byte swizzle's constant): the S GEMM's descriptors are that word plus a constant
  const uint32_t dq_lo = static_cast<uint32_t>(ptx::wgmma_desc_k_sw128(sm.q[0] + 64 * cw * 128));
  const uint64_t dk0 = ptx::wgmma_desc_k_sw128(K::k_slot(sm, 0)), dk1 = ptx::wgmma_desc_k_sw128(K::k_slot(sm, 1));
  const uint32_t dk_hi = static_cast<uint32_t>(dk0 >> 32);
  // V as the N-major B operand: 64-column blocks LBO apart, 8-key groups SBO = 1024 bytes apart
  const uint64_t dv0 = ptx::wgmma_desc(K::v_slot(sm, 0), ptx::SmemSwizzle::k128B, C::kBN * 128, 1024),
                 dv1 = ptx::wgmma_desc(K::v_slot(sm, 1), ptx::SmemSwizzle::k128B, C::kBN * 128, 1024);
  constexpr uint32_t kQBlk = sizeof(sm.q[0]) / 16, kKBlk = C::kBN * 128 / 16;
  // softmax_scale > 0 (the usual case): the row maximum of S·scale is (row maximum of S)·scale, and
  // the scale folds into the exponent's FFMA; otherwise S is scaled first
  const bool pos_scale = p.scale_log2 > 0.f;
  const float c = pos_scale ? p.scale_log2 : 1.f;
  TileFeed<typename K::Smem> feed{sm, p};
  // O staged for a TMA store in the V slot of its tile's last P·V: the warpgroup's thread 0 issues
  // the store and releases the slot (for its warpgroup's 4 warps) once the store has read it, at
  // the next tile's start (the producer refills that slot with the next tile's second V tile)
  int o_pending = -1;
  const auto release_o_slot = [&]() {
    if (o_pending >= 0) {
      ptx::bulk_wait_read<0>();
      for (int i = 0; i < 4; ++i) sm.v_tile[o_pending].consumer_release();
      o_pending = -1;
    }
  };
  for (int t = feed.next(-1); t < p.num_tiles; t = feed.next(t)) {
    const Tile w = tile_at(p, t);
    release_o_slot();
    if (!w.valid) continue;
    // this tile's O by TMA: bf16 slots, keys to visit, and (thd) every row of the tile in its sequence
    const bool stage_o = p.tma_o && !fp8() && w.n_blocks > 0 && (!p.thd || (w.m + 1) * 128 <= w.len_q);
    int o_slot = 0;
    float o[kDv / 2];
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kDv / 2; ++i) o[i] = 0.f;
    // S = Q·K_jᵀ into s (this thread's 2 rows x 32 keys, accumulator layout): one wgmma group
    const auto issue_s = [&](float(&s)[64], int kslot) {
      const uint32_t dk_lo = static_cast<uint32_t>(kslot ? dk1 : dk0);
#pragma unroll
      for (int i = 0; i < 64; ++i) ptx::fence_reg(s[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDqk / 16; ++kk)
        ptx::WgmmaOp<128, ptx::MmaDtype::kBF16, ptx::MmaDtype::kBF16, false>::mma(
            s, ptx::desc_pack(dq_lo + (kk / 4) * kQBlk + 2 * (kk % 4), dk_hi),
            ptx::desc_pack(dk_lo + (kk / 4) * kKBlk + 2 * (kk % 4), dk_hi), kk > 0);
      ptx::wgmma_commit();
    };
    // O += P·V_j: one wgmma group (P from registers: k-step kk holds key columns 16kk .. 16kk+15)
    const auto issue_pv = [&](const uint32_t(&pa)[8][4], int vslot) {
      const uint64_t dvs = vslot ? dv1 : dv0;
#pragma unroll
      for (int i = 0; i < kDv / 2; ++i) ptx::fence_reg(o[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {  // 16 keys = 16 rows of 128 bytes per step
        if constexpr (kDv == 128)
          ptx::wgmma_m64n128k16_f32_bf16_bf16_rs<1>(o, pa[kk], dvs + kk * (16 * 128 / 16), true);
        else
          ptx::wgmma_m64n64k16_f32_bf16_bf16_rs<1>(o, pa[kk], dvs + kk * (16 * 128 / 16), true);
      }
      ptx::wgmma_commit();
    };
    // masks (keys past the sequence, causal), then the online softmax in place (log2 domain): s
    // becomes P, the row statistics move on, alpha is the factor O has to take
    const auto softmax = [&](float(&s)[64], int j, float(&alpha)[2]) {
      const int kb = j * 128, row0 = w.m * 128 + r_in;
      const bool tail = kb + 128 > w.len_kv;
      const bool diag = p.causal && kb + 127 > w.m * 128 + 64 * cw + w.key_off;
      // key kq + 8(i / 4) + (i % 2) is visible to row half h = (i / 2) % 2 iff that offset < lim[h]
      if (tail || diag) {
        const int kq = kb + 2 * (lane % 4);
        int lim[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          lim[h] = w.len_kv - kq;
          if (p.causal) lim[h] = min(lim[h], row0 + 8 * h + w.key_off + 1 - kq);
        }
#pragma unroll
        for (int i = 0; i < 64; ++i)
          if (8 * (i / 4) + (i % 2) >= lim[(i / 2) % 2]) s[i] = -INFINITY;
      }
      if (!pos_scale) {
#pragma unroll
        for (int i = 0; i < 64; ++i) s[i] = __fmul_rn(s[i], p.scale_log2);
      }
      float base[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // row h's values: s[4jj + 2h], s[4jj + 2h + 1]
        float m4[4];                  // four independent chains
#pragma unroll
        for (int q = 0; q < 4; ++q) m4[q] = fmaxf(s[4 * q + 2 * h], s[4 * q + 2 * h + 1]);
#pragma unroll
        for (int jj = 4; jj < 16; ++jj) m4[jj % 4] = fmaxf(m4[jj % 4], fmaxf(s[4 * jj + 2 * h], s[4 * jj + 2 * h + 1]));
        float mx = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(mrow[h], __fmul_rn(mx, c));
        base[h] = m_new == -INFINITY ? 0.f : m_new;
        alpha[h] = ptx::ex2_approx(mrow[h] - base[h]);
        mrow[h] = m_new;
      }
      // P = 2^(S·c − base) as one FFMA, fma(S, ce, −base). With ce = c that leaves the row maximum's
      // exponent at the rounding error of max·c instead of 0. Below kFoldLimit that is under 2^-14: a
      // common factor within 1 ± 5e-5 on the row's P, no more than each score's own rounding in the
      // unfolded form. At |S·c| ≥ 2^31 it is ±128 or more (every P 0 or Inf: O and LSE lost), and in
      // between enough to move the maximum's P off 1, which E4M3 P rounds to another code. So past the
      // limit (any row of the warp, NaN included) S is rounded to S·c first and ce = 1: the maximum's
      // exponent is exactly 0, as in the reference (the kernel's SASS keeps the P·V wait after the row
      // maxima only with the multiplications alone under this branch: docs/notes-attention.md).
      float ce = c;
      if (__any_sync(0xffffffffu, !(fabsf(base[0]) < kFoldLimit && fabsf(base[1]) < kFoldLimit))) {
#pragma unroll
        for (int i = 0; i < 64; ++i) s[i] = __fmul_rn(s[i], c);
        ce = 1.f;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
          s[4 * jj + 2 * h] = ptx::ex2_approx(fmaf(s[4 * jj + 2 * h], ce, -base[h]));
          s[4 * jj + 2 * h + 1] = ptx::ex2_approx(fmaf(s[4 * jj + 2 * h + 1], ce, -base[h]));
          l4[jj % 4] += s[4 * jj + 2 * h] + s[4 * jj + 2 * h + 1];
        }
        lrow[h] = lrow[h] * alpha[h] + ((l4[0] + l4[1]) + (l4[2] + l4[3]));
      }
    };
    // O's rescale, skipped when no row of the warp has a new maximum (alpha = 1 exactly)
    const auto rescale_o = [&](const float(&alpha)[2]) {
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int jj = 0; jj < kDv / 8; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h) o[4 * jj + 2 * h] *= alpha[h], o[4 * jj + 2 * h + 1] *= alpha[h];
      }
    };
    // P as the A operand: k-step kk holds accumulator columns 16kk .. 16kk+15
    const auto to_p = [&](const float(&s)[64], uint32_t(&pa)[8][4]) {
      if (p.e4m3_p) {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) pa[kk][r] = p_e4m3_bf16x2(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
      } else {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) pa[kk][r] = bf16x2_rn(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
      }
    };
    const auto wait_k = [&]() {
      const int slot = n_k & kv_mask;
      sm.k_tile[slot].consumer_wait(n_k++ >> kv_shift);
      return slot;
    };
    const auto wait_v = [&]() {
      const int slot = n_v & kv_mask;
      sm.v_tile[slot].consumer_wait(n_v++ >> kv_shift);
      return slot;
    };
    const auto s_landed = [&](float(&s)[64], int kslot, int j) {
#pragma unroll
      for (int i = 0; i < 64; ++i) ptx::fence_reg(s[i]);
      if (lane == 0) {
        sm.k_tile[kslot].consumer_release();
        if (j == w.n_blocks - 1) sm.q_tile.consumer_release();
      }
    };
    // thd on bf16 inputs (the caller's or the staged copies): a sequence's last key tile holds rows
    // past its end (the next sequence's tokens, or tokens outside every sequence: the staged copy
    // leaves those unwritten). Their P is 0, but 0·Inf and 0·NaN are NaN, so the two consumer
    // warpgroups zero those V rows before that tile's P·V (it is the last one the work tile visits;
    // the FP8 dequantizer writes such rows as zeros itself). Whole rows of every 64-column block:
    // the swizzle permutes 16-byte chunks inside a row.
    const auto zero_v_rows = [&](int vslot, int first_row) {
      uint8_t* base = K::v_slot(sm, vslot);
      const int tid = static_cast<int>(threadIdx.x) - 128 * C::kFirstConsumerWG;  // 0 .. 255
#pragma unroll
      for (int i = tid; i < C::kVBlocks * C::kBN * 8; i += 256)  // 16-byte chunk i: row (i / 8) % kBN
        if ((i / 8) % C::kBN >= first_row) *reinterpret_cast<uint4*>(base + 16 * i) = make_uint4(0, 0, 0, 0);
      ptx::fence_proxy_async();  // the generic-proxy stores before the wgmma's reads
      ptx::named_barrier(kConsumerBarrier, 256);
    };
    const auto pv_landed = [&](int vslot) {
#pragma unroll
      for (int i = 0; i < kDv / 2; ++i) ptx::fence_reg(o[i]);
      if (lane == 0) sm.v_tile[vslot].consumer_release();
    };
    if (w.n_blocks > 0) {
      // intra-warpgroup overlap: the softmax of S_j runs while O += P_{j-1}·V_{j-1} is on the
      // tensor cores; O takes S_j's rescale once that product has landed
      float s[64], alpha[2];
      uint32_t pa[8][4];
      sm.q_tile.consumer_wait(n_q++);
      int kslot = wait_k();
      issue_s(s, kslot);
      ptx::wgmma_wait<0>();
      s_landed(s, kslot, 0);
      softmax(s, 0, alpha);  // O is zero: nothing to rescale
      to_p(s, pa);
      for (int j = 1; j < w.n_blocks; ++j) {
        kslot = wait_k();
        issue_s(s, kslot);
        if constexpr (K::kRescaleUnderS) {  // S_{j-1}'s rescale (O is 0 before P_0·V_0)
#pragma unroll
          for (int i = 0; i < kDv / 2; ++i) ptx::fence_reg(o[i]);  // after the issue, not before it
          if (j > 1) rescale_o(alpha);
        }
        const int vslot = wait_v();
        issue_pv(pa, vslot);
        ptx::wgmma_wait<1>();  // S_j has landed
        s_landed(s, kslot, j);
        softmax(s, j, alpha);
        ptx::wgmma_wait<0>();
        pv_landed(vslot);
        if constexpr (!K::kRescaleUnderS) rescale_o(alpha);
        to_p(s, pa);
      }
      if constexpr (K::kRescaleUnderS) {
        if (w.n_blocks > 1) rescale_o(alpha);
      }
      const int vslot = wait_v();
      if (zero_v_tail && w.n_blocks * 128 > w.len_kv) zero_v_rows(vslot, w.len_kv - (w.n_blocks - 1) * 128);
      issue_pv(pa, vslot);
      ptx::wgmma_wait<0>();
      if (stage_o) {
#pragma unroll
        for (int i = 0; i < kDv / 2; ++i) ptx::fence_reg(o[i]);
        o_slot = vslot;  // kept: O goes through it
      } else {
        pv_landed(vslot);
      }
    }
    // epilogue: O / l -> bf16 (staged: into the last V slot, rows as V's, [64 columns][128 B] blocks
    // with the 128-byte swizzle, once both warpgroups' last P·V has read it), LSE
    uint8_t* const o_stage = K::v_slot(sm, o_slot);
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = lrow[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[h] = l > 0.f ? 1.f / l : (l == 0.f ? 0.f : l);  // l NaN stays NaN
      const int row = w.m * 128 + r_in + 8 * h;
      if (row >= w.len_q) continue;
      if (!stage_o) {
        uint16_t* orow = p.o + w.b * p.o_st_b + (w.q0 + row) * p.o_st_s + w.h * p.o_st_h;
#pragma unroll
        for (int jj = 0; jj < kDv / 8; ++jj) {
          const int col = 8 * jj + 2 * (lane % 4);
          const uint32_t v =
              bf16_out(o[4 * jj + 2 * h] * inv[h]) | (uint32_t{bf16_out(o[4 * jj + 2 * h + 1] * inv[h])} << 16);
          *reinterpret_cast<uint32_t*>(orow + col) = v;
        }
      }
      if (p.lse != nullptr && lane % 4 == 0) {
        const float lse = l == 0.f ? -INFINITY : (mrow[h] + log2f(l)) * 0.69314718055994531f;
        const int64_t idx = p.thd ? int64_t{w.h} * p.total_q + w.q0 + row : (int64_t{w.b} * p.H + w.h) * p.Sq + row;
        p.lse[idx] = lse;
      }
    }
    if (stage_o) {
      // O into the slot once both warpgroups' last P·V has read it (rows past the tensor too: TMA
      // leaves them unwritten): 8x8 matrices (16 rows, 16 columns per stmatrix) of the accumulator
      // layout, lane l giving row l % 8 (+ 8 for matrices 1, 3) of column block 2u (+ 1 for 2, 3)
      ptx::named_barrier(kConsumerBarrier, 256);
      const auto pk = [&](int jj, int h) {
        return bf16_out(o[4 * jj + 2 * h] * inv[h]) | (uint32_t{bf16_out(o[4 * jj + 2 * h + 1] * inv[h])} << 16);
      };
      const int mi = lane / 8, rt = 64 * cw + 16 * warp + 8 * (mi % 2) + lane % 8;  // (rt & 7 = lane % 8)
#pragma unroll
      for (int u = 0; u < kDv / 16; ++u) {
        const int jj = 2 * u + mi / 2;
        ptx::stmatrix_x4(o_stage + (jj / 8) * C::kBN * 128 + rt * 128 + (((jj % 8) ^ (lane % 8)) * 16), pk(2 * u, 0),
                         pk(2 * u, 1), pk(2 * u + 1, 0), pk(2 * u + 1, 1));
      }
    }
    if (stage_o) {  // this warpgroup's 64 rows, one box per 64 columns
      ptx::fence_proxy_async();
      ptx::named_barrier(kOStagedBarrier + cw, 128);
      if (threadIdx.x % 128 == 0) {
#pragma unroll
        for (int cb = 0; cb < C::kVBlocks; ++cb)
          ptx::tma_store_4d(&tmap_o, o_stage + cb * C::kBN * 128 + 64 * cw * 128, cb * 64, w.h,
                            w.q0 + w.m * 128 + 64 * cw, p.thd ? 0 : w.b);
        ptx::bulk_commit();
        o_pending = o_slot;
      }
    }
  }
  release_o_slot();  // (the CTA's shared memory stays until the last store has read it)
}

}  // namespace mxmla::detail::attn
