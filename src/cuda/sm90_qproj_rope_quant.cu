// mxmla — the fused Q up-projection for SM90: GEMM (bf16 wgmma, fp32 accumulation) + RoPE + MXFP8
// quantization in the epilogue (SPEC §4, include/mxmla/qproj.h).
//
// One persistent, warp-specialized kernel of four warpgroups:
//   producer   one thread streams x [128 x 64] and W [192 x 64] bf16 tiles by TMA (128-byte swizzle)
//              into a kStages-deep ring guarded by full/empty mbarriers;
//   MMA        two warpgroups run m64n192k16 wgmmas (bf16 -> fp32) on 64 of the 128 rows each,
//              keeping one wgmma group in flight; at the end of a tile they round the accumulators
//              to bf16 (SPEC §4's first rounding) into a shared tile and go straight on to the next
//              tile's mainloop;
//   epilogue   the last warpgroup and warps 1..3 of the producer's (7 warps) take the bf16 tile while
//              the next one is being multiplied: RoPE in fp32, rowwise and columnwise amax, E8M0
//              scales, FP8 codes and the optional bf16 q. q never passes through global memory as
//              bf16 unless asked for.
//   cost model alone, the mainloop runs at ~99 % of the tensor cores' per-cycle peak. The epilogue
//              and the mainloop take about the same time per tile and barely wait for each other;
//              the epilogue's cost is the ~13 % it slows the mainloop. Measured with synthetic
//              epilogues (knobs 7-24, scripts/prof-qproj, docs/notes-qproj.md): its shared-memory
//              loads are free (3 passes over the tile: +0.4 %), its arithmetic competes with the
//              wgmmas for the sub-partitions (FMAs at full rate: +31 %; the same integer work
//              +12 % on 7 warps, +2 % on one warp per sub-partition; while the wgmmas run, a
//              dependent FMA chain steps every ~9 cycles), its global stores and table loads cost more
//              per byte than the TMA stream (48 KB of stores +11 %; as TMA bulk stores from
//              shared memory +2.4 %; 64 KB of loads +7 %). In the real kernel the column codes
//              staged in the tile and written by TMA tensor stores gave the mainloop back only
//              ~0.5 % and lengthened the epilogue: +3.3 % (sixteenth session). W multicast over
//              a 2-CTA cluster (less L2 -> SM traffic) measured level; the real epilogue on 4
//              warps (one per sub-partition) is too slow to keep pace (+6 %).
//              Nothing is to be added to the MMA warps' path (it lands on the tile cycle directly).
//   scheduler  tile = (sequence, 128 tokens, one head): BN equals the head dim, so every RoPE
//              partner, every rowwise block and every 32-token columnwise block is inside one
//              tile. Tiles run in groups of kGroupM token tiles x all heads (x tiles stay in L2
//              while W streams); every role walks the same tile sequence.
#include <cuda.h>  // CUtensorMap (types only; the encoder comes from the runtime's driver entry point)
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "common/qproj_ops.h"
#include "common/tile_deal.h"
#include "cuda/tma_host.h"
#include "cuda/cuda_check.h"
#include "cuda/ptx.cuh"
#include "cuda/ptx_sm90.cuh"
#include "cuda/prof_spans.cuh"
#include "cuda/stream_scratch.h"

// Experiment knob (cmake -DMXMLA_QPROJ_EPILOGUE=n): 0 times the mainloop and the tile hand-off alone
// (outputs not written), 2 skips the columnwise part of the epilogue, 3 the table loads, 4 the rope
// part, 5 the RoPE rows' fp32 write-back into the tile, 6 the epilogue's global stores (computed,
// not stored) (wrong outputs: for timing only; docs/notes-qproj.md, scripts/prof-qproj). 7-10 replace
// the epilogue by one synthetic kind of work at about its per-tile volume, to see which kind slows
// the mainloop: 7 arithmetic only (~2400 FMAs per warp), 8 shared loads only (3 passes over the
// 64 KB tile), 9 global code stores only (48 KB), 10 table loads only (64 KB); 11-14 ~2400 of one
// instruction per warp: 11 LOP3 (integer pipe), 12 IMAD (the FMA pipe's integer side), 13 FFMA in
// one dependent chain (7 has four), 14 F2FP (fp32 pair -> E4M3 pair, + a LOP3),
// 15 IADD3, 16 PRMT, 17 VIMNMX (integer max), 18 FMNMX (fp32 max), 19 SHFL.BFLY (+ a LOP3); 15,
// 17, 18 take i * constant, one IMAD per 4 steps. 20, 21: knob 11's 16.8 k LOP3 per tile dealt
// by sub-partition: 20 only on epilogue warps 0-3 (one per SM sub-partition, 4200 each), 21 only
// on warps 4-6 (sub-partitions 1-3, 5600 each). 22, 23: knobs 9, 10 on epilogue warps 0-3 only;
// 24: knob 9's 48 KB as 256 bulk copies (TMA unit) of 192-byte rows from the shared tile.
// 30-32 split the mainloop (epilogue off, as 0): 30 the TMA loads without the wgmmas, 31 the
// wgmmas without the loads (each stage is loaded once, in the first tile, then reused), 32
// neither (the barrier hand-offs alone) — for energy per call (scripts/energy-qproj).
#ifndef MXMLA_QPROJ_EPILOGUE
#define MXMLA_QPROJ_EPILOGUE 1
#endif
// Profiling knob (cmake -DMXMLA_QPROJ_PROFILE=1, scripts/prof-qproj): clock64 stamps of each role's
// phases per tile on the first CTAs, summarised on stderr after the sixth launch. 0: no code.
#ifndef MXMLA_QPROJ_PROFILE
#define MXMLA_QPROJ_PROFILE 0
#endif
// Grid knob (cmake -DMXMLA_QPROJ_GRID=n): 0 (default) the fewest CTAs that take as many waves of
// tiles as one CTA per SM (common/tile_deal.h, balanced_grid); 1 one CTA per SM (the rule before
// the twenty-fourth session); n > 1 at most n CTAs.
#ifndef MXMLA_QPROJ_GRID
#define MXMLA_QPROJ_GRID 0
#endif
static_assert(MXMLA_QPROJ_GRID >= 0, "MXMLA_QPROJ_GRID: 0 (balanced), 1 (one CTA per SM) or a CTA count");

