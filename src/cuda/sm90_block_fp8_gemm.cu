// mxmla — the block-FP8 GEMM for SM90 (sm_90a; include/mxmla/blockfp8.h, the DeepSeek-V3 recipe's
// Linear GEMMs):
//
//   D[M, N] = alpha · Σ_kb (A_kb · B_kbᵀ) ⊙ (sa_kb ⊗ sb_kb)  (+ D)
//
// A [M, K] and B [N, K] E4M3 codes, K-major; fp32 factors per 128-wide block of K: A's per row
// (1 x 128 blocks) or per 128 rows (128 x 128), B's per 128 rows (fprop's and dgrad's weights:
// one factor per 128-column slice of a tile) or per row (wgrad's xᵀ: kColB, a factor per column).
//
// Persistent over 128 x kBN output tiles (grouped rasterisation), 384 threads, one CTA per SM; kBN
// 256, or 128 where the wider tiles would leave many SMs idle in their last wave
// (heuristics::block_gemm_tile_n):
//   warpgroup 0  thread 0: TMA producer, each tile's k-blocks A [128][128 B] and B [kBN][128 B]
//                (128-byte swizzle, one 128-wide block of K a stage) into a ring of 4 (kBN 256)
//                or 6 stages;
//                kColB: warp 1 writes each stage's kBN column factors of B into a table beside
//                the ring (its 32 lanes arrive on the stage's full barrier with the TMA bytes),
//                reading them from a [kblocks][N] copy that the launcher transposes first, so
//                that a stage's factors are one contiguous row (a gather of kBN lines otherwise);
//   warpgroups 1, 2  consumers of 64 rows: the block-scaled mainloop
//                (sm90/mainloop_tma_wgmma_block_scaled.cuh: per 128-column slice four m64n128k32
//                FP8 wgmmas into a temporary accumulator, folded into the fp32 one with the
//                factors), then the MXFP8 GEMM's epilogue (sm90_bf16_gemm.cuh: bf16 by TMA through
//                shared memory, or from the registers for fp32 / accumulate / unaligned rows;
//                kColB always from the registers: its factor table takes the staging buffer's
//                shared memory, and wgrad writes fp32).
// Four instantiations (kBN 128 / 256, kColB false / true). Operands whose code rows TMA cannot take (row stride
// or start not a multiple of 16 bytes: K % 16 != 0 when contiguous) are copied into padded rows
// in scratch first.
#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "common/blockfp8_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/sm90/mainloop_tma_wgmma_block_scaled.cuh"
#include "cuda/sm90_bf16_gemm.cuh"  // store_tma
#include "cuda/sm90_mxfp8_gemm.cuh"  // Params (the output's fields), store_accumulators
#include "cuda/stream_scratch.h"
#include "cuda/tile_scheduler.h"
#include "cuda/tma_desc.h"

