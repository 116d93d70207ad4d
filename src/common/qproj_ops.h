// mxmla internal — the fused Q up-projection problem (GEMM + RoPE + MXFP8) that src/qproj.cpp
// (validation) hands to a backend: the CPU reference (src/cpu/qproj_reference.cpp) or the SM90
// kernel (src/cuda/sm90_qproj_rope_quant.cu).
#pragma once

#include <cstdint>

#include "common/gemm_ops.h"
#include "common/mxfp8_common.h"
#include "mxmla/qproj.h"

namespace mxmla::detail {

// x: tokens of B sequences of S tokens, element (b, s, k) at x + b*x_st_b + s*x_st_s + k.
// Token order (codes, q, tables): sbhd t = s*B + b, bshd t = b*S + s.
// W: [N, K] (element (n, k) at w + n*w_st + k) or [K, N] (w + k*w_st + n), N = NH*D.
// cos/sin: row s (the position inside the sequence), R columns, row stride tab_st.
// Outputs: codes contiguous [tokens, NH*D]; scales through row_map / col_map, whose geometry is
// quantize_attention's ([vb, S, cols] with vb = b, cols = NH*D for bshd; vb = 0, cols = B*NH*D for
// sbhd); q (optional) bf16 contiguous [tokens, NH, D].
struct QProjProblem {
  const void* x = nullptr;
  int64_t B = 1, S = 0, K = 0, x_st_b = 0, x_st_s = 0;
  const void* w = nullptr;
  int64_t w_st = 0;
  bool w_kn = false;
  int64_t NH = 0, D = 192, R = 64;
  const void* cos = nullptr;
  const void* sin = nullptr;
  DType tab_t = DType::kFloat32;
  int64_t tab_st = 0;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  bool sbhd = true;
  Fp8Format fmt = Fp8Format::kE4M3;
  uint8_t* row_codes = nullptr;  // null: rowwise off
  uint8_t* row_scales = nullptr;
  uint8_t* col_codes = nullptr;  // null: columnwise off
  uint8_t* col_scales = nullptr;
  ScaleMap row_map, col_map;
  uint16_t* q = nullptr;  // optional bf16 q
};

void qproj_cpu(const QProjProblem& p);
void qproj_cuda(const QProjProblem& p, Stream stream);
// MXFP8 x and W: g.a = x [T, K] and g.b = W [N, K], both read along K (rowwise copies; T, N, K,
// fmt as in g); p's x and w fields are unused. The CPU reference decodes them exactly (float64);
// the CUDA path feeds the kernel design C's bf16 copies, with an exact fallback (see
// cuda/mxfp8_bf16_operands.h).
void qproj_mxfp8_cpu(const QProjProblem& p, const GemmProblem& g);
void qproj_mxfp8_cuda(const QProjProblem& p, const GemmProblem& g, Stream stream);
// Whether the SM90 kernel has an instantiation for these head dims (D, R). W as [K, N] is
// transposed into a scratch buffer first.
bool qproj_cuda_supports(int64_t D, int64_t R);

}  // namespace mxmla::detail
