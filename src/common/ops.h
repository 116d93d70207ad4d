// mxmla internal — the problem descriptions that api.cpp (validation, flattening) hands to the
// backends: the CPU reference (src/cpu) and the CUDA kernels (src/cuda).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/mxfp8_common.h"
#include "mxmla/mxfp8.h"

namespace mxmla::detail {

// Where a row's columns come from when they are not contiguous (seg > 0): column c = j·seg + e, with
// j = jo·nh + jh (jo: sbhd's batch index, else 0; jh: the head), is element e of that head, read from
// part 0 (QuantizeProblem::in) for e < split and from part 1 (in1) at e − split otherwise — attention
// inputs with strided heads, and torch.cat([part0, part1], -1) read in place (MLA's K = [k_nope | k_pe],
// k_pe shared by the heads through a head stride of 0). Part i's element e' of (bi, r, jo, jh) is at
// bi·batch_stride + r·row_stride + jo·outer_stride[i] + jh·head_stride[i] + e' (part 0: the problem's
// batch_stride and row_stride; part 1: batch_stride1, row_stride1). seg, split: multiples of a
// 16-byte chunk's elements (the CUDA kernel gathers whole chunks).
struct ColumnGather {
  int64_t seg = 0, nh = 1, split = 0;
  const void* in1 = nullptr;
  int64_t batch_stride1 = 0, row_stride1 = 0;
  int64_t outer_stride[2] = {0, 0}, head_stride[2] = {0, 0};
};

// Input viewed as [batch, rows, cols] (cols = last dim, a multiple of 32), element strides
// (batch_stride, row_stride, 1), or gathered (`gather`). Codes are written contiguous [batch, rows, cols].
struct QuantizeProblem {
  const void* in = nullptr;
  DType in_dtype = DType::kBFloat16;
  Fp8Format fmt = Fp8Format::kE4M3;
  int64_t batch = 1, rows = 0, cols = 0, batch_stride = 0, row_stride = 0;
  ColumnGather gather;
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

// The input element (bi, r, c) of a QuantizeProblem: its part (0: in, 1: gather.in1) and offset in
// elements from that part's pointer.
struct InputRef {
  int part;
  int64_t offset;
};
MXMLA_HD InputRef input_ref(const QuantizeProblem& p, int64_t bi, int64_t r, int64_t c) {
  const ColumnGather& g = p.gather;
  if (g.seg == 0) return {0, bi * p.batch_stride + r * p.row_stride + c};
  // (32-bit divisions: a gathered problem's cols < 2^31, checked where it is made)
  const uint32_t seg = static_cast<uint32_t>(g.seg), nh = static_cast<uint32_t>(g.nh);
  const uint32_t j = static_cast<uint32_t>(c) / seg, jo = j / nh;
  const int64_t e = c - int64_t{j} * seg, jh = j - jo * nh;
  return e < g.split ? InputRef{0, bi * p.batch_stride + r * p.row_stride + jo * g.outer_stride[0] +
                                       jh * g.head_stride[0] + e}
                     : InputRef{1, bi * g.batch_stride1 + r * g.row_stride1 + jo * g.outer_stride[1] +
                                       jh * g.head_stride[1] + (e - g.split)};
}

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
// Checks a ConcatInput of `ndim`-D parts (arguments "<arg>.part0", "<arg>.part1"; `dims` names the
// expected dimensions in messages) and returns the concatenated shape (src/api.cpp).
std::vector<int64_t> check_concat(const char* op, const std::string& arg, const ConcatInput& in, int64_t ndim,
                                  const std::string& dims);
void dequantize_cpu(const DequantizeProblem& p);
void remap_scales_cpu(const std::vector<RemapProblem>& jobs);

void quantize_cuda(const QuantizeProblem& p, Stream stream);
void dequantize_cuda(const DequantizeProblem& p, Stream stream);
void remap_scales_cuda(const std::vector<RemapProblem>& jobs, Stream stream);

inline uint32_t rcp_max_bits(Fp8Format f) { return f == Fp8Format::kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits; }

}  // namespace mxmla::detail
