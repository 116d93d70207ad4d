// mxmla command-line tool — the fused Q up-projection main job (tools/run_qproj.cpp).
#pragma once

#include <cstdint>

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

int run_qproj_cpu(const QProjRunArgs& a);
int run_qproj_cuda(const QProjRunArgs& a);

}  // namespace mxmla::tool
