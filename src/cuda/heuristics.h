// mxmla internal — every launch-size choice of the kernels, in one place (host, plain C++: the CPU
// tests check these rules). The kernels' tile shapes are constexpr tables in their files; what is
// chosen per call — how many CTAs — is chosen here, from the device's SM count and how many CTAs
// of the kernel are resident per SM (cuda/launch.h reads both once per device and kernel).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace mxmla::detail::heuristics {

// A choice below forced through the environment variable `name` (tests, A/B runs): its value when
// it is a whole number in 1 .. max, else 0 (not forced). Read at every call.
inline int64_t env_forced(const char* name, int64_t max) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == '\0') return 0;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  return *end == '\0' && v >= 1 && v <= max ? v : 0;
}

// The attention forward's tile order: dynamic (tiles claimed from a counter) where the tiles differ
// in length — causal, or packed sequences — and outnumber the CTAs, else static (CTA b: tiles b,
// b + grid, ...). MXMLA_ATTN_FWD_ORDER in the environment ("static" / "dynamic", read at every
// call) forces one (A/B runs, tests).
inline bool attn_fwd_dynamic_order(bool causal, bool varlen, int64_t tiles, int64_t grid) {
  const char* e = std::getenv("MXMLA_ATTN_FWD_ORDER");
  if (e != nullptr && std::strcmp(e, "static") == 0) return false;
  if (e != nullptr && std::strcmp(e, "dynamic") == 0) return true;
  return (causal || varlen) && tiles > grid;
}

// A persistent grid: one wave of resident CTAs, never more CTAs than work units (and at least one).
// The quantize and rope_backward_quantize kernels.
inline int64_t persistent_grid(int64_t resident, int64_t units) {
  return std::max<int64_t>(1, std::min(resident, units));
}

// The fused Q up-projection (CTAs take tiles t = b, b + G, ...): the fewest CTAs that need as
// many waves as one CTA per SM, so that no partial last wave keeps a few SMs busy while the rest
// idle (4096 tiles on 132 SMs: 128 CTAs of 32 tiles, not 132 of which 4 take a 32nd). At the
// H200's power cap the SMs left out cost next to nothing, the others clocking a little higher:
// single calls -0.8 % at T 4096 x NH 128, -1.4 % at T 16384 x NH 16 (docs/notes-qproj.md). Fewer
// CTAs than that (more waves) measured slower. tiles >= 1, sms >= 1.
inline int balanced_grid(int tiles, int sms) {
  const int waves = (tiles + sms - 1) / sms;
  return (tiles + waves - 1) / waves;
}

// The rope_backward_quantize fast path with its run queue: the persistent grid, but no more CTAs
// than the queue has runs (every CTA's first run is run blockIdx.x).
inline int64_t queue_grid(int64_t resident, int64_t tiles, int64_t runs) {
  return std::min(persistent_grid(resident, tiles), std::max<int64_t>(1, runs));
}

// The MXFP8 GEMM's designs C and D with K split: how many m-tile rows (of m_tiles, each n_tiles
// output tiles) run whole in a launch of their own before the split launch — the rows that the
// complete waves hold (no partial sums, no reduction for them); m_tiles when no wave is partial.
// m_tiles, n_tiles, resident >= 1.
inline int64_t gemm_whole_rows(int64_t m_tiles, int64_t n_tiles, int64_t resident) {
  const int64_t tiles = m_tiles * n_tiles;
  return std::min(m_tiles, tiles / resident * resident / n_tiles);
}

