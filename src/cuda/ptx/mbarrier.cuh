// mxmla internal — inline PTX: mbarriers (transaction-counting barriers in shared memory) and the
// fences between the generic and the async (TMA / wgmma) proxies (sm_90+).
#pragma once

#include <cstdint>

#include "cuda/ptx/common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "mxmla: mbarrier transaction counts and async-proxy fences need sm_90 or newer; build for sm_90a"
#endif

namespace mxmla::ptx {

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Make mbarrier initialisation visible to the async (TMA) proxy.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Order this thread's generic-proxy shared-memory writes before later async-proxy accesses (a TMA
// refill or store of the same bytes, a wgmma reading them).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The same for global memory: order async-proxy global accesses (bulk reductions) against this
// thread's generic ones (the flags that publish or admit them).
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
// Wait until the phase with the given parity has completed. The suspend-time hint (10 ms, an upper
// bound) lets the warp sleep in try_wait until the phase flips instead of spinning (Nsight Compute
// showed the fused kernel's producer thread spinning through ~12 k instructions per tile without it).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1, %2;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity), "n"(10000000)
      : "memory");
}

}  // namespace mxmla::ptx
