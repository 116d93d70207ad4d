// mxmla internal — the fused Q up-projection kernel (sm_90a): its configuration, its parameters and
// its body, composed of the SM90 parts (mainloop + epilogue + scheduler; see
// sm90_qproj_rope_quant.cu for the launcher). A header so that experiments (dev/cuda/) can
// instantiate the same body with a probe or another epilogue.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/mxfp8_common.h"
#include "common/qproj_ops.h"
#include "cuda/mxfp8_bf16_operands.h"
#include "cuda/numerics.cuh"
#include "cuda/ptx/convert.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/sm90/epilogue_rope_mxfp8.cuh"
#include "cuda/sm90/mainloop_tma_wgmma.cuh"
#include "cuda/sm90/mainloop_tma_wgmma_block_scaled.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/probe.cuh"
#include "cuda/tile_scheduler.h"
#include "cuda/stream_scratch.h"

namespace mxmla::detail::qproj {

// ---------------------------------------------------------------- configuration
struct Cfg {
  static constexpr int kD = 192, kR = 64;  // DeepSeek-V3 head (the one compiled tile): BN = D
  static constexpr int kBM = 128, kBK = 64;  // tokens per tile, K per stage (128 bytes of bf16)
  static constexpr int kStages = 4;
  static constexpr int kMmaWGs = 2;          // warpgroups of 64 rows
  static constexpr int kGroupM = 32;         // token tiles per raster group
};

struct SchedParams {
  int B, NH, mtiles, num_tiles;  // sequences, heads, token tiles per sequence, tiles
};
struct BlockFactors {  // block-FP8 x and W (the tensor maps read their E4M3 codes): fp32 scale_inv
  const float* sx;      // [T, ceil(K / 128)], row stride sx_ld: token t's factors
  int64_t sx_ld;
  const float* sw;      // [ceil(N / 128), ceil(K / 128)], row stride sw_ld
  int64_t sw_ld;
};
struct Params {
  SchedParams sched;
  int kblocks;
  sm90::RopeMxfp8Params epi;
  Mxfp8Exact ex;  // MXFP8 x and W (the tensor maps read their bf16 copies): the exact fallback; else flag null
  BlockFactors bf;  // the block-FP8 kernel's factors (unused by the others)
};

// Kernel traits: the parts and the shared memory they share. MainloopT: bf16 (MainloopTmaWgmma) or
// block-FP8 (MainloopTmaWgmmaBlockScaled, kBlockFp8: its MMA warpgroups hold a slice's temporary
// accumulators besides the tile's, so the warpgroups' registers are moved by setmaxnreg); Epi: the
// epilogue (the default one computes the op; dev/cuda/ has others); Probe: NoProbe, or a recording
// one (dev/cuda/).
template <class MainloopT, class Epi, class ProbeT, bool kExact_, bool kBlockFp8_>
struct KernelTraits {
  // false: the wgmma kernel (returns at once when p.ex.flag is set); true: its exact fallback for
  // MXFP8 x and W (exact_tile below instead of the mainloop; returns at once unless the flag is set)
  static constexpr bool kExact = kExact_;
  static constexpr bool kBlockFp8 = kBlockFp8_;
  using Mainloop = MainloopT;
  using Epilogue = Epi;
  using Probe = ProbeT;
  // warpgroups: 0 producer (warp 0: TMA; warps 1..3: epilogue), 1..kMmaWGs MMA, then the epilogue's
  static constexpr int kThreads = 128 * (Cfg::kMmaWGs + 2);
  // block-FP8: registers a thread of the MMA warpgroups / of the other two (the launch gives 128)
  static constexpr uint32_t kRegsMma = 152, kRegsOther = 104;
  static_assert(!kBlockFp8 || Cfg::kMmaWGs * kRegsMma + 2 * kRegsOther == (Cfg::kMmaWGs + 2) * 128,
                "setmaxnreg moves registers inside the CTA's launch allocation");
  static_assert(Epilogue::kThreads == 128 + 96, "the epilogue takes warps 1..3 and the last warpgroup");
  struct alignas(1024) Smem {
    typename Mainloop::SharedStorage ml;  // the stage ring (x, W tiles)
    typename Epilogue::SharedStorage epi;  // the hand-off tile
    typename Mainloop::Barriers stages;   // full / empty per stage
    sm90::Handoff handoff;                // tile_full / tile_empty
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + alignment slack of the dynamic buffer
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");
};

template <RopeStyle kStyle, bool kE4M3, class Epi = sm90::EpilogueRopeMxfp8<Cfg::kD, Cfg::kR, Cfg::kBM, kStyle, kE4M3>,
          class ProbeT = NoProbe, bool kExact_ = false>
struct Kernel : KernelTraits<sm90::MainloopTmaWgmma<Cfg::kBM, Cfg::kD, Cfg::kBK, Cfg::kStages, Cfg::kMmaWGs,
                                                    ptx::MmaDtype::kBF16, ptx::MmaDtype::kBF16>,
                             Epi, ProbeT, kExact_, false> {};

// Block-FP8 x and W (E4M3 codes, 128 of K per stage): column slices of 64, so that a slice lies in
// one 128-row block of W whatever the head (head h's rows start at 192 h, a multiple of 64).
template <RopeStyle kStyle, bool kE4M3>
struct KernelBlockFp8
    : KernelTraits<sm90::MainloopTmaWgmmaBlockScaled<Cfg::kBM, Cfg::kD, Cfg::kStages, Cfg::kMmaWGs, 64>,
                   sm90::EpilogueRopeMxfp8<Cfg::kD, Cfg::kR, Cfg::kBM, kStyle, kE4M3>, NoProbe, false, true> {
  static_assert(Cfg::kD % 64 == 0 && 128 % 64 == 0, "a 64-column slice never straddles two blocks of W's rows");
};

// Tile t -> (sequence bi, first token m0, head h): groups of kGroupM token tiles, head-major inside.
__device__ __forceinline__ void tile_coords(const SchedParams& s, int t, int& bi, int& m0, int& h) {
  int mt;
  grouped_tile<Cfg::kGroupM>(t, s.B * s.mtiles, s.NH, mt, h);
  bi = mt / s.mtiles;
  m0 = (mt % s.mtiles) * Cfg::kBM;
}

// ---------------------------------------------------------------- the exact fallback
// Taken when ex.flag is set (some scale byte puts values outside bf16's normal range, so the bf16
// copies the mainloop reads are not exact): MMA warpgroup cw's rows of the tile by CUDA cores from
// the FP8 codes and the gathered scales, rounded to bf16 into the hand-off tile as the wgmma path's
// accumulators are (the same fragment: rows 16 w + lane / 4 + 8 hh of its 64, columns
// 8 j + 2 (lane % 4) + e). code · 2^(e − 127) is exact in fp32 for every code and scale byte (the
// smallest, 2^-16 · 2^-127, is an fp32 subnormal); products and sums in fp32, in another order than
// the wgmma's (within the fp32-accumulation bound; bit-identical where every partial sum is exact).
// Rows past the sequence (xrow < 0) give 0. Slow (CUDA cores, operands from L1 / L2, an eighth
// of the columns at a time), but only such inputs take it: the body of the kernel's kExact instantiation
// (in the wgmma one, ptxas would serialize the wgmmas and spill).
__device__ __forceinline__ float fp8_value(uint32_t code, bool e4m3) {  // exact: an FP8 value is an f16 value
  const uint32_t h2 = e4m3 ? ptx::cvt_f16x2_from_fp8x2<true>(static_cast<uint16_t>(code))
                           : ptx::cvt_f16x2_from_fp8x2<false>(static_cast<uint16_t>(code));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xFFFFu)));
}
template <class Epilogue>
__device__ __forceinline__ void exact_tile(const Params& p, typename Epilogue::SharedStorage& epi, int cw, int t) {
  constexpr int kParts = 8, kJh = Cfg::kD / 8 / kParts;  // column parts, 8-column groups per part
  const Mxfp8Exact& ex = p.ex;
  const int w4 = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  int bi, m0, h;
  tile_coords(p.sched, t, bi, m0, h);
  int64_t xrow[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int si = m0 + 64 * cw + 16 * w4 + lane / 4 + 8 * hh;
    xrow[hh] = si < p.epi.S ? Epilogue::token_of(p.epi, bi, si) : -1;
  }
  const uint32_t tile = ptx::smem_u32(epi.tile);
  for (int part = 0; part < kParts; ++part) {
    const int64_t wrow0 = int64_t{h} * Cfg::kD + part * (Cfg::kD / kParts);
    float acc[2][kJh][2];  // [hh][j][e]
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int j = 0; j < kJh; ++j) acc[hh][j][0] = acc[hh][j][1] = 0.f;
#pragma unroll 1
    for (int kb = 0; kb < ex.K / 32; ++kb) {
      float fx[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        fx[hh] = xrow[hh] < 0 ? 0.f : e8m0_factor(ex.a.scales[swizzle_offset(xrow[hh], kb, ex.a.tiles_x)]);
#pragma unroll 1
      for (int k4 = 0; k4 < 8; ++k4) {  // 4 values of K at a time
        const int k0 = 32 * kb + 4 * k4;
        float xv[2][4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t c = xrow[hh] < 0 ? 0u : *reinterpret_cast<const uint32_t*>(ex.a.codes + xrow[hh] * ex.a.ld + k0);
#pragma unroll
          for (int i = 0; i < 4; ++i) xv[hh][i] = fp8_value((c >> (8 * i)) & 0xFFu, ex.e4m3) * fx[hh];
        }
#pragma unroll
        for (int j = 0; j < kJh; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t wr = wrow0 + 8 * j + 2 * (lane % 4) + e;
            const float fw = e8m0_factor(ex.b.scales[swizzle_offset(wr, kb, ex.b.tiles_x)]);
            const uint32_t c = *reinterpret_cast<const uint32_t*>(ex.b.codes + wr * ex.b.ld + k0);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float wv = fp8_value((c >> (8 * i)) & 0xFFu, ex.e4m3) * fw;
              acc[0][j][e] = fmaf(xv[0][i], wv, acc[0][j][e]);
              acc[1][j][e] = fmaf(xv[1][i], wv, acc[1][j][e]);
            }
          }
      }
    }
    // bf16 pairs (columns c, c + 1) into the tile's bf16 region, as store_accumulators rounds them
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = 64 * cw + 16 * w4 + lane / 4 + 8 * hh;
#pragma unroll
      for (int j = 0; j < kJh; ++j) {
        const int col = part * (Cfg::kD / kParts) + 8 * j + 2 * (lane % 4);
        ptx::st_shared_u32(tile + Epilogue::tswz(row, 2 * col), bf16x2_rn(acc[hh][j][0], acc[hh][j][1]));
      }
    }
  }
}

