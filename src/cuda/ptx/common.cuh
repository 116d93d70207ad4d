// mxmla internal — the inline-PTX layer, part 0: what every other part uses (shared-window
// addresses, the register fence for asynchronous accumulators) and the profiling registers.
// The PTX layer is split by topic; each file names the architecture its instructions need and
// fails the build loudly when device code for an older one includes it (never an empty body):
//   common.cuh     any        shared addresses, register fence, %globaltimer, %smid, byte permute,
//                             ex2.approx, read-only byte loads, 16-byte shared stores, flags
//                             between CTAs (gpu-scope release fence, additions, acquire spin)
//   convert.cuh    sm_89+     fp32 -> FP8 pairs, FP8 pairs -> f16x2
//   cp_async.cuh   sm_80+     cp.async (global -> shared, per thread)
//   mma_sync.cuh   sm_80+     ldmatrix (.trans), mma.sync m16n8k16 bf16 (warp-level MMAs)
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

// Byte permute of x (and zero bytes) by the immediate selector kSel (PTX prmt: nibble i picks
// result byte i; bit 3 of a nibble replicates the picked byte's sign bit).
template <uint32_t kSel>
__device__ __forceinline__ uint32_t prmt(uint32_t x) {
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(x), "n"(kSel));
  return r;
}
// 2^x, approximate (MUFU), subnormal results flushed to zero; -inf -> +0.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// One byte through the read-only path (ld.global.nc): issued at once, used later.
__device__ __forceinline__ uint8_t ld_global_nc_u8(const uint8_t* p) {
  uint16_t v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return static_cast<uint8_t>(v);
}
// One fp32 from a shared-window address (ld.shared: a pointer whose window the compiler cannot see
// would become a generic load, queued behind the thread's global traffic).
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
// One 32-bit word to a shared-window address.
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
// Two floats (8 bytes) to a shared-window address.
__device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
// 16 bytes to a shared-window address.
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Flags between CTAs: the writer's release fence and relaxed additions, the waiter's spin on acquire
// loads.
// Wait until *p >= n (acquire loads at gpu scope, a short sleep between them). The loop lives inside
// one asm statement: a loop the compiler sees, taken by one thread of a warpgroup, made ptxas give up
// the uniform registers of the wgmma descriptors around it (280 more instructions per tile in the
// attention backward's consumers).
__device__ __forceinline__ void spin_until_ge_acquire_gpu(const int* p, int n) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      ".reg .s32 v;\n"
      "SPIN_%=:\n"
      "ld.acquire.gpu.global.s32 v, [%0];\n"
      "setp.lt.s32 p, v, %1;\n"
      "@p nanosleep.u32 32;\n"
      "@p bra SPIN_%=;\n"
      "}\n" ::"l"(p),
      "r"(n)
      : "memory");
}
// A release fence at gpu scope (then relaxed additions publish what this thread, or a thread that
// synchronized with it, wrote before: one fence for several flags), and such an addition.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void red_relaxed_gpu_add_s32(int* p, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

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
