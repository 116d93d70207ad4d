// mxmla run --op attention — the attention forward and backward of a DeepSeek-V3 layer (h 128,
// d_qk 192, d_v 128, b 1, causal) on MXFP8 Q, K, V: Q from the fused Q up-projection (x ~ N(0, 1)
// [s, 1536], W ~ N(0, 1/K), YaRN tables: q ~ N(0, 1)), quantized rowwise with BHSD scales in the
// same kernel; K and V random N(0, 1) bf16, quantized by quantize_attention (K rowwise, V
// columnwise, BHSD scales). The forward's output is checked on sampled (b, h, row) triples against a
// float64 attention on the dequantized inputs computed here; the backward (dO ~ N(0, 1) bf16; the
// rowwise Q, K and columnwise V serve every GEMM) on sampled rows (dQ) and keys (dK, dV) against the
// float64 backward of SPEC §5 on the same inputs, O and LSE. On the GPU both are timed, each with the
// same op on the bf16 q, k, v in the same run. Without a GPU it runs the CPU reference at a smaller
// size and says so.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "common/host_util.h"
#include "mxmla/attention.h"
#include "mxmla/qproj.h"
#include "mxmla/rope.h"
#include "tools/cli_args.h"
#include "tools/jobs.h"
#include "tools/run_attention.h"

#if MXMLA_WITH_CUDA
#include "tools/gpu_timer.h"
#endif

