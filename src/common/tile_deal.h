// mxmla internal — the order in which the persistent blocks of the rope_backward_quantize fast
// path (sm90_rope_quantize.cu) take tiles, and the fused Q up-projection's grid size (at the end);
// host and device code, so that the CPU tests walk it.
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
// tiles (H 6: runs of 2 were 13 % slower than ranges, thirteenth session).
#pragma once

#include "common/mxfp8_common.h"

namespace mxmla::detail {

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

// The persistent grid of the fused Q up-projection (sm90_qproj_rope_quant.cu), whose CTAs take
// tiles t = b, b + G, ...: the fewest CTAs that need as many waves as one CTA per SM, so that no
// partial last wave keeps a few SMs busy while the rest idle (4096 tiles on 132 SMs: 128 CTAs of 32
// tiles, not 132 of which 4 take a 32nd). At the H200's power cap the SMs left out cost next to
// nothing, the others clocking a little higher: single calls −0.8 % at T 4096 × NH 128, −1.4 % at
// T 16384 × NH 16 (docs/performance.md, twenty-fourth session). Fewer CTAs than that (more waves)
// measured slower.
// tiles >= 1, sms >= 1.
MXMLA_HD int balanced_grid(int tiles, int sms) {
  const int waves = (tiles + sms - 1) / sms;
  return (tiles + waves - 1) / waves;
}

}  // namespace mxmla::detail
