// Experiment 02 — the floor of the fused Q up-projection's structure, against cuBLAS's bf16 GEMM in
// the same run (single calls, L2 flushed before each, medians of 30): the kernel; the same
// mainloop and hand-off writing only the tile's 48 KB of output bytes through the TMA unit (no
// RoPE, no amax, no quantization: the cheapest output this structure can produce); the mainloop
// and hand-off alone. At three shapes: T x NH = 16384 x 128, 4096 x 128, 16384 x 16 (K 1536).
// Usage (GPU machine): build/dev/02_sm90_qproj_floor [rounds]   (default 2)
#include <cstdio>
#include <cstdlib>

#include "dev/cuda/dev_util.h"
#include "dev/cuda/qproj_variants.cuh"

using namespace mxmla;
using namespace mxmla::dev;

template <class K>
float time_variant(QProjCase& c) {
  detail::StreamScratch sw(0, nullptr), st(0, nullptr);
  CUtensorMap tx, tw;
  detail::qproj::Params kp;
  detail::qproj_prepare(c.p, nullptr, sw, st, tx, tw, kp, false);
  return time_ms([&] { launch<K>(c.p, tx, tw, kp); });
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
  using H = detail::NoProbe;
  using Real = detail::qproj::Kernel<RopeStyle::kInterleavedInHalvesOut, true, RealEpilogue<>, H>;
  using Bytes = detail::qproj::Kernel<RopeStyle::kInterleavedInHalvesOut, true, OutputBytesEpilogue, H>;
  using Bare = detail::qproj::Kernel<RopeStyle::kInterleavedInHalvesOut, true, NoEpilogue, H>;
  std::printf("%-14s %-6s %10s %10s %10s %10s   %s\n", "T x NH", "round", "cuBLAS ms", "kernel", "bytes only",
              "mainloop", "ratios to cuBLAS");
  const int64_t shapes[3][2] = {{16384, 128}, {4096, 128}, {16384, 16}};
  for (const auto& s : shapes) {
    QProjCase c(s[0], s[1]);
    CublasPeer peer(c);
    for (int r = 0; r < rounds; ++r) {
      const float tb = time_ms([&] { peer.run(c); });
      const float tk = time_variant<Real>(c), ty = time_variant<Bytes>(c), tm = time_variant<Bare>(c);
      std::printf("%6lld x %-5lld %-6d %10.4f %10.4f %10.4f %10.4f   %.3f / %.3f / %.3f\n", (long long)s[0],
                  (long long)s[1], r, tb, tk, ty, tm, tk / tb, ty / tb, tm / tb);
    }
  }
  return 0;
}
