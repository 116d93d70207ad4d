// mxmla internal — SM90 part: the fused Q up-projection's epilogue: the accumulator tile of one
// head (128 tokens x D = nope + rope) -> bf16 (SPEC §4's first rounding) -> RoPE of the rope part
// in fp32 -> MXFP8 rowwise (blocks of 32 along the head dim) and columnwise (blocks of 32 tokens
// of one sequence), scales compact or BHSD, plus the optional bf16 q.
//
// Two sides, joined by a one-tile Handoff (cuda/sm90/pipeline.cuh) in the kernel:
//   store_accumulators  each MMA warpgroup rounds its 64 accumulator rows to bf16 and writes them
//                       into the shared tile with stmatrix (then goes on to the next tile's mainloop);
//   run                 the epilogue warps (kThreads = 7 warps: a whole warpgroup plus warps 1..3 of
//                       the producer's, whose warp 0 issues TMA) take the tile while the next one is
//                       multiplied:
//     N  thread = (nope block, row), a warp = 8 rows x 4 blocks: amax on packed bf16 pairs, scale,
//        codes (and the bf16 q copy);
//     R  warp = 4 rows, lane = 8 outputs: RoPE of the rope part in fp32 (written back over the row's
//        bf16 inputs), its rowwise blocks (amax over 8 lanes, scale, codes) and the bf16 q of it;
//     C  thread = (32-row block, 4 columns): amax over 32 rows, 4 scales, then the codes row by row
//        (a warp writes 128 contiguous bytes per row), from the bf16 nope or the fp32 rope part.
// What the epilogue costs and why it is shaped this way: docs/notes-qproj.md. Its arithmetic
// competes with the wgmmas for the SM sub-partitions; nothing is to be added to the MMA warps'
// side (store_accumulators lands on the tile cycle directly).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/mxfp8_common.h"
#include "cuda/numerics.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "mxmla/rope.h"

namespace mxmla::sm90 {

using detail::MapMode;
using detail::ScaleMap;

// The problem as the epilogue sees it. Token order (codes, q): sbhd t = s*B + b, bshd t = b*S + s;
// codes contiguous [tokens, N = NH*D]; scales through row_map / col_map (quantize_attention's
// geometry); q (optional) bf16 [tokens, NH, D]; tables fp32 [>= S rows, R] (row stride tab_st).
struct RopeMxfp8Params {
  int B, S, NH;
  bool sbhd;
  const float* cos;
  const float* sin;
  int64_t tab_st, N;
  uint8_t *row_codes, *row_scales, *col_codes, *col_scales;  // null codes: that direction is off
  ScaleMap row_map, col_map;
  uint16_t* q;
};

template <int kD_, int kR_, int kBM_, RopeStyle kStyle, bool kE4M3>
struct EpilogueRopeMxfp8 {
  static constexpr int kD = kD_, kR = kR_, kNope = kD - kR, kBM = kBM_;
  static constexpr int kThreads = 128 + 96;  // the epilogue warpgroup + warps 1..3 of the producer's
  static constexpr int kWarps = kThreads / 32;
  // a tile row: the nope part as bf16, then the rope part: bf16 from the MMA, overwritten in place
  // by its fp32 RoPE output (bytes kRopeOff .. kTileRow)
  static constexpr int kTileRow = kNope * 2 + kR * 4;
  static constexpr int kRopeOff = kNope * 2;
  static constexpr int kJ = kD / 8;  // 8-column groups of the accumulator fragment
  static constexpr bool kHalves = kStyle == RopeStyle::kInterleavedInHalvesOut;
  static constexpr bool kIlv = kStyle == RopeStyle::kInterleaved;
  static_assert(kD % 32 == 0 && kR % 32 == 0 && kNope % 32 == 0, "whole MXFP8 blocks in nope and rope");
  static_assert(kR == 64, "the R split assumes rope halves of 32 and 8 units of 8 outputs per row");
  static_assert(kNope / 32 == 4 && kBM == 128 && kThreads == 224, "the N / R / C balance below (docs/notes-qproj.md)");
  static_assert(kTileRow % 128 == 0 && kRopeOff % 128 == 0, "tile rows of whole 128-byte swizzle groups");
  static_assert(kJ % 8 == 0, "accumulator column groups in whole 128-byte groups");

