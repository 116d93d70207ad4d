// mxmla — the MXFP8 GEMM of MXFP8 training (SPEC §6): D = alpha · op(A) · op(B) (+ D).
//
//   op(A) = A     (A given as [M, K]: contraction along its last dim  -> A's rowwise copy)
//   op(A) = Aᵀ    (trans_a: A given as [K, M]: along its leading dim   -> A's columnwise copy)
//   op(B) = Bᵀ    (trans_b, the default: B given as [N, K]            -> B's rowwise copy)
//   op(B) = B     (B given as [K, N]: along its leading dim            -> B's columnwise copy)
//
// Each operand is read through the copy quantized along the contraction axis, dequantized exactly
// (code · 2^(e−127)); products exact, fp32 accumulation; D rounded once to bf16 (or kept in fp32,
// or added to an fp32 D). The three GEMMs of a Linear y = x·Wᵀ (x [T, K], W [N, K]):
//   fprop  y  = x · Wᵀ    gemm(x, W)                                   x rowwise, W rowwise
//   dgrad  dx = dy · W    gemm(dy, W, {.trans_b = false})              dy rowwise, W columnwise
//   wgrad  dW = dyᵀ · x   gemm(dy, x, {.trans_a = true, .trans_b = false}) dy columnwise, x columnwise
// bf16 operands (both) run the same GEMM on bf16 values.
#pragma once

#include <cstdint>

#include "mxmla/mxfp8.h"
#include "mxmla/tensor.h"

namespace mxmla {

struct GemmOptions {
  bool trans_a = false;
  bool trans_b = true;
  bool accumulate = false;  // D += alpha · op(A) · op(B); D must be fp32
  double alpha = 1.0;
};

// One GEMM operand: a 2-D bf16 tensor, or a 2-D MXFP8Tensor holding the copy the contraction needs
// (compact or swizzled scales). Exactly one of the two is set.
struct GemmInput {
  const TensorDesc* bf16 = nullptr;
  const MXFP8Tensor* mx = nullptr;
};

// out: caller-allocated [M, N], bf16 or fp32 (fp32 when accumulate), any row stride, last dim
// contiguous. Both operands MXFP8 (the same FP8 format) or both bf16, on out's device.
void gemm(const GemmInput& a, const GemmInput& b, TensorDesc& out, const GemmOptions& opts, Stream stream = nullptr);

}  // namespace mxmla
