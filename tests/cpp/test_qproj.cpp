// The fused Q up-projection (issue 4): CPU reference against independent float64 formulas, the SM90
// kernel bit for bit against the reference (integer-valued inputs: every fp32 partial sum exact),
// random inputs within the fp32-accumulation bound, NaN/Inf, tails, batches, strides, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>

#include "cuda/heuristics.h"
#include "cpu/reference.h"
#include "mxmla/qproj.h"
#include "test_util.h"

namespace mxmla {
namespace {

struct QCase {
  int64_t T = 64, NH = 2, K = 64, B = 1;
  QKVLayout layout = QKVLayout::kSBHD;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  Fp8Format fmt = Fp8Format::kE4M3;
  bool bhsd = false, rowwise = true, columnwise = true, want_q = true, tab_f32 = true;
  int64_t x_pad = 0, w_pad = 0;  // extra elements per row (strided x / W)
  bool integer = true;           // integer-valued x, W (exact fp32 sums) or N(0,1)-like
  bool w_kn = false;             // W given as [K, N]
  bool specials = false;         // NaN / Inf in a few x rows
  bool tab_specials = false;     // ±Inf / NaN in the tables' last 28 rows (the kernel's rows past the
                                 // sequence keep those rows' table values: they must not leak)
  uint64_t seed = 7;
  std::string name() const {
    std::ostringstream s;
    s << "T" << T << "_NH" << NH << "_K" << K << "_B" << B << (layout == QKVLayout::kSBHD ? "_sbhd" : "_bshd")
      << "_st" << int(style) << (fmt == Fp8Format::kE4M3 ? "_e4m3" : "_e5m2") << (bhsd ? "_bhsd" : "")
      << (rowwise ? "_r" : "") << (columnwise ? "_c" : "") << (want_q ? "_q" : "") << (tab_f32 ? "" : "_tbf16")
      << (x_pad || w_pad ? "_strided" : "") << (integer ? "" : "_random") << (specials ? "_nan" : "")
      << (tab_specials ? "_tabinf" : "") << (w_kn ? "_wkn" : "");
    return s.str();
  }
  QProjOptions opts() const {
    QProjOptions o;
    o.style = style, o.layout = layout, o.batch = B, o.rowwise = rowwise, o.columnwise = columnwise;
    o.format = fmt, o.bhsd_scales = bhsd;
    o.weight_layout = w_kn ? WeightLayout::kKN : WeightLayout::kNK;
    return o;
  }
};

void PrintTo(const QCase& c, std::ostream* os) { *os << c.name(); }

// Host inputs of a case.
struct QInputs {
  std::vector<uint16_t> x, w;     // bf16 bits, rows of K + pad (W [N, K])
  std::vector<uint16_t> w_kn;     // the same W as [K, N], rows of N + pad (when the case asks for it)
  std::vector<uint8_t> cos, sin;  // fp32 or bf16 bytes [S, 64]
  int64_t S = 0;
};

QInputs make_inputs(const QCase& c) {
  QInputs in;
  util::Rng rng(c.seed);
  const int64_t N = c.NH * 192, xs = c.K + c.x_pad, ws = c.K + c.w_pad;
  in.x.assign(c.T * xs, util::to_bf16(0.f));
  in.w.assign(N * ws, util::to_bf16(0.f));
  auto draw = [&](double scale) {
    return c.integer ? static_cast<float>(static_cast<int>(rng.uniform() * 9) - 4) : static_cast<float>(rng.normal() * scale);
  };
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t k = 0; k < c.K; ++k) in.x[t * xs + k] = util::to_bf16(draw(1.0));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < c.K; ++k) in.w[n * ws + k] = util::to_bf16(draw(0.05));
  if (c.specials) {
    const float sp[3] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3 && i < c.T; ++i) in.x[(i * 7 % c.T) * xs + (i * 5 % c.K)] = util::to_bf16(sp[i]);
  }
  if (c.w_kn) {
    in.w_kn.assign(c.K * (N + c.w_pad), util::to_bf16(0.f));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < c.K; ++k) in.w_kn[k * (N + c.w_pad) + n] = in.w[n * ws + k];
  }
  in.S = c.T / c.B;
  std::vector<double> pos = positions_arange(in.S);
  std::vector<float> cf(in.S * 64), sf(in.S * 64);
  TensorDesc cd(cf.data(), DType::kFloat32, {in.S, 64}), sd(sf.data(), DType::kFloat32, {in.S, 64});
  rope_tables(pos, 64, 10000.0, YarnParams::deepseek_v3(), c.style, cd, sd);
  if (c.tab_specials)
    for (int64_t i = 0; i < 28 && i < in.S; ++i) {
      const int64_t row = in.S - 1 - i, col = i * 5 % 64;
      cf[row * 64 + col] = i % 2 ? INFINITY : -INFINITY;
      sf[row * 64 + (col + 7) % 64] = NAN;
    }
  const DType tt = c.tab_f32 ? DType::kFloat32 : DType::kBFloat16;
  in.cos = test::encode(cf, tt), in.sin = test::encode(sf, tt);
  return in;
}

