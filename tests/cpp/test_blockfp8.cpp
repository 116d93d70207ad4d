// Block FP8 (include/mxmla/blockfp8.h, docs/spec.md §4.1) on the CPU: the scale rule's edges, the
// quantization of hand-checked values (and transposed), the fused Q up-projection on block-FP8
// operands against the bf16 op on the dequantized operands (power-of-two scales: exact in bf16),
// the block-FP8 GEMM by hand, and errors. The CUDA kernels are checked against this reference in
// tests/python/test_blockfp8.py and test_blockfp8_gemm.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
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

// Quantizing with transpose gives the bits of quantizing a contiguous copy of the transpose, for
// both block shapes, on adversarial values (zero blocks, NaN, Inf, denormals) and tails.
TEST(BlockFp8Cpu, TransposedQuantizationIsTheQuantizationOfTheTranspose) {
  for (int64_t br : {1, 128})
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {130, 257}, {257, 129}}) {
      std::vector<float> x = test::make_data(rows, cols, test::Data::kAdversarial, uint64_t(rows + cols + br));
      std::vector<float> xt(x.size());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
      const std::vector<int64_t> ss = block_scale_shape(cols, rows, br);
      std::vector<uint8_t> c1(x.size()), c2(x.size());
      std::vector<float> s1(ss[0] * ss[1]), s2(s1.size());
      BlockQuantizeOptions o;
      o.block_rows = br, o.transpose = true;
      BlockFP8Tensor t1{TensorDesc(c1.data(), DType::kFloat8E4M3, {cols, rows}), TensorDesc(s1.data(), DType::kFloat32, ss), 0};
      quantize_blockwise(TensorDesc(x.data(), DType::kFloat32, {rows, cols}), t1, o);
      o.transpose = false;
      BlockFP8Tensor t2{TensorDesc(c2.data(), DType::kFloat8E4M3, {cols, rows}), TensorDesc(s2.data(), DType::kFloat32, ss), 0};
      quantize_blockwise(TensorDesc(xt.data(), DType::kFloat32, {cols, rows}), t2, o);
      EXPECT_EQ(c1, c2) << br << " " << rows << "x" << cols;
      EXPECT_EQ(0, std::memcmp(s1.data(), s2.data(), s1.size() * 4)) << br << " " << rows << "x" << cols;
    }
}

// The two-output call writes the bits of the two one-direction calls; its own rules name the argument.
TEST(BlockFp8Cpu, BothDirectionsAreTheTwoQuantizations) {
  const int64_t rows = 130, cols = 257;
  std::vector<float> x = test::make_data(rows, cols, test::Data::kAdversarial, 99);
  const TensorDesc in(x.data(), DType::kFloat32, {rows, cols});
  for (int64_t br : {1, 128}) {
    const std::vector<int64_t> ss = block_scale_shape(rows, cols, br), sst = block_scale_shape(cols, rows, br);
    std::vector<uint8_t> c(x.size()), ct(x.size()), r(x.size()), rt(x.size());
    std::vector<float> s(ss[0] * ss[1]), st(sst[0] * sst[1]), q(s.size()), qt(st.size());
    BlockQuantizeOptions o;
    o.block_rows = br;
    BlockFP8Tensor a{TensorDesc(c.data(), DType::kUInt8, {rows, cols}), TensorDesc(s.data(), DType::kFloat32, ss), 0};
    BlockFP8Tensor at{TensorDesc(ct.data(), DType::kUInt8, {cols, rows}), TensorDesc(st.data(), DType::kFloat32, sst), 0};
    quantize_blockwise(in, a, at, o);
    EXPECT_EQ(a.block_rows, br);
    EXPECT_EQ(at.block_rows, br);
    BlockFP8Tensor b{TensorDesc(r.data(), DType::kUInt8, {rows, cols}), TensorDesc(q.data(), DType::kFloat32, ss), 0};
    quantize_blockwise(in, b, o);
    o.transpose = true;
    BlockFP8Tensor bt{TensorDesc(rt.data(), DType::kUInt8, {cols, rows}), TensorDesc(qt.data(), DType::kFloat32, sst), 0};
    quantize_blockwise(in, bt, o);
    EXPECT_EQ(c, r) << br;
    EXPECT_EQ(ct, rt) << br;
    EXPECT_EQ(0, std::memcmp(s.data(), q.data(), s.size() * 4)) << br;
    EXPECT_EQ(0, std::memcmp(st.data(), qt.data(), st.size() * 4)) << br;
    test::expect_error("mxmla.quantize_blockwise", [&] { quantize_blockwise(in, a, at, o); }, "transpose",
                       "must be false");
    o.transpose = false;
    BlockFP8Tensor wrong{TensorDesc(ct.data(), DType::kUInt8, {rows, cols}), at.scale_inv, 0};
    test::expect_error("mxmla.quantize_blockwise", [&] { quantize_blockwise(in, a, wrong, o); }, "t.data",
                       "the input's shape transposed");
  }
}

