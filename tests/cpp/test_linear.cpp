// The MXFP8 Linear's GEMMs with fused quantization (include/mxmla/linear.h), on the CPU:
//   LinearCpu     linear_forward / linear_backward equal quantize + gemm bit for bit (y, x_saved's
//                 codes and scales, dx, dw, dw accumulated), token counts with tail blocks, a
//                 strided x, no dgrad; linear_backward of a ConcatInput equals it on the materialised dy,
//                 of a RopeGrad rope_backward_quantize + gemm;
//   LinearErrors  each rule names its argument.
// (The CUDA path against the unfused CUDA calls: tests/python/test_linear.py.)
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "mxmla/gemm.h"
#include "mxmla/linear.h"
#include "test_util.h"

namespace mxmla {
namespace {

uint16_t bf16_bits(float f) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// bf16 [rows, ld] with N(0, 1) values times a power of two per row; the matrix is its first cols.
struct Bf16 {
  std::vector<uint16_t> v;
  TensorDesc d;
  Bf16(int64_t rows, int64_t cols, int64_t ld, unsigned seed) : v(static_cast<size_t>(rows * ld)) {
    std::mt19937 g(seed);
    std::normal_distribution<float> n;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < ld; ++c) v[r * ld + c] = bf16_bits(n(g) * static_cast<float>(1 << (r % 5)) / 4.f);
    d = TensorDesc(v.data(), DType::kBFloat16, {rows, cols}, {}, {ld, 1});
  }
};

// Both copies of quantize(t) (compact scales, E4M3) in owned buffers.
struct Q {
  std::vector<uint8_t> rc, rs, cc, cs;
  MXFP8Tensor t;
  Q(const TensorDesc& in, bool rowwise = true, bool columnwise = true) {
    const MXFP8Shapes s = quantize_shapes(in.shape, false);
    rc.resize(numel(s.data)), rs.resize(numel(s.rowwise_scale)), cc.resize(numel(s.data));
    cs.resize(numel(s.columnwise_scale));
    if (rowwise) {
      t.rowwise_data = TensorDesc(rc.data(), DType::kUInt8, s.data);
      t.rowwise_scale_inv = TensorDesc(rs.data(), DType::kUInt8, s.rowwise_scale);
    }
    if (columnwise) {
      t.columnwise_data = TensorDesc(cc.data(), DType::kUInt8, s.data);
      t.columnwise_scale_inv = TensorDesc(cs.data(), DType::kUInt8, s.columnwise_scale);
    }
    QuantizeOptions o;
    o.rowwise = rowwise, o.columnwise = columnwise;
    quantize(in, t, o);
  }
};

template <typename T>
struct Mat {
  std::vector<T> v;
  TensorDesc d;
  Mat(int64_t rows, int64_t cols, DType dt, T fill = T{}) : v(static_cast<size_t>(rows * cols), fill) {
    d = TensorDesc(v.data(), dt, {rows, cols});
  }
};

struct LCase {
  int64_t T, K, N, ld_extra;
};

class LinearCpu : public ::testing::TestWithParam<LCase> {};

TEST_P(LinearCpu, EqualsQuantizeAndGemmBitForBit) {
  const LCase c = GetParam();
  const Bf16 x(c.T, c.K, c.K + c.ld_extra, 1), w(c.N, c.K, c.K, 2), dy(c.T, c.N, c.N, 3);
  const Q x8(x.d), w8(w.d), dy8(dy.d);
  // forward
  Mat<uint16_t> y(c.T, c.N, DType::kBFloat16), y0(c.T, c.N, DType::kBFloat16);
  const MXFP8Shapes s = quantize_shapes({c.T, c.K}, false);
  std::vector<uint8_t> sc(numel(s.data)), ss(numel(s.columnwise_scale));
  MXFP8Tensor saved;
  saved.columnwise_data = TensorDesc(sc.data(), DType::kUInt8, s.data);
  saved.columnwise_scale_inv = TensorDesc(ss.data(), DType::kUInt8, s.columnwise_scale);
  linear_forward(x.d, w8.t, y.d, saved);
  gemm({nullptr, &x8.t}, {nullptr, &w8.t}, y0.d, GemmOptions{});
  EXPECT_EQ(y.v, y0.v);
  EXPECT_EQ(sc, x8.cc);
  EXPECT_EQ(ss, x8.cs);
  EXPECT_FALSE(saved.has_rowwise());
  // backward
  Mat<uint16_t> dx(c.T, c.K, DType::kBFloat16), dx0(c.T, c.K, DType::kBFloat16);
  Mat<float> dw(c.N, c.K, DType::kFloat32), dw0(c.N, c.K, DType::kFloat32);
  linear_backward(dy.d, w8.t, saved, &dx.d, dw.d, false);
  GemmOptions dg;
  dg.trans_b = false;
  gemm({nullptr, &dy8.t}, {nullptr, &w8.t}, dx0.d, dg);
  GemmOptions wg;
  wg.trans_a = true, wg.trans_b = false;
  gemm({nullptr, &dy8.t}, {nullptr, &x8.t}, dw0.d, wg);
  EXPECT_EQ(dx.v, dx0.v);
  EXPECT_EQ(dw.v, dw0.v);
  // accumulate, no dgrad
  Mat<float> mg(c.N, c.K, DType::kFloat32, 0.5f), mg0(c.N, c.K, DType::kFloat32, 0.5f);
  linear_backward(dy.d, w8.t, saved, nullptr, mg.d, true);
  wg.accumulate = true;
  gemm({nullptr, &dy8.t}, {nullptr, &x8.t}, mg0.d, wg);
  EXPECT_EQ(mg.v, mg0.v);
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearCpu,
                         ::testing::Values(LCase{1, 32, 32, 0}, LCase{31, 64, 96, 0}, LCase{33, 96, 64, 32},
                                           LCase{100, 64, 32, 0}),
                         [](const ::testing::TestParamInfo<LCase>& i) {
                           const LCase& c = i.param;
                           return "T" + std::to_string(c.T) + "K" + std::to_string(c.K) + "N" + std::to_string(c.N) +
                                  (c.ld_extra ? "strided" : "");
                         });

// linear_backward of a ConcatInput (dy = cat([part0, part1], -1).flatten(-2), read in place): the bits of
// linear_backward on the materialised dy. MLA's kv_b gradient: part0 = dK[..., :nope] (a view of
// [T, h, nope + rope]), part1 = dV; T with a tail block, one and three heads.
TEST(LinearCpu, BackwardOfAConcatenationEqualsTheMaterialisedDy) {
  for (const int64_t T : {33, 1}) {
    for (const int64_t H : {3, 1}) {
      const int64_t NOPE = 32, ROPE = 16, V = 64, K = 64, N = H * (NOPE + V);
      const Bf16 dk(T * H, NOPE, NOPE + ROPE, 5), dv(T * H, V, V, 6), x(T, K, K, 7), w(N, K, K, 8);
      Mat<uint16_t> dy(T, N, DType::kBFloat16);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
          std::memcpy(&dy.v[t * N + h * (NOPE + V)], &dk.v[(t * H + h) * (NOPE + ROPE)], NOPE * 2);
          std::memcpy(&dy.v[t * N + h * (NOPE + V) + NOPE], &dv.v[(t * H + h) * V], V * 2);
        }
      const Q w8(w.d), x8(x.d, false, true);
      const ConcatInput parts{TensorDesc(const_cast<uint16_t*>(dk.v.data()), DType::kBFloat16, {T, H, NOPE}, {},
                                         {H * (NOPE + ROPE), NOPE + ROPE, 1}),
                              TensorDesc(const_cast<uint16_t*>(dv.v.data()), DType::kBFloat16, {T, H, V})};
      Mat<uint16_t> dx(T, K, DType::kBFloat16), dx0(T, K, DType::kBFloat16);
      Mat<float> dw(N, K, DType::kFloat32), dw0(N, K, DType::kFloat32);
      linear_backward(parts, w8.t, x8.t, &dx.d, dw.d, false);
      linear_backward(dy.d, w8.t, x8.t, &dx0.d, dw0.d, false);
      EXPECT_EQ(dx.v, dx0.v) << "T " << T << " h " << H;
      EXPECT_EQ(dw.v, dw0.v) << "T " << T << " h " << H;
    }
  }
}

