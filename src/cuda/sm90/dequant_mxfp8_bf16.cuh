// mxmla internal — SM90 part: MXFP8 codes -> bf16, exactly, with integer bit construction.
//
// An E4M3 code s.eeee.mmm read as the bf16 bit pattern s.000 0eee e.mmm 0000 is the code's value
// times 2^-120 (subnormal codes land on bf16 subnormals, zero on zero): one byte permute with sign
// replication, one shift, one mask per two codes; then one bf16x2 multiply by 2^(120 + e - 127)
// applies the block scale, exact while that factor is a normal bf16 (e <= 134; E5M2: the pattern
// s.000 eeee e.mm0 0000 is the value times 2^-112, e <= 142). The product is exact whenever the
// dequantized value is a normal bf16, and rounds to nearest even otherwise — the value a bf16
// tensor core can hold. Rare inputs leave the fast path (the caller checks `fast_ok`): NaN codes
// (E4M3 S.1111.111; E5M2 exponent 11111: Inf / NaN), scale 255 (NaN) and scales above the limit
// take the exact fp32 path `dequant16_exact_store`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/ptx/common.cuh"
#include "cuda/numerics.cuh"
#include "cuda/ptx/convert.cuh"

namespace mxmla::sm90 {

// The bf16 factor that turns the code pattern into code * 2^(e-127) (largest usable e: kMaxFastE).
template <bool kE4M3>
struct Fp8Bf16 {
  static constexpr uint32_t kBias = kE4M3 ? 120 : 112;   // pattern value = code * 2^-kBias
  static constexpr uint32_t kMaxFastE = 254 - kBias;     // 2^(e - 127 + kBias) a normal bf16
  static constexpr uint32_t kShift = kE4M3 ? 4 : 5;
  static constexpr uint32_t kMask = kE4M3 ? 0x87F087F0u : 0x8FE08FE0u;
};

// bf16 bits of the factor 2^(e - 127 + kBias) (valid for e <= kMaxFastE).
template <bool kE4M3>
__device__ __forceinline__ uint32_t fast_factor_bits(uint32_t e) {
  return (e + Fp8Bf16<kE4M3>::kBias) << 7;
}

// Four codes (byte i = element i) -> two bf16x2 patterns (lo: elements 0, 1; hi: 2, 3).
template <bool kE4M3>
__device__ __forceinline__ void fp8x4_patterns(uint32_t x, uint32_t& lo, uint32_t& hi) {
  // [b0, sign(b0), b1, sign(b1)] and [b2, sign(b2), b3, sign(b3)] (selector nibble 8+i: byte i's sign)
  const uint32_t a = ptx::prmt<0x9180>(x), b = ptx::prmt<0xB3A2>(x);
  lo = (a << Fp8Bf16<kE4M3>::kShift) & Fp8Bf16<kE4M3>::kMask;
  hi = (b << Fp8Bf16<kE4M3>::kShift) & Fp8Bf16<kE4M3>::kMask;
}

// Non-zero when one of the four codes is E4M3 NaN (x.1111.111) / E5M2 Inf or NaN (x.11111.xx).
template <bool kE4M3>
__device__ __forceinline__ uint32_t special_codes(uint32_t x) {
  if constexpr (kE4M3) {
    const uint32_t n = ~x & 0x7F7F7F7Fu;  // a zero byte <=> a NaN code
    return (n - 0x01010101u) & 0x80808080u;
  } else {
    const uint32_t n = ~x & 0x7C7C7C7Cu;  // a zero byte <=> exponent 11111
    return (n - 0x01010101u) & 0x80808080u;
  }
}

// 16 codes with one factor pair per two elements: out[i] = bf16x2 of elements 2i, 2i+1.
// f[i] = the factor (bf16x2) of elements 2i, 2i+1. Returns the special-code flags.
template <bool kE4M3>
__device__ __forceinline__ uint32_t dequant16_fast(const uint4& c, const uint32_t (&f)[8], uint32_t (&out)[8]) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  uint32_t special = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    fp8x4_patterns<kE4M3>(w[i], lo, hi);
    special |= special_codes<kE4M3>(w[i]);
    out[2 * i] = ptx::mul_bf16x2(lo, f[2 * i]);
    out[2 * i + 1] = ptx::mul_bf16x2(hi, f[2 * i + 1]);
  }
  return special;
}

// The exact path: code -> fp32 (exact) * 2^(e-127) (fp32, exact or correctly rounded) -> bf16
// round-to-nearest-even; e = 255 -> NaN. e: the scale bytes of the 16 elements (byte i of the
// 16 = element i); out[i] = bf16x2 of elements 2i, 2i+1.
template <bool kE4M3>
__device__ __forceinline__ void dequant16_exact(const uint4& c, const uint4& e, uint32_t (&out)[8]) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w}, ew[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t h2 = ptx::cvt_f16x2_from_fp8x2<kE4M3>(static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2))));
    const __half2 hv = *reinterpret_cast<const __half2*>(&h2);
    float v[2] = {__low2float(hv), __high2float(hv)};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int el = 2 * i + k;
      const uint32_t sb = (ew[el / 4] >> (8 * (el % 4))) & 0xFFu;
      v[k] *= detail::e8m0_factor(sb);
    }
    const __nv_bfloat162 b = __floats2bfloat162_rn(v[0], v[1]);
    out[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
}

// The same, storing the 32 result bytes as two 16-byte halves at the shared-memory addresses dst_lo
// (elements 0..7) and dst_hi (8..15). Out of line and without arrays in memory: one copy of the rare
// path, so that the unrolled fast path stays compact in the instruction cache (a kernel whose
// register allocation must not see a call inlines dequant16_exact instead).
template <bool kE4M3>
__device__ __noinline__ void dequant16_exact_store(uint4 c, uint4 e, uint32_t dst_lo, uint32_t dst_hi) {
  uint32_t out[8];
  dequant16_exact<kE4M3>(c, e, out);
  ptx::st_shared_v4(dst_lo, out[0], out[1], out[2], out[3]);
  ptx::st_shared_v4(dst_hi, out[4], out[5], out[6], out[7]);
}

}  // namespace mxmla::sm90
