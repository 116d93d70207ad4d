// mxmla internal — inline PTX: conversions between fp32 / f16 and the FP8 formats (sm_89+).
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 890)
#error "mxmla: FP8 conversions (cvt ... e4m3x2/e5m2x2) need sm_89 or newer; build for sm_90a"
#endif

namespace mxmla::ptx {

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

// a * b per bf16 half, round to nearest even (subnormals kept). sm_90+: an older device target
// fails to compile a call.
template <int kUnused = 0>
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  static_assert(kUnused != 0 && kUnused == 0, "mxmla: mul.rn.bf16x2 needs sm_90 or newer");
  return 0;
#endif
}

}  // namespace mxmla::ptx