namespace mxmla::tool {

namespace {

constexpr int64_t kDqk = 192, kDv = 128, kQLoraRank = 1536;
const char* const kCmd = "mxmla run --op attention";

const char* format_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }
const char* p_name(PFormat p) { return p == PFormat::kBF16 ? "bf16" : "E4M3 (the reference system's p*2^8)"; }

std::string sizes(int64_t S, int64_t H) { return "s " + std::to_string(S) + ", h " + std::to_string(H); }

// FLOPs of the two GEMMs, causal ones on the triangle: 2 b h (s^2 / 2) (d_qk + d_v).
double attention_flop(int64_t S, int64_t H, bool causal) {
  return 2.0 * H * (causal ? 0.5 : 1.0) * double(S) * double(S) * (kDqk + kDv);
}
const char* flop_formula(bool causal) {
  return causal ? "FLOPs = 2*b*h*(s^2/2)*(d_qk + d_v), the causal triangle" : "FLOPs = 2*b*h*s^2*(d_qk + d_v)";
}

// Host inputs, sbhd with b 1: x [S, K] and W [H*192, K] of the Q up-projection with its tables;
// k [S, 1, H, 192], v [S, 1, H, 128] bf16.
struct Inputs {
  std::vector<uint16_t> x, w, k, v;
  std::vector<float> cos, sin;
};

Inputs make_inputs(const AttentionRunArgs& a, int64_t S, int64_t H) {
  Inputs in;
  util::Rng rng(a.seed);
  auto normal_bf16 = [&rng](std::vector<uint16_t>& v, int64_t n, double scale) {
    v.resize(n);
    for (auto& e : v) e = util::to_bf16(static_cast<float>(rng.normal() * scale));
  };
  normal_bf16(in.x, S * kQLoraRank, 1.0);
  normal_bf16(in.w, H * kDqk * kQLoraRank, 1.0 / std::sqrt(double(kQLoraRank)));
  normal_bf16(in.k, S * H * kDqk, 1.0);
  normal_bf16(in.v, S * H * kDv, 1.0);
  in.cos.resize(S * 64), in.sin.resize(S * 64);
  TensorDesc c(in.cos.data(), DType::kFloat32, {S, 64}), s(in.sin.data(), DType::kFloat32, {S, 64});
  rope_tables(positions_arange(S), 64, 10000.0, YarnParams::deepseek_v3(), RopeStyle::kInterleavedInHalvesOut, c, s);
  return in;
}

// The Q up-projection as the attention hand-off: rowwise only, BHSD scales.
QProjOptions q_options(const AttentionRunArgs& a) {
  QProjOptions o;
  o.format = a.format, o.columnwise = false, o.bhsd_scales = true;
  return o;
}

std::vector<int64_t> qkv_shape(int64_t S, int64_t H, int64_t d) { return {S, 1, H, d}; }

// One direction of an attention-quantized (BHSD scales, sbhd) tensor over caller buffers.
MXFP8Tensor one_direction(const std::vector<int64_t>& shape, const MXFP8Shapes& s, void* codes, void* scales,
                          bool rowwise, Fp8Format f, Device dev) {
  MXFP8Tensor t = rowwise ? describe(shape, s, codes, scales, nullptr, nullptr, dev)
                          : describe(shape, s, nullptr, nullptr, codes, scales, dev);
  t.format = f, t.scale_layout = ScaleLayout::kBHSD, t.qkv_layout = QKVLayout::kSBHD, t.attention = true;
  return t;
}

// q, k rowwise [S, 1, H, 192] and v columnwise [S, 1, H, 128], BHSD scales, over buffers from alloc(bytes).
struct Operands {
  MXFP8Tensor q, k, v;
};

template <typename Alloc>
Operands make_operands(int64_t S, int64_t H, Fp8Format f, Device dev, Alloc&& alloc) {
  const std::vector<int64_t> qs = qkv_shape(S, H, kDqk), vs = qkv_shape(S, H, kDv);
  const MXFP8Shapes qsh = attention_shapes(qs, QKVLayout::kSBHD, true), vsh = attention_shapes(vs, QKVLayout::kSBHD, true);
  Operands o;
  o.q = one_direction(qs, qsh, alloc(numel(qs)), alloc(numel(qsh.rowwise_scale)), true, f, dev);
  o.k = one_direction(qs, qsh, alloc(numel(qs)), alloc(numel(qsh.rowwise_scale)), true, f, dev);
  o.v = one_direction(vs, vsh, alloc(numel(vs)), alloc(numel(vsh.columnwise_scale)), false, f, dev);
  return o;
}

// Fills `mx`: q from the fused Q up-projection of x (and its bf16 copy into q_bf16 when given), k and v
// quantized by quantize_attention. Descriptors on the CPU run the references, on the GPU the kernels.
void quantize_operands(const AttentionRunArgs& a, const TensorDesc& x, const TensorDesc& w, const TensorDesc& cos,
                       const TensorDesc& sin, const TensorDesc& k, const TensorDesc& v, Operands& mx,
                       TensorDesc* q_bf16) {
  fused_q_uproj_rope_quant(x, w, cos, sin, mx.q, q_bf16, q_options(a));
  AttentionQuantizeOptions o;
  o.layout = QKVLayout::kSBHD, o.format = a.format, o.bhsd_scales = true;
  o.rowwise = true, o.columnwise = false;
  quantize_attention(k, mx.k, o);
  o.rowwise = false, o.columnwise = true;
  quantize_attention(v, mx.v, o);
}

AttentionOptions attn_options(const AttentionRunArgs& a) {
  AttentionOptions o;
  o.q_format = o.kv_format = AttnFormat::kSBHD;
  o.causal = a.causal, o.p_format = a.p_format;
  return o;
}

// ------------------------------------------------------------------ the check
// q, k, v dequantized exactly (fp32), [S, H, d] (b 1).
struct Dequantized {
  std::vector<float> q, k, v;
};

struct CheckStats {
  int64_t rows = 0, elements = 0, o_far = 0, lse_far = 0;
  double o_max = 0, o_worst = 0, sq = 0, lse_max = 0;  // o_worst: the largest |err| / bound
};

void merge(CheckStats& into, const CheckStats& st) {
  into.rows += st.rows, into.elements += st.elements, into.o_far += st.o_far, into.lse_far += st.lse_far;
  into.o_max = std::max(into.o_max, st.o_max), into.o_worst = std::max(into.o_worst, st.o_worst);
  into.sq += st.sq, into.lse_max = std::max(into.lse_max, st.lse_max);
}

// Bounds against the float64 attention. P in bf16: each p rounded with relative error <= 2^-9
// moves O by <= 2^-9 max|v| (numerator and normaliser alike: 2^-8 with margin), O's bf16 rounding
// <= 2^-9 |O|; LSE: fp32 S and l, l's terms within 2^-9. P in E4M3: the reference system's own
// gate (SPEC §5: atol 0.12, rtol 0.2), LSE within l's 2^-4.
double o_bound(PFormat p, double ref, double vmax) {
  return p == PFormat::kBF16 ? std::ldexp(vmax + std::fabs(ref), -8) : 0.12 + 0.2 * std::fabs(ref);
}
double lse_bound(PFormat p) { return p == PFormat::kBF16 ? 4e-3 : 0.07; }

// Row `i` of head `h` (b 0): o sbhd [S, 1, H, 128] bf16, lse [1, H, S].
void check_row(const AttentionRunArgs& a, int64_t S, int64_t H, const Dequantized& d, const uint16_t* o,
               const float* lse, int64_t h, int64_t i, CheckStats& st) {
  const double scale = 1.0 / std::sqrt(double(kDqk));
  const int64_t n = a.causal ? i + 1 : S;  // s_q == s_kv: top-left causal
  std::vector<double> s(n), acc(kDv, 0.0);
  const float* q = &d.q[(i * H + h) * kDqk];
  double m = -INFINITY, vmax = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float* k = &d.k[(j * H + h) * kDqk];
    double dot = 0;
    for (int64_t c = 0; c < kDqk; ++c) dot += double(q[c]) * double(k[c]);
    s[j] = dot * scale, m = std::max(m, s[j]);
  }
  double l = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double p = std::exp(s[j] - m);
    const float* v = &d.v[(j * H + h) * kDv];
    l += p;
    for (int64_t c = 0; c < kDv; ++c) acc[c] += p * v[c], vmax = std::max(vmax, std::fabs(double(v[c])));
  }
  ++st.rows;
  for (int64_t c = 0; c < kDv; ++c) {
    const double ref = acc[c] / l, got = ref::bf16_to_double(o[(i * H + h) * kDv + c]);
    const double err = std::fabs(got - ref), bound = o_bound(a.p_format, ref, vmax);
    ++st.elements, st.sq += err * err;
    st.o_max = std::max(st.o_max, err), st.o_worst = std::max(st.o_worst, err / bound);
    if (!(err <= bound)) ++st.o_far;  // NaN counts as far
  }
  const double lse_err = std::fabs(double(lse[h * S + i]) - (m + std::log(l)));
  st.lse_max = std::max(st.lse_max, lse_err);
  if (!(lse_err <= lse_bound(a.p_format))) ++st.lse_far;
}

