// mxmla internal — the inline-PTX layer, part 0: what every other part uses (shared-window
// addresses, the register fence for asynchronous accumulators) and the profiling registers.
// The PTX layer is split by topic; each file names the architecture its instructions need and
// fails the build loudly when device code for an older one includes it (never an empty body):
//   common.cuh     any        shared addresses, register fence, %globaltimer, %smid
//   convert.cuh    sm_89+     fp32 -> FP8 pairs, FP8 pairs -> f16x2
//   cp_async.cuh   sm_80+     cp.async (global -> shared, per thread)
//   mbarrier.cuh   sm_90+     mbarriers, async-proxy fences
//   tma.cuh        sm_90+     TMA tensor loads/stores, bulk copies, tensor-map prefetch
//   warpgroup.cuh  sm_90+     named barriers, stmatrix; setmaxnreg (sm_90a)
//   wgmma.cuh      sm_90a     wgmma descriptors, fence/commit/wait and the MMA shapes (wgmma_ops.cuh)
// An SM100 port adds its own files (tcgen05, TMEM) beside these.
#pragma once

#include <cstdint>

namespace mxmla::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Keeps the compiler from moving accumulator reads/writes across an asynchronous MMA.
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Profiling helpers: the GPU-wide nanosecond timer (comparable across SMs) and the SM's index.
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t smid() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

}  // namespace mxmla::ptx
