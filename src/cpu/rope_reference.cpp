// mxmla — CPU reference of RoPE forward and backward (SPEC §3). RoPE's arithmetic is two terms
// per element; the reference evaluates exactly the fp32 sequence the kernels promise (a rounded
// product, then one fused multiply-add: include/mxmla/rope.h), so GPU results can be compared bit
// for bit; the tests check it against float64 formulas written independently.
#include <cmath>
#include <cstring>
#include <vector>

#include "common/rope_ops.h"
#include "cpu/reference.h"

namespace mxmla::detail {

namespace {
// out[j] = c[j] * x[a(j)] + sign(j) * s[j] * x[b(j)] (see include/mxmla/rope.h).
struct Term {
  int64_t a, b;
  double sign;
};
Term term(RopeStyle st, int64_t j, int64_t R) {
  const int64_t h = R / 2;
  switch (st) {
    case RopeStyle::kInterleavedInHalvesOut:
      return j < h ? Term{2 * j, 2 * j + 1, -1.0} : Term{2 * (j - h) + 1, 2 * (j - h), 1.0};
    case RopeStyle::kInterleaved:
      return j % 2 == 0 ? Term{j, j + 1, -1.0} : Term{j, j - 1, 1.0};
    default:
      return j < h ? Term{j, j + h, -1.0} : Term{j, j - h, 1.0};
  }
}
}  // namespace

void rope_cpu(const RopeProblem& p) {
  const int64_t R = p.rope_dim, nope = p.D - R;
  std::vector<double> x(R), y(R), c(R), s(R);
  for (int64_t si = 0; si < p.S; ++si)
    for (int64_t bi = 0; bi < p.B; ++bi) {
      const int64_t row = p.row_of_token[si * p.B + bi];
      for (int64_t j = 0; j < R; ++j) {
        c[j] = ref::load_as_double(p.cos, p.tab_t, row * p.tab_st[0] + j * p.tab_st[1]);
        s[j] = ref::load_as_double(p.sin, p.tab_t, row * p.tab_st[0] + j * p.tab_st[1]);
      }
      for (int64_t h = 0; h < p.H; ++h) {
        const int64_t ib = si * p.in_st[0] + bi * p.in_st[1] + h * p.in_st[2];
        const int64_t ob = si * p.out_st[0] + bi * p.out_st[1] + h * p.out_st[2];
        for (int64_t d = 0; d < R; ++d) x[d] = ref::load_as_double(p.in, p.in_t, ib + (nope + d) * p.in_st[3]);
        // The fp32 semantics (include/mxmla/rope.h), written out: a product, then one fma.
        if (!p.backward) {  // out[j] = fmaf(sign(j) s[j], x[b(j)], c[j] x[a(j)])
          for (int64_t j = 0; j < R; ++j) {
            const Term t = term(p.style, j, R);
            const float prod = static_cast<float>(c[j]) * static_cast<float>(x[t.a]);
            y[j] = std::fma(static_cast<float>(t.sign * s[j]), static_cast<float>(x[t.b]), prod);
          }
        } else {  // dx[k] = fmaf(sign(j2) s[j2], g[j2], c[j1] g[j1]) with a(j1) = k, b(j2) = k
          for (int64_t j = 0; j < R; ++j) y[term(p.style, j, R).a] = static_cast<float>(c[j]) * static_cast<float>(x[j]);
          for (int64_t j = 0; j < R; ++j) {
            const Term t = term(p.style, j, R);
            y[t.b] = std::fma(static_cast<float>(t.sign * s[j]), static_cast<float>(x[j]), static_cast<float>(y[t.b]));
          }
        }
        // pass-through first (reads before writes also when out aliases in): the same bits when
        // the dtype does not change (NaN payloads included), else one conversion; then the rotated part
        const int64_t es = p.in_t == DType::kFloat32 ? 4 : 2;
        for (int64_t d = 0; d < nope; ++d) {
          if (p.in_t == p.out_t)
            std::memcpy(static_cast<char*>(p.out) + (ob + d * p.out_st[3]) * es,
                        static_cast<const char*>(p.in) + (ib + d * p.in_st[3]) * es, es);
          else
            ref::store_from_double(p.out, p.out_t, ob + d * p.out_st[3],
                                   ref::load_as_double(p.in, p.in_t, ib + d * p.in_st[3]));
        }
        for (int64_t d = 0; d < R; ++d) ref::store_from_double(p.out, p.out_t, ob + (nope + d) * p.out_st[3], y[d]);
      }
    }
}

}  // namespace mxmla::detail
