// mxmla — CPU reference of the block-FP8 quantization (include/mxmla/blockfp8.h): amax over each
// block, the scale rule of common/blockfp8_common.h, fp32 products, the FP8 rounding of SPEC §2
// (ref::round_to_fp8: nearest even, saturating, NaN -> 0x7F).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/blockfp8_common.h"
#include "common/blockfp8_ops.h"
#include "common/parallel.h"
#include "cpu/reference.h"

namespace mxmla::detail {

void block_quantize_cpu(const BlockQuantizeProblem& p) {
  // the quantized matrix Q [rows, cols]: in, or inᵀ (transpose)
  const int64_t rows = p.transpose ? p.cols : p.rows, cols = p.transpose ? p.rows : p.cols;
  const int64_t br = p.block_rows, nbc = (cols + kBlockFp8K - 1) / kBlockFp8K;
  auto value = [&](int64_t r, int64_t c) {  // Q[r, c], exact in fp32 (bf16 or fp32 input)
    const int64_t off = p.transpose ? c * p.in_st + r : r * p.in_st + c;
    return static_cast<float>(ref::load_as_double(p.in, p.in_t, off));
  };
  for (int64_t r0 = 0; r0 < rows; r0 += br)
    for (int64_t j = 0; j < nbc; ++j) {
      const int64_t r1 = std::min(rows, r0 + br), c0 = j * kBlockFp8K, c1 = std::min(cols, c0 + kBlockFp8K);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::fmax(amax, std::fabs(value(r, c)));  // (NaN ignored)
      const float s = block_fp8_scale(amax, p.pow2);
      p.scale_inv[(r0 / br) * p.s_st + j] = block_fp8_scale_inv(s);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          volatile float prod = value(r, c) * s;  // one fp32 rounding
          p.codes[r * cols + c] = ref::round_to_fp8(static_cast<double>(prod), Fp8Format::kE4M3);
        }
    }
}

// The block-FP8 GEMM in float64: E4M3 values are exact in float64, so is every product and every
// block's sum of 128 of them (at most 2^36 · 128 apart in magnitude: within 53 bits); the sum over
// blocks of sum · factor · factor in float64, · alpha, (+ D), rounded once to the output.
void block_gemm_cpu(const BlockGemmProblem& p) {
  double lut[256];
  for (int c = 0; c < 256; ++c) lut[c] = ref::fp8_to_double(static_cast<uint8_t>(c), Fp8Format::kE4M3);
  const int64_t M = p.M, N = p.N, K = p.K, nkb = (K + kBlockFp8K - 1) / kBlockFp8K;
  auto decode = [&](const uint8_t* x, int64_t rows, int64_t ld) {
    std::vector<double> v(static_cast<size_t>(rows * K));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) v[r * K + k] = lut[x[r * ld + k]];
    return v;
  };
  const std::vector<double> a = decode(p.a, M, p.a_ld), b = decode(p.b, N, p.b_ld);
  constexpr int64_t kRows = 8;
  const int64_t tasks = (M + kRows - 1) / kRows;
  parallel_for(tasks, threads_for(double(M) * double(N) * double(K), tasks), [&](int64_t t) {
    for (int64_t m = t * kRows; m < std::min(M, (t + 1) * kRows); ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t kb = 0; kb < nkb; ++kb) {
          double blk = 0;
          for (int64_t k = kb * kBlockFp8K; k < std::min(K, (kb + 1) * kBlockFp8K); ++k) blk += a[m * K + k] * b[n * K + k];
          s += blk * double(p.sa[(m / p.a_br) * p.sa_ld + kb]) * double(p.sb[(n / p.b_br) * p.sb_ld + kb]);
        }
        double v = s * p.alpha;
        const int64_t off = m * p.ld_out + n;
        if (p.accumulate) v += static_cast<const float*>(p.out)[off];
        ref::store_from_double(p.out, p.out_t, off, v);
      }
  });
}

}  // namespace mxmla::detail