// The block-FP8 GEMM by hand: A [2, 256] with 1 x 128 blocks, B [3, 256] with 1 x 128 blocks (then
// as 128 x 128), codes 1.0 (0x38) and 2.0 (0x40), scale_inv powers of two: D is a sum of four
// products per element, checked in closed form; alpha, accumulate and an fp32 out with a row stride.
TEST(BlockFp8Cpu, GemmByHand) {
  const int64_t M = 2, N = 3, K = 256;
  std::vector<uint8_t> a(M * K, 0x38), b(N * K, 0x40);  // a = 1.0, b = 2.0
  std::vector<float> sa = {0.5f, 2.f, 1.f, 4.f}, sb1 = {1.f, 0.25f, 2.f, 1.f, 8.f, 0.5f}, sb128 = {4.f, 1.f};
  std::vector<float> out(M * 5, -7.f);
  TensorDesc od(out.data(), DType::kFloat32, {M, N}, Device{}, {5, 1});
  const BlockFP8Tensor A{TensorDesc(a.data(), DType::kFloat8E4M3, {M, K}), TensorDesc(sa.data(), DType::kFloat32, {M, 2}), 1};
  BlockFP8Tensor B{TensorDesc(b.data(), DType::kFloat8E4M3, {N, K}), TensorDesc(sb1.data(), DType::kFloat32, {N, 2}), 1};
  GemmOptions g;
  g.alpha = 0.5;
  gemm(A, B, od, g);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)  // each block: 128 products of 1 * 2
      EXPECT_EQ(out[m * 5 + n], 0.5f * 256.f * (sa[m * 2] * sb1[n * 2] + sa[m * 2 + 1] * sb1[n * 2 + 1])) << m << n;
  EXPECT_EQ(out[3], -7.f);  // past N: untouched
  B.scale_inv = TensorDesc(sb128.data(), DType::kFloat32, {1, 2}), B.block_rows = 128;
  g.alpha = 1.0, g.accumulate = true;
  const std::vector<float> before = out;
  gemm(A, B, od, g);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      EXPECT_EQ(out[m * 5 + n], before[m * 5 + n] + 256.f * (sa[m * 2] * 4.f + sa[m * 2 + 1] * 1.f)) << m << n;
}

TEST(BlockFp8Errors, GemmNamesTheArgument) {
  std::vector<uint8_t> a(4 * 256), b(8 * 256);
  std::vector<float> sa(8), sb(16), out(32);
  const BlockFP8Tensor A{TensorDesc(a.data(), DType::kFloat8E4M3, {4, 256}), TensorDesc(sa.data(), DType::kFloat32, {4, 2}), 1};
  const BlockFP8Tensor B{TensorDesc(b.data(), DType::kFloat8E4M3, {8, 256}), TensorDesc(sb.data(), DType::kFloat32, {8, 2}), 1};
  auto call = [&](BlockFP8Tensor x, BlockFP8Tensor y, TensorDesc o, GemmOptions g) {
    return [=]() mutable { gemm(x, y, o, g); };
  };
  const TensorDesc o32(out.data(), DType::kFloat32, {4, 8}), o16(out.data(), DType::kBFloat16, {4, 8});
  EXPECT_NO_THROW(call(A, B, o32, {})());
  GemmOptions ta;
  ta.trans_a = true;
  test::expect_error("mxmla.gemm", call(A, B, o32, ta), "trans_a", "K-major");
  GemmOptions tb;
  tb.trans_b = false;
  test::expect_error("mxmla.gemm", call(A, B, o32, tb), "trans_b", "K-major");
  GemmOptions acc;
  acc.accumulate = true;
  test::expect_error("mxmla.gemm", call(A, B, o16, acc), "out", "must be float32 with accumulate");
  test::expect_error("mxmla.gemm", call(A, B, TensorDesc(out.data(), DType::kFloat32, {4, 4}), {}), "out", "must be [M, N]");
  BlockFP8Tensor b2 = B;
  b2.data.shape = {8, 128}, b2.scale_inv.shape = {8, 1};
  test::expect_error("mxmla.gemm", call(A, b2, o32, {}), "b.data", "does not match a's K");
  BlockFP8Tensor b3 = B;
  b3.block_rows = 128;
  test::expect_error("mxmla.gemm", call(A, b3, o32, {}), "b.scale_inv", "must be [1, 2]");
  BlockFP8Tensor a4 = A;
  a4.block_rows = 32;
  test::expect_error("mxmla.gemm", call(a4, B, o32, {}), "a.block_rows", "must be 1");
  BlockFP8Tensor a5 = A;
  a5.data.dtype = DType::kBFloat16;
  test::expect_error("mxmla.gemm", call(a5, B, o32, {}), "a.data", "must be float8_e4m3fn");
}

}  // namespace
}  // namespace mxmla
