// mxmla internal — the problem descriptions that api.cpp (validation, flattening) hands to the
// backends: the CPU reference (src/cpu) and the CUDA kernels (src/cuda).
#pragma once

#include <cstdint>
#include <vector>

#include "common/mxfp8_common.h"
#include "mxmla/mxfp8.h"

namespace mxmla::detail {

// Input viewed as [batch, rows, cols] (cols = last dim, a multiple of 32), element strides
// (batch_stride, row_stride, 1). Codes are written contiguous [batch, rows, cols].
struct QuantizeProblem {
  const void* in = nullptr;
  DType in_dtype = DType::kBFloat16;
  Fp8Format fmt = Fp8Format::kE4M3;
  int64_t batch = 1, rows = 0, cols = 0, batch_stride = 0, row_stride = 0;
  uint8_t* row_codes = nullptr;  // null: no rowwise output
  uint8_t* col_codes = nullptr;  // null: no columnwise output
  uint8_t* row_scales = nullptr;
  uint8_t* col_scales = nullptr;
  ScaleMap row_map, col_map;
  // The MXFP8 Linear's operand copies (CUDA, bf16 input, E4M3, batch 1; quantize_copies_cuda): the
  // exact bf16 values of a direction's codes, as the GEMM reads them (K-major). row_copy: [rows, cols],
  // row stride row_copy_ld; col_copy: transposed, [cols, rows], row stride col_copy_ld (a multiple of
  // 32 at least round_up(rows, 32): the tail tile's rows past `rows` are written as zeros). A direction
  // with a copy and no codes writes no scales. inexact[0] (rowwise copy), inexact[1] (columnwise copy):
  // set to 1 where a block with nonzero codes has a scale byte below the GEMM's min_exact_e (its
  // values do not fit bf16 exactly).
  uint16_t* row_copy = nullptr;
  uint16_t* col_copy = nullptr;
  int64_t row_copy_ld = 0, col_copy_ld = 0;
  uint32_t* inexact = nullptr;
  // null, or a device flag: the launch returns at once while it is clear (the copies' fallback)
  const uint32_t* run_if = nullptr;
};

// Codes contiguous [batch, rows, cols]; one direction's scales through `map`.
struct DequantizeProblem {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  Fp8Format fmt = Fp8Format::kE4M3;
  bool rowwise = true;
  ScaleMap map;  // carries batch, rows, cols
  void* out = nullptr;
  DType out_dtype = DType::kFloat32;
};

// Write every byte of `dst` (dst_map): the scale of the block it holds, read from `src` (src_map),
// or zero for padding. Several remaps run as one launch.
struct RemapProblem {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  ScaleMap src_map, dst_map;
  bool rowwise = true;
};

// Validates the outputs of quantizing a tensor of `shape` on `dev` (errors name `op`), sets out's
// metadata (a direction that is off gets null pointers) and returns the problem with its output
// fields and maps filled in (rows = product of the leading dims, cols = the last); the caller
// sets the input fields.
QuantizeProblem quantize_outputs(const char* op, const std::vector<int64_t>& shape, MXFP8Tensor& out,
                                 const QuantizeOptions& opts, const Device& dev);

// The same for the attention hand-off: a 4-D Q/K/V `shape` in opts.layout (quantize_attention's
// outputs and [batch, rows, cols] geometry).
QuantizeProblem attention_outputs(const char* op, const std::vector<int64_t>& shape, MXFP8Tensor& out,
                                  const AttentionQuantizeOptions& opts, const Device& dev);

void quantize_cpu(const QuantizeProblem& p);
void dequantize_cpu(const DequantizeProblem& p);
void remap_scales_cpu(const std::vector<RemapProblem>& jobs);

void quantize_cuda(const QuantizeProblem& p, Stream stream);
void dequantize_cuda(const DequantizeProblem& p, Stream stream);
void remap_scales_cuda(const std::vector<RemapProblem>& jobs, Stream stream);

inline uint32_t rcp_max_bits(Fp8Format f) { return f == Fp8Format::kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits; }

}  // namespace mxmla::detail