// ... and how many parts to split K into. A GEMM whose last wave leaves SMs idle and whose K is
// long (dgrad at T 4096: 192 tiles of 128 x 256 on 132 SMs) splits the tiles past the whole rows
// (whole: their tiles): s splits make s units of about kblocks / s k-blocks of each, whose fp32
// partial sums a reduction pass adds. Estimated time (µs) for s = 1 .. 4: the whole tiles' waves,
// then the split tiles' waves, each (k-blocks per unit + kTileOverhead) · kKBlockUs, plus for s > 1
// the split tiles' share of the partials' traffic (M·N·(8s + 2) bytes: written, read, the result)
// at kReduceBytesPerUs and a kLaunchUs per launch; a split must beat the unsplit estimate by
// kMinGain (the model is coarse; a split changes the output's rounding), the fastest wins (ties:
// fewer splits). A split keeps at least kMinKBlocks k-blocks. tiles, kblocks, resident >= 1.
inline int gemm_k_splits(int64_t tiles, int64_t whole, int64_t kblocks, int64_t mn, int64_t resident) {
  constexpr double kKBlockUs = 0.55;          // one 128 x 256 x 64 bf16 k-block on one SM (H200)
  constexpr double kTileOverhead = 2;         // a tile's prologue and epilogue, in k-blocks
  constexpr double kReduceBytesPerUs = 3e6;   // the reduction pass's bandwidth (3 TB/s)
  constexpr double kLaunchUs = 5;
  constexpr double kMinGain = 0.02;
  constexpr int64_t kMinKBlocks = 8;
  const auto waves_us = [&](int64_t units, int64_t per) {
    return static_cast<double>((units + resident - 1) / resident) * (static_cast<double>(per) + kTileOverhead) * kKBlockUs;
  };
  const int64_t last = tiles - whole;
  const double whole_us = whole > 0 ? waves_us(whole, kblocks) + kLaunchUs : 0;
  int best = 1;
  double best_us = waves_us(tiles, kblocks) * (1 - kMinGain);
  for (int s = 2; s <= 4 && last > 0; ++s) {
    const int64_t per = (kblocks + s - 1) / s;
    if (per < kMinKBlocks) break;
    const int64_t parts = (kblocks + per - 1) / per;  // no empty part
    if (parts != s) continue;
    const double us = whole_us + waves_us(last * parts, per) +
                      static_cast<double>(mn) * static_cast<double>(last) / static_cast<double>(tiles) * (8.0 * s + 2) /
                          kReduceBytesPerUs +
                      kLaunchUs;
    if (us < best_us) best = s, best_us = us;
  }
  return best;
}

// The MXFP8 GEMM's design D (A's codes dequantized in registers by the GEMM, no pass over A) or
// design C (a dequantizing pass over A, then the bf16 GEMM): D converts A's codes once per 256-column
// output tile, about a tenth of the GEMM's time at any N (experiment 06, H100: 0.157 ms of 1.572 at
// dgrad T 16384, 0.13 of 1.48 at 8192³); C's pass moves 3 bytes a value of A once (0.3 to 0.4 ms
// for dgrad T 16384's 402 M values). They cross near N = 4800 (H100: C's pass 1.2e-12 s · M K
// against D's conversion 0.1 · 2 M N K / 800 TFLOP/s): D where N <= kGemmDesignDMaxN (dgrad T 16384,
// N 1536: D 1.57 ms + B's pass, C 1.47 + 0.4 ms; 8192³: D 1.48, C 1.35 + 0.08). The same for a
// columnwise A (wgrad's dY, N = in features): C's pass over it also transposes.
inline constexpr int64_t kGemmDesignDMaxN = 3072;
// (At N 1536 · 2: D / C 0.985 to 0.997 at K 8192; at 4608 and wider D loses, 1.03 to 1.11.)
// ... and where K >= kGemmDesignDMinK, the shortest contraction measured: since D's epilogue stores
// through shared memory by TMA, as C's does (the stores overlap the next tile's loads), D wins at
// every K measured. Forced D against forced C (dev/bench/gemm_d_crossover.py, H100, 2026-12-05),
// D / C time at N 1536 by K: A columnwise, M 24576: 0.967 (512), 0.933 (1024), 0.911 (2048), 0.893
// (4096), 0.875 (16384); A rowwise, M 16384: 0.961, 0.931, 0.922, 0.914, 0.894. (With the epilogue
// stored from registers D lost below K 4096: 1.09 to 1.11 at 2048.)
inline constexpr int64_t kGemmDesignDMinK = 512;

// The block-FP8 GEMM's tile width, 256 or 128 columns (128 rows either way): a persistent grid
// takes waves of one tile per SM, so the time goes as the waves times a tile's time. A 128-column
// tile takes kNarrow of a wide tile's time (measured on an H200 in full waves: 0.54 at fprop
// T 16384, 0.59 at 8192³, 0.61 at dgrad T 16384: each k-block's A is read for half the work); the
// narrow tiles win where the wide ones leave the last wave's SMs idle: dgrad at T 4096 (4096 x 1536:
// 192 wide tiles, 2 waves on 132 SMs, against 384 narrow ones, 3 waves), a 512-column output (64
// wide tiles: half the SMs). m_tiles, n256, n128, sms >= 1.
inline int block_gemm_tile_n(int64_t m_tiles, int64_t n256, int64_t n128, int64_t sms) {
  constexpr double kNarrow = 0.6;
  const int64_t wide = (m_tiles * n256 + sms - 1) / sms, narrow = (m_tiles * n128 + sms - 1) / sms;
  return kNarrow * static_cast<double>(narrow) < static_cast<double>(wide) ? 128 : 256;
}