struct QOutputs {
  test::HostQ q;
  std::vector<uint16_t> qbf16;
};

// Runs the op on the CPU or the GPU (inputs copied there, outputs poisoned with 0xAB first).
QOutputs run(const QCase& c, const QInputs& in, bool gpu) {
  const QProjOptions o = c.opts();
  const MXFP8Shapes sh = qproj_shapes(c.T, c.NH, o);
  QOutputs r;
  r.q = test::alloc_host(sh, c.rowwise, c.columnwise);
  const std::vector<int64_t> qshape = qproj_q_shape(c.T, c.NH, o);
  r.qbf16.assign(c.want_q ? numel(qshape) : 0, 0xABAB);
  const DType tt = c.tab_f32 ? DType::kFloat32 : DType::kBFloat16;
  const int64_t N = c.NH * 192;
  if (!gpu) {
    TensorDesc x(const_cast<uint16_t*>(in.x.data()), DType::kBFloat16, {c.T, c.K}, {}, {c.K + c.x_pad, 1});
    TensorDesc w = c.w_kn ? TensorDesc(const_cast<uint16_t*>(in.w_kn.data()), DType::kBFloat16, {c.K, N}, {}, {N + c.w_pad, 1})
                          : TensorDesc(const_cast<uint16_t*>(in.w.data()), DType::kBFloat16, {N, c.K}, {}, {c.K + c.w_pad, 1});
    TensorDesc cs(const_cast<uint8_t*>(in.cos.data()), tt, {in.S, 64}), sn(const_cast<uint8_t*>(in.sin.data()), tt, {in.S, 64});
    TensorDesc qd(r.qbf16.data(), DType::kBFloat16, qshape);
    fused_q_uproj_rope_quant(x, w, cs, sn, r.q.t, c.want_q ? &qd : nullptr, o);
    return r;
  }
#if MXMLA_WITH_CUDA
  using util::DeviceBuffer;
  const Device dev{DeviceType::kCUDA, 0};
  const std::vector<uint16_t>& hw = c.w_kn ? in.w_kn : in.w;
  DeviceBuffer dx(in.x.size() * 2), dw(hw.size() * 2), dc(in.cos.size()), ds(in.sin.size());
  dx.upload(in.x.data()), dw.upload(hw.data()), dc.upload(in.cos.data()), ds.upload(in.sin.data());
  auto dev_copy = [&](std::vector<uint8_t>& h) {
    DeviceBuffer b(h.size());
    if (!h.empty()) b.upload(h.data());
    return b;
  };
  DeviceBuffer drow = dev_copy(r.q.row), drs = dev_copy(r.q.rs), dcol = dev_copy(r.q.col), dcs = dev_copy(r.q.cs);
  DeviceBuffer dq(r.qbf16.size() * 2);
  if (c.want_q) dq.upload(r.qbf16.data());
  MXFP8Tensor t = r.q.t;
  auto relocate = [&](TensorDesc& d, DeviceBuffer& b) {
    if (d.data) d.data = b.ptr, d.device = dev;
  };
  relocate(t.rowwise_data, drow), relocate(t.rowwise_scale_inv, drs);
  relocate(t.columnwise_data, dcol), relocate(t.columnwise_scale_inv, dcs);
  TensorDesc x(dx.ptr, DType::kBFloat16, {c.T, c.K}, dev, {c.K + c.x_pad, 1});
  TensorDesc w = c.w_kn ? TensorDesc(dw.ptr, DType::kBFloat16, {c.K, N}, dev, {N + c.w_pad, 1})
                        : TensorDesc(dw.ptr, DType::kBFloat16, {N, c.K}, dev, {c.K + c.w_pad, 1});
  TensorDesc cs(dc.ptr, tt, {in.S, 64}, dev), sn(ds.ptr, tt, {in.S, 64}, dev);
  TensorDesc qd(dq.ptr, DType::kBFloat16, qshape, dev);
  fused_q_uproj_rope_quant(x, w, cs, sn, t, c.want_q ? &qd : nullptr, o);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  auto back = [](std::vector<uint8_t>& h, const DeviceBuffer& b) {
    if (!h.empty()) MXMLA_CUDA_CHECK(cudaMemcpy(h.data(), b.ptr, h.size(), cudaMemcpyDeviceToHost));
  };
  back(r.q.row, drow), back(r.q.rs, drs), back(r.q.col, dcol), back(r.q.cs, dcs);
  if (c.want_q) MXMLA_CUDA_CHECK(cudaMemcpy(r.qbf16.data(), dq.ptr, r.qbf16.size() * 2, cudaMemcpyDeviceToHost));
#endif
  return r;
}

