// Attention forward (include/mxmla/attention.h, SPEC §5):
//   AttentionFwdCpu   the CPU reference against an independent float64 attention written here, on the
//                  dequantized inputs (mxmla::dequantize of each operand's quantized buffers): every
//                  format, GQA, both causal alignments, thd with empty and one-token sequences, bf16
//                  and MXFP8 inputs in every scale layout the library writes, packed and strided
//                  views, and the E4M3 P definition (with its own E4M3 rounding);
//   AttentionFwdGpu   the CUDA op against the CPU reference (relative RMS of O <= 0.5 %, every element
//                  within 0.02 + 0.02 |ref|, LSE within 1e-4, untouched bytes untouched); skipped
//                  without a CUDA device;
//   *Errors        bad arguments: mxmla::Error naming the argument.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>

#include "cpu/reference.h"
#include "mxmla/attention.h"
#include "test_util.h"

namespace mxmla {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// How an operand is given: bf16, or MXFP8 from quantize_attention (compact / BHSD scales, sbhd and
// bshd), from quantize of the operand's own shape (compact / swizzled) or of its [tokens, h*d] view.
enum class In { kBF16, kAttnCompact, kAttnBHSD, kPlain, kPlainSwizzled, kTokens };

const char* fmt_name(AttnFormat f) {
  return f == AttnFormat::kSBHD ? "sbhd" : f == AttnFormat::kBSHD ? "bshd" : f == AttnFormat::kBHSD ? "bhsd" : "thd";
}
const char* in_name(In i) {
  static const char* n[] = {"bf16", "attn", "attnbhsd", "plain", "swz", "tokens"};
  return n[static_cast<int>(i)];
}

struct ACase {
  int64_t B = 1, Sq = 8, Skv = 8, H = 2, Hkv = 2, Dqk = 64, Dv = 32;
  AttnFormat qf = AttnFormat::kSBHD, kvf = AttnFormat::kSBHD;
  std::vector<int32_t> lq, lkv;  // thd: sequence lengths (B = their count)
  int64_t tail = 0;              // thd: tokens after the last sequence (neither read nor written)
  bool causal = false, br = false;
  In in = In::kBF16;
  Fp8Format fmt = Fp8Format::kE4M3;
  PFormat pf = PFormat::kBF16;
  bool packed = false;       // q, k, v views into one storage ([s, b, 3, h, d], [b, s, 3, h, d], [t, 3, h, d])
  int64_t pad = 0;           // elements after each head row (strided operands and o)
  bool lse = true;
  bool max_seqlen = false;   // thd: pass max_seqlen_q / _kv (no host copy of cu_seqlens on CUDA)
  double scale = 0;
  uint64_t seed = 1;
  bool thd() const { return qf == AttnFormat::kTHD; }
  std::string name() const {
    std::ostringstream s;
    if (thd()) {
      s << "thd";
      for (int32_t l : lq) s << "_" << l;
      s << "_kv";
      for (int32_t l : lkv) s << "_" << l;
      if (tail) s << "_tail" << tail;
    } else {
      s << "b" << B << "_sq" << Sq << "_skv" << Skv << "_" << fmt_name(qf);
      if (kvf != qf) s << "_kv" << fmt_name(kvf);
    }
    s << "_h" << H << "_" << Hkv << "_d" << Dqk << "_" << Dv << "_" << in_name(in);
    if (in != In::kBF16 && fmt == Fp8Format::kE5M2) s << "_e5m2";
    if (causal) s << (br ? "_causalbr" : "_causal");
    if (pf == PFormat::kE4M3) s << "_pe4m3";
    if (packed) s << "_packed";
    if (pad) s << "_pad" << pad;
    if (!lse) s << "_nolse";
    if (max_seqlen) s << "_maxlen";
    if (scale != 0) s << "_scaled";
    return s.str();
  }
};
void PrintTo(const ACase& c, std::ostream* os) { *os << c.name(); }

// ---------------------------------------------------------------- layouts
std::vector<int64_t> fshape(AttnFormat f, int64_t B, int64_t S, int64_t H, int64_t D) {
  switch (f) {
    case AttnFormat::kSBHD: return {S, B, H, D};
    case AttnFormat::kBSHD: return {B, S, H, D};
    case AttnFormat::kBHSD: return {B, H, S, D};
    default: return {S, H, D};  // thd: S = tokens
  }
}
// Strides of a view: head rows padded by `pad`, or one of `npack` tensors packed along a dim
// before h ([.., npack, h, d]).
std::vector<int64_t> view_strides(const std::vector<int64_t>& shape, int64_t pad, int64_t npack) {
  const size_t r = shape.size();
  std::vector<int64_t> st(r);
  st[r - 1] = 1;
  st[r - 2] = npack > 1 ? shape[r - 1] : shape[r - 1] + pad;
  st[r - 3] = npack > 1 ? npack * shape[r - 2] * shape[r - 1] : shape[r - 2] * st[r - 2];
  if (r == 4) st[0] = shape[1] * st[1];
  return st;
}
// Offset (elements) of the element with contiguous row-major index n of `shape`, in strides `st`.
int64_t offset_of(int64_t n, const std::vector<int64_t>& shape, const std::vector<int64_t>& st) {
  int64_t off = 0;
  for (size_t i = shape.size(); i-- > 0;) off += (n % shape[i]) * st[i], n /= shape[i];
  return off;
}

// An operand: its sizes, what attention reads (dequantized, contiguous in its format) and the
// descriptors handed to attention_forward.
struct Op {
  AttnFormat f = AttnFormat::kSBHD;
  int64_t B = 1, S = 0, H = 0, D = 0;  // thd: S = tokens
  std::vector<int64_t> shape;
  std::vector<double> vals;
  bool fp8 = false;
  TensorDesc bf16;
  MXFP8Tensor mx;
  AttnInput input() const {
    AttnInput a;
    if (fp8) a.mx = &mx;
    else a.bf16 = &bf16;
    return a;
  }
  // contiguous index of (b, token, h, d) (thd: token = packed token, b unused)
  int64_t flat(int64_t b, int64_t t, int64_t h, int64_t d) const {
    switch (f) {
      case AttnFormat::kSBHD: return ((t * B + b) * H + h) * D + d;
      case AttnFormat::kBSHD: return ((b * S + t) * H + h) * D + d;
      case AttnFormat::kBHSD: return ((b * H + h) * S + t) * D + d;
      default: return (t * H + h) * D + d;
    }
  }
};

struct Inputs {
  std::vector<std::unique_ptr<std::vector<uint8_t>>> stores;  // every buffer a descriptor points into
  Op q, k, v;
  std::vector<int32_t> cu_q, cu_kv;  // thd (kept in stores too, for the GPU copy)
  TensorDesc cuq_d, cukv_d;
  uint8_t* alloc(size_t n, uint8_t fill = 0) {
    stores.push_back(std::make_unique<std::vector<uint8_t>>(std::max<size_t>(n, 1), fill));
    return stores.back()->data();
  }
};

// Random bf16 data, contiguous in the format: N(0, 1) times a power of two per (token, head) row
// in [1/2, 2] (so that MXFP8 blocks get several scales).
std::vector<uint16_t> random_op(const Op& op, util::Rng& rng, double mult) {
  std::vector<uint16_t> x(static_cast<size_t>(numel(op.shape)));
  for (size_t r = 0; r < x.size() / op.D; ++r) {
    const double s = mult * std::ldexp(1.0, static_cast<int>(rng.uniform() * 3) - 1);
    for (int64_t d = 0; d < op.D; ++d) x[r * op.D + d] = util::to_bf16(static_cast<float>(rng.normal() * s));
  }
  return x;
}

// Writes contiguous elements `src` (esize bytes each) into a view with strides `st` at `base`.
void scatter(uint8_t* base, const uint8_t* src, int64_t esize, const std::vector<int64_t>& shape,
             const std::vector<int64_t>& st) {
  const int64_t n = numel(shape);
  for (int64_t i = 0; i < n; ++i) std::memcpy(base + offset_of(i, shape, st) * esize, src + i * esize, esize);
}

struct View {
  uint8_t* base;  // bytes of one element size below; the view's data pointer is base + off * esize
  int64_t off;
  std::vector<int64_t> st;
};

// Quantizes the contiguous bf16 `x` of `op` as `c.in` says and fills op.mx / op.vals; the
// operand's codes are copied into `view` (strides of the case).
void make_fp8(Inputs& in, Op& op, const ACase& c, const std::vector<uint16_t>& x, bool is_v, const View& view) {
  TensorDesc xd(const_cast<uint16_t*>(x.data()), DType::kBFloat16, op.shape);
  std::vector<int64_t> qshape = op.shape;
  if (c.in == In::kTokens) qshape = {numel(op.shape) / (op.H * op.D), op.H * op.D};
  const bool attn = c.in == In::kAttnCompact || c.in == In::kAttnBHSD;
  const MXFP8Shapes sh = attn ? attention_shapes(op.shape, op.f == AttnFormat::kSBHD ? QKVLayout::kSBHD : QKVLayout::kBSHD,
                                                 c.in == In::kAttnBHSD)
                              : quantize_shapes(qshape, c.in == In::kPlainSwizzled);
  MXFP8Tensor t;
  const int64_t n = numel(qshape);
  t.rowwise_data = TensorDesc(in.alloc(n), DType::kUInt8, qshape);
  t.rowwise_scale_inv = TensorDesc(in.alloc(numel(sh.rowwise_scale)), DType::kUInt8, sh.rowwise_scale);
  t.columnwise_data = TensorDesc(in.alloc(n), DType::kUInt8, qshape);
  t.columnwise_scale_inv = TensorDesc(in.alloc(numel(sh.columnwise_scale)), DType::kUInt8, sh.columnwise_scale);
  if (attn) {
    AttentionQuantizeOptions ao;
    ao.layout = op.f == AttnFormat::kSBHD ? QKVLayout::kSBHD : QKVLayout::kBSHD;
    ao.format = c.fmt, ao.bhsd_scales = c.in == In::kAttnBHSD;
    quantize_attention(xd, t, ao);
  } else {
    QuantizeOptions qo;
    qo.format = c.fmt, qo.swizzle = c.in == In::kPlainSwizzled;
    xd.shape = qshape;
    quantize(xd, t, qo);
  }
  // what attention reads: the dequantized direction (Q, K rowwise; V columnwise)
  std::vector<float> deq(static_cast<size_t>(n));
  TensorDesc dd(deq.data(), DType::kFloat32, qshape);
  if (n > 0) dequantize(t, dd, is_v);
  op.vals.assign(deq.begin(), deq.end());
  // the operand: the needed direction's codes as a view in the format
  TensorDesc& codes = is_v ? t.columnwise_data : t.rowwise_data;
  scatter(view.base + view.off, static_cast<const uint8_t*>(codes.data), 1, op.shape, view.st);
  codes = TensorDesc(view.base + view.off, DType::kUInt8, op.shape, Device{}, view.st);
  op.mx = t;
  op.fp8 = true;
}

Inputs make_inputs(const ACase& c) {
  Inputs in;
  util::Rng rng(c.seed);
  int64_t B = c.B, Tq = c.Sq, Tkv = c.Skv;
  if (c.thd()) {
    B = static_cast<int64_t>(c.lq.size());
    in.cu_q.assign(1, 0), in.cu_kv.assign(1, 0);
    for (int32_t l : c.lq) in.cu_q.push_back(in.cu_q.back() + l);
    for (int32_t l : c.lkv) in.cu_kv.push_back(in.cu_kv.back() + l);
    Tq = in.cu_q.back() + c.tail, Tkv = in.cu_kv.back() + c.tail;
    auto put = [&](const std::vector<int32_t>& cu, TensorDesc& d) {
      uint8_t* p = in.alloc(cu.size() * 4);
      std::memcpy(p, cu.data(), cu.size() * 4);
      d = TensorDesc(p, DType::kInt32, {static_cast<int64_t>(cu.size())});
    };
    put(in.cu_q, in.cuq_d), put(in.cu_kv, in.cukv_d);
  }
  auto init = [&](Op& op, AttnFormat f, int64_t S, int64_t H, int64_t D) {
    op.f = f, op.B = B, op.S = S, op.H = H, op.D = D;
    op.shape = fshape(f, B, S, H, D);
  };
  init(in.q, c.qf, Tq, c.H, c.Dqk), init(in.k, c.kvf, Tkv, c.Hkv, c.Dqk), init(in.v, c.kvf, Tkv, c.Hkv, c.Dv);
  const bool fp8 = c.in != In::kBF16;
  const int64_t es = fp8 ? 1 : 2;
  // storage: one packed buffer [.., 3, h, d], or one (padded) buffer per operand
  std::vector<View> views;
  if (c.packed) {
    const std::vector<int64_t> st = view_strides(in.q.shape, 0, 3);
    uint8_t* base = in.alloc(static_cast<size_t>(in.q.shape[0] * st[0] * es));
    for (int i = 0; i < 3; ++i) views.push_back({base, i * c.H * c.Dqk, st});
  } else {
    for (Op* op : {&in.q, &in.k, &in.v}) {
      const std::vector<int64_t> st = view_strides(op->shape, c.pad, 1);
      views.push_back({in.alloc(static_cast<size_t>(op->shape[0] * st[0] * es), 0xCD), 0, st});
    }
  }
  Op* ops[3] = {&in.q, &in.k, &in.v};
  for (int i = 0; i < 3; ++i) {
    Op& op = *ops[i];
    const std::vector<uint16_t> x = random_op(op, rng, i == 0 ? 1.5 : 1.0);
    if (fp8) {
      make_fp8(in, op, c, x, i == 2, views[i]);
    } else {
      scatter(views[i].base + views[i].off * 2, reinterpret_cast<const uint8_t*>(x.data()), 2, op.shape, views[i].st);
      op.bf16 = TensorDesc(views[i].base + views[i].off * 2, DType::kBFloat16, op.shape, Device{}, views[i].st);
      op.vals.resize(x.size());
      for (size_t j = 0; j < x.size(); ++j) op.vals[j] = ref::bf16_to_double(x[j]);
    }
  }
  return in;
}

AttentionOptions options_of(const ACase& c) {
  AttentionOptions o;
  o.q_format = c.qf, o.kv_format = c.kvf, o.causal = c.causal, o.bottom_right = c.br;
  o.softmax_scale = c.scale, o.p_format = c.pf;
  if (c.thd() && c.max_seqlen) {
    o.max_seqlen_q = c.lq.empty() ? 0 : *std::max_element(c.lq.begin(), c.lq.end());
    o.max_seqlen_kv = c.lkv.empty() ? 0 : *std::max_element(c.lkv.begin(), c.lkv.end());
    o.max_seqlen_q = std::max<int64_t>(o.max_seqlen_q, 1), o.max_seqlen_kv = std::max<int64_t>(o.max_seqlen_kv, 1);
  }
  return o;
}

// ---------------------------------------------------------------- outputs
constexpr uint8_t kPoison = 0xAB;

struct Result {
  std::vector<uint16_t> o;   // o's buffer (strided by the case's pad)
  std::vector<float> lse;    // contiguous
};

std::vector<int64_t> o_shape(const ACase& c, const Inputs& in) {
  std::vector<int64_t> s = in.q.shape;
  s.back() = c.Dv;
  return s;
}
std::vector<int64_t> lse_shape(const ACase& c, const Inputs& in) {
  return c.thd() ? std::vector<int64_t>{c.H, in.q.S} : std::vector<int64_t>{c.B, c.H, c.Sq};
}

// A query row: where its O and LSE live.
struct Row {
  int64_t b, h, i, sq, skv, q_tok0, kv_tok0, o_off, lse_off;
};
std::vector<Row> rows_of(const ACase& c, const Inputs& in) {
  std::vector<Row> rows;
  const std::vector<int64_t> os = o_shape(c, in), st = view_strides(os, c.pad, 1);
  const int64_t B = c.thd() ? static_cast<int64_t>(c.lq.size()) : c.B;
  Op o = in.q;
  o.D = c.Dv;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t sq = c.thd() ? c.lq[b] : c.Sq, skv = c.thd() ? c.lkv[b] : c.Skv;
    const int64_t q0 = c.thd() ? in.cu_q[b] : 0, kv0 = c.thd() ? in.cu_kv[b] : 0;
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < sq; ++i) {
        Row r{b, h, i, sq, skv, q0, kv0, 0, 0};
        r.o_off = offset_of(o.flat(b, q0 + i, h, 0), os, st);
        r.lse_off = c.thd() ? h * in.q.S + q0 + i : (b * c.H + h) * c.Sq + i;
        rows.push_back(r);
      }
  }
  return rows;
}

