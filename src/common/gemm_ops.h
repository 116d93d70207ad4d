// mxmla internal — the GEMM problem that src/gemm.cpp (validation, direction choice) hands to a
// backend: the CPU reference (src/cpu/gemm_reference.cpp) or, later, the SM90 kernel.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/mxfp8_common.h"
#include "common/ops.h"
#include "common/rope_cuda.h"
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

// The CUDA GEMM kernels' extents: M, N and K at most 2^31 − 256 (their tile coordinates, TMA's
// included, are 32-bit numbers); an error naming out (M, N) or b (K) beyond.
inline void check_cuda_gemm_extents(const char* op, int64_t M, int64_t N, int64_t K) {
  if (M > kMaxCudaExtent || N > kMaxCudaExtent)
    throw Error(op, "out", "is [" + std::to_string(M) + ", " + std::to_string(N) +
                               "]: the CUDA GEMM kernels take at most 2^31 - 256 rows and columns "
                               "(32-bit tile coordinates)");
  if (K > kMaxCudaExtent)
    throw Error(op, "b", "contraction length K = " + std::to_string(K) +
                             ": the CUDA GEMM kernels take at most 2^31 - 256 (32-bit tile coordinates)");
}

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
// A 2-D matrix descriptor [rows, cols] (`what` words it): rank, strides, sizes, last dim contiguous,
// data pointer; errors name `op` and `arg`.
void check_matrix(const char* op, const std::string& arg, const TensorDesc& t, const std::string& what);
// A GEMM's out [M, N] (check_matrix, then shape, dtype bf16 / fp32, fp32 with accumulate, rows that
// do not overlap); `formula` words what accumulate computes; errors name `op` and "out".
void check_gemm_out(const char* op, const TensorDesc& out, int64_t M, int64_t N, bool accumulate,
                    const std::string& formula);
// The same for either copy: contract_cols = false reads the columnwise copy of [rows, cols] (the
// contraction along its rows).
GemmOperandView gemm_operand(const char* op, const char* name, const MXFP8Tensor& t, bool contract_cols);
// The MXFP8 Linear on CUDA (src/cuda/sm90_mxfp8_gemm.cu; api: src/linear.cpp). forward: q quantizes x
// (bf16 [T, K]) with its columnwise outputs set (x_saved); g: the fprop GEMM with b (W rowwise) and
// out (y) set, its operand a made here. backward: q views dy (bf16 [T, N]) without outputs; dgrad
// (null: none) and wgrad with b and out set, their a made here.
void linear_forward_cuda(const QuantizeProblem& q, GemmProblem g, Stream stream);
void linear_backward_cuda(const QuantizeProblem& q, const GemmProblem* dgrad, GemmProblem wgrad, Stream stream);
// The same backward with dy the RoPE backward of dq (linear_backward's RopeGrad form): r has the
// rope fields set (outputs unset); T = tokens, N = H·D. The fast path's pass writes the GEMMs' bf16
// copies of dy instead of its codes; other shapes run rope_quantize_cuda and the GEMMs' own passes.
void rope_linear_backward_cuda(const RopeQuantizeParams& r, const GemmProblem* dgrad, GemmProblem wgrad,
                               Stream stream);
// Operand A's bf16 copy made by the caller (the MXFP8 Linear: quantize_cuda's row_copy / col_copy):
// op(A) [M, K] K-major bf16, row stride a_ld elements (a multiple of 8), exact unless the caller's
// check set *flag. The GEMM's design C reads it instead of dequantizing A; `flag` is its design
// flag, already holding the copy's check (the call ORs B's in). Design B, behind the flag, reads A's
// codes (the view p.a): a_codes launches the caller's pass that writes them behind the flag (or
// always, where a design that reads them is forced); the call launches it once B's check has run
// too and after design C's kernel, so that the codes may overwrite a16's buffer.
struct GemmPrepared {
  const uint16_t* a16 = nullptr;
  int64_t a_ld = 0;
  uint32_t* flag = nullptr;
  std::function<void()> a_codes;
};
// The SM90 kernel (MXFP8 operands; src/cuda/sm90_mxfp8_gemm.cu); prep: null, or A's prepared copy.
void mxfp8_gemm_cuda(const GemmProblem& p, Stream stream, const GemmPrepared* prep = nullptr);

}  // namespace mxmla::detail
