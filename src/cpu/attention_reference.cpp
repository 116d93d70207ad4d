// mxmla — CPU reference of the attention forward (SPEC §5): float64 attention on the exactly
// dequantized inputs. What the SM90 kernel is checked against (within tolerances: the kernel
// accumulates in fp32 and, by default, rounds P to bf16).
//
//   inputs   bf16 values, or code · 2^(e−127) (E4M3 / E5M2 decode of SPEC §2; e = 255 → NaN):
//            Q and K through their rowwise scales, V through its columnwise scales
//   S        s_j = (Σ_d q_d·k_jd) · softmax_scale, in float64, over the visible keys only
//   mask     causal top-left: key j visible to query i iff j ≤ i; bottom-right: j ≤ i + s_kv − s_q
//            (per sequence for thd); masked keys never enter a sum (a NaN in one included)
//   GQA      query head h reads kv head h / (H / H_kv)
//   O        Σ p_j·v_j / Σ p_j rounded once to bf16 (nearest even); LSE = m + ln(l) rounded to fp32
//   no keys  a row with no visible key: O = 0, LSE = −inf
//
// p_format kBF16: the exact softmax, p_j = exp(s_j − m) with m the row maximum.
//
// p_format kE4M3, mxmla's definition of the reference system's E4M3 P: the online form of
// FlashAttention-3's FP8 path with key blocks of 128 (block t = keys [128t, 128t + 128) counted
// from key 0 of the sequence, only the visible ones):
//   m_t = max(m_{t−1}, max of block t's scaled scores)          (m_{−1} = −inf, o_{−1} = l_{−1} = 0)
//   p   = exp(s − m_t)                                          (float64)
//   P̃   = e4m3_rn(p · 2^8) / 2^8                                (nearest even, saturating at 448)
//   o_t = o_{t−1} · exp(m_{t−1} − m_t) + Σ P̃ · v
//   l_t = l_{t−1} · exp(m_{t−1} − m_t) + Σ p                    (the unquantized p)
//   O   = o / l,  LSE = m + ln(l)
// Everything is float64 except the E4M3 rounding of P̃ (p · 256 as a double → nearest E4M3).
//
// Special values follow float64 arithmetic: a NaN score (a NaN input or scale among the visible
// keys) makes its row's O and LSE NaN; NaN in V spreads to the O columns it touches.
//
// Memory: per (sequence, kv head) K and V dequantized once (s_kv rows), one row of scores.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/attention_ops.h"
#include "cpu/reference.h"

namespace mxmla::detail {

namespace {

// Reads rows of one operand (dequantized to float64).
struct OperandReader {
  const AttentionProblem& p;
  const AttnTensorView& view;
  const AttnScaleView& sc;
  const int32_t* cu;
  bool rowwise;  // Q, K: rowwise scales; V: columnwise

  // Element (b, h, s, 0..D-1) into out[0..D).
  void row(int64_t b, int64_t h, int64_t s, int64_t D, double* out) const {
    const int64_t tok = (cu ? cu[b] : 0) + s;
    const int64_t off = b * view.st_b + tok * view.st_s + h * view.st_h;
    if (!p.fp8) {
      const auto* x = static_cast<const uint16_t*>(view.data) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = ref::bf16_to_double(x[d]);
      return;
    }
    const auto* codes = static_cast<const uint8_t*>(view.data) + off;
    const int64_t bi = b * sc.bi_b;
    const int64_t r = tok * sc.row_s + b * sc.row_b + h * sc.row_h + sc.row0;
    const int64_t c0 = b * sc.col_b + h * sc.col_h;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = c0 + d;
      const int64_t so = rowwise ? row_scale_offset(sc.map, bi, r, c / 32) : col_scale_offset(sc.map, bi, r / 32, c);
      out[d] = ref::fp8_to_double(codes[d], p.fmt) * ref::e8m0_to_double(sc.ptr[so]);
    }
  }
};

double e4m3_p_tilde(double p) {
  return ref::fp8_to_double(ref::round_to_fp8(p * 256.0, Fp8Format::kE4M3), Fp8Format::kE4M3) / 256.0;
}

}  // namespace

