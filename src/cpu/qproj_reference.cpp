// mxmla — CPU reference of the fused Q up-projection (SPEC §4): GEMM in float64, rounded to fp32
// (what an exact fp32 accumulation gives) and then to bf16; RoPE through the RoPE reference
// (fp32, include/mxmla/rope.h) into fp32; MXFP8 through the quantize reference on those fp32 values.
// Integer-valued inputs small enough that every fp32 partial sum is exact make the GPU kernel's
// fp32 accumulation equal to this one, so its codes and scales compare bit for bit.
#include <vector>

#include "common/blockfp8_common.h"
#include "common/blockfp8_ops.h"
#include "common/gemm_ops.h"
#include "common/ops.h"
#include "common/qproj_ops.h"
#include "common/rope_ops.h"
#include "cpu/reference.h"

namespace mxmla::detail {

namespace {

// The op from x's rows xrow(b, s, t, buf) -> K doubles (token t = (b, s); buf: K doubles to fill) and W's rows wd [N][K] (float64 values).
template <class XRow>
void qproj_decoded(const QProjProblem& p, XRow&& xrow, const std::vector<double>& wd) {
  const int64_t N = p.NH * p.D, tokens = p.B * p.S;
  // q = bf16(fp32(x . W^T)) [tokens, NH, D] in token order
  std::vector<uint16_t> q(static_cast<size_t>(tokens * N));
  std::vector<double> buf(static_cast<size_t>(p.K));
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t s = 0; s < p.S; ++s) {
      const int64_t t = p.sbhd ? s * p.B + b : b * p.S + s;
      const double* xr = xrow(b, s, t, buf);
      for (int64_t n = 0; n < N; ++n) {
        const double* wr = wd.data() + n * p.K;
        double a = 0;
        for (int64_t k = 0; k < p.K; ++k) a += xr[k] * wr[k];
        q[t * N + n] = ref::float_to_bf16(static_cast<float>(a));
      }
    }
  // RoPE (fp32 out), q viewed as [S, B, NH, D]
  std::vector<float> qf(static_cast<size_t>(tokens * N));
  RopeProblem r;
  r.in = q.data(), r.in_t = DType::kBFloat16, r.out = qf.data(), r.out_t = DType::kFloat32;
  r.S = p.S, r.B = p.B, r.H = p.NH, r.D = p.D, r.rope_dim = p.R, r.style = p.style;
  const int64_t st_s = p.sbhd ? p.B * N : N, st_b = p.sbhd ? N : p.S * N;
  const int64_t st[4] = {st_s, st_b, p.D, 1};
  for (int i = 0; i < 4; ++i) r.in_st[i] = st[i], r.out_st[i] = st[i];
  r.cos = p.cos, r.sin = p.sin, r.tab_t = p.tab_t, r.tab_st[0] = p.tab_st, r.tab_st[1] = 1;
  r.row_of_token.resize(tokens);
  for (int64_t s = 0; s < p.S; ++s)
    for (int64_t b = 0; b < p.B; ++b) r.row_of_token[s * p.B + b] = s;
  rope_cpu(r);
  // MXFP8 of the fp32 values, in quantize_attention's [batch, rows, cols] geometry
  QuantizeProblem qp;
  qp.in = qf.data(), qp.in_dtype = DType::kFloat32, qp.fmt = p.fmt;
  qp.batch = p.row_map.batch, qp.rows = p.S, qp.cols = p.row_map.cols;
  qp.row_stride = qp.cols, qp.batch_stride = p.S * qp.cols;
  qp.row_codes = p.row_codes, qp.row_scales = p.row_scales, qp.col_codes = p.col_codes, qp.col_scales = p.col_scales;
  qp.row_map = p.row_map, qp.col_map = p.col_map;
  quantize_cpu(qp);
  if (p.q != nullptr)
    for (size_t i = 0; i < qf.size(); ++i) p.q[i] = ref::float_to_bf16(qf[i]);
}

}  // namespace

void qproj_cpu(const QProjProblem& p) {
  const int64_t N = p.NH * p.D;
  const auto* x = static_cast<const uint16_t*>(p.x);
  const auto* w = static_cast<const uint16_t*>(p.w);
  std::vector<double> wd(static_cast<size_t>(N * p.K));  // W decoded once, as rows of K doubles
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < p.K; ++k)
      wd[n * p.K + k] = ref::bf16_to_double(p.w_kn ? w[k * p.w_st + n] : w[n * p.w_st + k]);
  qproj_decoded(p, [&](int64_t b, int64_t s, int64_t, std::vector<double>& buf) {
    for (int64_t k = 0; k < p.K; ++k) buf[k] = ref::bf16_to_double(x[b * p.x_st_b + s * p.x_st_s + k]);
    return buf.data();
  }, wd);
}

// MXFP8 x [T, K] (row t = token t) and W [N, K]: both decoded exactly (gemm_decode), then the same.
void qproj_mxfp8_cpu(const QProjProblem& p, const GemmProblem& g) {
  const std::vector<double> xd = gemm_decode(g, g.a, g.M), wd = gemm_decode(g, g.b, g.N);
  qproj_decoded(p, [&](int64_t, int64_t, int64_t t, std::vector<double>&) { return xd.data() + t * p.K; }, wd);
}

// Block-FP8 x [T, K] (1 x 128 blocks) and W [N, K] (128 x 128): code · scale_inv in float64 (exact:
// both are fp32 numbers), then the same.
void qproj_block_fp8_cpu(const QProjProblem& p, const BlockFp8Operands& bo) {
  const int64_t N = p.NH * p.D;
  const auto* xc = static_cast<const uint8_t*>(p.x);
  const auto* wc = static_cast<const uint8_t*>(p.w);
  std::vector<double> wd(static_cast<size_t>(N * p.K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < p.K; ++k)
      wd[n * p.K + k] = ref::fp8_to_double(wc[n * p.w_st + k], Fp8Format::kE4M3) *
                        static_cast<double>(bo.sw[(n / kBlockFp8K) * bo.sw_ld + k / kBlockFp8K]);
  qproj_decoded(p, [&](int64_t b, int64_t s, int64_t t, std::vector<double>& buf) {
    for (int64_t k = 0; k < p.K; ++k)
      buf[k] = ref::fp8_to_double(xc[b * p.x_st_b + s * p.x_st_s + k], Fp8Format::kE4M3) *
               static_cast<double>(bo.sx[t * bo.sx_ld + k / kBlockFp8K]);
    return buf.data();
  }, wd);
}

}  // namespace mxmla::detail