// Checks a.check_rows (b, h, row) triples (every one when n covers them all; else (0, 0, 0), (0, H-1, S-1)
// and random ones), on `threads` threads; prints the result line and returns whether it passed.
bool check(const AttentionRunArgs& a, const Dequantized& d, const uint16_t* o, const float* lse, Progress& progress) {
  const int64_t S = a.seq, H = a.heads, total = S * H, n = std::min(a.check_rows, total);
  std::vector<int64_t> picked(n);
  util::Rng pick(a.seed + 17);
  for (int64_t t = 0; t < n; ++t)
    picked[t] = n == total ? t : t == 0 ? 0 : t == 1 ? total - 1 : static_cast<int64_t>(pick.uniform() * total);
  CheckStats all;
  std::mutex m;
  progress.begin("checking against a float64 attention", n, "rows");
  parallel_for(n, cpu_threads(a.threads), [&](int64_t t) {
    CheckStats st;
    const int64_t hi = picked[t];  // head-major: (h, row)
    check_row(a, S, H, d, o, lse, hi / S, hi % S, st);
    std::lock_guard<std::mutex> g(m);
    merge(all, st);
    progress.advance();
  });
  progress.end();
  const bool ok = all.o_far == 0 && all.lse_far == 0;
  std::printf("check: %lld of %lld (b, h, row) triples against a float64 attention on the dequantized inputs: O max "
              "|err| %.3g (RMSE %.3g, %.2f of its bound), LSE max |err| %.3g (bound %.3g); %lld O elements and %lld "
              "LSE values beyond the bound: %s\n",
              (long long)n, (long long)total, all.o_max, std::sqrt(all.sq / std::max<int64_t>(1, all.elements)),
              all.o_worst, all.lse_max, lse_bound(a.p_format), (long long)all.o_far, (long long)all.lse_far,
              ok ? "OK" : "FAILED");
  return ok;
}

// ------------------------------------------------------------------ the backward and its check
// FLOPs of the backward's five GEMMs, causal ones on the triangle: 2 b h (s^2 / 2) (3 d_qk + 2 d_v).
double backward_flop(int64_t S, int64_t H, bool causal) {
  return 2.0 * H * (causal ? 0.5 : 1.0) * double(S) * double(S) * (3 * kDqk + 2 * kDv);
}
const char* backward_flop_formula(bool causal) {
  return causal ? "FLOPs = 2*b*h*(s^2/2)*(3*d_qk + 2*d_v)" : "FLOPs = 2*b*h*s^2*(3*d_qk + 2*d_v)";
}

// dO ~ N(0, 1) bf16, sbhd [S, 1, H, 128].
std::vector<uint16_t> make_dout(const AttentionRunArgs& a, int64_t S, int64_t H) {
  util::Rng rng(a.seed + 29);
  std::vector<uint16_t> v(S * H * kDv);
  for (auto& e : v) e = util::to_bf16(static_cast<float>(rng.normal()));
  return v;
}

// The backward keeps P and dS in bf16 (whatever the forward's p_format).
AttentionOptions bwd_options(const AttentionRunArgs& a) {
  AttentionOptions o = attn_options(a);
  o.p_format = PFormat::kBF16;
  return o;
}

