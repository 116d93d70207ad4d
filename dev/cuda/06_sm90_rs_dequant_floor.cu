// Experiment 06 — a floor for a "design D" of the MXFP8 GEMM: A's FP8 codes go to shared memory as
// they are (no dequantizing pass over A) and each consumer thread dequantizes its own A fragment into
// registers for a bf16 wgmma that reads A from registers (RS); B is a bf16 copy in shared memory, as
// design C's. Design C pays a pass over both operands first (dgrad T 16384: 0.336 ms of its 1.75 ms,
// almost all of it over dY, the A operand); this times the kernel that would not, against cuBLAS's
// bf16 GEMM on the dequantized operands and the library's own GEMM on them (design C's kernel without
// its passes) in the same run (L2 flushed before each call, medians of 30), and checks its result
// against cuBLAS's; "RS raw" is the same kernel without the conversion (raw code bits into the
// wgmmas: a wrong product, timed only).
//
//   D[M, N] = deq(A) · Bᵀ,   A [M, K] E4M3 codes, K-major, F8_128x4-swizzled E8M0 scales (one per row
//   and 32 of K); B [N, K] bf16, K-major, its K permuted inside every 64 (below); D bf16.
//
// The A fragment of an RS m64nNk16 wgmma: thread (warp w, lane l) holds rows 16w + l/4 (+ 8) and the K
// columns 2q, 2q + 1 and 2q + 8, 2q + 9 (q = l % 4) of each 16. Reading those from a K-major tile takes
// four 2-byte loads a row and step; instead each thread reads 16 contiguous bytes of a row (LDS.128,
// bytes 16q .. 16q + 15 of a 64-byte k-block), and byte 16q + 4s + i is taken as logical column
// 16s + {2q, 2q+1, 2q+8, 2q+9}[i] of step s. The contraction is over K, so B's copy is permuted the
// same way (B_perm[n][64g + σ(p)] = B[n][64g + p]): a dequantizing pass that writes B's copy can
// write it in any order. Dequantization: code -> f16 (cvt e4m3x2) -> fp32 · 2^(e − 127) -> bf16
// (numerics.cuh dequant_pair: exact for the scale bytes used here, 120 .. 134).
//
// Design D was built once (dev/patches/gemm_d_fp8a_regs.patch, 2026-12-02: 1.18x design C's time on
// fprop): there ptxas serialized every wgmma (C7513: other instructions wrote the next fragments while
// wgmmas were in flight), so each k-block's wgmmas drained before the next issue. Here the stage loop
// is unrolled twice, each stage's fragments in their own registers, written only after the wait that
// retires the wgmmas which read them last: ptxas reports no serialization, and a k-block's fragments
// are converted while the previous k-block's wgmmas run.
//
// 128 x 256 tiles, 64 of K a stage (A 8 KB with the 64-byte swizzle, B 32 KB with the 128-byte one,
// the stage's 512-byte scale tile), 5 stages, one producer thread, two consumer warpgroups (64 rows
// each), persistent CTAs over grouped tiles, no split of K (so T 4096's 192 tiles leave a wave
// part-empty, where design C splits K). Epilogue: bf16 stores from registers.
// Result and what came of it: docs/notes-gemm.md (design D; the library's sm90_mxfp8_gemm_rs.cuh reads
// the fragments in K's own order instead, for design C's bits).
// Usage (GPU machine): build/dev/06_sm90_rs_dequant_floor [rounds] [small]   (rounds: default 2; "small":
// one 1000 x 512 x 1024 case, a tail in M, for compute-sanitizer)
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/numerics.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90_bf16_gemm.cuh"    // design C's bf16 GEMM kernel
#include "cuda/sm90_mxfp8_gemm.cuh"  // Params, store_accumulators
#include "cuda/tile_scheduler.h"
#include "cuda/tma_desc.h"
#include "dev/cuda/dev_util.h"
#include "dev/cuda/gemm_inputs.cuh"

