// mxmla internal — SM90 part: the synchronisation of warp-specialized kernels.
//   PipelineState<kStages>  a position in a ring of stages and the parity of its current lap;
//   StageBarriers<kStages>  the full / empty mbarrier pair of every stage of a TMA ring (producer:
//                           acquire an empty stage, arm `full` with the bytes it will receive, issue
//                           the copies; consumers: wait for `full`, compute, release `empty`);
//   Handoff                 a one-slot hand-off between two roles (e.g. an accumulator tile staged
//                           in shared memory for the epilogue warps), used once per tile n;
//   NamedBarrier<id, n>     bar.sync / bar.arrive over a subset of the CTA's warps;
//   aligned_shared, init_barriers_once: a kernel's shared storage and its barriers' set-up.
// Everything is inline and holds no more state than the hand-written loops it replaces.
#pragma once

#include <cstdint>

#include "cuda/ptx/common.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/warpgroup.cuh"

namespace mxmla::sm90 {

// The kernel's shared storage T at the first 1024-byte boundary of its dynamic shared memory (the
// 128-byte TMA swizzle's atoms; launches ask for 1023 bytes more than sizeof(T)).
template <class T>
__device__ __forceinline__ T& aligned_shared(uint8_t* raw) {
  return *reinterpret_cast<T*>(raw + ((1024u - (ptx::smem_u32(raw) & 1023u)) & 1023u));
}

// Thread 0 runs init() (the CTA's mbarrier initialisations) and the fence that shows them to the
// async proxy; then the whole CTA waits for it.
template <class Init>
__device__ __forceinline__ void init_barriers_once(Init&& init) {
  if (threadIdx.x == 0) {
    init();
    ptx::fence_barrier_init();
  }
  __syncthreads();
}

template <int kStages>
struct PipelineState {
  static_assert(kStages >= 2, "a ring needs a stage to fill while another one is consumed");
  uint32_t index = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++index == kStages) index = 0, phase ^= 1;
  }
};

// In shared memory. full[s]: `producer_arrivals` arrivals (one: the producer's expect_tx, plus the
// stage's bytes; or the threads that wrote the stage); empty[s]: `consumer_arrivals` arrivals (e.g.
// lane 0 of every consumer warp).
template <int kStages>
struct StageBarriers {
  uint64_t full[kStages], empty[kStages];

  // One thread, before the CTA's first barrier (then fence_barrier_init + __syncthreads).
  __device__ __forceinline__ void init(uint32_t consumer_arrivals, uint32_t producer_arrivals = 1) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&full[s], producer_arrivals);
      ptx::mbar_init(&empty[s], consumer_arrivals);
    }
  }
  // Producer: wait until the consumers have released the stage (the first lap passes at once).
  __device__ __forceinline__ void producer_acquire(const PipelineState<kStages>& s) {
    ptx::mbar_wait(&empty[s.index], s.phase ^ 1);
  }
  // Producer: the stage will receive `bytes` by TMA; returns the barrier the copies complete on.
  __device__ __forceinline__ uint64_t* producer_expect(const PipelineState<kStages>& s, uint32_t bytes) {
    ptx::mbar_arrive_expect_tx(&full[s.index], bytes);
    return &full[s.index];
  }
  // Producer: complete the stage without copying (its contents are already in place).
  __device__ __forceinline__ void producer_arrive(const PipelineState<kStages>& s) { ptx::mbar_arrive(&full[s.index]); }
  // Consumer: wait until the stage's data has landed.
  __device__ __forceinline__ void consumer_wait(const PipelineState<kStages>& s) {
    ptx::mbar_wait(&full[s.index], s.phase);
  }
  // Consumer: this arrival's part of releasing stage `index`.
  __device__ __forceinline__ void consumer_release(uint32_t index) { ptx::mbar_arrive(&empty[index]); }
};

// In shared memory. The producer role fills the slot for its n-th use and arrives on `full`
// (`producer_arrivals` arrivals); the consumer role waits for it, uses it and arrives on `empty`
// (`consumer_arrivals` arrivals). A consumer's wait on full also implies that every consumer
// thread has released use n - 1.
struct Handoff {
  uint64_t full, empty;

  __device__ __forceinline__ void init(uint32_t producer_arrivals, uint32_t consumer_arrivals) {
    ptx::mbar_init(&full, producer_arrivals);
    ptx::mbar_init(&empty, consumer_arrivals);
  }
  __device__ __forceinline__ void producer_wait(uint32_t n) { ptx::mbar_wait(&empty, (n & 1) ^ 1); }
  __device__ __forceinline__ void producer_commit() { ptx::mbar_arrive(&full); }
  __device__ __forceinline__ void consumer_wait(uint32_t n) { ptx::mbar_wait(&full, n & 1); }
  __device__ __forceinline__ void consumer_release() { ptx::mbar_arrive(&empty); }
};

// Named barrier kId (1..15; 0 is __syncthreads) over kThreads threads (whole warps).
template <uint32_t kId, uint32_t kThreads>
struct NamedBarrier {
  static_assert(kId >= 1 && kId <= 15, "named barriers 1..15 (0 is __syncthreads)");
  static_assert(kThreads % 32 == 0, "named barriers count whole warps");
  __device__ __forceinline__ static void sync() { ptx::named_barrier(kId, kThreads); }
  __device__ __forceinline__ static void arrive() { ptx::named_barrier_arrive(kId, kThreads); }
};

}  // namespace mxmla::sm90
