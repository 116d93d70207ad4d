// The CPU reference against hand-worked values of SPEC §2 (no GPU needed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/mxfp8_common.h"
#include "cpu/reference.h"
#include "test_util.h"

namespace mxmla {
namespace {

using ref::round_to_fp8;
constexpr auto E4 = Fp8Format::kE4M3;
constexpr auto E5 = Fp8Format::kE5M2;

TEST(Reference, E4M3RoundingAndSaturation) {
  EXPECT_EQ(round_to_fp8(1.0, E4), 0x38);
  EXPECT_EQ(round_to_fp8(448.0, E4), 0x7E);
  EXPECT_EQ(round_to_fp8(449.0, E4), 0x7E);       // saturates (satfinite), never NaN
  EXPECT_EQ(round_to_fp8(464.0, E4), 0x7E);       // midpoint 448 | 480: saturates
  EXPECT_EQ(round_to_fp8(1e30, E4), 0x7E);
  EXPECT_EQ(round_to_fp8(INFINITY, E4), 0x7E);
  EXPECT_EQ(round_to_fp8(-INFINITY, E4), 0xFE);
  EXPECT_EQ(round_to_fp8(-448.0, E4), 0xFE);
  EXPECT_EQ(round_to_fp8(NAN, E4), 0x7F);
  EXPECT_EQ(round_to_fp8(1.0625, E4), 0x38);      // midpoint 1 | 1.125 -> even (1.0)
  EXPECT_EQ(round_to_fp8(1.1875, E4), 0x3A);      // midpoint 1.125 | 1.25 -> even (1.25)
  EXPECT_EQ(round_to_fp8(1.0625000001, E4), 0x39);
  EXPECT_EQ(round_to_fp8(std::ldexp(1.0, -6), E4), 0x08);   // smallest normal
  EXPECT_EQ(round_to_fp8(std::ldexp(1.0, -9), E4), 0x01);   // smallest subnormal
  EXPECT_EQ(round_to_fp8(std::ldexp(1.0, -10), E4), 0x00);  // half of it: ties to even (0)
  EXPECT_EQ(round_to_fp8(std::ldexp(1.5, -9), E4), 0x02);   // 1.5 quanta: ties to even (2)
  EXPECT_EQ(round_to_fp8(-std::ldexp(1.0, -12), E4), 0x80); // negative underflow keeps the sign
  EXPECT_EQ(round_to_fp8(-0.0, E4), 0x80);
  EXPECT_EQ(round_to_fp8(std::ldexp(15.0, -10), E4), 0x08);  // 7.5 quanta -> 8 quanta = min normal
}

TEST(Reference, E5M2RoundingAndSaturation) {
  EXPECT_EQ(round_to_fp8(1.0, E5), 0x3C);
  EXPECT_EQ(round_to_fp8(57344.0, E5), 0x7B);
  EXPECT_EQ(round_to_fp8(61440.0, E5), 0x7B);  // midpoint to 65536 (Inf in E5M2): saturates
  EXPECT_EQ(round_to_fp8(INFINITY, E5), 0x7B);
  EXPECT_EQ(round_to_fp8(-INFINITY, E5), 0xFB);
  EXPECT_EQ(round_to_fp8(std::ldexp(1.0, -16), E5), 0x01);
  EXPECT_EQ(round_to_fp8(std::ldexp(1.0, -17), E5), 0x00);
  EXPECT_EQ(round_to_fp8(1.125, E5), 0x3C);  // midpoint 1 | 1.25 -> even
  EXPECT_EQ(round_to_fp8(1.375, E5), 0x3E);  // midpoint 1.25 | 1.5 -> even (1.5)
}

TEST(Reference, EveryCodeRoundTrips) {
  for (auto f : {E4, E5})
    for (int c = 0; c < 256; ++c) {
      const double v = ref::fp8_to_double(static_cast<uint8_t>(c), f);
      if (std::isnan(v) || std::isinf(v)) continue;
      EXPECT_EQ(round_to_fp8(v, f), c) << "code " << c;
    }
  EXPECT_EQ(ref::fp8_to_double(0x7E, E4), 448.0);
  EXPECT_TRUE(std::isnan(ref::fp8_to_double(0xFF, E4)));
  EXPECT_TRUE(std::isinf(ref::fp8_to_double(0x7C, E5)));
}

TEST(Reference, E8M0ScaleRule) {
  EXPECT_EQ(ref::e8m0_from_amax(448.0, E4), 127);  // 448 * fp32(1/448) == 1 exactly
  EXPECT_EQ(ref::e8m0_from_amax(449.0, E4), 128);
  EXPECT_EQ(ref::e8m0_from_amax(896.0, E4), 128);
  EXPECT_EQ(ref::e8m0_from_amax(897.0, E4), 129);
  EXPECT_EQ(ref::e8m0_from_amax(1.0, E4), 119);    // 1/448 = 2^-8.8 -> 2^-8
  EXPECT_EQ(ref::e8m0_from_amax(0.0, E4), 0);
  EXPECT_EQ(ref::e8m0_from_amax(57344.0, E5), 127);
  EXPECT_EQ(ref::e8m0_from_amax(57345.0, E5), 128);
  EXPECT_EQ(ref::e8m0_from_amax(448.0 * std::ldexp(1.0, -127), E4), 0);  // product 2^-127 -> 0
  EXPECT_EQ(ref::e8m0_from_amax(448.0 * std::ldexp(1.0, -126), E4), 1);
  EXPECT_EQ(ref::e8m0_from_amax(3.4e38, E4), 247);
  EXPECT_EQ(detail::kRcpMaxE4M3Bits, [] { float f = 1.0f / 448.0f; uint32_t u; std::memcpy(&u, &f, 4); return u; }());
  EXPECT_EQ(detail::kRcpMaxE5M2Bits, [] { float f = 1.0f / 57344.0f; uint32_t u; std::memcpy(&u, &f, 4); return u; }());
}

// The shared (kernel-side) bit-manipulation rule and the reference's ceil(log2) rule agree.
TEST(Reference, E8M0BitRuleMatchesCeilLog2) {
  util::Rng rng(3);
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng.next()) & 0x7F7FFFFFu;  // finite, non-negative
    if (i % 4 == 0) bits &= 0x7F800000u;                               // exact powers of two
    if (i % 7 == 0) bits &= 0x00FFFFFFu;                               // denormals and tiny normals
    float amax;
    std::memcpy(&amax, &bits, 4);
    for (auto f : {E4, E5}) {
      const uint8_t a = ref::e8m0_from_amax(amax, f);
      const uint8_t b = detail::block_scale_from_amax_bits(bits, f == E4 ? detail::kRcpMaxE4M3Bits : detail::kRcpMaxE5M2Bits);
      ASSERT_EQ(a, b) << "amax bits 0x" << std::hex << bits;
    }
  }
}