namespace mxmla::dev {

struct RsCfg {
  static constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 5, kGroupM = 8, kThreads = 384;
  static constexpr int kRegsProducer = 40, kRegsConsumer = 232;
  static constexpr uint32_t kABytes = kBM * kBK, kBBytes = kBN * kBK * 2, kScaleBytes = 512;
};
struct alignas(1024) RsSmem {
  uint8_t a[RsCfg::kStages][RsCfg::kABytes];  // [128 rows][64 B] codes, 64-byte swizzle
  uint8_t b[RsCfg::kStages][RsCfg::kBBytes];  // [256 rows][64] bf16, 128-byte swizzle
  uint8_t sa[RsCfg::kStages][RsCfg::kScaleBytes];  // the F8_128x4 tile of the stage's 128 of K
  sm90::StageBarriers<RsCfg::kStages> bars;
};
constexpr size_t kRsSmemBytes = sizeof(RsSmem) + 1024;
static_assert(kRsSmemBytes <= 232448, "227 KB of shared memory per block on SM90");

// kConvert false: the same kernel feeding the codes' raw bits to the wgmmas (a wrong product; it times
// what the conversion's instructions cost against the rest)
template <bool kConvert>
__global__ void __launch_bounds__(RsCfg::kThreads, 1)
    rs_dequant_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                           const detail::mxgemm::Params p) {
  using C = RsCfg;
  using Op = ptx::WgmmaOp<256, ptx::MmaDtype::kBF16, ptx::MmaDtype::kBF16, true>;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = sm90::aligned_shared<RsSmem>(smem_raw);
  const int wg = ptx::warpgroup_index();
  sm90::init_barriers_once([&] { sm.bars.init(8); });  // lane 0 of every consumer warp releases a stage
  const detail::StaticPersistent sched{p.num_tiles};
  sm90::PipelineState<C::kStages> st;

  if (wg == 0) {  // ---------------------------------------------------------------- TMA producer
    ptx::setmaxnreg_dec<C::kRegsProducer>();
    if (threadIdx.x != 0) return;
    for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
      int mt, nt;
      detail::grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
      for (int kb = 0; kb < p.kblocks; ++kb) {
        sm.bars.producer_acquire(st);
        uint64_t* full = sm.bars.producer_expect(st, C::kABytes + C::kBBytes + C::kScaleBytes);
        ptx::tma_load_2d(sm.a[st.index], &tmap_a, full, kb * C::kBK, mt * C::kBM);
        ptx::tma_load_2d(sm.b[st.index], &tmap_b, full, kb * C::kBK, nt * C::kBN);
        ptx::bulk_load_g2s(sm.sa[st.index], p.sa + (mt * p.tiles_x + kb / 2) * C::kScaleBytes, C::kScaleBytes, full);
        st.advance();
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 rows each
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int cw = wg - 1, warp = ptx::warp_in_warpgroup(), lane = threadIdx.x % 32, q = lane % 4;
  const int r0 = 64 * cw + 16 * warp + lane / 4;  // tile rows r0 and r0 + 8
  const int r1 = r0 + 8;
  // this thread's 16 bytes of rows r0, r1 in a stage (64-byte swizzle: chunk c of row r at c ^ (r / 2 % 4))
  const uint32_t off0 = r0 * 64 + ((q ^ ((r0 >> 1) & 3)) * 16), off1 = r1 * 64 + ((q ^ ((r1 >> 1) & 3)) * 16);
  // its rows' scale bytes in the stage's F8_128x4 tile (+ the block, 0 .. 3)
  const uint32_t so0 = static_cast<uint32_t>(detail::swizzle_offset(r0, 0, 1)),
                 so1 = static_cast<uint32_t>(detail::swizzle_offset(r1, 0, 1));
  const uint64_t db0 = ptx::wgmma_desc_k_sw128(sm.b[0]);
  constexpr uint32_t kBStep = C::kBBytes / 16;
  for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
    int mt, nt;
    detail::grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t prev = 0;
    // A fragments in two register sets, stage by stage in turn: a set is written again only after the
    // wait that retires the wgmmas reading it (PTX: an A register of a wgmma in flight must not change)
    uint32_t frag[2][4][4];
    const auto stage = [&](int kb, uint32_t(&a)[4][4]) {
      sm.bars.consumer_wait(st);
      const uint4 w0 = *reinterpret_cast<const uint4*>(sm.a[st.index] + off0);
      const uint4 w1 = *reinterpret_cast<const uint4*>(sm.a[st.index] + off1);
      // the thread's 16 bytes lie in one 32-block of K: block 2 (kb % 2) + q / 2 of the 128-of-K scale tile
      const uint32_t j = 2 * (kb % 2) + q / 2;
      const float fa = detail::e8m0_factor(sm.sa[st.index][so0 + j]), fb = detail::e8m0_factor(sm.sa[st.index][so1 + j]);
      const uint32_t x0[4] = {w0.x, w0.y, w0.z, w0.w}, x1[4] = {w1.x, w1.y, w1.z, w1.w};
      const uint64_t db = db0 + st.index * kBStep;
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // k16 step s: bytes 4s .. 4s + 3 of each row's 16
        if constexpr (kConvert) {
          a[s][0] = detail::dequant_pair<true>(x0[s] & 0xFFFFu, fa), a[s][1] = detail::dequant_pair<true>(x1[s] & 0xFFFFu, fb);
          a[s][2] = detail::dequant_pair<true>(x0[s] >> 16, fa), a[s][3] = detail::dequant_pair<true>(x1[s] >> 16, fb);
        } else {
          a[s][0] = x0[s], a[s][1] = x1[s], a[s][2] = x0[s] ^ __float_as_uint(fa), a[s][3] = x1[s] ^ __float_as_uint(fb);
        }
#pragma unroll
        for (int i = 0; i < 128; ++i) ptx::fence_reg(acc[i]);
        ptx::wgmma_fence();
        Op::mma(acc, a[s], db + 2 * s, true);
      }
      ptx::wgmma_commit();
      if (kb > 0) {
        ptx::wgmma_wait<1>();  // the previous stage's wgmmas are done: hand it back
        if (lane == 0) sm.bars.consumer_release(prev);
      }
      prev = st.index;
      st.advance();
    };
    for (int kb = 0; kb < p.kblocks; kb += 2) {
      stage(kb, frag[0]);
      if (kb + 1 < p.kblocks) stage(kb + 1, frag[1]);
    }
    ptx::wgmma_wait<0>();
    if (lane == 0) sm.bars.consumer_release(prev);
#pragma unroll
    for (int i = 0; i < 128; ++i) ptx::fence_reg(acc[i]);
    detail::mxgemm::store_accumulators<256>(p, acc, mt * C::kBM, nt * C::kBN, r0, lane);
  }
}