namespace mxmla::detail {
namespace blockgemm {

template <int kBN_>
struct Cfg {
  static constexpr int kBM = 128, kBN = kBN_;  // tile
  // columns per FP8 wgmma slice (same-run A/Bs in docs/notes-gemm.md: 128 against 64, 0.85-0.90x the time)
  static constexpr int kSubN = 128;
  static constexpr int kStages = kBN == 256 ? 4 : 6;  // 48 / 32 KB a stage (128 of K)
  static constexpr int kGroupM = 8;
  static constexpr int kThreads = 384;
  static constexpr int kRegsProducer = 40, kRegsConsumer = 232;
  static_assert(kRegsProducer * 128 + 2 * kRegsConsumer * 128 <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg moves registers inside the CTA's launch allocation");
  static_assert((kBN == 128 || kBN == 256) && 128 % kSubN == 0, "a slice lies in one 128-row block of B");
};

struct Params {
  mxgemm::Params o;   // M, N, the output (out, ld_out, out_f32, accumulate, alpha, tma_out); tiles
  const float* sa;    // A's factors: row (m / a_br) at sa + (m / a_br) * sa_ld, block kb at + kb
  const float* sb;    // B's: row (n / b_br) at sb + (n / b_br) * sb_ld; kColB: block kb's at sb + kb * sb_ld
  int64_t sa_ld, sb_ld;
  int a_br, b_br;
};

template <int kBN, bool kColB>
struct Kernel {
  using C = Cfg<kBN>;
  static constexpr int kSubN = C::kSubN;
  using Mainloop = sm90::MainloopTmaWgmmaBlockScaled<C::kBM, C::kBN, C::kStages, 2, kSubN, kColB>;
  static constexpr int kSlices = Mainloop::kSlices;
  struct alignas(1024) SmemSlices {
    typename Mainloop::SharedStorage ring;  // a [128][128], b [256][128] E4M3 per stage, 128-byte swizzle
    uint8_t epi[2][2][64 * 128];            // per consumer: half a tile's bf16 results (store_tma)
    typename Mainloop::Barriers bars;
  };
  struct alignas(1024) SmemCols {
    typename Mainloop::SharedStorage ring;
    float fb[C::kStages][C::kBN];  // B's factors of the stage's block of K, per column of the tile
    typename Mainloop::Barriers bars;
  };
  using Smem = std::conditional_t<kColB, SmemCols, SmemSlices>;
  // full barrier arrivals: the TMA producer's expect_tx (+ the factor warp's 32 lanes)
  static constexpr uint32_t kFullArrivals = kColB ? 33 : 1;
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");
};

template <class K, bool kColB>
__global__ void __launch_bounds__(K::C::kThreads, 1)
    sm90_block_fp8_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                               const __grid_constant__ CUtensorMap tmap_out, const Params p) {
  using C = typename K::C;
  using ML = typename K::Mainloop;
  const mxgemm::Params& o = p.o;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = sm90::aligned_shared<typename K::Smem>(smem_raw);
  const int wg = ptx::warpgroup_index(), r = threadIdx.x % 128;
  sm90::init_barriers_once([&] {
    sm.bars.init(ML::kConsumerArrivals, K::kFullArrivals);
  });
  const StaticPersistent sched{o.num_tiles};

  if (wg == 0) {  // ---------------------------------------------------------------- TMA producer
    ptx::setmaxnreg_dec<C::kRegsProducer>();
    if (threadIdx.x == 0) {
      ptx::prefetch_tmap(&tmap_a);
      ptx::prefetch_tmap(&tmap_b);
      typename ML::State st;
      for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
        int mt, nt;
        grouped_tile<C::kGroupM>(t, o.m_tiles, o.n_tiles, mt, nt);
        ML::template produce<NoProbe>(sm.ring, sm.bars, st, o.kblocks, 0,
                                      [&](uint8_t* a, uint8_t* b, uint64_t* full, int kb) {
                                        ptx::tma_load_2d(a, &tmap_a, full, kb * ML::kBK, mt * C::kBM);
                                        ptx::tma_load_2d(b, &tmap_b, full, kb * ML::kBK, nt * C::kBN);
                                      });
      }
    } else if constexpr (kColB) {
      if (threadIdx.x / 32 == 1) {  // the factor warp: B's column factors of each stage
        const int lane = threadIdx.x % 32;
        typename ML::State st;
        for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
          int mt, nt;
          grouped_tile<C::kGroupM>(t, o.m_tiles, o.n_tiles, mt, nt);
          const int n = nt * C::kBN + lane;  // columns n + 32 i (0 past N)
          // (p.sb: the factors transposed by the launcher, [kblocks][N]: a stage's are one row)
          for (int kb = 0; kb < o.kblocks; ++kb) {
            sm.bars.producer_acquire(st);  // the consumers are done with the stage's previous block
            const float* f = p.sb + int64_t{kb} * p.sb_ld;
#pragma unroll
            for (int i = 0; i < C::kBN / 32; ++i) sm.fb[st.index][lane + 32 * i] = n + 32 * i < o.N ? __ldg(f + n + 32 * i) : 0.f;
            ptx::mbar_arrive(&sm.bars.full[st.index]);
            st.advance();
          }
        }
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
    int mt, nt;
    grouped_tile<C::kGroupM>(t, o.m_tiles, o.n_tiles, mt, nt);
    const int m0 = mt * C::kBM, n0 = nt * C::kBN;
    // the factor rows: of A's rows r0, r0 + 8 (null past M: TMA gave them zero codes), of B's rows
    // under each slice (128-row blocks) or of each column (kColB, in col_factors)
    const float* fa[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + r0 + 8 * h;
      fa[h] = m < o.M ? p.sa + int64_t{m / p.a_br} * p.sa_ld : nullptr;
    }
    const float* fb[K::kSlices];
#pragma unroll
    for (int s = 0; s < K::kSlices; ++s) {
      const int n = n0 + K::kSubN * s;
      fb[s] = !kColB && n < o.N ? p.sb + int64_t{n / p.b_br} * p.sb_ld : nullptr;
    }
    float acc[ML::kAcc];
    cons.template mma<NoProbe>(
        sm.bars, st, o.kblocks, acc,
        [&](int kb, float (&fr)[2], float (&fs)[K::kSlices]) {
#pragma unroll
          for (int h = 0; h < 2; ++h) fr[h] = fa[h] != nullptr ? __ldg(fa[h] + kb) : 0.f;
#pragma unroll
          for (int s = 0; s < K::kSlices; ++s) fs[s] = fb[s] != nullptr ? __ldg(fb[s] + kb) : 0.f;
        },
        false, 0,
        [&](uint32_t stage, int s, int j) {  // (kColB) columns 8 j + 2 (lane % 4) + {0, 1} of slice s
          if constexpr (kColB) return *reinterpret_cast<const float2*>(&sm.fb[stage][K::kSubN * s + 8 * j + 2 * (lane % 4)]);
          else return make_float2(0.f, 0.f);
        });
    if constexpr (!kColB) {
      if (o.tma_out) {
        mxgemm_c::store_tma<C::kBN>(o, acc, sm.epi[cw][0], &tmap_out, m0 + 64 * cw, n0, cw, r, lane);
        continue;
      }
    }
    mxgemm::store_accumulators<C::kBN>(o, acc, m0, n0, r0, lane);
  }
  if (o.tma_out && r == 0) ptx::bulk_wait_all();
}

// kColB: B's per-column factors [N][kblocks] (row stride ld) -> [kblocks][N], so that the factor warp
// reads a stage's factors as one contiguous row. Thread (n fastest) per output value.
__global__ void transpose_col_factors(const float* __restrict__ sb, int64_t ld, int64_t N, int64_t kblocks,
                                      float* __restrict__ out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= N * kblocks) return;
  const int64_t kb = i / N, n = i - kb * N;
  out[i] = sb[n * ld + kb];
}

// A K-major E4M3 operand [rows, K] (row stride ld bytes): boxes of [box_rows][128 bytes], 128-byte swizzle.
CUtensorMap operand_map(const uint8_t* codes, int64_t rows, int64_t K, int64_t ld, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld)};
  const cuuint32_t box[2] = {128u, static_cast<cuuint32_t>(box_rows)};
  return make_tma_desc(codes, DType::kFloat8E4M3, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

// The operand's codes where TMA can read them: as given, or copied into rows of round_up(K, 16)
// bytes in scratch (the copy's bytes past K are never read: the map's K stops there).
struct Codes {
  const uint8_t* ptr;
  int64_t ld;
  std::unique_ptr<StreamScratch> copy;
};
Codes tma_codes(const uint8_t* codes, int64_t rows, int64_t K, int64_t ld, cudaStream_t s) {
  if (ld % 16 == 0 && reinterpret_cast<uintptr_t>(codes) % 16 == 0) return {codes, ld, nullptr};
  const int64_t kp = (K + 15) / 16 * 16;
  auto copy = std::make_unique<StreamScratch>(rows * kp, s);
  MXMLA_CUDA_CHECK(cudaMemcpy2DAsync(copy->ptr, size_t(kp), codes, size_t(ld), size_t(K), size_t(rows),
                                     cudaMemcpyDeviceToDevice, s));
  const auto* p = static_cast<const uint8_t*>(copy->ptr);
  return {p, kp, std::move(copy)};
}

template <int kBN, bool kColB>
void launch(const BlockGemmProblem& pr, Params p, cudaStream_t s) {
  using K = Kernel<kBN, kColB>;
  p.o.n_tiles = static_cast<int>((pr.N + kBN - 1) / kBN);
  const int64_t tiles = int64_t{p.o.m_tiles} * p.o.n_tiles;
  if (tiles > 0x7FFFFFFF) throw Error("mxmla.gemm", "out", "has too many output tiles");
  p.o.num_tiles = static_cast<int>(tiles);
  const void* kernel = reinterpret_cast<const void*>(&sm90_block_fp8_gemm_kernel<K, kColB>);
  const KernelFit fit = kernel_fit(kernel, K::C::kThreads, K::kSmemBytes, K::kSmemBytes);
  const Codes a = tma_codes(pr.a, pr.M, pr.K, pr.a_ld, s), b = tma_codes(pr.b, pr.N, pr.K, pr.b_ld, s);
  const CUtensorMap ta = operand_map(a.ptr, pr.M, pr.K, a.ld, K::C::kBM);
  const CUtensorMap tb = operand_map(b.ptr, pr.N, pr.K, b.ld, K::C::kBN);
  CUtensorMap to{};
  if (p.o.tma_out) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(pr.N), static_cast<cuuint64_t>(pr.M)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(pr.ld_out * 2)};
    const cuuint32_t box[2] = {64u, 64u};
    to = make_tma_desc(pr.out, DType::kBFloat16, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  }
  const int grid = static_cast<int>(heuristics::persistent_grid(fit.resident(), p.o.num_tiles));
  sm90_block_fp8_gemm_kernel<K, kColB><<<grid, K::C::kThreads, K::kSmemBytes, s>>>(ta, tb, to, p);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace blockgemm

void block_gemm_cuda(const BlockGemmProblem& pr, Stream stream) {
  constexpr const char* kOp = "mxmla.gemm";
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (pr.M == 0 || pr.N == 0) return;
  if (pr.K == 0) {  // D = 0 (+ D)
    if (!pr.accumulate) {
      const int64_t esz = pr.out_t == DType::kFloat32 ? 4 : 2;
      MXMLA_CUDA_CHECK(cudaMemset2DAsync(pr.out, pr.ld_out * esz, 0, pr.N * esz, pr.M, s));
    }
    return;
  }
  check_cuda_gemm_extents(kOp, pr.M, pr.N, pr.K);
  blockgemm::Params p{};
  mxgemm::Params& o = p.o;
  o.M = static_cast<int>(pr.M), o.N = static_cast<int>(pr.N), o.K = static_cast<int>(pr.K);
  o.kblocks = static_cast<int>((pr.K + 127) / 128);
  o.m_tiles = static_cast<int>((pr.M + 127) / 128);  // n_tiles, num_tiles: launch (by the tile's width)
  o.out = pr.out, o.ld_out = pr.ld_out;
  o.out_f32 = pr.out_t == DType::kFloat32, o.accumulate = pr.accumulate;
  o.alpha = static_cast<float>(pr.alpha);
  o.k_splits = 1, o.kb_per_split = o.kblocks;
  o.tma_out = pr.b_br != 1 && !o.out_f32 && !o.accumulate && reinterpret_cast<uintptr_t>(pr.out) % 16 == 0 &&
              pr.ld_out * 2 % 16 == 0 && pr.N * 2 % 16 == 0;  // (whole 16-byte chunks: sm90_mxfp8_gemm.cu's launch_c)
  p.sa = pr.sa, p.sb = pr.sb, p.sa_ld = pr.sa_ld, p.sb_ld = pr.sb_ld;
  p.a_br = static_cast<int>(pr.a_br), p.b_br = static_cast<int>(pr.b_br);
  std::unique_ptr<StreamScratch> col_factors;  // kColB: B's factors transposed (freed on the stream after the GEMM)
  if (pr.b_br == 1) {
    col_factors = std::make_unique<StreamScratch>(pr.N * o.kblocks * 4, s);
    auto* t = reinterpret_cast<float*>(col_factors->ptr);
    const int64_t n = pr.N * o.kblocks;
    blockgemm::transpose_col_factors<<<static_cast<unsigned>(heuristics::elementwise_grid(n, 256)), 256, 0, s>>>(
        pr.sb, pr.sb_ld, pr.N, o.kblocks, t);
    MXMLA_CUDA_CHECK(cudaGetLastError());
    p.sb = t, p.sb_ld = pr.N;
  }
  // the tile's width: MXMLA_BLOCK_GEMM_TILE_N=128 or 256 in the environment forces it (tests, A/B runs)
  const int64_t forced = heuristics::env_forced("MXMLA_BLOCK_GEMM_TILE_N", 256);
  const int tile_n = forced == 128 || forced == 256
                         ? static_cast<int>(forced)
                         : heuristics::block_gemm_tile_n(o.m_tiles, (pr.N + 255) / 256, (pr.N + 127) / 128, device_sms());
  if (tile_n == 128) {
    if (pr.b_br == 1) blockgemm::launch<128, true>(pr, p, s);
    else blockgemm::launch<128, false>(pr, p, s);
  } else {
    if (pr.b_br == 1) blockgemm::launch<256, true>(pr, p, s);
    else blockgemm::launch<256, false>(pr, p, s);
  }
}

}  // namespace mxmla::detail
