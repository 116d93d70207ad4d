// Experiment 07 — a floor for a "design E" of the MXFP8 GEMM: A's FP8 codes go to shared memory as
// they are (no dequantizing pass over A, as design D) and three warps of the producer's warpgroup
// convert each stage's codes into a bf16 tile in shared memory (128-byte swizzle, the layout design
// C's kernel reads), so that the consumers run design C's shared-memory (SS) wgmmas and none of the
// conversion's instructions sit in their issue stream (design D converts in the consumers' registers:
// its kernel alone takes 0.93–0.95× cuBLAS's time where experiment 06 without the conversion took
// 1.04×; FlashMLA's Hopper FP8 path converts in a warpgroup of its own). Timed in the same run (L2
// flushed before each call, medians of 30) against cuBLAS's bf16 GEMM on the dequantized operands,
// design C's kernel on them (the library's, unsplit, TMA store) and design D's kernel (the library's,
// unsplit) on the codes. The same values in the same order as design C's kernel: its output must
// equal C's bit for bit (and D's, which gives C's bits).
//
//   D[M, N] = deq(A) · Bᵀ,   A [M, K] E4M3 codes, K-major, F8_128x4-swizzled E8M0 scales (one per row
//   and 32 of K); B [N, K] bf16, K-major; D bf16 from the registers.
//
// 128 x 256 tiles, 64 of K a stage: the codes (8 KB, 64-byte swizzle), their bf16 tile (16 KB), B
// (32 KB) and the stage's 512-byte scale tile: 56.5 KB a stage, so 3 stages (4 would pass the 227 KB
// by a few hundred bytes). Warpgroup 0: warp 0's lane 0 issues the copies, warps 1–3 (96 threads)
// convert, 16 codes a piece (one 16-byte load, two 16-byte stores, no bank conflict; a thread's
// pieces two at a time, their loads first),
// then fence the async proxy and arrive on the stage's conversion barrier (96 arrivals) and its
// release; the two consumer warpgroups (64 rows each) wait on the first, and release the stage
// (256 more arrivals) once their wgmmas have read it. Registers: 88 for warpgroup 0, 208 for the
// consumers.
// Usage (GPU machine): build/dev/07_sm90_dequant_wg_floor [rounds] [small]   (rounds: default 2;
// "small": one 1000 x 512 x 1024 case, a tail in M, for compute-sanitizer)
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/numerics.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90_bf16_gemm.cuh"      // design C's bf16 GEMM kernel
#include "cuda/sm90_mxfp8_gemm.cuh"     // Params, store_accumulators
#include "cuda/sm90_mxfp8_gemm_rs.cuh"  // design D's kernel
#include "cuda/tile_scheduler.h"
#include "cuda/tma_desc.h"
#include "dev/cuda/dev_util.h"
#include "dev/cuda/gemm_inputs.cuh"

