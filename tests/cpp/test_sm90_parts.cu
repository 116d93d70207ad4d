// Tests of the SM90 building blocks on the GPU (sm_90a): every wgmma shape of the table
// (cuda/ptx/wgmma_ops.cuh: bf16 and the four FP8 combinations, A from shared memory and from
// registers, N = 64 .. 256), and the TMA + mbarrier + wgmma mainloop with the static persistent
// scheduler on an FP8 GEMM with tails in M, N and K (TMA descriptors of a 1-byte type).
// Inputs are small integers, so every fp32 partial sum is exact and results compare bit for bit
// with an integer reference.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/host_util.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/mainloop_tma_wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/tile_scheduler.h"
#include "cuda/tma_desc.h"
#include "test_util.h"

namespace mxmla::test {
namespace {

using ptx::MmaDtype;

#define CHECK_CUDA(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

// ---------------------------------------------------------------- element encodings (exact small integers)
uint8_t encode_int(MmaDtype t, int v, uint16_t& bf16) {
  // v in [-8, 8]: exact in bf16, E4M3 and E5M2
  const float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  bf16 = static_cast<uint16_t>(u >> 16);  // exact: no rounding needed
  if (v == 0) return 0;
  const int s = v < 0 ? 0x80 : 0, a = v < 0 ? -v : v;
  int e = 0;
  while ((2 << e) <= a) ++e;  // a = 2^e * (1 + m / 2^e)
  const int mant = a - (1 << e);
  if (t == MmaDtype::kE4M3) return static_cast<uint8_t>(s | ((e + 7) << 3) | ((mant << 3) >> e));  // 3 mantissa bits
  return static_cast<uint8_t>(s | ((e + 15) << 2) | ((mant << 2) >> e));                           // 2 mantissa bits
}
int elem_bytes(MmaDtype t) { return t == MmaDtype::kBF16 ? 2 : 1; }

// ---------------------------------------------------------------- one wgmma shape
// One warpgroup: A [64][K] and B [N][K] (K-major, rows of 128 bytes) staged in shared memory with
// the 128-byte swizzle, kSteps wgmmas along K, D [64][N] fp32 out (row-major).
template <int N, MmaDtype kA, MmaDtype kB, bool kRegA>
__global__ void __launch_bounds__(128) wgmma_shape_kernel(const uint8_t* a, const uint8_t* b, float* d) {
  using Op = ptx::WgmmaOp<N, kA, kB, kRegA>;
  constexpr int kRow = 128;  // bytes per row: one 128-byte swizzle row
  constexpr int kSteps = kRow / (Op::kK * (kA == MmaDtype::kBF16 ? 2 : 1));
  extern __shared__ uint8_t smem_raw[];
  uint8_t* sa = smem_raw + ((1024u - (ptx::smem_u32(smem_raw) & 1023u)) & 1023u);
  uint8_t* sb = sa + 64 * kRow;
  const int tid = threadIdx.x;
  for (int c = tid; c < (64 + N) * 8; c += 128) {  // 16-byte chunk c of the row r: at chunk c ^ (r % 8)
    const int r = c / 8, k = c % 8;
    const uint4 v = r < 64 ? reinterpret_cast<const uint4*>(a)[c] : reinterpret_cast<const uint4*>(b)[c - 64 * 8];
    reinterpret_cast<uint4*>(sa)[r * 8 + (k ^ (r % 8))] = v;
  }
  ptx::fence_proxy_async();  // generic writes, read by the async proxy (wgmma)
  __syncthreads();
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  const int warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) ptx::fence_reg(acc[i]);
  // register form: every step's A fragment is loaded before the fence (registers an asynchronous
  // wgmma reads must not be written until it has retired). a[r]: row 16 warp + lane / 4 + 8 (r % 2),
  // K bytes kb .. kb + 3 of the step (two bf16 or four FP8 values), kb = 4 (lane % 4) + (r / 2) * 16
  uint32_t fr[kSteps][4];
  if constexpr (kRegA) {
#pragma unroll
    for (int k = 0; k < kSteps; ++k)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = 16 * warp + lane / 4 + 8 * (r % 2), kb = 32 * k + 4 * (lane % 4) + (r / 2) * 16;
        fr[k][r] = *reinterpret_cast<const uint32_t*>(a + row * kRow + kb);
      }
  }
  ptx::wgmma_fence();
  const uint64_t db = ptx::wgmma_desc_k_sw128(sb);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    if constexpr (kRegA) Op::mma(acc, fr[k], db + 2 * k, k > 0);
    else Op::mma(acc, ptx::wgmma_desc_k_sw128(sa) + 2 * k, db + 2 * k, k > 0);
  }
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < N / 2; ++i) ptx::fence_reg(acc[i]);
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        d[(16 * warp + lane / 4 + 8 * h) * N + 8 * j + 2 * (lane % 4) + e] = acc[4 * j + 2 * h + e];
}