// ---------------------------------------------------------------- CPU reference vs float64 formulas
// q = bf16(x W^T), then SPEC §3's formula in float64 (the DeepSeek complex multiply for
// kInterleaved); the reference's bf16 q agrees within one bf16 rounding of the fp32 RoPE.
TEST(QProjCpu, MatchesFloat64Formula) {
  for (RopeStyle st : {RopeStyle::kInterleavedInHalvesOut, RopeStyle::kInterleaved, RopeStyle::kRotateHalf}) {
    QCase c;
    c.T = 40, c.NH = 2, c.K = 48, c.style = st, c.integer = false;
    const QInputs in = make_inputs(c);
    const QOutputs r = run(c, in, false);
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t h = 0; h < c.NH; ++h) {
        double qh[192];
        for (int64_t d = 0; d < 192; ++d) {
          double a = 0;
          for (int64_t k = 0; k < c.K; ++k)
            a += ref::bf16_to_double(in.x[t * c.K + k]) * ref::bf16_to_double(in.w[(h * 192 + d) * c.K + k]);
          qh[d] = ref::bf16_to_double(util::to_bf16(static_cast<float>(a)));
        }
        const float* cf = reinterpret_cast<const float*>(in.cos.data()) + t * 64;
        const float* sf = reinterpret_cast<const float*>(in.sin.data()) + t * 64;
        const double* x = qh + 128;
        double y[64];
        for (int i = 0; i < 32; ++i) {
          if (st == RopeStyle::kInterleavedInHalvesOut) {  // [x1 c - x2 s | x2 c + x1 s], pairs (2i, 2i+1)
            y[i] = x[2 * i] * cf[i] - x[2 * i + 1] * sf[i];
            y[32 + i] = x[2 * i + 1] * cf[32 + i] + x[2 * i] * sf[32 + i];
          } else if (st == RopeStyle::kInterleaved) {  // (x0 + i x1) (c + i s)
            y[2 * i] = x[2 * i] * cf[2 * i] - x[2 * i + 1] * sf[2 * i];
            y[2 * i + 1] = x[2 * i + 1] * cf[2 * i + 1] + x[2 * i] * sf[2 * i + 1];
          } else {  // x c + rotate_half(x) s
            y[i] = x[i] * cf[i] - x[32 + i] * sf[i];
            y[32 + i] = x[32 + i] * cf[32 + i] + x[i] * sf[32 + i];
          }
        }
        const uint16_t* got = &r.qbf16[(t * c.NH + h) * 192];
        for (int d = 0; d < 128; ++d) ASSERT_EQ(ref::bf16_to_double(got[d]), qh[d]) << "nope t " << t << " d " << d;
        for (int d = 0; d < 64; ++d) {
          const double g = ref::bf16_to_double(got[128 + d]);
          ASSERT_NEAR(g, y[d], std::ldexp(std::fabs(y[d]), -8) + 1e-6 * (std::fabs(x[d]) + 1)) << "rope t " << t << " d " << d;
        }
      }
  }
}

