// Quantization suites: CUDA kernels against the CPU reference, bit for bit (GPU tests skip with a
// message where no GPU is visible), and CPU-side consistency properties that need no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <tuple>

#include "test_util.h"

namespace mxmla {
namespace {

using test::Data;
using test::HostQ;


void expect_same(const HostQ& gpu, const HostQ& cpu, const std::string& what) {
  EXPECT_EQ(test::first_mismatch(gpu.row, cpu.row), "") << what << ": rowwise codes";
  EXPECT_EQ(test::first_mismatch(gpu.rs, cpu.rs), "") << what << ": rowwise scales";
  EXPECT_EQ(test::first_mismatch(gpu.col, cpu.col), "") << what << ": columnwise codes";
  EXPECT_EQ(test::first_mismatch(gpu.cs, cpu.cs), "") << what << ": columnwise scales";
}

// ------------------------------------------------------------------ plain quantize, GPU vs CPU
struct Shape2 {
  int64_t M, K;
};
using QuantParam = std::tuple<DType, Fp8Format, Data, Shape2, int /*dirs: 1 row, 2 col, 3 both*/, bool /*swizzle*/>;

class QuantizeGpu : public ::testing::TestWithParam<QuantParam> {};

TEST_P(QuantizeGpu, MatchesReferenceBitExact) {
  MXMLA_REQUIRE_GPU();
  const auto [dtype, fmt, data, shape, dirs, swizzle] = GetParam();
  const bool rw = dirs & 1, cw = dirs & 2;
  const std::vector<float> x = test::make_data(shape.M, shape.K, data, shape.M * 7 + shape.K);
  const std::vector<uint8_t> in = test::encode(x, dtype);
  const TensorDesc in_host(const_cast<uint8_t*>(in.data()), dtype, {shape.M, shape.K});
  QuantizeOptions o;
  o.rowwise = rw, o.columnwise = cw, o.format = fmt, o.swizzle = swizzle;
  const MXFP8Shapes s = quantize_shapes({shape.M, shape.K}, swizzle);
  HostQ cpu = test::alloc_host(s, rw, cw);
  quantize(in_host, cpu.t, o);
  HostQ gpu = test::quantize_on_gpu(in, in_host, s, rw, cw, false, o, {});
  expect_same(gpu, cpu, "quantize");
}

std::string quant_name(const ::testing::TestParamInfo<QuantParam>& info) {
  const auto [dtype, fmt, data, shape, dirs, swizzle] = info.param;
  return std::string(dtype_name(dtype)) + (fmt == Fp8Format::kE4M3 ? "_e4m3_" : "_e5m2_") +
         (data == Data::kRandom ? "rand_" : "adv_") + std::to_string(shape.M) + "x" + std::to_string(shape.K) +
         (dirs == 3 ? "_both" : dirs == 1 ? "_row" : "_col") + (swizzle ? "_swz" : "_compact");
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantizeGpu,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32),
                                            ::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                                            ::testing::Values(Data::kRandom, Data::kAdversarial),
                                            ::testing::Values(Shape2{1, 32}, Shape2{31, 64}, Shape2{33, 96},
                                                              Shape2{128, 256}, Shape2{300, 2080}, Shape2{4097, 32}),
                                            ::testing::Values(3), ::testing::Values(false, true)),
                         quant_name);
INSTANTIATE_TEST_SUITE_P(Directions, QuantizeGpu,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat32),
                                            ::testing::Values(Fp8Format::kE4M3), ::testing::Values(Data::kAdversarial),
                                            ::testing::Values(Shape2{65, 544}, Shape2{256, 1024}),
                                            ::testing::Values(1, 2), ::testing::Values(false, true)),
                         quant_name);

// ------------------------------------------------------------------ strided input
// x is a [2, M, K] view with rows of pitch P > K (a column slice of a wider tensor).
struct Strided {
  std::vector<uint8_t> buf;
  TensorDesc desc;
};
Strided make_strided(DType t, int64_t B, int64_t M, int64_t K, int64_t P) {
  const std::vector<float> wide = test::make_data(B * M, P, Data::kAdversarial, 99);
  Strided s;
  s.buf = test::encode(wide, t);
  // skip the first 32 columns: data starts at element 32 (64 or 128 bytes: still 16-byte aligned)
  s.desc = TensorDesc(s.buf.data() + 32 * dtype_size(t), t, {B, M, K}, Device{}, {M * P, P, 1});
  return s;
}