namespace mxmla::detail {
namespace {

// the MXMLA_QPROJ_EPILOGUE knob's switches (all true in the default build)
[[maybe_unused]] constexpr bool kEpilogueOn = MXMLA_QPROJ_EPILOGUE != 0 && MXMLA_QPROJ_EPILOGUE < 30;
constexpr bool kMmaOn = MXMLA_QPROJ_EPILOGUE != 30 && MXMLA_QPROJ_EPILOGUE != 32;
constexpr bool kLoadsOn = MXMLA_QPROJ_EPILOGUE != 31 && MXMLA_QPROJ_EPILOGUE != 32;

// ---------------------------------------------------------------- configuration
struct Cfg {
  static constexpr int kD = 192, kR = 64, kNope = kD - kR;  // DeepSeek-V3 head (the one instantiation)
  static constexpr int kBM = 128, kBK = 64;                  // tokens per tile, K per stage (128 bytes)
  static constexpr int kStages = 4;
  static constexpr int kMmaWGs = 2;                          // warpgroups of 64 rows
  static constexpr int kThreads = 128 * (kMmaWGs + 2);       // + producer + epilogue warpgroup
  // epilogue threads: the epilogue warpgroup plus warps 1..3 of the producer warpgroup (warp 0 issues TMA)
  static constexpr int kEpiThreads = 128 + 96;
  // hand-off tile row: the nope part as bf16, then the rope part: bf16 from the MMA, overwritten in
  // place by its fp32 RoPE output (bytes kNope*2 .. kTileRow)
  static constexpr int kTileRow = kNope * 2 + kR * 4;
  static constexpr int kRopeOff = kNope * 2;
  static constexpr int kGroupM = 32;                         // token tiles per raster group
  static constexpr int kJ = kD / 8;                          // 8-column groups of the accumulator fragment
  static constexpr uint32_t kStageBytes = (kBM + kD) * kBK * 2;
};
static_assert(Cfg::kD % 32 == 0 && Cfg::kR % 32 == 0 && Cfg::kNope % 32 == 0, "whole MXFP8 blocks in nope and rope");
static_assert(Cfg::kD <= 256 && Cfg::kD % 8 == 0, "wgmma N (one head per tile) is a multiple of 8, at most 256");
static_assert(Cfg::kBK * 2 == 128, "a stage row is one 128-byte swizzle row");
static_assert(Cfg::kBM == 64 * Cfg::kMmaWGs && Cfg::kBM == 128, "two MMA warpgroups of 64 rows; the epilogue split assumes 128");
static_assert(Cfg::kTileRow % 128 == 0 && Cfg::kRopeOff % 128 == 0, "tile rows of whole 128-byte swizzle groups");

struct alignas(1024) Smem {
  __nv_bfloat16 a[Cfg::kStages][Cfg::kBM * Cfg::kBK];  // x tiles  [128 rows][64], 128-byte swizzle
  __nv_bfloat16 b[Cfg::kStages][Cfg::kD * Cfg::kBK];   // W tiles  [192 rows][64], 128-byte swizzle
  uint8_t tile[Cfg::kBM * Cfg::kTileRow];              // [128 rows][nope bf16 | rope bf16 -> fp32], swizzled
  uint64_t full[Cfg::kStages], empty[Cfg::kStages];    // stage ring
  uint64_t tile_full, tile_empty;                      // tile hand-off
};
static_assert(sizeof(Smem::a[0]) % 1024 == 0 && sizeof(Smem::b[0]) % 1024 == 0, "stage tiles 1024-aligned");
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + alignment slack of the dynamic buffer
static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");

struct KParams {
  int B, S, NH, mtiles, num_tiles, kblocks;
  bool sbhd, rotate_half;
  const float* cos;  // fp32 tables (bf16 ones are widened into scratch by the launcher)
  const float* sin;
  int64_t tab_st, N;
  uint8_t *row_codes, *row_scales, *col_codes, *col_scales;
  ScaleMap row_map, col_map;
  uint16_t* q;
};

// ---------------------------------------------------------------- profiling (MXMLA_QPROJ_PROFILE)
// Stamp slots per tile: MMA warp 0 of warpgroup 0: 0 tile start, 1 mainloop done, 2 tile_empty
// passed, 3 hand-off done, 15 cycles spent waiting for stage data (sum over the tile's k-blocks);
// epilogue: 4 tile_full passed (warp 0), 5..11 each warp's end, 12 warp 0 after N, 13 after R, 14
// after the named barrier; producer: 16 cycles spent waiting for free stages (sum). Per CTA (up to
// kProfSpans): its start (the producer) and end (the epilogue's last tile) on the global timer, its
// SM and its tile count (cuda/prof_spans.cuh: do the SMs finish together?), and when its MMA warps
// handed over their last tile: the end minus that is the drain, the epilogue the mainloop cannot hide.
#if MXMLA_QPROJ_PROFILE
constexpr int kProfCtas = 8, kProfTiles = 64, kProfSlots = 17, kProfSpans = 1024;
__device__ unsigned long long g_prof[kProfCtas][kProfTiles][kProfSlots];
__device__ BlockSpan g_spans[kProfSpans];
__device__ unsigned long long g_mma_end[kProfSpans];  // global timer when the MMA warps' last hand-off is done
#endif
__device__ __forceinline__ void stamp_value(uint32_t n, int slot, unsigned long long v) {
#if MXMLA_QPROJ_PROFILE
  if (blockIdx.x < kProfCtas && n < kProfTiles) g_prof[blockIdx.x][n][slot] = v;
#endif
}
__device__ __forceinline__ unsigned long long prof_clock() { return MXMLA_QPROJ_PROFILE ? clock64() : 0; }
__device__ __forceinline__ void stamp(uint32_t n, int slot) { stamp_value(n, slot, prof_clock()); }
__device__ __forceinline__ void span(bool end, uint32_t tiles) {  // one thread: the CTA's start / end
#if MXMLA_QPROJ_PROFILE
  if (blockIdx.x < kProfSpans) end ? span_end(g_spans[blockIdx.x], int(tiles)) : span_begin(g_spans[blockIdx.x]);
#endif
}

// Tile t -> (sequence bi, first token m0, head h): groups of kGroupM token tiles, head-major inside.
__device__ __forceinline__ void tile_coords(const KParams& p, int t, int& bi, int& m0, int& h) {
  const int mt_all = p.B * p.mtiles;
  const int group = t / (Cfg::kGroupM * p.NH);
  const int first = group * Cfg::kGroupM;
  const int gm = min(Cfg::kGroupM, mt_all - first);
  const int local = t - group * Cfg::kGroupM * p.NH;
  h = local / gm;
  const int mt = first + local % gm;
  bi = mt / p.mtiles;
  m0 = (mt % p.mtiles) * Cfg::kBM;
}

// Byte offset of logical byte `off` of row `row` in sm.tile: 16-byte chunks are XOR-swizzled by
// row % 8 inside their 128-byte group, so that 8 rows at the same column (stmatrix, N) and 8 chunks
// of one row (R, C) each hit all banks (no padding: the fourth stage needs the space).
__device__ __forceinline__ uint32_t tswz(int row, int off) {
  return static_cast<uint32_t>(row * Cfg::kTileRow + (off ^ ((row & 7) << 4)));
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
// bf16 pair with NaNs made canonical (0x7FC0, the reference's float_to_bf16).
__device__ __forceinline__ uint32_t bf16x2_canonical(uint32_t w) {
  uint32_t r = w;
  if ((w & 0x7FFFu) > 0x7F80u) r = (r & 0xFFFF0000u) | 0x7FC0u;
  if ((w & 0x7FFF0000u) > 0x7F800000u) r = (r & 0xFFFFu) | 0x7FC00000u;
  return r;
}
__device__ __forceinline__ uint32_t bf16x2_of(float lo, float hi) {  // round to nearest even, canonical NaN
  const uint32_t l = isnan(lo) ? 0x7FC0u : (bf16x2_bits(lo, 0.f) & 0xFFFFu);
  const uint32_t h = isnan(hi) ? 0x7FC0u : (bf16x2_bits(hi, 0.f) & 0xFFFFu);
  return l | (h << 16);
}
__device__ __forceinline__ float rope_term(float sgn_s, float xb, float c, float xa) {
  return __fmaf_rn(sgn_s, xb, __fmul_rn(c, xa));  // a rounded product, then one fma (include/mxmla/rope.h)
}
// Four consecutive fp32 table values (rows 16-byte aligned: checked by the host, or the scratch).
__device__ __forceinline__ float4 tab4(const float* tab, int64_t off) { return __ldg(reinterpret_cast<const float4*>(tab + off)); }
// The rowwise scale offset of block kb of row si of batch vb: compact maps inline (the common case,
// fewer instructions in the epilogue's hot loops than the general cursor), the others through it.
__device__ __forceinline__ int64_t row_scale_at(const ScaleMap& m, int vb, int si, int64_t kb) {
  if (m.mode == MapMode::kCompact) return (static_cast<int64_t>(vb) * m.rows + si) * (m.cols / 32) + kb;
  return row_scale_offset(m, vb, si, kb);
}
__device__ __forceinline__ int64_t token_of(const KParams& p, int bi, int s) {
  return p.sbhd ? static_cast<int64_t>(s) * p.B + bi : static_cast<int64_t>(bi) * p.S + s;
}
// Knob 6 (timing only): false, so that the epilogue skips its global stores; a condition the compiler
// cannot prove false keeps the computation. True (folded away) in every other build.
__device__ __forceinline__ bool stores_on(const KParams& p) { return MXMLA_QPROJ_EPILOGUE != 6 || p.kblocks < 0; }
// Four FP8 codes of v * mul (one multiplier per element), byte i = element i.
template <bool kE4M3>
__device__ __forceinline__ uint32_t codes4(float v0, float v1, float v2, float v3, float m0, float m1, float m2, float m3) {
  return ptx::cvt_fp8x2<kE4M3>(v0 * m0, v1 * m1) | (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(v2 * m2, v3 * m3)) << 16);
}

// ---------------------------------------------------------------- columnwise item
// Four columns (4 * cq ...) of the 32-row block g of the tile: amax over the rows, four E8M0 scales,
// then the codes row by row (a warp writes 128 contiguous bytes per row). Nope columns come from
// the bf16 tile, rope columns from the fp32 RoPE output. A full block (nrows == 32) is unrolled
// with independent max chains; a tail block takes the generic loop.
template <bool kNope, bool kE4M3>
__device__ __forceinline__ void col_item(const KParams& p, const Smem& sm, int bi, int h, int g, int cq, int sg, int nrows) {
  constexpr int kNopeQuads = Cfg::kNope / 4;
  const uint32_t rcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int r0 = 32 * g;
  const int coff = kNope ? 8 * cq : Cfg::kRopeOff + 16 * (cq - kNopeQuads);  // logical byte of the 4 columns
  auto load4 = [&](int i, float (&v)[4]) {  // row i of the four columns as fp32
    if constexpr (kNope) {
      const uint2 w = *reinterpret_cast<const uint2*>(sm.tile + tswz(r0 + i, coff));
      v[0] = bf_lo(w.x), v[1] = bf_hi(w.x), v[2] = bf_lo(w.y), v[3] = bf_hi(w.y);
    } else {
      const float4 w = *reinterpret_cast<const float4*>(sm.tile + tswz(r0 + i, coff));
      v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
    }
  };
  // magnitude maxima as fp32 bits (bf16 pairs: packed max of the two halves, then widened)
  uint32_t a[4] = {0, 0, 0, 0};
  if (nrows == 32) {
    constexpr int kChains = 4;  // independent max chains over rows i = c, c + 4, ...
    uint32_t m[kChains][4] = {};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      uint32_t* mc = m[i % kChains];
      if constexpr (kNope) {
        const uint2 w = *reinterpret_cast<const uint2*>(sm.tile + tswz(r0 + i, coff));
        mc[0] = __vmaxu2(mc[0], w.x & 0x7FFF7FFFu), mc[1] = __vmaxu2(mc[1], w.y & 0x7FFF7FFFu);
      } else {
        const uint4 w = *reinterpret_cast<const uint4*>(sm.tile + tswz(r0 + i, coff));
        mc[0] = max(mc[0], w.x & 0x7FFFFFFFu), mc[1] = max(mc[1], w.y & 0x7FFFFFFFu);
        mc[2] = max(mc[2], w.z & 0x7FFFFFFFu), mc[3] = max(mc[3], w.w & 0x7FFFFFFFu);
      }
    }
#pragma unroll
    for (int c = 1; c < kChains; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) m[0][j] = kNope ? __vmaxu2(m[0][j], m[c][j]) : max(m[0][j], m[c][j]);
    if constexpr (kNope) a[0] = m[0][0] << 16, a[1] = m[0][0] & 0xFFFF0000u, a[2] = m[0][1] << 16, a[3] = m[0][1] & 0xFFFF0000u;
    else a[0] = m[0][0], a[1] = m[0][1], a[2] = m[0][2], a[3] = m[0][3];
  } else {
#pragma unroll 4
    for (int i = 0; i < nrows; ++i) {
      float v[4];
      load4(i, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) a[j] = max(a[j], __float_as_uint(v[j]) & 0x7FFFFFFFu);
    }
  }
  uint8_t e[4];
  float mul[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) e[j] = block_scale_from_amax_bits(a[j], rcp), mul[j] = e8m0_quant_multiplier(e[j]);
  const int vb = p.sbhd ? 0 : bi;
  const int64_t c = (p.sbhd ? static_cast<int64_t>(bi) * p.NH + h : h) * Cfg::kD + 4 * cq;  // scale-map column
  if (stores_on(p) && p.col_map.mode == MapMode::kCompact) {
    *reinterpret_cast<uint32_t*>(p.col_scales + col_scale_offset(p.col_map, vb, sg / 32, c)) =
        e[0] | (uint32_t{e[1]} << 8) | (uint32_t{e[2]} << 16) | (uint32_t{e[3]} << 24);
  } else if (stores_on(p)) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p.col_scales[col_scale_offset(p.col_map, vb, sg / 32, c + j)] = e[j];
  }
  const int64_t tstride = p.sbhd ? int64_t{p.B} * p.N : p.N;  // bytes from one token of the sequence to the next
  uint8_t* dst = p.col_codes + token_of(p, bi, sg) * p.N + static_cast<int64_t>(h) * Cfg::kD + 4 * cq;
  auto code_row = [&](int i, uint8_t* d) {
    float v[4];
    load4(i, v);
    const uint32_t codes = codes4<kE4M3>(v[0], v[1], v[2], v[3], mul[0], mul[1], mul[2], mul[3]);
    if (stores_on(p)) __stcs(reinterpret_cast<unsigned int*>(d), codes);
  };
  if (nrows == 32) {
#pragma unroll
    for (int i = 0; i < 32; ++i, dst += tstride) code_row(i, dst);
  } else {
#pragma unroll 4
    for (int i = 0; i < nrows; ++i, dst += tstride) code_row(i, dst);
  }
}