// The nope part of q is the bf16 GEMM value itself, so its rowwise blocks must equal what
// quantize_attention() makes of the bf16 q copy (the rope blocks hold fp32 values a bf16 copy
// cannot reproduce).
TEST(QProjCpu, RowwiseScalesOfNopeBlocksMatchQuantize) {
  QCase c;
  c.T = 33, c.NH = 3, c.K = 64;
  const QInputs in = make_inputs(c);
  const QOutputs r = run(c, in, false);
  std::vector<int64_t> shape = qproj_q_shape(c.T, c.NH, c.opts());
  const MXFP8Shapes sh = attention_shapes(shape, c.layout, false);
  test::HostQ hq = test::alloc_host(sh, true, false);
  AttentionQuantizeOptions ao;
  ao.columnwise = false, ao.bhsd_scales = false;
  TensorDesc qd(const_cast<uint16_t*>(r.qbf16.data()), DType::kBFloat16, shape);
  quantize_attention(qd, hq.t, ao);
  for (int64_t row = 0; row < c.T * c.NH; ++row) {
    for (int b = 0; b < 4; ++b) ASSERT_EQ(hq.rs[row * 6 + b], r.q.rs[row * 6 + b]) << "row " << row << " block " << b;
    for (int d = 0; d < 128; ++d) ASSERT_EQ(hq.row[row * 192 + d], r.q.row[row * 192 + d]);
  }
}

// The fused kernel's persistent grid (cuda/heuristics.h, balanced_grid): as many waves of tiles as
// one CTA per SM, with the fewest CTAs that allow it.
TEST(QProjCpu, GridIsTheFewestCtasForTheWaves) {
  using detail::heuristics::balanced_grid;
  EXPECT_EQ(balanced_grid(4096, 132), 128);   // T 4096 x NH 128: 128 CTAs of 32 tiles, not 132 of 31 or 32
  EXPECT_EQ(balanced_grid(2048, 132), 128);   // T 16384 x NH 16
  EXPECT_EQ(balanced_grid(16384, 132), 132);  // T 16384 x NH 128: 125 waves need all 132
  EXPECT_EQ(balanced_grid(133, 132), 67);
  EXPECT_EQ(balanced_grid(1, 132), 1);
  for (int sms : {1, 7, 78, 114, 132})
    for (int tiles = 1; tiles <= 3000; ++tiles) {
      const int g = balanced_grid(tiles, sms), waves = (tiles + sms - 1) / sms;
      ASSERT_TRUE(g >= 1 && g <= std::min(tiles, sms)) << tiles << " tiles, " << sms << " SMs: " << g;
      ASSERT_EQ((tiles + g - 1) / g, waves) << tiles << " tiles, " << sms << " SMs";
      if (g > 1) ASSERT_GT((tiles + g - 2) / (g - 1), waves) << tiles << " tiles, " << sms << " SMs: not the fewest";
    }
}

// ---------------------------------------------------------------- GPU vs reference
class QProjGpu : public ::testing::TestWithParam<QCase> {};

