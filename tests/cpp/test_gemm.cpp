// The MXFP8 GEMM (include/mxmla/gemm.h, SPEC §6):
//   GemmLinear     the three GEMMs of a Linear (fprop y = x·Wᵀ, dgrad dx = dy·W, wgrad dW = dyᵀ·x) from
//                  one x [T, K], W [N, K], dy [T, N] quantized with mxmla::quantize in both directions,
//                  against a naive float64 GEMM written here on operands decoded here (its own E4M3 /
//                  E5M2 and E8M0 decode, its own compact and F8_128x4 scale indexing): token counts
//                  with tail blocks, compact and swizzled scales, E5M2, bf16 / fp32 out, accumulate
//                  with alpha, strided out and operands, zero blocks;
//   GemmCpu        single GEMMs with odd M / N / K (1, 31, 33, 100) wherever the copy read allows
//                  them, every transposition, bf16 operands, and special scales (NaN 0xFF, e = 1,
//                  e = 254, zero blocks);
//   GemmExact      integer-valued data (small integers, scales in range): the reference equals an
//                  fp32 accumulation written here bit for bit, the bound the GPU kernel will be held to;
//   GemmScaleIndex the dequantizing passes' index of an operand's own scales equals the maps' offsets;
//   GemmErrors     each rule of the validation names its argument;
//   GemmCudaPath   a CUDA call is validated like a CPU one and then raises "not available yet" (runs on
//                  the CPU with descriptors marked cuda:0; and on a GPU with device buffers).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>

#include "common/mxfp8_common.h"
#include "cpu/reference.h"
#include "mxmla/gemm.h"
#include "test_util.h"

namespace mxmla {
namespace {

// ---------------------------------------------------------------- the test's own decoding
double dec_fp8(uint8_t b, Fp8Format f) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  if (f == Fp8Format::kE4M3) {
    const int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
    return sign * (e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
  }
  const int e = (b >> 2) & 31, m = b & 3;
  if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  return sign * (e == 0 ? std::ldexp(m, -16) : std::ldexp(4 + m, e - 17));
}
double dec_e8m0(uint8_t e) { return e == 255 ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, e - 127); }
double dec_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// SPEC §2.1: i the 128-row axis, j the 4-column axis
int64_t swz(int64_t i, int64_t j, int64_t tiles_x) {
  return ((i / 128) * tiles_x + j / 4) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + (j % 4);
}
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------- operands
// A stored matrix [rows, cols]: bf16 values and, when cols % 32 == 0, both MXFP8 copies.
struct QOp {
  int64_t rows = 0, cols = 0, ld = 0;  // ld: row stride (elements) of the buffers handed to gemm
  Fp8Format fmt = Fp8Format::kE4M3;
  bool swz = false, fp8 = false;
  std::vector<uint16_t> bf16;                 // contiguous values
  std::vector<uint8_t> rc, rs, cc, cs;        // contiguous codes, scales (as quantize wrote them)
  std::vector<uint16_t> bf16_ld;              // the buffers with row stride ld
  std::vector<uint8_t> rc_ld, cc_ld;
  TensorDesc bdesc;
  MXFP8Tensor mx;
  QOp() = default;
  QOp(const QOp&) = delete;
  QOp& operator=(const QOp&) = delete;