Result run_cpu(const ACase& c, const Inputs& in) {
  const std::vector<int64_t> os = o_shape(c, in), ost = view_strides(os, c.pad, 1), ls = lse_shape(c, in);
  Result r;
  r.o.assign(static_cast<size_t>(os[0] * ost[0]), static_cast<uint16_t>(kPoison * 0x101));
  r.lse.assign(static_cast<size_t>(numel(ls)), 0.f);
  std::memset(r.lse.data(), kPoison, r.lse.size() * 4);
  TensorDesc o(r.o.data(), DType::kBFloat16, os, Device{}, ost), l(r.lse.data(), DType::kFloat32, ls);
  attention_forward(in.q.input(), in.k.input(), in.v.input(), o, c.lse ? &l : nullptr, options_of(c),
                    c.thd() ? &in.cuq_d : nullptr, c.thd() ? &in.cukv_d : nullptr);
  return r;
}

#if MXMLA_WITH_CUDA
Result run_gpu(const ACase& c, const Inputs& in) {
  using util::DeviceBuffer;
  const Device dev{DeviceType::kCUDA, 0};
  std::vector<DeviceBuffer> bufs;
  for (const auto& s : in.stores) {
    bufs.emplace_back(s->size());
    bufs.back().upload(s->data());
  }
  auto reloc = [&](TensorDesc& t) {
    if (t.data == nullptr) return;
    const auto* p = static_cast<const uint8_t*>(t.data);
    for (size_t i = 0; i < in.stores.size(); ++i) {
      const uint8_t* b = in.stores[i]->data();
      if (p >= b && p < b + in.stores[i]->size()) {
        t.data = static_cast<uint8_t*>(bufs[i].ptr) + (p - b), t.device = dev;
        return;
      }
    }
    ADD_FAILURE() << "a descriptor points outside the test's buffers";
  };
  Op q = in.q, k = in.k, v = in.v;
  for (Op* op : {&q, &k, &v}) {
    reloc(op->bf16);
    reloc(op->mx.rowwise_data), reloc(op->mx.rowwise_scale_inv);
    reloc(op->mx.columnwise_data), reloc(op->mx.columnwise_scale_inv);
  }
  TensorDesc cuq = in.cuq_d, cukv = in.cukv_d;
  reloc(cuq), reloc(cukv);
  const std::vector<int64_t> os = o_shape(c, in), ost = view_strides(os, c.pad, 1), ls = lse_shape(c, in);
  Result r;
  r.o.assign(static_cast<size_t>(os[0] * ost[0]), static_cast<uint16_t>(kPoison * 0x101));
  r.lse.assign(static_cast<size_t>(numel(ls)), 0.f);
  std::memset(r.lse.data(), kPoison, r.lse.size() * 4);
  DeviceBuffer od(r.o.size() * 2 + 16), ld(r.lse.size() * 4 + 16);
  MXMLA_CUDA_CHECK(cudaMemcpy(od.ptr, r.o.data(), r.o.size() * 2, cudaMemcpyHostToDevice));
  MXMLA_CUDA_CHECK(cudaMemcpy(ld.ptr, r.lse.data(), r.lse.size() * 4, cudaMemcpyHostToDevice));
  TensorDesc o(od.ptr, DType::kBFloat16, os, dev, ost), l(ld.ptr, DType::kFloat32, ls, dev);
  attention_forward(q.input(), k.input(), v.input(), o, c.lse ? &l : nullptr, options_of(c), c.thd() ? &cuq : nullptr,
                    c.thd() ? &cukv : nullptr);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  MXMLA_CUDA_CHECK(cudaMemcpy(r.o.data(), od.ptr, r.o.size() * 2, cudaMemcpyDeviceToHost));
  MXMLA_CUDA_CHECK(cudaMemcpy(r.lse.data(), ld.ptr, r.lse.size() * 4, cudaMemcpyDeviceToHost));
  return r;
}
#else
Result run_gpu(const ACase&, const Inputs&) {
  ADD_FAILURE() << "run_gpu in a CPU-only build";
  return {};
}
#endif