// ---------------------------------------------------------------- epilogue warpgroup
// One tile from sm.tile (bf16 accumulator, all kD columns of 128 rows):
//   N  thread = (nope block, row), a warp = 8 rows x 4 blocks: amax on packed bf16 pairs, scale,
//      codes (and the bf16 q copy);
//   R  warp = 4 rows, lane = 8 outputs: RoPE of the rope part in fp32 (written back over the row's
//      bf16 inputs), its rowwise blocks (amax over 8 lanes, scale, codes) and the bf16 q of it;
//   C  thread = (32-row block, 4 columns): amax over 32 rows, 4 scales, then the codes row by row
//      (a warp writes 128 contiguous bytes per row), from the bf16 nope or the fp32 rope part.
// Knobs 7-24 (timing only, see the top): one kind of the epilogue's work alone. The results feed a
// shared store under a condition the compiler cannot prove false, so that the work is kept.
__device__ __forceinline__ void synthetic_epilogue(const KParams& p, Smem& sm, int tid, int bi, int m0, int h) {
  uint32_t acc = 0;
  if (MXMLA_QPROJ_EPILOGUE == 7) {  // 4 independent FMA chains, 600 steps
    float a[4] = {float(tid), float(tid + 1), float(tid + 2), float(tid + 3)};
#pragma unroll 4
    for (int i = 0; i < 600; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) a[j] = __fmaf_rn(a[j], 1.0001f, 0.5f);
    acc = __float_as_uint(a[0] + a[1] + a[2] + a[3]);
  } else if (MXMLA_QPROJ_EPILOGUE >= 11 && MXMLA_QPROJ_EPILOGUE <= 21) {
    uint32_t a[4] = {uint32_t(tid), uint32_t(tid + 1), uint32_t(tid + 2), uint32_t(tid + 3)};
    float f = float(tid);
    const uint32_t steps = MXMLA_QPROJ_EPILOGUE == 20 ? (tid < 128 ? 1050 : 0)
                         : MXMLA_QPROJ_EPILOGUE == 21 ? (tid < 128 ? 0 : 1400) : 600;
#pragma unroll 4
    for (uint32_t i = 0; i < steps; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (MXMLA_QPROJ_EPILOGUE == 11 || MXMLA_QPROJ_EPILOGUE >= 20)
          asm("lop3.b32 %0, %0, %1, %2, 0x96;" : "+r"(a[j]) : "r"(i), "r"(0x9E3779B9u));
        if (MXMLA_QPROJ_EPILOGUE == 12) asm("mad.lo.u32 %0, %0, %1, %2;" : "+r"(a[j]) : "r"(0x9E3779B9u), "r"(i));
        if (MXMLA_QPROJ_EPILOGUE == 13) f = __fmaf_rn(f, 1.0001f, 0.5f);
        if (MXMLA_QPROJ_EPILOGUE == 14) a[j] ^= ptx::cvt_fp8x2<true>(__uint_as_float(a[j]), __uint_as_float(i));
        if (MXMLA_QPROJ_EPILOGUE == 15) asm("add.u32 %0, %0, %1;" : "+r"(a[j]) : "r"(i * 0x9E3779B9u));
        if (MXMLA_QPROJ_EPILOGUE == 16) asm("prmt.b32 %0, %0, %1, 0x1537;" : "+r"(a[j]) : "r"(i));
        if (MXMLA_QPROJ_EPILOGUE == 17) asm("max.u32 %0, %0, %1;" : "+r"(a[j]) : "r"(i * 0x9E3779B9u));
        if (MXMLA_QPROJ_EPILOGUE == 18) asm("max.f32 %0, %0, %1;" : "+r"(a[j]) : "r"(i * 0x9E3779B9u));
        if (MXMLA_QPROJ_EPILOGUE == 19) a[j] ^= __shfl_xor_sync(0xFFFFFFFFu, a[j], 1 << j);
      }
    acc = a[0] ^ a[1] ^ a[2] ^ a[3] ^ __float_as_uint(f);
  } else if (MXMLA_QPROJ_EPILOGUE == 8) {  // 16-byte chunks, a warp = 32 consecutive chunks (conflict-free)
    constexpr int kChunks = Cfg::kBM * Cfg::kTileRow / 16;
    for (int i = tid; i < 3 * kChunks; i += Cfg::kEpiThreads) {
      const uint4 v = *reinterpret_cast<const uint4*>(sm.tile + 16 * (i % kChunks));
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  } else if (MXMLA_QPROJ_EPILOGUE == 9 || MXMLA_QPROJ_EPILOGUE == 22) {  // the tile's row and column codes, 12 chunks of 16 bytes per row
    constexpr int kThr = MXMLA_QPROJ_EPILOGUE == 22 ? 128 : Cfg::kEpiThreads;
    for (int i = tid; i < 2 * Cfg::kBM * 12 && tid < kThr; i += kThr) {
      const int k = i % (Cfg::kBM * 12), r = k / 12, si = m0 + r;
      if (si >= p.S) continue;
      uint8_t* base = i < Cfg::kBM * 12 ? p.row_codes : p.col_codes;
      if (base != nullptr)
        __stcs(reinterpret_cast<uint4*>(base + token_of(p, bi, si) * p.N + static_cast<int64_t>(h) * Cfg::kD + 16 * (k % 12)),
               make_uint4(i, i, i, i));
    }
  } else if (MXMLA_QPROJ_EPILOGUE == 24) {  // one bulk copy per (array, row), the tile's rows as source
    for (int i = tid; i < 2 * Cfg::kBM; i += Cfg::kEpiThreads) {
      const int r = i % Cfg::kBM, si = m0 + r;
      uint8_t* base = i < Cfg::kBM ? p.row_codes : p.col_codes;
      if (si < p.S && base != nullptr)
        ptx::bulk_store_s2g(base + token_of(p, bi, si) * p.N + static_cast<int64_t>(h) * Cfg::kD, sm.tile + r * Cfg::kTileRow,
                            Cfg::kD);
    }
    ptx::bulk_commit();
    ptx::bulk_wait_read_all();  // the tile is the next hand-off's
  } else if (MXMLA_QPROJ_EPILOGUE == 10 || MXMLA_QPROJ_EPILOGUE == 23) {  // cos and sin rows of the tile's tokens, 16 float4 per row
    constexpr int kThr = MXMLA_QPROJ_EPILOGUE == 23 ? 128 : Cfg::kEpiThreads;
    for (int i = tid; i < 2 * Cfg::kBM * 16 && tid < kThr; i += kThr) {
      const int k = i % (Cfg::kBM * 16), si = m0 + k / 16;
      if (si >= p.S) continue;
      const float4 v = tab4(i < Cfg::kBM * 16 ? p.cos : p.sin, static_cast<int64_t>(si) * p.tab_st + 4 * (k % 16));
      acc ^= __float_as_uint(v.x) ^ __float_as_uint(v.y) ^ __float_as_uint(v.z) ^ __float_as_uint(v.w);
    }
  }
  if (p.kblocks < 0) reinterpret_cast<uint32_t*>(sm.tile)[tid] = acc;
}

template <bool kHalves, bool kE4M3>
__device__ __forceinline__ void epilogue_tile(const KParams& p, Smem& sm, int tid, int bi, int m0, int h, uint32_t n) {
  if constexpr (MXMLA_QPROJ_EPILOGUE >= 7 && kEpilogueOn) {
    synthetic_epilogue(p, sm, tid, bi, m0, h);
    return;
  }
  constexpr int kNB = Cfg::kNope / 32;  // nope blocks per row
  const uint32_t rcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int vb = p.sbhd ? 0 : bi;                                                    // scale-map batch
  const int64_t col0 = (p.sbhd ? static_cast<int64_t>(bi) * p.NH + h : h) * Cfg::kD;  // scale-map column of the head

  // ---- R: rope part; a warp takes 4 rows at a time, lane = (row of 4, unit u of 8 outputs): the
  //      table loads of one instruction are 4 rows x 128 contiguous bytes (4 cache lines), a
  //      quarter-warp's 16-byte shared accesses hit the 8 units of one row (conflict-free), and
  //      a code store covers 4 rows x 32 bytes.
  static_assert(Cfg::kR == 64, "the unit split below assumes rope halves of 32 and 8 units per row");
  constexpr int kRStep = Cfg::kEpiThreads / 32;  // warps
  const int lane = tid & 31, wid = tid >> 5, u = lane & 7, rl = lane >> 3;
  const bool ilv = !kHalves && !p.rotate_half;
  // output positions [pa, pa + 4) and [pb, pb + 4) of unit u, and their rope blocks
  const int pa = ilv ? 8 * u : 4 * u, pb = ilv ? 8 * u + 4 : 32 + 4 * u;
  const bool pa1 = pa >= 32, pb1 = pb >= 32;
  // Per-lane running offset of R's row codes (row 4 * wid + rl first, kRStep quads per iteration:
  // no 64-bit token arithmetic per row). Rows past the sequence load no tables and keep the last
  // row's (their inputs are TMA's zero rows; their outputs are never stored, and C reads only rows
  // of the sequence).
  const int64_t rc_step = int64_t{4 * kRStep} * (p.sbhd ? p.B : 1) * p.N;
  int64_t rc_off = token_of(p, bi, m0 + 4 * wid + rl) * p.N + static_cast<int64_t>(h) * Cfg::kD + Cfg::kNope;
  // table values (cos, sin at pa; cos, sin at pb) of row si
  auto load_tabs = [&](int si, float4 (&t)[4]) {
    if (si < p.S && MXMLA_QPROJ_EPILOGUE != 3) {
      const int64_t off = static_cast<int64_t>(si) * p.tab_st;
      t[0] = tab4(p.cos, off + pa), t[1] = tab4(p.sin, off + pa);
      t[2] = tab4(p.cos, off + pb), t[3] = tab4(p.sin, off + pb);
    }
  };

  // the first row quad's tables load while N runs; each R iteration loads the next quad's
  float4 tab[4] = {};
  load_tabs(m0 + 4 * wid + rl, tab);

  // ---- N: nope rowwise blocks, item = (row, block)
  if (p.row_codes != nullptr || p.q != nullptr) {
    // start so that the third items (512 = 2 x 224 + 64) go to warps 5 and 6, which have one row quad
    // less in R (32 = 4 x 7 + 4)
    static_assert(Cfg::kEpiThreads == 224 && Cfg::kBM * kNB == 512 && Cfg::kBM / 4 == 32, "the N / R balance");
#pragma unroll 2  // two items' loads in flight (-0.4 %, docs/notes-qproj.md)
    for (int item = (tid + 64) % Cfg::kEpiThreads; item < Cfg::kBM * kNB; item += Cfg::kEpiThreads) {
      // a warp's 32 items = 8 rows x 4 blocks, lane = (block, row): a quarter-warp's 16-byte reads hit 8
      // rows (the tile swizzle: conflict-free), a store instruction covers 8 rows (8 cache lines, not 32)
      const int r = 8 * (item / 32) + (item & 7), b = (item >> 3) & 3, si = m0 + r;
      static_assert(kNB == 4 && Cfg::kBM * kNB % 32 == 0, "item = (row group of 8, block, row)");
      if (si >= p.S) continue;
      uint32_t w[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 v = *reinterpret_cast<const uint4*>(sm.tile + tswz(r, 64 * b + 16 * i));
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
      }
      const int64_t tok = token_of(p, bi, si);
      if (p.row_codes != nullptr) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) m = __vmaxu2(m, w[i] & 0x7FFF7FFFu);
        const uint32_t amax = max(m << 16, m & 0xFFFF0000u);  // as fp32 bits
        const uint8_t e8 = block_scale_from_amax_bits(amax, rcp);
        const float mul = e8m0_quant_multiplier(e8);
        if (stores_on(p)) p.row_scales[row_scale_at(p.row_map, vb, si, col0 / 32 + b)] = e8;
        uint32_t c[8];
#pragma unroll
        for (int k = 0; k < 8; ++k)
          c[k] = codes4<kE4M3>(bf_lo(w[2 * k]), bf_hi(w[2 * k]), bf_lo(w[2 * k + 1]), bf_hi(w[2 * k + 1]), mul, mul, mul, mul);
        uint4* dst = reinterpret_cast<uint4*>(p.row_codes + tok * p.N + static_cast<int64_t>(h) * Cfg::kD + 32 * b);
        if (stores_on(p)) __stcs(dst, make_uint4(c[0], c[1], c[2], c[3])), __stcs(dst + 1, make_uint4(c[4], c[5], c[6], c[7]));
      }
      if (p.q != nullptr) {
        uint4* dst = reinterpret_cast<uint4*>(p.q + (tok * p.NH + h) * Cfg::kD + 32 * b);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          __stcs(dst + i, make_uint4(bf16x2_canonical(w[4 * i]), bf16x2_canonical(w[4 * i + 1]),
                                     bf16x2_canonical(w[4 * i + 2]), bf16x2_canonical(w[4 * i + 3])));
      }
    }
  }

  if (tid == 0) stamp(n, 12);
  if (MXMLA_QPROJ_EPILOGUE != 4) {
#pragma unroll 1
    for (int rq = wid; rq < Cfg::kBM / 4; rq += kRStep, rc_off += rc_step) {
      const int r = 4 * rq + rl, si = m0 + r;
      const float c0[4] = {tab[0].x, tab[0].y, tab[0].z, tab[0].w}, s0[4] = {tab[1].x, tab[1].y, tab[1].z, tab[1].w};
      const float c1[4] = {tab[2].x, tab[2].y, tab[2].z, tab[2].w}, s1[4] = {tab[3].x, tab[3].y, tab[3].z, tab[3].w};
      if (rq + kRStep < Cfg::kBM / 4) load_tabs(si + 4 * kRStep, tab);  // (c0..s1 hold this quad's)
      float x[8], oa[4], ob[4];  // inputs; outputs at pa and pb
      if (kHalves || ilv) {  // inputs [8u, 8u + 8)
        const uint4 w = *reinterpret_cast<const uint4*>(sm.tile + tswz(r, Cfg::kRopeOff + 16 * u));
        x[0] = bf_lo(w.x), x[1] = bf_hi(w.x), x[2] = bf_lo(w.y), x[3] = bf_hi(w.y);
        x[4] = bf_lo(w.z), x[5] = bf_hi(w.z), x[6] = bf_lo(w.w), x[7] = bf_hi(w.w);
      } else {  // rotate_half: inputs [4u, 4u + 4) and [32 + 4u, 32 + 4u + 4)
        const uint2 lo = *reinterpret_cast<const uint2*>(sm.tile + tswz(r, Cfg::kRopeOff + 8 * u));
        const uint2 hi = *reinterpret_cast<const uint2*>(sm.tile + tswz(r, Cfg::kRopeOff + 64 + 8 * u));
        x[0] = bf_lo(lo.x), x[1] = bf_hi(lo.x), x[2] = bf_lo(lo.y), x[3] = bf_hi(lo.y);
        x[4] = bf_lo(hi.x), x[5] = bf_hi(hi.x), x[6] = bf_lo(hi.y), x[7] = bf_hi(hi.y);
      }
      uint32_t ma = 0, mb = 0;  // magnitude maxima of the outputs at pa and at pb
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (kHalves) {  // out[i] = x[2i] c - x[2i+1] s, out[32 + i] = x[2i+1] c + x[2i] s
          oa[e] = rope_term(-s0[e], x[2 * e + 1], c0[e], x[2 * e]);
          ob[e] = rope_term(s1[e], x[2 * e], c1[e], x[2 * e + 1]);
        } else if (ilv) {  // pairs (2k, 2k+1) in place
          oa[e] = (e & 1) == 0 ? rope_term(-s0[e], x[e + 1], c0[e], x[e]) : rope_term(s0[e], x[e - 1], c0[e], x[e]);
          ob[e] = (e & 1) == 0 ? rope_term(-s1[e], x[4 + e + 1], c1[e], x[4 + e])
                               : rope_term(s1[e], x[4 + e - 1], c1[e], x[4 + e]);
        } else {  // rotate_half: out[j] = x[j] c - x[j+32] s, out[j+32] = x[j+32] c + x[j] s
          oa[e] = rope_term(-s0[e], x[4 + e], c0[e], x[e]);
          ob[e] = rope_term(s1[e], x[e], c1[e], x[4 + e]);
        }
        ma = max(ma, __float_as_uint(oa[e]) & 0x7FFFFFFFu), mb = max(mb, __float_as_uint(ob[e]) & 0x7FFFFFFFu);
      }
      // the fp32 outputs replace the row's bf16 inputs: all 8 lanes of the row (this warp) have read theirs
      if (MXMLA_QPROJ_EPILOGUE != 5) {
        __syncwarp();
        *reinterpret_cast<float4*>(sm.tile + tswz(r, Cfg::kRopeOff + 4 * pa)) = make_float4(oa[0], oa[1], oa[2], oa[3]);
        *reinterpret_cast<float4*>(sm.tile + tswz(r, Cfg::kRopeOff + 4 * pb)) = make_float4(ob[0], ob[1], ob[2], ob[3]);
      }
      uint32_t am0 = max(pa1 ? 0u : ma, pb1 ? 0u : mb), am1 = max(pa1 ? ma : 0u, pb1 ? mb : 0u);  // rope blocks 0, 1
#pragma unroll
      for (int m = 1; m < 8; m <<= 1) {  // over the 8 lanes of the row
        am0 = max(am0, __shfl_xor_sync(0xFFFFFFFFu, am0, m));
        am1 = max(am1, __shfl_xor_sync(0xFFFFFFFFu, am1, m));
      }
      if (si >= p.S) continue;
      if (p.row_codes != nullptr) {
        const uint8_t e0 = block_scale_from_amax_bits(am0, rcp), e1 = block_scale_from_amax_bits(am1, rcp);
        if (u < 2 && stores_on(p)) p.row_scales[row_scale_at(p.row_map, vb, si, col0 / 32 + kNB + u)] = u == 0 ? e0 : e1;
        const float m0s = e8m0_quant_multiplier(e0), m1s = e8m0_quant_multiplier(e1);
        const float fa = pa1 ? m1s : m0s, fb = pb1 ? m1s : m0s;
        uint8_t* dst = p.row_codes + rc_off;
        const uint32_t ca = codes4<kE4M3>(oa[0], oa[1], oa[2], oa[3], fa, fa, fa, fa);
        const uint32_t cb = codes4<kE4M3>(ob[0], ob[1], ob[2], ob[3], fb, fb, fb, fb);
        if (stores_on(p)) __stcs(reinterpret_cast<unsigned int*>(dst + pa), ca), __stcs(reinterpret_cast<unsigned int*>(dst + pb), cb);
      }
      if (p.q != nullptr) {
        uint16_t* dst = p.q + (token_of(p, bi, si) * p.NH + h) * Cfg::kD + Cfg::kNope;
        __stcs(reinterpret_cast<uint2*>(dst + pa), make_uint2(bf16x2_of(oa[0], oa[1]), bf16x2_of(oa[2], oa[3])));
        __stcs(reinterpret_cast<uint2*>(dst + pb), make_uint2(bf16x2_of(ob[0], ob[1]), bf16x2_of(ob[2], ob[3])));
      }
    }
  }

  if (tid == 0) stamp(n, 13);
  ptx::named_barrier(1, Cfg::kEpiThreads);  // the fp32 rope part complete
  if (tid == 0) stamp(n, 14);

  // ---- C: columnwise, item = (32-row block g, 4 columns), at most one per thread; the nope items
  //      first, so that each warp takes one kind
  if (p.col_codes != nullptr && MXMLA_QPROJ_EPILOGUE != 2) {
    constexpr int kQuads = Cfg::kD / 4, kNopeQuads = Cfg::kNope / 4;
    constexpr int kItems = (Cfg::kBM / 32) * kQuads, kNopeItems = (Cfg::kBM / 32) * kNopeQuads;
    static_assert(kItems <= Cfg::kEpiThreads, "one columnwise item per thread");
    static_assert(kNopeItems % 32 == 0, "warp-uniform nope / rope items");
    if (tid < kItems) {
      const bool nope_item = tid < kNopeItems;
      const int k = nope_item ? tid : tid - kNopeItems, nq = nope_item ? kNopeQuads : kQuads - kNopeQuads;
      const int g = k / nq, cq = (nope_item ? 0 : kNopeQuads) + k % nq, sg = m0 + 32 * g;
      if (sg < p.S) {
        const int nrows = min(32, p.S - sg);
        if (nope_item) col_item<true, kE4M3>(p, sm, bi, h, g, cq, sg, nrows);
        else col_item<false, kE4M3>(p, sm, bi, h, g, cq, sg, nrows);
      }
    }
  }
}