  struct SharedStorage {
    uint8_t tile[kBM * kTileRow];  // [128 rows][nope bf16 | rope bf16 -> fp32], 16-byte chunks swizzled
  };
  using RopeDone = NamedBarrier<1, kThreads>;  // the fp32 rope part of the tile is complete

  // Byte offset of logical byte `off` of row `row` in the tile: 16-byte chunks are XOR-swizzled by
  // row % 8 inside their 128-byte group, so that 8 rows at the same column (stmatrix, N) and 8
  // chunks of one row (R, C) each hit all banks (no padding: the fourth stage needs the space).
  __device__ __forceinline__ static uint32_t tswz(int row, int off) {
    return static_cast<uint32_t>(row * kTileRow + (off ^ ((row & 7) << 4)));
  }
  __device__ __forceinline__ static int64_t token_of(const RopeMxfp8Params& p, int bi, int s) {
    return p.sbhd ? static_cast<int64_t>(s) * p.B + bi : static_cast<int64_t>(bi) * p.S + s;
  }
  // Four consecutive fp32 table values (rows 16-byte aligned: checked by the host, or the scratch).
  __device__ __forceinline__ static float4 tab4(const float* tab, int64_t off) {
    return __ldg(reinterpret_cast<const float4*>(tab + off));
  }
  // The rowwise scale offset of block kb of row si of batch vb: compact maps inline (the common
  // case, fewer instructions in the hot loops than the general cursor), the others through it.
  __device__ __forceinline__ static int64_t row_scale_at(const ScaleMap& m, int vb, int si, int64_t kb) {
    if (m.mode == MapMode::kCompact) return (static_cast<int64_t>(vb) * m.rows + si) * (m.cols / 32) + kb;
    return detail::row_scale_offset(m, vb, si, kb);
  }

  // ---------------------------------------------------------------- MMA side
  // MMA warpgroup cw (rows 64 cw ..): its accumulators [64 x kD] (the m64nNk16 fragment) -> bf16 ->
  // the tile. stmatrix x4 = column groups (j, j+1) x row halves (0, 8): lane l addresses row l % 8
  // of matrix l / 8.
  __device__ __forceinline__ static void store_accumulators(SharedStorage& sm, int cw, const float (&acc)[kD / 2]) {
    const int w4 = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int mi = lane / 8;
    const int srow = 64 * cw + 16 * w4 + lane % 8 + 8 * (mi & 1), sw = srow & 7;
    // chunk j + (mi >> 1) (j even) of row srow, swizzled: 128-byte group j / 8, then chunk
    // (j % 8) ^ (sw & 6) plus bit ((mi >> 1) ^ sw) & 1: four per-lane offsets, the group an immediate
    const uint32_t sbase = ptx::smem_u32(sm.tile) + srow * kTileRow + 16 * (((mi >> 1) ^ sw) & 1);
    uint32_t soff[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) soff[c] = sbase + 16u * ((2 * c) ^ (sw & 6));
#pragma unroll
    for (int j = 0; j < kJ; j += 2)
      ptx::stmatrix_x4(soff[(j % 8) / 2] + 128 * (j / 8), detail::bf16x2_rn(acc[4 * j], acc[4 * j + 1]),
                       detail::bf16x2_rn(acc[4 * j + 2], acc[4 * j + 3]), detail::bf16x2_rn(acc[4 * j + 4], acc[4 * j + 5]),
                       detail::bf16x2_rn(acc[4 * j + 6], acc[4 * j + 7]));
  }