// Host copies the backward's check reads (b 1; o, dout, dv [S, H, 128], dq, dk [S, H, 192]).
struct BwdHost {
  const Dequantized* d;
  const uint16_t *o, *dout, *dq, *dk, *dv;
  const float* lse;   // [H, S]
  std::vector<double> D;  // [H, S]: rowsum(O ⊙ dO)
};

struct BwdStats {
  int64_t elements = 0, far = 0;
  double max_err = 0, sq = 0, ref_sq = 0;
};
void merge(BwdStats& into, const BwdStats& st) {
  into.elements += st.elements, into.far += st.far, into.max_err = std::max(into.max_err, st.max_err);
  into.sq += st.sq, into.ref_sq += st.ref_sq;
}
// The bound of one gradient element against the float64 backward: 0.02 + 0.05·|ref| (the kernel's
// fp32 sums and the bf16 roundings of P, dS taken at fp32 against float64 values).
void tally(BwdStats& st, uint16_t got_bits, double ref) {
  const double err = std::fabs(ref::bf16_to_double(got_bits) - ref);
  ++st.elements, st.sq += err * err, st.ref_sq += ref * ref, st.max_err = std::max(st.max_err, err);
  if (!(err <= 0.02 + 0.05 * std::fabs(ref))) ++st.far;  // NaN counts as far
}

double bf16_round(double v) { return ref::bf16_to_double(ref::double_to_bf16(v)); }

// P_ij (unrounded) and dS_ij (rounded to bf16) of head h as SPEC §5 defines them, in float64.
struct Pds {
  double p, ds;
};
Pds p_ds(int64_t S, int64_t H, const BwdHost& x, int64_t h, int64_t i, int64_t j) {
  const double scale = static_cast<float>(1.0 / std::sqrt(double(kDqk)));  // the op's fp32 scale
  const float *q = &x.d->q[(i * H + h) * kDqk], *k = &x.d->k[(j * H + h) * kDqk];
  const float* v = &x.d->v[(j * H + h) * kDv];
  const uint16_t* dout = &x.dout[(i * H + h) * kDv];
  double s = 0, dp = 0;
  for (int64_t c = 0; c < kDqk; ++c) s += double(q[c]) * double(k[c]);
  for (int64_t c = 0; c < kDv; ++c) dp += ref::bf16_to_double(dout[c]) * double(v[c]);
  const double p = std::exp(s * scale - double(x.lse[h * S + i]));
  return {p, bf16_round(p * (dp - x.D[h * S + i]) * scale)};
}

// dQ of row i: Σ_j bf16(dS_ij) K_j over the keys row i sees.
void check_dq_row(const AttentionRunArgs& a, int64_t S, int64_t H, const BwdHost& x, int64_t h, int64_t i,
                  BwdStats& st) {
  std::vector<double> acc(kDqk, 0.0);
  const int64_t n = a.causal ? i + 1 : S;
  for (int64_t j = 0; j < n; ++j) {
    const double ds = p_ds(S, H, x, h, i, j).ds;
    const float* k = &x.d->k[(j * H + h) * kDqk];
    for (int64_t c = 0; c < kDqk; ++c) acc[c] += ds * k[c];
  }
  for (int64_t c = 0; c < kDqk; ++c) tally(st, x.dq[(i * H + h) * kDqk + c], acc[c]);
}

// dK, dV of key j: Σ_i bf16(dS_ij) Q_i and Σ_i bf16(P_ij) dO_i over the rows that see key j.
void check_dkdv_key(const AttentionRunArgs& a, int64_t S, int64_t H, const BwdHost& x, int64_t h, int64_t j,
                    BwdStats& st) {
  std::vector<double> dk(kDqk, 0.0), dv(kDv, 0.0);
  for (int64_t i = a.causal ? j : 0; i < S; ++i) {
    const Pds r = p_ds(S, H, x, h, i, j);
    const double p = bf16_round(r.p);
    const float* q = &x.d->q[(i * H + h) * kDqk];
    const uint16_t* dout = &x.dout[(i * H + h) * kDv];
    for (int64_t c = 0; c < kDqk; ++c) dk[c] += r.ds * q[c];
    for (int64_t c = 0; c < kDv; ++c) dv[c] += p * ref::bf16_to_double(dout[c]);
  }
  for (int64_t c = 0; c < kDqk; ++c) tally(st, x.dk[(j * H + h) * kDqk + c], dk[c]);
  for (int64_t c = 0; c < kDv; ++c) tally(st, x.dv[(j * H + h) * kDv + c], dv[c]);
}

