// mxmla — the GEMMs of an MXFP8 Linear y = x·Wᵀ (SPEC §6) with the quantization of x and of the
// output gradient fused into the GEMMs' operand preparation. Each call gives exactly the bits of
// the composition in its comment (quantize + gemm, include/mxmla/mxfp8.h and gemm.h), in fewer
// passes over memory: on CUDA one pass over x (or dy) writes the bf16 values of its MXFP8 copies
// that the GEMM reads, instead of FP8 codes that the GEMM then dequantizes in a pass of its own.
//
// linear_forward:  x   bf16 [T, K] (last dim contiguous, any row stride; K a positive multiple of 32)
//                  w   MXFP8Tensor [N, K] from quantize (E4M3, compact or swizzled scales) with its
//                      rowwise copy
//                  y   bf16 [T, N] (any row stride, last dim contiguous)
//                      = gemm(quantize(x), w)                        (fprop)
//                  x_saved: x's columnwise copy, as quantize(x, {rowwise = false, columnwise = true,
//                      E4M3, compact}) writes it: caller-allocated codes [T, K] and scales
//                      [ceil(T/32), K] (columnwise_data, columnwise_scale_inv); what the backward reads.
// linear_backward: dy  bf16 [T, N] (N a positive multiple of 32)
//                  w   with its columnwise copy; x_saved with its columnwise copy (E4M3)
//                  dx  bf16 [T, K], or null (no dgrad)
//                      = gemm(quantize(dy), w, {.trans_b = false})                       (dgrad)
//                  dw  [N, K] float32 (or bfloat16 without accumulate)
//                      = gemm(quantize(dy), x_saved, {.trans_a = true, .trans_b = false})  (wgrad),
//                      added to dw with accumulate (Megatron's main_grad)
// All on one device; CPU tensors run the reference (the composition itself).
#pragma once

#include "mxmla/mxfp8.h"
#include "mxmla/rope.h"
#include "mxmla/tensor.h"

namespace mxmla {

void linear_forward(const TensorDesc& x, const MXFP8Tensor& w, TensorDesc& y, MXFP8Tensor& x_saved,
                    Stream stream = nullptr);
void linear_backward(const TensorDesc& dy, const MXFP8Tensor& w, const MXFP8Tensor& x_saved, TensorDesc* dx,
                     TensorDesc& dw, bool accumulate, Stream stream = nullptr);
// The same with dy = torch.cat([part0, part1], -1).flatten(-2), read in place (ConcatInput,
// include/mxmla/mxfp8.h): bf16 parts [T, h, d0] and [T, h, d1], N = h·(d0 + d1) — e.g. the gradient of
// MLA's kv_b projection from attention's dK (its first nope_dim columns, a view) and dV without a
// concatenation pass.
void linear_backward(const ConcatInput& dy, const MXFP8Tensor& w, const MXFP8Tensor& x_saved, TensorDesc* dx,
                     TensorDesc& dw, bool accumulate, Stream stream = nullptr);

// The same with dy the RoPE backward of dq, quantized as rope_backward_quantize quantizes it
// (E4M3, dy = R^T dq in fp32 viewed as [T, h·d], T = dq's tokens in their memory order): the
// backward GEMMs of the fused Q up-projection (its dgrad and wgrad from attention's dQ) =
// gemm(rope_backward_quantize(dq, cos, sin), w, {.trans_b = false}) and the wgrad likewise, bit for
// bit. dq, cos, sin, rope and cu_seqlens follow rope_backward_quantize's rules (include/mxmla/rope.h).
// On CUDA, for bf16 DeepSeek-V3 query heads (d 192, rope_dim 64) at one token stride, the RoPE pass
// writes the bf16 values the GEMMs read instead of codes they would dequantize in passes of their own.
struct RopeGrad {
  TensorDesc dq, cos, sin;
  RopeOptions rope;
  const TensorDesc* cu_seqlens = nullptr;
};
void linear_backward(const RopeGrad& dy, const MXFP8Tensor& w, const MXFP8Tensor& x_saved, TensorDesc* dx,
                     TensorDesc& dw, bool accumulate, Stream stream = nullptr);

}  // namespace mxmla