  // ---------------------------------------------------------------- C: one columnwise item
  // Four columns (4 * cq ...) of the 32-row block g of the tile: amax over the rows, four E8M0
  // scales, then the codes row by row (a warp writes 128 contiguous bytes per row). Nope columns
  // come from the bf16 tile, rope columns from the fp32 RoPE output. A full block (nrows == 32) is
  // unrolled with independent max chains; a tail block takes the generic loop.
  template <bool kNopeItem>
  __device__ __forceinline__ static void col_item(const RopeMxfp8Params& p, const SharedStorage& sm, int bi, int h, int g,
                                                  int cq, int sg, int nrows) {
    constexpr int kNopeQuads = kNope / 4;
    constexpr uint32_t rcp = detail::rcp_max_bits<kE4M3>();
    const int r0 = 32 * g;
    const int coff = kNopeItem ? 8 * cq : kRopeOff + 16 * (cq - kNopeQuads);  // logical byte of the 4 columns
    auto load4 = [&](int i, float (&v)[4]) {  // row i of the four columns as fp32
      if constexpr (kNopeItem) {
        const uint2 w = *reinterpret_cast<const uint2*>(sm.tile + tswz(r0 + i, coff));
        v[0] = detail::bf16_lo(w.x), v[1] = detail::bf16_hi(w.x), v[2] = detail::bf16_lo(w.y), v[3] = detail::bf16_hi(w.y);
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
        if constexpr (kNopeItem) {
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
        for (int j = 0; j < 4; ++j) m[0][j] = kNopeItem ? __vmaxu2(m[0][j], m[c][j]) : max(m[0][j], m[c][j]);
      if constexpr (kNopeItem)
        a[0] = m[0][0] << 16, a[1] = m[0][0] & 0xFFFF0000u, a[2] = m[0][1] << 16, a[3] = m[0][1] & 0xFFFF0000u;
      else a[0] = m[0][0], a[1] = m[0][1], a[2] = m[0][2], a[3] = m[0][3];
    } else {
#pragma unroll 4
      for (int i = 0; i < nrows; ++i) {
        float v[4];
        load4(i, v);
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = max(a[j], detail::mag_bits(v[j]));
      }
    }
    uint8_t e[4];
    float mul[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) e[j] = detail::block_scale_from_amax_bits(a[j], rcp), mul[j] = detail::e8m0_quant_multiplier(e[j]);
    const int vb = p.sbhd ? 0 : bi;
    const int64_t c = (p.sbhd ? static_cast<int64_t>(bi) * p.NH + h : h) * kD + 4 * cq;  // scale-map column
    if (p.col_map.mode == MapMode::kCompact) {
      *reinterpret_cast<uint32_t*>(p.col_scales + detail::col_scale_offset(p.col_map, vb, sg / 32, c)) =
          e[0] | (uint32_t{e[1]} << 8) | (uint32_t{e[2]} << 16) | (uint32_t{e[3]} << 24);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) p.col_scales[detail::col_scale_offset(p.col_map, vb, sg / 32, c + j)] = e[j];
    }
    const int64_t tstride = p.sbhd ? int64_t{p.B} * p.N : p.N;  // bytes from one token of the sequence to the next
    uint8_t* dst = p.col_codes + token_of(p, bi, sg) * p.N + static_cast<int64_t>(h) * kD + 4 * cq;
    auto code_row = [&](int i, uint8_t* d) {
      float v[4];
      load4(i, v);
      __stcs(reinterpret_cast<unsigned int*>(d), detail::fp8x4<kE4M3>(v[0], v[1], v[2], v[3], mul[0], mul[1], mul[2], mul[3]));
    };
    if (nrows == 32) {
#pragma unroll
      for (int i = 0; i < 32; ++i, dst += tstride) code_row(i, dst);
    } else {
#pragma unroll 4
      for (int i = 0; i < nrows; ++i, dst += tstride) code_row(i, dst);
    }
  }

  // ---------------------------------------------------------------- epilogue warps
  // Epilogue thread tid (0 .. kThreads-1, whole warps) on the tile of sequence bi, tokens m0 ..
  // m0 + kBM - 1, head h (the n-th tile of this CTA, for the probe's stamps).
  template <class Probe>
  __device__ __forceinline__ static void run(const RopeMxfp8Params& p, SharedStorage& sm, int tid, int bi, int m0, int h,
                                             uint32_t n) {
    constexpr int kNB = kNope / 32;  // nope blocks per row
    constexpr uint32_t rcp = detail::rcp_max_bits<kE4M3>();
    const int vb = p.sbhd ? 0 : bi;                                              // scale-map batch
    const int64_t col0 = (p.sbhd ? static_cast<int64_t>(bi) * p.NH + h : h) * kD;  // scale-map column of the head

    // ---- R's layout: a warp takes 4 rows at a time, lane = (row of 4, unit u of 8 outputs): the
    //      table loads of one instruction are 4 rows x 128 contiguous bytes (4 cache lines), a
    //      quarter-warp's 16-byte shared accesses hit the 8 units of one row (conflict-free), and
    //      a code store covers 4 rows x 32 bytes.
    constexpr int kRStep = kWarps;
    const int lane = tid & 31, wid = tid >> 5, u = lane & 7, rl = lane >> 3;
    // output positions [pa, pa + 4) and [pb, pb + 4) of unit u, and their rope blocks
    const int pa = kIlv ? 8 * u : 4 * u, pb = kIlv ? 8 * u + 4 : 32 + 4 * u;
    const bool pa1 = pa >= 32, pb1 = pb >= 32;
    // Per-lane running offset of R's row codes (row 4 * wid + rl first, kRStep quads per
    // iteration: no 64-bit token arithmetic per row). Rows past the sequence load no tables and
    // keep the last row's (their inputs are TMA's zero rows; their outputs are never stored, and
    // C reads only rows of the sequence).
    const int64_t rc_step = int64_t{4 * kRStep} * (p.sbhd ? p.B : 1) * p.N;
    int64_t rc_off = token_of(p, bi, m0 + 4 * wid + rl) * p.N + static_cast<int64_t>(h) * kD + kNope;
    // table values (cos, sin at pa; cos, sin at pb) of row si
    auto load_tabs = [&](int si, float4 (&t)[4]) {
      if (si < p.S) {
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
      // start so that the third items (512 = 2 x 224 + 64) go to warps 5 and 6, which have one row
      // quad less in R (32 = 4 x 7 + 4)
#pragma unroll 2  // two items' loads in flight (-0.4 %, docs/notes-qproj.md)
      for (int item = (tid + 64) % kThreads; item < kBM * kNB; item += kThreads) {
        // a warp's 32 items = 8 rows x 4 blocks, lane = (block, row): a quarter-warp's 16-byte reads
        // hit 8 rows (the tile swizzle: conflict-free), a store instruction covers 8 rows (8 cache
        // lines, not 32)
        const int r = 8 * (item / 32) + (item & 7), b = (item >> 3) & 3, si = m0 + r;
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
          const uint8_t e8 = detail::block_scale_from_amax_bits(amax, rcp);
          const float mul = detail::e8m0_quant_multiplier(e8);
          p.row_scales[row_scale_at(p.row_map, vb, si, col0 / 32 + b)] = e8;
          uint32_t c[8];
#pragma unroll
          for (int k = 0; k < 8; ++k)
            c[k] = detail::fp8x4<kE4M3>(detail::bf16_lo(w[2 * k]), detail::bf16_hi(w[2 * k]), detail::bf16_lo(w[2 * k + 1]),
                                        detail::bf16_hi(w[2 * k + 1]), mul);
          uint4* dst = reinterpret_cast<uint4*>(p.row_codes + tok * p.N + static_cast<int64_t>(h) * kD + 32 * b);
          __stcs(dst, make_uint4(c[0], c[1], c[2], c[3])), __stcs(dst + 1, make_uint4(c[4], c[5], c[6], c[7]));
        }
        if (p.q != nullptr) {
          uint4* dst = reinterpret_cast<uint4*>(p.q + (tok * p.NH + h) * kD + 32 * b);
#pragma unroll
          for (int i = 0; i < 4; ++i)
            __stcs(dst + i, make_uint4(detail::bf16x2_canonical(w[4 * i]), detail::bf16x2_canonical(w[4 * i + 1]),
                                       detail::bf16x2_canonical(w[4 * i + 2]), detail::bf16x2_canonical(w[4 * i + 3])));
        }
      }
    }

    if (tid == 0) Probe::stamp(n, 12);
    // ---- R: the rope part
#pragma unroll 1
    for (int rq = wid; rq < kBM / 4; rq += kRStep, rc_off += rc_step) {
      const int r = 4 * rq + rl, si = m0 + r;
      const float c0[4] = {tab[0].x, tab[0].y, tab[0].z, tab[0].w}, s0[4] = {tab[1].x, tab[1].y, tab[1].z, tab[1].w};
      const float c1[4] = {tab[2].x, tab[2].y, tab[2].z, tab[2].w}, s1[4] = {tab[3].x, tab[3].y, tab[3].z, tab[3].w};
      if (rq + kRStep < kBM / 4) load_tabs(si + 4 * kRStep, tab);  // (c0..s1 hold this quad's)
      float x[8], oa[4], ob[4];  // inputs; outputs at pa and pb
      if constexpr (kHalves || kIlv) {  // inputs [8u, 8u + 8)
        const uint4 w = *reinterpret_cast<const uint4*>(sm.tile + tswz(r, kRopeOff + 16 * u));
        x[0] = detail::bf16_lo(w.x), x[1] = detail::bf16_hi(w.x), x[2] = detail::bf16_lo(w.y), x[3] = detail::bf16_hi(w.y);
        x[4] = detail::bf16_lo(w.z), x[5] = detail::bf16_hi(w.z), x[6] = detail::bf16_lo(w.w), x[7] = detail::bf16_hi(w.w);
      } else {  // rotate_half: inputs [4u, 4u + 4) and [32 + 4u, 32 + 4u + 4)
        const uint2 lo = *reinterpret_cast<const uint2*>(sm.tile + tswz(r, kRopeOff + 8 * u));
        const uint2 hi = *reinterpret_cast<const uint2*>(sm.tile + tswz(r, kRopeOff + 64 + 8 * u));
        x[0] = detail::bf16_lo(lo.x), x[1] = detail::bf16_hi(lo.x), x[2] = detail::bf16_lo(lo.y), x[3] = detail::bf16_hi(lo.y);
        x[4] = detail::bf16_lo(hi.x), x[5] = detail::bf16_hi(hi.x), x[6] = detail::bf16_lo(hi.y), x[7] = detail::bf16_hi(hi.y);
      }
      uint32_t ma = 0, mb = 0;  // magnitude maxima of the outputs at pa and at pb
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kHalves) {  // out[i] = x[2i] c - x[2i+1] s, out[32 + i] = x[2i+1] c + x[2i] s
          oa[e] = detail::rope_term(-s0[e], x[2 * e + 1], c0[e], x[2 * e]);
          ob[e] = detail::rope_term(s1[e], x[2 * e], c1[e], x[2 * e + 1]);
        } else if constexpr (kIlv) {  // pairs (2k, 2k+1) in place
          oa[e] = (e & 1) == 0 ? detail::rope_term(-s0[e], x[e + 1], c0[e], x[e]) : detail::rope_term(s0[e], x[e - 1], c0[e], x[e]);
          ob[e] = (e & 1) == 0 ? detail::rope_term(-s1[e], x[4 + e + 1], c1[e], x[4 + e])
                               : detail::rope_term(s1[e], x[4 + e - 1], c1[e], x[4 + e]);
        } else {  // rotate_half: out[j] = x[j] c - x[j+32] s, out[j+32] = x[j+32] c + x[j] s
          oa[e] = detail::rope_term(-s0[e], x[4 + e], c0[e], x[e]);
          ob[e] = detail::rope_term(s1[e], x[e], c1[e], x[4 + e]);
        }
        ma = max(ma, detail::mag_bits(oa[e])), mb = max(mb, detail::mag_bits(ob[e]));
      }
      // the fp32 outputs replace the row's bf16 inputs: all 8 lanes of the row (this warp) have read theirs
      __syncwarp();
      *reinterpret_cast<float4*>(sm.tile + tswz(r, kRopeOff + 4 * pa)) = make_float4(oa[0], oa[1], oa[2], oa[3]);
      *reinterpret_cast<float4*>(sm.tile + tswz(r, kRopeOff + 4 * pb)) = make_float4(ob[0], ob[1], ob[2], ob[3]);
      uint32_t am0 = max(pa1 ? 0u : ma, pb1 ? 0u : mb), am1 = max(pa1 ? ma : 0u, pb1 ? mb : 0u);  // rope blocks 0, 1
#pragma unroll
      for (int m = 1; m < 8; m <<= 1) {  // over the 8 lanes of the row
        am0 = max(am0, __shfl_xor_sync(0xFFFFFFFFu, am0, m));
        am1 = max(am1, __shfl_xor_sync(0xFFFFFFFFu, am1, m));
      }
      if (si >= p.S) continue;
      if (p.row_codes != nullptr) {
        const uint8_t e0 = detail::block_scale_from_amax_bits(am0, rcp), e1 = detail::block_scale_from_amax_bits(am1, rcp);
        if (u < 2) p.row_scales[row_scale_at(p.row_map, vb, si, col0 / 32 + kNB + u)] = u == 0 ? e0 : e1;
        const float m0s = detail::e8m0_quant_multiplier(e0), m1s = detail::e8m0_quant_multiplier(e1);
        const float fa = pa1 ? m1s : m0s, fb = pb1 ? m1s : m0s;
        uint8_t* dst = p.row_codes + rc_off;
        __stcs(reinterpret_cast<unsigned int*>(dst + pa), detail::fp8x4<kE4M3>(oa[0], oa[1], oa[2], oa[3], fa));
        __stcs(reinterpret_cast<unsigned int*>(dst + pb), detail::fp8x4<kE4M3>(ob[0], ob[1], ob[2], ob[3], fb));
      }
      if (p.q != nullptr) {
        uint16_t* dst = p.q + (token_of(p, bi, si) * p.NH + h) * kD + kNope;
        __stcs(reinterpret_cast<uint2*>(dst + pa), make_uint2(detail::bf16x2_out(oa[0], oa[1]), detail::bf16x2_out(oa[2], oa[3])));
        __stcs(reinterpret_cast<uint2*>(dst + pb), make_uint2(detail::bf16x2_out(ob[0], ob[1]), detail::bf16x2_out(ob[2], ob[3])));
      }
    }