// linear_backward of a RopeGrad (dy = the RoPE backward of dq, quantized as rope_backward_quantize
// quantizes it): the bits of rope_backward_quantize + gemm; sbhd with two sequences, a tail block,
// one and three heads; the wgrad accumulated.
TEST(LinearCpu, BackwardOfARopeGradEqualsRopeBackwardQuantizeAndGemm) {
  for (const int64_t S : {33, 1}) {
    for (const int64_t H : {3, 1}) {
      const int64_t B = 2, D = 64, R = 32, K = 32, T = S * B, N = H * D;
      const Bf16 dq(T * H, D, D, 9), x(T, K, K, 10), w(N, K, K, 11);
      std::vector<float> cos(static_cast<size_t>(S * R)), sin(cos.size());
      const TensorDesc cd(cos.data(), DType::kFloat32, {S, R}), sd(sin.data(), DType::kFloat32, {S, R});
      std::vector<double> pos(static_cast<size_t>(S));
      for (int64_t s = 0; s < S; ++s) pos[s] = static_cast<double>(s);
      TensorDesc cw = cd, sw = sd;
      rope_tables(pos, R, 10000.0, YarnParams{}, RopeStyle::kInterleaved, cw, sw);
      const TensorDesc dqd(const_cast<uint16_t*>(dq.v.data()), DType::kBFloat16, {S, B, H, D});
      RopeBackwardQuantizeOptions ro;
      ro.rope.style = RopeStyle::kInterleaved, ro.rope.layout = RopeLayout::kSBHD, ro.rope.rope_dim = R;
      const MXFP8Shapes s = quantize_shapes({T, N}, false);
      std::vector<uint8_t> rc(numel(s.data)), rs(numel(s.rowwise_scale)), cc(numel(s.data)), cs(numel(s.columnwise_scale));
      MXFP8Tensor dy8;
      dy8.rowwise_data = TensorDesc(rc.data(), DType::kUInt8, s.data);
      dy8.rowwise_scale_inv = TensorDesc(rs.data(), DType::kUInt8, s.rowwise_scale);
      dy8.columnwise_data = TensorDesc(cc.data(), DType::kUInt8, s.data);
      dy8.columnwise_scale_inv = TensorDesc(cs.data(), DType::kUInt8, s.columnwise_scale);
      rope_backward_quantize(dqd, cd, sd, dy8, nullptr, ro);
      const Q w8(w.d), x8(x.d, false, true);
      Mat<uint16_t> dx(T, K, DType::kBFloat16), dx0(T, K, DType::kBFloat16);
      Mat<float> dw(N, K, DType::kFloat32), dw0(N, K, DType::kFloat32), mg(N, K, DType::kFloat32, 0.5f),
          mg0(N, K, DType::kFloat32, 0.5f);
      const RopeGrad g{dqd, cd, sd, ro.rope, nullptr};
      linear_backward(g, w8.t, x8.t, &dx.d, dw.d, false);
      linear_backward(g, w8.t, x8.t, nullptr, mg.d, true);
      GemmOptions dg;
      dg.trans_b = false;
      gemm({nullptr, &dy8}, {nullptr, &w8.t}, dx0.d, dg);
      GemmOptions wg;
      wg.trans_a = true, wg.trans_b = false;
      gemm({nullptr, &dy8}, {nullptr, &x8.t}, dw0.d, wg);
      wg.accumulate = true;
      gemm({nullptr, &dy8}, {nullptr, &x8.t}, mg0.d, wg);
      EXPECT_EQ(dx.v, dx0.v) << "S " << S << " h " << H;
      EXPECT_EQ(dw.v, dw0.v) << "S " << S << " h " << H;
      EXPECT_EQ(mg.v, mg0.v) << "S " << S << " h " << H;
    }
  }
}

