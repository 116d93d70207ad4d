// mxmla internal — the CPU reference's element conversions (float64 arithmetic, SPEC §2
// rounding written out in software). Exposed for the unit tests.
#pragma once

#include <cstdint>

#include "mxmla/mxfp8.h"

namespace mxmla::ref {

// Round a value to an FP8 code: round-to-nearest-even, saturating to +-max normal (Inf too),
// NaN -> 0x7F. Negative values that round to zero give the negative-zero code 0x80.
uint8_t round_to_fp8(double v, Fp8Format f);
// Decode an FP8 code (E4M3: 0x7F/0xFF NaN; E5M2: exponent 31 Inf/NaN).
double fp8_to_double(uint8_t code, Fp8Format f);
// E8M0 scale of a block from its amax (finite, >= 0): ceil(log2(amax * fp32(1/max))) + 127
// clamped to [0, 254], the fp32 product rounded as fp32 (SPEC §2).
uint8_t e8m0_from_amax(double amax, Fp8Format f);
// 2^(e-127); e = 255 -> NaN.
double e8m0_to_double(uint8_t e);
// Input element decoders.
double bf16_to_double(uint16_t bits);
double fp16_to_double(uint16_t bits);
// float -> bf16 bits, round to nearest even (NaN -> 0x7FC0).
uint16_t float_to_bf16(float f);
// double -> bf16 / fp16 bits in one rounding (nearest even, overflow to Inf, NaN -> 0x7FC0 / 0x7E00).
uint16_t double_to_bf16(double v);
uint16_t double_to_fp16(double v);
// Element access by dtype (bf16, fp16, fp32) for the reference loops.
double load_as_double(const void* base, DType t, int64_t offset);
void store_from_double(void* base, DType t, int64_t offset, double v);

}  // namespace mxmla::ref
