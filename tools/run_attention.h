// mxmla command-line tool — `mxmla run --op attention` (run_attention.cpp): the attention forward
// of a DeepSeek-V3 layer on MXFP8 Q, K, V.
#pragma once

#include <cstdint>

#include "mxmla/attention.h"
#include "mxmla/mxfp8.h"
#include "tools/progress.h"

namespace mxmla::tool {

// seq / heads / check_rows < 0: the device's default (GPU s 4096, h 128, 256 checked rows; CPU s 256,
// h 2, 1024 checked rows, i.e. every row at the default size).
struct AttentionRunArgs {
  int64_t seq = -1, heads = -1, iters = 10, check_rows = -1, threads = 0;
  uint64_t seed = 1234;
  bool causal = true;
  PFormat p_format = PFormat::kBF16;
  Fp8Format format = Fp8Format::kE4M3;
};

// Each returns the exit status (0: the check passed, 1: it failed) and throws UsageError for
// sizes that cannot run here.
int run_attention_cpu(const AttentionRunArgs& a, Progress& progress);
int run_attention_cuda(const AttentionRunArgs& a, Progress& progress);

}  // namespace mxmla::tool
