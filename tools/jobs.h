// mxmla command-line tool — the two jobs: `mxmla run` (the fused Q up-projection, run_qproj.cpp)
// and `mxmla run-quantize` (MXFP8 quantize of a query tensor, run_quantize.cpp), and a helper both use.
#pragma once

#include <cstdint>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/rope.h"
#include "tools/progress.h"

namespace mxmla::tool {

// `mxmla run`. tokens / heads < 0: the device's default (GPU T 4096, NH 128; CPU T 256, NH 16).
struct QProjRunArgs {
  int64_t tokens = -1, heads = -1, k = 1536, iters = 10, check_groups = 64, threads = 0;
  uint64_t seed = 1234;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  Fp8Format format = Fp8Format::kE4M3;
  bool mxfp8_weights = false;  // --weights mxfp8: W quantized once (rowwise), x per call (both copies)
  bool block_weights = false;  // --weights block-fp8: W quantized once (128 x 128 blocks), x per call (1 x 128)
};

// `mxmla run-quantize`. tokens < 0: the device's default (GPU 4096, CPU 256).
struct QuantizeRunArgs {
  int64_t tokens = -1, heads = 128, dim = 192, iters = 50, check_blocks = 2048, threads = 0;
  uint64_t seed = 1234;
  Fp8Format format = Fp8Format::kE4M3;
  bool swizzle = false;
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

// Each returns the exit status (0: the check passed, 1: it failed) and throws UsageError for
// sizes that cannot run here.
int run_qproj_cpu(const QProjRunArgs& a, Progress& progress);
int run_qproj_cuda(const QProjRunArgs& a, Progress& progress);
int run_quantize_cpu(const QuantizeRunArgs& a, Progress& progress);
int run_quantize_cuda(const QuantizeRunArgs& a, Progress& progress);

}  // namespace mxmla::tool
