// mxmla internal — the block-FP8 scale rule (include/mxmla/blockfp8.h) shared by the CPU reference
// and the CUDA kernels. Division and multiplication are IEEE fp32, round to nearest (the kernels
// use the _rn intrinsics so that no FMA contraction changes a bit).
#pragma once

#include <cstdint>

#include "common/mxfp8_common.h"

namespace mxmla::detail {

constexpr int kBlockFp8K = 128;          // values of a block along a row
constexpr float kBlockFp8Max = 448.0f;   // E4M3's largest normal

// The fp32 scale of a block from its amax (>= 0, NaN already ignored): 448 / amax, 1 when amax is 0
// or Inf, the largest finite fp32 when the quotient overflows; pow2: mantissa bits cleared.
MXMLA_HD float block_fp8_scale(float amax, bool pow2) {
  const uint32_t ab = f32_as_u32(amax);
  if (amax == 0.0f || ab == 0x7F800000u) return 1.0f;
#if defined(__CUDA_ARCH__)
  float s = __fdiv_rn(kBlockFp8Max, amax);
#else
  volatile float num = kBlockFp8Max;  // (no constant folding into another precision)
  float s = num / amax;
#endif
  if (f32_as_u32(s) == 0x7F800000u) s = u32_as_f32(0x7F7FFFFFu);
  if (pow2) s = u32_as_f32(f32_as_u32(s) & 0xFF800000u);
  return s;
}

MXMLA_HD float block_fp8_scale_inv(float scale) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, scale);
#else
  volatile float one = 1.0f;
  return one / scale;
#endif
}

}  // namespace mxmla::detail
