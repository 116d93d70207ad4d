// mxmla command-line tool — the fused Q up-projection main job (tools/run_qproj.cpp) and a helper
// both jobs use.
#pragma once

#include <cstdint>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/rope.h"

namespace mxmla::tool {

struct QProjRunArgs {
  int64_t tokens = -1, heads = 128, k = 1536, iters = 10, check_groups = 64;
  bool heads_given = false;
  uint64_t seed = 1234;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  Fp8Format format = Fp8Format::kE4M3;
};

// An MXFP8Tensor over caller buffers (uint8 codes and scales of `s`), logical shape `shape`.
inline MXFP8Tensor describe(const std::vector<int64_t>& shape, const MXFP8Shapes& s, void* row, void* rs, void* col,
                            void* cs, Device dev) {
  MXFP8Tensor t;
  t.rowwise_data = TensorDesc(row, DType::kUInt8, s.data, dev);
  t.rowwise_scale_inv = TensorDesc(rs, DType::kUInt8, s.rowwise_scale, dev);
  t.columnwise_data = TensorDesc(col, DType::kUInt8, s.data, dev);
  t.columnwise_scale_inv = TensorDesc(cs, DType::kUInt8, s.columnwise_scale, dev);
  t.shape = shape;
  return t;
}

int run_qproj_cpu(const QProjRunArgs& a);
int run_qproj_cuda(const QProjRunArgs& a);

}  // namespace mxmla::tool
