// mxmla — the DeepSeek-V3 FP8 recipe: E4M3 codes with one fp32 scale per block of 1 x 128 values
// (activations) or 128 x 128 values (weights), as DeepSeek-V3's checkpoints and TransformerEngine's
// Float8BlockScaling recipe store them (docs/spec.md, "Block FP8"), and the fused Q up-projection
// on such operands: the Hopper-speed weight path (FP8 tensor cores; MXFP8 has none on SM90).
//
// Quantization of a block (TransformerEngine's rule): amax = max |v| over the block's values (NaN
// ignored); scale = 448 / amax in fp32 (1 when amax is 0 or Inf; the largest finite fp32 when the
// quotient overflows), with pow2_scales rounded down to a power of two (its mantissa bits
// cleared); code = E4M3(fp32(v · scale)) rounded to nearest even, saturating to ±448, NaN → 0x7F;
// scale_inv = fp32(1 / scale) is what is stored. A value's dequantized value is code · scale_inv.
#pragma once

#include <cstdint>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/qproj.h"
#include "mxmla/tensor.h"

namespace mxmla {

// E4M3 codes [rows, cols] (row-major, innermost stride 1) and fp32 scale_inv, one per block:
// block_rows 1: [rows, ceil(cols / 128)]; block_rows 128: [ceil(rows / 128), ceil(cols / 128)]
// (innermost stride 1, any row stride: TransformerEngine's padded GEMM-ready rows are accepted).
struct BlockFP8Tensor {
  TensorDesc data;
  TensorDesc scale_inv;
  int64_t block_rows = 1;  // 1 (1 x 128 blocks) or 128 (128 x 128 blocks)
};

struct BlockQuantizeOptions {
  int64_t block_rows = 1;   // 1 or 128
  bool pow2_scales = true;  // TransformerEngine's default; false: plain fp32 scales
};

// Shape of scale_inv for codes [rows, cols].
std::vector<int64_t> block_scale_shape(int64_t rows, int64_t cols, int64_t block_rows);

// in: bf16 or fp32 [rows, cols] (innermost stride 1) -> out.data (E4M3 or uint8, [rows, cols],
// contiguous) and out.scale_inv (fp32, block_scale_shape), caller-allocated; out.block_rows is
// set from the options.
void quantize_blockwise(const TensorDesc& in, BlockFP8Tensor& out, const BlockQuantizeOptions& opts,
                        Stream stream = nullptr);

// The fused Q up-projection (include/mxmla/qproj.h) on block-FP8 operands: x [T, K] with 1 x 128
// blocks, w [N, K] with 128 x 128 blocks (opts.weight_layout kNK). The GEMM's semantics:
//   q_acc[t, n] = Σ_kb (Σ_{k in kb} x_code · w_code) · x_scale_inv[t, kb] · w_scale_inv[n / 128, kb]
// each block's sum exact in the CPU reference (float64 throughout, rounded to fp32 and then bf16 as
// the bf16 op's); on CUDA the sums of a block come from the FP8 tensor cores (exact products, their
// own reduced-precision additions) and are added across blocks in fp32 with the two factors. Then
// the bf16 op's RoPE + MXFP8 epilogue. CUDA: the SM90 kernel with FP8 wgmma (K a multiple of 16,
// 16-byte aligned code rows, opts.format E4M3 output).
void fused_q_uproj_rope_quant(const BlockFP8Tensor& x, const BlockFP8Tensor& w, const TensorDesc& cos,
                              const TensorDesc& sin, MXFP8Tensor& out, TensorDesc* q, const QProjOptions& opts,
                              Stream stream = nullptr);

}  // namespace mxmla
