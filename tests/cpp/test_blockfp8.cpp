// Block FP8 (include/mxmla/blockfp8.h, docs/spec.md §4.1) on the CPU: the scale rule's edges, the
// quantization of hand-checked values, the fused Q up-projection on block-FP8 operands against the
// bf16 op on the dequantized operands (power-of-two scales: exact in bf16), and errors. The CUDA
// kernels are checked against this reference in tests/python/test_blockfp8.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/blockfp8_common.h"
#include "cpu/reference.h"
#include "mxmla/blockfp8.h"
#include "test_util.h"

namespace mxmla {
namespace {

using detail::block_fp8_scale;

TEST(BlockFp8Cpu, ScaleRuleEdges) {
  EXPECT_EQ(block_fp8_scale(0.f, true), 1.f);
  EXPECT_EQ(block_fp8_scale(std::numeric_limits<float>::infinity(), false), 1.f);
  EXPECT_EQ(block_fp8_scale(448.f, true), 1.f);
  EXPECT_EQ(block_fp8_scale(3.f, true), 128.f);          // 149.33 rounded down to a power of two
  EXPECT_EQ(block_fp8_scale(3.f, false), 448.f / 3.f);   // fp32 quotient
  EXPECT_EQ(block_fp8_scale(1e-40f, false), std::numeric_limits<float>::max());  // overflow
  EXPECT_EQ(block_fp8_scale(1e-40f, true), std::ldexp(1.f, 127));
  EXPECT_EQ(block_fp8_scale(1000.f, true), 0.25f);       // 0.448 -> 0.25
}

TEST(BlockFp8Cpu, QuantizesHandCheckedValues) {
  // one row of 130 values: block 0 amax 7 (scale 64), block 1 = {-0.5, NaN} (amax 0.5, scale 512)
  std::vector<float> x(130, 0.f);
  x[0] = 7.f, x[1] = -3.f, x[2] = 0.01f, x[128] = -0.5f, x[129] = std::nanf("");
  std::vector<uint8_t> codes(130, 0xAB);
  std::vector<float> si(2, -1.f);
  BlockFP8Tensor t{TensorDesc(codes.data(), DType::kFloat8E4M3, {1, 130}), TensorDesc(si.data(), DType::kFloat32, {1, 2}),
                   0};
  quantize_blockwise(TensorDesc(x.data(), DType::kFloat32, {1, 130}), t, BlockQuantizeOptions{});
  EXPECT_EQ(t.block_rows, 1);
  EXPECT_EQ(si[0], 1.f / 64.f);
  EXPECT_EQ(si[1], 1.f / 512.f);
  EXPECT_EQ(codes[0], ref::round_to_fp8(448.0, Fp8Format::kE4M3));
  EXPECT_EQ(codes[1], ref::round_to_fp8(-192.0, Fp8Format::kE4M3));
  EXPECT_EQ(codes[2], ref::round_to_fp8(double(0.01f * 64.f), Fp8Format::kE4M3));
  EXPECT_EQ(codes[3], 0x00);
  EXPECT_EQ(codes[128], ref::round_to_fp8(-256.0, Fp8Format::kE4M3));
  EXPECT_EQ(codes[129], 0x7F);
}

// x [T, K], W [N, K] bf16 -> both paths of the fused op; the block-FP8 one on quantize_blockwise of
// them (power-of-two scales), the bf16 one on their dequantized values (exact in bf16).
TEST(BlockFp8Cpu, FusedOpEqualsTheBf16OpOnDequantizedOperands) {
  const int64_t T = 37, NH = 2, K = 200, N = NH * 192;
  std::vector<float> xf = test::make_data(T, K, test::Data::kRandom, 11), wf = test::make_data(N, K, test::Data::kRandom, 12);
  std::vector<float> cs(T * 64), sn(T * 64);
  for (int64_t i = 0; i < T * 64; ++i) cs[i] = std::cos(0.01f * float(i)), sn[i] = std::sin(0.01f * float(i));
  auto block = [](std::vector<float>& v, int64_t rows, int64_t cols, int64_t br, std::vector<uint8_t>& c,
                  std::vector<float>& s) {
    c.assign(size_t(rows * cols), 0);
    const std::vector<int64_t> ss = block_scale_shape(rows, cols, br);
    s.assign(size_t(ss[0] * ss[1]), 0.f);
    BlockFP8Tensor t{TensorDesc(c.data(), DType::kUInt8, {rows, cols}), TensorDesc(s.data(), DType::kFloat32, ss), br};
    BlockQuantizeOptions o;
    o.block_rows = br;
    quantize_blockwise(TensorDesc(v.data(), DType::kFloat32, {rows, cols}), t, o);
    std::vector<uint16_t> deq(size_t(rows * cols));  // code * scale_inv, exact in bf16
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k) {
        const double d = ref::fp8_to_double(c[r * cols + k], Fp8Format::kE4M3) * s[(r / br) * ss[1] + k / 128];
        deq[r * cols + k] = ref::double_to_bf16(d);
        EXPECT_EQ(ref::bf16_to_double(deq[r * cols + k]), d);
      }
    return std::pair{t, deq};
  };
  std::vector<uint8_t> xc, wc;
  std::vector<float> xs, ws;
  auto [xb, xd] = block(xf, T, K, 1, xc, xs);
  auto [wb, wd] = block(wf, N, K, 128, wc, ws);
  QProjOptions o;
  const MXFP8Shapes sh = qproj_shapes(T, NH, o);
  test::HostQ a = test::alloc_host(sh, true, true), b = test::alloc_host(sh, true, true);
  const TensorDesc c(cs.data(), DType::kFloat32, {T, 64}), s(sn.data(), DType::kFloat32, {T, 64});
  fused_q_uproj_rope_quant(xb, wb, c, s, a.t, nullptr, o);
  fused_q_uproj_rope_quant(TensorDesc(xd.data(), DType::kBFloat16, {T, K}), TensorDesc(wd.data(), DType::kBFloat16, {N, K}),
                           c, s, b.t, nullptr, o);
  EXPECT_EQ(test::first_mismatch(a.row, b.row), "");
  EXPECT_EQ(test::first_mismatch(a.rs, b.rs), "");
  EXPECT_EQ(test::first_mismatch(a.col, b.col), "");
  EXPECT_EQ(test::first_mismatch(a.cs, b.cs), "");
}

TEST(BlockFp8Errors, BadInputsNameTheArgument) {
  std::vector<float> x(8 * 256, 1.f), cs(8 * 64, 1.f);
  std::vector<uint8_t> c(192 * 256);
  std::vector<float> s(64);
  const TensorDesc in(x.data(), DType::kFloat32, {8, 256});
  auto quant = [&](TensorDesc data, TensorDesc scale, int64_t br) {
    return [=]() mutable {
      BlockFP8Tensor t{data, scale, 0};
      BlockQuantizeOptions o;
      o.block_rows = br;
      quantize_blockwise(in, t, o);
    };
  };
  const TensorDesc d8(c.data(), DType::kFloat8E4M3, {8, 256});
  test::expect_error("mxmla.quantize_blockwise", quant(d8, TensorDesc(s.data(), DType::kFloat32, {8, 2}), 32), "block_rows",
                     "must be 1");
  test::expect_error("mxmla.quantize_blockwise", quant(d8, TensorDesc(s.data(), DType::kFloat32, {8, 3}), 1), "scale_inv",
                     "must be [8, 2]");
  test::expect_error("mxmla.quantize_blockwise", quant(d8, TensorDesc(s.data(), DType::kE8M0, {8, 2}), 1), "scale_inv",
                     "must be float32");
  test::expect_error("mxmla.quantize_blockwise",
                     quant(TensorDesc(c.data(), DType::kFloat8E4M3, {8, 128}), TensorDesc(s.data(), DType::kFloat32, {8, 2}), 1),
                     "data", "must be [8, 256]");
  // the fused op: block shapes, K, weight layout
  QProjOptions o;
  const MXFP8Shapes sh = qproj_shapes(8, 1, o);
  test::HostQ h = test::alloc_host(sh, true, true);
  const TensorDesc cc(cs.data(), DType::kFloat32, {8, 64});
  std::vector<float> xs(8 * 2), ws(2 * 2);
  const BlockFP8Tensor xb{d8, TensorDesc(xs.data(), DType::kFloat32, {8, 2}), 1};
  const BlockFP8Tensor wb{TensorDesc(c.data(), DType::kFloat8E4M3, {192, 256}), TensorDesc(ws.data(), DType::kFloat32, {2, 2}), 128};
  auto fused = [&](BlockFP8Tensor xx, BlockFP8Tensor ww, QProjOptions oo) {
    return [=, &h]() mutable { fused_q_uproj_rope_quant(xx, ww, cc, cc, h.t, nullptr, oo); };
  };
  EXPECT_NO_THROW(fused(xb, wb, o)());
  BlockFP8Tensor w1 = wb;
  w1.block_rows = 1;
  test::expect_error("mxmla.fused_q_uproj_rope_quant", fused(xb, w1, o), "w.block_rows", "must be 128");
  BlockFP8Tensor w2 = wb;
  w2.scale_inv.shape = {1, 2};
  test::expect_error("mxmla.fused_q_uproj_rope_quant", fused(xb, w2, o), "w.scale_inv", "must be [2, 2]");
  BlockFP8Tensor w3 = wb;
  w3.data.shape = {192, 128}, w3.scale_inv.shape = {2, 1};
  test::expect_error("mxmla.fused_q_uproj_rope_quant", fused(xb, w3, o), "w", "does not match K");
  QProjOptions kn = o;
  kn.weight_layout = WeightLayout::kKN;
  test::expect_error("mxmla.fused_q_uproj_rope_quant", fused(xb, wb, kn), "weight_layout", "must be nk");
}

}  // namespace
}  // namespace mxmla