// ---------------------------------------------------------------- kernel
template <bool kHalves, bool kE4M3>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    sm90_qproj_rope_quant_kernel(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w,
                                 const KParams p) {
  extern __shared__ uint8_t smem_raw[];
  // 1024-align by an offset from smem_raw (not through an integer), so that the compiler keeps the
  // shared address space: LDS/STS with 32-bit addresses instead of generic loads (measured: the
  // generic ones cost the epilogue long-scoreboard stalls and registers)
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw + ((1024u - (ptx::smem_u32(smem_raw) & 1023u)) & 1023u));
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(&sm.full[s], 1);
      ptx::mbar_init(&sm.empty[s], 4 * Cfg::kMmaWGs);  // lane 0 of every MMA warp
    }
    ptx::mbar_init(&sm.tile_full, 128 * Cfg::kMmaWGs);  // every MMA thread after its fragment stores
    ptx::mbar_init(&sm.tile_empty, Cfg::kEpiThreads);   // every epilogue thread after its last tile read
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < 32) {  // ---------------- producer: one thread issues the TMA loads
    if (threadIdx.x == 0) {
      span(false, 0);  // (profiling only)
      ptx::prefetch_tmap(&tmap_x);
      ptx::prefetch_tmap(&tmap_w);
      uint32_t st = 0, phase = 0, n = 0;  // ring position and its parity; tiles
      for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x, ++n) {
        int bi, m0, h;
        tile_coords(p, t, bi, m0, h);
        unsigned long long waited = 0;  // (profiling only)
        for (int kb = 0; kb < p.kblocks; ++kb) {
          const unsigned long long w0 = prof_clock();
          ptx::mbar_wait(&sm.empty[st], phase ^ 1);
          waited += prof_clock() - w0;
          if (!kLoadsOn && (n > 0 || kb >= Cfg::kStages)) {  // (energy knobs 31, 32 only)
            ptx::mbar_arrive(&sm.full[st]);
            if (++st == Cfg::kStages) st = 0, phase ^= 1;
            continue;
          }
          ptx::mbar_arrive_expect_tx(&sm.full[st], Cfg::kStageBytes);
          // x map dims: {K, B, S} for sbhd (b is the inner token dim), {K, S, B} for bshd
          if (p.sbhd) ptx::tma_load_3d(sm.a[st], &tmap_x, &sm.full[st], kb * Cfg::kBK, bi, m0);
          else ptx::tma_load_3d(sm.a[st], &tmap_x, &sm.full[st], kb * Cfg::kBK, m0, bi);
          ptx::tma_load_2d(sm.b[st], &tmap_w, &sm.full[st], kb * Cfg::kBK, h * Cfg::kD);
          if (++st == Cfg::kStages) st = 0, phase ^= 1;
        }
        stamp_value(n, 16, waited);
      }
    }
    return;
  }

  if (wg == 0 || wg == Cfg::kMmaWGs + 1) {  // ---------------- epilogue: warps 1..3 and the last warpgroup
    const int tid = wg == 0 ? Cfg::kBM + threadIdx.x - 32 : threadIdx.x - 128 * wg;  // whole warps
    uint32_t n = 0;
    for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x, ++n) {
      int bi, m0, h;
      tile_coords(p, t, bi, m0, h);
      ptx::mbar_wait(&sm.tile_full, n & 1);  // (implies that every epilogue thread is done with the previous tile)
      if (tid == 0) stamp(n, 4);
#if MXMLA_QPROJ_EPILOGUE && MXMLA_QPROJ_EPILOGUE < 30
      epilogue_tile<kHalves, kE4M3>(p, sm, tid, bi, m0, h, n);
#endif
      if (tid % 32 == 0) stamp(n, 5 + tid / 32);
      ptx::mbar_arrive(&sm.tile_empty);
    }
    if (tid == 0) span(true, n);  // (profiling only)
    return;
  }

  // ---------------- MMA warpgroups: 64 rows each
  const int cw = wg - 1;
  const int w4 = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float acc[96];
  // descriptors of stage 0; a stage is a whole number of 16-byte descriptor units further on
  const uint64_t da0 = ptx::wgmma_desc_k_sw128(sm.a[0] + 64 * cw * Cfg::kBK), db0 = ptx::wgmma_desc_k_sw128(sm.b[0]);
  constexpr uint32_t kAStep = sizeof(Smem::a[0]) / 16, kBStep = sizeof(Smem::b[0]) / 16;
  uint32_t st = 0, phase = 0, n = 0;  // ring position, its parity; tiles done
  const bool pw = MXMLA_QPROJ_PROFILE && threadIdx.x == 128;  // lane 0 of the first MMA warp
  for (int t = blockIdx.x; t < p.num_tiles; t += gridDim.x, ++n) {
    if (pw) stamp(n, 0);
    uint32_t prev = 0;
#pragma unroll
    for (int i = 0; i < 96; ++i) ptx::fence_reg(acc[i]);
    unsigned long long waited = 0;  // (profiling only)
    for (int kb = 0; kb < p.kblocks; ++kb) {
      const unsigned long long w0 = prof_clock();
      ptx::mbar_wait(&sm.full[st], phase);
      waited += prof_clock() - w0;
      ptx::wgmma_fence();
      const uint64_t da = da0 + st * kAStep, db = db0 + st * kBStep;
#pragma unroll
      for (int k = 0; k < Cfg::kBK / 16; ++k)  // 16 elements = 32 bytes = 2 descriptor units
        if (kMmaOn) ptx::wgmma_m64n192k16_bf16(acc, da + 2 * k, db + 2 * k, kb > 0 || k > 0);
      ptx::wgmma_commit();
      if (kb > 0) {
        ptx::wgmma_wait<1>();  // the previous stage's wgmmas are done: hand it back
        if (lane == 0) ptx::mbar_arrive(&sm.empty[prev]);
      }
      prev = st;
      if (++st == Cfg::kStages) st = 0, phase ^= 1;
    }
    ptx::wgmma_wait<0>();
    if (pw) stamp(n, 1), stamp_value(n, 15, waited);
    if (lane == 0) ptx::mbar_arrive(&sm.empty[prev]);
#pragma unroll
    for (int i = 0; i < 96; ++i) ptx::fence_reg(acc[i]);
    // accumulator -> bf16 (SPEC §4) -> sm.tile, once the epilogue has read the previous tile
    ptx::mbar_wait(&sm.tile_empty, (n & 1) ^ 1);
    if (pw) stamp(n, 2);
    // stmatrix x4 = column groups (j, j+1) x row halves (0, 8): lane l addresses row l % 8 of matrix l / 8
    const int mi = lane / 8;
    const int srow = 64 * cw + 16 * w4 + lane % 8 + 8 * (mi & 1), sw = srow & 7;
    // chunk j + (mi >> 1) (j even) of row srow, swizzled: 128-byte group j / 8, then chunk
    // (j % 8) ^ (sw & 6) plus bit ((mi >> 1) ^ sw) & 1: four per-lane offsets, the group an immediate
    uint8_t* const sbase = sm.tile + srow * Cfg::kTileRow + 16 * (((mi >> 1) ^ sw) & 1);
    uint32_t soff[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) soff[c] = 16u * ((2 * c) ^ (sw & 6));
    static_assert(Cfg::kJ % 8 == 0, "column groups in whole 128-byte groups");
#pragma unroll
    for (int j = 0; j < Cfg::kJ; j += 2)
      ptx::stmatrix_x4(sbase + 128 * (j / 8) + soff[(j % 8) / 2], bf16x2_bits(acc[4 * j], acc[4 * j + 1]), bf16x2_bits(acc[4 * j + 2], acc[4 * j + 3]),
                       bf16x2_bits(acc[4 * j + 4], acc[4 * j + 5]), bf16x2_bits(acc[4 * j + 6], acc[4 * j + 7]));
    ptx::mbar_arrive(&sm.tile_full);
    if (pw) stamp(n, 3);
  }
