// mxmla internal — inline PTX: warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors,
// the fence / commit / wait protocol, and (wgmma_ops.cuh, generated) the MMA shapes with the
// WgmmaOp<N, A, B, kRegA> table the kernels pick them from.
//
// Protocol per k-block: wgmma_fence() (orders the accumulator registers' earlier writes before the
// asynchronous MMAs read them), the MMAs, wgmma_commit() (one group), and wgmma_wait<n>() before
// reading the accumulators or handing an operand's shared memory back (at most n groups pending).
// fence_reg() (common.cuh) keeps the compiler from moving accumulator accesses across them.
#pragma once

#include <cstdint>

#include "cuda/ptx/common.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "mxmla: wgmma needs sm_90a; build with -gencode=arch=compute_90a,code=sm_90a (an SM100 port uses tcgen05 instead)"
#endif

namespace mxmla::ptx {

// Shared-memory layouts a descriptor can describe (bits 62-63).
enum class SmemSwizzle : uint8_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// A matrix descriptor: start address, leading / stride byte offsets (LBO, SBO: for swizzled
// K-major tiles SBO is the distance between 8-row groups, LBO unused), the layout.
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, SmemSwizzle swizzle, uint32_t lbo_bytes,
                                               uint32_t sbo_bytes) {
  const uint64_t addr = smem_u32(smem);
  return ((addr & 0x3FFFFull) >> 4) | (uint64_t{(lbo_bytes & 0x3FFFFu) >> 4} << 16) |
         (uint64_t{(sbo_bytes & 0x3FFFFu) >> 4} << 32) | (uint64_t{static_cast<uint8_t>(swizzle)} << 62);
}
// The common case: a K-major tile stored as rows of 128 bytes (64 bf16 or 128 FP8 values) with the
// 128-byte swizzle that TMA writes: 8-row groups 1024 bytes apart (SBO), tile 1024-aligned. Advance
// along K by adding (bytes / 16) to the descriptor (within the 128-byte row).
__device__ __forceinline__ uint64_t wgmma_desc_k_sw128(const void* smem) {
  const uint64_t addr = smem_u32(smem);
  return ((addr & 0x3FFFFull) >> 4) | (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// A descriptor from its two words (the high word, constant in a loop, stays put while the low
// word, the start address, moves: 32-bit arithmetic).
__device__ __forceinline__ uint64_t desc_pack(uint32_t lo, uint32_t hi) { return (uint64_t{hi} << 32) | lo; }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

}  // namespace mxmla::ptx

#include "cuda/ptx/wgmma_ops.cuh"