TEST(QuantizeStrided, CpuStridedEqualsContiguousCopy) {
  const int64_t B = 2, M = 45, K = 96, P = 160;
  Strided s = make_strided(DType::kBFloat16, B, M, K, P);
  std::vector<uint8_t> packed(B * M * K * 2);
  for (int64_t r = 0; r < B * M; ++r) std::memcpy(&packed[r * K * 2], &s.buf[(r * P + 32) * 2], K * 2);
  const MXFP8Shapes shp = quantize_shapes({B, M, K}, false);
  HostQ a = test::alloc_host(shp, true, true), b = test::alloc_host(shp, true, true);
  quantize(s.desc, a.t, QuantizeOptions{});
  quantize(TensorDesc(packed.data(), DType::kBFloat16, {B, M, K}), b.t, QuantizeOptions{});
  expect_same(a, b, "strided vs contiguous");
}

TEST(QuantizeStrided, GpuMatchesReference) {
  MXMLA_REQUIRE_GPU();
  for (DType t : {DType::kBFloat16, DType::kFloat32}) {
    Strided s = make_strided(t, 2, 45, 96, 160);
    const MXFP8Shapes shp = quantize_shapes({2, 45, 96}, true);
    QuantizeOptions o;
    o.swizzle = true;
    HostQ cpu = test::alloc_host(shp, true, true);
    quantize(s.desc, cpu.t, o);
    HostQ gpu = test::quantize_on_gpu(s.buf, s.desc, shp, true, true, false, o, {});
    expect_same(gpu, cpu, dtype_name(t));
  }
}

// ------------------------------------------------------------------ attention hand-off
struct AttnShape {
  int64_t S, B, H, D;
};
using AttnParam = std::tuple<QKVLayout, AttnShape, bool /*bhsd (fused)*/>;
class AttentionGpu : public ::testing::TestWithParam<AttnParam> {};

std::vector<int64_t> attn_dims(QKVLayout l, const AttnShape& a) {
  return l == QKVLayout::kSBHD ? std::vector<int64_t>{a.S, a.B, a.H, a.D} : std::vector<int64_t>{a.B, a.S, a.H, a.D};
}

TEST_P(AttentionGpu, MatchesReferenceBitExact) {
  MXMLA_REQUIRE_GPU();
  const auto [layout, a, bhsd] = GetParam();
  const std::vector<int64_t> dims = attn_dims(layout, a);
  const std::vector<float> x = test::make_data(a.S * a.B * a.H, a.D, Data::kAdversarial, a.S + a.D);
  const std::vector<uint8_t> in = test::encode(x, DType::kBFloat16);
  const TensorDesc in_host(const_cast<uint8_t*>(in.data()), DType::kBFloat16, dims);
  AttentionQuantizeOptions o;
  o.layout = layout, o.bhsd_scales = bhsd;
  const MXFP8Shapes s = attention_shapes(dims, layout, bhsd);
  HostQ cpu = test::alloc_host(s, true, true);
  quantize_attention(in_host, cpu.t, o);
  HostQ gpu = test::quantize_on_gpu(in, in_host, s, true, true, true, {}, o);
  expect_same(gpu, cpu, "quantize_attention");
}

std::string attn_name(const ::testing::TestParamInfo<AttnParam>& info) {
  const QKVLayout layout = std::get<0>(info.param);
  const AttnShape a = std::get<1>(info.param);
  return std::string(layout == QKVLayout::kSBHD ? "sbhd_" : "bshd_") + "s" + std::to_string(a.S) + "_b" +
         std::to_string(a.B) + "_h" + std::to_string(a.H) + "_d" + std::to_string(a.D) +
         (std::get<2>(info.param) ? "_fused" : "_compact");
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, AttentionGpu,
    ::testing::Combine(::testing::Values(QKVLayout::kSBHD, QKVLayout::kBSHD),
                       ::testing::Values(AttnShape{33, 2, 3, 192}, AttnShape{128, 1, 1, 128}, AttnShape{300, 3, 2, 64},
                                         AttnShape{1, 2, 1, 32}, AttnShape{257, 2, 16, 192}),
                       ::testing::Values(true, false)),
    attn_name);