// ---------------------------------------------------------------- the independent float64 attention
// E4M3 round to nearest even (ties to the even code), saturating at 448, for x >= 0: a search in the
// table of the 127 finite non-negative values (code n has value table[n]).
double e4m3_rne(double x) {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (int n = 0; n < 127; ++n) {
      const int e = n >> 3, m = n & 7;
      t.push_back(e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
    }
    return t;
  }();
  if (x >= 448) return 448;
  const size_t hi = std::upper_bound(table.begin(), table.end(), x) - table.begin();  // table[hi-1] <= x < table[hi]
  const double a = table[hi - 1], b = table[hi];
  if (x - a < b - x) return a;
  if (x - a > b - x) return b;
  return (hi - 1) % 2 == 0 ? a : b;
}

struct Naive {
  std::vector<double> o;    // rows x Dv
  std::vector<double> lse;  // rows
};

Naive naive(const ACase& c, const Inputs& in, const std::vector<Row>& rows) {
  Naive n;
  n.o.assign(rows.size() * c.Dv, 0.0);
  n.lse.assign(rows.size(), 0.0);
  const double scale = c.scale != 0 ? static_cast<double>(static_cast<float>(c.scale))
                                    : static_cast<double>(static_cast<float>(1.0 / std::sqrt(double(c.Dqk))));
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    const Row& r = rows[ri];
    const int64_t hk = r.h / (c.H / c.Hkv);
    int64_t nk = r.skv;
    if (c.causal) nk = std::max<int64_t>(0, std::min<int64_t>(r.skv, r.i + 1 + (c.br ? r.skv - r.sq : 0)));
    double* out = &n.o[ri * c.Dv];
    if (nk == 0) {
      n.lse[ri] = -kInf;
      continue;
    }
    std::vector<double> s(nk);
    bool nan = false;
    for (int64_t j = 0; j < nk; ++j) {
      double a = 0;
      for (int64_t d = 0; d < c.Dqk; ++d)
        a += in.q.vals[in.q.flat(r.b, r.q_tok0 + r.i, r.h, d)] * in.k.vals[in.k.flat(r.b, r.kv_tok0 + j, hk, d)];
      s[j] = a * scale;
      nan |= std::isnan(s[j]);
    }
    auto vval = [&](int64_t j, int64_t d) { return in.v.vals[in.v.flat(r.b, r.kv_tok0 + j, hk, d)]; };
    if (nan) {
      for (int64_t d = 0; d < c.Dv; ++d) out[d] = NAN;
      n.lse[ri] = NAN;
      continue;
    }
    if (c.pf == PFormat::kBF16) {
      const double m = *std::max_element(s.begin(), s.end());
      double l = 0;
      for (int64_t j = 0; j < nk; ++j) {
        const double p = std::exp(s[j] - m);
        l += p;
        for (int64_t d = 0; d < c.Dv; ++d) out[d] += p * vval(j, d);
      }
      for (int64_t d = 0; d < c.Dv; ++d) out[d] /= l;
      n.lse[ri] = m + std::log(l);
    } else {  // the online E4M3 definition, blocks of 128 keys from key 0
      double m = -kInf, l = 0;
      std::vector<double> o(c.Dv, 0.0);
      for (int64_t j0 = 0; j0 < nk; j0 += 128) {
        const int64_t j1 = std::min<int64_t>(nk, j0 + 128);
        const double mt = std::max(m, *std::max_element(s.begin() + j0, s.begin() + j1));
        const double corr = j0 == 0 ? 0.0 : std::exp(m - mt);
        l *= corr;
        for (double& x : o) x *= corr;
        for (int64_t j = j0; j < j1; ++j) {
          const double p = std::exp(s[j] - mt);
          const double pt = e4m3_rne(p * 256) / 256;
          l += p;
          for (int64_t d = 0; d < c.Dv; ++d) o[d] += pt * vval(j, d);
        }
        m = mt;
      }
      for (int64_t d = 0; d < c.Dv; ++d) out[d] = o[d] / l;
      n.lse[ri] = m + std::log(l);
    }
  }
  return n;
}

