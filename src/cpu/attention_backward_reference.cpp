// mxmla — CPU reference of the attention backward (SPEC §5; include/mxmla/attention.h:
// attention_backward): float64 on the exactly dequantized inputs, each GEMM reading its own copy.
//
// For every query row i of a sequence and every visible key j (masks as in the forward):
//   s_ij  = (Q_row_i · K_row_j) · scale                      P_ij = exp(s_ij − LSE_i)   (LSE as given, fp32)
//   dP_ij = dO_row_i · V_row_j                                D_i  = Σ_d O_id · dO_row_id   (O bf16)
//   dS_ij = P_ij · (dP_ij − D_i) · scale
//   dV_j += bf16(P_ij) · dO_col_i      dK_j += bf16(dS_ij) · Q_col_i      dQ_i += bf16(dS_ij) · K_col_j
// with bf16(x) the nearest-even bf16 value of x (mxmla's P and dS formats); sums in float64, each
// gradient element rounded once to bf16. dK, dV of a kv head sum over its query heads (GQA). A row
// without visible keys adds nothing (its dQ is 0); thd tokens outside every sequence get 0.
// Special values follow float64 arithmetic (a NaN among the visible keys reaches the sums it enters).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/attention_ops.h"
#include "cpu/reference.h"

namespace mxmla::detail {

namespace {

// Rows (b, h, s, 0..D-1) of one read of an operand, dequantized to float64.
struct Reader {
  const AttnRead& r;
  const int32_t* cu;

  void row(int64_t b, int64_t h, int64_t s, int64_t D, double* out) const {
    const int64_t tok = (cu ? cu[b] : 0) + s;
    const int64_t off = b * r.view.st_b + tok * r.view.st_s + h * r.view.st_h;
    if (!r.fp8) {
      const auto* x = static_cast<const uint16_t*>(r.view.data) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = ref::bf16_to_double(x[d]);
      return;
    }
    const AttnScaleView& sc = r.sc;
    const auto* codes = static_cast<const uint8_t*>(r.view.data) + off;
    const int64_t bi = b * sc.bi_b;
    const int64_t row = tok * sc.row_s + b * sc.row_b + h * sc.row_h + sc.row0;
    const int64_t c0 = b * sc.col_b + h * sc.col_h;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = c0 + d;
      const int64_t so = r.rowwise ? row_scale_offset(sc.map, bi, row, c / 32) : col_scale_offset(sc.map, bi, row / 32, c);
      out[d] = ref::fp8_to_double(codes[d], r.fmt) * ref::e8m0_to_double(sc.ptr[so]);
    }
  }
};

double bf16_round(double x) { return ref::bf16_to_double(ref::double_to_bf16(x)); }

void write_row(uint16_t* base, const AttnTensorView& v, const int32_t* cu, int64_t b, int64_t h, int64_t s,
               const double* x, int64_t D) {
  uint16_t* row = base + b * v.st_b + ((cu ? cu[b] : 0) + s) * v.st_s + h * v.st_h;
  for (int64_t d = 0; d < D; ++d) row[d] = x ? ref::double_to_bf16(x[d]) : uint16_t{0};
}

}  // namespace