// BHSD scales do not depend on the token-major layout: quantize the same Q as sbhd and as bshd.
TEST(AttentionCpu, BhsdScalesIndependentOfLayout) {
  const AttnShape a{70, 3, 2, 192};
  const std::vector<float> sb = test::make_data(a.S * a.B * a.H, a.D, Data::kRandom, 5);  // [s, b, h, d]
  std::vector<float> bs(sb.size());                                                          // [b, s, h, d]
  for (int64_t s = 0; s < a.S; ++s)
    for (int64_t b = 0; b < a.B; ++b)
      std::memcpy(&bs[((b * a.S + s) * a.H) * a.D], &sb[((s * a.B + b) * a.H) * a.D], a.H * a.D * sizeof(float));
  HostQ q[2];
  for (int i = 0; i < 2; ++i) {
    const QKVLayout l = i ? QKVLayout::kBSHD : QKVLayout::kSBHD;
    const auto dims = attn_dims(l, a);
    AttentionQuantizeOptions o;
    o.layout = l;
    q[i] = test::alloc_host(attention_shapes(dims, l, true), true, true);
    quantize_attention(TensorDesc(const_cast<float*>(i ? bs.data() : sb.data()), DType::kFloat32, dims), q[i].t, o);
  }
  EXPECT_EQ(test::first_mismatch(q[0].rs, q[1].rs), "");
  EXPECT_EQ(test::first_mismatch(q[0].cs, q[1].cs), "");
}

// Columnwise blocks stay inside each sequence (b > 1, s not a multiple of 32): the bshd result for
// sequence b equals a plain quantize of that sequence's [s, h*d] matrix.
TEST(AttentionCpu, ColumnwiseBlocksStayInsideSequences) {
  const AttnShape a{45, 3, 2, 64};
  const std::vector<float> x = test::make_data(a.B * a.S * a.H, a.D, Data::kRandom, 8);  // [b, s, h, d]
  AttentionQuantizeOptions o;
  o.layout = QKVLayout::kBSHD, o.bhsd_scales = false;
  const auto dims = attn_dims(o.layout, a);
  HostQ q = test::alloc_host(attention_shapes(dims, o.layout, false), false, true);
  o.rowwise = false;
  quantize_attention(TensorDesc(const_cast<float*>(x.data()), DType::kFloat32, dims), q.t, o);
  const int64_t cols = a.H * a.D, nrb = (a.S + 31) / 32;
  for (int64_t b = 0; b < a.B; ++b) {
    QuantizeOptions po;
    po.rowwise = false;
    HostQ p = test::alloc_host(quantize_shapes({a.S, cols}, false), false, true);
    quantize(TensorDesc(const_cast<float*>(x.data() + b * a.S * cols), DType::kFloat32, {a.S, cols}), p.t, po);
    EXPECT_TRUE(std::equal(p.col.begin(), p.col.end(), q.col.begin() + b * a.S * cols)) << "codes of sequence " << b;
    EXPECT_TRUE(std::equal(p.cs.begin(), p.cs.end(), q.cs.begin() + b * nrb * cols)) << "scales of sequence " << b;
  }
}

// Inputs read in place (ConcatInput, strided heads): the same bytes as quantize_attention of the
// materialised tensor. MLA's K: [k_nope (a view of a [.., h, nope + v] projection output) | k_pe
// shared by the heads (head stride 0)]; V: the other view. Both layouts, both scale layouts, a tail.
class AttentionConcatCpu : public ::testing::TestWithParam<std::tuple<QKVLayout, bool>> {};