// Bytes of o / lse that belong to no row must keep the poison.
void expect_untouched(const ACase& c, const std::vector<Row>& rows, const Result& r, const char* what) {
  std::vector<char> used_o(r.o.size(), 0), used_l(r.lse.size(), 0);
  for (const Row& row : rows) {
    for (int64_t d = 0; d < c.Dv; ++d) used_o[row.o_off + d] = 1;
    used_l[row.lse_off] = 1;
  }
  int64_t bad_o = 0, bad_l = 0;
  for (size_t i = 0; i < r.o.size(); ++i) bad_o += !used_o[i] && r.o[i] != kPoison * 0x101;
  for (size_t i = 0; i < r.lse.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &r.lse[i], 4);
    bad_l += (!used_l[i] || !c.lse) && u != kPoison * 0x01010101u;
  }
  EXPECT_EQ(bad_o, 0) << what << ": o elements outside the rows were written";
  EXPECT_EQ(bad_l, 0) << what << ": lse entries outside the rows were written";
}

double bf16(uint16_t b) { return ref::bf16_to_double(b); }

// The CPU reference equals bf16(the naive O) up to one bf16 rounding, and the naive LSE up to fp32's.
void expect_matches_naive(const ACase& c, const Inputs& in, const Result& r) {
  const std::vector<Row> rows = rows_of(c, in);
  const Naive n = naive(c, in, rows);
  int64_t bad = 0, bad_lse = 0;
  std::string first;
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    for (int64_t d = 0; d < c.Dv; ++d) {
      const double want = n.o[ri * c.Dv + d], got = bf16(r.o[rows[ri].o_off + d]);
      const bool ok = std::isnan(want) ? std::isnan(got) : std::fabs(got - want) <= std::ldexp(std::fabs(want), -8) + 1e-300;
      if (!ok && bad++ == 0) {
        std::ostringstream s;
        s << "o row " << ri << " (b " << rows[ri].b << " h " << rows[ri].h << " i " << rows[ri].i << ") d " << d
          << ": " << got << " vs " << want;
        first = s.str();
      }
    }
    if (!c.lse) continue;
    const double want = n.lse[ri], got = r.lse[rows[ri].lse_off];
    const bool ok = std::isnan(want) ? std::isnan(got)
                    : std::isinf(want) ? got == want
                                       : std::fabs(got - want) <= 4e-7 * std::max(1.0, std::fabs(want));
    if (!ok && bad_lse++ == 0) first += " | lse row " + std::to_string(ri) + ": " + std::to_string(got) + " vs " + std::to_string(want);
  }
  EXPECT_EQ(bad, 0) << first;
  EXPECT_EQ(bad_lse, 0) << first;
  expect_untouched(c, rows, r, "cpu");
}

// ---------------------------------------------------------------- CPU reference vs the naive attention
class AttentionFwdCpu : public ::testing::TestWithParam<ACase> {};

TEST_P(AttentionFwdCpu, MatchesNaiveFloat64) {
  const ACase c = GetParam();
  const Inputs in = make_inputs(c);
  expect_matches_naive(c, in, run_cpu(c, in));
}

std::vector<ACase> cpu_cases() {
  std::vector<ACase> v;
  auto add = [&](auto f) {
    ACase c;
    f(c);
    c.seed = v.size() + 11;
    v.push_back(c);
  };
  const AttnFormat all[] = {AttnFormat::kSBHD, AttnFormat::kBSHD, AttnFormat::kBHSD};
  // every format, bf16 and plain MXFP8, causal both ways, GQA
  for (AttnFormat f : all)
    for (In i : {In::kBF16, In::kPlain}) {
      add([&](ACase& c) { c.qf = c.kvf = f, c.in = i, c.B = 2, c.Sq = 7, c.Skv = 37, c.H = 4, c.Hkv = 2; });
      add([&](ACase& c) { c.qf = c.kvf = f, c.in = i, c.B = 2, c.Sq = 37, c.Skv = 37, c.H = 3, c.Hkv = 1, c.causal = true; });
      add([&](ACase& c) { c.qf = c.kvf = f, c.in = i, c.Sq = 40, c.Skv = 9, c.causal = true, c.br = true; });
      add([&](ACase& c) { c.qf = c.kvf = f, c.in = i, c.Sq = 9, c.Skv = 40, c.causal = true, c.br = true, c.H = 2, c.Hkv = 1; });
      add([&](ACase& c) { c.qf = c.kvf = f, c.in = i, c.Sq = 9, c.Skv = 40, c.causal = true; });
    }
  // the scale layouts the library writes
  for (AttnFormat f : {AttnFormat::kSBHD, AttnFormat::kBSHD})
    for (In i : {In::kAttnCompact, In::kAttnBHSD, In::kPlainSwizzled, In::kTokens})
      add([&](ACase& c) { c.qf = c.kvf = f, c.in = i, c.B = 3, c.Sq = 33, c.Skv = 70, c.H = 2, c.Hkv = 1, c.causal = true; });
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kBHSD, c.in = In::kPlainSwizzled, c.B = 2, c.Sq = 20, c.Skv = 45; });
  add([](ACase& c) { c.in = In::kAttnBHSD, c.fmt = Fp8Format::kE5M2, c.B = 2, c.Sq = 17, c.Skv = 17, c.causal = true; });
  add([](ACase& c) { c.in = In::kAttnCompact, c.Dqk = 192, c.Dv = 128, c.B = 2, c.Sq = 5, c.Skv = 66, c.H = 2, c.Hkv = 2; });
  // mixed formats
  add([](ACase& c) { c.qf = AttnFormat::kBSHD, c.kvf = AttnFormat::kBHSD, c.B = 2, c.Sq = 11, c.Skv = 13, c.causal = true; });
  add([](ACase& c) { c.qf = AttnFormat::kBHSD, c.kvf = AttnFormat::kSBHD, c.in = In::kPlain, c.B = 2, c.Sq = 11, c.Skv = 13; });
  add([](ACase& c) { c.qf = AttnFormat::kSBHD, c.kvf = AttnFormat::kBSHD, c.in = In::kAttnBHSD, c.B = 2, c.Sq = 11, c.Skv = 35; });
  // thd: empty and one-token sequences, a tail, both alignments
  for (In i : {In::kBF16, In::kPlain, In::kTokens, In::kPlainSwizzled})
    for (int causal = 0; causal < 3; ++causal)
      add([&](ACase& c) {
        c.qf = c.kvf = AttnFormat::kTHD, c.in = i, c.lq = {5, 0, 1, 37, 3, 1}, c.lkv = {9, 4, 0, 40, 1, 1};
        c.H = 4, c.Hkv = 2, c.causal = causal > 0, c.br = causal == 2, c.tail = causal == 1 ? 3 : 0;
      });
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kTHD, c.lq = {0}, c.lkv = {0}; });
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kTHD, c.lq = {}, c.lkv = {}; });
  // no keys at all; causal rows without keys; one query, one key
  add([](ACase& c) { c.B = 2, c.Sq = 5, c.Skv = 0; });
  add([](ACase& c) { c.Sq = 1, c.Skv = 1, c.causal = true, c.in = In::kAttnCompact; });
  // packed q, k, v and padded strides
  for (AttnFormat f : {AttnFormat::kSBHD, AttnFormat::kBSHD, AttnFormat::kTHD})
    for (In i : {In::kBF16, In::kAttnBHSD}) {
      if (f == AttnFormat::kTHD && i != In::kBF16) continue;
      add([&](ACase& c) {
        c.qf = c.kvf = f, c.in = i, c.packed = true, c.B = 2, c.Sq = c.Skv = 19, c.Dqk = c.Dv = 64, c.causal = true;
        if (f == AttnFormat::kTHD) c.lq = c.lkv = {7, 0, 12};
      });
    }
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kTHD, c.in = In::kTokens, c.packed = true, c.lq = c.lkv = {7, 0, 12}, c.Dqk = c.Dv = 32; });
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kBHSD, c.pad = 32, c.B = 2, c.Sq = 6, c.Skv = 21, c.in = In::kPlain; });
  add([](ACase& c) { c.pad = 8, c.B = 2, c.Sq = 6, c.Skv = 21, c.lse = false; });
  add([](ACase& c) { c.B = 2, c.Sq = 6, c.Skv = 21, c.scale = 0.3, c.in = In::kTokens; });
  // the E4M3 P definition: several 128-key blocks, causal, GQA, thd
  add([](ACase& c) { c.pf = PFormat::kE4M3, c.Sq = 5, c.Skv = 300; });
  add([](ACase& c) { c.pf = PFormat::kE4M3, c.Sq = 300, c.Skv = 300, c.H = 2, c.Hkv = 1, c.causal = true, c.in = In::kAttnBHSD; });
  add([](ACase& c) { c.pf = PFormat::kE4M3, c.Sq = 40, c.Skv = 290, c.causal = true, c.br = true, c.qf = c.kvf = AttnFormat::kBHSD; });
  add([](ACase& c) {
    c.pf = PFormat::kE4M3, c.qf = c.kvf = AttnFormat::kTHD, c.lq = {1, 260, 0}, c.lkv = {129, 257, 5}, c.causal = true, c.br = true;
  });
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, AttentionFwdCpu, ::testing::ValuesIn(cpu_cases()),
                         [](const ::testing::TestParamInfo<ACase>& i) { return std::to_string(i.index) + "_" + i.param.name(); });