// Checks a.check_rows sampled (h, row) pairs for dQ and as many (h, key) pairs for dK, dV (every one
// when that covers them all); prints the result line and returns whether it passed.
bool check_backward(const AttentionRunArgs& a, BwdHost& x, Progress& progress) {
  const int64_t S = a.seq, H = a.heads, total = S * H, n = std::min(a.check_rows, total);
  x.D.assign(total, 0.0);
  parallel_for(total, cpu_threads(a.threads), [&](int64_t t) {  // t = i * H + h
    double acc = 0;
    for (int64_t c = 0; c < kDv; ++c)
      acc += ref::bf16_to_double(x.o[t * kDv + c]) * ref::bf16_to_double(x.dout[t * kDv + c]);
    x.D[(t % H) * S + t / H] = acc;
  });
  std::vector<int64_t> picked(n);
  util::Rng pick(a.seed + 31);
  for (int64_t t = 0; t < n; ++t)
    picked[t] = n == total ? t : t == 0 ? 0 : t == 1 ? total - 1 : static_cast<int64_t>(pick.uniform() * total);
  BwdStats dq, dkv;
  std::mutex m;
  progress.begin("checking the backward against a float64 backward", 2 * n, "rows and keys");
  parallel_for(2 * n, cpu_threads(a.threads), [&](int64_t t) {
    BwdStats st;
    const int64_t hi = picked[t % n];  // head-major: (h, row or key)
    if (t < n) check_dq_row(a, S, H, x, hi / S, hi % S, st);
    else check_dkdv_key(a, S, H, x, hi / S, hi % S, st);
    std::lock_guard<std::mutex> g(m);
    merge(t < n ? dq : dkv, st);
    progress.advance();
  });
  progress.end();
  const bool ok = dq.far == 0 && dkv.far == 0;
  auto rel = [](const BwdStats& st) { return std::sqrt(st.sq / std::max(st.ref_sq, 1e-300)); };
  std::printf("check: backward, %lld of %lld rows (dQ) and keys (dK, dV) against a float64 backward (SPEC §5 on the "
              "dequantized inputs, the kernel's O and LSE): dQ max |err| %.3g (relative RMS %.2g), dK/dV max |err| "
              "%.3g (relative RMS %.2g); %lld elements beyond 0.02 + 0.05*|ref|: %s\n",
              (long long)n, (long long)total, dq.max_err, rel(dq), dkv.max_err, rel(dkv),
              (long long)(dq.far + dkv.far), ok ? "OK" : "FAILED");
  return ok;
}

void describe_job(const AttentionRunArgs& a) {
  const int64_t S = a.seq, H = a.heads;
  std::printf("attention forward (DeepSeek-V3 MLA, b 1): q [%lld, 1, %lld, 192] MXFP8 %s rowwise from the fused Q "
              "up-projection of x [%lld, %lld], k [%lld, 1, %lld, 192] rowwise, v [%lld, 1, %lld, 128] columnwise, "
              "BHSD scales; %s, P %s\n",
              (long long)S, (long long)H, format_name(a.format), (long long)S, (long long)kQLoraRank, (long long)S,
              (long long)H, (long long)S, (long long)H, a.causal ? "causal" : "not causal", p_name(a.p_format));
}

// Host bytes: inputs, codes and scales, the fp32 dequantized copies, o and lse, per-thread rows.
double host_bytes(int64_t S, int64_t H) {
  const double sh = double(S) * H;
  return 2.0 * S * kQLoraRank + 2.0 * H * kDqk * kQLoraRank + 8.0 * S * 64 + sh * (2 * 192 + 2 * 128) +
         sh * (192 + 192 + 128) * (1 + 4 + 1.0 / 16) + sh * (2 * 128 + 4) +
         sh * (2 * 128 + 2 * 192 + 2 * 192 + 2 * 128 + 8);  // the backward: dO, dQ, dK, dV, D
}

// The run's sizes: the device's defaults where the arguments leave them open.
AttentionRunArgs resolve(const AttentionRunArgs& args, bool gpu) {
  AttentionRunArgs a = args;
  if (a.seq < 0) a.seq = gpu ? 4096 : 256;
  if (a.heads < 0) a.heads = gpu ? 128 : 2;
  if (a.check_rows < 0) a.check_rows = gpu ? 256 : 1024;
  check_host_memory(kCmd, host_bytes(a.seq, a.heads), sizes(a.seq, a.heads));
  return a;
}

}  // namespace