namespace mxmla::dev {

struct ECfg {
  static constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3, kGroupM = 8, kThreads = 384;
  static constexpr int kRegsProducer = 88, kRegsConsumer = 208;
  static constexpr int kConverters = 96;  // warps 1..3 of warpgroup 0
  static constexpr uint32_t kCodeBytes = kBM * kBK, kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2,
                            kScaleBytes = 512;
};
static_assert(ECfg::kRegsProducer * 128 + 2 * ECfg::kRegsConsumer * 128 <=
                  (65536 / ECfg::kThreads / 8 * 8) * ECfg::kThreads,
              "setmaxnreg moves registers inside the CTA's launch allocation");
struct alignas(1024) ESmem {
  uint8_t a16[ECfg::kStages][ECfg::kABytes];       // [128 rows][64] bf16, 128-byte swizzle (written here)
  uint8_t b[ECfg::kStages][ECfg::kBBytes];         // [256 rows][64] bf16, 128-byte swizzle
  uint8_t codes[ECfg::kStages][ECfg::kCodeBytes];  // [128 rows][64 B] codes, 64-byte swizzle
  uint8_t sa[ECfg::kStages][ECfg::kScaleBytes];    // the F8_128x4 tile of the stage's 128 of K
  sm90::StageBarriers<ECfg::kStages> bars;         // full: the copies; empty: consumers and converters (352)
  uint64_t conv[ECfg::kStages];                    // the stage's bf16 A is written (96 arrivals)
};
constexpr size_t kESmemBytes = sizeof(ESmem) + 1024;
static_assert(kESmemBytes <= 232448, "227 KB of shared memory per block on SM90");

__global__ void __launch_bounds__(ECfg::kThreads, 1)
    dequant_wg_gemm_kernel(const __grid_constant__ CUtensorMap tmap_codes, const __grid_constant__ CUtensorMap tmap_b,
                           const detail::mxgemm::Params p) {
  using C = ECfg;
  using Op = ptx::WgmmaOp<256, ptx::MmaDtype::kBF16, ptx::MmaDtype::kBF16, false>;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = sm90::aligned_shared<ESmem>(smem_raw);
  const int wg = ptx::warpgroup_index();
  sm90::init_barriers_once([&] {
    sm.bars.init(2 * 128 + C::kConverters);
    for (int s = 0; s < C::kStages; ++s) ptx::mbar_init(&sm.conv[s], C::kConverters);
  });
  const detail::StaticPersistent sched{p.num_tiles};
  sm90::PipelineState<C::kStages> st;

  if (wg == 0) {
    ptx::setmaxnreg_dec<C::kRegsProducer>();
    if (threadIdx.x < 32) {  // ------------------------------------------------ copies: warp 0, lane 0
      if (threadIdx.x != 0) return;
      for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
        int mt, nt;
        detail::grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
        for (int kb = 0; kb < p.kblocks; ++kb) {
          sm.bars.producer_acquire(st);
          uint64_t* full = sm.bars.producer_expect(st, C::kCodeBytes + C::kBBytes + C::kScaleBytes);
          ptx::tma_load_2d(sm.codes[st.index], &tmap_codes, full, kb * C::kBK, mt * C::kBM);
          ptx::tma_load_2d(sm.b[st.index], &tmap_b, full, kb * C::kBK, nt * C::kBN);
          ptx::bulk_load_g2s(sm.sa[st.index], p.sa + (mt * p.tiles_x + kb / 2) * C::kScaleBytes, C::kScaleBytes,
                             full);
          st.advance();
        }
      }
      return;
    }
    // ---------------------------------------------------------------- converters: warps 1..3
    const int tid = threadIdx.x - 32;
    for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
      for (int kb = 0; kb < p.kblocks; ++kb) {
        sm.bars.consumer_wait(st);  // the copies have landed
        const uint8_t* codes = sm.codes[st.index];
        uint8_t* a16 = sm.a16[st.index];
        // a thread's 5 or 6 pieces (row r, 16 codes q: K 16q .. 16q + 15), kBatch at a time: their
        // loads first, then the conversions and stores (three warps hide little latency by switching)
        constexpr int kPer = (C::kBM * 4 + C::kConverters - 1) / C::kConverters, kBatch = 2;
        static_assert(kPer % kBatch == 0, "whole batches");
#pragma unroll
        for (int i0 = 0; i0 < kPer; i0 += kBatch) {
          uint4 words[kBatch];
          uint32_t ebytes[kBatch];
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            const int c = tid + C::kConverters * (i0 + i), r = c / 4, q = c % 4;
            if (c < C::kBM * 4) {
              words[i] = *reinterpret_cast<const uint4*>(codes + r * 64 + ((q ^ ((r >> 1) & 3)) * 16));
              ebytes[i] = sm.sa[st.index][detail::swizzle_offset(r, 0, 1) + 2 * (kb % 2) + q / 2];
            }
          }
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            const int c = tid + C::kConverters * (i0 + i), r = c / 4, q = c % 4;
            if (c >= C::kBM * 4) break;
            const uint4 w = words[i];
            const float f = detail::e8m0_factor(ebytes[i]);
            // bf16 chunks 2q (K 16q .. 16q + 7) and 2q + 1 of row r, at chunk ^ (r % 8) (128-byte swizzle)
            const uint32_t base = ptx::smem_u32(a16 + r * 128);
            ptx::st_shared_v4(base + (((2 * q) ^ (r % 8)) * 16), detail::dequant_pair<true>(w.x & 0xFFFFu, f),
                              detail::dequant_pair<true>(w.x >> 16, f), detail::dequant_pair<true>(w.y & 0xFFFFu, f),
                              detail::dequant_pair<true>(w.y >> 16, f));
            ptx::st_shared_v4(base + (((2 * q + 1) ^ (r % 8)) * 16), detail::dequant_pair<true>(w.z & 0xFFFFu, f),
                              detail::dequant_pair<true>(w.z >> 16, f), detail::dequant_pair<true>(w.w & 0xFFFFu, f),
                              detail::dequant_pair<true>(w.w >> 16, f));
          }
        }
        ptx::fence_proxy_async();  // the generic-proxy stores, before the wgmmas (async proxy) read them
        ptx::mbar_arrive(&sm.conv[st.index]);
        // and this thread's part of releasing the stage (its reads of the codes: racecheck follows an
        // mbarrier's order only from the threads that arrive on it themselves)
        sm.bars.consumer_release(st.index);
        st.advance();
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 rows each
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int cw = wg - 1, warp = ptx::warp_in_warpgroup(), lane = threadIdx.x % 32;
  const int r0 = 64 * cw + 16 * warp + lane / 4;  // tile rows r0 and r0 + 8
  const uint64_t da0 = ptx::wgmma_desc_k_sw128(sm.a16[0] + 64 * cw * 128), db0 = ptx::wgmma_desc_k_sw128(sm.b[0]);
  constexpr uint32_t kAStep = C::kABytes / 16, kBStep = C::kBBytes / 16;  // descriptor units per stage
  for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
    int mt, nt;
    detail::grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t prev = 0;
    for (int kb = 0; kb < p.kblocks; ++kb) {
      ptx::mbar_wait(&sm.conv[st.index], st.phase);
      const uint64_t da = da0 + st.index * kAStep, db = db0 + st.index * kBStep;
#pragma unroll
      for (int i = 0; i < 128; ++i) ptx::fence_reg(acc[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) Op::mma(acc, da + 2 * s, db + 2 * s, kb > 0 || s > 0);
      ptx::wgmma_commit();
      if (kb > 0) {
        ptx::wgmma_wait<1>();  // the previous stage's wgmmas are done: hand it back
        sm.bars.consumer_release(prev);
      }
      prev = st.index;
      st.advance();
    }
    ptx::wgmma_wait<0>();
    sm.bars.consumer_release(prev);
#pragma unroll
    for (int i = 0; i < 128; ++i) ptx::fence_reg(acc[i]);
    detail::mxgemm::store_accumulators<256>(p, acc, mt * C::kBM, nt * C::kBN, r0, lane);
  }
}

}  // namespace mxmla::dev