// The kernels' integer-add scale rule against TransformerEngine's float_to_e8m0 (kept in
// mxfp8_common.h as the written-out formula) plus SPEC §2's Inf / NaN rules, for every one of the
// 2^31 sign-cleared amax bit patterns and both formats (~8 s in a Release build); and that the
// scale never decreases as the amax bits grow (so a max over scales equals the scale of the max).
TEST(Reference, E8M0BitRuleEqualsTeFormulaExhaustive) {
  for (uint32_t rcp : {detail::kRcpMaxE4M3Bits, detail::kRcpMaxE5M2Bits}) {
    uint64_t mismatches = 0, decreases = 0;
    uint32_t first = 0;
    uint8_t prev = 0;
    for (uint64_t b = 0; b < 0x80000000ull; ++b) {
      const uint32_t bits = static_cast<uint32_t>(b);
      uint8_t want = detail::float_to_e8m0(detail::u32_as_f32(bits) * detail::u32_as_f32(rcp));
      if (bits == 0x7F800000u) want = 0xFE;
      if (bits > 0x7F800000u) want = 0xFF;
      const uint8_t got = detail::block_scale_from_amax_bits(bits, rcp);
      if (got != want && mismatches++ == 0) first = bits;
      decreases += got < prev;  // non-decreasing in the amax bits: the max of scales is the scale of the max
      prev = got;
    }
    EXPECT_EQ(mismatches, 0u) << "first amax bits 0x" << std::hex << first << " (rcp 0x" << rcp << ")";
    EXPECT_EQ(decreases, 0u) << "rcp 0x" << std::hex << rcp;
  }
}