int run_attention_cpu(const AttentionRunArgs& args, Progress& progress) {
  const AttentionRunArgs a = resolve(args, false);
  const int64_t S = a.seq, H = a.heads;
  std::printf("%s: no GPU in use: running the CPU reference of the attention forward at s %lld, h %lld%s\n", kCmd,
              (long long)S, (long long)H,
              args.seq < 0 && args.heads < 0 ? " (smaller than the GPU default s 4096, h 128)" : "");
  describe_job(a);
  progress.begin("generating inputs");
  Inputs in = make_inputs(a, S, H);
  const std::vector<int64_t> qs = qkv_shape(S, H, kDqk), vs = qkv_shape(S, H, kDv);
  std::deque<std::vector<uint8_t>> bufs;
  Operands mx = make_operands(S, H, a.format, Device{}, [&bufs](int64_t n) { return bufs.emplace_back(n).data(); });
  progress.begin("the fused Q up-projection and the K, V quantization (CPU reference)");
  quantize_operands(a, TensorDesc(in.x.data(), DType::kBFloat16, {S, kQLoraRank}),
                    TensorDesc(in.w.data(), DType::kBFloat16, {H * kDqk, kQLoraRank}),
                    TensorDesc(in.cos.data(), DType::kFloat32, {S, 64}), TensorDesc(in.sin.data(), DType::kFloat32, {S, 64}),
                    TensorDesc(in.k.data(), DType::kBFloat16, qs), TensorDesc(in.v.data(), DType::kBFloat16, vs), mx,
                    nullptr);

  std::vector<uint16_t> o(S * H * kDv);
  std::vector<float> lse(H * S);
  TensorDesc od(o.data(), DType::kBFloat16, vs), ld(lse.data(), DType::kFloat32, {1, H, S});
  progress.begin("attention forward (CPU reference)");
  const auto t0 = std::chrono::steady_clock::now();
  attention_forward(AttnInput{nullptr, &mx.q}, AttnInput{nullptr, &mx.k}, AttnInput{nullptr, &mx.v}, od, &ld,
                    attn_options(a));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  progress.begin("dequantizing q, k, v");
  Dequantized d{std::vector<float>(numel(qs)), std::vector<float>(numel(qs)), std::vector<float>(numel(vs))};
  TensorDesc dq(d.q.data(), DType::kFloat32, qs), dk(d.k.data(), DType::kFloat32, qs), dv(d.v.data(), DType::kFloat32, vs);
  dequantize(mx.q, dq, false), dequantize(mx.k, dk, false), dequantize(mx.v, dv, true);
  progress.end();
  std::printf("attention forward in %.3f s on the CPU reference (%.2f GFLOP/s; %s)\n", secs,
              attention_flop(S, H, a.causal) / secs / 1e9, flop_formula(a.causal));
  const bool ok_fwd = check(a, d, o.data(), lse.data(), progress);

  // the backward on the same inputs, O and LSE
  std::vector<uint16_t> dout = make_dout(a, S, H), gq(numel(qs)), gk(numel(qs)), gv(numel(vs));
  const TensorDesc dod(dout.data(), DType::kBFloat16, vs);
  TensorDesc gqd(gq.data(), DType::kBFloat16, qs), gkd(gk.data(), DType::kBFloat16, qs), gvd(gv.data(), DType::kBFloat16, vs);
  progress.begin("attention backward (CPU reference)");
  const auto t1 = std::chrono::steady_clock::now();
  attention_backward(AttnInput{&dod, nullptr}, AttnInput{nullptr, &mx.q}, AttnInput{nullptr, &mx.k},
                     AttnInput{nullptr, &mx.v}, od, ld, gqd, gkd, gvd, bwd_options(a));
  const double bsecs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  progress.end();
  std::printf("attention backward in %.3f s on the CPU reference (%.2f GFLOP/s; %s)\n", bsecs,
              backward_flop(S, H, a.causal) / bsecs / 1e9, backward_flop_formula(a.causal));
  BwdHost x{&d, o.data(), dout.data(), gq.data(), gk.data(), gv.data(), lse.data(), {}};
  const bool ok_bwd = check_backward(a, x, progress);
  return ok_fwd && ok_bwd ? 0 : 1;
}