struct ShapeCase {
  int n;
  MmaDtype a, b;
  bool reg_a;
  std::string name() const {
    auto t = [](MmaDtype x) { return x == MmaDtype::kBF16 ? "bf16" : x == MmaDtype::kE4M3 ? "e4m3" : "e5m2"; };
    return "N" + std::to_string(n) + "_" + t(a) + "_" + t(b) + (reg_a ? "_rs" : "_ss");
  }
};

using ShapeFn = void (*)(const uint8_t*, const uint8_t*, float*);
template <int N, MmaDtype kA, MmaDtype kB, bool kRegA>
ShapeFn shape_fn() {
  return wgmma_shape_kernel<N, kA, kB, kRegA>;
}
template <int N, MmaDtype kA, MmaDtype kB>
ShapeFn pick_a(bool reg_a) {
  return reg_a ? shape_fn<N, kA, kB, true>() : shape_fn<N, kA, kB, false>();
}
template <int N>
ShapeFn pick_types(MmaDtype a, MmaDtype b, bool reg_a) {
  using D = MmaDtype;
  if (a == D::kBF16) return pick_a<N, D::kBF16, D::kBF16>(reg_a);
  if (a == D::kE4M3) return b == D::kE4M3 ? pick_a<N, D::kE4M3, D::kE4M3>(reg_a) : pick_a<N, D::kE4M3, D::kE5M2>(reg_a);
  return b == D::kE4M3 ? pick_a<N, D::kE5M2, D::kE4M3>(reg_a) : pick_a<N, D::kE5M2, D::kE5M2>(reg_a);
}
ShapeFn pick(const ShapeCase& c) {
  switch (c.n) {
    case 64: return pick_types<64>(c.a, c.b, c.reg_a);
    case 96: return pick_types<96>(c.a, c.b, c.reg_a);
    case 128: return pick_types<128>(c.a, c.b, c.reg_a);
    case 192: return pick_types<192>(c.a, c.b, c.reg_a);
    default: return pick_types<256>(c.a, c.b, c.reg_a);
  }
}

