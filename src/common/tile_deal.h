// mxmla internal — the order in which persistent blocks take tiles (host and device, so that the
// CPU tests check it): tiles are numbered head-fastest (tile = token tile * H + head). Level 0
// deals runs of gcd(H, run0) consecutive tiles round-robin (run j goes to block j % G) in whole
// rounds of G runs, so that at any time the co-running blocks work on a few neighbouring token
// tiles (they share DRAM pages) while a block keeps one set of table rows for a whole run.
// Level 1 gives what is left (less than a round) to the blocks as contiguous ranges, block b
// [b L / G, (b + 1) L / G) of the L tiles, a run being the part of a range inside one token
// tile: every tile goes to exactly one block, every block ends within one tile of the others,
// and no run crosses a token tile. Until the eighteenth session level 1 dealt runs of 4 and
// then single tiles round-robin: each of those short runs reloads a whole token tile's table
// rows, and ranges took 0.6 % off rope_backward_quantize at DeepSeek-V3 shape (docs/notes-rope.md).
// Head counts that are not a multiple of kMinRun would get short runs and a table hand-off every
// few tiles (H 6: runs of 2, 13 % slower than contiguous ranges, device run 1 of the thirteenth
// session): they skip level 0. Used by the rope_backward_quantize fast path (sm90_rope_quantize.cu).
#pragma once

#include "common/mxfp8_common.h"

namespace mxmla::detail {

constexpr int kMinRun = 8;  // the shortest run dealt round-robin

struct TileDeal {
  int len0, n0;  // level 0: runs of len0 tiles, n0 of them (a multiple of G), from tile 0
  int base1;     // level 1: tiles [base1, ntiles) as contiguous ranges
  int ntiles;
};
// gcd(h, p) for h >= 1 and a power of two p
MXMLA_HD int gcd_pow2(int h, int p) { return (h & -h) < p ? (h & -h) : p; }
// ntiles tiles of H heads per token tile over G blocks (1 <= G <= ntiles); run0 a power of two.
MXMLA_HD TileDeal make_tile_deal(int ntiles, int G, int H, int run0) {
  TileDeal d;
  d.len0 = gcd_pow2(H, run0);
  d.n0 = H % kMinRun != 0 ? 0 : (ntiles / (G * d.len0)) * G;
  d.base1 = d.n0 * d.len0, d.ntiles = ntiles;
  return d;
}
// A block's cursor: tile t of its run [t, tend) on level lvl (3: the block is done), tile t's
// token tile and head; level 0: the run's index j; level 1: hi = the end of the block's range.
struct TileRun {
  int lvl, j, t, tend;
  int tt, h;
  int hi;
};
// Level 1: the run that starts at tile t of the range [t, hi).
MXMLA_HD void range_at(TileRun& c, int t, int hi, int H) {
  c.t = t, c.hi = hi, c.lvl = t < hi ? 1 : 3;
  if (t < hi) {
    c.tt = t / H, c.h = t - c.tt * H;
    const int e = (c.tt + 1) * H;
    c.tend = e < hi ? e : hi;
  }
}
// Run j of level 0 for block `block`, or the block's level-1 range once level 0 is used up.
MXMLA_HD void run_at(TileRun& c, const TileDeal& d, int j, int block, int G, int H) {
  if (j >= d.n0) {
    const int left = d.ntiles - d.base1;
    return range_at(c, d.base1 + static_cast<int>(static_cast<int64_t>(block) * left / G),
                    d.base1 + static_cast<int>(static_cast<int64_t>(block + 1) * left / G), H);
  }
  c.lvl = 0, c.j = j, c.t = j * d.len0, c.tend = c.t + d.len0;
  c.tt = c.t / H, c.h = c.t - c.tt * H;
}
MXMLA_HD void run_first(TileRun& c, const TileDeal& d, int block, int G, int H) { run_at(c, d, block, block, G, H); }
// The block's next run (its first tile), leaving c as it is.
MXMLA_HD TileRun run_next(const TileRun& c, const TileDeal& d, int block, int G, int H) {
  TileRun n = c;
  if (c.lvl == 0)
    run_at(n, d, c.j + G, block, G, H);
  else
    range_at(n, c.tend, c.hi, H);
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
