// mxmla experiments — profiling helper of the recording probes
// (experiments 01 and 03): every block's start and end on the global timer, its
// SM and its tile count, and their spread on stderr. A persistent grid ends when its slowest block
// does: blocks that start together but end far apart mean the SMs progress at different speeds
// (rope_backward_quantize's static deal: ends 427–502 µs in a 0.49 ms kernel, docs/notes-rope.md).
// Each kernel file keeps its own `__device__ BlockSpan` array (no relocatable device code).
#pragma once

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda/ptx/common.cuh"

namespace mxmla::detail {

struct BlockSpan {
  unsigned long long start, end, sm, tiles;  // global timer (ns), %smid, tiles the block did
};

__device__ __forceinline__ void span_begin(BlockSpan& s) { s.start = ptx::globaltimer(), s.sm = ptx::smid(); }
__device__ __forceinline__ void span_end(BlockSpan& s, int tiles) {
  s.end = ptx::globaltimer(), s.tiles = static_cast<unsigned long long>(tiles);
}

// min / median / max of the blocks' tile counts, start and end times (µs from the first start)
// and of each SM's last end, one line on stderr.
inline void print_block_spans(const BlockSpan* sp, int nb) {
  if (nb <= 0) return;
  unsigned long long t0 = sp[0].start;
  for (int b = 0; b < nb; ++b) t0 = std::min(t0, sp[b].start);
  std::vector<double> start(nb), end(nb), tiles(nb), sm_end(1024, 0.0);
  for (int b = 0; b < nb; ++b) {
    start[b] = 1e-3 * double(sp[b].start - t0), end[b] = 1e-3 * double(sp[b].end - t0), tiles[b] = double(sp[b].tiles);
    double& e = sm_end[sp[b].sm & 1023];
    e = std::max(e, end[b]);
  }
  std::vector<double> sms;
  for (double e : sm_end)
    if (e > 0) sms.push_back(e);
  auto q = [](std::vector<double> v, double f) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(f * double(v.size())))];
  };
  std::fprintf(stderr, "  blocks (%d, tiles min/med/max %.0f / %.0f / %.0f): start us min/med/max %.2f / %.2f / %.2f; "
               "end %.2f / %.2f / %.2f; SMs (%zu) last end min/med/max %.2f / %.2f / %.2f\n", nb, q(tiles, 0),
               q(tiles, 0.5), q(tiles, 1), q(start, 0), q(start, 0.5), q(start, 1), q(end, 0), q(end, 0.5), q(end, 1),
               sms.size(), q(sms, 0), q(sms, 0.5), q(sms, 1));
}

}  // namespace mxmla::detail
