// mxmla — CPU reference of the block-FP8 quantization (include/mxmla/blockfp8.h): amax over each
// block, the scale rule of common/blockfp8_common.h, fp32 products, the FP8 rounding of SPEC §2
// (ref::round_to_fp8: nearest even, saturating, NaN -> 0x7F).
#include <algorithm>
#include <cmath>

#include "common/blockfp8_common.h"
#include "common/blockfp8_ops.h"
#include "cpu/reference.h"

namespace mxmla::detail {

void block_quantize_cpu(const BlockQuantizeProblem& p) {
  const int64_t br = p.block_rows, nbc = (p.cols + kBlockFp8K - 1) / kBlockFp8K;
  auto value = [&](int64_t r, int64_t c) {  // exact in fp32 (bf16 or fp32 input)
    return static_cast<float>(ref::load_as_double(p.in, p.in_t, r * p.in_st + c));
  };
  for (int64_t r0 = 0; r0 < p.rows; r0 += br)
    for (int64_t j = 0; j < nbc; ++j) {
      const int64_t r1 = std::min(p.rows, r0 + br), c0 = j * kBlockFp8K, c1 = std::min(p.cols, c0 + kBlockFp8K);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::fmax(amax, std::fabs(value(r, c)));  // (NaN ignored)
      const float s = block_fp8_scale(amax, p.pow2);
      p.scale_inv[(r0 / br) * p.s_st + j] = block_fp8_scale_inv(s);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          volatile float prod = value(r, c) * s;  // one fp32 rounding
          p.codes[r * p.cols + c] = ref::round_to_fp8(static_cast<double>(prod), Fp8Format::kE4M3);
        }
    }
}

}  // namespace mxmla::detail
