// mxmla internal — the GEMM problem that src/gemm.cpp (validation, direction choice) hands to a
// backend: the CPU reference (src/cpu/gemm_reference.cpp) or, later, the SM90 kernel.
#pragma once

#include <cstdint>
#include <vector>

#include "common/mxfp8_common.h"
#include "mxmla/gemm.h"

namespace mxmla::detail {

// One operand as stored: a 2-D matrix [rows, cols] (row stride ld elements, cols contiguous) of
// FP8 codes (bytes) or bf16. The contraction runs along its cols (contract_cols: read through the
// rowwise scales) or along its rows (the columnwise scales). op(A) is [M, K] and op(B)ᵀ is [N, K]:
// A stored [M, K] (contract_cols) or [K, M]; B stored [N, K] (contract_cols) or [K, N].
struct GemmOperandView {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  bool contract_cols = true;
  const uint8_t* scales = nullptr;  // fp8 only
  ScaleMap map;                     // rowwise map (contract_cols) or columnwise map, of [rows, cols]
};

struct GemmProblem {
  int64_t M = 0, N = 0, K = 0;
  bool fp8 = false;
  Fp8Format fmt = Fp8Format::kE4M3;
  GemmOperandView a, b;
  void* out = nullptr;  // [M, N], row stride ld_out elements
  DType out_t = DType::kBFloat16;
  int64_t ld_out = 0;
  bool accumulate = false;
  double alpha = 1.0;
};

void gemm_cpu(const GemmProblem& p);
// The CPU reference's exact decode of one operand: op(X) [n_out, K] in float64, K contiguous
// (code · 2^(e − 127) for MXFP8, the values for bf16).
std::vector<double> gemm_decode(const GemmProblem& p, const GemmOperandView& v, int64_t n_out);
// An MXFP8 operand [rows, cols] read along its cols (its rowwise copy), with mxmla.gemm's checks of
// it (shape, copy present, dtypes, scale shapes); errors name `op` and the argument `name`.
GemmOperandView gemm_rowwise_operand(const char* op, const char* name, const MXFP8Tensor& t);
// The SM90 kernel (MXFP8 operands; src/cuda/sm90_mxfp8_gemm.cu).
void mxfp8_gemm_cuda(const GemmProblem& p, Stream stream);

}  // namespace mxmla::detail