class WgmmaShapeGpu : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(WgmmaShapeGpu, MatchesIntegerReference) {
  MXMLA_REQUIRE_GPU();
  const ShapeCase c = GetParam();
  const int N = c.n, K = 128 / elem_bytes(c.a);  // one 128-byte row of K
  util::Rng rng(1000 + N + 7 * static_cast<int>(c.a) + 31 * static_cast<int>(c.b) + c.reg_a);
  std::vector<int> av(64 * K), bv(N * K);
  for (int& v : av) v = static_cast<int>(rng.uniform() * 17) - 8;
  for (int& v : bv) v = static_cast<int>(rng.uniform() * 17) - 8;
  auto bytes = [&](const std::vector<int>& v, MmaDtype t) {
    std::vector<uint8_t> out(v.size() * elem_bytes(t));
    for (size_t i = 0; i < v.size(); ++i) {
      uint16_t h;
      const uint8_t f8 = encode_int(t, v[i], h);
      if (t == MmaDtype::kBF16) std::memcpy(&out[2 * i], &h, 2);
      else out[i] = f8;
    }
    return out;
  };
  const std::vector<uint8_t> ab = bytes(av, c.a), bb = bytes(bv, c.b);
  uint8_t *da = nullptr, *db = nullptr;
  float* dd = nullptr;
  CHECK_CUDA(cudaMalloc(&da, ab.size()));
  CHECK_CUDA(cudaMalloc(&db, bb.size()));
  CHECK_CUDA(cudaMalloc(&dd, 64 * N * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(da, ab.data(), ab.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, bb.data(), bb.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dd, 0xFF, 64 * N * sizeof(float)));  // poison (NaN)
  const ShapeFn fn = pick(c);
  const int smem = 1024 + (64 + N) * 128;
  CHECK_CUDA(cudaFuncSetAttribute(reinterpret_cast<const void*>(fn), cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  fn<<<1, 128, smem>>>(da, db, dd);
  CHECK_CUDA(cudaGetLastError());
  std::vector<float> out(64 * N);
  CHECK_CUDA(cudaMemcpy(out.data(), dd, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(da), cudaFree(db), cudaFree(dd);
  int bad = 0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      long ref = 0;
      for (int k = 0; k < K; ++k) ref += long{av[m * K + k]} * bv[n * K + k];
      if (out[m * N + n] != static_cast<float>(ref) && ++bad <= 5)
        ADD_FAILURE() << c.name() << ": D[" << m << "][" << n << "] = " << out[m * N + n] << ", expected " << ref;
    }
  EXPECT_EQ(bad, 0);
}

std::vector<ShapeCase> all_shapes() {
  std::vector<ShapeCase> v;
  const MmaDtype f8[] = {MmaDtype::kE4M3, MmaDtype::kE5M2};
  for (int n : {64, 96, 128, 192, 256})
    for (bool reg_a : {false, true}) {
      v.push_back({n, MmaDtype::kBF16, MmaDtype::kBF16, reg_a});
      for (MmaDtype a : f8)
        for (MmaDtype b : f8) v.push_back({n, a, b, reg_a});
    }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Table, WgmmaShapeGpu, ::testing::ValuesIn(all_shapes()),
                         [](const ::testing::TestParamInfo<ShapeCase>& i) { return i.param.name(); });

// ---------------------------------------------------------------- the mainloop on an FP8 GEMM
// C [M x N] fp32 = A [M x K] * B [N x K]^T, E4M3 inputs, tiles of 128 x 128, K-blocks of 128:
// one producer warp (TMA), two consumer warpgroups, a 4-stage ring, the static persistent
// scheduler; partial tiles in M, N and K (TMA fills outside the tensors with zeros).
using GemmMainloop = sm90::MainloopTmaWgmma<128, 128, 128, 4, 2, MmaDtype::kE4M3, MmaDtype::kE4M3>;
struct GemmSmem {
  GemmMainloop::SharedStorage ml;
  GemmMainloop::Barriers bars;
};

__global__ void __launch_bounds__(384, 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb, float* c, int M,
                    int N, int K) {
  extern __shared__ uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<GemmSmem*>(smem_raw + ((1024u - (ptx::smem_u32(smem_raw) & 1023u)) & 1023u));
  const int m_tiles = (M + 127) / 128, n_tiles = (N + 127) / 128, kblocks = (K + 127) / 128;
  const detail::StaticPersistent sched{m_tiles * n_tiles};
  if (threadIdx.x == 0) {
    sm.bars.init(GemmMainloop::kConsumerArrivals);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // producer
    if (threadIdx.x == 0) {
      GemmMainloop::State st;
      uint32_t n = 0;
      for (int t = sched.first(); sched.valid(t); t = sched.next(t), ++n) {
        int mt, nt;
        detail::grouped_tile<4>(t, m_tiles, n_tiles, mt, nt);
        GemmMainloop::produce<detail::NoProbe>(sm.ml, sm.bars, st, kblocks, n, [&](void* a, void* b, uint64_t* bar, int kb) {
          ptx::tma_load_2d(a, &ta, bar, kb * 128, mt * 128);
          ptx::tma_load_2d(b, &tb, bar, kb * 128, nt * 128);
        });
      }
    }
    return;
  }
  const int cw = wg - 1;
  const GemmMainloop::Consumer mma(sm.ml, cw);
  GemmMainloop::State st;
  float acc[GemmMainloop::kAcc];
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  uint32_t n = 0;
  for (int t = sched.first(); sched.valid(t); t = sched.next(t), ++n) {
    int mt, nt;
    detail::grouped_tile<4>(t, m_tiles, n_tiles, mt, nt);
    mma.mma<detail::NoProbe>(sm.bars, st, kblocks, acc, false, n);
    for (int j = 0; j < 128 / 8; ++j)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) {
          const int row = mt * 128 + 64 * cw + 16 * warp + lane / 4 + 8 * h, col = nt * 128 + 8 * j + 2 * (lane % 4) + e;
          if (row < M && col < N) c[static_cast<int64_t>(row) * N + col] = acc[4 * j + 2 * h + e];
        }
  }
}

TEST(Sm90MainloopGpu, Fp8GemmTailsPersistent) {
  MXMLA_REQUIRE_GPU();
  const int M = 300, N = 200, K = 544;  // tails in all three (K % 16 == 0: TMA rows of whole 16 bytes)
  util::Rng rng(77);
  std::vector<int> av(M * K), bv(N * K);
  for (int& v : av) v = static_cast<int>(rng.uniform() * 9) - 4;
  for (int& v : bv) v = static_cast<int>(rng.uniform() * 9) - 4;
  std::vector<uint8_t> ab(M * K), bb(N * K);
  uint16_t unused;
  for (size_t i = 0; i < av.size(); ++i) ab[i] = encode_int(MmaDtype::kE4M3, av[i], unused);
  for (size_t i = 0; i < bv.size(); ++i) bb[i] = encode_int(MmaDtype::kE4M3, bv[i], unused);
  uint8_t *da = nullptr, *db = nullptr;
  float* dc = nullptr;
  CHECK_CUDA(cudaMalloc(&da, ab.size()));
  CHECK_CUDA(cudaMalloc(&db, bb.size()));
  CHECK_CUDA(cudaMalloc(&dc, sizeof(float) * M * N));
  CHECK_CUDA(cudaMemcpy(da, ab.data(), ab.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, bb.data(), bb.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dc, 0xFF, sizeof(float) * M * N));
  const cuuint64_t adims[2] = {cuuint64_t(K), cuuint64_t(M)}, bdims[2] = {cuuint64_t(K), cuuint64_t(N)};
  const cuuint64_t st[1] = {cuuint64_t(K)};
  const cuuint32_t box[2] = {128, 128};
  const CUtensorMap ta = detail::make_tma_desc(da, DType::kFloat8E4M3, 2, adims, st, box, CU_TENSOR_MAP_SWIZZLE_128B);
  const CUtensorMap tb = detail::make_tma_desc(db, DType::kFloat8E4M3, 2, bdims, st, box, CU_TENSOR_MAP_SWIZZLE_128B);
  const size_t smem = sizeof(GemmSmem) + 1024;
  const int tiles = ((M + 127) / 128) * ((N + 127) / 128);
  const detail::KernelFit fit = detail::kernel_fit(reinterpret_cast<const void*>(&fp8_gemm_kernel), 384, smem, smem);
  // fewer CTAs than tiles, so that CTAs walk several tiles and the ring's phases wrap across tiles
  const int grid = static_cast<int>(detail::heuristics::persistent_grid(std::min(2, fit.resident()), tiles));
  fp8_gemm_kernel<<<grid, 384, smem>>>(ta, tb, dc, M, N, K);
  CHECK_CUDA(cudaGetLastError());
  std::vector<float> out(static_cast<size_t>(M) * N);
  CHECK_CUDA(cudaMemcpy(out.data(), dc, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(da), cudaFree(db), cudaFree(dc);
  int bad = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      long ref = 0;
      for (int k = 0; k < K; ++k) ref += long{av[m * K + k]} * bv[n * K + k];
      if (out[static_cast<size_t>(m) * N + n] != static_cast<float>(ref) && ++bad <= 5)
        ADD_FAILURE() << "C[" << m << "][" << n << "] = " << out[static_cast<size_t>(m) * N + n] << ", expected " << ref;
    }
  EXPECT_EQ(bad, 0);
}

}  // namespace
}  // namespace mxmla::test