TEST_P(QProjGpu, MatchesReferenceBitExact) {
  MXMLA_REQUIRE_GPU();
  const QCase c = GetParam();
  const QInputs in = make_inputs(c);
  const QOutputs ref = run(c, in, false), got = run(c, in, true);
  EXPECT_EQ(test::first_mismatch(ref.q.row, got.q.row), "") << "rowwise codes";
  EXPECT_EQ(test::first_mismatch(ref.q.rs, got.q.rs), "") << "rowwise scales";
  EXPECT_EQ(test::first_mismatch(ref.q.col, got.q.col), "") << "columnwise codes";
  EXPECT_EQ(test::first_mismatch(ref.q.cs, got.q.cs), "") << "columnwise scales";
  EXPECT_TRUE(ref.qbf16 == got.qbf16) << "bf16 q";
}

std::vector<QCase> bit_exact_cases() {
  std::vector<QCase> v;
  auto add = [&](auto f) {
    QCase c;
    f(c);
    v.push_back(c);
  };
  add([](QCase& c) { c.T = 1, c.NH = 1, c.K = 64; });
  add([](QCase& c) { c.T = 31, c.NH = 3, c.K = 128, c.style = RopeStyle::kInterleaved, c.tab_f32 = false, c.want_q = false; });
  add([](QCase& c) { c.T = 33, c.NH = 3, c.K = 136, c.layout = QKVLayout::kBSHD, c.style = RopeStyle::kRotateHalf, c.fmt = Fp8Format::kE5M2; });
  add([](QCase& c) { c.T = 128, c.NH = 128, c.K = 64, c.bhsd = true, c.want_q = false; });
  add([](QCase& c) { c.T = 4097, c.NH = 3, c.K = 72; });
  add([](QCase& c) { c.T = 200, c.NH = 2, c.K = 64, c.B = 2, c.columnwise = false, c.style = RopeStyle::kRotateHalf; });
  add([](QCase& c) { c.T = 210, c.NH = 2, c.K = 64, c.B = 3, c.layout = QKVLayout::kBSHD, c.style = RopeStyle::kInterleaved, c.bhsd = true, c.rowwise = false; });
  add([](QCase& c) { c.T = 300, c.NH = 4, c.K = 64, c.B = 2, c.bhsd = true, c.fmt = Fp8Format::kE5M2; });
  add([](QCase& c) { c.T = 256, c.NH = 16, c.K = 1536; });
  add([](QCase& c) { c.T = 96, c.NH = 2, c.K = 200, c.x_pad = 8, c.w_pad = 24, c.style = RopeStyle::kInterleaved; });
  add([](QCase& c) { c.T = 64, c.NH = 2, c.K = 64, c.specials = true; });
  add([](QCase& c) { c.T = 70, c.NH = 2, c.K = 64, c.specials = true, c.bhsd = true, c.style = RopeStyle::kRotateHalf, c.fmt = Fp8Format::kE5M2; });
  add([](QCase& c) { c.T = 70, c.NH = 2, c.K = 64, c.tab_specials = true; });
  add([](QCase& c) { c.T = 150, c.NH = 2, c.K = 64, c.B = 2, c.layout = QKVLayout::kBSHD, c.tab_specials = true, c.style = RopeStyle::kInterleaved; });
  add([](QCase& c) { c.T = 65, c.NH = 2, c.K = 80, c.w_kn = true; });
  add([](QCase& c) { c.T = 40, c.NH = 3, c.K = 48, c.w_kn = true, c.w_pad = 8, c.style = RopeStyle::kInterleaved; });
  // More tiles than SMs, so that each CTA takes several (on the H200's 132 SMs: 528 tiles on 132 CTAs,
  // 144 on 72; every case above has at most one tile per CTA): the shared hand-off tile passed from
  // one tile to the next (tile_full / tile_empty parities) and the stage ring running across tiles
  add([](QCase& c) { c.T = 4100, c.NH = 16, c.K = 64; });
  add([](QCase& c) { c.T = 600, c.NH = 24, c.K = 64, c.B = 2, c.layout = QKVLayout::kBSHD, c.style = RopeStyle::kRotateHalf, c.bhsd = true; });
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, QProjGpu, ::testing::ValuesIn(bit_exact_cases()),
                         [](const ::testing::TestParamInfo<QCase>& i) { return i.param.name(); });