#if MXMLA_QPROJ_PROFILE
  if (pw && blockIdx.x < kProfSpans) g_mma_end[blockIdx.x] = ptx::globaltimer();
#endif
}

// ---------------------------------------------------------------- W given as [K, N]
// The kernel reads W K-major ([N, K], the TMA box of one head). A [K, N] weight is first transposed
// into a stream-ordered scratch buffer (one extra read + write of W: ~2 % of the op at T 16384,
// NH 128). 32 x 32 tiles through shared memory; dst [N, K] contiguous.
__global__ void __launch_bounds__(256) transpose_kn_to_nk(const uint16_t* __restrict__ src, int64_t src_st,
                                                          uint16_t* __restrict__ dst, int64_t K, int64_t N) {
  __shared__ uint16_t t[32][33];
  const int64_t k0 = int64_t{blockIdx.y} * 32, n0 = int64_t{blockIdx.x} * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t k = k0 + i, n = n0 + threadIdx.x;
    if (k < K && n < N) t[i][threadIdx.x] = src[k * src_st + n];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t n = n0 + i, k = k0 + threadIdx.x;
    if (k < K && n < N) dst[n * K + k] = t[threadIdx.x][i];
  }
}

// ---------------------------------------------------------------- bf16 tables
// Rows [0, rows) of bf16 cos / sin (row stride st elements) widened to fp32 (exact) into dst:
// [2][rows][kR] (cos, then sin), so that the kernel's epilogue has one table type to load.
__global__ void __launch_bounds__(256) widen_tables(const uint16_t* __restrict__ c, const uint16_t* __restrict__ sn,
                                                    int64_t st, float* __restrict__ dst, int64_t rows) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= rows * Cfg::kR) return;
  const int64_t off = (i / Cfg::kR) * st + i % Cfg::kR;
  dst[i] = bf_lo(c[off]);
  dst[rows * Cfg::kR + i] = bf_lo(sn[off]);
}