// ---------------------------------------------------------------- the kernel
template <class K>
__global__ void __launch_bounds__(K::kThreads, 1)
    sm90_qproj_rope_quant_kernel(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w,
                                 const Params p) {
  using Mainloop = typename K::Mainloop;
  using Epilogue = typename K::Epilogue;
  using Probe = typename K::Probe;
  extern __shared__ uint8_t smem_raw[];
  // 1024-align by an offset from smem_raw (not through an integer), so that the compiler keeps the
  // shared address space: LDS/STS with 32-bit addresses instead of generic loads (measured: the
  // generic ones cost the epilogue long-scoreboard stalls and registers)
  auto& sm = sm90::aligned_shared<typename K::Smem>(smem_raw);
  const int wg = ptx::warpgroup_index();
  const StaticPersistent sched{p.sched.num_tiles};
  // MXFP8 inputs: the scale check's flag (written by an earlier kernel of the stream) picks this
  // instantiation or the other (uniform: the whole CTA returns)
  if (p.ex.flag != nullptr && (*p.ex.flag != 0u) != K::kExact) return;

  sm90::init_barriers_once([&] {
    sm.stages.init(Mainloop::kConsumerArrivals);
    sm.handoff.init(128 * Cfg::kMmaWGs, Epilogue::kThreads);  // every MMA thread; every epilogue thread
  });
  // ---------------- producer: one thread issues the TMA loads
  auto producer = [&] {
    if (threadIdx.x == 0 && !K::kExact) {
      Probe::cta_begin();
      ptx::prefetch_tmap(&tmap_x);
      ptx::prefetch_tmap(&tmap_w);
      typename Mainloop::State st;
      uint32_t n = 0;
      for (int t = sched.first(); sched.valid(t); t = sched.next(t), ++n) {
        int bi, m0, h;
        tile_coords(p.sched, t, bi, m0, h);
        Mainloop::template produce<Probe>(sm.ml, sm.stages, st, p.kblocks, n, [&](void* a, void* b, uint64_t* bar, int kb) {
          // x map dims: {K, B, S} for sbhd (b is the inner token dim), {K, S, B} for bshd
          if (p.epi.sbhd) ptx::tma_load_3d(a, &tmap_x, bar, kb * Mainloop::kBK, bi, m0);
          else ptx::tma_load_3d(a, &tmap_x, bar, kb * Mainloop::kBK, m0, bi);
          ptx::tma_load_2d(b, &tmap_w, bar, kb * Mainloop::kBK, h * Cfg::kD);
        });
      }
    }
  };
  // ---------------- epilogue: warps 1..3 and the last warpgroup
  auto epilogue = [&] {
    const int tid = wg == 0 ? 128 + threadIdx.x - 32 : threadIdx.x - 128 * wg;  // whole warps
    uint32_t n = 0;
    for (int t = sched.first(); sched.valid(t); t = sched.next(t), ++n) {
      int bi, m0, h;
      tile_coords(p.sched, t, bi, m0, h);
      sm.handoff.consumer_wait(n);  // (implies that every epilogue thread is done with the previous tile)
      if (tid == 0) Probe::stamp(n, 4);
      Epilogue::template run<Probe>(p.epi, sm.epi, tid, bi, m0, h, n);
      if (tid % 32 == 0) Probe::stamp(n, 5 + tid / 32);
      sm.handoff.consumer_release();
    }
    if (tid == 0) Probe::cta_end(n);
  };
  if constexpr (K::kBlockFp8) {
    // registers move between whole warpgroups: every warp of one executes the same setmaxnreg
    if (wg == 0 || wg == Cfg::kMmaWGs + 1) {
      ptx::setmaxnreg_dec<K::kRegsOther>();
      if (threadIdx.x < 32) producer();
      else epilogue();
      return;
    }
    ptx::setmaxnreg_inc<K::kRegsMma>();
  } else {
    if (threadIdx.x < 32) return producer();
    if (wg == 0 || wg == Cfg::kMmaWGs + 1) return epilogue();
  }

  // ---------------- MMA warpgroups: 64 rows each
  const int cw = wg - 1;
  float acc[Mainloop::kAcc];
  const typename Mainloop::Consumer mma(sm.ml, cw);
  typename Mainloop::State st;
  const bool stamps = Probe::kOn && threadIdx.x == 128;  // lane 0 of the first MMA warp
  uint32_t n = 0;
  for (int t = sched.first(); sched.valid(t); t = sched.next(t), ++n) {
    if (stamps) Probe::stamp(n, 0);
    if constexpr (K::kExact) {
      sm.handoff.producer_wait(n);
      exact_tile<Epilogue>(p, sm.epi, cw, t);
      sm.handoff.producer_commit();
      continue;
    }
    if constexpr (K::kBlockFp8) {
      // this thread's rows r0, r0 + 8 of the warpgroup's 64 (0 past the sequence: TMA filled them
      // with zero codes) and the 128-row blocks of W under the head's three 64-column slices
      int bi, m0, h;
      tile_coords(p.sched, t, bi, m0, h);
      const int r0 = 64 * cw + 16 * ((threadIdx.x / 32) % 4) + (threadIdx.x % 32) / 4;
      int ox[2];  // 32-bit offsets of the rows' factors in p.bf.sx (-1: past the sequence); the host checks the range
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int si = m0 + r0 + 8 * hh;
        ox[hh] = si < p.epi.S ? static_cast<int>(Epilogue::token_of(p.epi, bi, si) * p.bf.sx_ld) : -1;
      }
      const int ow = static_cast<int>((h * Cfg::kD / 128) * p.bf.sw_ld);  // the block of the head's first row
      const int second = (h * Cfg::kD) % 128 == 0 ? 2 : 1;                 // the first slice in the next block
      mma.template mma<Probe>(sm.stages, st, p.kblocks, acc, [&](int kb, float (&fr)[2], float (&fs)[3]) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) fr[hh] = ox[hh] >= 0 ? __ldg(p.bf.sx + ox[hh] + kb) : 0.f;
        const float w0 = __ldg(p.bf.sw + ow + kb), w1 = __ldg(p.bf.sw + (ow + static_cast<int>(p.bf.sw_ld)) + kb);
#pragma unroll
        for (int sl = 0; sl < 3; ++sl) fs[sl] = sl < second ? w0 : w1;
      }, stamps, n);
    } else {
      mma.template mma<Probe>(sm.stages, st, p.kblocks, acc, stamps, n);
    }
    sm.handoff.producer_wait(n);  // the epilogue has read the previous tile
    if (stamps) Probe::stamp(n, 2);
    Epilogue::store_accumulators(sm.epi, cw, acc);
    sm.handoff.producer_commit();
    if (stamps) Probe::stamp(n, 3);
  }
  if (stamps) Probe::mma_end();
}

}  // namespace mxmla::detail::qproj

namespace mxmla::detail {
// Host: the kernel's inputs for problem p (tensor maps of x and W; W transposed into scratch_w
// first when given as [K, N], scratch_w then holding N * K bf16; bf16 tables widened into
// scratch_tab, 2 * S * R floats). Queues those conversions on `stream`. fp8: x and W are E4M3 codes
// (block-FP8; W [N, K]): maps of 128-code boxes, k-blocks of 128.
void qproj_prepare(const QProjProblem& p, cudaStream_t stream, StreamScratch& scratch_w, StreamScratch& scratch_tab,
                   CUtensorMap& tx, CUtensorMap& tw, qproj::Params& kp, bool fp8);
}  // namespace mxmla::detail
