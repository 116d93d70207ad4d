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

#include "mxmla/gemm.h"
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
  // Quantize inᵀ instead of in: out.data is [cols, rows] (the codes transposed in the same pass) and
  // out.scale_inv block_scale_shape(cols, rows, block_rows); the same bits as quantizing a
  // contiguous copy of inᵀ. What a Linear's backward needs: the GEMMs read K-major operands, so
  // wgrad's dyᵀ and xᵀ (1 x 128 blocks along the tokens) and dgrad's Wᵀ (128 x 128 blocks: the same
  // blocks and scales as W's, transposed) are quantized this way.
  bool transpose = false;
};

// Shape of scale_inv for codes [rows, cols].
std::vector<int64_t> block_scale_shape(int64_t rows, int64_t cols, int64_t block_rows);

// in: bf16 or fp32 [rows, cols] (innermost stride 1) -> out.data (E4M3 or uint8, [rows, cols],
// contiguous; [cols, rows] with opts.transpose) and out.scale_inv (fp32, block_scale_shape of the
// data's shape), caller-allocated; out.block_rows is set from the options.
void quantize_blockwise(const TensorDesc& in, BlockFP8Tensor& out, const BlockQuantizeOptions& opts,
                        Stream stream = nullptr);

// Both directions in one pass over in (what a Linear's forward needs of x and its backward of dy):
// out = the quantization of in ([rows, cols]) and out_t = that of inᵀ ([cols, rows]), each the same
// bits as the one-direction call; opts.transpose must be false.
void quantize_blockwise(const TensorDesc& in, BlockFP8Tensor& out, BlockFP8Tensor& out_t,
                        const BlockQuantizeOptions& opts, Stream stream = nullptr);

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

// The block-FP8 GEMM (the DeepSeek-V3 recipe's Linear GEMMs): D[M, N] = alpha · A · Bᵀ (+ D),
// A [M, K] and B [N, K] block-FP8 (E4M3 codes, K contiguous; either block_rows), fp32 sums:
//   D[m, n] = alpha · Σ_kb (Σ_{k in kb} a_code · b_code) · a_scale_inv[m / a.block_rows, kb]
//                                                        · b_scale_inv[n / b.block_rows, kb]
// kb the 128-wide blocks of K. The CPU reference computes it in float64 (each block's sum is exact)
// and rounds once to the output; on CUDA the sums of a block come from the FP8 tensor cores (exact
// products, their own reduced-precision additions) and are added across blocks in fp32 with the
// two factors (the fused Q up-projection's mainloop). The three GEMMs of a Linear y = x·Wᵀ, every
// operand K-major (BlockQuantizeOptions::transpose makes the transposed ones):
//   fprop  y  = x · Wᵀ    gemm(x [T, K] 1 x 128, W [N, K] 128 x 128)
//   dgrad  dx = dy · W    gemm(dy [T, N] 1 x 128, Wᵀ [K, N] 128 x 128)
//   wgrad  dW = dyᵀ · x   gemm(dyᵀ [N, T] 1 x 128, xᵀ [K, T] 1 x 128)
// opts: trans_a false and trans_b true (the K-major layout above); accumulate adds into an fp32 out.
// out: caller-allocated [M, N] bf16 or fp32, any row stride, last dim contiguous. CUDA (SM90): any
// M, N, K (code rows that are not 16-byte aligned, K % 16 != 0 for contiguous codes, are copied
// into aligned rows first: one pass over that operand).
void gemm(const BlockFP8Tensor& a, const BlockFP8Tensor& b, TensorDesc& out, const GemmOptions& opts,
          Stream stream = nullptr);

}  // namespace mxmla