// A NaN scale (0xFF) in one K rowwise block makes exactly the rows that see that key NaN: under a
// causal mask the earlier queries of the group, and every query of the other kv head, stay finite.
TEST(AttentionFwdCpuSpecial, NanScaleInOneKBlockReachesOnlyTheRowsThatSeeIt) {
  for (In i : {In::kAttnCompact, In::kAttnBHSD, In::kPlain}) {
    ACase c;
    c.in = i, c.B = 2, c.Sq = c.Skv = 40, c.H = 4, c.Hkv = 2, c.causal = true, c.Dqk = 64;
    Inputs in = make_inputs(c);
    // key j = 17 of sequence b = 1, kv head 0, d block 1
    const int64_t b = 1, j = 17, hk = 0;
    MXFP8Tensor& t = in.k.mx;
    const MXFP8Shapes sh = i == In::kPlain ? quantize_shapes(t.shape, false)
                                           : attention_shapes(t.shape, QKVLayout::kSBHD, i == In::kAttnBHSD);
    int64_t off;
    if (i == In::kAttnBHSD) off = (b * c.Hkv + hk) * (128 * 4) + (j % 32) * 16 + ((j % 128) / 32) * 4 + 1;  // one 128x4 tile per (b, h)
    else off = ((j * c.B + b) * c.Hkv + hk) * 2 + 1;  // compact rowwise [s*b*h, d/32]
    ASSERT_LT(off, numel(sh.rowwise_scale));
    static_cast<uint8_t*>(t.rowwise_scale_inv.data)[off] = 0xFF;
    // refresh what the naive attention reads
    std::vector<float> deq(static_cast<size_t>(numel(t.shape)));
    MXFP8Tensor pristine = t;
    std::vector<uint8_t> codes(static_cast<size_t>(numel(t.shape)));
    for (int64_t n = 0; n < numel(t.shape); ++n)
      codes[n] = static_cast<const uint8_t*>(t.rowwise_data.data)[offset_of(n, t.rowwise_data.shape, t.rowwise_data.strides)];
    pristine.rowwise_data = TensorDesc(codes.data(), DType::kUInt8, t.shape);
    TensorDesc dd(deq.data(), DType::kFloat32, t.shape);
    dequantize(pristine, dd, false);
    in.k.vals.assign(deq.begin(), deq.end());
    const Result r = run_cpu(c, in);
    expect_matches_naive(c, in, r);
    int64_t nan_rows = 0;
    for (const Row& row : rows_of(c, in)) {
      const bool sees = row.b == b && row.h / 2 == hk && row.i >= j;
      const double o0 = bf16(r.o[row.o_off]), l = r.lse[row.lse_off];
      EXPECT_EQ(std::isnan(o0), sees) << in_name(i) << " b " << row.b << " h " << row.h << " i " << row.i;
      EXPECT_EQ(std::isnan(l), sees) << in_name(i) << " b " << row.b << " h " << row.h << " i " << row.i;
      nan_rows += sees;
    }
    EXPECT_EQ(nan_rows, 2 * (40 - j));
  }
}

// The E4M3 rounding of the test's definition agrees with the library's FP8 rounding on [0, 448]
// (a cross-check of the two independent implementations, midpoints included).
TEST(AttentionFwdCpuSpecial, E4m3RoundingOfTheTestAgreesWithTheLibrary) {
  for (int n = 0; n < 126; ++n) {
    const double a = ref::fp8_to_double(static_cast<uint8_t>(n), Fp8Format::kE4M3);
    const double b = ref::fp8_to_double(static_cast<uint8_t>(n + 1), Fp8Format::kE4M3);
    for (double x : {a, (a + b) / 2, std::nextafter((a + b) / 2, 0.0), std::nextafter((a + b) / 2, 1e9), a + (b - a) / 3})
      ASSERT_EQ(e4m3_rne(x), ref::fp8_to_double(ref::round_to_fp8(x, Fp8Format::kE4M3), Fp8Format::kE4M3)) << x;
  }
  EXPECT_EQ(e4m3_rne(1000), 448);
}

// The default softmax scale is d_qk^-0.5; the E4M3 P path differs from the bf16 one (and the same
// inputs give the same O on both when every p·256 is an E4M3 value: one key).
TEST(AttentionFwdCpuSpecial, DefaultScaleAndPFormats) {
  ACase c;
  c.Sq = 3, c.Skv = 200, c.Dqk = 64;
  const Inputs in = make_inputs(c);
  ACase c2 = c;
  c2.scale = 0.125;  // 64^-0.5
  EXPECT_EQ(run_cpu(c, in).o, run_cpu(c2, in).o);
  ACase c3 = c;
  c3.pf = PFormat::kE4M3;
  EXPECT_NE(run_cpu(c, in).o, run_cpu(c3, in).o);
  ACase c4 = c, c5 = c;
  c4.Skv = c5.Skv = 1, c5.pf = PFormat::kE4M3;
  const Inputs in1 = make_inputs(c4);
  EXPECT_EQ(run_cpu(c4, in1).o, run_cpu(c5, in1).o);
}

// ---------------------------------------------------------------- CUDA vs the CPU reference
class AttentionFwdGpu : public ::testing::TestWithParam<ACase> {};

TEST_P(AttentionFwdGpu, MatchesReference) {
  MXMLA_REQUIRE_GPU();
  const ACase c = GetParam();
  const Inputs in = make_inputs(c);
  const Result ref = run_cpu(c, in), got = run_gpu(c, in);
  const std::vector<Row> rows = rows_of(c, in);
  double num = 0, den = 0;
  int64_t far = 0, lse_far = 0, masked_bad = 0;
  std::string first;
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    const Row& r = rows[ri];
    const bool no_keys = (c.causal ? std::min(r.skv, r.i + 1 + (c.br ? r.skv - r.sq : 0)) : r.skv) <= 0;
    for (int64_t d = 0; d < c.Dv; ++d) {
      const double a = bf16(ref.o[r.o_off + d]), b = bf16(got.o[r.o_off + d]);
      if (no_keys) {
        masked_bad += b != 0;
        continue;
      }
      num += (a - b) * (a - b), den += a * a;
      if (!(std::fabs(a - b) <= 0.02 + 0.02 * std::fabs(a)) && far++ == 0) {
        std::ostringstream s;
        s << "o (b " << r.b << " h " << r.h << " i " << r.i << " d " << d << "): gpu " << b << " vs ref " << a;
        first = s.str();
      }
    }
    if (c.lse) {
      const double a = ref.lse[r.lse_off], b = got.lse[r.lse_off];
      const bool ok = std::isinf(a) ? a == b : std::fabs(a - b) <= 1e-4;
      if (!ok && lse_far++ == 0) first += " | lse (b " + std::to_string(r.b) + " h " + std::to_string(r.h) + " i " +
                                          std::to_string(r.i) + "): gpu " + std::to_string(b) + " vs ref " + std::to_string(a);
    }
  }
  const double rel_rms = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  EXPECT_LE(rel_rms, 0.005) << "relative RMS error of O";
  EXPECT_EQ(far, 0) << "O elements outside atol 0.02 + rtol 0.02; first: " << first;
  EXPECT_EQ(lse_far, 0) << "LSE outside 1e-4; first: " << first;
  EXPECT_EQ(masked_bad, 0) << "rows without keys must be exactly 0";
  expect_untouched(c, rows, got, "gpu");
}

