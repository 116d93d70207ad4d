// mxmla internal — the SM90 MXFP8 GEMM (include/mxmla/gemm.h, SPEC §6, §7 design B): traits,
// parameters and the body. Launcher: sm90_mxfp8_gemm.cu.
//
//   D[M, N] = alpha · Σ_kb (A_kb · B_kbᵀ) ⊙ (sa_kb ⊗ sb_kb)   (+ D)
//
// A [M, K] and B [N, K], both K-major FP8 (E4M3 or E5M2), with F8_128x4-swizzled E8M0 scales (one
// per row and 32 of K). The FP8 tensor cores take K = 32 per instruction: exactly one MX block. So
// every 32 of K runs one wgmma into a temporary accumulator, and the consumer folds it into the fp32
// accumulator with the two block scales: acc += tmp · (fa_row · fb_col), two fp32 operations per
// output element and 32 of K (DeepGEMM's `sm90_mxfp8_fp8_gemm_1d2d` idea, with per-column B
// scales). The factors 2^(e − 127) are exact fp32 numbers (e = 0: 2^−127, e = 255: NaN); their
// product is an exact power of two (normal or subnormal) wherever ea + eb lies in [105, 381], and the
// fold rounds once. The scale converter marks each block whose every row-column pair of the tile is
// inside; the other blocks fold element by element (fold_block_scales, common/mxfp8_common.h:
// outside, both factors lie on the same side of 1, and the sum times b's factor, then a's, leaves
// fp32's range no earlier than the result does).
// Precision: the 32 products of one block are exact, but the FP8 tensor cores add them with an adder
// of about 14 bits (DeepSeek-V3 §3.3.2); across blocks the sums are fp32. Integer data whose partial
// sums fit 14 bits come out exactly.
//
// Roles: warp 0 of warpgroup 0 issues the TMA loads (A and B tiles of 128 x 128 bytes with the
// 128-byte swizzle, and each tile's two 512-byte scale tiles by bulk copy) into a kStages ring;
// warp 1 turns each stage's scale bytes into fp32 factor tables (fa[block][row], fb[block][col])
// and marks the stage ready; warpgroups 1 and 2 each own 64 rows of the 128 x 128 output tile. Each
// consumer keeps two temporary accumulators: block j + 1's wgmma runs while block j is folded, and
// the two consumers' wgmmas interleave on the tensor cores.
// Persistent CTAs over output tiles, grouped rasterisation (kGroupM M tiles share their A rows).
#pragma once

#include <cuda.h>  // CUtensorMap (types only)

#include <cstdint>
#include <type_traits>

#include "cuda/numerics.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/tile_scheduler.h"

