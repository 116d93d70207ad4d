// mxmla internal — the order in which persistent blocks take tiles (host and device, so that the
// CPU tests check it): tiles are numbered head-fastest (tile = token tile * H + head) and dealt in
// runs of consecutive tiles, round-robin (run j of a level goes to block j % G), so that at any
// time the co-running blocks work on a few neighbouring token tiles (they share DRAM pages) while
// a block keeps one set of table rows for a whole run. Level 0 deals runs of gcd(H, run0) tiles
// in whole rounds of G runs, level 1 the rest in runs of gcd(H, 4), level 2 what is left one tile
// at a time: every tile goes to exactly one block, every block ends within one tile of the
// others, and no run crosses a token tile (its length divides H and it starts at a multiple of
// its length). Head counts that are not a multiple of kMinRun would get short runs and a table
// hand-off every few tiles (H 6: runs of 2, 13 % slower than contiguous ranges, device run 1 of
// the thirteenth session); they take contiguous ranges instead: block b gets tiles
// [b N / G, (b + 1) N / G), a run being the part of that range inside one token tile. Used by
// the rope_backward_quantize fast path (sm90_rope_quantize.cu).
#pragma once

#include "common/mxfp8_common.h"

namespace mxmla::detail {

constexpr int kMinRun = 8;  // the shortest run dealt round-robin

struct TileDeal {  // per level: first tile, run length, runs (scalars: a run-time index would spill)
  int base0, base1, base2, len0, len1, n0, n1, n2;
  int ntiles;
  bool contig;  // H % kMinRun != 0: contiguous ranges, the levels unused
  MXMLA_HD int nruns(int l) const { return l == 0 ? n0 : l == 1 ? n1 : n2; }
  MXMLA_HD int base(int l) const { return l == 0 ? base0 : l == 1 ? base1 : base2; }
  MXMLA_HD int len(int l) const { return l == 0 ? len0 : l == 1 ? len1 : 1; }
};
// gcd(h, p) for h >= 1 and a power of two p
MXMLA_HD int gcd_pow2(int h, int p) { return (h & -h) < p ? (h & -h) : p; }
// ntiles tiles of H heads per token tile over G blocks (1 <= G <= ntiles); run0 a power of two.
MXMLA_HD TileDeal make_tile_deal(int ntiles, int G, int H, int run0) {
  TileDeal d;
  d.len0 = gcd_pow2(H, run0), d.len1 = gcd_pow2(H, 4);
  d.n0 = (ntiles / (G * d.len0)) * G;
  const int left = ntiles - d.n0 * d.len0;
  d.n1 = (left / (G * d.len1)) * G;
  d.n2 = left - d.n1 * d.len1;
  d.base0 = 0, d.base1 = d.n0 * d.len0, d.base2 = d.base1 + d.n1 * d.len1;
  d.ntiles = ntiles, d.contig = H % kMinRun != 0;
  return d;
}
// A block's cursor: tile t of [t, tend) = run j of level lvl (lvl 3: the block is done), and
// tile t's token tile and head; contiguous mode: hi = the end of the block's range, lvl 0 or 3.
struct TileRun {
  int lvl, j, t, tend;
  int tt, h;
  int hi;
};
// Contiguous mode: the run that starts at tile t of the range [t, hi).
MXMLA_HD void range_at(TileRun& c, int t, int hi, int H) {
  c.t = t, c.hi = hi, c.lvl = t < hi ? 0 : 3;
  if (t < hi) {
    c.tt = t / H, c.h = t - c.tt * H;
    const int e = (c.tt + 1) * H;
    c.tend = e < hi ? e : hi;
  }
}
// The first tile of run j of level lvl of block `block`, or of its next run on a later level.
MXMLA_HD void run_at(TileRun& c, const TileDeal& d, int lvl, int j, int block, int H) {
  while (lvl < 3 && j >= d.nruns(lvl)) ++lvl, j = block;
  c.lvl = lvl, c.j = j;
  if (lvl < 3) {
    c.t = d.base(lvl) + j * d.len(lvl), c.tend = c.t + d.len(lvl);
    c.tt = c.t / H, c.h = c.t - c.tt * H;
  }
}
MXMLA_HD void run_first(TileRun& c, const TileDeal& d, int block, int G, int H) {
  if (!d.contig) return run_at(c, d, 0, block, block, H);
  const int lo = static_cast<int>(static_cast<int64_t>(block) * d.ntiles / G);
  range_at(c, lo, static_cast<int>(static_cast<int64_t>(block + 1) * d.ntiles / G), H);
}
// The block's next run (its first tile), leaving c as it is.
MXMLA_HD TileRun run_next(const TileRun& c, const TileDeal& d, int block, int G, int H) {
  TileRun n = c;
  if (d.contig)
    range_at(n, c.tend, c.hi, H);
  else
    run_at(n, d, c.lvl, c.j + G, block, H);
  return n;
}
// The block's next tile (a run never crosses a token tile: inside one, the head steps).
MXMLA_HD void run_step(TileRun& c, const TileDeal& d, int block, int G, int H) {
  if (++c.t == c.tend) {
    c = run_next(c, d, block, G, H);
    return;
  }
  ++c.h;
}

}  // namespace mxmla::detail
