// Experiment 01 — the fused Q up-projection's per-tile timeline: the production kernel body with a
// recording probe (clock64 stamps of the producer's, MMA warps' and epilogue warps' phases on the
// first CTAs, every CTA's start / end and the drain), once with the real epilogue and once with an
// epilogue that does nothing (the mainloop and hand-off alone). What was learned from it:
// docs/notes-qproj.md.
// Usage (GPU machine): build/dev/01_sm90_qproj_profile [T NH]   (default 4096 128)
#include <cstdio>
#include <cstdlib>

#include "dev/cuda/dev_util.h"
#include "dev/cuda/qproj_variants.cuh"

using namespace mxmla;
using namespace mxmla::dev;

template <class K>
void profile(const char* what, QProjCase& c, bool epilogue) {
  detail::StreamScratch sw(0, nullptr), st(0, nullptr);
  CUtensorMap tx, tw;
  detail::qproj::Params kp;
  detail::qproj_prepare(c.p, nullptr, sw, st, tx, tw, kp, false);
  int grid = 0;
  const float ms = time_ms([&] { grid = launch<K>(c.p, tx, tw, kp); }, 5);  // the last launch's stamps remain
  std::printf("%s: %.4f ms (probed; %.0f TFLOP/s)\n", what, ms, c.flops() / ms * 1e-9);
  print_profile((kp.sched.num_tiles + grid - 1) / grid, grid, epilogue);
}

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096, NH = argc > 2 ? std::atoll(argv[2]) : 128;
  QProjCase c(T, NH);
  std::printf("fused Q up-projection T %lld x NH %lld, K %lld\n", (long long)T, (long long)NH, (long long)c.K);
  using Real = detail::qproj::Kernel<RopeStyle::kInterleavedInHalvesOut, true, RealEpilogue<>, ClockProbe>;
  using Bare = detail::qproj::Kernel<RopeStyle::kInterleavedInHalvesOut, true, NoEpilogue, ClockProbe>;
  profile<Real>("kernel", c, true);
  profile<Bare>("mainloop + hand-off only (no epilogue work)", c, false);
  return 0;
}
