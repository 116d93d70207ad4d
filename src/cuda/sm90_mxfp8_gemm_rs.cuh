// mxmla internal — design D of the SM90 MXFP8 GEMM (SPEC §7; launcher: sm90_mxfp8_gemm.cu): A's
// FP8 codes dequantized in registers for a bf16 wgmma that reads A from registers (RS), B design C's
// bf16 copy in shared memory. It saves design C's dequantizing pass over A (the large operand of a
// dgrad or a wgrad: dY [T, 24576]) at the price of converting A's codes once per output tile that
// reads them (N / 256 times): the launcher picks it where N is small (heuristics::kGemmDesignDMaxN;
// K at least kGemmDesignDMinK).
//
//   D[M, N] = alpha · deq(A) · Bᵀ,   A [M, K] E4M3 or E5M2 codes, K-major, or (kColsA) a
//   columnwise copy's codes [K, M], M contiguous (a wgrad's dY); F8_128x4-swizzled E8M0 scales (one
//   per row of A and 32 of K, gathered by the launcher); B [N, K] bf16, K-major (design C's copy);
//   D bf16 or fp32 (no accumulation: the launcher's rule).
//
// The same sums as design C's kernel (sm90_bf16_gemm.cuh), bit for bit: the same values (design C's
// dequantization, dequant_pair: code -> f16 -> fp32 · 2^(e − 127) -> bf16, exact for a scale byte
// >= min_exact_e), the same m64n256k16 wgmmas over the same 16 of K in the same order, the same work
// units and K split (mxgemm_c::work_at; the launcher's split_k), the same rounding of the output.
// So a call gives the bits design C would (the MXFP8 Linear, whose GEMMs run design C on copies its
// quantize pass wrote, gives the bits of quantize + gemm).
// The A fragment of an RS m64nNk16 wgmma: thread (warp w, lane l) holds rows 16w + l/4 (+ 8) and, of
// each 16 of K, columns 2q, 2q + 1 (registers 0, 1) and 2q + 8, 2q + 9 (registers 2, 3), q = l % 4.
// Each is 2 bytes of the row's codes (bytes 2q and 2q + 8 of the 16): 16 shared loads of 2 bytes a
// stage per thread, which meet no bank conflict under the 64-byte swizzle (a warp's 8 rows x 2 words
// fall in 16 distinct banks; lanes q = 2j, 2j + 1 read halves of one word). kColsA: the stage's
// codes lie [64 of K][128 rows] (128-byte swizzle), and one ldmatrix.x4.trans per two 16s of K gives
// lane l, of each 8 of K, the 2-byte pairs of rows 2g, 2g + 1 (g = l / 4) at K 2q and at 2q + 1
// (bytes (2q, 2g), (2q, 2g + 1), (2q + 1, 2g), (2q + 1, 2g + 1)); one byte permute makes them the
// K pairs of two rows. So the fragment's row g holds the warp's tile row 2g and row g + 8 holds
// 2g + 1 (rows r0 and r1 = r0 + 1, which the epilogue writes): the products and their order are
// the same, only the rows' places in the fragment differ. Eight rows of 16 bytes per ldmatrix phase,
// 8 consecutive K at chunks XOR-ed by K % 8: no bank conflict.
// A block with non-zero codes under a scale byte below min_exact_e sets p.check_flag (when given):
// the launcher's design B, queued after this kernel, then recomputes all of D from the codes (this
// design's output is overwritten: hence no accumulation into D here).
//
// 128 x 256 tiles, 64 of K a stage (A 8 KB with the 64-byte swizzle, B 32 KB with the 128-byte one,
// the stage's 512-byte scale tile), 4 stages, one producer thread, two consumer warpgroups (64 rows
// each), persistent CTAs over grouped tiles. The stage loop is unrolled twice, each stage's fragments
// in their own registers, written only after the wait that retires the wgmmas which read them last
// (PTX: a wgmma's A registers must not change while it runs; ptxas would otherwise serialize every
// wgmma, C7513): a stage's fragments are converted while the previous stage's wgmmas run. Epilogue:
// a bf16 output without accumulation whose rows TMA can describe goes through shared memory by TMA
// stores (design C's store_tma, per consumer two [64 rows][128 B] blocks: four stages leave room for
// them), so that a tile's stores overlap the next tile's loads and wgmmas; an fp32 output, a K
// split's partial sums or an unaligned view from the registers (mxgemm::store_accumulators).
// Measured against design C: docs/notes-gemm.md (design D).
#pragma once

