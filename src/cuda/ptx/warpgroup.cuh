// mxmla internal — inline PTX: warp and warpgroup cooperation: named barriers, stmatrix / ldmatrix
// (register fragments <-> shared memory, sm_90 / sm_75+) and setmaxnreg (sm_90a: register
// reallocation between the warpgroups of a warp-specialized kernel).
#pragma once

#include <cstdint>

#include "cuda/ptx/common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#error "mxmla: stmatrix and warpgroup control need sm_90 or newer; build for sm_90a"
#endif

namespace mxmla::ptx {

// The index of this thread's warpgroup (threadIdx.x / 128) and of its warp within the warpgroup, as
// values the compiler knows to be warp-uniform (a shuffle from lane 0): what derives from them —
// wgmma descriptors, shared-memory offsets of a role's buffers — then lives in uniform registers,
// where wgmma reads its descriptors, instead of being moved there (R2UR) before every wgmma.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x) / 128, 0);
}
__device__ __forceinline__ int warp_in_warpgroup() {
  return __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x) / 32 % 4, 0);
}

// Named barrier `id` (1..15) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync that also ORs a predicate over the participating threads.
__device__ __forceinline__ bool named_barrier_or(uint32_t id, uint32_t threads, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "barrier.red.or.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return r != 0;
}
// Arrive at named barrier `id` without waiting (a producer signalling the threads that bar.sync).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Four 8x8 b16 matrices from registers to shared memory: lane l gives the address of row l % 8 of
// matrix l / 8; register i holds this lane's pair (row lane/4, columns 2(lane%4), +1) of matrix i.
__device__ __forceinline__ void stmatrix_x4(uint32_t row_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(row_addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4(void* row_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  stmatrix_x4(smem_u32(row_addr), r0, r1, r2, r3);
}
// The same with each matrix stored transposed: the row at lane l's address (row l % 8 of matrix
// l / 8) receives column l % 8 of the register matrix (an accumulator fragment [rows][cols] lands
// as [cols][rows]).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t row_addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(row_addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// The inverse: four 8x8 b16 matrices from shared memory into the same register fragment.
__device__ __forceinline__ void ldmatrix_x4(const void* row_addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_u32(row_addr))
               : "memory");
}

// Raise / lower this warpgroup's register budget (the kernel needs __launch_bounds__(threads, 1)).
// sm_90a only: any other device target fails to compile a call.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
#else
  static_assert(kRegs == 0 && kRegs != 0, "mxmla: setmaxnreg needs sm_90a (-gencode=arch=compute_90a,code=sm_90a)");
#endif
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
#else
  static_assert(kRegs == 0 && kRegs != 0, "mxmla: setmaxnreg needs sm_90a (-gencode=arch=compute_90a,code=sm_90a)");
#endif
}

}  // namespace mxmla::ptx