TEST_P(AttentionConcatCpu, EqualsTheMaterialisedTensor) {
  const auto [layout, bhsd] = GetParam();
  const int64_t S = 37, B = 2, H = 3, NOPE = 128, ROPE = 64, V = 128, W = NOPE + V;
  const std::vector<float> kv = test::make_data(S * B * H, W, Data::kAdversarial, 21);  // [s|b, b|s, h, W]
  const std::vector<float> pe = test::make_data(S * B, ROPE, Data::kRandom, 22);        // [s|b, b|s, 1, ROPE]
  const int64_t L0 = layout == QKVLayout::kSBHD ? S : B, L1 = layout == QKVLayout::kSBHD ? B : S;
  std::vector<float> k(L0 * L1 * H * (NOPE + ROPE)), v(L0 * L1 * H * V);  // materialised K and V
  for (int64_t t = 0; t < L0 * L1; ++t)
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(&k[(t * H + h) * (NOPE + ROPE)], &kv[(t * H + h) * W], NOPE * sizeof(float));
      std::memcpy(&k[(t * H + h) * (NOPE + ROPE) + NOPE], &pe[t * ROPE], ROPE * sizeof(float));
      std::memcpy(&v[(t * H + h) * V], &kv[(t * H + h) * W + NOPE], V * sizeof(float));
    }
  auto* kvp = const_cast<float*>(kv.data());
  const ConcatInput kin{TensorDesc(kvp, DType::kFloat32, {L0, L1, H, NOPE}, Device{}, {L1 * H * W, H * W, W, 1}),
                        TensorDesc(const_cast<float*>(pe.data()), DType::kFloat32, {L0, L1, H, ROPE}, Device{},
                                   {L1 * ROPE, ROPE, 0, 1})};
  const TensorDesc vin(kvp + NOPE, DType::kFloat32, {L0, L1, H, V}, Device{}, {L1 * H * W, H * W, W, 1});
  AttentionQuantizeOptions o;
  o.layout = layout, o.bhsd_scales = bhsd;
  for (int which = 0; which < 2; ++which) {
    const int64_t D = which == 0 ? NOPE + ROPE : V;
    const MXFP8Shapes s = attention_shapes({L0, L1, H, D}, layout, bhsd);
    HostQ a = test::alloc_host(s, true, true), b = test::alloc_host(s, true, true);
    if (which == 0) quantize_attention(kin, a.t, o);
    else quantize_attention(vin, a.t, o);
    quantize_attention(TensorDesc(which == 0 ? k.data() : v.data(), DType::kFloat32, {L0, L1, H, D}), b.t, o);
    expect_same(a, b, which == 0 ? "K from its parts" : "V from its view");
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, AttentionConcatCpu,
                         ::testing::Combine(::testing::Values(QKVLayout::kSBHD, QKVLayout::kBSHD),
                                            ::testing::Values(true, false)));

TEST(AttentionConcatCpu, Errors) {
  std::vector<uint16_t> x(2 * 8 * 2 * 64, 0);
  AttentionQuantizeOptions o;
  o.layout = QKVLayout::kBSHD;
  HostQ q = test::alloc_host(attention_shapes({2, 8, 2, 64}, QKVLayout::kBSHD, true), true, true);
  auto part = [&](int64_t d, std::vector<int64_t> st = {}) {
    return st.empty() ? TensorDesc(x.data(), DType::kBFloat16, {2, 8, 2, d})
                      : TensorDesc(x.data(), DType::kBFloat16, {2, 8, 2, d}, Device{}, st);
  };
  test::expect_error("mxmla.quantize_attention", [&] { quantize_attention(ConcatInput{part(36), part(28)}, q.t, o); },
                     "input.part0", "multiple of 8");
  test::expect_error("mxmla.quantize_attention", [&] { quantize_attention(ConcatInput{part(32), part(8)}, q.t, o); },
                     "input", "multiple of 32");
  test::expect_error("mxmla.quantize_attention",
                     [&] { quantize_attention(ConcatInput{part(32), part(32, {512, 64, 32, 2})}, q.t, o); },
                     "input.part1", "last dimension must be contiguous");
  test::expect_error("mxmla.quantize_attention",
                     [&] { quantize_attention(ConcatInput{part(32), TensorDesc(x.data(), DType::kFloat32, {2, 8, 2, 32})}, q.t, o); },
                     "input.part1", "must be part0's");
  test::expect_error("mxmla.quantize_attention",
                     [&] { quantize_attention(ConcatInput{part(32, {512, -64, 32, 1}), part(32)}, q.t, o); },
                     "input.part0", "must not be negative");
}

