// mxmla internal — SM90 part: the mainloop of a warp-specialized GEMM tile.
//
//   acc[kBM x kBN] = A[kBM x K] * B[kBN x K]^T, fp32 accumulators, A and B K-major in global memory.
//   Producer (one thread): the tile's k-blocks of A [kBM x kBK] and B [kBN x kBK] into a kStages
//     ring by TMA (128-byte swizzle: a stage row is one 128-byte swizzle row), each stage guarded by
//     its full / empty mbarriers (cuda/sm90/pipeline.cuh). The caller's `issue` functor names the
//     global coordinates (its tensor maps), so the same loop serves any operand layout.
//   Consumers: kMmaWGs warpgroups, 64 rows of A each, one wgmma group kept in flight: a stage is
//     handed back (lane 0 of every consumer warp arrives on `empty`) as soon as the group that read
//     it has retired.
// The accumulators stay in the consumers' registers; what happens to them is the epilogue's.
// Probes (cuda/probe.cuh) see the waits; the default probe compiles to nothing.
#pragma once

#include <cstdint>

#include "cuda/probe.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/pipeline.cuh"

namespace mxmla::sm90 {

template <int kBM_, int kBN_, int kBK_, int kStages_, int kMmaWGs_, ptx::MmaDtype kA, ptx::MmaDtype kB>
struct MainloopTmaWgmma {
  static constexpr int kBM = kBM_, kBN = kBN_, kBK = kBK_, kStages = kStages_, kMmaWGs = kMmaWGs_;
  static constexpr int kElem = kA == ptx::MmaDtype::kBF16 ? 2 : 1;  // bytes per element (A and B alike)
  using Op = ptx::WgmmaOp<kBN, kA, kB, false>;
  static constexpr int kAcc = kBN / 2;                              // accumulators per thread
  static constexpr int kKSteps = kBK / Op::kK;                      // wgmmas per k-block
  static constexpr uint32_t kStageBytes = (kBM + kBN) * kBK * kElem;
  static_assert((kA == ptx::MmaDtype::kBF16) == (kB == ptx::MmaDtype::kBF16), "bf16 with bf16, FP8 with FP8");
  static_assert(kBK * kElem == 128, "a stage row is one 128-byte swizzle row");
  static_assert(kBM == 64 * kMmaWGs, "one consumer warpgroup per 64 rows of A");
  static_assert(Op::kK * kElem == 32, "one wgmma advances the descriptors by 32 bytes (2 units)");
  static_assert((kBM * kBK * kElem) % 1024 == 0 && (kBN * kBK * kElem) % 1024 == 0, "stage tiles 1024-aligned");

  using State = PipelineState<kStages>;
  using Barriers = StageBarriers<kStages>;
  struct SharedStorage {  // 1024-aligned by the kernel (the 128-byte swizzle atom)
    uint8_t a[kStages][kBM * kBK * kElem];  // A tiles [kBM rows][kBK], 128-byte swizzle
    uint8_t b[kStages][kBN * kBK * kElem];  // B tiles [kBN rows][kBK], 128-byte swizzle
  };
  static constexpr int kConsumerArrivals = 4 * kMmaWGs;  // lane 0 of every consumer warp releases a stage
  struct NoOverlap {
    __device__ __forceinline__ void operator()() const {}
  };

  // ---------------------------------------------------------------- producer (one thread)
  // The kblocks k-blocks of one tile: issue(a_stage, b_stage, full_barrier, kb) issues the TMA
  // copies of k-block kb (kStageBytes in all) completing on full_barrier.
  template <class Probe, class Issue>
  __device__ __forceinline__ static void produce(SharedStorage& sm, Barriers& bars, State& st, int kblocks, uint32_t n,
                                                 Issue&& issue) {
    unsigned long long waited = 0;  // (probes only)
    for (int kb = 0; kb < kblocks; ++kb) {
      const unsigned long long w0 = Probe::clock();
      bars.producer_acquire(st);
      waited += Probe::clock() - w0;
      uint64_t* full = bars.producer_expect(st, kStageBytes);
      issue(sm.a[st.index], sm.b[st.index], full, kb);
      st.advance();
    }
    Probe::stamp_value(n, 16, waited);
  }

  // ---------------------------------------------------------------- consumers
  // Consumer warpgroup cw's view of the ring: descriptors of stage 0 (a stage is a whole number of
  // 16-byte descriptor units further on).
  struct Consumer {
    uint64_t da0, db0;
    static constexpr uint32_t kAStep = sizeof(SharedStorage::a[0]) / 16, kBStep = sizeof(SharedStorage::b[0]) / 16;

    __device__ __forceinline__ Consumer(const SharedStorage& sm, int cw)
        : da0(ptx::wgmma_desc_k_sw128(sm.a[0] + 64 * cw * kBK * kElem)), db0(ptx::wgmma_desc_k_sw128(sm.b[0])) {}

    // acc = the tile's product over kblocks k-blocks (overwritten); returns with every wgmma retired
    // and every stage released. `overlap()` runs once per k-block while that k-block's wgmmas are in
    // flight (after the previous stage is handed back): work that must not wait for them.
    template <class Probe, class Overlap = NoOverlap>
    __device__ __forceinline__ void mma(Barriers& bars, State& st, int kblocks, float (&acc)[kAcc], bool stamps,
                                        uint32_t n, Overlap&& overlap = {}) const {
      const int lane = threadIdx.x % 32;
      uint32_t prev = 0;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) ptx::fence_reg(acc[i]);
      unsigned long long waited = 0;  // (probes only)
      for (int kb = 0; kb < kblocks; ++kb) {
        const unsigned long long w0 = Probe::clock();
        bars.consumer_wait(st);
        waited += Probe::clock() - w0;
        ptx::wgmma_fence();
        const uint64_t da = da0 + st.index * kAStep, db = db0 + st.index * kBStep;
#pragma unroll
        for (int k = 0; k < kKSteps; ++k)  // 32 bytes = 2 descriptor units per wgmma
          Op::mma(acc, da + 2 * k, db + 2 * k, kb > 0 || k > 0);
        ptx::wgmma_commit();
        if (kb > 0) {
          ptx::wgmma_wait<1>();  // the previous stage's wgmmas are done: hand it back
          if (lane == 0) bars.consumer_release(prev);
        }
        prev = st.index;
        st.advance();
        overlap();
      }
      ptx::wgmma_wait<0>();
      if (stamps) Probe::stamp(n, 1), Probe::stamp_value(n, 15, waited);
      if (lane == 0) bars.consumer_release(prev);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) ptx::fence_reg(acc[i]);
    }
  };
};

}  // namespace mxmla::sm90