// Elementwise kernels (RoPE, dequantize, scale re-layout): one thread per work unit.
inline int64_t elementwise_grid(int64_t units, int threads_per_block) {
  return (units + threads_per_block - 1) / threads_per_block;
}

// The SM90 attention backward's dispatch order (non-deterministic): its grid is (key blocks, KV heads of the
// launch), one CTA per key block, and the GPU starts the CTAs in the order of that grid, x fastest.
// Causal, a head's first key blocks walk the most query tiles, so with the heads one after another the
// last head's longest CTAs start last and run on while the other SMs have little left. Here the heads
// run in chunks of this many, key-block-major inside a chunk (key block 0 of the chunk's heads, then key
// block 1, ...), so that a launch ends on shorter CTAs, while the CTAs in flight still span a few heads
// (their query-side tiles shared in L2). By measurement (dev/bench/attn_bwd_order.py, H100, MXFP8 inputs,
// 128 heads in the launcher's groups, 9 rounds against chunks of 1, the previous order): chunks of 3
// took 0.983 / 0.983 / 0.980 / 1.001x the time at s 2048 / 4096 / 6144 / 8192 (22 / 43 / 64 / 86 key
// blocks), chunks of 2 0.998 / 0.989 / 0.987 / 0.991x; chunks of about sms / key blocks (6 at s 2048)
// gained nothing there. So 3 up to kAttnBwdChunkMaxKeyBlocks key blocks, else 1. MXMLA_ATTN_BWD_ORDER_G in
// the environment forces it (A/B runs, tests). key_blocks, heads >= 1.
inline constexpr int64_t kAttnBwdChunkHeads = 3, kAttnBwdChunkMaxKeyBlocks = 64;
inline int64_t attn_bwd_order_heads(int64_t key_blocks, int64_t heads) {
  const int64_t forced = env_forced("MXMLA_ATTN_BWD_ORDER_G", int64_t{1} << 20);
  const int64_t g = forced > 0 ? forced : key_blocks <= kAttnBwdChunkMaxKeyBlocks ? kAttnBwdChunkHeads : 1;
  return std::max<int64_t>(1, std::min(g, heads));
}

// ... and the CTA that starts lin-th (lin = blockIdx.y · key_blocks + blockIdx.x < key_blocks · heads,
// which the launcher keeps inside 32 bits) in that order: its key block and head of the launch. Chunk
// c holds heads c·g .. c·g + g − 1, the last one also the heads % g left over (a short last chunk
// would end the launch on long CTAs again); inside a chunk of n heads, CTA r takes key block r / n and
// head r % n. g = 1: key block lin % key_blocks of head lin / key_blocks, the grid's own order. (Host
// and device: the kernel's prologue and the CPU tests.)
struct AttnBwdCta {
  uint32_t kb, head;
};
#if defined(__CUDACC__)
__host__ __device__
#endif
inline AttnBwdCta attn_bwd_cta(uint32_t lin, uint32_t key_blocks, uint32_t heads, uint32_t g) {
  const uint32_t chunks = heads / g > 1 ? heads / g : 1, by_lin = lin / (g * key_blocks);
  const uint32_t chunk = by_lin < chunks - 1 ? by_lin : chunks - 1, h_first = chunk * g;
  const uint32_t n = chunk == chunks - 1 ? heads - h_first : g, r = lin - h_first * key_blocks;
  return {r / n, h_first + r % n};
}

// The attention backward's SM90 path: into how many groups of KV heads to split the work, so that
// its scratch — the bf16 copies its preprocess makes of the FP8 query-side reads, and where the dQ
// accumulator splits with the heads (b = 1 or thd) that too (copy_bytes / acc_bytes for one KV head
// and its query heads) — stays within kBudget at a time: each group's scratch is made, used by that
// group's kernels and freed (stream-ordered) before the next group's is made. One group when it
// fits, and without copies (bf16 reads: the accumulator alone, as cuDNN's backward holds it too);
// each split adds a kernel drain. hkv >= 1; returns 1 .. hkv.
inline int64_t attn_bwd_head_groups(int64_t copy_bytes_per_kv_head, int64_t acc_bytes_per_kv_head, int64_t hkv) {
  constexpr int64_t kBudget = int64_t{512} << 20;
  if (copy_bytes_per_kv_head == 0) return 1;
  const int64_t total = (copy_bytes_per_kv_head + acc_bytes_per_kv_head) * hkv;
  const int64_t groups = (total + kBudget - 1) / kBudget;
  return std::min<int64_t>(std::max<int64_t>(groups, 1), hkv);
}

}  // namespace mxmla::detail::heuristics