// Two phases (compact, then attention_scales_to_bhsd) equal the fused result, on the CPU and the GPU.
TEST(AttentionCpu, TwoPhaseEqualsFused) {
  for (QKVLayout l : {QKVLayout::kSBHD, QKVLayout::kBSHD}) {
    const AttnShape a{100, 2, 3, 192};
    const auto dims = attn_dims(l, a);
    const std::vector<float> x = test::make_data(a.S * a.B * a.H, a.D, Data::kAdversarial, 11);
    const TensorDesc in(const_cast<float*>(x.data()), DType::kFloat32, dims);
    AttentionQuantizeOptions o;
    o.layout = l;
    HostQ fused = test::alloc_host(attention_shapes(dims, l, true), true, true);
    quantize_attention(in, fused.t, o);
    o.bhsd_scales = false;
    const MXFP8Shapes cs = attention_shapes(dims, l, false), bs = attention_shapes(dims, l, true);
    HostQ phase1 = test::alloc_host(cs, true, true);
    quantize_attention(in, phase1.t, o);
    HostQ two = test::alloc_host(bs, true, true);
    attention_scales_to_bhsd(phase1.t.rowwise_scale_inv, two.t.rowwise_scale_inv, dims, l, true);
    attention_scales_to_bhsd(phase1.t.columnwise_scale_inv, two.t.columnwise_scale_inv, dims, l, false);
    EXPECT_EQ(test::first_mismatch(two.rs, fused.rs), "");
    EXPECT_EQ(test::first_mismatch(two.cs, fused.cs), "");
    EXPECT_EQ(test::first_mismatch(phase1.row, fused.row), "");
  }
}

// ------------------------------------------------------------------ swizzle / dequantize
TEST(SwizzleCpu, SwizzleOfCompactEqualsSwizzledQuantizeAndRoundTrips) {
  for (Shape2 sh : {Shape2{1, 32}, Shape2{130, 96}, Shape2{300, 544}}) {
    const std::vector<float> x = test::make_data(sh.M, sh.K, Data::kRandom, 4);
    const TensorDesc in(const_cast<float*>(x.data()), DType::kFloat32, {sh.M, sh.K});
    const MXFP8Shapes c = quantize_shapes({sh.M, sh.K}, false), s = quantize_shapes({sh.M, sh.K}, true);
    HostQ qc = test::alloc_host(c, true, true), qs = test::alloc_host(s, true, true);
    quantize(in, qc.t, QuantizeOptions{});
    QuantizeOptions so;
    so.swizzle = true;
    quantize(in, qs.t, so);
    for (bool rowwise : {true, false}) {
      TensorDesc& comp = rowwise ? qc.t.rowwise_scale_inv : qc.t.columnwise_scale_inv;
      std::vector<uint8_t> swz(numel(rowwise ? s.rowwise_scale : s.columnwise_scale), 0xAB);
      TensorDesc swz_d(swz.data(), DType::kUInt8, rowwise ? s.rowwise_scale : s.columnwise_scale);
      swizzle_scales(comp, swz_d, sh.M, sh.K, rowwise);
      EXPECT_EQ(test::first_mismatch(swz, rowwise ? qs.rs : qs.cs), "") << sh.M << "x" << sh.K;
      std::vector<uint8_t> back(comp.numel(), 0xAB);
      TensorDesc back_d(back.data(), DType::kUInt8, comp.shape);
      unswizzle_scales(swz_d, back_d, sh.M, sh.K, rowwise);
      EXPECT_EQ(test::first_mismatch(back, rowwise ? qc.rs : qc.cs), "");
    }
  }
}

