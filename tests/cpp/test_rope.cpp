// RoPE CPU reference (issue 3): SPEC §3 formulas, transpose property, errors, positions, YaRN.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "mxmla/rope.h"
#include "test_util.h"

namespace mxmla {
namespace {

struct RopeCase {
  int64_t S = 5, B = 2, H = 3, D = 96, R = 32;
  std::vector<float> x, c, s, y;
  explicit RopeCase(uint64_t seed) {
    util::Rng rng(seed);
    x.resize(S * B * H * D), c.resize(S * R), s.resize(S * R), y.resize(x.size());
    for (auto& v : x) v = static_cast<float>(rng.normal());
    for (auto& v : c) v = static_cast<float>(rng.normal());
    for (auto& v : s) v = static_cast<float>(rng.normal());
  }
  TensorDesc xd() { return TensorDesc(x.data(), DType::kFloat32, {S, B, H, D}); }
  TensorDesc yd() { return TensorDesc(y.data(), DType::kFloat32, {S, B, H, D}); }
  TensorDesc cd() { return TensorDesc(c.data(), DType::kFloat32, {S, R}); }
  TensorDesc sd() { return TensorDesc(s.data(), DType::kFloat32, {S, R}); }
};

// SPEC §3 default style, written out: out = [x1 c[:h] - x2 s[:h] | x2 c[h:] + x1 s[h:]], in the fp32
// semantics of include/mxmla/rope.h.
TEST(RopeCpu, InterleavedInHalvesOutFollowsSpec) {
  RopeCase t(1);
  RopeOptions o;
  o.rope_dim = t.R;
  TensorDesc y = t.yd();
  apply_rope(t.xd(), t.cd(), t.sd(), y, o);
  const int64_t h = t.R / 2, nope = t.D - t.R;
  for (int64_t si = 0; si < t.S; ++si)
    for (int64_t bh = 0; bh < t.B * t.H; ++bh) {
      const float* x = &t.x[(si * t.B * t.H + bh) * t.D + nope];
      const float* y = &t.y[(si * t.B * t.H + bh) * t.D + nope];
      const float* c = &t.c[si * t.R];
      const float* s = &t.s[si * t.R];
      for (int64_t i = 0; i < h; ++i) {  // fp32 semantics: fmaf(sign s, x_b, c * x_a)
        ASSERT_EQ(y[i], std::fma(-s[i], x[2 * i + 1], c[i] * x[2 * i]));
        ASSERT_EQ(y[h + i], std::fma(s[h + i], x[2 * i], c[h + i] * x[2 * i + 1]));
        ASSERT_NEAR(y[i], double(x[2 * i]) * c[i] - double(x[2 * i + 1]) * s[i], 1e-5);  // the SPEC formula
      }
      for (int64_t d = 0; d < nope; ++d) ASSERT_EQ(t.y[(si * t.B * t.H + bh) * t.D + d], t.x[(si * t.B * t.H + bh) * t.D + d]);
    }
}

class RopeStyles : public ::testing::TestWithParam<RopeStyle> {};
// <R x, g> == <x, R^T g> for every style and layout.
TEST_P(RopeStyles, BackwardIsTranspose) {
  for (RopeLayout l : {RopeLayout::kSBHD, RopeLayout::kBSHD}) {
    RopeCase a(2), g(3);
    RopeOptions o;
    o.style = GetParam(), o.layout = l, o.rope_dim = a.R;
    // bshd: the same buffers read as [B, S, H, D]
    auto shape = [&](RopeCase& t) {
      return l == RopeLayout::kSBHD ? std::vector<int64_t>{t.S, t.B, t.H, t.D} : std::vector<int64_t>{t.B, t.S, t.H, t.D};
    };
    TensorDesc rx(a.y.data(), DType::kFloat32, shape(a)), rtg(g.y.data(), DType::kFloat32, shape(g));
    apply_rope(TensorDesc(a.x.data(), DType::kFloat32, shape(a)), a.cd(), a.sd(), rx, o);
    rope_backward(TensorDesc(g.x.data(), DType::kFloat32, shape(g)), a.cd(), a.sd(), rtg, o);
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < a.x.size(); ++i) lhs += double(a.y[i]) * g.x[i], rhs += double(a.x[i]) * g.y[i];
    EXPECT_NEAR(lhs, rhs, 1e-5 * std::fabs(lhs) + 1e-4);
  }
}
INSTANTIATE_TEST_SUITE_P(All, RopeStyles,
                         ::testing::Values(RopeStyle::kInterleavedInHalvesOut, RopeStyle::kInterleaved,
                                           RopeStyle::kRotateHalf));

void expect_rope_error(const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << arg;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + arg + "'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(rule), std::string::npos) << e.what();
  }
}