#include <cuda.h>  // CUtensorMap (types only)

#include <cstdint>

#include "common/mxfp8_common.h"
#include "cuda/numerics.cuh"
#include "cuda/ptx/common.cuh"
#include "cuda/ptx/mma_sync.cuh"  // ldmatrix_x4_trans
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90_bf16_gemm.cuh"  // mxgemm_c::work_at (the same work units and K split)
#include "cuda/sm90_mxfp8_gemm.cuh"  // Params, other_design, store_accumulators
#include "cuda/tile_scheduler.h"

namespace mxmla::detail::mxgemm_d {

struct Cfg {
  static constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4, kThreads = 384;
  static constexpr int kRegsProducer = 40, kRegsConsumer = 232;
  static constexpr uint32_t kABytes = kBM * kBK;      // codes [128 rows][64 B], 64-byte swizzle (kColsA:
                                                      // [64 of K][128 B], 128-byte swizzle)
  static constexpr uint32_t kBBytes = kBN * kBK * 2;  // bf16 [256 rows][64], 128-byte swizzle
  static constexpr uint32_t kScaleBytes = 512;        // the F8_128x4 tile of the stage's 128 of K
  static_assert(kBM == mxgemm_c::Cfg::kBM && kBN == mxgemm_c::Cfg::kBN && kBK == mxgemm_c::Cfg::kBK,
                "design C's work units (work_at)");
  static_assert(kBK * 2 == 128, "two stages share a 128-of-K scale tile");
  static_assert(kRegsProducer * 128 + 2 * kRegsConsumer * 128 <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg moves registers inside the CTA's launch allocation");
};

struct Kernel {
  using C = Cfg;
  struct alignas(1024) Smem {
    uint8_t a[C::kStages][C::kABytes];
    uint8_t b[C::kStages][C::kBBytes];
    uint8_t epi[2][2][64 * 128];  // per consumer: half a tile's results, 64-column blocks [64 rows][128 B] (TMA store)
    uint8_t sa[C::kStages][C::kScaleBytes];
    sm90::StageBarriers<C::kStages> bars;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");
};

template <class K, bool kE4M3, bool kColsA>
__global__ void __launch_bounds__(K::C::kThreads, 1)
    sm90_mxfp8_gemm_rs_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                              const __grid_constant__ CUtensorMap tmap_out, const mxgemm::Params p) {
  using C = typename K::C;
  using Op = ptx::WgmmaOp<C::kBN, ptx::MmaDtype::kBF16, ptx::MmaDtype::kBF16, true>;
  if (mxgemm::other_design(p)) return;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = sm90::aligned_shared<typename K::Smem>(smem_raw);
  const int wg = ptx::warpgroup_index();
  // every consumer thread releases a stage: each read its scale bytes (and codes) itself, and an
  // arrival per reading thread is the order compute-sanitizer's racecheck follows through an mbarrier
  // (lane 0 per warp after __syncwarp was reported as racing with the next bulk copy of the tile)
  sm90::init_barriers_once([&] { sm.bars.init(2 * 128); });
  const StaticPersistent sched{p.num_tiles};
  sm90::PipelineState<C::kStages> st;

  if (wg == 0) {  // ---------------------------------------------------------------- TMA producer
    ptx::setmaxnreg_dec<C::kRegsProducer>();
    if (threadIdx.x != 0) return;
    ptx::prefetch_tmap(&tmap_a);
    ptx::prefetch_tmap(&tmap_b);
    for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
      const mxgemm_c::Work w = mxgemm_c::work_at(p, t);
      for (int kb = w.kb0; kb < w.kb0 + w.nkb; ++kb) {
        sm.bars.producer_acquire(st);
        uint64_t* full = sm.bars.producer_expect(st, C::kABytes + C::kBBytes + C::kScaleBytes);
        if constexpr (kColsA) ptx::tma_load_2d(sm.a[st.index], &tmap_a, full, w.mt * C::kBM, kb * C::kBK);
        else ptx::tma_load_2d(sm.a[st.index], &tmap_a, full, kb * C::kBK, w.mt * C::kBM);
        ptx::tma_load_2d(sm.b[st.index], &tmap_b, full, kb * C::kBK, w.nt * C::kBN);
        ptx::bulk_load_g2s(sm.sa[st.index], p.sa + (w.mt * p.tiles_x + kb / 2) * C::kScaleBytes, C::kScaleBytes,
                           full);
        st.advance();
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 rows each
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int cw = wg - 1, warp = ptx::warp_in_warpgroup(), lane = threadIdx.x % 32, q = lane % 4;
  // the tile rows of fragment rows lane / 4 and lane / 4 + 8: r0 and r1 = r0 + 8 (kColsA: r0 + 1)
  const int r0 = 64 * cw + 16 * warp + (kColsA ? 2 : 1) * (lane / 4);
  const int r1 = r0 + (kColsA ? 1 : 8);
  // kColsA: this lane's ldmatrix row, K = lane (+ 32 for 16s of K 2, 3) of the stage, the warp's
  // 16 rows at chunk (4 cw + warp) ^ (K % 8)
  const uint32_t lds = lane * 128 + (((4 * cw + warp) ^ (lane % 8)) * 16);
  // its rows' code pairs in a stage: row r, 16 of K s at r * 64 + ((s ^ (r / 2 % 4)) * 16) (the 64-byte
  // swizzle), + 2q for columns 2q, 2q + 1 and + 8 more for 2q + 8, 2q + 9
  const uint32_t row0 = r0 * 64 + 2 * q, row1 = r1 * 64 + 2 * q;
  const uint32_t sw0 = (r0 >> 1) & 3, sw1 = (r1 >> 1) & 3;
  // its rows' scale bytes in the stage's F8_128x4 tile (+ the block, 0 .. 3)
  const uint32_t so0 = static_cast<uint32_t>(swizzle_offset(r0, 0, 1)),
                 so1 = static_cast<uint32_t>(swizzle_offset(r1, 0, 1));
  const uint64_t db0 = ptx::wgmma_desc_k_sw128(sm.b[0]);
  constexpr uint32_t kBStep = C::kBBytes / 16;  // descriptor units (16 bytes) per stage
  constexpr uint32_t kMinE = min_exact_e(kE4M3);
  bool inexact = false;  // a block with non-zero codes under a scale byte below kMinE
  for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
    const mxgemm_c::Work w = mxgemm_c::work_at(p, t);
    float acc[C::kBN / 2];
#pragma unroll
    for (int i = 0; i < C::kBN / 2; ++i) acc[i] = 0.f;
    uint32_t prev = 0;
    uint32_t frag[2][4][4];  // two register sets of A fragments, stage by stage in turn
    const auto stage = [&](int j, uint32_t(&a)[4][4]) {  // the unit's stage j (k-block w.kb0 + j)
      sm.bars.consumer_wait(st);
      const uint8_t* base = sm.a[st.index];
      uint32_t x[4][4];  // [16 of K s][row r0 cols 2q.., row r1 cols 2q.., row r0 cols 2q + 8.., row r1 ..]
      if constexpr (kColsA) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // 16s of K 2h, 2h + 1: matrices of K 0-7, 8-15 of each
          uint32_t m[4];
          ptx::ldmatrix_x4_trans(ptx::smem_u32(base) + lds + 4096 * h, m[0], m[1], m[2], m[3]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t t = ptx::prmt<0x3120>(m[i]);  // row r0's K pair (low half), row r1's (high)
            x[2 * h + i / 2][2 * (i % 2)] = t & 0xFFFFu, x[2 * h + i / 2][2 * (i % 2) + 1] = t >> 16;
          }
        }
      } else {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint8_t *a0 = base + row0 + ((s ^ sw0) * 16), *a1 = base + row1 + ((s ^ sw1) * 16);
          x[s][0] = *reinterpret_cast<const uint16_t*>(a0), x[s][1] = *reinterpret_cast<const uint16_t*>(a1);
          x[s][2] = *reinterpret_cast<const uint16_t*>(a0 + 8), x[s][3] = *reinterpret_cast<const uint16_t*>(a1 + 8);
        }
      }
      // the stage's 64 of K are blocks 2 (kb % 2) and 2 (kb % 2) + 1 of the 128-of-K scale tile
      const uint32_t blk = 2 * ((w.kb0 + j) % 2);
      const uint32_t e[2][2] = {{sm.sa[st.index][so0 + blk], sm.sa[st.index][so1 + blk]},
                                {sm.sa[st.index][so0 + blk + 1], sm.sa[st.index][so1 + blk + 1]}};
#pragma unroll
      for (int b = 0; b < 2; ++b)  // block b: 16s of K s = 2b, 2b + 1 (the quad's 4 threads: all 32 codes)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t codes = x[2 * b][r] | x[2 * b][r + 2] | x[2 * b + 1][r] | x[2 * b + 1][r + 2];
          inexact |= e[b][r] < kMinE && (codes & 0x7F7Fu) != 0;  // ±0: no
        }
      const float f[2][2] = {{e8m0_factor(e[0][0]), e8m0_factor(e[0][1])}, {e8m0_factor(e[1][0]), e8m0_factor(e[1][1])}};
      const uint64_t db = db0 + st.index * kBStep;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[s][i] = dequant_pair<kE4M3>(x[s][i], f[s / 2][i % 2]);
#pragma unroll
        for (int i = 0; i < C::kBN / 2; ++i) ptx::fence_reg(acc[i]);
        ptx::wgmma_fence();
        // + 2 descriptor units = 32 bytes = the next 16 of K; the unit's first wgmma writes acc
        // rather than adding to zeros, as design C's first does (so even a zero sum's sign is C's)
        Op::mma(acc, a[s], db + 2 * s, j > 0 || s > 0);
      }
      ptx::wgmma_commit();
      if (j > 0) {
        ptx::wgmma_wait<1>();  // the previous stage's wgmmas are done: hand it back
        sm.bars.consumer_release(prev);
      }
      prev = st.index;
      st.advance();
    };
    for (int j = 0; j < w.nkb; j += 2) {
      stage(j, frag[0]);
      if (j + 1 < w.nkb) stage(j + 1, frag[1]);
    }
    ptx::wgmma_wait<0>();
    sm.bars.consumer_release(prev);