namespace mxmla::detail::mxgemm {

struct Cfg {
  static constexpr int kBM = 128, kBN = 128;
  static constexpr int kBK = 128;               // bytes = FP8 values of K per stage: one 128-byte swizzle row
  static constexpr int kChunks = kBK / 32;      // MX blocks (wgmmas) per stage
  static constexpr int kStages = 5;
  static constexpr int kGroupM = 8;
  static constexpr int kThreads = 384;          // producer warpgroup + two consumer warpgroups
  static constexpr int kRegsProducer = 40, kRegsConsumer = 232;
  static constexpr uint32_t kTileBytes = kBM * kBK;  // A (and B) bytes per stage
  static constexpr uint32_t kScaleBytes = 512;       // one F8_128x4 tile: 128 rows x 4 blocks
  static_assert(kBM == 128 && kBN == 128, "one scale tile per 128 rows");
  static_assert(kChunks == 4, "a scale tile holds 4 blocks of K");
  static_assert(kRegsProducer * 128 + 2 * kRegsConsumer * 128 <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg moves registers inside the CTA's launch allocation");
};

struct Params {
  int M, N, K, kblocks, m_tiles, n_tiles, num_tiles;
  const uint8_t* sa;  // swizzled scales of A, [round_up(M, 128), round_up(K / 32, 4)]
  const uint8_t* sb;  // swizzled scales of B, [round_up(N, 128), round_up(K / 32, 4)]
  int64_t tiles_x;    // 512-byte scale tiles per 128 rows: ceil(K / 128)
  void* out;          // [M, N], row stride ld_out elements
  int64_t ld_out;
  bool out_f32, accumulate;
  float alpha;
  // Both designs are launched; a kernel whose design the scales' check did not pick returns at once:
  // it runs iff design_flag is null or (*design_flag != 0) == run_on_flag.
  const uint32_t* design_flag;
  bool run_on_flag;
  bool tma_out;  // design C: bf16 out, no accumulation, aligned rows: the epilogue stores by TMA
  // design C with K split into k_splits parts (tiles t = split · m_tiles · n_tiles + tile; part s
  // takes k-blocks [s · kb_per_split, min((s + 1) · kb_per_split, kblocks))): each part's fp32 sums
  // go to partial + s · M · N ([M][N]), and a reduction pass writes D from them
  int k_splits, kb_per_split;
  float* partial;
  // design D (sm90_mxfp8_gemm_rs.cuh), null elsewhere: set when A has a block its bf16 conversion
  // cannot hold exactly (design B, queued after it, then takes the call)
  uint32_t* check_flag;
};

struct Kernel {
  using C = Cfg;
  using Barriers = sm90::StageBarriers<C::kStages>;
  struct alignas(1024) Smem {
    uint8_t a[C::kStages][C::kTileBytes];  // [128 rows][128 K bytes], 128-byte swizzle
    uint8_t b[C::kStages][C::kTileBytes];
    uint8_t sa[C::kStages][C::kScaleBytes];   // swizzled scale bytes as loaded
    uint8_t sb[C::kStages][C::kScaleBytes];
    float fa[C::kStages][C::kChunks][C::kBM];  // 2^(e - 127) per block and row of A
    float fb[C::kStages][C::kChunks][C::kBN];  // ... and per block and column of B
    Barriers bars;
    uint64_t ready[C::kStages];                // the factor tables of a stage are written
    uint32_t product_ok[C::kStages];           // bit c: block c's every fa · fb is exact (ea + eb in [105, 381])
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");
};

// Whether the scales' check picked the other design for this call (the launcher runs both kernels;
// the one not picked returns at once).
__device__ __forceinline__ bool other_design(const Params& p) {
  return p.design_flag != nullptr && (*p.design_flag != 0u) != p.run_on_flag;
}

// Both designs' epilogue: alpha, (+ D), bf16 or fp32 straight from the registers of an m64nN
// accumulator (its rows r0 and r0 + row1 of the tile at m0 -- row1 8, or 1 where the fragment's rows
// are permuted as design D's kColsA permutes them; columns n0 + 8 jj + 2 (lane % 4) + {0, 1}).
// A thread's two columns are adjacent: one 4-byte (bf16x2) or 8-byte (fp32 pair) store when the
// output's pointer and row stride allow it, element by element otherwise (and at column N − 1).
template <int kN>
__device__ __forceinline__ void store_accumulators(const Params& p, const float (&acc)[kN / 2], int m0, int n0, int r0,
                                                   int lane, int row1 = 8) {
  const uint32_t pair_bytes = p.out_f32 ? 8u : 4u;  // the column (even) pair's alignment
  const bool pairs = p.ld_out % 2 == 0 && reinterpret_cast<uintptr_t>(p.out) % pair_bytes == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + r0 + row1 * h;
    if (row >= p.M) continue;
#pragma unroll
    for (int jj = 0; jj < kN / 8; ++jj) {
      const int col = n0 + 8 * jj + 2 * (lane % 4);
      const float v0 = p.alpha * acc[4 * jj + 2 * h], v1 = p.alpha * acc[4 * jj + 2 * h + 1];
      const bool pair = pairs && col + 1 < p.N;
      if (p.out_f32) {
        float* o = static_cast<float*>(p.out) + int64_t{row} * p.ld_out + col;
        if (pair) {
          float2 w = make_float2(v0, v1);
          if (p.accumulate) {
            const float2 d = *reinterpret_cast<const float2*>(o);
            w.x += d.x, w.y += d.y;
          }
          *reinterpret_cast<float2*>(o) = w;
        } else {
          if (col < p.N) o[0] = p.accumulate ? o[0] + v0 : v0;
          if (col + 1 < p.N) o[1] = p.accumulate ? o[1] + v1 : v1;
        }
      } else {
        uint16_t* o = static_cast<uint16_t*>(p.out) + int64_t{row} * p.ld_out + col;
        if (pair) {
          *reinterpret_cast<uint32_t*>(o) = bf16x2_out(v0, v1);
        } else {
          if (col < p.N) o[0] = bf16_out(v0);
          if (col + 1 < p.N) o[1] = bf16_out(v1);
        }
      }
    }
  }
}

template <class K, ptx::MmaDtype kFmt>
__global__ void __launch_bounds__(K::C::kThreads, 1)
    sm90_mxfp8_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                           const Params p) {
  using C = typename K::C;
  if (other_design(p)) return;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = sm90::aligned_shared<typename K::Smem>(smem_raw);
  const int wg = ptx::warpgroup_index();
  sm90::init_barriers_once([&] {
    // every thread that read (wrote) a stage's tables arrives itself, so that each access is ordered
    // by the barrier it passes (compute-sanitizer's racecheck sees the same)
    sm.bars.init(256);  // every consumer thread releases a stage
    for (int i = 0; i < C::kStages; ++i) ptx::mbar_init(&sm.ready[i], 32);  // every converter lane
  });
  const StaticPersistent sched{p.num_tiles};

  if (wg == 0) {  // ------------------------------------------------------- producer, scale converter
    ptx::setmaxnreg_dec<C::kRegsProducer>();
    if (threadIdx.x >= 32 && threadIdx.x < 64) {  // warp 1: scale bytes -> factor tables
      const int lane = threadIdx.x - 32;
      sm90::PipelineState<C::kStages> st;
      for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
        for (int kb = 0; kb < p.kblocks; ++kb) {
          sm.bars.producer_acquire(st);  // the consumers are done with the tables' previous contents
          sm.bars.consumer_wait(st);     // and the stage's bytes have landed
          // lane L: bytes [16L, 16L + 16) of the A tile and of the B tile; byte o of a tile is
          // (row (o / 16) + 32 ((o % 16) / 4), block o % 4)
          uint32_t lo[2][4], hi[2][4];  // [A, B][block]: the tile's smallest and largest scale byte
#pragma unroll
          for (int side = 0; side < 2; ++side) {
            const uint4 w = *reinterpret_cast<const uint4*>((side ? sm.sb[st.index] : sm.sa[st.index]) + 16 * lane);
            float(&tab)[C::kChunks][128] = side ? sm.fb[st.index] : sm.fa[st.index];
            const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
              for (int j = 0; j < 4; ++j) tab[j][lane + 32 * q] = e8m0_factor((words[q] >> (8 * j)) & 0xFFu);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              uint32_t l = 255, h = 0;
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                const uint32_t e = (words[q] >> (8 * j)) & 0xFFu;
                l = min(l, e), h = max(h, e);
              }
              lo[side][j] = __reduce_min_sync(0xFFFFFFFFu, l), hi[side][j] = __reduce_max_sync(0xFFFFFFFFu, h);
            }
          }
          if (lane == 0) {
            uint32_t ok = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j)
              ok |= uint32_t{lo[0][j] + lo[1][j] >= kFactorProductLo && hi[0][j] + hi[1][j] <= kFactorProductHi} << j;
            sm.product_ok[st.index] = ok;
          }
          ptx::mbar_arrive(&sm.ready[st.index]);
          st.advance();
        }
      }
      return;
    }
    if (threadIdx.x != 0) return;
    ptx::prefetch_tmap(&tmap_a);
    ptx::prefetch_tmap(&tmap_b);
    sm90::PipelineState<C::kStages> st;
    for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
      int mt, nt;
      grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
      for (int kb = 0; kb < p.kblocks; ++kb) {
        sm.bars.producer_acquire(st);
        uint64_t* full = sm.bars.producer_expect(st, 2 * C::kTileBytes + 2 * C::kScaleBytes);
        ptx::tma_load_2d(sm.a[st.index], &tmap_a, full, kb * C::kBK, mt * C::kBM);
        ptx::tma_load_2d(sm.b[st.index], &tmap_b, full, kb * C::kBK, nt * C::kBN);
        ptx::bulk_load_g2s(sm.sa[st.index], p.sa + (mt * p.tiles_x + kb) * C::kScaleBytes, C::kScaleBytes, full);
        ptx::bulk_load_g2s(sm.sb[st.index], p.sb + (nt * p.tiles_x + kb) * C::kScaleBytes, C::kScaleBytes, full);
        st.advance();
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 rows each
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int cw = wg - 1, warp = ptx::warp_in_warpgroup(), lane = threadIdx.x % 32;
  const int r0 = 64 * cw + 16 * warp + lane / 4;  // tile row of accumulator half 0 (half 1: + 8)
  using Op = ptx::WgmmaOp<128, kFmt, kFmt, false>;
  static_assert(Op::kK == 32, "one FP8 wgmma covers one MX block");
  const uint64_t da0 = ptx::wgmma_desc_k_sw128(sm.a[0] + 64 * cw * C::kBK), db0 = ptx::wgmma_desc_k_sw128(sm.b[0]);
  constexpr uint32_t kStep = C::kTileBytes / 16;  // descriptor units per stage
  sm90::PipelineState<C::kStages> st;
  // the stage's tiles have landed and its factor tables are written
  const auto wait_stage = [&](const sm90::PipelineState<C::kStages>& s) {
    sm.bars.consumer_wait(s);
    ptx::mbar_wait(&sm.ready[s.index], s.phase);
  };
  // one MX block (32 of K) of stage s into T: an asynchronous wgmma, committed as its own group
  const auto issue = [&](float(&T)[64], const sm90::PipelineState<C::kStages>& s, int c) {
#pragma unroll
    for (int i = 0; i < 64; ++i) ptx::fence_reg(T[i]);
    ptx::wgmma_fence();
    Op::mma(T, da0 + s.index * kStep + 2 * c, db0 + s.index * kStep + 2 * c, false);
    ptx::wgmma_commit();
  };
  // acc += T * (fa_row * fb_col) with block c's factors of stage s, once T's wgmma has completed
  // (wgmma_wait<kPending>: the other temporary's wgmma may still run); a block with a factor product
  // out of fp32's range somewhere in the tile element by element (fold_block_scales)
  const auto fold = [&](auto pending, float(&T)[64], const sm90::PipelineState<C::kStages>& s, int c,
                        float(&acc)[64]) {
    // this thread's factors of block c: its two rows, its 32 columns 8jj + 2 (lane % 4) + e
    const float fa0 = sm.fa[s.index][c][r0], fa1 = sm.fa[s.index][c][r0 + 8];
    const float* fbc = &sm.fb[s.index][c][2 * (lane % 4)];
    const bool product_ok = (sm.product_ok[s.index] >> c) & 1u;  // the same in the whole CTA
    ptx::wgmma_wait<decltype(pending)::value>();
#pragma unroll
    for (int i = 0; i < 64; ++i) ptx::fence_reg(T[i]);
    // acc[4jj + e] = rule(T[4jj + e], row factor, column factor, acc[4jj + e])
    const auto fold_all = [&](auto rule) {
#pragma unroll
      for (int jj = 0; jj < 16; ++jj) {
        const float2 fb = *reinterpret_cast<const float2*>(fbc + 8 * jj);
        acc[4 * jj + 0] = rule(T[4 * jj + 0], fa0, fb.x, acc[4 * jj + 0]);
        acc[4 * jj + 1] = rule(T[4 * jj + 1], fa0, fb.y, acc[4 * jj + 1]);
        acc[4 * jj + 2] = rule(T[4 * jj + 2], fa1, fb.x, acc[4 * jj + 2]);
        acc[4 * jj + 3] = rule(T[4 * jj + 3], fa1, fb.y, acc[4 * jj + 3]);
      }
    };
    if (product_ok)
      fold_all([](float t, float fa, float fb, float a) { return fold_block_product(t, fa, fb, a); });
    else
      fold_all([](float t, float fa, float fb, float a) { return fold_block_scales(t, fa, fb, a); });
  };
  using One = std::integral_constant<int, 1>;
  using Zero = std::integral_constant<int, 0>;
  for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
    int mt, nt;
    grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
    // two temporaries in flight: block j + 1's wgmma runs while block j is folded into acc
    float acc[64], t0[64], t1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    // per stage: block j + 1's wgmma runs while block j is folded; nothing is in flight across the
    // stage loop's back edge (ptxas serializes every wgmma of a loop that carries one in flight)
    static_assert(C::kChunks == 4, "blocks 0, 2 in t0 and 1, 3 in t1");
    for (int kb = 0; kb < p.kblocks; ++kb) {
      wait_stage(st);
      issue(t0, st, 0);
      issue(t1, st, 1), fold(One{}, t0, st, 0, acc);
      issue(t0, st, 2), fold(One{}, t1, st, 1, acc);
      issue(t1, st, 3), fold(One{}, t0, st, 2, acc);
      fold(Zero{}, t1, st, 3, acc);
      sm.bars.consumer_release(st.index);
      st.advance();
    }
    store_accumulators<C::kBN>(p, acc, mt * C::kBM, nt * C::kBN, r0, lane);
  }
}

}  // namespace mxmla::detail::mxgemm