  GemmInput in(bool as_fp8) const {
    GemmInput g;
    if (as_fp8) g.mx = &mx;
    else g.bf16 = &bdesc;
    return g;
  }
  // Element (r, c) read through the rowwise copy (blocks of 32 along c) or the columnwise one.
  double value(bool rowwise, int64_t r, int64_t c) const {
    if (rowwise) {
      const int64_t nkb = cols / 32, so = swz ? ::mxmla::swz(r, c / 32, cdiv(nkb, 4)) : r * nkb + c / 32;
      return dec_fp8(rc[r * cols + c], fmt) * dec_e8m0(rs[so]);
    }
    const int64_t nrb = cdiv(rows, 32), so = swz ? ::mxmla::swz(c, r / 32, cdiv(nrb, 4)) : (r / 32) * cols + c;
    return dec_fp8(cc[r * cols + c], fmt) * dec_e8m0(cs[so]);
  }
  uint8_t& scale(bool rowwise, int64_t r, int64_t c) {  // the scale byte of element (r, c)'s block
    if (rowwise) {
      const int64_t nkb = cols / 32;
      return rs[swz ? ::mxmla::swz(r, c / 32, cdiv(nkb, 4)) : r * nkb + c / 32];
    }
    const int64_t nrb = cdiv(rows, 32);
    return cs[swz ? ::mxmla::swz(c, r / 32, cdiv(nrb, 4)) : (r / 32) * cols + c];
  }
  // Quantizes `bf16` into both copies (mxmla::quantize; contiguous buffers) and sets mx's metadata.
  void quantize_values() {
    const MXFP8Shapes s = quantize_shapes({rows, cols}, swz);
    rc.resize(rows * cols), cc.resize(rows * cols);
    rs.resize(numel(s.rowwise_scale)), cs.resize(numel(s.columnwise_scale));
    mx.shape = {rows, cols}, mx.format = fmt, mx.scale_layout = swz ? ScaleLayout::kSwizzled : ScaleLayout::kCompact;
    mx.rowwise_data = TensorDesc(rc.data(), DType::kUInt8, s.data);
    mx.rowwise_scale_inv = TensorDesc(rs.data(), DType::kUInt8, s.rowwise_scale);
    mx.columnwise_data = TensorDesc(cc.data(), DType::kUInt8, s.data);
    mx.columnwise_scale_inv = TensorDesc(cs.data(), DType::kUInt8, s.columnwise_scale);
    QuantizeOptions qo;
    qo.format = fmt, qo.swizzle = swz;
    quantize(TensorDesc(bf16.data(), DType::kBFloat16, {rows, cols}), mx, qo);
  }
  // Copies the contiguous buffers into the row-stride-ld ones and points the descriptors at them
  // (after any edit of the codes).
  void publish() {
    bf16_ld.assign(static_cast<size_t>(std::max<int64_t>(rows * ld, 1)), 0xFFFF);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(&bf16_ld[r * ld], &bf16[r * cols], cols * 2);
    const std::vector<int64_t> st = {ld, 1};
    bdesc = TensorDesc(bf16_ld.data(), DType::kBFloat16, {rows, cols}, {}, st);
    if (!fp8) return;
    for (auto [src, dst] : {std::pair{&rc, &rc_ld}, std::pair{&cc, &cc_ld}}) {
      dst->assign(static_cast<size_t>(std::max<int64_t>(rows * ld, 1)), 0x7F);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(&(*dst)[r * ld], &(*src)[r * cols], cols);
    }
    mx.rowwise_data = TensorDesc(rc_ld.data(), DType::kUInt8, {rows, cols}, {}, st);
    mx.columnwise_data = TensorDesc(cc_ld.data(), DType::kUInt8, {rows, cols}, {}, st);
    mx.rowwise_scale_inv.data = rs.data();
    mx.columnwise_scale_inv.data = cs.data();
  }
};

enum class Fill { kRandom, kInteger, kSpecial };

// values: N(0, 1) times 2^j per row (j in [-3, 3]); kInteger: integers in [-lim, lim] (E4M3 8, E5M2 4:
// exactly representable after any power-of-two scaling) times 2^int_shift; kSpecial: random with zero
// blocks in the data, then NaN / extreme / zero scale bytes written into both copies.
std::unique_ptr<QOp> make_op(int64_t rows, int64_t cols, Fill fill, Fp8Format fmt, bool swizzle, uint64_t seed,
                             int64_t pad = 0, int int_shift = 0) {
  auto o = std::make_unique<QOp>();
  o->rows = rows, o->cols = cols, o->ld = cols + pad, o->fmt = fmt, o->swz = swizzle;
  o->fp8 = cols > 0 && cols % 32 == 0;
  util::Rng rng(seed);
  o->bf16.resize(static_cast<size_t>(rows * cols));
  const int lim = fmt == Fp8Format::kE4M3 ? 8 : 4;
  for (int64_t r = 0; r < rows; ++r) {
    const double s = std::ldexp(1.0, static_cast<int>(rng.uniform() * 7) - 3);
    for (int64_t c = 0; c < cols; ++c) {
      const double v = fill == Fill::kInteger
                           ? std::ldexp(static_cast<double>(static_cast<int>(rng.uniform() * (2 * lim + 1)) - lim), int_shift)
                           : rng.normal() * s;
      o->bf16[r * cols + c] = util::to_bf16(static_cast<float>(v));
    }
  }
  if (fill == Fill::kSpecial) {  // zero blocks in the data: one rowwise block, one columnwise block
    if (rows > 2 && cols >= 32)
      for (int64_t c = 0; c < 32; ++c) o->bf16[2 * cols + c] = 0;
    if (rows > 32 && cols > 5)
      for (int64_t r = 32; r < std::min<int64_t>(rows, 64); ++r) o->bf16[r * cols + 5] = 0x8000;  // -0
  }
  if (o->fp8) {
    o->quantize_values();
    if (fill == Fill::kSpecial) {  // NaN scale, the extreme scales, a zero scale: a few blocks each
      const uint8_t bytes[] = {0xFF, 1, 254, 0, 254, 1};
      for (int i = 0; i < 6 && rows > 0; ++i) {
        const int64_t r = static_cast<int64_t>(rng.uniform() * rows), c = static_cast<int64_t>(rng.uniform() * cols);
        o->scale(true, r, c) = bytes[i];
        o->scale(false, r, c) = bytes[(i + 3) % 6];
      }
    }
  }
  o->publish();
  return o;
}

// ---------------------------------------------------------------- one GEMM against the naive one
struct Out {
  DType t = DType::kBFloat16;
  bool acc = false;
  double alpha = 1.0;
  int64_t pad = 0;  // elements after each output row (a strided out)
};

// A naive GEMM: element by element, float64 sums over k in order, alpha, + D, rounded once.
std::vector<double> naive_sums(const QOp& A, const QOp& B, bool fp8, bool ta, bool tb, int64_t M, int64_t N, int64_t K) {
  std::vector<double> s(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
        const double a = fp8 ? A.value(!ta, ar, ac) : dec_bf16(A.bf16[ar * A.cols + ac]);
        const double b = fp8 ? B.value(tb, br, bc) : dec_bf16(B.bf16[br * B.cols + bc]);
        acc += a * b;
      }
      s[m * N + n] = acc;
    }
  return s;
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
uint32_t canonical_f32(double v) { return std::isnan(v) ? 0x7FC00000u : f32_bits(static_cast<float>(v)); }

// Runs mxmla::gemm into a poisoned out (with D, a deterministic fp32 matrix, when accumulating) and
// returns every output word; `expect(m, n, d)` gives the expected word from the initial D value.
struct RunResult {
  std::vector<uint32_t> words;  // bf16 or fp32 bits per (m, n)
  int64_t untouched_bad = 0;    // padding words that changed
};
// D's [M, N] words from an out buffer of row stride ld (element size es), and the padding bytes
// (prefilled 0xAB) that changed.
RunResult collect(const std::vector<uint8_t>& buf, int64_t M, int64_t N, int64_t ld, int64_t es) {
  RunResult r;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      uint32_t w = 0;
      std::memcpy(&w, &buf[(m * ld + n) * es], es);
      r.words.push_back(w);
    }
    for (int64_t n = N; n < ld; ++n)
      for (int64_t b = 0; b < es; ++b) r.untouched_bad += buf[(m * ld + n) * es + b] != 0xAB;
  }
  return r;
}
std::vector<float> initial_d(int64_t M, int64_t N) {
  std::vector<float> d(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M * N; ++i) d[i] = static_cast<float>((i % 7) - 3) * 0.375f;
  return d;
}
RunResult run_gemm(const QOp& A, const QOp& B, bool fp8, bool ta, bool tb, int64_t M, int64_t N, const Out& o) {
  const int64_t ld = N + o.pad, es = dtype_size(o.t);
  std::vector<uint8_t> buf(static_cast<size_t>(std::max<int64_t>(M * ld, 1) * es), 0xAB);
  const std::vector<float> d = initial_d(M, N);
  if (o.acc)
    for (int64_t m = 0; m < M; ++m) std::memcpy(&buf[(m * ld) * 4], &d[m * N], N * 4);
  TensorDesc out(buf.data(), o.t, {M, N}, {}, {ld, 1});
  GemmOptions opts;
  opts.trans_a = ta, opts.trans_b = tb, opts.accumulate = o.acc, opts.alpha = o.alpha;
  gemm(A.in(fp8), B.in(fp8), out, opts);
  return collect(buf, M, N, ld, es);
}

std::string where(int64_t i, int64_t N) { return "(" + std::to_string(i / N) + ", " + std::to_string(i % N) + ")"; }

