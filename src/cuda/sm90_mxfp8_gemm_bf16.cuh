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
// Roles (384 threads, one CTA per SM, persistent over 128 x 256 output tiles, grouped rasterisation).
// Every stage is converted by all three warpgroups, one row per thread (A's 128 rows, B's 256):
//   warpgroup 0  TMA producer and A's converter. Thread 0 keeps the FP8 ring kStages8 - 1 stages
//                ahead: per stage A [128 rows][64 codes] and B [256 rows][64 codes] with the 64-byte
//                swizzle and the stage's 512-byte scale tiles (one of A, two of B) (full: TMA bytes;
//                empty: lane 0 of all 12 warps). Thread r turns row r of A into a bf16 row
//                (128-byte swizzle, the wgmma K-major layout) of the kStages16 ring (full: all 384
//                threads, each after fence.proxy.async; empty: the consumer warps);
//   warpgroups 1, 2  consumers: 64 rows each, m64n256k16 bf16 wgmma (sm90/mainloop_tma_wgmma.cuh's
//                consumer loop), the epilogue straight from the registers. Consumer c also converts
//                B's rows 128 c + r of stage g + 1 while its wgmmas of stage g run (the mainloop's
//                `overlap` hook): twelve converting warps instead of four, the conversion hidden
//                behind the tensor cores.
// The conversion is the attention forward's integer bit construction (sm90/dequant_mxfp8_bf16.cuh),
// with its exact fp32 path for NaN / Inf codes and scales above the fast path's range.
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
  // FP8 stages cover the load latency; 3 + 3 measured the same (the converters run kStages16 − 1 ahead)
  static constexpr int kStages8 = 5, kStages16 = 2;
  static constexpr int kGroupM = 8;
  static constexpr int kThreads = 384;           // producer + A converter, two consumers (+ B converters)
  static constexpr int kRegsDequant = 96, kRegsConsumer = 200;
  static constexpr uint32_t kA8Bytes = kBM * kBK, kB8Bytes = kBN * kBK;  // FP8 tiles per stage
  static constexpr uint32_t kScaleBytes = 512;   // one F8_128x4 tile: 128 rows x 4 blocks (K 128)
  static_assert(kBK == 64, "a stage is one 64-byte swizzle row of codes, one 128-byte row of bf16");
  static_assert(kBM == 128 && kBN == 256, "thread r of warpgroup w converts row r of slab w: A, B's halves");
  // setmaxnreg.inc waits (for ever) for registers that the CTA's launch allocation does not hold
  static_assert(kRegsDequant * 128 + 2 * kRegsConsumer * 128 <= (65536 / kThreads / 8 * 8) * kThreads,
                "setmaxnreg moves registers inside the CTA's launch allocation");
};

// (The smallest scale byte design A dequantizes exactly: min_exact_e, common/mxfp8_common.h.)

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

// Thread t's row of a 128-row slab (A, B's rows 0..127 or 128..255; t + 128 has t's swizzle phase):
// its byte offsets in the FP8 and the bf16 tiles.
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

// Position in this CTA's sequence of stages (its tiles' k-blocks in order), as every role walks it.
struct StageCursor {
  int t, kb, mt, nt;
  __device__ __forceinline__ void locate(const mxgemm::Params& p) { grouped_tile<Cfg::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt); }
};

