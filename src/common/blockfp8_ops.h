// mxmla internal — block-FP8 problems (include/mxmla/blockfp8.h) that src/blockfp8.cpp
// (validation) hands to a backend: the CPU reference (src/cpu/blockfp8_reference.cpp,
// src/cpu/qproj_reference.cpp) or the CUDA kernels (src/cuda/blockfp8_quantize.cu,
// src/cuda/sm90_qproj_block_fp8.cu).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/qproj_ops.h"
#include "mxmla/tensor.h"

namespace mxmla::detail {

// in [rows, cols] (bf16 or fp32, element (r, c) at in + r * in_st + c) -> codes [rows, cols]
// contiguous E4M3, scale_inv [block rows][ceil(cols / 128)] at scale_inv + i * s_st + j.
struct BlockQuantizeProblem {
  const void* in = nullptr;
  DType in_t = DType::kBFloat16;
  int64_t rows = 0, cols = 0, in_st = 0;
  uint8_t* codes = nullptr;
  float* scale_inv = nullptr;
  int64_t s_st = 0;
  int64_t block_rows = 1;  // 1 or 128
  bool pow2 = true;
  // codes [cols, rows] and scale_inv of the blocks of inᵀ (in stays [rows, cols]): the quantization
  // of inᵀ, written transposed
  bool transpose = false;
  // both directions in one pass (transpose false): codes / scale_inv are in's quantization and
  // codes_t [cols, rows] / scale_inv_t (row stride s_st_t) inᵀ's; null: in's only
  uint8_t* codes_t = nullptr;
  float* scale_inv_t = nullptr;
  int64_t s_st_t = 0;
};
// The fp32 scale_inv `s` of blocks whose grid is `ss` (block_scale_shape): shape, dtype, strides,
// rows that do not overlap, a pointer; throws Error(op, arg, ...) naming the rule. Returns its row stride.
int64_t block_scale_stride(const char* op, const std::string& arg, const TensorDesc& s, const std::vector<int64_t>& ss);

void block_quantize_cpu(const BlockQuantizeProblem& p);
void block_quantize_cuda(const BlockQuantizeProblem& p, Stream stream);

// The fused Q up-projection on block-FP8 operands: QProjProblem's x and w point to the E4M3 codes
// (x_st_* and w_st in bytes = elements, w [N, K]); the factors: sx [T, ceil(K / 128)] (row t =
// token t in the problem's token order), sw [ceil(N / 128), ceil(K / 128)].
struct BlockFp8Operands {
  const float* sx = nullptr;
  int64_t sx_ld = 0;
  const float* sw = nullptr;
  int64_t sw_ld = 0;
};
void qproj_block_fp8_cpu(const QProjProblem& p, const BlockFp8Operands& b);
void qproj_block_fp8_cuda(const QProjProblem& p, const BlockFp8Operands& b, Stream stream);

// The block-FP8 GEMM: D[M, N] = alpha · A · Bᵀ (+ D). a, b: E4M3 codes [M | N, K] (row stride
// a_ld / b_ld bytes, K contiguous); factors sa[(m / a_br) * sa_ld + kb], sb[(n / b_br) * sb_ld + kb].
struct BlockGemmProblem {
  int64_t M = 0, N = 0, K = 0;
  const uint8_t* a = nullptr;
  const uint8_t* b = nullptr;
  int64_t a_ld = 0, b_ld = 0;
  const float* sa = nullptr;
  const float* sb = nullptr;
  int64_t sa_ld = 0, sb_ld = 0, a_br = 1, b_br = 1;
  void* out = nullptr;  // [M, N], row stride ld_out elements
  DType out_t = DType::kBFloat16;
  int64_t ld_out = 0;
  bool accumulate = false;
  double alpha = 1.0;
};
void block_gemm_cpu(const BlockGemmProblem& p);
void block_gemm_cuda(const BlockGemmProblem& p, Stream stream);

}  // namespace mxmla::detail