// ---------------------------------------------------------------- host
CUtensorMap make_tmap(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides_bytes,
                      const cuuint32_t* box) {
  return make_tmap_bf16(base, rank, dims, strides_bytes, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

#if MXMLA_QPROJ_PROFILE
// Mean cycles per tile of each phase over the profiled CTAs (tiles 2 .. last-1), then the spread of
// every CTA's span, on stderr.
void print_profile(int tiles, int grid, cudaStream_t stream) {
  static unsigned long long h[kProfCtas][kProfTiles][kProfSlots];
  MXMLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_prof, sizeof(h)));
  double a[16] = {};
  int cnt = 0;
  for (int c = 0; c < kProfCtas; ++c)
    for (int n = 2; n + 1 < std::min(tiles - 1, kProfTiles); ++n, ++cnt) {
      auto d = [&](int from, int to, int n_to = 0) { return double(h[c][n + n_to][to]) - double(h[c][n][from]); };
      a[0] += d(0, 1), a[1] += d(1, 2), a[2] += d(2, 3), a[3] += d(0, 0, 1), a[4] += d(3, 4);
      a[5] += d(4, 12), a[6] += d(12, 13), a[7] += d(13, 14), a[8] += d(4, 4, 1);
      double last = 0;
      for (int w = 0; w < Cfg::kEpiThreads / 32; ++w) {  // epilogue warps
        const double e = d(4, 5 + w);
        last = std::max(last, e);
        a[w < 4 ? 10 : w < 6 ? 11 : 12] += e / (w < 4 ? 4 : w < 6 ? 2 : 1);
      }
      a[9] += last, a[13] += d(4, 4, 1) - last;
      a[14] += double(h[c][n][15]), a[15] += double(h[c][n][16]);
    }
  const char* names[16] = {"MMA mainloop", "MMA wait for tile_empty", "MMA hand-off (stmatrix)", "MMA tile cycle",
                           "hand-off -> epilogue starts", "epilogue warp 0: N", "epilogue warp 0: R",
                           "epilogue warp 0: barrier wait", "epilogue tile cycle", "epilogue: last warp done",
                           "epilogue warps 0-3 (nope C)", "epilogue warps 4-5 (rope C)", "epilogue warp 6 (no C)",
                           "epilogue idle (last warp -> next tile)", "MMA waits for stage data (in mainloop)",
                           "producer waits for free stages"};
  std::fprintf(stderr, "qproj profile: %d tiles per CTA, %d tile samples, mean cycles per tile\n", tiles, cnt);
  for (int i = 0; i < 16; ++i)  // (without the epilogue only the MMA warps' and the producer's phases mean anything)
    // knob 0: no epilogue rows; knobs 7-24 (synthetic): no N / R / barrier stamps
    if ((MXMLA_QPROJ_EPILOGUE != 0 || i < 4 || i >= 14) && (MXMLA_QPROJ_EPILOGUE < 7 || i < 5 || i > 7))
      std::fprintf(stderr, "  %-40s %8.0f\n", names[i], a[i] / std::max(cnt, 1));
  static BlockSpan sp[kProfSpans];
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(sp, g_spans, sizeof(sp)));
  print_block_spans(sp, std::min(grid, kProfSpans));
  static unsigned long long me[kProfSpans];
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(me, g_mma_end, sizeof(me)));
  std::vector<double> drain;
  for (int b = 0; b < std::min(grid, kProfSpans); ++b) drain.push_back(1e-3 * double(sp[b].end - me[b]));
  std::sort(drain.begin(), drain.end());
  if (!drain.empty())
    std::fprintf(stderr, "  drain (epilogue end - MMA warps' last hand-off) us min/med/max %.2f / %.2f / %.2f\n", drain.front(),
                 drain[drain.size() / 2], drain.back());
}
#endif