TEST(RopeCpu, Errors) {
  RopeCase t(4);
  TensorDesc y = t.yd();
  RopeOptions odd;
  odd.rope_dim = 31;
  expect_rope_error([&] { apply_rope(t.xd(), t.cd(), t.sd(), y, odd); }, "rope_dim", "even");
  RopeOptions big;
  big.rope_dim = 128;
  expect_rope_error([&] { apply_rope(t.xd(), t.cd(), t.sd(), y, big); }, "rope_dim", "exceeds the head dimension");
  RopeOptions thd;
  thd.layout = RopeLayout::kTHD, thd.rope_dim = t.R;
  TensorDesc x3(t.x.data(), DType::kFloat32, {t.S * t.B, t.H, t.D}), y3(t.y.data(), DType::kFloat32, {t.S * t.B, t.H, t.D});
  std::vector<int64_t> bad = {0, 4, 2, 10};
  TensorDesc cu(bad.data(), DType::kInt64, {4});
  expect_rope_error([&] { apply_rope(x3, t.cd(), t.sd(), y3, thd, &cu); }, "cu_seqlens", "non-decreasing");
  std::vector<int64_t> over = {0, 4, 11};
  TensorDesc cu2(over.data(), DType::kInt64, {3});
  expect_rope_error([&] { apply_rope(x3, t.cd(), t.sd(), y3, thd, &cu2); }, "cu_seqlens", "out of range");
  TensorDesc fx(t.x.data(), DType::kFloat32, {t.S, t.B, t.H, t.D}, Device{DeviceType::kCUDA, 0});
  RopeOptions ok;
  ok.rope_dim = t.R;
  EXPECT_THROW(apply_rope(fx, t.cd(), t.sd(), y, ok), Error);  // devices differ / CUDA not implemented
}

TEST(RopeCpu, PositionsAndYarn) {
  const auto p = positions_context_parallel(8, 4, 1);
  EXPECT_EQ(p, (std::vector<double>{4, 5, 6, 7, 24, 25, 26, 27}));
  EXPECT_EQ(positions_from_cu_seqlens({0, 2, 2, 5}), (std::vector<double>{0, 1, 0, 1, 2}));
  EXPECT_NEAR(yarn_softmax_scale(192, YarnParams::deepseek_v3()), 0.135234, 1e-6);
  const auto f = rope_inv_freq(64, 10000.0, YarnParams::deepseek_v3());
  const auto f0 = rope_inv_freq(64, 10000.0, YarnParams{});
  for (int i = 0; i <= 10; ++i) EXPECT_DOUBLE_EQ(f[i], f0[i]);       // below the ramp: unchanged
  for (int i = 23; i < 32; ++i) EXPECT_DOUBLE_EQ(f[i], f0[i] / 40);  // above: interpolated by the factor
}

#if MXMLA_WITH_CUDA
// The CUDA kernel against the CPU reference, bit for bit (same fp32 semantics), over styles,
// dtypes, table dtypes, directions, layouts and in-place use; outputs poisoned first.
TEST(RopeGpu, MatchesReferenceBitExact) {
  MXMLA_REQUIRE_GPU();
  if (!build_info().cuda_rope) GTEST_SKIP() << "the CUDA RoPE kernel is off in this build (CMake MXMLA_CUDA_ROPE)";
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t S = 37, B = 2, H = 3, D = 192, R = 64, n = S * B * H * D;
  util::Rng rng(5);
  std::vector<float> xf(n), cf(S * B * R), sf(S * B * R);
  for (auto& v : xf) v = static_cast<float>(rng.normal() * 4);
  for (auto& v : cf) v = static_cast<float>(rng.normal());
  for (auto& v : sf) v = static_cast<float>(rng.normal());
  xf[5 * D + 130] = NAN;  // NaN propagates with one pattern on both sides
  for (RopeStyle st : {RopeStyle::kInterleavedInHalvesOut, RopeStyle::kInterleaved, RopeStyle::kRotateHalf})
    for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
      for (DType tt : {DType::kFloat32, DType::kBFloat16})
        for (RopeLayout l : {RopeLayout::kSBHD, RopeLayout::kBSHD, RopeLayout::kTHD})
          for (int bwd = 0; bwd < 2; ++bwd)
            for (int inplace = 0; inplace < 2; ++inplace) {
              RopeOptions o;
              o.style = st, o.layout = l, o.rope_dim = R, o.tables_per_token = (l == RopeLayout::kTHD);
              const std::vector<int64_t> shape = l == RopeLayout::kSBHD   ? std::vector<int64_t>{S, B, H, D}
                                                 : l == RopeLayout::kBSHD ? std::vector<int64_t>{B, S, H, D}
                                                                          : std::vector<int64_t>{S * B, H, D};
              const int64_t T = o.tables_per_token ? S * B : S;
              std::vector<uint8_t> x = test::encode(xf, dt), c = test::encode({cf.begin(), cf.begin() + T * R}, tt),
                                   s = test::encode({sf.begin(), sf.begin() + T * R}, tt);
              std::vector<uint8_t> ref(x.size(), 0xAB);
              TensorDesc rd(ref.data(), dt, shape);
              auto run = bwd ? rope_backward : apply_rope;
              run(TensorDesc(x.data(), dt, shape), TensorDesc(c.data(), tt, {T, R}), TensorDesc(s.data(), tt, {T, R}),
                  rd, o, nullptr, nullptr);
              util::DeviceBuffer dx(x.size()), dc(c.size()), ds(s.size()), dy(x.size());
              dx.upload(x.data()), dc.upload(c.data()), ds.upload(s.data());
              std::vector<uint8_t> poison(x.size(), 0xCD);
              dy.upload(poison.data());
              TensorDesc yd(inplace ? dx.ptr : dy.ptr, dt, shape, dev);
              run(TensorDesc(dx.ptr, dt, shape, dev), TensorDesc(dc.ptr, tt, {T, R}, dev),
                  TensorDesc(ds.ptr, tt, {T, R}, dev), yd, o, nullptr, nullptr);
              MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
              const auto got = (inplace ? dx : dy).download<uint8_t>();
              ASSERT_EQ(test::first_mismatch(got, ref), "")
                  << "style " << int(st) << " dtype " << dtype_name(dt) << " table " << dtype_name(tt) << " layout "
                  << int(l) << (bwd ? " backward" : " forward") << (inplace ? " in place" : "");
            }
}
#endif

}  // namespace
}  // namespace mxmla