// gemm against the naive float64 GEMM, bit for bit (the same definition, written independently).
void check_gemm(const QOp& A, const QOp& B, bool fp8, bool ta, bool tb, const Out& o, const std::string& what) {
  const int64_t M = ta ? A.cols : A.rows, K = ta ? A.rows : A.cols, N = tb ? B.rows : B.cols;
  const RunResult got = run_gemm(A, B, fp8, ta, tb, M, N, o);
  const std::vector<double> s = naive_sums(A, B, fp8, ta, tb, M, N, K);
  const std::vector<float> d = initial_d(M, N);
  int64_t bad = 0;
  std::string first;
  for (int64_t i = 0; i < M * N; ++i) {
    double v = s[i] * o.alpha;
    if (o.acc) v += d[i];
    const uint32_t want = o.t == DType::kBFloat16 ? ref::double_to_bf16(v) : canonical_f32(v);
    if (got.words[i] != want && bad++ == 0) {
      std::ostringstream e;
      e << std::hex << "at " << where(i, N) << ": got 0x" << got.words[i] << ", want 0x" << want << std::dec
        << " (float64 value " << v << ")";
      first = e.str();
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << M * N << " outputs differ; first " << first;
  EXPECT_EQ(got.untouched_bad, 0) << what << ": bytes past N in a row of out were written";
}

// A list of test cases: add(f) appends a default case edited by f, with a seed of its own.
template <typename C>
struct Cases {
  std::vector<C> list;
  template <typename F>
  void add(F f) {
    C c;
    f(c);
    c.seed = list.size() * 7 + 3;
    list.push_back(c);
  }
};

// ---------------------------------------------------------------- the three GEMMs of a Linear
struct LCase {
  int64_t T = 33, K = 64, N = 32;
  Fp8Format fmt = Fp8Format::kE4M3;
  bool swz = false;  // scales of x and dy (W gets the other layout when `mixed`)
  bool mixed = false;
  Out out;
  Fill fill = Fill::kRandom;
  int64_t pad = 0;  // operand row padding
  uint64_t seed = 1;
  std::string name() const {
    std::ostringstream s;
    s << "T" << T << "_K" << K << "_N" << N << (fmt == Fp8Format::kE4M3 ? "_e4m3" : "_e5m2") << (swz ? "_swz" : "_compact")
      << (mixed ? "_mixed" : "") << (out.t == DType::kBFloat16 ? "_bf16" : "_f32") << (out.acc ? "_acc" : "");
    if (out.alpha != 1.0) s << "_alpha" << (out.alpha < 0 ? "m" : "") << static_cast<int>(std::fabs(out.alpha) * 8);
    if (out.pad) s << "_outpad";
    if (pad) s << "_strided";
    s << (fill == Fill::kSpecial ? "_special" : fill == Fill::kInteger ? "_int" : "");
    return s.str();
  }
};
void PrintTo(const LCase& c, std::ostream* os) { *os << c.name(); }

class GemmLinear : public ::testing::TestWithParam<LCase> {};

TEST_P(GemmLinear, ThreeDirectionsMatchNaiveFloat64) {
  const LCase c = GetParam();
  const auto x = make_op(c.T, c.K, c.fill, c.fmt, c.swz, c.seed, c.pad);
  const auto w = make_op(c.N, c.K, c.fill, c.fmt, c.mixed ? !c.swz : c.swz, c.seed + 1, c.pad);
  const auto dy = make_op(c.T, c.N, c.fill, c.fmt, c.swz, c.seed + 2, c.pad);
  check_gemm(*x, *w, true, false, true, c.out, "fprop y = x W^T");
  check_gemm(*dy, *w, true, false, false, c.out, "dgrad dx = dy W");
  check_gemm(*dy, *x, true, true, false, c.out, "wgrad dW = dy^T x");
}

std::vector<LCase> linear_cases() {
  Cases<LCase> v;
  auto add = [&](auto f) { v.add(f); };
  for (int64_t T : {1, 31, 32, 33, 100, 129})
    for (bool swz : {false, true}) add([&](LCase& c) { c.T = T, c.swz = swz; });
  for (auto [K, N] : {std::pair<int64_t, int64_t>{32, 32}, {96, 64}, {160, 32}, {32, 288}})
    add([&](LCase& c) { c.K = K, c.N = N, c.T = 65, c.mixed = true; });
  add([](LCase& c) { c.fmt = Fp8Format::kE5M2, c.T = 100; });
  add([](LCase& c) { c.fmt = Fp8Format::kE5M2, c.T = 31, c.swz = true; });
  add([](LCase& c) { c.out.t = DType::kFloat32, c.T = 100; });
  add([](LCase& c) { c.out.t = DType::kFloat32, c.out.acc = true, c.out.alpha = 0.375, c.T = 33, c.swz = true; });
  add([](LCase& c) { c.out.t = DType::kFloat32, c.out.acc = true, c.out.alpha = -2.0, c.T = 129, c.K = 96; });
  add([](LCase& c) { c.out.alpha = 0.125, c.T = 100; });
  add([](LCase& c) { c.out.pad = 5, c.pad = 32, c.T = 33; });
  add([](LCase& c) { c.out.pad = 3, c.out.t = DType::kFloat32, c.out.acc = true, c.pad = 1, c.T = 31, c.swz = true; });
  add([](LCase& c) { c.fill = Fill::kSpecial, c.T = 100, c.K = 96, c.N = 64; });
  add([](LCase& c) { c.fill = Fill::kSpecial, c.T = 129, c.K = 64, c.N = 160, c.swz = true, c.out.t = DType::kFloat32; });
  add([](LCase& c) { c.fill = Fill::kSpecial, c.T = 70, c.fmt = Fp8Format::kE5M2, c.out.t = DType::kFloat32; });
  return v.list;
}
INSTANTIATE_TEST_SUITE_P(Cases, GemmLinear, ::testing::ValuesIn(linear_cases()),
                         [](const ::testing::TestParamInfo<LCase>& i) { return std::to_string(i.index) + "_" + i.param.name(); });

// ---------------------------------------------------------------- single GEMMs: odd sizes, transpositions, bf16
struct GCase {
  int64_t M = 1, N = 1, K = 32;
  bool ta = false, tb = true, fp8 = true, swz_a = false, swz_b = false;
  Fp8Format fmt = Fp8Format::kE4M3;
  Out out;
  Fill fill = Fill::kRandom;
  int64_t pad = 0;
  uint64_t seed = 1;
  std::string name() const {
    std::ostringstream s;
    s << "M" << M << "_N" << N << "_K" << K << (ta ? "_ta" : "") << (tb ? "_tb" : "") << (fp8 ? "" : "_bf16in")
      << (swz_a ? "_swza" : "") << (swz_b ? "_swzb" : "") << (fmt == Fp8Format::kE5M2 ? "_e5m2" : "")
      << (out.t == DType::kFloat32 ? "_f32" : "") << (out.acc ? "_acc" : "") << (pad ? "_strided" : "")
      << (fill == Fill::kSpecial ? "_special" : "");
    return s.str();
  }
};
void PrintTo(const GCase& c, std::ostream* os) { *os << c.name(); }

class GemmCpu : public ::testing::TestWithParam<GCase> {};

TEST_P(GemmCpu, MatchesNaiveFloat64) {
  const GCase c = GetParam();
  const auto A = c.ta ? make_op(c.K, c.M, c.fill, c.fmt, c.swz_a, c.seed, c.pad)
                      : make_op(c.M, c.K, c.fill, c.fmt, c.swz_a, c.seed, c.pad);
  const auto B = c.tb ? make_op(c.N, c.K, c.fill, c.fmt, c.swz_b, c.seed + 1, c.pad)
                      : make_op(c.K, c.N, c.fill, c.fmt, c.swz_b, c.seed + 1, c.pad);
  check_gemm(*A, *B, c.fp8, c.ta, c.tb, c.out, c.name());
}

std::vector<GCase> cpu_cases() {
  Cases<GCase> v;
  auto add = [&](auto f) { v.add(f); };
  const int64_t odd[] = {1, 31, 33, 100};
  // both rowwise copies (fprop): any M and N, K a multiple of 32
  for (int64_t M : odd)
    for (int64_t N : odd) add([&](GCase& c) { c.M = M, c.N = N, c.K = (M == N ? 96 : 32), c.swz_a = M > 31, c.swz_b = N == 31; });
  // columnwise copies: any contraction length (tail blocks), the other dim a multiple of 32
  for (int64_t K : odd) add([&](GCase& c) { c.ta = true, c.tb = false, c.M = 32, c.N = 64, c.K = K, c.swz_a = K > 32; });
  add([](GCase& c) { c.ta = true, c.tb = false, c.M = 96, c.N = 32, c.K = 129, c.swz_b = true; });
  // one columnwise copy beside a rowwise one (K a multiple of 32 for the rowwise one)
  add([](GCase& c) { c.ta = true, c.M = 64, c.N = 33, c.K = 96; });
  add([](GCase& c) { c.tb = false, c.M = 31, c.N = 96, c.K = 64, c.swz_b = true; });
  // bf16 operands: any sizes, every transposition, strided
  for (int64_t M : odd)
    for (int t = 0; t < 4; ++t)
      add([&](GCase& c) {
        c.fp8 = false, c.M = M, c.N = odd[(t + 1) % 4], c.K = odd[(t + 2) % 4], c.ta = t & 1, c.tb = t & 2, c.pad = t;
        c.out.t = t == 3 ? DType::kFloat32 : DType::kBFloat16;
      });
  add([](GCase& c) { c.fp8 = false, c.M = 100, c.N = 33, c.K = 100, c.out.t = DType::kFloat32, c.out.acc = true, c.out.alpha = -0.5; });
  // special scales (NaN 0xFF, e = 1, e = 254, e = 0) and zero blocks in every direction
  for (int t = 0; t < 4; ++t)
    add([&](GCase& c) {
      c.fill = Fill::kSpecial, c.ta = t & 1, c.tb = t & 2, c.M = 64, c.N = 96, c.K = 64, c.swz_a = t == 1, c.swz_b = t >= 2;
      c.out.t = t % 2 ? DType::kFloat32 : DType::kBFloat16;
    });
  add([](GCase& c) { c.fill = Fill::kSpecial, c.fmt = Fp8Format::kE5M2, c.M = 40, c.N = 33, c.K = 96; });
  // the columnwise copies of x are those of a [0, K] tensor: wgrad over no tokens (K = 0)
  add([](GCase& c) { c.ta = true, c.tb = false, c.M = 32, c.N = 64, c.K = 0; });
  add([](GCase& c) { c.ta = true, c.tb = false, c.M = 32, c.N = 64, c.K = 0, c.out.t = DType::kFloat32, c.out.acc = true; });
  add([](GCase& c) { c.M = 0, c.N = 5, c.K = 32; });
  return v.list;
}
INSTANTIATE_TEST_SUITE_P(Cases, GemmCpu, ::testing::ValuesIn(cpu_cases()),
                         [](const ::testing::TestParamInfo<GCase>& i) { return std::to_string(i.index) + "_" + i.param.name(); });

// The dequantizing passes index a GEMM operand's own scales by OpScaleIndex (no per-element
// switch over the layouts): the same byte as the maps' offsets for every block, both directions,
// compact and swizzled, tails (rows not a multiple of 32 / 128, block columns not of 4), batch > 1.
TEST(GemmScaleIndex, EqualsTheMapsOffsetsForEveryBlock) {
  using namespace detail;
  int64_t checked = 0;
  for (MapMode mode : {MapMode::kCompact, MapMode::kSwizzled})
    for (int64_t batch : {1, 2})
      for (int64_t a : {1, 31, 33, 130, 257})
        for (int64_t b : {32, 96, 160, 512}) {
          // rowwise: X [R = batch·a, K = b] (K a multiple of 32)
          const ScaleMap rm = make_row_map(mode, batch, a, b);
          const OpScaleIndex ri = op_scale_index(rm, true);
          for (int64_t r = 0; r < batch * a; ++r)
            for (int64_t kb = 0; kb < b / 32; ++kb, ++checked)
              ASSERT_EQ(ri.at(r, kb), row_scale_offset(rm, 0, r, kb)) << "rowwise r " << r << " kb " << kb;
          // columnwise: X [K = a tokens, R = b] (one batch: a columnwise copy's blocks run down K)
          if (batch != 1) continue;
          const ScaleMap cm = make_col_map(mode, 1, a, b);
          const OpScaleIndex ci = op_scale_index(cm, false);
          for (int64_t r = 0; r < b; ++r)
            for (int64_t kb = 0; kb < (a + 31) / 32; ++kb, ++checked)
              ASSERT_EQ(ci.at(r, kb), col_scale_offset(cm, 0, kb, r)) << "columnwise r " << r << " kb " << kb;
        }
  EXPECT_GT(checked, 10000);
}

// Design B's fold of a block (common/mxfp8_common.h: the function the kernel calls, here on the
// host): acc + t · 2^(ea − 127) · 2^(eb − 127) against the exactly rounded value, for every pair of
// scale bytes and block sums across both FP8 formats' range (zero, ±Inf, NaN, full mantissas, the
// largest E5M2 block 49 · 2^31). One rounding everywhere, but where |t · fa · fb| < 2^-148: there
// one subnormal step (2^-149) at most. And the converter's fast path (the product alone, for blocks
// whose every pair has ea + eb in [105, 381]) gives the same bits there.
TEST(GemmFold, RoundsOnceAtEveryPairOfScaleBytes) {
  using namespace detail;
  std::vector<float> ts = {0.f, -0.f, 1.f, -1.f, 0x1.fffffep0f, 0x1p-32f, -0x1.000002p-18f, 49.f * 0x1p31f,
                           -0x1.234566p37f, 0x1.800002p10f, 3.f, 0x1.fffffep23f, std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  util::Rng rng(7);
  for (int i = 0; i < 40; ++i)  // random 24-bit mantissas, exponents -32 .. 37, both signs
    ts.push_back(static_cast<float>(std::ldexp((rng.uniform() < 0.5 ? -1 : 1) * (1 + rng.uniform()),
                                               static_cast<int>(rng.uniform() * 70) - 32)));
  int64_t checked = 0, off_by_a_step = 0, bad = 0;
  std::string first;
  for (uint32_t ea = 0; ea < 256; ++ea)
    for (uint32_t eb = 0; eb < 256; ++eb)
      for (float t : ts) {
        const float fa = e8m0_factor(ea), fb = e8m0_factor(eb);
        const float got = fold_block_scales(t, fa, fb, 0.f);
        ++checked;
        // + 0.0: acc = +0 turns an exact -0 into +0, as the fold's addition does
        const double x = std::ldexp(static_cast<double>(t), static_cast<int>(ea + eb) - 254) + 0.0;
        const bool nan = ea == 255 || eb == 255 || std::isnan(t);
        float want;
        if (nan || std::isnan(x)) want = std::numeric_limits<float>::quiet_NaN();
        else if (std::fabs(x) >= 0x1.ffffffp127)  // rounds past FLT_MAX: an infinity of its sign
          want = x > 0 ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
        else want = static_cast<float>(x);
        bool ok = std::isnan(want) ? std::isnan(got) : f32_as_u32(got) == f32_as_u32(want);
        if (!ok && !std::isnan(want) && std::fabs(x) < 0x1p-148 && std::fabs(double(got) - double(want)) <= 0x1p-149) {
          ok = true;
          ++off_by_a_step;
        }
        if (ok && ea + eb >= kFactorProductLo && ea + eb <= kFactorProductHi) {
          const float fast = fold_block_product(t, fa, fb, 0.f);
          ok = std::isnan(got) ? std::isnan(fast) : f32_as_u32(fast) == f32_as_u32(got);
        }
        if (!ok && bad++ == 0) {
          std::ostringstream e;
          e << "ea " << ea << " eb " << eb << " t " << t << ": got " << got << ", want " << want;
          first = e.str();
        }
      }
  EXPECT_EQ(bad, 0) << bad << " of " << checked << "; first: " << first;
  EXPECT_LT(off_by_a_step, checked / 1000) << "subnormal double roundings";
  EXPECT_GT(checked, 3000000);
}

TEST(GemmCpuSpecial, NanScaleReachesExactlyItsRowAndLargeScalesOverflow) {
  // x [4, 64] of ones (rowwise scale 127 - 8 = 119 for E4M3: 1 = 256 * 2^-8), W [3, 64] of ones
  auto x = make_op(4, 64, Fill::kRandom, Fp8Format::kE4M3, false, 1);
  auto w = make_op(3, 64, Fill::kRandom, Fp8Format::kE4M3, false, 2);
  for (auto* o : {x.get(), w.get()}) {
    std::fill(o->bf16.begin(), o->bf16.end(), util::to_bf16(1.0f));
    o->quantize_values();
  }
  x->scale(true, 1, 40) = 0xFF;  // row 1, second block: NaN
  x->scale(true, 2, 0) = 254;    // row 2: 2^127 * 256 * ... overflows fp32
  x->publish(), w->publish();
  std::vector<float> y(12);
  TensorDesc out(y.data(), DType::kFloat32, {4, 3});
  gemm(x->in(true), w->in(true), out, GemmOptions{});
  for (int n = 0; n < 3; ++n) {
    EXPECT_EQ(y[0 * 3 + n], 64.0f);
    EXPECT_EQ(f32_bits(y[1 * 3 + n]), 0x7FC00000u) << "NaN scale: the canonical NaN";
    EXPECT_EQ(y[2 * 3 + n], INFINITY);
    EXPECT_EQ(y[3 * 3 + n], 64.0f);
  }
}

// ---------------------------------------------------------------- integer-valued data: fp32 sums are exact
struct ECase {
  int64_t T = 100, K = 96, N = 64;
  Fp8Format fmt = Fp8Format::kE4M3;
  bool swz = false;
  Out out;
  int shift_x = 0, shift_w = 0;  // powers of two on the integer values (scales away from 127)
};

class GemmExact : public ::testing::TestWithParam<ECase> {};

// What the GPU kernel computes: exact products, fp32 sums in any order (all exact here), * alpha,
// + D in fp32, rounded to the output.
TEST_P(GemmExact, ReferenceEqualsFp32AccumulationBitForBit) {
  const ECase c = GetParam();
  const auto x = make_op(c.T, c.K, Fill::kInteger, c.fmt, c.swz, 5, 0, c.shift_x);
  const auto w = make_op(c.N, c.K, Fill::kInteger, c.fmt, !c.swz, 6, 0, c.shift_w);
  const auto dy = make_op(c.T, c.N, Fill::kInteger, c.fmt, c.swz, 7, 0, c.shift_x);
  // quantization of these values is exact in both copies
  for (const QOp* o : {x.get(), w.get(), dy.get()})
    for (int64_t r = 0; r < o->rows; ++r)
      for (int64_t col = 0; col < o->cols; ++col)
        for (bool rw : {true, false}) ASSERT_EQ(o->value(rw, r, col), dec_bf16(o->bf16[r * o->cols + col]));
  struct Dir {
    const QOp *A, *B;
    bool ta, tb;
    const char* what;
  };
  for (const Dir& d : {Dir{x.get(), w.get(), false, true, "fprop"}, Dir{dy.get(), w.get(), false, false, "dgrad"},
                       Dir{dy.get(), x.get(), true, false, "wgrad"}}) {
    const int64_t M = d.ta ? d.A->cols : d.A->rows, K = d.ta ? d.A->rows : d.A->cols, N = d.tb ? d.B->rows : d.B->cols;
    const RunResult got = run_gemm(*d.A, *d.B, true, d.ta, d.tb, M, N, c.out);
    const std::vector<float> D = initial_d(M, N);
    int64_t bad = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float acc = 0.0f;  // fp32 accumulation, k descending (the order does not matter: every sum is exact)
        for (int64_t k = K - 1; k >= 0; --k) {
          const float a = static_cast<float>(d.A->value(!d.ta, d.ta ? k : m, d.ta ? m : k));
          const float b = static_cast<float>(d.B->value(d.tb, d.tb ? n : k, d.tb ? k : n));
          acc += a * b;
        }
        float v = acc * static_cast<float>(c.out.alpha);
        if (c.out.acc) v += D[m * N + n];
        const uint32_t want = c.out.t == DType::kBFloat16 ? util::to_bf16(v) : f32_bits(v);
        bad += got.words[m * N + n] != want;
      }
    EXPECT_EQ(bad, 0) << d.what << ": outputs differing from the fp32 accumulation";
  }
}

std::vector<ECase> exact_cases() {
  std::vector<ECase> v;
  v.push_back({});
  v.push_back({129, 160, 32, Fp8Format::kE4M3, true, {}, -3, 5});
  v.push_back({31, 64, 96, Fp8Format::kE5M2, false, {}, 2, -4});
  v.push_back({100, 96, 64, Fp8Format::kE4M3, true, {DType::kFloat32, true, 0.5, 0}, 0, 0});
  v.push_back({33, 32, 32, Fp8Format::kE5M2, true, {DType::kFloat32, false, -2.0, 0}, -1, 1});
  v.push_back({65, 64, 64, Fp8Format::kE4M3, false, {DType::kBFloat16, false, 0.25, 2}, 6, -6});
  // scale bytes above the bf16 fast path's range (E4M3 > 134, E5M2 > 142): design A's exact path
  v.push_back({70, 128, 96, Fp8Format::kE4M3, false, {DType::kFloat32, false, 1.0, 0}, 20, -20});
  v.push_back({70, 128, 96, Fp8Format::kE5M2, true, {DType::kFloat32, false, 1.0, 0}, -30, 30});
  // T 300, K 288, N 544: more than one 128 x 256 tile each way, partial tiles whose rows 128..255
  // hold no data (fprop N = 544 = 2 * 256 + 32; dgrad N = K = 288 = 256 + 32)
  v.push_back({300, 288, 544, Fp8Format::kE4M3, true, {}, 0, 0});
  // long contractions with a narrow output, which the GPU launcher gives design D per call (its
  // stage ring wraps many times): wgrad over T 6200 (A = dy's columnwise codes, read as stored; a
  // partial last block of 24 tokens), dgrad over N 6176 (A = dy rowwise); sums up to 6200 · 64 <
  // 2^24, still exact
  v.push_back({6200, 96, 64, Fp8Format::kE4M3, false, {}, 0, 0});
  v.push_back({40, 64, 6176, Fp8Format::kE5M2, true, {DType::kFloat32, false, 1.0, 0}, 0, 0});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, GemmExact, ::testing::ValuesIn(exact_cases()));

// ---------------------------------------------------------------- errors
void expect_error(const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
  test::expect_error("mxmla.gemm", fn, arg, rule);
}

// A small valid fprop (x [4, 64], W [32, 64] -> y [4, 32] bf16) whose pieces each test breaks.
struct Call {
  std::unique_ptr<QOp> x = make_op(4, 64, Fill::kRandom, Fp8Format::kE4M3, false, 1);
  std::unique_ptr<QOp> w = make_op(32, 64, Fill::kRandom, Fp8Format::kE4M3, true, 2);
  MXFP8Tensor xm = x->mx, wm = w->mx;
  TensorDesc xb = x->bdesc, wb = w->bdesc;
  std::vector<float> ob = std::vector<float>(4 * 40);
  TensorDesc out{ob.data(), DType::kBFloat16, {4, 32}};
  GemmOptions opts;
  void mx() { gemm({nullptr, &xm}, {nullptr, &wm}, out, opts); }
  void bf() { gemm({&xb, nullptr}, {&wb, nullptr}, out, opts); }
};

TEST(GemmErrors, EveryRuleNamesItsArgument) {
  {
    Call a;
    a.mx(), a.bf();  // valid
  }
  auto mx = [](auto mutate) {
    return [mutate] {
      Call a;
      mutate(a);
      a.mx();
    };
  };
  auto bf = [](auto mutate) {
    return [mutate] {
      Call a;
      mutate(a);
      a.bf();
    };
  };
  // operands
  expect_error([] { Call a; gemm({nullptr, nullptr}, {nullptr, &a.wm}, a.out, a.opts); }, "a", "exactly one");
  expect_error([] { Call a; gemm({nullptr, &a.xm}, {&a.wb, &a.wm}, a.out, a.opts); }, "b", "exactly one");
  expect_error(bf([](Call& a) { a.xb.dtype = DType::kFloat32; }), "a", "dtype float32 must be bfloat16");
  expect_error(bf([](Call& a) { a.wb.shape = {32, 64, 1}; }), "b", "must be 2-D");
  expect_error(bf([](Call& a) { a.xb.strides = {64, 2}; }), "a", "last dimension must be contiguous");
  expect_error(bf([](Call& a) { a.xb.data = nullptr; }), "a", "null");
  expect_error([] { Call a; gemm({nullptr, &a.xm}, {&a.wb, nullptr}, a.out, a.opts); }, "b",
               "is bfloat16 but a is MXFP8: both operands must be MXFP8 or both bfloat16");
  expect_error([] { Call a; gemm({&a.xb, nullptr}, {nullptr, &a.wm}, a.out, a.opts); }, "b", "is MXFP8 but a is bfloat16");
  expect_error(mx([](Call& a) { a.wm.format = Fp8Format::kE5M2; }), "b", "FP8 format e5m2 differs from a's e4m3");
  // the copy each direction needs, and why
  expect_error(mx([](Call& a) { a.xm.rowwise_data = TensorDesc(); }), "a.rowwise_data",
               "is absent: with trans_a = false A is [M, K] and the contraction runs along its last dim, so the GEMM "
               "reads A's rowwise copy: blocks of 32 along K, the contraction axis");
  expect_error(mx([](Call& a) { a.wm.rowwise_data.data = nullptr; }), "b.rowwise_data", "fprop reads W's");
  expect_error(mx([](Call& a) { a.wm.columnwise_data = TensorDesc(), a.opts.trans_b = false; }), "b.columnwise_data",
               "dgrad reads W's: blocks of 32 along N");
  expect_error(mx([](Call& a) { a.xm.columnwise_data = TensorDesc(), a.opts.trans_a = true; }), "a.columnwise_data",
               "wgrad reads dy's: blocks of 32 along the tokens");
  // sizes
  expect_error(mx([](Call& a) { a.opts.trans_b = false; }), "b",
               "contraction length 32 (b's leading dim, trans_b = false) does not match a's K = 64");
  expect_error(bf([](Call& a) { a.wb.shape = {32, 48}; }), "b", "contraction length 48");
  expect_error(mx([](Call& a) { a.xm.shape = {4, 48}; }), "a.shape",
               "contraction length K = 48 (the last dim of [4, 48]) must be a positive multiple of 32: A's rowwise copy "
               "has blocks of 32 along K");
  expect_error(mx([](Call& a) { a.xm.shape = {2, 4, 64}; }), "a.shape", "must be 2-D");
  expect_error(mx([](Call& a) { a.wm.shape = {64, 48}, a.opts.trans_b = false; }), "b.shape",
               "last dimension 48 of [64, 48] must be a positive multiple of 32");
  // codes and scales
  expect_error(mx([](Call& a) { a.xm.rowwise_data.shape = {4, 32}; }), "a.rowwise_data", "must equal the tensor's shape [4, 64]");
  expect_error(mx([](Call& a) { a.xm.rowwise_data.dtype = DType::kFloat8E5M2; }), "a.rowwise_data", "must be uint8 or float8_e4m3");
  expect_error(mx([](Call& a) { a.xm.rowwise_data.strides = {64, 2}; }), "a.rowwise_data", "last dimension must be contiguous");
  expect_error(mx([](Call& a) { a.xm.rowwise_scale_inv.shape = {4, 1}; }), "a.rowwise_scale_inv",
               "must be [4, 2] (the rowwise compact scales");
  expect_error(mx([](Call& a) { a.wm.scale_layout = ScaleLayout::kCompact; }), "b.rowwise_scale_inv",
               "must be [32, 2] (the rowwise compact scales");
  expect_error(mx([](Call& a) { a.wm.rowwise_scale_inv.dtype = DType::kInt32; }), "b.rowwise_scale_inv", "uint8 or e8m0");
  expect_error(mx([](Call& a) { a.xm.rowwise_scale_inv.strides = {1, 4}; }), "a.rowwise_scale_inv", "contiguous");
  expect_error(mx([](Call& a) { a.xm.rowwise_scale_inv.data = nullptr; }), "a.rowwise_scale_inv", "null");
  expect_error(mx([](Call& a) { a.xm.scale_layout = ScaleLayout::kBHSD; }), "a", "attention hand-off");
  expect_error(mx([](Call& a) { a.wm.attention = true; }), "b", "a GEMM operand comes from quantize");
  // out
  expect_error(mx([](Call& a) { a.out.shape = {4, 33}; }), "out", "must be [M, N] = [4, 32]");
  expect_error(mx([](Call& a) { a.out.shape = {128}; }), "out", "must be 2-D");
  expect_error(mx([](Call& a) { a.out.dtype = DType::kFloat16; }), "out", "must be bfloat16 or float32");
  expect_error(mx([](Call& a) { a.opts.accumulate = true; }), "out", "must be float32 with accumulate");
  expect_error(mx([](Call& a) { a.out.strides = {32, 2}; }), "out", "last dimension must be contiguous");
  expect_error(mx([](Call& a) { a.out.strides = {16, 1}; }), "out", "row stride 16 is smaller than N = 32");
  expect_error(mx([](Call& a) { a.out.data = nullptr; }), "out", "null");
  expect_error(mx([](Call& a) { a.opts.alpha = NAN; }), "alpha", "must be finite");
  expect_error(mx([](Call& a) { a.opts.alpha = INFINITY; }), "alpha", "must be finite");
  // devices
  expect_error(mx([](Call& a) { a.wm.rowwise_data.device = Device{DeviceType::kCUDA, 0}; }), "b.rowwise_data",
               "is on cuda:0 but a.rowwise_data is on cpu:0: both operands and out must be on one device");
  expect_error(mx([](Call& a) { a.xm.rowwise_scale_inv.device = Device{DeviceType::kCUDA, 1}; }), "a.rowwise_scale_inv",
               "is on cuda:1");
  expect_error(mx([](Call& a) { a.out.device = Device{DeviceType::kCUDA, 0}; }), "out", "one device");
  // a strided out with rows far apart, and an accumulate into fp32: valid
  {
    Call a;
    a.out.strides = {40, 1};
    a.mx();
    a.out.dtype = DType::kFloat32, a.opts.accumulate = true;
    a.mx();
  }
}

// ---------------------------------------------------------------- the CUDA path
void on_cuda(Call& a, int index = 0) {
  const Device d{DeviceType::kCUDA, index};
  for (TensorDesc* t : {&a.xm.rowwise_data, &a.xm.rowwise_scale_inv, &a.xm.columnwise_data, &a.xm.columnwise_scale_inv,
                        &a.wm.rowwise_data, &a.wm.rowwise_scale_inv, &a.wm.columnwise_data, &a.wm.columnwise_scale_inv,
                        &a.xb, &a.wb, &a.out})
    t->device = d;
}

// Runs on the CPU: descriptors marked cuda:0 over host memory that is never touched. Every rule
// is checked before the CUDA path says it has no kernel, so bad input keeps its own error.
TEST(GemmCudaPath, ValidationFirstThenPointers) {
  {
    Call a;
    on_cuda(a);
    std::fill(a.ob.begin(), a.ob.end(), 7.0f);
#if MXMLA_WITH_CUDA
    expect_error([&] { a.mx(); }, "a.rowwise_data", "cuda:0");  // host memory described as CUDA
#else
    expect_error([&] { a.mx(); }, "a.rowwise_data", "no CUDA support");  // (a build without nvcc)
#endif
    for (float v : a.ob) ASSERT_EQ(v, 7.0f) << "nothing is written";
    expect_error([&] { a.bf(); }, "a", "the CUDA bf16 GEMM kernel is not available in this build yet");
    expect_error([&] { a.bf(); }, "a", "run a bf16 matmul");
  }
  auto cuda = [](auto mutate) {
    return [mutate] {
      Call a;
      on_cuda(a);
      mutate(a);
      a.mx();
    };
  };
  expect_error(cuda([](Call& a) { a.out.shape = {4, 31}; }), "out", "must be [M, N] = [4, 32]");
  expect_error(cuda([](Call& a) { a.opts.trans_b = false, a.wm.columnwise_data = TensorDesc(); }), "b.columnwise_data",
               "is absent");
  expect_error(cuda([](Call& a) { a.wm.format = Fp8Format::kE5M2; }), "b", "differs from a's");
  expect_error(cuda([](Call& a) { a.opts.accumulate = true; }), "out", "must be float32 with accumulate");
  expect_error(cuda([](Call& a) { a.wm.rowwise_data.device = Device{DeviceType::kCUDA, 1}; }), "b.rowwise_data",
               "is on cuda:1 but a.rowwise_data is on cuda:0");
  expect_error(cuda([](Call& a) { a.out.device = Device{}; }), "out", "is on cpu:0 but a.rowwise_data is on cuda:0");
}

#if MXMLA_WITH_CUDA
// An operand's MXFP8 buffers copied to the GPU with the same strides: a device MXFP8Tensor.
struct DevOp {
  util::DeviceBuffer rc, rs, cc, cs;
  MXFP8Tensor mx;
  explicit DevOp(const QOp& o) : rc(o.rc_ld.size()), rs(o.rs.size()), cc(o.cc_ld.size()), cs(o.cs.size()) {
    rc.upload(o.rc_ld.data()), rs.upload(o.rs.data()), cc.upload(o.cc_ld.data()), cs.upload(o.cs.data());
    mx = o.mx;
    const Device d{DeviceType::kCUDA, 0};
    mx.rowwise_data.data = rc.ptr, mx.rowwise_scale_inv.data = rs.ptr;
    mx.columnwise_data.data = cc.ptr, mx.columnwise_scale_inv.data = cs.ptr;
    for (TensorDesc* t : {&mx.rowwise_data, &mx.rowwise_scale_inv, &mx.columnwise_data, &mx.columnwise_scale_inv})
      t->device = d;
  }
};

// run_gemm on the GPU: the same output buffer (padding 0xAB, D preloaded), read back.
RunResult run_gemm_gpu(const QOp& A, const QOp& B, bool ta, bool tb, int64_t M, int64_t N, const Out& o) {
  DevOp da(A), db(B);
  const int64_t ld = N + o.pad, es = dtype_size(o.t);
  std::vector<uint8_t> buf(static_cast<size_t>(std::max<int64_t>(M * ld, 1) * es), 0xAB);
  const std::vector<float> d = initial_d(M, N);
  if (o.acc)
    for (int64_t m = 0; m < M; ++m) std::memcpy(&buf[(m * ld) * 4], &d[m * N], N * 4);
  util::DeviceBuffer dout(buf.size());
  dout.upload(buf.data());
  TensorDesc out(dout.ptr, o.t, {M, N}, Device{DeviceType::kCUDA, 0}, {ld, 1});
  GemmOptions opts;
  opts.trans_a = ta, opts.trans_b = tb, opts.accumulate = o.acc, opts.alpha = o.alpha;
  gemm({nullptr, &da.mx}, {nullptr, &db.mx}, out, opts);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  buf = dout.download<uint8_t>();
  return collect(buf, M, N, ld, es);
}
#endif

// On integer data every fp32 partial sum is exact: the kernel's output equals the reference's bit
// for bit, in all three directions.
class GemmGpuExact : public ::testing::TestWithParam<ECase> {};
TEST_P(GemmGpuExact, MatchesReferenceBitForBit) {
  MXMLA_REQUIRE_GPU();
#if MXMLA_WITH_CUDA
  const ECase c = GetParam();
  const auto x = make_op(c.T, c.K, Fill::kInteger, c.fmt, c.swz, 5, 0, c.shift_x);
  const auto w = make_op(c.N, c.K, Fill::kInteger, c.fmt, !c.swz, 6, 0, c.shift_w);
  const auto dy = make_op(c.T, c.N, Fill::kInteger, c.fmt, c.swz, 7, 0, c.shift_x);
  struct Dir {
    const QOp *A, *B;
    bool ta, tb;
    const char* what;
  };
  for (const Dir& d : {Dir{x.get(), w.get(), false, true, "fprop"}, Dir{dy.get(), w.get(), false, false, "dgrad"},
                       Dir{dy.get(), x.get(), true, false, "wgrad"}}) {
    const int64_t M = d.ta ? d.A->cols : d.A->rows, N = d.tb ? d.B->rows : d.B->cols;
    const RunResult want = run_gemm(*d.A, *d.B, true, d.ta, d.tb, M, N, c.out);
    const RunResult got = run_gemm_gpu(*d.A, *d.B, d.ta, d.tb, M, N, c.out);
    int64_t bad = 0;
    std::string first;
    for (int64_t i = 0; i < M * N; ++i)
      if (got.words[i] != want.words[i] && bad++ == 0) first = where(i, N);
    EXPECT_EQ(bad, 0) << d.what << ": " << bad << " of " << M * N << " outputs differ; first at " << first;
    EXPECT_EQ(got.untouched_bad, 0) << d.what << ": bytes past N in a row of out were written";
  }
#endif
}
INSTANTIATE_TEST_SUITE_P(Cases, GemmGpuExact, ::testing::ValuesIn(exact_cases()));

// Random data (and special scales): within the accumulation bound of the float64 reference. Design A
// (bf16 wgmma on the dequantized values) sums in fp32 throughout; design B (the fallback for tiny
// scales) sums across the 32-wide blocks in fp32, but inside one block the FP8 tensor cores add the
// 32 exact products with their own adder, which keeps about 14 bits (DeepSeek-V3 §3.3.2, SPEC §7):
// the bound is 2^-10 * sum |a b| + the output rounding. NaN exactly where the reference has it. (Integer data,
// whose every partial sum fits 14 bits, is compared bit for bit above.)
struct RndCase {
  int64_t T, K, N;
  Fill fill;
  Fp8Format fmt;
  bool swz;
  Out out;
};
class GemmGpuRandom : public ::testing::TestWithParam<RndCase> {};
TEST_P(GemmGpuRandom, WithinTheFp32AccumulationBound) {
  MXMLA_REQUIRE_GPU();
#if MXMLA_WITH_CUDA
  const RndCase c = GetParam();
  const auto x = make_op(c.T, c.K, c.fill, c.fmt, c.swz, 11);
  const auto w = make_op(c.N, c.K, c.fill, c.fmt, !c.swz, 12);
  const auto dy = make_op(c.T, c.N, c.fill, c.fmt, c.swz, 13);
  // MXMLA_GEMM_DESIGN=A, C or D forces a bf16 design for every call: it multiplies each dequantized
  // value rounded to bf16 (README: tiny values lose bits), so the bound is about those values;
  // per call (and with B forced) the products are of the exact values
  const char* forced = std::getenv("MXMLA_GEMM_DESIGN");
  const bool bf16_values = forced != nullptr && (forced[0] == 'A' || forced[0] == 'C' || forced[0] == 'D');
  const auto held = [&](double v) {
    return bf16_values ? ref::bf16_to_double(util::to_bf16(static_cast<float>(v))) : v;
  };
  struct Dir {
    const QOp *A, *B;
    bool ta, tb;
    const char* what;
  };
  for (const Dir& d : {Dir{x.get(), w.get(), false, true, "fprop"}, Dir{dy.get(), w.get(), false, false, "dgrad"},
                       Dir{dy.get(), x.get(), true, false, "wgrad"}}) {
    if (!d.A->fp8 || !d.B->fp8) continue;  // a rowwise copy needs a contraction of whole blocks
    const int64_t M = d.ta ? d.A->cols : d.A->rows, K = d.ta ? d.A->rows : d.A->cols, N = d.tb ? d.B->rows : d.B->cols;
    const RunResult got = run_gemm_gpu(*d.A, *d.B, d.ta, d.tb, M, N, c.out);
    const std::vector<float> D = initial_d(M, N);
    int64_t bad = 0;
    std::string first;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0, abs_sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double a = held(d.A->value(!d.ta, d.ta ? k : m, d.ta ? m : k));
          const double b = held(d.B->value(d.tb, d.tb ? n : k, d.tb ? k : n));
          sum += a * b, abs_sum += std::fabs(a * b);
        }
        double ref = sum * c.out.alpha;
        if (c.out.acc) ref += D[m * N + n];
        const uint32_t w = got.words[m * N + n];
        const double g = c.out.t == DType::kBFloat16 ? ref::bf16_to_double(static_cast<uint16_t>(w))
                                                     : static_cast<double>(detail::u32_as_f32(w));
        bool ok;
        if (std::isnan(ref)) ok = std::isnan(g);
        else {
          const double tol = std::ldexp(1.0, -10) * abs_sum * std::fabs(c.out.alpha) +
                             std::ldexp(std::fabs(ref), c.out.t == DType::kBFloat16 ? -8 : -23) + 1e-30;
          // beyond the output's range (extreme scales): the bound's whole interval above the largest
          // finite value -> an infinity of ref's sign; straddling it -> either. Where Σ|a·b| itself
          // passes fp32's range a partial sum may overflow: then any infinity or NaN
          const double top = c.out.t == DType::kBFloat16 ? 0x1.FEp127 : 0x1.FFFFFEp127;
          if (abs_sum * std::fabs(c.out.alpha) > 0x1.FFFFFEp127 && !std::isfinite(g)) ok = true;
          else if (std::fabs(ref) - tol > top) ok = std::isinf(g) && (g > 0) == (ref > 0);
          else if (std::fabs(ref) + tol > top && std::isinf(g)) ok = (g > 0) == (ref > 0);
          else ok = std::fabs(g - ref) <= tol;
        }
        if (!ok && bad++ == 0) {
          std::ostringstream e;
          e << where(m * N + n, N) << ": got " << g << ", want " << ref;
          first = e.str();
        }
      }
    EXPECT_EQ(bad, 0) << d.what << ": " << bad << " of " << M * N << " outside the bound; first " << first;
    EXPECT_EQ(got.untouched_bad, 0) << d.what;
  }
#endif
}
std::vector<RndCase> gpu_random_cases() {
  std::vector<RndCase> v;
  const Out bf{}, f32acc{DType::kFloat32, true, 0.5, 0}, f32pad{DType::kFloat32, false, 1.0, 3};
  for (int64_t T : {1, 31, 33, 257})
    for (int64_t K : {32, 160}) v.push_back({T, K, 64, Fill::kRandom, Fp8Format::kE4M3, false, bf});
  v.push_back({1000, 1536, 130, Fill::kRandom, Fp8Format::kE4M3, true, bf});
  v.push_back({300, 256, 96, Fill::kRandom, Fp8Format::kE5M2, false, f32acc});
  v.push_back({129, 96, 33, Fill::kRandom, Fp8Format::kE4M3, true, f32pad});
  v.push_back({100, 128, 64, Fill::kSpecial, Fp8Format::kE4M3, false, bf});
  v.push_back({100, 128, 64, Fill::kSpecial, Fp8Format::kE5M2, true, f32acc});
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, GemmGpuRandom, ::testing::ValuesIn(gpu_random_cases()));

}  // namespace
}  // namespace mxmla