template <bool kHalves, bool kE4M3>
void launch(const CUtensorMap& tx, const CUtensorMap& tw, const KParams& kp, cudaStream_t stream) {
  auto* kernel = sm90_qproj_rope_quant_kernel<kHalves, kE4M3>;
  // per device, once (as the other kernels' launchers): the shared-memory limit, then the SM count
  static int cached_sms[64] = {};
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  int& sms = cached_sms[dev & 63];
  if (sms == 0) {
    MXMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
    int n = 0;
    MXMLA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    sms = n > 0 ? n : 1;
  }
  const int grid = MXMLA_QPROJ_GRID == 0 ? balanced_grid(kp.num_tiles, sms)
                                         : std::min(kp.num_tiles, MXMLA_QPROJ_GRID == 1 ? sms : MXMLA_QPROJ_GRID);
  kernel<<<grid, Cfg::kThreads, kSmemBytes, stream>>>(tx, tw, kp);
  MXMLA_CUDA_CHECK(cudaGetLastError());
#if MXMLA_QPROJ_PROFILE
  static int launches = 0;
  if (++launches == 6) print_profile((kp.num_tiles + grid - 1) / grid, grid, stream);
#endif
}

}  // namespace

bool qproj_cuda_supports(int64_t D, int64_t R) { return D == Cfg::kD && R == Cfg::kR; }

