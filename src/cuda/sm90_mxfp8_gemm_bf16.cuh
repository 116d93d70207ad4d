// mxmla internal — the SM90 MXFP8 GEMM, design A (SPEC §7): the FP8 codes are dequantized to bf16
// in shared memory and multiplied by bf16 wgmma with fp32 accumulation. Launcher:
// sm90_mxfp8_gemm.cu (which also holds design B, sm90_mxfp8_gemm.cuh, for the scales design A
// cannot hold exactly).
//
//   D[M, N] = alpha · A_deq · B_deqᵀ (+ D),   A_deq[m, k] = code · 2^(e(m, k / 32) − 127)
//
// A [M, K] and B [N, K], K-major FP8 codes (E4M3 or E5M2) with F8_128x4-swizzled E8M0 scales.
// Each dequantized value is a bf16 number (exactly: the launcher sends operands with scale bytes
// below kMinExactE, whose smallest codes fall below bf16's normal range, to design B). The products
// of two bf16 numbers are exact in fp32 and every sum is an fp32 sum: integer data whose partial
// sums fit fp32's 24 bits comes out exactly.
//
// Roles (384 threads, one CTA per SM, persistent over 128 x 256 output tiles, grouped rasterisation):
//   warpgroup 0  dequantizer and TMA producer. Thread 0 keeps the FP8 ring kStages8 - 1 stages ahead:
//                per stage A [128 rows][64 codes] and B [256 rows][64 codes] with the 64-byte swizzle
//                and the stage's 512-byte scale tiles (one of A, two of B) (full: TMA bytes; empty:
//                the four warps of this warpgroup). Thread t turns rows t of A and t, t + 128 of B of
//                an FP8 stage into bf16 rows (128-byte swizzle, the wgmma K-major layout) of a
//                kStages16 ring (full: 128 arrivals after fence.proxy.async; empty: the consumer
//                warps) — the attention forward's integer bit construction
//                (sm90/dequant_mxfp8_bf16.cuh), with its exact fp32 path for NaN / Inf codes and
//                scales above the fast path's range;
//   warpgroups 1, 2  consumers: 64 rows each, m64n256k16 bf16 wgmma (sm90/mainloop_tma_wgmma.cuh's
//                consumer loop), the epilogue straight from the registers.
// (A separate producer warpgroup would make 512 threads: ptxas then allots 128 registers per thread,
// too few for the 128 accumulators of an m64n256 wgmma.)
#pragma once

#include <cuda.h>  // CUtensorMap (types only)

#include <cstdint>

#include "cuda/numerics.cuh"
#include "cuda/probe.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/dequant_mxfp8_bf16.cuh"
#include "cuda/sm90/mainloop_tma_wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"
#include "cuda/sm90_mxfp8_gemm.cuh"  // Params, other_design, store_accumulators
#include "cuda/tile_scheduler.h"

