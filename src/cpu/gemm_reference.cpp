// mxmla — CPU reference of the MXFP8 GEMM (SPEC §6): D = alpha · op(A) · op(B) (+ D).
//
//   operands  exactly dequantized: code · 2^(e−127) (E4M3 / E5M2 decode of SPEC §2; e = 255 → NaN),
//             each through the copy quantized along the contraction (rowwise scales when the
//             contraction runs along the stored matrix's columns, columnwise scales when along its
//             rows; a columnwise tail block is read like any other); bf16 operands: their values
//   products  in float64 (exact: a code times a power of two, squared, stays far inside float64)
//   sum       in float64, k = 0, 1, …, K−1 in order, per output element
//   then      · alpha (float64), then with accumulate + D (the fp32 D as float64), rounded once to
//             the output: bf16 round-to-nearest-even, fp32 by a plain cast; NaN as the library's
//             canonical NaN (bf16 0x7FC0, fp32 0x7FC00000)
//
// The reference sums in float64; the GPU kernel will sum in fp32 (SPEC §6: exact products, fp32
// accumulation), so its tests compare within the fp32-accumulation bound — except on
// integer-valued data (small integers, scales in range), where every fp32 partial sum is exact
// and the kernel must match this reference bit for bit.
//
// Special values follow float64 arithmetic: a NaN scale (0xFF) or NaN code makes every output its
// block reaches NaN; E5M2 infinities give ±Inf or NaN (Inf · 0, Inf − Inf); results beyond the
// output's range round to ±Inf.
//
// Work: each operand is decoded once into a float64 matrix [M, K] / [N, K] (K contiguous), then
// the dot products run on every core over blocks of output rows (common/parallel.h).
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "common/gemm_ops.h"
#include "common/parallel.h"
#include "cpu/reference.h"

namespace mxmla::detail {

namespace {

constexpr int64_t kRowBlock = 16;  // output rows per task: one row of B is reused across them

}  // namespace

// op(A) [M, K] (or op(B)ᵀ [N, K]) in float64, row i holding the contraction k = 0..K-1 contiguous.
std::vector<double> gemm_decode(const GemmProblem& p, const GemmOperandView& v, int64_t n_out) {
  const int64_t K = p.K;
  std::vector<double> d(static_cast<size_t>(n_out * K));
  std::array<double, 256> code{}, scale{};
  if (p.fp8)
    for (int i = 0; i < 256; ++i) {
      code[i] = ref::fp8_to_double(static_cast<uint8_t>(i), p.fmt);
      scale[i] = ref::e8m0_to_double(static_cast<uint8_t>(i));
    }
  const auto* codes = static_cast<const uint8_t*>(v.data);
  const auto* bf16 = static_cast<const uint16_t*>(v.data);
  const int64_t tasks = ceil_div(n_out, kRowBlock);
  parallel_for(tasks, threads_for(double(n_out) * double(K), tasks), [&](int64_t t) {
    for (int64_t i = t * kRowBlock; i < std::min(n_out, (t + 1) * kRowBlock); ++i)
      for (int64_t k = 0; k < K; ++k) {
        // stored element: (i, k) when the contraction runs along the columns, else (k, i)
        const int64_t r = v.contract_cols ? i : k, c = v.contract_cols ? k : i;
        const int64_t off = r * v.ld + c;
        double x;
        if (p.fp8) {
          const int64_t so = v.contract_cols ? row_scale_offset(v.map, 0, r, c / 32) : col_scale_offset(v.map, 0, r / 32, c);
          x = code[codes[off]] * scale[v.scales[so]];
        } else {
          x = ref::bf16_to_double(bf16[off]);
        }
        d[i * K + k] = x;
      }
  });
  return d;
}

void gemm_cpu(const GemmProblem& p) {
  const int64_t M = p.M, N = p.N, K = p.K;
  const std::vector<double> a = gemm_decode(p, p.a, M), b = gemm_decode(p, p.b, N);
  const int64_t tasks = ceil_div(M, kRowBlock);
  parallel_for(tasks, threads_for(double(M) * double(N) * double(K), tasks), [&](int64_t t) {
    const int64_t m0 = t * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
    for (int64_t n = 0; n < N; ++n) {
      const double* br = b.data() + n * K;
      for (int64_t m = m0; m < m1; ++m) {
        const double* ar = a.data() + m * K;
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += ar[k] * br[k];
        double v = s * p.alpha;
        const int64_t off = m * p.ld_out + n;
        if (p.accumulate) v += static_cast<const float*>(p.out)[off];
        ref::store_from_double(p.out, p.out_t, off, v);
      }
    }
  });
}

}  // namespace mxmla::detail