std::vector<ACase> gpu_cases() {
  std::vector<ACase> v;
  auto add = [&](auto f) {
    ACase c;
    c.B = 2, c.H = c.Hkv = 3, c.Dqk = 192, c.Dv = 128;
    f(c);
    c.seed = v.size() + 101;
    v.push_back(c);
  };
  const int64_t sizes[] = {1, 31, 127, 128, 129, 1000};
  // sequence lengths, without and with a causal mask (bf16)
  for (int64_t s : sizes)
    for (int causal = 0; causal < 2; ++causal) add([&](ACase& c) { c.Sq = c.Skv = s, c.causal = causal; });
  // s_q != s_kv, both alignments
  const std::pair<int64_t, int64_t> qkv[] = {{1, 1000}, {31, 129}, {129, 31}, {1000, 127}, {128, 1000}, {127, 128}};
  for (auto [sq, skv] : qkv)
    for (int br = 0; br < 2; ++br) add([&](ACase& c) { c.Sq = sq, c.Skv = skv, c.causal = true, c.br = br; });
  add([](ACase& c) { c.Sq = 129, c.Skv = 1000; });
  // formats, mixed formats, heads, GQA
  for (AttnFormat f : {AttnFormat::kBSHD, AttnFormat::kBHSD})
    add([&](ACase& c) { c.qf = c.kvf = f, c.Sq = 129, c.Skv = 257, c.causal = true, c.br = true; });
  add([](ACase& c) { c.qf = AttnFormat::kBSHD, c.kvf = AttnFormat::kBHSD, c.Sq = 200, c.Skv = 131; });
  add([](ACase& c) { c.B = 1, c.H = 16, c.Hkv = 16, c.Sq = c.Skv = 200, c.causal = true; });
  add([](ACase& c) { c.B = 1, c.H = 16, c.Hkv = 2, c.Sq = c.Skv = 257, c.causal = true, c.qf = c.kvf = AttnFormat::kBSHD; });
  add([](ACase& c) { c.B = 2, c.H = 3, c.Hkv = 1, c.Sq = 130, c.Skv = 300, c.qf = c.kvf = AttnFormat::kBHSD; });
  add([](ACase& c) { c.B = 1, c.H = c.Hkv = 1, c.Sq = c.Skv = 1000, c.causal = true; });
  // d 128 / 128
  add([](ACase& c) { c.Dqk = c.Dv = 128, c.Sq = c.Skv = 300, c.causal = true; });
  add([](ACase& c) { c.Dqk = c.Dv = 128, c.Sq = 129, c.Skv = 1000, c.in = In::kAttnBHSD; });
  // thd: empty and one-token sequences, both alignments, given or computed max lengths, a tail
  for (int causal = 0; causal < 3; ++causal)
    for (In i : {In::kBF16, In::kTokens})
      add([&](ACase& c) {
        c.qf = c.kvf = AttnFormat::kTHD, c.in = i, c.lq = {0, 1, 129, 1000, 31, 1}, c.lkv = {3, 0, 1, 1000, 64, 1};
        c.H = 4, c.Hkv = 2, c.causal = causal > 0, c.br = causal == 2, c.max_seqlen = causal == 1, c.tail = causal == 2 ? 5 : 0;
      });
  // packed q, k, v (d 128 / 128): sb3hd, bs3hd, t3hd; bf16 and MXFP8 code views
  for (AttnFormat f : {AttnFormat::kSBHD, AttnFormat::kBSHD, AttnFormat::kTHD})
    for (In i : {In::kBF16, In::kAttnCompact}) {
      if (f == AttnFormat::kTHD && i != In::kBF16) continue;
      add([&](ACase& c) {
        c.qf = c.kvf = f, c.in = i, c.packed = true, c.Dqk = c.Dv = 128, c.Sq = c.Skv = 257, c.causal = true;
        if (f == AttnFormat::kTHD) c.lq = c.lkv = {100, 0, 157};
      });
    }
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kTHD, c.in = In::kTokens, c.packed = true, c.Dqk = c.Dv = 128, c.lq = c.lkv = {100, 1, 156}; });
  // MXFP8: compact and BHSD attention scales, plain bhsd, tokens-major bshd, E5M2, padded strides
  for (AttnFormat f : {AttnFormat::kSBHD, AttnFormat::kBSHD})
    for (In i : {In::kAttnCompact, In::kAttnBHSD})
      add([&](ACase& c) { c.qf = c.kvf = f, c.in = i, c.Sq = 129, c.Skv = 1000, c.causal = true, c.br = true; });
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kBHSD, c.in = In::kPlain, c.Sq = 127, c.Skv = 129; });
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kBHSD, c.in = In::kPlainSwizzled, c.Sq = c.Skv = 256, c.causal = true; });
  add([](ACase& c) { c.qf = c.kvf = AttnFormat::kBSHD, c.in = In::kTokens, c.Sq = 100, c.Skv = 200; });
  add([](ACase& c) { c.in = In::kAttnBHSD, c.fmt = Fp8Format::kE5M2, c.Sq = c.Skv = 300, c.causal = true; });
  add([](ACase& c) { c.in = In::kAttnBHSD, c.pad = 64, c.Sq = 65, c.Skv = 200, c.lse = false; });
  add([](ACase& c) { c.pad = 32, c.Sq = 65, c.Skv = 200, c.qf = c.kvf = AttnFormat::kBHSD; });
  // E4M3 P: bf16 and MXFP8 inputs, causal, thd
  add([](ACase& c) { c.pf = PFormat::kE4M3, c.Sq = c.Skv = 1000, c.causal = true; });
  add([](ACase& c) { c.pf = PFormat::kE4M3, c.in = In::kAttnBHSD, c.Sq = 300, c.Skv = 1000, c.causal = true, c.br = true; });
  add([](ACase& c) {
    c.pf = PFormat::kE4M3, c.qf = c.kvf = AttnFormat::kTHD, c.in = In::kTokens, c.lq = {0, 1, 300, 129}, c.lkv = {5, 1, 300, 1};
    c.causal = true;
  });
  // a long sequence (one head: the CPU reference is the slow side)
  add([](ACase& c) { c.B = 1, c.H = c.Hkv = 1, c.Sq = c.Skv = 4096, c.causal = true, c.in = In::kAttnBHSD; });
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, AttentionFwdGpu, ::testing::ValuesIn(gpu_cases()),
                         [](const ::testing::TestParamInfo<ACase>& i) { return std::to_string(i.index) + "_" + i.param.name(); });

// ---------------------------------------------------------------- CUDA: staged and fused dequantization
// MXFP8 inputs take the staged path by default (a conversion pass to bf16, then the kernel on the
// copies); MXMLA_ATTN_FWD=fused dequantizes inside the kernel. Both put the same bf16 values into
// the same consumers, so O and LSE must agree bit for bit (NaN with NaN), also with extreme scale
// bytes (0, 1, the fast path's limits, 254, 255 = NaN) and NaN / max codes spread over Q, K and V.
// thd: a sequence's last key tile reaches into the next sequence's tokens (NaN there with the
// specials) and past the last sequence into tokens the staged copy leaves unwritten; the fused
// path reads those V rows as zeros, the staged one must zero them.
class AttentionFwdGpuPaths : public ::testing::TestWithParam<std::tuple<ACase, bool>> {};

// Every 13th scale byte of each copy -> one of the extremes, every 97th code -> NaN or the largest
// finite code (both signs).
void poke_specials(Inputs& in, Fp8Format fmt) {
  const uint8_t scales[] = {0, 1, 2, 120, 127, 134, 135, 142, 143, 200, 253, 254, 255};
  const uint8_t nan = fmt == Fp8Format::kE4M3 ? 0x7F : 0x7E, big = fmt == Fp8Format::kE4M3 ? 0x7E : 0x7B;
  const uint8_t codes[] = {nan, big, static_cast<uint8_t>(big | 0x80), static_cast<uint8_t>(nan | 0x80)};
  for (Op* op : {&in.q, &in.k, &in.v}) {
    for (TensorDesc* t : {&op->mx.rowwise_scale_inv, &op->mx.columnwise_scale_inv}) {
      if (t->data == nullptr) continue;
      auto* b = static_cast<uint8_t*>(t->data);
      for (int64_t i = 0, n = numel(t->shape), j = 0; i < n; i += 13) b[i] = scales[j++ % sizeof(scales)];
    }
    for (TensorDesc* t : {&op->mx.rowwise_data, &op->mx.columnwise_data}) {
      if (t->data == nullptr) continue;
      auto* b = static_cast<uint8_t*>(t->data);
      for (int64_t i = 5, n = numel(t->shape), j = 0; i < n; i += 97) b[i] = codes[j++ % sizeof(codes)];
    }
  }
}

bool same_bf16(uint16_t a, uint16_t b) {
  const auto nan = [](uint16_t x) { return (x & 0x7F80) == 0x7F80 && (x & 0x7F) != 0; };
  return a == b || (nan(a) && nan(b));
}