// Random (non-integer) inputs: the kernel's fp32 sums differ from the exact ones by at most
// gamma = K * 2^-24 relative to sum |x w| (any summation order, each partial rounded once), plus one
// bf16 rounding of q (2^-8 relative) that such a difference can flip, carried through RoPE
// (|c| + |s| <= 2 for these tables). The bf16 q must agree within that bound; nope codes may then
// move by one FP8 step where the scales agree (rope codes by 2^-7 of the block range, since
// c x_a + s x_b can cancel), and a scale by one where an amax sits at a power of two.
TEST(QProjGpuRandom, WithinFp32AccumulationBound) {
  MXMLA_REQUIRE_GPU();
  QCase c;
  c.T = 300, c.NH = 4, c.K = 1536, c.integer = false;
  const QInputs in = make_inputs(c);
  const QOutputs ref = run(c, in, false), got = run(c, in, true);
  const int64_t N = c.NH * 192;
  int64_t q_diff = 0, code_far = 0, scale_diff = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    double M = 0;
    for (int64_t n = 0; n < N; ++n) {
      // rope outputs: the rotation keeps the norm of each pair (c^2 + s^2 = 1 here), so its inputs are
      // at most the largest rope output of the head, M; their bf16 steps carry over as 2^-8 M each
      if (n % 192 == 0) {  // once per (token, head)
        M = 0;
        for (int64_t d = 128; d < 192; ++d) M = std::max(M, std::fabs(ref::bf16_to_double(ref.qbf16[t * N + n + d])));
      }
      double sabs = 0;
      for (int64_t k = 0; k < c.K; ++k)
        sabs += std::fabs(ref::bf16_to_double(in.x[t * c.K + k]) * ref::bf16_to_double(in.w[n * c.K + k]));
      const double gamma = c.K * std::ldexp(1.0, -24) * sabs;
      const double a = ref::bf16_to_double(ref.qbf16[t * N + n]), b = ref::bf16_to_double(got.qbf16[t * N + n]);
      const double bound = 2 * (gamma + std::ldexp(std::fabs(a) + (n % 192 >= 128 ? 2 * M : 0), -7)) + 1e-30;
      if (std::fabs(a - b) > bound) ++q_diff;
    }
  }
  for (size_t i = 0; i < ref.q.rs.size(); ++i) scale_diff += ref.q.rs[i] != got.q.rs[i];
  for (size_t i = 0; i < ref.q.row.size(); ++i) {
    const int64_t blk = static_cast<int64_t>(i / 32);
    if (ref.q.rs[blk] != got.q.rs[blk]) continue;
    auto ord = [](uint8_t c) { return (c & 0x80) ? -int(c & 0x7F) : int(c & 0x7F); };  // +0 == -0
    const uint8_t a = ref.q.row[i], b = got.q.row[i];
    if (static_cast<int64_t>(i % 192) >= 128) {  // rope: c x_a + s x_b may cancel: 2^-7 of the range
      if (std::fabs(ref::fp8_to_double(a, c.fmt) - ref::fp8_to_double(b, c.fmt)) >
          448.0 / 128 + std::fabs(ref::fp8_to_double(a, c.fmt)) / 8)
        ++code_far;
    } else if (std::abs(ord(a) - ord(b)) > 1 && ((a & 0x7F) > 1 || (b & 0x7F) > 1)) {  // sign of ~0 may flip
      ++code_far;
    }
  }
  EXPECT_EQ(q_diff, 0) << "bf16 q outside the fp32-accumulation bound";
  EXPECT_EQ(code_far, 0) << "codes more than one FP8 step apart under equal scales";
  EXPECT_LE(scale_diff, static_cast<int64_t>(ref.q.rs.size() / 100)) << "rowwise scales differing";
}

// ---------------------------------------------------------------- errors
void expect_error(const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
  try {
    fn();
    FAIL() << "no error (expected argument '" << arg << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.arg(), arg) << e.what();
    EXPECT_NE(e.rule().find(rule), std::string::npos) << e.what();
  }
}