void attention_bwd_cpu(const AttentionBwdProblem& p) {
  const int64_t group = p.H / p.Hkv;
  const double scale = static_cast<double>(p.softmax_scale);
  const int32_t* cq = p.thd ? p.cu_q : nullptr;
  const int32_t* ck = p.thd ? p.cu_kv : nullptr;
  const Reader q_s{p.q_s, cq}, q_g{p.q_g, cq}, do_s{p.do_s, cq}, do_g{p.do_g, cq};
  const Reader k_s{p.k_s, ck}, k_g{p.k_g, ck}, v_s{p.v_s, ck};
  const int64_t Dqk = p.Dqk, Dv = p.Dv;
  std::vector<double> Ks, Kg, Vs, dK, dV, qs(Dqk), qg(Dqk), dos(Dv), dog(Dv), o(Dv), dq(Dqk);

  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t sq = p.thd ? p.cu_q[b + 1] - p.cu_q[b] : p.Sq;
    const int64_t skv = p.thd ? p.cu_kv[b + 1] - p.cu_kv[b] : p.Skv;
    const int64_t q_tok0 = p.thd ? p.cu_q[b] : 0;
    Ks.resize(static_cast<size_t>(skv * Dqk)), Kg.resize(Ks.size());
    Vs.resize(static_cast<size_t>(skv * Dv));
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      for (int64_t j = 0; j < skv; ++j) {
        k_s.row(b, hk, j, Dqk, Ks.data() + j * Dqk);
        k_g.row(b, hk, j, Dqk, Kg.data() + j * Dqk);
        v_s.row(b, hk, j, Dv, Vs.data() + j * Dv);
      }
      dK.assign(static_cast<size_t>(skv * Dqk), 0.0);
      dV.assign(static_cast<size_t>(skv * Dv), 0.0);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i = 0; i < sq; ++i) {
          int64_t n = skv;
          if (p.causal) n = std::clamp<int64_t>(i + 1 + (p.bottom_right ? skv - sq : 0), 0, skv);
          if (n == 0) {
            write_row(p.dq, p.dq_v, cq, b, h, i, nullptr, Dqk);
            continue;
          }
          q_s.row(b, h, i, Dqk, qs.data());
          q_g.row(b, h, i, Dqk, qg.data());
          do_s.row(b, h, i, Dv, dos.data());
          do_g.row(b, h, i, Dv, dog.data());
          const uint16_t* orow = p.o + b * p.o_st_b + (q_tok0 + i) * p.o_st_s + h * p.o_st_h;
          double D = 0;
          for (int64_t d = 0; d < Dv; ++d) D += ref::bf16_to_double(orow[d]) * dos[d];
          const double lse = p.lse[p.thd ? h * p.total_q + q_tok0 + i : (b * p.H + h) * p.Sq + i];
          std::fill(dq.begin(), dq.end(), 0.0);
          for (int64_t j = 0; j < n; ++j) {
            const double* ks = Ks.data() + j * Dqk;
            const double* vs = Vs.data() + j * Dv;
            double s = 0, dp = 0;
            for (int64_t d = 0; d < Dqk; ++d) s += qs[d] * ks[d];
            for (int64_t d = 0; d < Dv; ++d) dp += dos[d] * vs[d];
            const double P = std::exp(s * scale - lse);
            const double Pb = bf16_round(P), dSb = bf16_round(P * (dp - D) * scale);
            double* dv = dV.data() + j * Dv;
            double* dk = dK.data() + j * Dqk;
            const double* kg = Kg.data() + j * Dqk;
            for (int64_t d = 0; d < Dv; ++d) dv[d] += Pb * dog[d];
            for (int64_t d = 0; d < Dqk; ++d) dk[d] += dSb * qg[d], dq[d] += dSb * kg[d];
          }
          write_row(p.dq, p.dq_v, cq, b, h, i, dq.data(), Dqk);
        }
      for (int64_t j = 0; j < skv; ++j) {
        write_row(p.dk, p.dk_v, ck, b, hk, j, dK.data() + j * Dqk, Dqk);
        write_row(p.dv, p.dv_v, ck, b, hk, j, dV.data() + j * Dv, Dv);
      }
    }
  }
  if (p.thd) {  // tokens after the last sequence
    for (int64_t t = p.cu_q[p.B]; t < p.total_q; ++t)
      for (int64_t h = 0; h < p.H; ++h) write_row(p.dq, p.dq_v, nullptr, 0, h, t, nullptr, Dqk);
    for (int64_t t = p.cu_kv[p.B]; t < p.total_kv; ++t)
      for (int64_t h = 0; h < p.Hkv; ++h) {
        write_row(p.dk, p.dk_v, nullptr, 0, h, t, nullptr, Dqk);
        write_row(p.dv, p.dv_v, nullptr, 0, h, t, nullptr, Dv);
      }
  }
}

}  // namespace mxmla::detail