TEST_P(AttentionFwdGpuPaths, StagedAndFusedAgreeBitwise) {
  MXMLA_REQUIRE_GPU();
  const auto& [c, specials] = GetParam();
  Inputs in = make_inputs(c);
  if (specials) poke_specials(in, c.fmt);
  Result staged, fused;
  {
    test::ScopedEnv e("MXMLA_ATTN_FWD", "staged");  // an error if the staged path did not apply
    staged = run_gpu(c, in);
  }
  {
    test::ScopedEnv e("MXMLA_ATTN_FWD", "fused");
    fused = run_gpu(c, in);
  }
  ASSERT_EQ(staged.o.size(), fused.o.size());
  int64_t o_diff = 0, lse_diff = 0, nonfinite = 0;
  for (size_t i = 0; i < staged.o.size(); ++i) {
    o_diff += !same_bf16(staged.o[i], fused.o[i]);
    nonfinite += (staged.o[i] & 0x7F80) == 0x7F80;
  }
  for (size_t i = 0; i < staged.lse.size(); ++i) {
    const float a = staged.lse[i], b = fused.lse[i];
    lse_diff += !(std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b)));
  }
  EXPECT_EQ(o_diff, 0) << "O elements whose bits differ between the staged and the fused path";
  EXPECT_EQ(lse_diff, 0) << "LSE values whose bits differ";
  if (specials) EXPECT_GT(nonfinite, 0) << "the special values reached no output (the poke missed)";
}

std::vector<ACase> fp8_cases() {
  std::vector<ACase> v;
  for (const ACase& c : gpu_cases())
    if (c.in != In::kBF16 && c.Sq * c.Skv * c.H <= 3000000) v.push_back(c);
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, AttentionFwdGpuPaths,
                         ::testing::Combine(::testing::ValuesIn(fp8_cases()), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<ACase, bool>>& i) {
                           return std::to_string(i.index) + "_" + std::get<0>(i.param).name() +
                                  (std::get<1>(i.param) ? "_specials" : "");
                         });

// ---------------------------------------------------------------- CUDA: the tile order
// Causal and thd launches whose tiles outnumber the CTAs claim them from a counter (dynamic order),
// others deal them round-robin; MXMLA_ATTN_FWD_ORDER forces either. A tile's arithmetic does not
// depend on the CTA or the order, so both give the same bits. The dynamic order also with fewer
// tiles than CTAs (forced), and with many more (a causal launch of 512 tiles, thd with FP8 inputs
// and their dequantizing warpgroup, which reads the claimed tiles too).
class AttentionFwdGpuOrder : public ::testing::TestWithParam<ACase> {};

TEST_P(AttentionFwdGpuOrder, StaticAndDynamicAgreeBitwise) {
  MXMLA_REQUIRE_GPU();
  const ACase& c = GetParam();
  Inputs in = make_inputs(c);
  Result stat, dyn;
  {
    test::ScopedEnv e("MXMLA_ATTN_FWD_ORDER", "static");
    stat = run_gpu(c, in);
  }
  {
    test::ScopedEnv e("MXMLA_ATTN_FWD_ORDER", "dynamic");
    dyn = run_gpu(c, in);
  }
  ASSERT_EQ(stat.o.size(), dyn.o.size());
  EXPECT_EQ(std::memcmp(stat.o.data(), dyn.o.data(), stat.o.size() * 2), 0) << "O differs between the orders";
  EXPECT_EQ(std::memcmp(stat.lse.data(), dyn.lse.data(), stat.lse.size() * 4), 0) << "LSE differs between the orders";
}

std::vector<ACase> order_cases() {
  std::vector<ACase> v;
  for (const ACase& c : gpu_cases())
    if ((c.causal || c.thd()) && c.Sq * c.Skv * c.H <= 3000000) v.push_back(c);
  ACase big;  // 2 x 16 heads x 16 query blocks = 512 tiles
  big.B = 2, big.H = big.Hkv = 16, big.Sq = big.Skv = 2048, big.Dqk = 192, big.Dv = 128, big.causal = true;
  big.qf = big.kvf = AttnFormat::kBSHD, big.seed = 7;
  v.push_back(big);
  ACase big8 = big;  // MXFP8 (BHSD scales), GQA: the staged copies read by 512 tiles in either order
  big8.in = In::kAttnBHSD, big8.Hkv = 4, big8.seed = 9;
  v.push_back(big8);
  ACase thd = big;  // FP8 thd: the fused path (dequantizer warpgroup), 8 sequences of 1..1500 tokens
  thd.qf = thd.kvf = AttnFormat::kTHD, thd.in = In::kTokens, thd.H = thd.Hkv = 8;
  thd.lq = {1500, 3, 700, 0, 1024, 129, 900, 1};
  thd.lkv = thd.lq;
  thd.seed = 8;  // (B: the number of sequences, from lq)
  v.push_back(thd);
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, AttentionFwdGpuOrder, ::testing::ValuesIn(order_cases()),
                         [](const ::testing::TestParamInfo<ACase>& i) { return std::to_string(i.index) + "_" + i.param.name(); });

// ---------------------------------------------------------------- errors
void expect_error(const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
  test::expect_error("mxmla.attention", fn, arg, rule);
}

// A small valid call (sbhd [4, 1, 2, 64] q, k; v d 32) whose pieces each test breaks.
struct Call {
  ACase c;
  Inputs in;
  TensorDesc q, k, v;  // bf16
  std::vector<uint16_t> ob = std::vector<uint16_t>(4 * 2 * 32 + 64);
  std::vector<float> lb = std::vector<float>(64);
  TensorDesc o{ob.data(), DType::kBFloat16, {4, 1, 2, 32}}, lse{lb.data(), DType::kFloat32, {1, 2, 4}};
  AttentionOptions opts;
  explicit Call(In i = In::kBF16) {
    c.Sq = c.Skv = 4, c.in = i;
    in = make_inputs(c);
    q = in.q.bf16, k = in.k.bf16, v = in.v.bf16;
  }
  void run_bf16() { attention_forward({&q, nullptr}, {&k, nullptr}, {&v, nullptr}, o, &lse, opts); }
  void run_mx() { attention_forward(in.q.input(), in.k.input(), in.v.input(), o, &lse, opts); }
};

TEST(AttentionFwdErrors, ShapesDtypesAndOptions) {
  {
    Call a;
    a.run_bf16();  // valid
  }
  auto with = [](auto mutate) {
    return [mutate] {
      Call a;
      mutate(a);
      a.run_bf16();
    };
  };
  expect_error(with([](Call& a) { a.k.shape[3] = 32; }), "k", "does not match q's d_qk");
  expect_error(with([](Call& a) { a.v.shape[0] = 3; }), "v", "has 3 keys but k has 4");
  expect_error(with([](Call& a) { a.v.shape[2] = 1; }), "v", "has 1 heads but k has 2");
  expect_error(with([](Call& a) { a.k.shape[1] = 2; }), "k", "batch size 2 does not match");
  expect_error(with([](Call& a) { a.q.shape[2] = 3, a.o.shape[2] = 3; }), "q", "h % h_kv");
  expect_error(with([](Call& a) { a.q.shape[3] = a.k.shape[3] = 48; }), "q", "multiple of 32");
  expect_error(with([](Call& a) { a.v.shape[3] = 16, a.o.shape[3] = 16; }), "v", "multiple of 32");
  expect_error(with([](Call& a) { a.q.dtype = DType::kFloat32; }), "q", "must be bfloat16");
  expect_error(with([](Call& a) { a.q.shape = {4, 2, 64}; }), "q", "must be 4-D [s, b, h, d]");
  expect_error(with([](Call& a) { a.k.strides = {128, 128, 1, 2}; }), "k", "head dimension must be contiguous");
  expect_error(with([](Call& a) { a.q.data = nullptr; }), "q", "null");
  expect_error(with([](Call& a) { a.o.shape[3] = 64; }), "o", "must be [4, 1, 2, 32]");
  expect_error(with([](Call& a) { a.o.dtype = DType::kFloat32; }), "o", "must be bfloat16");
  expect_error(with([](Call& a) { a.o.strides = {64, 64, 1, 2}; }), "o", "head dimension must be contiguous");
  expect_error(with([](Call& a) { a.lse.shape = {2, 4}; }), "lse", "must be [1, 2, 4]");
  expect_error(with([](Call& a) { a.lse.dtype = DType::kBFloat16; }), "lse", "must be float32");
  expect_error(with([](Call& a) { a.lse.strides = {8, 1, 2}; }), "lse", "contiguous");
  expect_error(with([](Call& a) { a.opts.softmax_scale = NAN; }), "softmax_scale", "finite");
  expect_error(with([](Call& a) { a.opts.kv_format = AttnFormat::kTHD; }), "kv_format", "both be thd");
  expect_error(with([](Call& a) { a.k.device = Device{DeviceType::kCUDA, 0}; }), "k", "all operands must be on one device");
  expect_error(with([](Call& a) { a.o.device = Device{DeviceType::kCUDA, 0}; }), "o", "is on cuda:0");
  expect_error([] {
    Call a;
    TensorDesc cu(a.ob.data(), DType::kInt32, {2});
    attention_forward({&a.q, nullptr}, {&a.k, nullptr}, {&a.v, nullptr}, a.o, &a.lse, a.opts, &cu, nullptr);
  }, "cu_seqlens_q", "only for the thd format");
  // exactly one of bf16 / mx
  expect_error([] {
    Call a;
    attention_forward({nullptr, nullptr}, {&a.k, nullptr}, {&a.v, nullptr}, a.o, &a.lse, a.opts);
  }, "q", "exactly one");
  expect_error([] {
    Call a(In::kAttnCompact);
    attention_forward({&a.q, &a.in.q.mx}, a.in.k.input(), a.in.v.input(), a.o, &a.lse, a.opts);
  }, "q", "exactly one");
}