    if (tid == 0) Probe::stamp(n, 13);
    RopeDone::sync();
    if (tid == 0) Probe::stamp(n, 14);

    // ---- C: columnwise, item = (32-row block g, 4 columns), at most one per thread; the nope items
    //      first, so that each warp takes one kind
    if (p.col_codes != nullptr) {
      constexpr int kQuads = kD / 4, kNopeQuads = kNope / 4;
      constexpr int kItems = (kBM / 32) * kQuads, kNopeItems = (kBM / 32) * kNopeQuads;
      static_assert(kItems <= kThreads, "one columnwise item per thread");
      static_assert(kNopeItems % 32 == 0, "warp-uniform nope / rope items");
      if (tid < kItems) {
        const bool nope_item = tid < kNopeItems;
        const int k = nope_item ? tid : tid - kNopeItems, nq = nope_item ? kNopeQuads : kQuads - kNopeQuads;
        const int g = k / nq, cq = (nope_item ? 0 : kNopeQuads) + k % nq, sg = m0 + 32 * g;
        if (sg < p.S) {
          const int nrows = min(32, p.S - sg);
          if (nope_item) col_item<true>(p, sm, bi, h, g, cq, sg, nrows);
          else col_item<false>(p, sm, bi, h, g, cq, sg, nrows);
        }
      }
    }
  }
};

}  // namespace mxmla::sm90