void qproj_cuda(const QProjProblem& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  const int64_t tokens = p.B * p.S;
  if (tokens == 0) return;
  // BHSD scales have padding that nobody else writes.
  if (p.row_scales != nullptr && p.row_map.mode != MapMode::kCompact)
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.row_scales, 0, row_map_bytes(p.row_map), stream));
  if (p.col_scales != nullptr && p.col_map.mode != MapMode::kCompact)
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.col_scales, 0, col_map_bytes(p.col_map), stream));

  // x: {K, B, S} (sbhd) or {K, S, B} (bshd), box {64, 1, 128} / {64, 128, 1}
  cuuint64_t xd[3], xs[2];
  cuuint32_t xb[3];
  xd[0] = p.K, xb[0] = Cfg::kBK;
  const int64_t st_b = p.B > 1 ? p.x_st_b : p.x_st_s * p.S;  // any legal stride when there is one sequence
  if (p.sbhd) xd[1] = p.B, xd[2] = p.S, xs[0] = st_b * 2, xs[1] = p.x_st_s * 2, xb[1] = 1, xb[2] = Cfg::kBM;
  else xd[1] = p.S, xd[2] = p.B, xs[0] = p.x_st_s * 2, xs[1] = st_b * 2, xb[1] = Cfg::kBM, xb[2] = 1;
  const CUtensorMap tx = make_tmap(p.x, 3, xd, xs, xb);
  const void* w = p.w;
  int64_t w_st = p.w_st;
  StreamScratch scratch(p.w_kn ? p.NH * p.D * p.K * 2 : 0, stream);  // W transposed to [N, K]
  if (p.w_kn) {
    const int64_t N = p.NH * p.D;
    const dim3 grid(unsigned((N + 31) / 32), unsigned((p.K + 31) / 32)), block(32, 8);
    transpose_kn_to_nk<<<grid, block, 0, stream>>>(static_cast<const uint16_t*>(p.w), p.w_st,
                                                   reinterpret_cast<uint16_t*>(scratch.ptr), p.K, N);
    MXMLA_CUDA_CHECK(cudaGetLastError());
    w = scratch.ptr, w_st = p.K;
  }
  const cuuint64_t wd[2] = {cuuint64_t(p.K), cuuint64_t(p.NH * p.D)}, ws[1] = {cuuint64_t(w_st * 2)};
  const cuuint32_t wb[2] = {Cfg::kBK, Cfg::kD};
  const CUtensorMap tw = make_tmap(w, 2, wd, ws, wb);

  KParams kp{};
  kp.B = int(p.B), kp.S = int(p.S), kp.NH = int(p.NH);
  kp.mtiles = int((p.S + Cfg::kBM - 1) / Cfg::kBM);
  kp.num_tiles = int(p.B * kp.mtiles * p.NH);
  kp.kblocks = int((p.K + Cfg::kBK - 1) / Cfg::kBK);
  kp.sbhd = p.sbhd, kp.rotate_half = p.style == RopeStyle::kRotateHalf;
  const bool tab_f32 = p.tab_t == DType::kFloat32;
  StreamScratch tabs(tab_f32 ? 0 : 2 * p.S * Cfg::kR * 4, stream);  // bf16 tables as fp32
  if (tab_f32) {
    kp.cos = static_cast<const float*>(p.cos), kp.sin = static_cast<const float*>(p.sin), kp.tab_st = p.tab_st;
  } else {
    const int64_t n = p.S * Cfg::kR;
    widen_tables<<<unsigned((n + 255) / 256), 256, 0, stream>>>(static_cast<const uint16_t*>(p.cos),
                                                               static_cast<const uint16_t*>(p.sin), p.tab_st,
                                                               reinterpret_cast<float*>(tabs.ptr), p.S);
    MXMLA_CUDA_CHECK(cudaGetLastError());
    kp.cos = reinterpret_cast<const float*>(tabs.ptr), kp.sin = kp.cos + n, kp.tab_st = Cfg::kR;
  }
  kp.N = p.NH * p.D;
  kp.row_codes = p.row_codes, kp.row_scales = p.row_scales, kp.col_codes = p.col_codes, kp.col_scales = p.col_scales;
  kp.row_map = p.row_map, kp.col_map = p.col_map, kp.q = p.q;

  const bool halves = p.style == RopeStyle::kInterleavedInHalvesOut, e4m3 = p.fmt == Fp8Format::kE4M3;
  if (halves && e4m3) launch<true, true>(tx, tw, kp, stream);
  else if (halves) launch<true, false>(tx, tw, kp, stream);
  else if (e4m3) launch<false, true>(tx, tw, kp, stream);
  else launch<false, false>(tx, tw, kp, stream);
}

}  // namespace mxmla::detail
