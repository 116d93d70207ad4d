// mxmla internal — the RoPE problem that src/rope.cpp (validation) hands to a backend.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/ops.h"
#include "common/rope_cuda.h"
#include "mxmla/rope.h"

namespace mxmla::detail {

// x viewed as [S, B, H, D] with element strides (thd: S = tokens, B = 1); token (s, b) has
// index s * B + b in `row_of_token`, its cos/sin table row.
struct RopeProblem {
  const void* in = nullptr;
  DType in_t = DType::kBFloat16;
  void* out = nullptr;
  DType out_t = DType::kBFloat16;
  int64_t S = 0, B = 1, H = 0, D = 0;
  int64_t in_st[4] = {0, 0, 0, 0}, out_st[4] = {0, 0, 0, 0};
  const void* cos = nullptr;
  const void* sin = nullptr;
  DType tab_t = DType::kFloat32;
  int64_t tab_st[2] = {0, 0};  // row, column strides of cos and sin
  int64_t rope_dim = 64;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  bool backward = false;
  std::vector<int64_t> row_of_token;  // CPU only
  std::vector<int64_t> cu;            // thd cu_seqlens (checked), empty when not given
};

void rope_cpu(const RopeProblem& p);

// The RoPE backward of dq as an operand (src/rope.cpp; linear_backward's RopeGrad form), checked as
// rope_backward_quantize checks it (errors name `op`). CPU: dx = R^T dq in fp32 quantized by `host`
// (outputs and maps set by the caller; rows = tokens, cols = H·D). CUDA: `cuda` is called with the
// kernel parameters (the rope fields; E4M3; outputs unset).
void rope_grad_run(const char* op, const TensorDesc& dq, const TensorDesc& cos, const TensorDesc& sin,
                   const RopeOptions& o, const TensorDesc* cu_seqlens, QuantizeProblem* host,
                   const std::function<void(const RopeQuantizeParams&)>& cuda);

}  // namespace mxmla::detail
