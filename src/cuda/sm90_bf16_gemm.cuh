// mxmla internal — the SM90 bf16 GEMM that design C of the MXFP8 GEMM runs on its operands' bf16
// copies (SPEC §7; launcher: sm90_mxfp8_gemm.cu, which dequantizes each MXFP8 operand once into a
// K-major bf16 copy first):
//
//   D[M, N] = alpha · A · Bᵀ (+ D),   A [M, K] and B [N, K] bf16, K-major (row stride a multiple of
//   16 bytes; TMA reads zeros past K and past the last row)
//
// Persistent over 128 x 256 output tiles (grouped rasterisation; with K split in p.k_splits parts,
// part s of every tile after part s − 1 of all: the fp32 partial sums go to scratch and the
// launcher's reduction pass writes D), 384 threads, one CTA per SM:
//   warpgroup 0  thread 0: TMA producer, the tiles' k-blocks A [128][64] and B [256][64] (128-byte
//                swizzle) into a kStages ring (sm90/mainloop_tma_wgmma.cuh);
//   warpgroups 1, 2  consumers: 64 rows each, m64n256k16 bf16 wgmma, fp32 accumulators; the epilogue
//                runs while the producer already fills the ring with the next tile's k-blocks:
//                bf16 out without accumulation into rows TMA can take (p.tma_out): each consumer
//                writes its 64 x 256 results in two halves of 64 x 128 bf16 into its shared
//                buffer (two [64 rows][128 B] blocks, 128-byte swizzle) and one thread stores them
//                with TMA (asynchronous: the next tile's mainloop starts at once; the buffer is
//                reused once the store has read it); otherwise mxgemm::store_accumulators (design
//                A's and B's) straight from the registers.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)

#include <cstdint>

#include "cuda/probe.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/mainloop_tma_wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90_mxfp8_gemm.cuh"  // Params, other_design, store_accumulators
#include "cuda/tile_scheduler.h"

