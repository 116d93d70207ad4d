// mxmla internal — the RoPE kernel's parameters (src/cuda/rope.cu), built by src/rope.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "common/mxfp8_common.h"
#include "mxmla/rope.h"

namespace mxmla::detail {

// x / out viewed as [S, B, H, D] with element strides (thd: B = 1); same dtype in and out;
// tables [T, R] with unit column stride. Row of a token: s, its index in x's token order
// (row_per_token), or its position inside its sequence (thd with cu_seqlens: `cu` holds the
// host copy of the sequence starts, uploaded by the launcher).
struct RopeKernelParams {
  const void* in = nullptr;
  void* out = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  DType io_t = DType::kBFloat16, tab_t = DType::kFloat32;
  int64_t S = 0, B = 1, H = 0, D = 0, R = 64;
  int64_t in_st[3] = {0, 0, 0}, out_st[3] = {0, 0, 0};  // s, b, h (d is contiguous)
  int64_t tab_row_stride = 0;
  bool sbhd = true;            // token order s-major (sbhd, thd) or b-major (bshd)
  bool row_per_token = false;  // tables hold one row per token
  bool copy_nope = true;       // out is not x
  bool backward = false;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  const std::vector<int64_t>* cu = nullptr;  // thd cu_seqlens (b + 1 entries) or null
};

void rope_cuda(const RopeKernelParams& p, Stream stream);

// RoPE backward fused with MXFP8 quantization (src/cuda/rope_quantize.cu): dx = R^T dq in
// fp32 (rope fields of `rope`, backward; out unused), quantized as [tokens, H*D] in token order
// (sbhd / thd: s*B + b, bshd: b*S + s) with the SPEC §2 rules, and optionally copied (bf16 or
// fp32, contiguous in the same order). Null codes: that direction is off.
struct RopeQuantizeParams {
  RopeKernelParams rope;
  Fp8Format fmt = Fp8Format::kE4M3;
  uint8_t* row_codes = nullptr;
  uint8_t* row_scales = nullptr;
  uint8_t* col_codes = nullptr;
  uint8_t* col_scales = nullptr;
  ScaleMap row_map, col_map;  // batch 1, rows = tokens, cols = H*D
  void* dx = nullptr;
  DType dx_t = DType::kBFloat16;
  // The MXFP8 GEMM's bf16 operand copies (rope_quantize_copies_cuda only; E4M3, no codes, no
  // scales): rowwise [tokens, H*D] (row stride row_copy_ld) and columnwise transposed [H*D, Tp]
  // (row stride col_copy_ld >= Tp = tokens rounded up to 32), each value the dequantized code
  // (numerics.cuh dequant_pair); inexact[0] / [1] set where a rowwise / columnwise block's values
  // are not exact in bf16 (check_exact). Null: that copy is off.
  uint16_t* row_copy = nullptr;
  uint16_t* col_copy = nullptr;
  int64_t row_copy_ld = 0, col_copy_ld = 0;
  uint32_t* inexact = nullptr;
  // rope_quantize_cuda: the launch returns at once while *run_if is 0 (null: it always runs).
  const uint32_t* run_if = nullptr;
};
constexpr int64_t kRopeQuantizeMaxHeadDim = 256;  // the fused kernel holds 32 tokens x one head in shared memory

void rope_quantize_cuda(const RopeQuantizeParams& p, Stream stream);
// The copies instead of codes (row_copy / col_copy / inexact set, codes null), on the fast path
// only: returns false, launching nothing, where the fast path does not take the call (not bf16 dq
// with DeepSeek-V3 query heads at one token stride, or not E4M3).
bool rope_quantize_copies_cuda(const RopeQuantizeParams& p, Stream stream);

}  // namespace mxmla::detail