using namespace mxmla;
using namespace mxmla::dev;

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device");
  using DK = detail::mxgemm_d::Kernel;
  const auto d_kernel = &detail::mxgemm_d::sm90_mxfp8_gemm_rs_kernel<DK, true, false>;
  check_cuda(cudaFuncSetAttribute(dequant_wg_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(kESmemBytes)),
             "smem attribute (E)");
  check_cuda(cudaFuncSetAttribute(d_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(DK::kSmemBytes)),
             "smem attribute (design D)");
  cublasHandle_t h{};
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 1;
  const std::vector<GemmShape> shapes =
      gemm_shapes(argc, argv, {{"dgrad T 16384", 16384, 1536, 24576}, {"dgrad T 4096", 4096, 1536, 24576},
                               {"wgrad T 4096", 24576, 1536, 4096}, {"8192^3", 8192, 8192, 8192}});
  std::printf("%-14s %-6s %10s %10s %10s %10s %8s %8s %8s   %s\n", "case", "round", "cuBLAS ms", "C ms", "D ms", "E ms",
              "E/cuBLAS", "E/C", "E/D", "check: E and D against C (bits), C against cuBLAS");
  for (const GemmShape& sh : shapes) {
    GemmCase g(sh.M, sh.N, sh.K);
    const int64_t M = g.M, N = g.N;
    util::DeviceBuffer de(M * N * 2), dd(M * N * 2);
    detail::mxgemm::Params p = g.p;
    p.out = de.ptr;
    const int grid = std::min(p.num_tiles, sms);
    const auto ours = [&] { dequant_wg_gemm_kernel<<<grid, ECfg::kThreads, kESmemBytes>>>(g.ta, g.tb, p); };
    // design D's kernel as the library launches it unsplit, its output from the registers
    detail::mxgemm::Params pd = g.p;
    pd.out = dd.ptr, pd.tma_out = false;
    const CUtensorMap no_out{};
    const auto dk = [&] { d_kernel<<<grid, DK::C::kThreads, DK::kSmemBytes>>>(g.ta, g.tb, no_out, pd); };
    const auto peer = [&] { g.cublas(h); };
    const auto lib = [&] { g.design_c(sms); };
    ours(), dk(), peer(), lib();
    check_cuda(cudaDeviceSynchronize(), "first calls");
    const std::vector<uint16_t> he = de.download<uint16_t>(), hd = dd.download<uint16_t>(),
                                hc = g.dlib.download<uint16_t>(), hr = g.dref.download<uint16_t>();
    int64_t e_diff = 0, d_diff = 0;
    for (int64_t i = 0; i < M * N; ++i) e_diff += he[i] != hc[i], d_diff += hd[i] != hc[i];
    const double rel = sampled_rel_diff(hc, hr, M, N);
    const bool ok = e_diff == 0 && d_diff == 0 && rel <= 0x1p-7;
    for (int r = 0; r < rounds; ++r) {
      const float tp = time_ms(peer), tc = time_ms(lib), td = time_ms(dk), te = time_ms(ours);
      std::printf("%-14s %-6d %10.4f %10.4f %10.4f %10.4f %8.3f %8.3f %8.3f   E %lld, D %lld outputs differ; %.2e%s\n",
                  sh.name, r, tp, tc, td, te, te / tp, te / tc, te / td, static_cast<long long>(e_diff),
                  static_cast<long long>(d_diff), rel, ok ? "" : "  FAIL");
    }
  }
  cublasDestroy(h);
  return 0;
}