TEST(LinearErrors, EveryRuleNamesItsArgument) {
  const Bf16 x(8, 64, 64, 1), w(32, 64, 64, 2), dy(8, 32, 32, 3);
  const Q w8(w.d), w_row(w.d, true, false);
  Mat<uint16_t> y(8, 32, DType::kBFloat16);
  const MXFP8Shapes s = quantize_shapes({8, 64}, false);
  std::vector<uint8_t> sc(numel(s.data)), ss(numel(s.columnwise_scale));
  MXFP8Tensor saved;
  saved.columnwise_data = TensorDesc(sc.data(), DType::kUInt8, s.data);
  saved.columnwise_scale_inv = TensorDesc(ss.data(), DType::kUInt8, s.columnwise_scale);
  auto fwd_error = [](const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
    test::expect_error("mxmla.linear_forward", fn, arg, rule);
  };
  auto bwd_error = [](const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
    test::expect_error("mxmla.linear_backward", fn, arg, rule);
  };
  fwd_error([&] {
    TensorDesc xf = x.d;
    xf.dtype = DType::kFloat32;
    linear_forward(xf, w8.t, y.d, saved);
  }, "x", "dtype float32 must be bfloat16");
  fwd_error([&] {
    TensorDesc xs = x.d;
    xs.shape = {8, 48};
    linear_forward(xs, w8.t, y.d, saved);
  }, "x", "last dimension 48 (K) must be a positive multiple of 32");
  fwd_error([&] {
    TensorDesc ys = y.d;
    ys.shape = {8, 31};
    linear_forward(x.d, w8.t, ys, saved);
  }, "y", "shape [8, 31] must be [8, 32]");
  fwd_error([&] {
    MXFP8Tensor bad = saved;
    bad.columnwise_scale_inv.shape = {1, 63};
    linear_forward(x.d, w8.t, y.d, bad);
  }, "columnwise_scale_inv", "");
  linear_forward(x.d, w8.t, y.d, saved);
  Mat<float> dw(32, 64, DType::kFloat32);
  Mat<uint16_t> dwb(32, 64, DType::kBFloat16);
  bwd_error([&] { linear_backward(dy.d, w_row.t, saved, nullptr, dw.d, false); }, "w.columnwise_data",
            "is absent: mxmla.linear_backward reads its columnwise copy");
  bwd_error([&] { linear_backward(dy.d, w8.t, saved, nullptr, dwb.d, true); }, "dw",
            "dtype bfloat16 must be float32 with accumulate");
  bwd_error([&] {
    const Bf16 dy9(9, 32, 32, 4);
    linear_backward(dy9.d, w8.t, saved, nullptr, dw.d, false);
  }, "x_saved", "shape [8, 64] must be [T, K] = [9, 64]");
  // dy as a ConcatInput: 3-D bf16 parts [T, h, d_i] whose widths add up to w's N
  std::vector<uint16_t> p(8 * 2 * 16, 0);
  auto part = [&](int64_t d, DType t = DType::kBFloat16) { return TensorDesc(p.data(), t, {8, 2, d}); };
  bwd_error([&] { linear_backward(ConcatInput{part(8, DType::kFloat32), part(8)}, w8.t, saved, nullptr, dw.d, false); },
            "dy.part0", "dtype float32 must be bfloat16");
  bwd_error([&] { linear_backward(ConcatInput{part(4), part(12)}, w8.t, saved, nullptr, dw.d, false); }, "dy.part0",
            "must be a multiple of 8");
  bwd_error([&] {
    linear_backward(ConcatInput{TensorDesc(p.data(), DType::kBFloat16, {8, 32}), part(8)}, w8.t, saved, nullptr, dw.d,
                    false);
  }, "dy.part0", "must be 3-D");
  bwd_error([&] { linear_backward(ConcatInput{part(8), part(24)}, w8.t, saved, nullptr, dw.d, false); }, "w",
            "must be [N, K] with N = 64");
}

}  // namespace
}  // namespace mxmla
