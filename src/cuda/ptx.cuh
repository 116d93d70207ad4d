// mxmla internal — the one thin layer of inline PTX used by the CUDA kernels.
// Every wrapper is guarded by the architecture it needs; compiling device code for an older
// architecture is a hard error, never an empty body.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 890)
#error "mxmla: the MXFP8 kernels need sm_89 or newer (cvt ... e4m3x2/e5m2x2); build for sm_90a"
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

// Two fp32 -> two FP8 codes, round to nearest even, saturating to +-max normal, NaN kept.
// Result byte 0 is `lo`, byte 1 is `hi`.
template <bool kE4M3>
__device__ __forceinline__ uint16_t cvt_fp8x2(float lo, float hi) {
  uint16_t r;
  if constexpr (kE4M3)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two FP8 codes (byte 0, byte 1) -> two halves (exact), as a packed f16x2 register.
template <bool kE4M3>
__device__ __forceinline__ uint32_t cvt_f16x2_from_fp8x2(uint16_t codes) {
  uint32_t r;
  if constexpr (kE4M3)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(codes));
  else
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(codes));
  return r;
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