#if MXMLA_WITH_CUDA
TEST(ScalesGpu, SwizzleUnswizzleBhsdAndDequantizeMatchReference) {
  MXMLA_REQUIRE_GPU();
  const Device dev{DeviceType::kCUDA, 0};
  // swizzle / unswizzle
  for (Shape2 sh : {Shape2{1, 32}, Shape2{130, 96}, Shape2{300, 544}})
    for (bool rowwise : {true, false}) {
      const MXFP8Shapes c = quantize_shapes({sh.M, sh.K}, false), s = quantize_shapes({sh.M, sh.K}, true);
      const auto cshape = rowwise ? c.rowwise_scale : c.columnwise_scale;
      const auto sshape = rowwise ? s.rowwise_scale : s.columnwise_scale;
      std::vector<uint8_t> comp(numel(cshape));
      util::Rng rng(1);
      for (auto& b : comp) b = static_cast<uint8_t>(rng.next());
      std::vector<uint8_t> ref(numel(sshape), 0xAB);
      TensorDesc cd(comp.data(), DType::kUInt8, cshape), rd(ref.data(), DType::kUInt8, sshape);
      swizzle_scales(cd, rd, sh.M, sh.K, rowwise);
      util::DeviceBuffer dc(comp.size()), ds(ref.size()), db(comp.size());
      dc.upload(comp.data());
      std::vector<uint8_t> poison(ref.size(), 0xCD);
      ds.upload(poison.data());
      TensorDesc dcd(dc.ptr, DType::kUInt8, cshape, dev), dsd(ds.ptr, DType::kUInt8, sshape, dev),
          dbd(db.ptr, DType::kUInt8, cshape, dev);
      swizzle_scales(dcd, dsd, sh.M, sh.K, rowwise);
      unswizzle_scales(dsd, dbd, sh.M, sh.K, rowwise);
      EXPECT_EQ(test::first_mismatch(ds.download<uint8_t>(), ref), "");
      EXPECT_EQ(test::first_mismatch(db.download<uint8_t>(), comp), "");
    }
  // dequantize: every code with every scale neighbourhood, both directions and layouts, fp32 and bf16 out
  for (bool swz : {false, true})
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const int64_t M = 70, K = 256;
      const MXFP8Shapes s = quantize_shapes({M, K}, swz);
      HostQ h = test::alloc_host(s, true, true);
      util::Rng rng(2);
      for (auto* v : {&h.row, &h.col})
        for (auto& b : *v) b = static_cast<uint8_t>(rng.next());
      for (auto* v : {&h.rs, &h.cs})
        for (auto& b : *v) b = static_cast<uint8_t>(rng.next() % 2 ? rng.next() : 100 + rng.next() % 50);
      h.t.shape = {M, K}, h.t.format = f, h.t.scale_layout = swz ? ScaleLayout::kSwizzled : ScaleLayout::kCompact;
      util::DeviceBuffer drow(h.row.size()), drs(h.rs.size()), dcol(h.col.size()), dcs(h.cs.size());
      drow.upload(h.row.data()), drs.upload(h.rs.data()), dcol.upload(h.col.data()), dcs.upload(h.cs.data());
      MXFP8Tensor dt = h.t;
      dt.rowwise_data = TensorDesc(drow.ptr, DType::kUInt8, s.data, dev);
      dt.rowwise_scale_inv = TensorDesc(drs.ptr, DType::kUInt8, s.rowwise_scale, dev);
      dt.columnwise_data = TensorDesc(dcol.ptr, DType::kUInt8, s.data, dev);
      dt.columnwise_scale_inv = TensorDesc(dcs.ptr, DType::kUInt8, s.columnwise_scale, dev);
      for (DType out_t : {DType::kFloat32, DType::kBFloat16})
        for (bool colw : {false, true}) {
          std::vector<uint8_t> ref(M * K * dtype_size(out_t));
          TensorDesc rd(ref.data(), out_t, {M, K});
          dequantize(h.t, rd, colw);
          util::DeviceBuffer dout(ref.size());
          TensorDesc od(dout.ptr, out_t, {M, K}, dev);
          dequantize(dt, od, colw);
          EXPECT_EQ(test::first_mismatch(dout.download<uint8_t>(), ref), "")
              << "dequantize " << dtype_name(out_t) << (colw ? " columnwise" : " rowwise") << (swz ? " swizzled" : "");
        }
    }
}

