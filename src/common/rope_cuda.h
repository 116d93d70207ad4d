// mxmla internal — the RoPE kernel's parameters (src/cuda/sm90_rope.cu), built by src/rope.cpp.
#pragma once

#include <cstdint>

#include "mxmla/rope.h"

namespace mxmla::detail {

// x / out viewed as [S, B, H, D] with element strides (thd: B = 1); same dtype in and out;
// tables [T, R] with unit column stride. Row of a token: s, or its index in x's token order.
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
};

void rope_cuda(const RopeKernelParams& p, Stream stream);

}  // namespace mxmla::detail