// The select-only special cases of the shared helpers: every E8M0 byte's multiplier, and the Inf /
// NaN block rule (SPEC §2) for every NaN payload class and both formats.
TEST(Reference, E8M0MultiplierAndSpecialBlocks) {
  for (int e = 0; e < 256; ++e) {
    const float m = detail::e8m0_quant_multiplier(static_cast<uint8_t>(e));
    if (e == 255) {
      EXPECT_TRUE(std::isnan(m));
    } else {
      const double want = e == 0 ? 1.0 : std::ldexp(1.0, 127 - e);  // TE: e = 0 -> 1; e = 254 (Inf block) -> 2^-127
      EXPECT_EQ(static_cast<double>(m), want) << "e " << e;
    }
  }
  for (uint32_t rcp : {detail::kRcpMaxE4M3Bits, detail::kRcpMaxE5M2Bits}) {
    EXPECT_EQ(detail::block_scale_from_amax_bits(0x7F800000u, rcp), 0xFE);  // Inf
    for (uint32_t nan : {0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu, 0x7FA5A5A5u})
      EXPECT_EQ(detail::block_scale_from_amax_bits(nan, rcp), 0xFF) << std::hex << nan;
    const auto fmt = rcp == detail::kRcpMaxE4M3Bits ? E4 : E5;
    EXPECT_EQ(detail::block_scale_from_amax_bits(0x7F7FFFFFu, rcp), ref::e8m0_from_amax(3.4028234663852886e38, fmt));
    EXPECT_EQ(detail::block_scale_from_amax_bits(0u, rcp), 0);
  }
}

// SPEC §2.1: swizzled = S.view(M/128, 4, 32, Kb/4, 4).permute(0, 3, 2, 1, 4), written contiguously.
TEST(Reference, SwizzleMatchesTorchViewPermute) {
  const int64_t M = 256, Kb = 8;
  int64_t idx = 0;
  for (int64_t a = 0; a < M / 128; ++a)
    for (int64_t d = 0; d < Kb / 4; ++d)
      for (int64_t c = 0; c < 32; ++c)
        for (int64_t b = 0; b < 4; ++b)
          for (int64_t e = 0; e < 4; ++e, ++idx)
            ASSERT_EQ(detail::swizzle_offset(a * 128 + b * 32 + c, d * 4 + e, Kb / 4), idx);
}

// Block-level policy on the CPU path of the public API.
struct Block {
  std::vector<uint8_t> row, rs, col, cs;
};
Block quantize_block_cpu(const std::vector<float>& x, int64_t rows, DType t = DType::kFloat32) {
  std::vector<uint8_t> in = test::encode(x, t);
  const MXFP8Shapes s = quantize_shapes({rows, 32}, false);
  test::HostQ h = test::alloc_host(s, true, true);
  quantize(TensorDesc(in.data(), t, {rows, 32}), h.t, QuantizeOptions{});
  return {h.row, h.rs, h.col, h.cs};
}

TEST(ReferenceBlocks, ZeroBlock) {
  Block b = quantize_block_cpu(std::vector<float>(32 * 32, 0.0f), 32);
  for (auto s : b.rs) EXPECT_EQ(s, 0);
  for (auto s : b.cs) EXPECT_EQ(s, 0);
  for (auto c : b.row) EXPECT_EQ(c, 0);
}