// One thread's share of a stage: row `r` of slab `slab` (0: A's 128 rows; 1, 2: B's rows 0..127,
// 128..255) from the FP8 ring into the bf16 ring. Waits for the FP8 stage and the bf16 slot, then
// releases the FP8 stage (lane 0 of every warp) and marks its bf16 row written (every thread, after
// fence.proxy.async: the wgmmas read it through the async proxy).
template <class K, bool kE4M3>
__device__ __forceinline__ void convert_row(typename K::Smem& sm, const mxgemm::Params& p, const StageCursor& c,
                                            sm90::PipelineState<K::C::kStages8>& s8,
                                            sm90::PipelineState<K::C::kStages16>& s16, int slab, int r,
                                            const RowOffsets& ro) {
  using C = typename K::C;
  sm.bars8.consumer_wait(s8);
  sm.bars16.producer_acquire(s16);
  const bool valid = slab == 0 ? c.mt * C::kBM + r < p.M : c.nt * C::kBN + 128 * (slab - 1) + r < p.N;
  const uint8_t* src = slab == 0 ? sm.a8[s8.index] : sm.b8[s8.index] + (slab - 1) * 128 * C::kBK;
  uint8_t* dst = slab == 0 ? sm.bf.a[s16.index] : sm.bf.b[s16.index] + (slab - 1) * 128 * 2 * C::kBK;
  const uint8_t* sc = slab == 0 ? sm.sa[s8.index] : sm.sb[s8.index][slab - 1];
  uint4 x[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = valid ? *reinterpret_cast<const uint4*>(src + ro.src[i]) : make_uint4(0, 0, 0, 0);
  // byte of (row, block j) in a 512-byte scale tile: (row % 32) * 16 + (row / 32) * 4 + j; this
  // stage holds blocks 2 (kb % 2) and + 1 of the tile
  const int j = (r % 32) * 16 + (r / 32) * 4 + 2 * (c.kb % 2);
  const uint32_t e0 = valid ? sc[j] : 127u, e1 = valid ? sc[j + 1] : 127u;
  dequant_row64<kE4M3>(x, src, dst, ro, valid, e0, e1);
  __syncwarp();
  if (threadIdx.x % 32 == 0) sm.bars8.consumer_release(s8.index);  // this warp is done reading the FP8 stage
  ptx::fence_proxy_async();  // the bf16 row, written by this thread, for the wgmmas (async proxy)
  sm.bars16.producer_arrive(s16);
  s8.advance();
  s16.advance();
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
  auto& sm = sm90::aligned_shared<typename K::Smem>(smem_raw);
  const int wg = ptx::warpgroup_index(), r = threadIdx.x % 128;
  sm90::init_barriers_once([&] {
    sm.bars8.init(C::kThreads / 32);                 // FP8 stage released by lane 0 of every warp
    sm.bars16.init(ML::kConsumerArrivals, C::kThreads);  // bf16 stage: full after every thread's row
  });
  const StaticPersistent sched{p.num_tiles};
  const RowOffsets ro(r);
  sm90::PipelineState<C::kStages8> s8;   // this thread's conversions: the FP8 stage it reads
  sm90::PipelineState<C::kStages16> s16;  // ... and the bf16 slot it writes
  StageCursor cv{sched.first(), 0, 0, 0};  // the next stage this thread converts
  if (sched.valid(cv.t)) cv.locate(p);
  const auto next_stage = [&](StageCursor& c) {
    if (++c.kb == p.kblocks) {
      c.kb = 0, c.t = sched.next(c.t);
      if (sched.valid(c.t)) c.locate(p);
    }
  };

  if (wg == 0) {  // ------------------------------------------------- A's converter, TMA producer
    ptx::setmaxnreg_dec<C::kRegsDequant>();
    // thread 0's loads: the same stage sequence, kStages8 - 1 stages ahead
    StageCursor ld = cv;
    sm90::PipelineState<C::kStages8> st;
    const int b_row_tiles = (p.N + 127) / 128;  // B's 128-row scale tiles
    const auto load_next = [&] {
      if (!sched.valid(ld.t)) return;
      const bool b_hi = 2 * ld.nt + 1 < b_row_tiles;  // rows 128..255 of the B tile exist
      sm.bars8.producer_acquire(st);                   // every warp is done with the slot
      uint64_t* full = sm.bars8.producer_expect(st, C::kA8Bytes + C::kB8Bytes + (b_hi ? 3 : 2) * C::kScaleBytes);
      ptx::tma_load_2d(sm.a8[st.index], &tmap_a, full, ld.kb * C::kBK, ld.mt * C::kBM);
      ptx::tma_load_2d(sm.b8[st.index], &tmap_b, full, ld.kb * C::kBK, ld.nt * C::kBN);
      const int64_t kt = ld.kb / 2;  // the 512-byte scale tile holding K [128 kt, 128 kt + 128)
      ptx::bulk_load_g2s(sm.sa[st.index], p.sa + (int64_t{ld.mt} * p.tiles_x + kt) * C::kScaleBytes, C::kScaleBytes,
                         full);
      ptx::bulk_load_g2s(sm.sb[st.index][0], p.sb + (int64_t{2 * ld.nt} * p.tiles_x + kt) * C::kScaleBytes,
                         C::kScaleBytes, full);
      if (b_hi)
        ptx::bulk_load_g2s(sm.sb[st.index][1], p.sb + (int64_t{2 * ld.nt + 1} * p.tiles_x + kt) * C::kScaleBytes,
                           C::kScaleBytes, full);
      st.advance();
      next_stage(ld);
    };
    if (threadIdx.x == 0) {
      ptx::prefetch_tmap(&tmap_a);
      ptx::prefetch_tmap(&tmap_b);
      for (int i = 0; i < C::kStages8 - 1; ++i) load_next();
    }
    for (; sched.valid(cv.t); next_stage(cv)) {
      if (threadIdx.x == 0) load_next();  // into the slot every warp released a stage ago
      convert_row<K, kE4M3>(sm, p, cv, s8, s16, 0, r, ro);
    }
    return;
  }

  // ---------------------------------------------------------------- consumers: 64 rows each
  // Consumer cw converts B's rows 128 cw + r of every stage: stage g + 1 while its wgmmas of stage
  // g run (the bf16 slot of g + 1 is g − 1's, which both consumers have retired by then).
  ptx::setmaxnreg_inc<C::kRegsConsumer>();
  const int cw = wg - 1, warp = r / 32, lane = r % 32;
  const int r0 = 64 * cw + 16 * warp + lane / 4;  // tile row of accumulator half 0 (half 1: + 8)
  const typename ML::Consumer cons(sm.bf, cw);
  typename ML::State m16;  // the slot this warpgroup's wgmmas read
  const auto convert_next = [&] {  // the next stage's rows, while this stage's wgmmas run
    if (!sched.valid(cv.t)) return;
    convert_row<K, kE4M3>(sm, p, cv, s8, s16, 1 + cw, r, ro);
    next_stage(cv);
  };
  for (int i = 0; i < C::kStages16 - 1; ++i) convert_next();  // the converters run kStages16 - 1 stages ahead
  for (int t = sched.first(); sched.valid(t); t = sched.next(t)) {
    int mt, nt;
    grouped_tile<C::kGroupM>(t, p.m_tiles, p.n_tiles, mt, nt);
    float acc[ML::kAcc];
    cons.template mma<NoProbe>(sm.bars16, m16, p.kblocks, acc, false, 0, convert_next);
    store_accumulators<C::kBN>(p, acc, mt * C::kBM, nt * C::kBN, r0, lane);
  }
}

}  // namespace mxmla::detail::mxgemm_a