// Phase two alone (compact -> BHSD scales) on the GPU equals the CPU remap for random scale bytes:
// odd and even block counts per row (d 96: three 32-blocks, 192: six), sequence tails, one head,
// many heads (several matrix groups per block), head dims large enough for one matrix per block
// and for the generic kernel (d 12800), more jobs than one launch takes, misaligned buffers (the
// staged kernel's byte paths), a poisoned destination (padding must be written as zero).
TEST(AttentionGpuPhases, PhaseTwoMatchesCpuRemap) {
  MXMLA_REQUIRE_GPU();
  const Device dev{DeviceType::kCUDA, 0};
  const std::vector<AttnShape> shapes = {{1, 1, 1, 32},    {33, 2, 3, 192},  {257, 2, 16, 192}, {300, 3, 2, 64},
                                         {129, 1, 5, 96},  {128, 2, 16, 128}, {70, 1, 1, 2080},  {40, 1, 1, 12800},
                                         {1000, 1, 40, 192}};
  struct Buf {
    std::vector<uint8_t> src, want;
    std::unique_ptr<util::DeviceBuffer> dsrc, ddst;
    size_t soff = 0, doff = 0;
  };
  for (QKVLayout l : {QKVLayout::kSBHD, QKVLayout::kBSHD})
    for (int misalign : {0, 1, 2}) {
      std::vector<BhsdScaleJob> jobs;
      std::vector<std::unique_ptr<Buf>> bufs;
      std::vector<std::string> names;
      util::Rng rng(7 + misalign);
      for (const AttnShape& a : shapes)
        for (bool rowwise : {true, false}) {
          const auto dims = attn_dims(l, a);
          const MXFP8Shapes cs = attention_shapes(dims, l, false), bs = attention_shapes(dims, l, true);
          const auto& cshape = rowwise ? cs.rowwise_scale : cs.columnwise_scale;
          const auto& bshape = rowwise ? bs.rowwise_scale : bs.columnwise_scale;
          auto b = std::make_unique<Buf>();
          b->src.resize(numel(cshape));
          for (auto& v : b->src) v = static_cast<uint8_t>(rng.next());
          b->want.assign(numel(bshape), 0xAB);
          TensorDesc ch(b->src.data(), DType::kUInt8, cshape), bh(b->want.data(), DType::kUInt8, bshape);
          attention_scales_to_bhsd(ch, bh, dims, l, rowwise);  // CPU remap (the reference)
          // misalign 1: both buffers at odd addresses; 2: source at +4, destination at +8
          b->soff = misalign == 1 ? 1 : misalign == 2 ? 4 : 0;
          b->doff = misalign == 1 ? 3 : misalign == 2 ? 8 : 0;
          std::vector<uint8_t> s(b->src.size() + 16, 0x11), d(b->want.size() + 16, 0xCD);
          std::copy(b->src.begin(), b->src.end(), s.begin() + b->soff);
          b->dsrc = std::make_unique<util::DeviceBuffer>(s.size()), b->ddst = std::make_unique<util::DeviceBuffer>(d.size());
          b->dsrc->upload(s.data()), b->ddst->upload(d.data());
          jobs.push_back({TensorDesc(b->dsrc->as<uint8_t>() + b->soff, DType::kUInt8, cshape, dev),
                          TensorDesc(b->ddst->as<uint8_t>() + b->doff, DType::kUInt8, bshape, dev), dims, l, rowwise});
          names.push_back("s" + std::to_string(a.S) + " b" + std::to_string(a.B) + " h" + std::to_string(a.H) + " d" +
                          std::to_string(a.D) + (rowwise ? " rowwise" : " columnwise"));
          bufs.push_back(std::move(b));
        }
      attention_scales_to_bhsd(jobs);  // 18 jobs: three launches of the staged kernel + the generic one
      MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
      for (size_t k = 0; k < bufs.size(); ++k) {
        const std::vector<uint8_t> got = bufs[k]->ddst->download<uint8_t>();
        const std::vector<uint8_t> in(got.begin() + bufs[k]->doff, got.begin() + bufs[k]->doff + bufs[k]->want.size());
        EXPECT_EQ(test::first_mismatch(in, bufs[k]->want), "")
            << names[k] << (l == QKVLayout::kSBHD ? " sbhd" : " bshd") << " misalign " << misalign;
        for (size_t i = 0; i < got.size(); ++i)  // nothing outside the destination is touched
          if (i < bufs[k]->doff || i >= bufs[k]->doff + bufs[k]->want.size()) ASSERT_EQ(got[i], 0xCD) << names[k] << " byte " << i;
      }
    }
}

