// mxmla internal — the RoPE problem that src/rope.cpp (validation) hands to a backend.
#pragma once

#include <cstdint>
#include <vector>

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

}  // namespace mxmla::detail