#pragma unroll
    for (int i = 0; i < C::kBN / 2; ++i) ptx::fence_reg(acc[i]);
    if (p.k_splits > 1) {  // this part's fp32 sums -> partial[split] ([M][N])
      mxgemm::Params q2 = p;
      q2.out = p.partial + int64_t{w.split} * p.M * p.N, q2.ld_out = p.N;
      q2.out_f32 = true, q2.accumulate = false, q2.alpha = 1.f;
      mxgemm::store_accumulators<C::kBN>(q2, acc, w.mt * C::kBM, w.nt * C::kBN, r0, lane, r1 - r0);
    } else if (p.tma_out) {  // bf16 through shared memory, TMA stores overlapping the next tile
      mxgemm_c::store_tma<C::kBN>(p, acc, sm.epi[cw][0], &tmap_out, w.mt * C::kBM + 64 * cw, w.nt * C::kBN, cw,
                                  threadIdx.x % 128, lane, r1 - r0);
    } else {
      mxgemm::store_accumulators<C::kBN>(p, acc, w.mt * C::kBM, w.nt * C::kBN, r0, lane, r1 - r0);
    }
  }
  if (p.tma_out && threadIdx.x % 128 == 0) ptx::bulk_wait_all();
  if (inexact && p.check_flag != nullptr) atomicOr(p.check_flag, 1u);
}

}  // namespace mxmla::detail::mxgemm_d