// Empty Q/K/V (no heads, no tokens): phase two is a no-op on the GPU, not a crash (the staged
// kernel's host setup divides by the matrices per item).
TEST(AttentionGpuPhases, PhaseTwoOfEmptyTensorsIsANoOp) {
  MXMLA_REQUIRE_GPU();
  const Device dev{DeviceType::kCUDA, 0};
  for (QKVLayout l : {QKVLayout::kSBHD, QKVLayout::kBSHD})
    for (const AttnShape& a : {AttnShape{5, 2, 0, 64}, AttnShape{0, 2, 3, 64}})
      for (bool rowwise : {true, false}) {
        const auto dims = attn_dims(l, a);
        const MXFP8Shapes cs = attention_shapes(dims, l, false), bs = attention_shapes(dims, l, true);
        TensorDesc sd(nullptr, DType::kUInt8, rowwise ? cs.rowwise_scale : cs.columnwise_scale, dev);
        TensorDesc dd(nullptr, DType::kUInt8, rowwise ? bs.rowwise_scale : bs.columnwise_scale, dev);
        EXPECT_EQ(sd.numel(), 0);
        EXPECT_NO_THROW(attention_scales_to_bhsd(sd, dd, dims, l, rowwise));
      }
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
}

// Two-phase on the GPU (compact, then the BHSD transpose kernel) equals the fused GPU result.
TEST(AttentionGpuPhases, TwoPhaseEqualsFused) {
  MXMLA_REQUIRE_GPU();
  const Device dev{DeviceType::kCUDA, 0};
  const AttnShape a{257, 2, 4, 192};
  for (QKVLayout l : {QKVLayout::kSBHD, QKVLayout::kBSHD}) {
    const auto dims = attn_dims(l, a);
    const std::vector<uint8_t> in = test::encode(test::make_data(a.S * a.B * a.H, a.D, Data::kRandom, 3), DType::kBFloat16);
    const TensorDesc ih(const_cast<uint8_t*>(in.data()), DType::kBFloat16, dims);
    AttentionQuantizeOptions o;
    o.layout = l;
    const MXFP8Shapes bs = attention_shapes(dims, l, true), cs = attention_shapes(dims, l, false);
    HostQ fused = test::quantize_on_gpu(in, ih, bs, true, true, true, {}, o);
    o.bhsd_scales = false;
    HostQ p1 = test::quantize_on_gpu(in, ih, cs, true, true, true, {}, o);
    for (bool rowwise : {true, false}) {
      const auto& src = rowwise ? p1.rs : p1.cs;
      util::DeviceBuffer dsrc(src.size()), ddst(numel(rowwise ? bs.rowwise_scale : bs.columnwise_scale));
      dsrc.upload(src.data());
      TensorDesc sd(dsrc.ptr, DType::kUInt8, rowwise ? cs.rowwise_scale : cs.columnwise_scale, dev);
      TensorDesc dd(ddst.ptr, DType::kUInt8, rowwise ? bs.rowwise_scale : bs.columnwise_scale, dev);
      attention_scales_to_bhsd(sd, dd, dims, l, rowwise);
      EXPECT_EQ(test::first_mismatch(ddst.download<uint8_t>(), rowwise ? fused.rs : fused.cs), "");
    }
  }
}
#endif

}  // namespace
}  // namespace mxmla