TEST(AttentionFwdErrors, Mxfp8Operands) {
  { Call(In::kAttnCompact).run_mx(); }  // valid
  auto with = [](In i, auto mutate) {
    return [i, mutate] {
      Call a(i);
      mutate(a);
      a.run_mx();
    };
  };
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.q.mx.rowwise_data = TensorDesc(); }), "q.rowwise_data", "is absent");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.k.mx.rowwise_data.data = nullptr; }), "k.rowwise_data", "is absent");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.v.mx.columnwise_data = TensorDesc(); }), "v.columnwise_data",
               "is absent: V is read through its columnwise copy");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.k.mx.rowwise_scale_inv.shape = {8, 1}; }), "k.rowwise_scale_inv",
               "must be [8, 2]");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.v.mx.columnwise_scale_inv.dtype = DType::kInt32; }),
               "v.columnwise_scale_inv", "uint8 or e8m0");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.q.mx.rowwise_data.dtype = DType::kFloat8E5M2; }), "q.rowwise_data",
               "must be uint8 or float8_e4m3");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.q.mx.qkv_layout = QKVLayout::kBSHD; }), "q", "its format must be bshd");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.opts.q_format = a.opts.kv_format = AttnFormat::kBSHD; }), "q",
               "its format must be sbhd, not bshd");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.v.mx.format = Fp8Format::kE5M2; a.in.v.mx.columnwise_data.dtype = DType::kUInt8; }),
               "v", "must share one format");
  expect_error(with(In::kPlain, [](Call& a) { a.in.q.mx.scale_layout = ScaleLayout::kBHSD; }), "q", "BHSD scales");
  expect_error(with(In::kPlain, [](Call& a) { a.in.k.mx.shape = {1, 4, 2, 64}; }), "k.shape", "cannot be read");
  expect_error(with(In::kPlain, [](Call& a) { a.in.k.mx.shape = {2, 256}; }), "k.shape", "cannot be read");
  expect_error(with(In::kAttnCompact, [](Call& a) { a.in.k.mx.shape = {4, 1, 1, 128}; }), "k.shape", "must equal the shape of its codes");
  // a 2-D quantized tensor must be given as a view in the format
  expect_error(with(In::kTokens, [](Call& a) { a.in.q.mx.rowwise_data.shape = a.in.q.mx.shape, a.in.q.mx.rowwise_data.strides = {}; }),
               "q.rowwise_data", "must be 4-D");
  // mixing bf16 and MXFP8
  expect_error([] {
    Call a(In::kAttnCompact);
    attention_forward(a.in.q.input(), {&a.in.q.mx.rowwise_data, nullptr}, a.in.v.input(), a.o, &a.lse, a.opts);
  }, "k", "dtype uint8 must be bfloat16");
  expect_error([] {
    Call a(In::kAttnCompact), b;
    attention_forward(a.in.q.input(), a.in.k.input(), {&b.v, nullptr}, a.o, &a.lse, a.opts);
  }, "v", "must all be bfloat16 or all MXFP8");
}

TEST(AttentionFwdErrors, Thd) {
  ACase c;
  c.qf = c.kvf = AttnFormat::kTHD, c.lq = {3, 2}, c.lkv = {4, 1};
  Inputs in = make_inputs(c);
  std::vector<uint16_t> ob(5 * 2 * 32);
  std::vector<float> lb(2 * 5);
  TensorDesc o(ob.data(), DType::kBFloat16, {5, 2, 32}), lse(lb.data(), DType::kFloat32, {2, 5});
  AttentionOptions opts = options_of(c);
  auto call = [&](std::vector<int32_t> cq, std::vector<int32_t> ckv, DType t = DType::kInt32, AttentionOptions oo = {}) {
    return [&, cq, ckv, t, oo]() mutable {
      TensorDesc a(cq.data(), t, {static_cast<int64_t>(cq.size())}), b(ckv.data(), DType::kInt32, {static_cast<int64_t>(ckv.size())});
      attention_forward(in.q.input(), in.k.input(), in.v.input(), o, &lse, oo, &a, &b);
    };
  };
  call({0, 3, 5}, {0, 4, 5}, DType::kInt32, opts)();  // valid
  expect_error([&] { attention_forward(in.q.input(), in.k.input(), in.v.input(), o, &lse, opts, nullptr, &in.cukv_d); },
               "cu_seqlens_q", "is required");
  expect_error(call({0, 3, 5}, {0, 4, 5}, DType::kInt64, opts), "cu_seqlens_q", "must be int32");
  expect_error(call({1, 3, 5}, {0, 4, 5}, DType::kInt32, opts), "cu_seqlens_q", "must start at 0");
  expect_error(call({0, 3, 5}, {0, 4, 3}, DType::kInt32, opts), "cu_seqlens_kv", "non-decreasing");
  expect_error(call({0, 3, 6}, {0, 4, 5}, DType::kInt32, opts), "cu_seqlens_q", "exceeds the 5 tokens of q");
  expect_error(call({0, 3, 5}, {0, 5}, DType::kInt32, opts), "cu_seqlens_kv", "has 2 entries");
  AttentionOptions small = opts;
  small.max_seqlen_q = 2;
  expect_error(call({0, 3, 5}, {0, 4, 5}, DType::kInt32, small), "max_seqlen_q", "smaller than the longest query sequence (3)");
  lse.shape = {2, 2, 3};
  expect_error(call({0, 3, 5}, {0, 4, 5}, DType::kInt32, opts), "lse", "must be [2, 5]");
}

// Without CUDA kernels (or without a GPU) a CUDA call is an Error, never a crash; with a GPU, the
// CUDA path's own rules name the argument.
TEST(AttentionFwdErrors, CudaPath) {
  if (!test::have_gpu()) {
    Call a;
    for (TensorDesc* t : {&a.q, &a.k, &a.v, &a.o, &a.lse}) t->device = Device{DeviceType::kCUDA, 0};
    EXPECT_THROW(a.run_bf16(), Error);
    return;
  }
#if MXMLA_WITH_CUDA
  // head dims without a kernel instantiation (64 / 32)
  ACase c;
  c.Sq = c.Skv = 4;
  const Inputs in = make_inputs(c);
  expect_error([&] { run_gpu(c, in); }, "q", "no instantiation");
  // V quantized as [t, h, d] (blocks across heads) on the CUDA path
  ACase t;
  t.qf = t.kvf = AttnFormat::kTHD, t.lq = t.lkv = {40}, t.Dqk = t.Dv = 128, t.H = t.Hkv = 2, t.in = In::kPlain;
  const Inputs tin = make_inputs(t);
  expect_error([&] { run_gpu(t, tin); }, "v", "blocks of 32 consecutive keys");
  // head rows of 129 bf16 (258 bytes): not a TMA stride
  ACase m;
  m.Dqk = m.Dv = 128, m.Sq = m.Skv = 8, m.pad = 1;
  const Inputs min = make_inputs(m);
  expect_error([&] { run_gpu(m, min); }, "q", "16 bytes");
#endif
}

}  // namespace
}  // namespace mxmla