TEST(ReferenceBlocks, NaNBlockGetsScaleFFAndNaNCodes) {
  std::vector<float> x(32, 1.0f);
  x[5] = NAN;
  x[6] = INFINITY;  // NaN wins over Inf
  Block b = quantize_block_cpu(x, 1);
  EXPECT_EQ(b.rs[0], 0xFF);
  for (auto c : b.row) EXPECT_EQ(c, 0x7F);
}

TEST(ReferenceBlocks, InfBlockGetsScaleFEAndSaturatedCodes) {
  std::vector<float> x(32, 3.0f);
  x[1] = INFINITY;
  x[2] = -INFINITY;
  x[3] = -3.0f;
  Block b = quantize_block_cpu(x, 1);
  EXPECT_EQ(b.rs[0], 0xFE);
  EXPECT_EQ(b.row[1], 0x7E);
  EXPECT_EQ(b.row[2], 0xFE);
  EXPECT_EQ(b.row[0], 0x00);  // 3 * 2^-127 underflows to +0
  EXPECT_EQ(b.row[3], 0x80);  // and -3 to -0
}

TEST(ReferenceBlocks, MaxNormalBoundary448vs449) {
  std::vector<float> x(32, 1.0f);
  x[0] = 448.0f;
  Block b = quantize_block_cpu(x, 1);
  EXPECT_EQ(b.rs[0], 127);
  EXPECT_EQ(b.row[0], 0x7E);
  EXPECT_EQ(b.row[1], 0x38);
  x[0] = 449.0f;
  b = quantize_block_cpu(x, 1);
  EXPECT_EQ(b.rs[0], 128);
  EXPECT_EQ(b.row[0], 0x76);  // 224.5 -> 224 = 1.75 * 2^7
  EXPECT_EQ(b.row[1], 0x30);  // 0.5
}

TEST(ReferenceBlocks, DenormalBlockUsesMultiplierOne) {
  // amax * (1/448) <= 2^-127 gives e = 0, and TE's multiplier for e = 0 is 1: codes flush to zero.
  std::vector<float> x(32, std::ldexp(1.0f, -130));  // bf16 subnormals
  x[3] = -std::ldexp(1.0f, -128);
  Block b = quantize_block_cpu(x, 1, DType::kBFloat16);
  EXPECT_EQ(b.rs[0], 0);
  EXPECT_EQ(b.row[0], 0x00);
  EXPECT_EQ(b.row[3], 0x80);
}

TEST(ReferenceBlocks, ColumnwiseTailBlockUsesPresentRowsOnly) {
  // 33 rows: the second row-block holds one row; its amax is that row's.
  std::vector<float> x(33 * 32, 1000.0f);
  for (int c = 0; c < 32; ++c) x[32 * 32 + c] = 448.0f;
  Block b = quantize_block_cpu(x, 33);
  ASSERT_EQ(b.cs.size(), 64u);
  for (int c = 0; c < 32; ++c) {
    EXPECT_EQ(b.cs[c], 129);      // 1000/448 -> 2^2
    EXPECT_EQ(b.cs[32 + c], 127);  // 448 -> 2^0
    EXPECT_EQ(b.col[32 * 32 + c], 0x7E);
  }
}

TEST(ReferenceBlocks, DequantizeInvertsExactValues) {
  // Values that are codes times a power of two come back exactly.
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = std::ldexp(static_cast<float>(i % 8 + 8) / 8.0f, i % 9 - 4) * (i % 3 ? 1 : -1);
  std::vector<uint8_t> in = test::encode(x, DType::kFloat32);
  const MXFP8Shapes s = quantize_shapes({2, 32}, false);
  test::HostQ h = test::alloc_host(s, true, true);
  quantize(TensorDesc(in.data(), DType::kFloat32, {2, 32}), h.t, QuantizeOptions{});
  std::vector<float> back(64);
  TensorDesc out(back.data(), DType::kFloat32, {2, 32});
  dequantize(h.t, out, false);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(back[i], x[i]) << i;
}

}  // namespace
}  // namespace mxmla