void attention_fwd_cpu(const AttentionProblem& p) {
  const int64_t group = p.H / p.Hkv;
  const double scale = static_cast<double>(p.softmax_scale);
  const double ninf = -std::numeric_limits<double>::infinity();
  const OperandReader rq{p, p.q, p.q_sc, p.thd ? p.cu_q : nullptr, true};
  const OperandReader rk{p, p.k, p.k_sc, p.thd ? p.cu_kv : nullptr, true};
  const OperandReader rv{p, p.v, p.v_sc, p.thd ? p.cu_kv : nullptr, false};
  std::vector<double> K, V, q(p.Dqk), s, o(p.Dv);

  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t sq = p.thd ? p.cu_q[b + 1] - p.cu_q[b] : p.Sq;
    const int64_t skv = p.thd ? p.cu_kv[b + 1] - p.cu_kv[b] : p.Skv;
    const int64_t q_tok0 = p.thd ? p.cu_q[b] : 0;
    K.resize(static_cast<size_t>(skv * p.Dqk));
    V.resize(static_cast<size_t>(skv * p.Dv));
    s.resize(static_cast<size_t>(skv));
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      for (int64_t j = 0; j < skv; ++j) {
        rk.row(b, hk, j, p.Dqk, K.data() + j * p.Dqk);
        rv.row(b, hk, j, p.Dv, V.data() + j * p.Dv);
      }
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i = 0; i < sq; ++i) {
          // visible keys: [0, n)
          int64_t n = skv;
          if (p.causal) n = std::clamp<int64_t>(i + 1 + (p.bottom_right ? skv - sq : 0), 0, skv);
          uint16_t* orow = p.o + b * p.o_st_b + (q_tok0 + i) * p.o_st_s + h * p.o_st_h;
          float* lse = p.lse ? p.lse + (p.thd ? h * p.total_q + q_tok0 + i : (b * p.H + h) * p.Sq + i) : nullptr;
          if (n == 0) {
            for (int64_t d = 0; d < p.Dv; ++d) orow[d] = 0;
            if (lse) *lse = -std::numeric_limits<float>::infinity();
            continue;
          }
          rq.row(b, h, i, p.Dqk, q.data());
          for (int64_t j = 0; j < n; ++j) {
            const double* kr = K.data() + j * p.Dqk;
            double a = 0;
            for (int64_t d = 0; d < p.Dqk; ++d) a += q[d] * kr[d];
            s[j] = a * scale;
          }
          std::fill(o.begin(), o.end(), 0.0);
          double m = ninf, l = 0;
          // kBF16: one block holding every visible key (the exact softmax); kE4M3: blocks of 128
          const int64_t blk = p.p_format == PFormat::kE4M3 ? 128 : n;
          for (int64_t j0 = 0; j0 < n; j0 += blk) {
            const int64_t j1 = std::min(n, j0 + blk);
            double mb = m;
            for (int64_t j = j0; j < j1; ++j) mb = std::max(mb, s[j]);  // a NaN score is skipped here
            const double alpha = std::exp(m - mb);                      // 0 for the first block
            if (j0 > 0) {
              for (int64_t d = 0; d < p.Dv; ++d) o[d] *= alpha;
              l *= alpha;
            }
            for (int64_t j = j0; j < j1; ++j) {
              const double pj = std::exp(s[j] - mb);
              const double pt = p.p_format == PFormat::kE4M3 ? e4m3_p_tilde(pj) : pj;
              const double* vr = V.data() + j * p.Dv;
              for (int64_t d = 0; d < p.Dv; ++d) o[d] += pt * vr[d];
              l += pj;
            }
            m = mb;
          }
          for (int64_t d = 0; d < p.Dv; ++d) orow[d] = ref::double_to_bf16(o[d] / l);
          if (lse) *lse = static_cast<float>(m + std::log(l));
        }
    }
  }
}

}  // namespace mxmla::detail
