// mxmla internal — the device side of every bit-exact rule, each written once and shared by the
// kernels (the CPU reference spells the same rules in software, src/cpu/, and the tests compare):
//   * MXFP8 scales: the E8M0 rule, the dequantization factor and the quantization multiplier (common/mxfp8_common.h, shared
//     with the reference), FP8 codes by cvt.rn.satfinite (cuda/ptx/convert.cuh), packed four at a time;
//   * the RoPE term: fmaf(sign * sin, x_b, cos * x_a) with the product rounded first
//     (include/mxmla/rope.h);
//   * bf16 / fp16 conversions: widening (exact), narrowing round-to-nearest-even with the
//     reference's canonical NaN (bf16 0x7FC0, fp16 0x7E00, fp32 0x7FC00000).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/mxfp8_common.h"
#include "cuda/ptx/convert.cuh"

namespace mxmla::detail {

// ---------------------------------------------------------------- MXFP8
// (A block's scale byte as its factor, e8m0_factor, and design B's fold: common/mxfp8_common.h.)
template <bool kE4M3>
__device__ __forceinline__ constexpr uint32_t rcp_max_bits() {
  return kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
}
// |v| as fp32 bits: an integer max over these is the amax, and sees NaN (> 0x7F800000) and Inf.
__device__ __forceinline__ uint32_t mag_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }
// Four FP8 codes of v * m (one multiplier per element), byte i = element i.
template <bool kE4M3>
__device__ __forceinline__ uint32_t fp8x4(float v0, float v1, float v2, float v3, float m0, float m1, float m2,
                                          float m3) {
  return ptx::cvt_fp8x2<kE4M3>(v0 * m0, v1 * m1) | (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(v2 * m2, v3 * m3)) << 16);
}
// ... with one multiplier.
template <bool kE4M3>
__device__ __forceinline__ uint32_t fp8x4(float v0, float v1, float v2, float v3, float m) {
  return ptx::cvt_fp8x2<kE4M3>(v0 * m, v1 * m) | (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(v2 * m, v3 * m)) << 16);
}

// ---------------------------------------------------------------- RoPE
// One output of a rotation: sgn_s * xb + c * xa with the product c * xa rounded to fp32 first, then
// one fma (include/mxmla/rope.h; forward and backward alike).
__device__ __forceinline__ float rope_term(float sgn_s, float xb, float c, float xa) {
  return __fmaf_rn(sgn_s, xb, __fmul_rn(c, xa));
}

// ---------------------------------------------------------------- bf16 / fp16
// bf16 pair in a 32-bit word (element 0 in the low half) -> fp32, exactly.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
// fp32 pair -> bf16 pair, round to nearest even (NaN payloads as the hardware leaves them: for
// intermediate values that are read back, not for outputs).
__device__ __forceinline__ uint32_t bf16x2_rn(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// An output bf16: round to nearest even, NaN -> 0x7FC0 (the reference's float_to_bf16).
__device__ __forceinline__ uint16_t bf16_out(float f) {
  return isnan(f) ? uint16_t{0x7FC0} : __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ uint32_t bf16x2_out(float lo, float hi) {
  return bf16_out(lo) | (static_cast<uint32_t>(bf16_out(hi)) << 16);
}
// A bf16 pair that came out of bf16x2_rn, with its NaNs made canonical (as bf16_out would have).
__device__ __forceinline__ uint32_t bf16x2_canonical(uint32_t w) {
  uint32_t r = w;
  if ((w & 0x7FFFu) > 0x7F80u) r = (r & 0xFFFF0000u) | 0x7FC0u;
  if ((w & 0x7FFF0000u) > 0x7F800000u) r = (r & 0xFFFFu) | 0x7FC00000u;
  return r;
}
// An output fp16: round to nearest even, NaN -> 0x7E00.
__device__ __forceinline__ uint16_t f16_out(float f) { return isnan(f) ? uint16_t{0x7E00} : __half_as_ushort(__float2half_rn(f)); }
// An output fp32: NaN -> 0x7FC00000.
__device__ __forceinline__ uint32_t f32_out(float f) { return isnan(f) ? 0x7FC00000u : __float_as_uint(f); }

// ---------------------------------------------------------------- bf16 copies of MXFP8 operands
// The MXFP8 GEMM's bf16 operand copies written by a quantizing pass (the Linear's QuantizeProblem::
// row_copy / col_copy, rope_backward_quantize's for linear_backward's RopeGrad form): two codes
// (the low 16 bits, element 0 low) dequantized exactly as the GEMM's dequantizing passes do
// (code · 2^(e−127) through fp16 and fp32, one bf16 rounding: exact for a scale byte >= min_exact_e).
template <bool kE4M3>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t codes, float f_lo, float f_hi) {
  const uint32_t h2 = ptx::cvt_f16x2_from_fp8x2<kE4M3>(static_cast<uint16_t>(codes));
  const __half2 h = *reinterpret_cast<const __half2*>(&h2);
  return bf16x2_rn(__low2float(h) * f_lo, __high2float(h) * f_hi);
}
// ... both codes in one block (one factor).
template <bool kE4M3>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t codes, float f) {
  return dequant_pair<kE4M3>(codes, f, f);
}
// Columns j and j + 1 of a pair of rows (a, b: bf16 pairs of one row each, element 0 low) as the
// rows' pairs of one column each: (a.lo, b.lo) and (a.hi, b.hi). For transposed copies.
__device__ __forceinline__ uint32_t pair_lo(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x5410); }
__device__ __forceinline__ uint32_t pair_hi(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x7632); }
// A block whose values a bf16 copy cannot hold exactly (non-zero codes under a scale byte below
// min_exact_e; amax_bits: the block's amax as fp32 bits): the copy's consumer must take the FP8 path.
template <bool kE4M3>
__device__ __forceinline__ void check_exact(uint32_t* flag, uint32_t e, uint32_t amax_bits) {
  if (e < min_exact_e(kE4M3) && amax_bits != 0u) atomicOr(flag, 1u);
}

}  // namespace mxmla::detail
