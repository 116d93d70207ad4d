// CPU tests of the host/device parts the persistent kernels share: the tile schedulers' orders
// (cuda/tile_scheduler.h) and the launch-size rules (cuda/heuristics.h). The dynamic queue's own
// tests are in test_rope.cpp (TileQueue), the fused kernel's grid in test_qproj.cpp. Also the CPU
// references' thread loop (common/parallel.h).
#include <gtest/gtest.h>

#include <stdlib.h>  // setenv, unsetenv (POSIX)

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <set>
#include <utility>
#include <vector>

#include "common/parallel.h"
#include "cuda/heuristics.h"
#include "cuda/tile_scheduler.h"
#include "test_util.h"
#if MXMLA_WITH_CUDA
#include "common/gemm_ops.h"
#include "cuda/attention_stage.h"
#endif

namespace mxmla::test {
namespace {

// Grouped rasterisation visits every (m, n) tile exactly once, N-major inside groups of kGroupM
// M tiles, the last group shorter.
template <int kGroupM>
void check_grouped(int m_tiles, int n_tiles) {
  std::set<std::pair<int, int>> seen;
  int prev_group = -1;
  for (int t = 0; t < m_tiles * n_tiles; ++t) {
    int m, n;
    detail::grouped_tile<kGroupM>(t, m_tiles, n_tiles, m, n);
    ASSERT_GE(m, 0);
    ASSERT_LT(m, m_tiles);
    ASSERT_GE(n, 0);
    ASSERT_LT(n, n_tiles);
    ASSERT_TRUE(seen.insert({m, n}).second) << "tile (" << m << ", " << n << ") twice";
    const int group = m / kGroupM;
    ASSERT_GE(group, prev_group) << "groups are walked in order";
    prev_group = group;
    if (t > 0) {  // inside a group: consecutive t walk M first, then the next N
      int pm, pn;
      detail::grouped_tile<kGroupM>(t - 1, m_tiles, n_tiles, pm, pn);
      if (pm / kGroupM == group) ASSERT_TRUE((pn == n && pm + 1 == m) || (pn + 1 == n && m == group * kGroupM));
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()), m_tiles * n_tiles);
}

// parallel_for calls fn once per index on any number of threads (more threads than indices, none);
// an exception stops the loop and is rethrown once every thread has joined.
TEST(ParallelFor, EveryIndexOnceAndTheFirstErrorRethrown) {
  for (int threads : {1, 2, 7, 64}) {
    for (int64_t n : {0, 1, 5, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      detail::parallel_for(n, threads, [&](int64_t i) { hits[static_cast<size_t>(i)].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)].load(), 1) << threads << " " << n;
    }
    std::atomic<int64_t> calls{0};
    EXPECT_THROW(detail::parallel_for(100000, threads,
                                      [&](int64_t i) {
                                        calls.fetch_add(1);
                                        if (i == 10) throw std::runtime_error("index 10");
                                      }),
                 std::runtime_error);
    EXPECT_LT(calls.load(), 100000) << "the loop goes on after an error (threads " << threads << ")";
  }
}

TEST(TileScheduler, GroupedRasterCoversEveryTileOnce) {
  check_grouped<32>(128, 128);  // T 16384 x NH 128
  check_grouped<32>(33, 5);     // a short last group
  check_grouped<32>(1, 1);
  check_grouped<4>(7, 3);
  check_grouped<1>(5, 9);
}

TEST(TileScheduler, StaticPersistentWalksEveryTileOnce) {
  // CTA b: b, b + G, ... (the device side's first / next, written out)
  for (int tiles : {1, 7, 132, 1000})
    for (int G : {1, 5, 132}) {
      const detail::StaticPersistent s{tiles};
      std::vector<int> count(tiles, 0);
      for (int b = 0; b < std::min(G, tiles); ++b)
        for (int t = b; s.valid(t); t += G) ++count[t];
      EXPECT_TRUE(std::all_of(count.begin(), count.end(), [](int c) { return c == 1; })) << tiles << " tiles, G " << G;
    }
}

TEST(TileScheduler, LongestFirstOrdersVarlenWork) {
  // sequences of 300, 0 (empty), 64 and 129 tokens in blocks of 64
  const std::vector<int64_t> cu = {0, 300, 300, 364, 493};
  const auto causal = detail::longest_first(cu, 64, true);
  ASSERT_EQ(causal.size(), 5u + 0u + 1u + 3u);
  for (size_t i = 1; i < causal.size(); ++i) EXPECT_GE(causal[i - 1].cost, causal[i].cost);
  EXPECT_EQ(causal.front().seq, 0);  // the longest sequence's last block first
  EXPECT_EQ(causal.front().block, 4);
  EXPECT_EQ(causal.front().cost, 5);
  std::set<std::pair<int, int>> items;
  for (const auto& w : causal) EXPECT_TRUE(items.insert({w.seq, w.block}).second);
  const auto full = detail::longest_first(cu, 64, false);  // every block of a sequence costs its length
  EXPECT_EQ(full.front().seq, 0);
  EXPECT_EQ(full.back().seq, 2);
}

TEST(Heuristics, PersistentAndQueueGrids) {
  using namespace detail::heuristics;
  EXPECT_EQ(persistent_grid(264, 10000), 264);  // one wave of resident CTAs
  EXPECT_EQ(persistent_grid(264, 100), 100);    // no more CTAs than work
  EXPECT_EQ(persistent_grid(264, 0), 1);
  EXPECT_EQ(queue_grid(396, 10000, 200), 200);  // every CTA starts on its own run
  EXPECT_EQ(queue_grid(396, 10000, 1000), 396);
  EXPECT_EQ(elementwise_grid(1000, 256), 4);
  EXPECT_EQ(elementwise_grid(1024, 256), 4);
  EXPECT_EQ(balanced_grid(4096, 132), 128);
}

// The MXFP8 GEMM's K split (designs C and D): only where the last wave leaves SMs idle and K is
// long, and then only past the rows that the complete waves hold.
TEST(Heuristics, GemmKSplits) {
  using namespace detail::heuristics;
  // dgrad T 4096 (32 x 6 tiles): 22 rows (132 tiles) whole, then the other 60 tiles in halves
  EXPECT_EQ(gemm_whole_rows(32, 6, 132), 22);
  EXPECT_EQ(gemm_k_splits(192, 132, 384, int64_t{4096} * 1536, 132), 2);
  EXPECT_EQ(gemm_whole_rows(32, 2, 132), 0);                                // 64 tiles: less than a wave
  EXPECT_EQ(gemm_k_splits(64, 0, 512, int64_t{4096} * 512, 132), 2);       // K 32768: one wave either way
  EXPECT_EQ(gemm_whole_rows(67, 2, 132), 66);                               // 134 tiles: 132 whole, 2 split
  EXPECT_EQ(gemm_whole_rows(132, 1, 132), 132);                             // one complete wave: all whole
  EXPECT_EQ(gemm_whole_rows(40, 5, 132), 26);                               // 130 of the 132 (whole rows only)
  const auto splits = [](int64_t m_tiles, int64_t n_tiles, int64_t kblocks, int64_t mn) {
    return gemm_k_splits(m_tiles * n_tiles, gemm_whole_rows(m_tiles, n_tiles, 132) * n_tiles, kblocks, mn, 132);
  };
  EXPECT_EQ(splits(128, 96, 24, int64_t{16384} * 24576), 1);   // fprop T 16384: 94 waves
  EXPECT_EQ(splits(32, 96, 24, int64_t{4096} * 24576), 1);     // fprop T 4096
  EXPECT_EQ(splits(128, 6, 384, int64_t{16384} * 1536), 1);    // dgrad T 16384: its last wave 108 of 132
  EXPECT_EQ(splits(192, 6, 64, int64_t{24576} * 1536), 1);     // wgrad T 4096
  EXPECT_EQ(splits(192, 6, 256, int64_t{24576} * 1536), 1);    // wgrad T 16384
  EXPECT_EQ(splits(64, 32, 128, int64_t{8192} * 8192), 1);     // 8192^3
  EXPECT_EQ(gemm_k_splits(1, 0, 10, 128 * 256, 132), 1);       // parts of K shorter than 8 k-blocks
}

// The block-FP8 GEMM's tile width: 128 columns where 256 leave the last wave's SMs idle.
TEST(Heuristics, BlockGemmTileN) {
  using namespace detail::heuristics;
  EXPECT_EQ(block_gemm_tile_n(32, 6, 12, 132), 128);     // dgrad T 4096 (4096 x 1536): 2 waves -> 3 narrow
  EXPECT_EQ(block_gemm_tile_n(32, 2, 4, 132), 128);      // a 512-column output: 64 wide tiles, one wave either way
  EXPECT_EQ(block_gemm_tile_n(128, 96, 192, 132), 256);  // fprop T 16384: 94 full waves
  EXPECT_EQ(block_gemm_tile_n(64, 32, 64, 132), 256);    // 8192^3
  EXPECT_EQ(block_gemm_tile_n(32, 3, 5, 132), 256);      // a 576-column output: 1 wave against 2
  EXPECT_EQ(block_gemm_tile_n(1, 1, 1, 132), 128);       // one small tile
}

// The environment's forced choices (MXMLA_GEMM_SPLITS, MXMLA_ATTN_BWD_GROUPS): whole numbers in range.
TEST(Heuristics, EnvForced) {
  using namespace detail::heuristics;
  const char* name = "MXMLA_TEST_ENV_FORCED";
  unsetenv(name);
  EXPECT_EQ(env_forced(name, 4), 0);
  for (const auto& [text, want] : {std::pair<const char*, int64_t>{"3", 3}, {"4", 4}, {"5", 0}, {"0", 0}, {"-1", 0},
                                   {"2x", 0}, {"", 0}, {"x", 0}}) {
    setenv(name, text, 1);
    EXPECT_EQ(env_forced(name, 4), want) << text;
  }
  setenv(name, "64", 1);
  EXPECT_EQ(env_forced(name, int64_t{1} << 30), 64);
  unsetenv(name);
}

// The attention forward's tile order: dynamic for tiles of different lengths (causal, thd) that
// outnumber the CTAs; MXMLA_ATTN_FWD_ORDER forces either.
TEST(Heuristics, AttnFwdDynamicOrder) {
  using namespace detail::heuristics;
  const char* name = "MXMLA_ATTN_FWD_ORDER";
  unsetenv(name);
  EXPECT_TRUE(attn_fwd_dynamic_order(true, false, 4096, 132));    // DeepSeek-V3 causal, s 4096
  EXPECT_TRUE(attn_fwd_dynamic_order(false, true, 4096, 132));    // packed sequences
  EXPECT_FALSE(attn_fwd_dynamic_order(false, false, 4096, 132));  // every tile the same length
  EXPECT_FALSE(attn_fwd_dynamic_order(true, false, 100, 100));    // one tile per CTA
  setenv(name, "dynamic", 1);
  EXPECT_TRUE(attn_fwd_dynamic_order(false, false, 1, 1));
  setenv(name, "static", 1);
  EXPECT_FALSE(attn_fwd_dynamic_order(true, true, 4096, 132));
  setenv(name, "other", 1);
  EXPECT_TRUE(attn_fwd_dynamic_order(true, false, 4096, 132));
  unsetenv(name);
}

// The attention backward's groups of KV heads: one group's scratch (the bf16 copies of the
// query-side FP8 reads, and the dQ accumulator where it splits) within 512 MiB.
TEST(Heuristics, AttnBwdHeadGroups) {
  using namespace detail::heuristics;
  // DeepSeek-V3, s 4096, b 1, MXFP8 with both copies of Q (K and V are converted in the kernel):
  // 2·192 values a token and head, 2 bytes each -> 3 MiB a head; the accumulator 192 fp32 values ->
  // 3 MiB a head; 768 MiB for 128 heads: two groups of 64
  const int64_t copies = int64_t{4096} * (2 * 192) * 2, acc = int64_t{4096} * 192 * 4;
  EXPECT_EQ(attn_bwd_head_groups(copies, acc, 128), 2);
  EXPECT_EQ(attn_bwd_head_groups(copies * 2, acc * 2, 128), 3);  // s 8192: 1.5 GiB
  EXPECT_EQ(attn_bwd_head_groups(copies / 2, acc / 2, 128), 1);  // s 2048: 384 MiB fits
  EXPECT_EQ(attn_bwd_head_groups(copies, 0, 128), 1);            // the accumulator does not split (b > 1)
  EXPECT_EQ(attn_bwd_head_groups(0, acc * 4, 128), 1);           // nothing converted (bf16 inputs)
  EXPECT_EQ(attn_bwd_head_groups(int64_t{1} << 40, 0, 3), 3);    // never more groups than heads
}

// The attention backward's dispatch order: chunks of 3 heads up to 64 key blocks, key-block-major
// inside a chunk; every (key block, head) exactly once; a launch ends on its last chunk's last key
// blocks, and that chunk is never shorter than the others.
TEST(Heuristics, AttnBwdOrderCoversEveryCtaOnceAndEndsOnShortBlocks) {
  using namespace detail::heuristics;
  const char* name = "MXMLA_ATTN_BWD_ORDER_G";
  unsetenv(name);
  EXPECT_EQ(attn_bwd_order_heads(43, 64), 3);   // DeepSeek-V3, s 4096 (96-key blocks), 64 heads a launch
  EXPECT_EQ(attn_bwd_order_heads(22, 128), 3);  // s 2048
  EXPECT_EQ(attn_bwd_order_heads(64, 128), 3);  // s 6144
  EXPECT_EQ(attn_bwd_order_heads(86, 43), 1);   // s 8192: the heads one after another
  EXPECT_EQ(attn_bwd_order_heads(11, 2), 2);    // never more than the launch's heads
  EXPECT_EQ(attn_bwd_order_heads(1, 1), 1);
  setenv(name, "5", 1);
  EXPECT_EQ(attn_bwd_order_heads(86, 64), 5);
  setenv(name, "0", 1);  // not a forced value
  EXPECT_EQ(attn_bwd_order_heads(43, 64), 3);
  unsetenv(name);
  for (const uint32_t nkb : {1u, 2u, 11u, 43u}) {
    for (const uint32_t heads : {1u, 3u, 7u, 16u, 64u}) {
      for (const uint32_t g : {1u, 2u, 3u, 4u, 5u, 7u, 16u, 64u}) {
        if (g > heads) continue;
        std::vector<int> seen(static_cast<size_t>(nkb) * heads, 0);
        for (uint32_t lin = 0; lin < nkb * heads; ++lin) {
          const AttnBwdCta x = attn_bwd_cta(lin, nkb, heads, g);
          ASSERT_LT(x.kb, nkb);
          ASSERT_LT(x.head, heads);
          ++seen[static_cast<size_t>(x.head) * nkb + x.kb];
          // chunks of g heads in order, the last one with the heads left over
          const uint32_t chunks = std::max(1u, heads / g), chunk = std::min(lin / (g * nkb), chunks - 1);
          EXPECT_EQ(std::min(x.head / g, chunks - 1), chunk) << nkb << " " << heads << " " << g << " " << lin;
          if (g == 1) EXPECT_TRUE(x.kb == lin % nkb && x.head == lin / nkb) << "g 1 is the grid's own order";
          if (lin > 0) {  // inside a chunk: key block 0 of its heads first, then key block 1, ...
            const AttnBwdCta prev = attn_bwd_cta(lin - 1, nkb, heads, g);
            if (std::min(prev.head / g, chunks - 1) == chunk)
              EXPECT_GE(x.kb, prev.kb) << nkb << " " << heads << " " << g << " " << lin;
          }
        }
        for (const int n : seen) ASSERT_EQ(n, 1) << nkb << " " << heads << " " << g;
        // the last CTAs started: the last key block of each head of the last chunk (g or more heads)
        const uint32_t last_heads = heads - (std::max(1u, heads / g) - 1) * g;
        EXPECT_GE(last_heads, g);
        for (uint32_t i = 1; i <= last_heads; ++i) EXPECT_EQ(attn_bwd_cta(nkb * heads - i, nkb, heads, g).kb, nkb - 1);
      }
    }
  }
}

#if MXMLA_WITH_CUDA
// The attention kernels put the sequences on a grid's z (at most 65535): thd launches run over
// chunks that take every sequence once, in order; the other formats are refused past 65535 with an
// error naming q that says how (pack as thd). Host code: no GPU needed.
TEST(SequenceChunks, ThdTakesEverySequenceOnceOthersStopAt65535) {
  for (const int64_t B : {int64_t{0}, int64_t{1}, int64_t{65534}, int64_t{65535}, int64_t{65536}, int64_t{131070},
                          int64_t{131071}, int64_t{200000}}) {
    std::vector<std::pair<int64_t, unsigned>> chunks;
    detail::for_sequence_chunks("mxmla.attention", B, true, [&](int64_t b0, unsigned n) { chunks.emplace_back(b0, n); });
    int64_t next = 0;
    for (const auto& [b0, n] : chunks) {
      EXPECT_EQ(b0, next) << "B " << B;
      EXPECT_GE(n, 1u) << "B " << B;
      EXPECT_LE(n, 65535u) << "B " << B;
      next = b0 + n;
    }
    EXPECT_EQ(next, B);
    EXPECT_EQ(static_cast<int64_t>(chunks.size()), (B + 65534) / 65535) << "B " << B;
  }
  int calls = 0;
  detail::for_sequence_chunks("mxmla.attention", 65535, false, [&](int64_t b0, unsigned n) {
    EXPECT_EQ(b0, 0);
    EXPECT_EQ(n, 65535u);
    ++calls;
  });
  EXPECT_EQ(calls, 1);
  expect_error("mxmla.attention_backward",
               [&] { detail::for_sequence_chunks("mxmla.attention_backward", 65536, false, [&](int64_t, unsigned) { ++calls; }); },
               "q", "pack them as thd");
  EXPECT_EQ(calls, 1);  // refused before any launch
}

// The CUDA GEMMs' extents: M, N, K up to 2^31 - 256 (32-bit tile and TMA coordinates), an error
// naming out (M, N) or b (K) past it.
TEST(GemmExtents, CudaKernelsTakeUpTo2To31Minus256) {
  constexpr int64_t kMax = (int64_t{1} << 31) - 256;
  detail::check_cuda_gemm_extents("mxmla.gemm", kMax, kMax, kMax);
  detail::check_cuda_gemm_extents("mxmla.gemm", 1, 1, 32);
  expect_error("mxmla.gemm", [] { detail::check_cuda_gemm_extents("mxmla.gemm", kMax + 1, 1, 32); }, "out", "2^31 - 256");
  expect_error("mxmla.gemm", [] { detail::check_cuda_gemm_extents("mxmla.gemm", 1, kMax + 1, 32); }, "out", "2^31 - 256");
  expect_error("mxmla.gemm", [] { detail::check_cuda_gemm_extents("mxmla.gemm", 1, 1, kMax + 32); }, "b",
               "contraction length K = 2147483424");
}
#endif

}  // namespace
}  // namespace mxmla::test