#if MXMLA_WITH_CUDA
int run_attention_cuda(const AttentionRunArgs& args, Progress& progress) {
  const AttentionRunArgs a = resolve(args, true);
  const int64_t S = a.seq, H = a.heads;
  std::printf("%s: GPU %s\n", kCmd, cuda_device_description(0).c_str());
  describe_job(a);
  progress.begin("generating inputs");
  const Inputs in = make_inputs(a, S, H);
  const Device dev{DeviceType::kCUDA, 0};
  const std::vector<int64_t> qs = qkv_shape(S, H, kDqk), vs = qkv_shape(S, H, kDv);
  util::DeviceBuffer dx(in.x.size() * 2), dw(in.w.size() * 2), dc(in.cos.size() * 4), ds(in.sin.size() * 4);
  util::DeviceBuffer dk(in.k.size() * 2), dv(in.v.size() * 2), dq(numel(qs) * 2);
  dx.upload(in.x.data()), dw.upload(in.w.data()), dc.upload(in.cos.data()), ds.upload(in.sin.data());
  dk.upload(in.k.data()), dv.upload(in.v.data());
  std::deque<util::DeviceBuffer> bufs;
  Operands mx = make_operands(S, H, a.format, dev, [&bufs](int64_t n) { return bufs.emplace_back(n).ptr; });
  // q (MXFP8, and its bf16 copy for the bf16 run) from the fused Q up-projection; k, v quantized
  TensorDesc q_bf16(dq.ptr, DType::kBFloat16, qs, dev);
  const TensorDesc k_bf16(dk.ptr, DType::kBFloat16, qs, dev), v_bf16(dv.ptr, DType::kBFloat16, vs, dev);
  quantize_operands(a, TensorDesc(dx.ptr, DType::kBFloat16, {S, kQLoraRank}, dev),
                    TensorDesc(dw.ptr, DType::kBFloat16, {H * kDqk, kQLoraRank}, dev),
                    TensorDesc(dc.ptr, DType::kFloat32, {S, 64}, dev), TensorDesc(ds.ptr, DType::kFloat32, {S, 64}, dev),
                    k_bf16, v_bf16, mx, &q_bf16);

  util::DeviceBuffer o_mx(numel(vs) * 2), o_bf(numel(vs) * 2), l_mx(H * S * 4), l_bf(H * S * 4);
  TensorDesc od(o_mx.ptr, DType::kBFloat16, vs, dev), ld(l_mx.ptr, DType::kFloat32, {1, H, S}, dev);
  TensorDesc od2(o_bf.ptr, DType::kBFloat16, vs, dev), ld2(l_bf.ptr, DType::kFloat32, {1, H, S}, dev);
  const AttentionOptions o = attn_options(a);
  auto run_mx = [&] {
    attention_forward(AttnInput{nullptr, &mx.q}, AttnInput{nullptr, &mx.k}, AttnInput{nullptr, &mx.v}, od, &ld, o);
  };
  auto run_bf = [&] {
    attention_forward(AttnInput{&q_bf16, nullptr}, AttnInput{&k_bf16, nullptr}, AttnInput{&v_bf16, nullptr}, od2,
                      &ld2, o);
  };
  run_mx();  // argument errors before anything is timed
  std::string bf_error;
  try {
    run_bf();
  } catch (const Error& e) {  // the bf16 run is a comparison only: the MXFP8 job goes on without it
    bf_error = e.what();
  }
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());

  GpuTimer timer(a.iters);
  const bool have_bf = bf_error.empty();
  progress.begin("timing (MXFP8, bf16 inputs; 3 rounds)", have_bf ? 6 : 3, "measurements");
  std::vector<float> t_mx, t_bf;
  for (int rep = 0; rep < 3; ++rep) {  // interleaved, so that clocks and neighbours affect both alike
    t_mx.push_back(timer.median_ms(run_mx)), progress.advance();
    if (have_bf) t_bf.push_back(timer.median_ms(run_bf)), progress.advance();
  }
  run_mx();  // the outputs to check (o_mx is only written by the MXFP8 run)
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out = o_mx.download<uint16_t>();
  const std::vector<float> lse = l_mx.download<float>();

  progress.begin("dequantizing q, k, v");
  Dequantized d;
  {
    util::DeviceBuffer f32(numel(qs) * 4);
    auto deq = [&](const MXFP8Tensor& t, bool columnwise) {
      TensorDesc fd(f32.ptr, DType::kFloat32, t.shape, dev);
      dequantize(t, fd, columnwise);
      std::vector<float> h(numel(t.shape));
      MXMLA_CUDA_CHECK(cudaMemcpy(h.data(), f32.ptr, h.size() * 4, cudaMemcpyDeviceToHost));
      return h;
    };
    d.q = deq(mx.q, false), d.k = deq(mx.k, false), d.v = deq(mx.v, true);
  }
  const bool ok = check(a, d, out.data(), lse.data(), progress);
  const double flop = attention_flop(S, H, a.causal);
  const float ms = median(t_mx);
  std::printf("MXFP8 attention : %.4f ms  %.0f TFLOP/s (%s; median of %lld calls, L2 flushed, 3 rounds)\n", ms,
              flop / ms / 1e9, flop_formula(a.causal), (long long)a.iters);
  if (have_bf) {
    const float mb = median(t_bf);
    std::printf("bf16 attention  : %.4f ms  %.0f TFLOP/s (the same op on the bf16 q, k, v; not checked)\n", mb,
                flop / mb / 1e9);
    std::printf("ratio           : MXFP8 / bf16 inputs = %.3f (time)\n", ms / mb);
  } else {
    std::printf("bf16 attention  : not timed (%s)\n", bf_error.c_str());
  }

  // the backward: dO ~ N(0, 1); the MXFP8 run's O and LSE (and for the same op on the bf16 inputs,
  // the bf16 run's)
  std::vector<uint16_t> dout = make_dout(a, S, H);
  util::DeviceBuffer ddo(dout.size() * 2), gq(numel(qs) * 2), gk(numel(qs) * 2), gv(numel(vs) * 2);
  util::DeviceBuffer gq2(numel(qs) * 2), gk2(numel(qs) * 2), gv2(numel(vs) * 2);
  ddo.upload(dout.data());
  const TensorDesc dod(ddo.ptr, DType::kBFloat16, vs, dev);
  TensorDesc gqd(gq.ptr, DType::kBFloat16, qs, dev), gkd(gk.ptr, DType::kBFloat16, qs, dev),
      gvd(gv.ptr, DType::kBFloat16, vs, dev);
  TensorDesc gqd2(gq2.ptr, DType::kBFloat16, qs, dev), gkd2(gk2.ptr, DType::kBFloat16, qs, dev),
      gvd2(gv2.ptr, DType::kBFloat16, vs, dev);
  const AttentionOptions ob = bwd_options(a);
  auto bwd_mx = [&] {
    attention_backward(AttnInput{&dod, nullptr}, AttnInput{nullptr, &mx.q}, AttnInput{nullptr, &mx.k},
                       AttnInput{nullptr, &mx.v}, od, ld, gqd, gkd, gvd, ob);
  };
  auto bwd_bf = [&] {
    attention_backward(AttnInput{&dod, nullptr}, AttnInput{&q_bf16, nullptr}, AttnInput{&k_bf16, nullptr},
                       AttnInput{&v_bf16, nullptr}, od2, ld2, gqd2, gkd2, gvd2, ob);
  };
  bwd_mx();
  std::string bwd_bf_error = have_bf ? "" : "no bf16 forward";
  if (have_bf) {
    try {
      bwd_bf();
    } catch (const Error& e) {
      bwd_bf_error = e.what();
    }
  }
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  const bool have_bf_bwd = bwd_bf_error.empty();
  progress.begin("timing the backward (MXFP8, bf16 inputs; 3 rounds)", have_bf_bwd ? 6 : 3, "measurements");
  std::vector<float> b_mx, b_bf;
  for (int rep = 0; rep < 3; ++rep) {
    b_mx.push_back(timer.median_ms(bwd_mx)), progress.advance();
    if (have_bf_bwd) b_bf.push_back(timer.median_ms(bwd_bf)), progress.advance();
  }
  bwd_mx();  // the gradients to check
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  progress.end();
  const std::vector<uint16_t> hq = gq.download<uint16_t>(), hk = gk.download<uint16_t>(), hv = gv.download<uint16_t>();
  BwdHost x{&d, out.data(), dout.data(), hq.data(), hk.data(), hv.data(), lse.data(), {}};
  const bool ok_bwd = check_backward(a, x, progress);
  const double bflop = backward_flop(S, H, a.causal);
  const float bms = median(b_mx);
  std::printf("MXFP8 attention backward : %.4f ms  %.0f TFLOP/s (%s; median of %lld calls, L2 flushed, 3 rounds)\n",
              bms, bflop / bms / 1e9, backward_flop_formula(a.causal), (long long)a.iters);
  if (have_bf_bwd) {
    const float bmb = median(b_bf);
    std::printf("bf16 attention backward  : %.4f ms  %.0f TFLOP/s (the same op on the bf16 q, k, v; not checked)\n",
                bmb, bflop / bmb / 1e9);
    std::printf("ratio backward           : MXFP8 / bf16 inputs = %.3f (time)\n", bms / bmb);
  } else {
    std::printf("bf16 attention backward  : not timed (%s)\n", bwd_bf_error.c_str());
  }
  return ok && ok_bwd ? 0 : 1;
}
#endif

}  // namespace mxmla::tool