// B_perm[n][64g + σ(p)] = B[n][64g + p], p = 16q + 4s + i -> σ(p) = 16s + 2q + {0, 1, 8, 9}[i]
__global__ void permute_b(const uint16_t* b, uint16_t* bp, int64_t N, int64_t K) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < N * K; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = e / K, k = e % K, g = k / 64;
    const int p = static_cast<int>(k % 64), qq = p / 16, s = (p % 16) / 4, i = p % 4;
    const int sigma = 16 * s + 2 * qq + (i < 2 ? i : 8 + i - 2);
    bp[n * K + 64 * g + sigma] = b[e];
  }
}
}  // namespace mxmla::dev

using namespace mxmla;
using namespace mxmla::dev;

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device");
  for (const void* k : {reinterpret_cast<const void*>(&rs_dequant_gemm_kernel<true>),
                        reinterpret_cast<const void*>(&rs_dequant_gemm_kernel<false>)})
    check_cuda(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kRsSmemBytes)),
               "smem attribute");
  cublasHandle_t h{};
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 1;
  const std::vector<GemmShape> shapes =
      gemm_shapes(argc, argv, {{"dgrad T 16384", 16384, 1536, 24576}, {"dgrad T 4096", 4096, 1536, 24576},
                               {"fprop T 16384", 16384, 24576, 1536}, {"8192^3", 8192, 8192, 8192}});
  std::printf("%-14s %-6s %10s %10s %10s %10s %8s %8s %8s   %s\n", "case", "round", "cuBLAS ms", "lib bf16", "RS ms",
              "RS raw ms", "TFLOP/s", "RS/cuBLAS", "RS/lib", "check: max|RS or lib - cuBLAS| / max|cuBLAS|");
  for (const GemmShape& sh : shapes) {
    GemmCase g(sh.M, sh.N, sh.K);
    const int64_t M = g.M, N = g.N, K = g.K;
    util::DeviceBuffer bp(N * K * 2), d(M * N * 2);
    permute_b<<<1024, 256>>>(g.b.as<const uint16_t>(), bp.as<uint16_t>(), N, K);
    check_cuda(cudaDeviceSynchronize(), "permuted B");
    const CUtensorMap tb = g.bf16_map(bp.ptr, N, 256);
    detail::mxgemm::Params p = g.p;
    p.out = d.ptr;
    const int grid = std::min(p.num_tiles, sms);
    const auto ours = [&] { rs_dequant_gemm_kernel<true><<<grid, RsCfg::kThreads, kRsSmemBytes>>>(g.ta, tb, p); };
    const auto raw = [&] { rs_dequant_gemm_kernel<false><<<grid, RsCfg::kThreads, kRsSmemBytes>>>(g.ta, tb, p); };
    const auto peer = [&] { g.cublas(h); };
    // the library's GEMM on the same bf16 operands: design C's GEMM kernel without its passes (the
    // shared-memory A this design replaces)
    const auto lib = [&] { g.design_c(sms); };
    ours(), peer(), lib();
    check_cuda(cudaDeviceSynchronize(), "first calls");
    // check: every row of a sample (every 7th), all columns
    const std::vector<uint16_t> hd = d.download<uint16_t>(), hr = g.dref.download<uint16_t>(),
                                hl = g.dlib.download<uint16_t>();
    const double rel = std::max(sampled_rel_diff(hd, hr, M, N), sampled_rel_diff(hl, hr, M, N));
    for (int r = 0; r < rounds; ++r) {
      const float tp = time_ms(peer), to = time_ms(ours), tl = time_ms(lib), tr = time_ms(raw);
      std::printf("%-14s %-6d %10.4f %10.4f %10.4f %10.4f %8.1f %8.3f %8.3f   %.2e%s\n", sh.name, r, tp, tl, to, tr,
                  2.0 * M * N * K / to / 1e9, to / tp, to / tl, rel, rel <= 0x1p-7 ? "" : "  FAIL (bound 2^-7)");
    }
  }
  cublasDestroy(h);
  return 0;
}
