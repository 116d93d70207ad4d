// mxmla internal — tile schedulers of the persistent kernels, and the order they walk
// tiles in. Host and device code (MXMLA_HD), so that the CPU tests walk the same sequences.
//
//   StaticPersistent   CTA b takes tiles b, b + G, b + 2G, ... (G = gridDim.x): no shared state;
//                      the fused Q up-projection's scheduler (every role walks the same sequence).
//   grouped_tile       rasterisation of a linear tile index into (M tile, N tile): groups of kGroupM
//                      M tiles x all N tiles, N-major inside a group (the group's A rows stay in L2
//                      while B streams through).
//   TileQueue          the dynamic queue (guided self-scheduling): runs of consecutive tiles from a
//                      global counter, shorter runs at the end so that the CTAs finish together;
//                      the rope_backward_quantize fast path's scheduler.
//   longest_first      room for variable-length work (attention over packed sequences): the host
//                      lists work items by decreasing cost, CTAs claim them in that order from a
//                      counter (the same claim as the queue's).
// Launch sizes (how many CTAs) are chosen on the host: cuda/heuristics.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/mxfp8_common.h"

namespace mxmla::detail {

// ---------------------------------------------------------------- static persistent
struct StaticPersistent {
  int num_tiles;
#if defined(__CUDACC__)
  __device__ __forceinline__ int first() const { return static_cast<int>(blockIdx.x); }
  __device__ __forceinline__ int next(int t) const { return t + static_cast<int>(gridDim.x); }
#endif
  MXMLA_HD bool valid(int t) const { return t < num_tiles; }
};

// ---------------------------------------------------------------- grouped rasterisation
// Linear tile t -> (m, n) of an m_tiles x n_tiles grid, in groups of kGroupM M tiles (the last
// group may be shorter), n-major inside a group.
template <int kGroupM>
MXMLA_HD void grouped_tile(int t, int m_tiles, int n_tiles, int& m, int& n) {
  static_assert(kGroupM >= 1, "groups of at least one M tile");
  const int group = t / (kGroupM * n_tiles);
  const int first = group * kGroupM;
  const int gm = kGroupM < m_tiles - first ? kGroupM : m_tiles - first;
  const int local = t - group * kGroupM * n_tiles;
  n = local / gm;
  m = first + local % gm;
}

// ---------------------------------------------------------------- the dynamic queue
// Tiles are numbered head-fastest (tile = token tile * H + head). A run is a stretch of
// consecutive tiles inside one token tile: a block keeps that token tile's table rows for the
// whole run and hands the next run's in at its end.
//
// Queue (H a multiple of kMinRun): the runs, in tile order, come from a global counter (guided
// self-scheduling). Runs hold len0 = gcd(H, run0) tiles while at least kQueueRounds * G * len0
// tiles are left, then half as many, down to kMinRun, so that the blocks finish close together
// whatever their SMs' speeds; block b's first run is run b, every later one the next the counter
// gives. Consecutive runs go to blocks that run at the same time, so co-running blocks work on a
// few neighbouring token tiles (they share DRAM pages). The static deal this replaced (runs of 32
// dealt round-robin, the rest as contiguous ranges) left the blocks' finishing times 426-500 us
// apart in a 0.49 ms kernel on the H200; the queue is 2.8 % faster (docs/notes-rope.md).
// Shorter runs cost table reloads and hand-offs (minimum runs of 4: 2.8 % slower than 8).
//
// Ranges (other head counts): block b takes [b L / G, (b + 1) L / G) of the L tiles, a run being
// the part of the range inside one token tile; short runs would hand the tables off every few
// tiles (H 6: runs of 2 were 13 % slower than ranges).
constexpr int kMinRun = 8;       // the shortest queued run; H % kMinRun == 0 takes the queue
constexpr int kQueueRounds = 2;  // runs of len while >= kQueueRounds * G * len tiles are left
constexpr int kMaxRun = 32;      // run0 <= kMaxRun
constexpr int kQueueSegs = 3;    // run lengths 32, 16, 8
static_assert(kMinRun << (kQueueSegs - 1) == kMaxRun, "one segment per run length");
// The kernel claims run n + 2 two tiles before the end of run n and its TMA producer runs three
// tiles ahead: both need runs of at least three tiles (sm90_rope_quantize.cu).
static_assert(kMinRun >= 3, "queued runs of at least three tiles");

// gcd(h, p) for h >= 1 and a power of two p
MXMLA_HD int gcd_pow2(int h, int p) { return (h & -h) < p ? (h & -h) : p; }

struct TileQueue {
  int nseg;    // 0: ranges (H not a multiple of kMinRun); else segments of the queue
  int ntiles;  // segment s: runs [q0[s], q0[s + 1]) of len[s] tiles from tile t0[s]
  int len[kQueueSegs], t0[kQueueSegs], q0[kQueueSegs + 1];
};
// ntiles tiles of H heads per token tile (a multiple of H) for a grid of G blocks; run0 a power
// of two in [kMinRun, kMaxRun].
MXMLA_HD TileQueue make_tile_queue(int ntiles, int G, int H, int run0) {
  TileQueue Q{};
  Q.ntiles = ntiles;
  if (H % kMinRun != 0) return Q;
  int t = 0, q = 0, len = gcd_pow2(H, run0 < kMaxRun ? run0 : kMaxRun);  // at most kQueueSegs lengths
  while (t < ntiles) {
    const int left = ntiles - t;
    while (len > kMinRun && left < kQueueRounds * G * len) len /= 2;
    // every run while kQueueRounds * G * len tiles are left (at least one), the last length all
    const int n = len == kMinRun ? (left + len - 1) / len : (left - kQueueRounds * G * len) / len + 1;
    Q.len[Q.nseg] = len, Q.t0[Q.nseg] = t, Q.q0[Q.nseg] = q, ++Q.nseg;
    t += n * len, q += n;
  }
  Q.q0[Q.nseg] = q;
  return Q;
}
MXMLA_HD int queue_runs(const TileQueue& Q) { return Q.q0[Q.nseg]; }

// A block's cursor: tile t of its run [t, tend) (lvl 0: a queued run; 1: a run of the range that
// ends at hi; 3: the block is done) and tile t's token tile and head.
struct TileRun {
  int lvl, t, tend;
  int tt, h;
  int hi;
};
// Run j of the queue (the block is done past the last).
MXMLA_HD void queue_run(TileRun& c, const TileQueue& Q, int j, int H) {
  if (j >= queue_runs(Q)) {
    c.lvl = 3;
    return;
  }
  int s = 0;
  while (j >= Q.q0[s + 1]) ++s;
  c.lvl = 0, c.t = Q.t0[s] + (j - Q.q0[s]) * Q.len[s];
  c.tend = c.t + Q.len[s] < Q.ntiles ? c.t + Q.len[s] : Q.ntiles;
  c.tt = c.t / H, c.h = c.t - c.tt * H;
}
// The run that starts at tile t of the range [t, hi).
MXMLA_HD void range_at(TileRun& c, int t, int hi, int H) {
  c.t = t, c.hi = hi, c.lvl = t < hi ? 1 : 3;
  if (t < hi) {
    c.tt = t / H, c.h = t - c.tt * H;
    const int e = (c.tt + 1) * H;
    c.tend = e < hi ? e : hi;
  }
}
// Block `block`'s range's first run.
MXMLA_HD void range_first(TileRun& c, int ntiles, int block, int G, int H) {
  range_at(c, static_cast<int>(static_cast<int64_t>(block) * ntiles / G),
           static_cast<int>(static_cast<int64_t>(block + 1) * ntiles / G), H);
}

#if defined(__CUDACC__)
// A CTA's claim of the next queue index from the launch's counter (zeroed per launch).
__device__ __forceinline__ int claim_next(int* counter) { return atomicAdd(counter, 1); }
#endif

// ---------------------------------------------------------------- longest first (varlen)
// One unit of variable-length work: item `block` of sequence `seq`, with its cost in any unit.
struct WorkItem {
  int seq, block;
  int64_t cost;
};
// Work items of packed sequences (cu_seqlens: b + 1 non-decreasing offsets) in blocks of `block`
// rows, ordered by decreasing cost (ties: sequence, then block, ascending). With `causal`, block i
// of a sequence costs i + 1 (it attends to i + 1 key blocks), else the sequence's block count.
inline std::vector<WorkItem> longest_first(const std::vector<int64_t>& cu_seqlens, int block, bool causal) {
  std::vector<WorkItem> items;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t len = cu_seqlens[s + 1] - cu_seqlens[s];
    const int64_t nb = (len + block - 1) / block;
    for (int64_t i = 0; i < nb; ++i)
      items.push_back({static_cast<int>(s), static_cast<int>(i), causal ? i + 1 : nb});
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

}  // namespace mxmla::detail