namespace mxmla::detail::mxgemm_a {

struct Cfg {
  static constexpr int kBM = 128, kBN = 256;
  static constexpr int kBK = 64;                 // K per stage: 64 codes (64 FP8 bytes, 128 bf16 bytes)
  static constexpr int kStages8 = 5, kStages16 = 2;  // FP8 stages cover the load latency
  static constexpr int kGroupM = 8;
  static constexpr int kThreads = 384;           // dequantizer + producer, two consumers
  static constexpr int kRegsDequant = 96, kRegsConsumer = 200;
  static constexpr uint32_t kA8Bytes = kBM * kBK, kB8Bytes = kBN * kBK;  // FP8 tiles per stage
  static constexpr uint32_t kScaleBytes = 512;   // one F8_128x4 tile: 128 rows x 4 blocks (K 128)
  static_assert(kBK == 64, "a stage is one 64-byte swizzle row of codes, one 128-byte row of bf16");
  static_assert(kBM == 128 && kBN == 256, "dequantizer thread t: row t of A, rows t and t + 128 of B");
  // setmaxnreg.inc waits (for ever) for registers that the CTA's launch allocation does not hold
  static_assert(kRegsDequant * 128 + 2 * kRegsConsumer * 128 <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg moves registers inside the CTA's launch allocation");
};

// The smallest scale byte design A dequantizes exactly: the smallest non-zero code times
// 2^(e − 127) must be a normal bf16 (E4M3: 2^-9 · 2^(e−127) >= 2^-126; E5M2: 2^-16 · ...).
constexpr uint32_t min_exact_e(bool e4m3) { return e4m3 ? 10u : 17u; }

struct Kernel {
  using C = Cfg;
  using Mainloop = sm90::MainloopTmaWgmma<C::kBM, C::kBN, C::kBK, C::kStages16, 2, ptx::MmaDtype::kBF16,
                                          ptx::MmaDtype::kBF16>;
  struct alignas(1024) Smem {
    typename Mainloop::SharedStorage bf;            // bf16 ring: a [128][64], b [256][64], 128-byte swizzle
    uint8_t a8[C::kStages8][C::kA8Bytes];           // FP8 ring: [128 rows][64 codes], 64-byte swizzle
    uint8_t b8[C::kStages8][C::kB8Bytes];           //           [256 rows][64 codes]
    uint8_t sa[C::kStages8][C::kScaleBytes];        // A's scale tile of the stage's K (as loaded)
    uint8_t sb[C::kStages8][2][C::kScaleBytes];     // B's two scale tiles (rows 0..127, 128..255)
    sm90::StageBarriers<C::kStages8> bars8;
    typename Mainloop::Barriers bars16;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "227 KB of shared memory per block on SM90");
  static_assert(sizeof(typename Mainloop::SharedStorage) % 1024 == 0, "the FP8 tiles start 1024-aligned");
};

// Dequantizer thread t's rows: row t of the A tile and rows t, t + 128 of the B tile share the
// swizzle phase (t + 128 has t's low bits), so one set of byte offsets serves all three.
struct RowOffsets {
  uint32_t src[4];  // 16-code chunk c of row t in an FP8 tile: t*64 + (c ^ ((t >> 1) & 3))*16 (64-byte swizzle)
  uint32_t dst[8];  // 16-byte chunk h of row t in a bf16 tile: t*128 + (h ^ (t & 7))*16 (128-byte swizzle)
  __device__ __forceinline__ explicit RowOffsets(int t) {
#pragma unroll
    for (int c = 0; c < 4; ++c) src[c] = t * 64 + ((c ^ ((t >> 1) & 3)) * 16);
#pragma unroll
    for (int h = 0; h < 8; ++h) dst[h] = t * 128 + ((h ^ (t & 7)) * 16);
  }
};

// One row of 64 FP8 codes x (already loaded) -> 64 bf16 values (one 128-byte swizzled row at dst +
// the offsets) with the row's two block scales e0 (codes 0..31) and e1 (32..63). `valid` false
// writes zeros. The rare exact path re-reads its codes from src (no arrays in local memory).
template <bool kE4M3>
__device__ __forceinline__ void dequant_row64(const uint4 (&x)[4], const uint8_t* __restrict__ src,
                                              uint8_t* __restrict__ dst, const RowOffsets& o, bool valid, uint32_t e0,
                                              uint32_t e1) {
  const auto dst_at = [&](int h) { return reinterpret_cast<uint4*>(dst + o.dst[h]); };
  if (!valid) {
#pragma unroll
    for (int h = 0; h < 8; ++h) *dst_at(h) = make_uint4(0, 0, 0, 0);
    return;
  }
  const bool exact = e0 > sm90::Fp8Bf16<kE4M3>::kMaxFastE || e1 > sm90::Fp8Bf16<kE4M3>::kMaxFastE;
  uint32_t special = 0;
  if (!exact) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint32_t b = sm90::fast_factor_bits<kE4M3>(c < 2 ? e0 : e1);
      uint32_t f[8], out[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = b | (b << 16);
      special |= sm90::dequant16_fast<kE4M3>(x[c], f, out);
      *dst_at(2 * c) = make_uint4(out[0], out[1], out[2], out[3]);
      *dst_at(2 * c + 1) = make_uint4(out[4], out[5], out[6], out[7]);
    }
  }
  if (exact || special != 0) {  // rare: NaN / Inf codes, NaN or large scales
#pragma unroll 1
    for (int c = 0; c < 4; ++c) {
      const uint32_t e = (c < 2 ? e0 : e1) * 0x01010101u;
      sm90::dequant16_exact_store<kE4M3>(*reinterpret_cast<const uint4*>(src + o.src[c]), make_uint4(e, e, e, e),
                                         ptx::smem_u32(dst_at(2 * c)), ptx::smem_u32(dst_at(2 * c + 1)));
    }
  }
}

template <class K, bool kE4M3>
__global__ void __launch_bounds__(K::C::kThreads, 1)
    sm90_mxfp8_gemm_bf16_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                                const mxgemm::Params p) {
  using C = typename K::C;
  using mxgemm::store_accumulators;
  using ML = typename K::Mainloop;
  if (mxgemm::other_design(p)) return;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<typename K::Smem*>(smem_raw + ((1024u - (ptx::smem_u32(smem_raw) & 1023u)) & 1023u));
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    sm.bars8.init(4);                   // FP8 stage released by lane 0 of each dequantizer warp
    sm.bars16.init(ML::kConsumerArrivals, 128);  // bf16 stage: full after all 128 dequantizer threads
    ptx::fence_barrier_init();
  }
  __syncthreads();
  const StaticPersistent sched{p.num_tiles};
  const int b_row_tiles = (p.N + 127) / 128;  // B's 128-row scale tiles

  if (wg == 0) {  // ------------------------------------------------- dequantizer, TMA producer
    ptx::setmaxnreg_dec<C::kRegsDequant>();
    const int t_row = threadIdx.x, lane = threadIdx.x % 32;
    // thread 0's loads: the (tile, k-block) sequence of this CTA, kStages8 - 1 stages ahead
    struct Loader {
      int t, kb;
      sm90::PipelineState<C::kStages8> st;
    } ld{sched.first(), 0, {}};
    const auto load_next = [&] {
      if (!sched.valid(ld.t)) return;
      int mt, nt;
      grouped_tile<C::kGroupM>(ld.t, p.m_tiles, p.n_tiles, mt, nt);
      const bool b_hi = 2 * nt + 1 < b_row_tiles;  // rows 128..255 of the B tile exist
      sm.bars8.producer_acquire(ld.st);               // the four warps are done with the slot
      uint64_t* full = sm.bars8.producer_expect(ld.st, C::kA8Bytes + C::kB8Bytes + (b_hi ? 3 : 2) * C::kScaleBytes);
      ptx::tma_load_2d(sm.a8[ld.st.index], &tmap_a, full, ld.kb * C::kBK, mt * C::kBM);
      ptx::tma_load_2d(sm.b8[ld.st.index], &tmap_b, full, ld.kb * C::kBK, nt * C::kBN);
      const int64_t kt = ld.kb / 2;  // the 512-byte scale tile holding K [128 kt, 128 kt + 128)
      ptx::bulk_load_g2s(sm.sa[ld.st.index], p.sa + (int64_t{mt} * p.tiles_x + kt) * C::kScaleBytes, C::kScaleBytes,
                         full);
      ptx::bulk_load_g2s(sm.sb[ld.st.index][0], p.sb + (int64_t{2 * nt} * p.tiles_x + kt) * C::kScaleBytes,
                         C::kScaleBytes, full);
      if (b_hi)
        ptx::bulk_load_g2s(sm.sb[ld.st.index][1], p.sb + (int64_t{2 * nt + 1} * p.tiles_x + kt) * C::kScaleBytes,
                           C::kScaleBytes, full);
      ld.st.advance();
      if (++ld.kb == p.kblocks) ld.kb = 0, ld.t = sched.next(ld.t);
    };
    if (threadIdx.x == 0) {
      ptx::prefetch_tmap(&tmap_a);
      ptx::prefetch_tmap(&tmap_b);
      for (int i = 0; i < C::kStages8 - 1; ++i) load_next();
    }
    // byte of (row, block j) in a 512-byte scale tile: (row % 32) * 16 + (row / 32) * 4 + j
    const int s_off = (t_row % 32) * 16 + (t_row / 32) * 4;
    const RowOffsets ro(t_row);
    sm90::PipelineState<C::kStages8> s8;
    sm90::PipelineState<C::kStages16> s16;
    for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
      int mt, nt;
      grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
      const bool va = mt * C::kBM + t_row < p.M;
      const bool vb0 = nt * C::kBN + t_row < p.N, vb1 = nt * C::kBN + 128 + t_row < p.N;
      for (int kb = 0; kb < p.kblocks; ++kb) {
        if (threadIdx.x == 0) load_next();  // into the slot the four warps released last iteration
        sm.bars8.consumer_wait(s8);
        sm.bars16.producer_acquire(s16);
        const int j = s_off + 2 * (kb % 2);  // blocks 2 (kb % 2) and + 1 of the scale tile
        const uint8_t* a8 = sm.a8[s8.index];
        const uint8_t* b8 = sm.b8[s8.index];
        // the three rows' codes first (twelve 16-byte loads in flight), then their conversions
        uint4 xa[4], xb[4], xc[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          xa[c] = va ? *reinterpret_cast<const uint4*>(a8 + ro.src[c]) : make_uint4(0, 0, 0, 0);
          xb[c] = vb0 ? *reinterpret_cast<const uint4*>(b8 + ro.src[c]) : make_uint4(0, 0, 0, 0);
          xc[c] = vb1 ? *reinterpret_cast<const uint4*>(b8 + 128 * 64 + ro.src[c]) : make_uint4(0, 0, 0, 0);
        }
        const uint8_t* sa = sm.sa[s8.index];
        const uint8_t* sb0 = sm.sb[s8.index][0];
        const uint8_t* sb1 = sm.sb[s8.index][1];
        const uint32_t ea0 = sa[j], ea1 = sa[j + 1];
        const uint32_t eb0 = vb0 ? sb0[j] : 127u, eb1 = vb0 ? sb0[j + 1] : 127u;
        const uint32_t ec0 = vb1 ? sb1[j] : 127u, ec1 = vb1 ? sb1[j + 1] : 127u;
        dequant_row64<kE4M3>(xa, a8, sm.bf.a[s16.index], ro, va, ea0, ea1);
        dequant_row64<kE4M3>(xb, b8, sm.bf.b[s16.index], ro, vb0, eb0, eb1);
        dequant_row64<kE4M3>(xc, b8 + 128 * 64, sm.bf.b[s16.index] + 128 * 128, ro, vb1, ec0, ec1);
        __syncwarp();
        if (lane == 0) sm.bars8.consumer_release(s8.index);  // this warp is done reading the FP8 stage
        ptx::fence_proxy_async();  // the bf16 rows, written by this thread, for the wgmmas (async proxy)
        sm.bars16.producer_arrive(s16);
        s8.advance();
        s16.advance();
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 rows each
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int cw = wg - 1, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int r0 = 64 * cw + 16 * warp + lane / 4;  // tile row of accumulator half 0 (half 1: + 8)
  const typename ML::Consumer cons(sm.bf, cw);
  typename ML::State st;
  for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
    int mt, nt;
    grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
    float acc[ML::kAcc];
    cons.template mma<NoProbe>(sm.bars16, st, p.kblocks, acc, false, 0);
    store_accumulators<C::kBN>(p, acc, mt * C::kBM, nt * C::kBN, r0, lane);
  }
}

}  // namespace mxmla::detail::mxgemm_a