namespace mxmla::detail::mxgemm_c {

struct Cfg {
  static constexpr int kBM = 128, kBN = 256, kBK = 64;  // K per stage: 64 bf16 (one 128-byte swizzle row)
  static constexpr int kStages = 4;                      // 48 KB a stage
  static constexpr int kGroupM = 8;
  static constexpr int kThreads = 384;
  static constexpr int kRegsProducer = 40, kRegsConsumer = 232;
  // setmaxnreg.inc waits (for ever) for registers that the CTA's launch allocation does not hold
  static_assert(kRegsProducer * 128 + 2 * kRegsConsumer * 128 <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg moves registers inside the CTA's launch allocation");
};

struct Kernel {
  using C = Cfg;
  using Mainloop = sm90::MainloopTmaWgmma<C::kBM, C::kBN, C::kBK, C::kStages, 2, ptx::MmaDtype::kBF16,
                                          ptx::MmaDtype::kBF16>;
  struct alignas(1024) Smem {
    typename Mainloop::SharedStorage ring;  // a [128][64], b [256][64] bf16 per stage, 128-byte swizzle
    uint8_t epi[2][2][64 * 128];            // per consumer: half a tile's results, 64-column blocks [64][128 B]
    typename Mainloop::Barriers bars;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");
};

// A work unit: output tile (mt, nt) over k-blocks kb0 .. kb0 + nkb − 1 (part `split` of K).
struct Work {
  int mt, nt, split, kb0, nkb;
};
__device__ __forceinline__ Work work_at(const mxgemm::Params& p, int t) {
  Work w;
  const int tiles = p.m_tiles * p.n_tiles;
  w.split = t / tiles;
  grouped_tile<Cfg::kGroupM>(t - w.split * tiles, p.m_tiles, p.n_tiles, w.mt, w.nt);
  w.kb0 = w.split * p.kb_per_split;
  w.nkb = min(p.kb_per_split, p.kblocks - w.kb0);
  return w;
}

// The TMA epilogue of one consumer: its rows m0 .. m0 + 63, columns n0 .. n0 + kN − 1 (acc: m64nkN
// fragments) through buf (two 64-column blocks [64 rows][128 B], 16-byte chunk c of row r at
// c ^ (r % 8): the rows of a warp's store land in distinct banks) in halves of 128 columns.
// Thread 0 of the warpgroup (r == 0) waits until the previous store has read the buffer, issues the
// stores (blocks wholly past M or N are skipped; TMA clips the rest, in whole 16-byte chunks of a row:
// the launchers take this path only when N · 2 bytes is a multiple of 16) and commits them.
// row_step 1: the fragment's rows permuted as design D's kColsA permutes them (its rows r0 and
// r0 + 1 instead of r0 and r0 + 8).
template <int kN = 256>
__device__ __forceinline__ void store_tma(const mxgemm::Params& p, const float (&acc)[kN / 2], uint8_t* buf,
                                          const CUtensorMap* tmap_out, int m0, int n0, int cw, int r, int lane,
                                          int row_step = 8) {
  static_assert(kN % 128 == 0, "128-column halves");
  const int rl = 16 * (r / 32) + (row_step == 8 ? 1 : 2) * (lane / 4);  // local row of half 0 (half 1: + row_step)
#pragma unroll
  for (int half = 0; half < kN / 128; ++half) {
    if (r == 0) ptx::bulk_wait_read_all();
    ptx::named_barrier(2 + cw, 128);
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const int J = 16 * half + jj, c = 8 * jj + 2 * (lane % 4);  // column in the half
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = rl + row_step * h;
        uint8_t* at = buf + (c / 64) * (64 * 128) + row * 128 + ((((c % 64) / 8) ^ (row % 8)) * 16) + (c % 8) * 2;
        ptx::st_shared_u32(ptx::smem_u32(at), bf16x2_out(p.alpha * acc[4 * J + 2 * h], p.alpha * acc[4 * J + 2 * h + 1]));
      }
    }
    ptx::fence_proxy_async();
    ptx::named_barrier(2 + cw, 128);
    if (r == 0) {
      const int n = n0 + 128 * half;
      if (m0 < p.M) {
        if (n < p.N) ptx::tma_store_2d(tmap_out, buf, n, m0);
        if (n + 64 < p.N) ptx::tma_store_2d(tmap_out, buf + 64 * 128, n + 64, m0);
      }
      ptx::bulk_commit();
    }
  }
}

template <class K>
__global__ void __launch_bounds__(K::C::kThreads, 1)
    sm90_bf16_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                          const __grid_constant__ CUtensorMap tmap_out, const mxgemm::Params p) {
  using C = typename K::C;
  using ML = typename K::Mainloop;
  using mxgemm::store_accumulators;
  if (mxgemm::other_design(p)) return;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = sm90::aligned_shared<typename K::Smem>(smem_raw);
  const int wg = ptx::warpgroup_index(), r = threadIdx.x % 128;
  sm90::init_barriers_once([&] {
    sm.bars.init(ML::kConsumerArrivals);
  });
  const StaticPersistent sched{p.num_tiles};

  if (wg == 0) {  // ---------------------------------------------------------------- TMA producer
    ptx::setmaxnreg_dec<C::kRegsProducer>();
    if (threadIdx.x == 0) {
      ptx::prefetch_tmap(&tmap_a);
      ptx::prefetch_tmap(&tmap_b);
      typename ML::State st;
      for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
        const Work w = work_at(p, t);
        ML::template produce<NoProbe>(sm.ring, sm.bars, st, w.nkb, 0,
                                      [&](uint8_t* a, uint8_t* b, uint64_t* full, int kb) {
                                        ptx::tma_load_2d(a, &tmap_a, full, (w.kb0 + kb) * C::kBK, w.mt * C::kBM);
                                        ptx::tma_load_2d(b, &tmap_b, full, (w.kb0 + kb) * C::kBK, w.nt * C::kBN);
                                      });
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 rows each
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int cw = wg - 1, warp = r / 32, lane = r % 32;
  const int r0 = 64 * cw + 16 * warp + lane / 4;  // tile row of accumulator half 0 (half 1: + 8)
  const typename ML::Consumer cons(sm.ring, cw);
  typename ML::State st;
  for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
    const Work w = work_at(p, t);
    float acc[ML::kAcc];
    cons.template mma<NoProbe>(sm.bars, st, w.nkb, acc, false, 0);
    if (p.k_splits > 1) {  // this part's fp32 sums -> partial[split] ([M][N])
      mxgemm::Params q = p;
      q.out = p.partial + int64_t{w.split} * p.M * p.N, q.ld_out = p.N;
      q.out_f32 = true, q.accumulate = false, q.alpha = 1.f;
      store_accumulators<C::kBN>(q, acc, w.mt * C::kBM, w.nt * C::kBN, r0, lane);
    } else if (p.tma_out) {
      store_tma(p, acc, sm.epi[cw][0], &tmap_out, w.mt * C::kBM + 64 * cw, w.nt * C::kBN, cw, r, lane);
    } else {
      store_accumulators<C::kBN>(p, acc, w.mt * C::kBM, w.nt * C::kBN, r0, lane);
    }
  }
  if (p.tma_out && r == 0) ptx::bulk_wait_all();
}

}  // namespace mxmla::detail::mxgemm_c