TEST(QProjErrors, BadInputsNameTheArgument) {
  QCase c;
  c.T = 32, c.NH = 1, c.K = 64;
  QInputs in = make_inputs(c);
  QProjOptions o = c.opts();
  const MXFP8Shapes sh = qproj_shapes(c.T, c.NH, o);
  test::HostQ hq = test::alloc_host(sh, true, true);
  std::vector<float> xf(32 * 64);
  TensorDesc x(in.x.data(), DType::kBFloat16, {32, 64}), w(in.w.data(), DType::kBFloat16, {192, 64});
  TensorDesc cs(in.cos.data(), DType::kFloat32, {32, 64}), sn(in.sin.data(), DType::kFloat32, {32, 64});
  auto call = [&](const TensorDesc& xx, const TensorDesc& ww, const TensorDesc& cc, const QProjOptions& oo) {
    return [=, &hq]() mutable { fused_q_uproj_rope_quant(xx, ww, cc, sn, hq.t, nullptr, oo); };
  };
  expect_error(call(TensorDesc(xf.data(), DType::kFloat32, {32, 64}), w, cs, o), "x", "must be bfloat16");
  expect_error(call(x, TensorDesc(in.w.data(), DType::kBFloat16, {192, 32}), cs, o), "w", "does not match K");
  expect_error(call(x, TensorDesc(in.w.data(), DType::kBFloat16, {100, 64}), cs, o), "w", "multiple of the head dim");
  expect_error(call(x, w, TensorDesc(in.cos.data(), DType::kFloat32, {16, 64}), o), "cos", "positions are needed");
  expect_error(call(x, w, TensorDesc(in.cos.data(), DType::kFloat32, {32, 32}), o), "cos", "rope_dim");
  QProjOptions b = o;
  b.batch = 3;
  expect_error(call(x, w, cs, b), "x", "do not split into batch");
  b = o, b.rope_dim = 63;
  expect_error(call(x, w, cs, b), "rope_dim", "positive and even");
  b = o, b.nope_dim = 100;
  expect_error(call(x, w, cs, b), "nope_dim", "multiple of 32");
  b = o, b.rowwise = b.columnwise = false;
  expect_error(call(x, w, cs, b), "options", "at least one");
  TensorDesc bad_out = hq.t.rowwise_data;
  hq.t.rowwise_data.shape = {1, 2, 3};
  expect_error(call(x, w, cs, o), "rowwise_data", "shape");
  hq.t.rowwise_data = bad_out;
}

// The kernel's tile coordinates are 32-bit numbers: on the CUDA path N (W's row h·192) or K past
// 2^31 − 256 is refused, naming w or x, before any pointer is looked at (descriptors only: runs
// without a GPU, and without gigabytes of W).
TEST(QProjErrors, CudaTileCoordinateLimits) {
  const Device dev{DeviceType::kCUDA, 0};
  void* fake = reinterpret_cast<void*>(uintptr_t{1} << 40);  // never dereferenced
  QProjOptions o;
  auto call = [&](int64_t T, int64_t K, int64_t NH) {
    return [=] {
      const MXFP8Shapes sh = qproj_shapes(T, NH, o);
      MXFP8Tensor t;
      t.rowwise_data = TensorDesc(fake, DType::kUInt8, sh.data, dev);
      t.rowwise_scale_inv = TensorDesc(fake, DType::kUInt8, sh.rowwise_scale, dev);
      t.columnwise_data = TensorDesc(fake, DType::kUInt8, sh.data, dev);
      t.columnwise_scale_inv = TensorDesc(fake, DType::kUInt8, sh.columnwise_scale, dev);
      const TensorDesc x(fake, DType::kBFloat16, {T, K}, dev), w(fake, DType::kBFloat16, {NH * 192, K}, dev),
          c(fake, DType::kFloat32, {T, 64}, dev), sn(fake, DType::kFloat32, {T, 64}, dev);
      fused_q_uproj_rope_quant(x, w, c, sn, t, nullptr, o);
    };
  };
  test::expect_error("mxmla.fused_q_uproj_rope_quant", call(1, 64, 11184811), "w",  // N = 2^31 + 64
                     "N = 2147483712 rows: the SM90 kernel takes at most 2^31 - 256");
  test::expect_error("mxmla.fused_q_uproj_rope_quant", call(1, (int64_t{1} << 31) - 224, 1), "x",
                     "K = 2147483424: the SM90 kernel takes at most 2^31 - 256");
}

