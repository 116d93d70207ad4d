// mxmla internal — inline PTX: cp.async, the per-thread asynchronous global -> shared copy (sm_80+).
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
#error "mxmla: cp.async needs sm_80 or newer; build for sm_90a"
#endif

namespace mxmla::ptx {

// Asynchronous global -> shared copy of kBytes (4, 8 or 16); src_bytes = 0 zero-fills without reading.
template <int kBytes>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, uint32_t src_bytes) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async moves 4, 8 or 16 bytes");
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(s), "l"(gmem), "n"(kBytes), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace mxmla::ptx