// The CUDA path's own rules (TMA, the compiled head shape) name the argument; never a crash.
TEST(QProjGpuErrors, CudaRulesNameTheArgument) {
  MXMLA_REQUIRE_GPU();
#if MXMLA_WITH_CUDA
  using util::DeviceBuffer;
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t T = 32, K = 64, N = 192;
  DeviceBuffer dx(T * (K + 8) * 2 + 16), dw(N * K * 2), dc(T * 64 * 4), ds(T * 64 * 4);
  QProjOptions o;
  const MXFP8Shapes sh = qproj_shapes(T, 1, o);
  DeviceBuffer r(numel(sh.data)), rs(numel(sh.rowwise_scale)), cd(numel(sh.data)), cs(numel(sh.columnwise_scale));
  MXFP8Tensor t;
  t.rowwise_data = TensorDesc(r.ptr, DType::kUInt8, sh.data, dev);
  t.rowwise_scale_inv = TensorDesc(rs.ptr, DType::kUInt8, sh.rowwise_scale, dev);
  t.columnwise_data = TensorDesc(cd.ptr, DType::kUInt8, sh.data, dev);
  t.columnwise_scale_inv = TensorDesc(cs.ptr, DType::kUInt8, sh.columnwise_scale, dev);
  const TensorDesc w(dw.ptr, DType::kBFloat16, {N, K}, dev), c(dc.ptr, DType::kFloat32, {T, 64}, dev),
      sn(ds.ptr, DType::kFloat32, {T, 64}, dev);
  auto call = [&](const TensorDesc& x, const TensorDesc& ww, const QProjOptions& oo) {
    return [&, x, ww, oo]() mutable { fused_q_uproj_rope_quant(x, ww, c, sn, t, nullptr, oo); };
  };
  // K = 36: rows of 72 bytes are not what TMA can stride
  expect_error(call(TensorDesc(dx.ptr, DType::kBFloat16, {T, 36}, dev), TensorDesc(dw.ptr, DType::kBFloat16, {N, 36}, dev), o),
               "x", "multiple of 8");
  // a misaligned x pointer
  expect_error(call(TensorDesc(static_cast<char*>(dx.ptr) + 2, DType::kBFloat16, {T, K}, dev), w, o), "x", "16-byte aligned");
  // a row stride that is not a multiple of 16 bytes
  expect_error(call(TensorDesc(dx.ptr, DType::kBFloat16, {T, K}, dev, {K + 4, 1}), w, o), "x", "16 bytes");
  // heads the kernel is not built for (nope 64 + rope 64 = 128)
  QProjOptions h = o;
  h.nope_dim = 64;
  const MXFP8Shapes sh2 = qproj_shapes(T, 1, h);
  t.rowwise_data.shape = t.columnwise_data.shape = sh2.data;
  t.rowwise_scale_inv.shape = sh2.rowwise_scale, t.columnwise_scale_inv.shape = sh2.columnwise_scale;
  expect_error(call(TensorDesc(dx.ptr, DType::kBFloat16, {T, K}, dev), TensorDesc(dw.ptr, DType::kBFloat16, {128, K}, dev), h),
               "nope_dim", "nope 128 + rope 64");
  // x on the GPU, W on the CPU
  std::vector<uint16_t> hw(N * K);
  t.rowwise_data.shape = t.columnwise_data.shape = sh.data;
  t.rowwise_scale_inv.shape = sh.rowwise_scale, t.columnwise_scale_inv.shape = sh.columnwise_scale;
  expect_error(call(TensorDesc(dx.ptr, DType::kBFloat16, {T, K}, dev), TensorDesc(hw.data(), DType::kBFloat16, {N, K}), o),
               "w", "another device");
#endif
}

}  // namespace
}  // namespace mxmla
