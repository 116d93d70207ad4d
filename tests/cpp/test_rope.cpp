// RoPE CPU reference (issue 3): SPEC §3 formulas, transpose property, errors, positions, YaRN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <functional>

#include "cuda/tile_scheduler.h"
#include "mxmla/rope.h"
#include "test_util.h"

namespace mxmla {
namespace {

struct RopeCase {
  int64_t S = 5, B = 2, H = 3, D = 96, R = 32;
  std::vector<float> x, c, s, y;
  explicit RopeCase(uint64_t seed) {
    util::Rng rng(seed);
    x.resize(S * B * H * D), c.resize(S * R), s.resize(S * R), y.resize(x.size());
    for (auto& v : x) v = static_cast<float>(rng.normal());
    for (auto& v : c) v = static_cast<float>(rng.normal());
    for (auto& v : s) v = static_cast<float>(rng.normal());
  }
  TensorDesc xd() { return TensorDesc(x.data(), DType::kFloat32, {S, B, H, D}); }
  TensorDesc yd() { return TensorDesc(y.data(), DType::kFloat32, {S, B, H, D}); }
  TensorDesc cd() { return TensorDesc(c.data(), DType::kFloat32, {S, R}); }
  TensorDesc sd() { return TensorDesc(s.data(), DType::kFloat32, {S, R}); }
};

// SPEC §3 default style, written out: out = [x1 c[:h] - x2 s[:h] | x2 c[h:] + x1 s[h:]], in the fp32
// semantics of include/mxmla/rope.h.
TEST(RopeCpu, InterleavedInHalvesOutFollowsSpec) {
  RopeCase t(1);
  RopeOptions o;
  o.rope_dim = t.R;
  TensorDesc y = t.yd();
  apply_rope(t.xd(), t.cd(), t.sd(), y, o);
  const int64_t h = t.R / 2, nope = t.D - t.R;
  for (int64_t si = 0; si < t.S; ++si)
    for (int64_t bh = 0; bh < t.B * t.H; ++bh) {
      const float* x = &t.x[(si * t.B * t.H + bh) * t.D + nope];
      const float* y = &t.y[(si * t.B * t.H + bh) * t.D + nope];
      const float* c = &t.c[si * t.R];
      const float* s = &t.s[si * t.R];
      for (int64_t i = 0; i < h; ++i) {  // fp32 semantics: fmaf(sign s, x_b, c * x_a)
        ASSERT_EQ(y[i], std::fma(-s[i], x[2 * i + 1], c[i] * x[2 * i]));
        ASSERT_EQ(y[h + i], std::fma(s[h + i], x[2 * i], c[h + i] * x[2 * i + 1]));
        ASSERT_NEAR(y[i], double(x[2 * i]) * c[i] - double(x[2 * i + 1]) * s[i], 1e-5);  // the SPEC formula
      }
      for (int64_t d = 0; d < nope; ++d) ASSERT_EQ(t.y[(si * t.B * t.H + bh) * t.D + d], t.x[(si * t.B * t.H + bh) * t.D + d]);
    }
}

class RopeStyles : public ::testing::TestWithParam<RopeStyle> {};
// <R x, g> == <x, R^T g> for every style and layout.
TEST_P(RopeStyles, BackwardIsTranspose) {
  for (RopeLayout l : {RopeLayout::kSBHD, RopeLayout::kBSHD}) {
    RopeCase a(2), g(3);
    RopeOptions o;
    o.style = GetParam(), o.layout = l, o.rope_dim = a.R;
    // bshd: the same buffers read as [B, S, H, D]
    auto shape = [&](RopeCase& t) {
      return l == RopeLayout::kSBHD ? std::vector<int64_t>{t.S, t.B, t.H, t.D} : std::vector<int64_t>{t.B, t.S, t.H, t.D};
    };
    TensorDesc rx(a.y.data(), DType::kFloat32, shape(a)), rtg(g.y.data(), DType::kFloat32, shape(g));
    apply_rope(TensorDesc(a.x.data(), DType::kFloat32, shape(a)), a.cd(), a.sd(), rx, o);
    rope_backward(TensorDesc(g.x.data(), DType::kFloat32, shape(g)), a.cd(), a.sd(), rtg, o);
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < a.x.size(); ++i) lhs += double(a.y[i]) * g.x[i], rhs += double(a.x[i]) * g.y[i];
    EXPECT_NEAR(lhs, rhs, 1e-5 * std::fabs(lhs) + 1e-4);
  }
}
INSTANTIATE_TEST_SUITE_P(All, RopeStyles,
                         ::testing::Values(RopeStyle::kInterleavedInHalvesOut, RopeStyle::kInterleaved,
                                           RopeStyle::kRotateHalf));

void expect_rope_error(const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << arg;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + arg + "'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(rule), std::string::npos) << e.what();
  }
}

TEST(RopeCpu, Errors) {
  RopeCase t(4);
  TensorDesc y = t.yd();
  RopeOptions odd;
  odd.rope_dim = 31;
  expect_rope_error([&] { apply_rope(t.xd(), t.cd(), t.sd(), y, odd); }, "rope_dim", "even");
  RopeOptions big;
  big.rope_dim = 128;
  expect_rope_error([&] { apply_rope(t.xd(), t.cd(), t.sd(), y, big); }, "rope_dim", "exceeds the head dimension");
  RopeOptions thd;
  thd.layout = RopeLayout::kTHD, thd.rope_dim = t.R;
  TensorDesc x3(t.x.data(), DType::kFloat32, {t.S * t.B, t.H, t.D}), y3(t.y.data(), DType::kFloat32, {t.S * t.B, t.H, t.D});
  std::vector<int64_t> bad = {0, 4, 2, 10};
  TensorDesc cu(bad.data(), DType::kInt64, {4});
  expect_rope_error([&] { apply_rope(x3, t.cd(), t.sd(), y3, thd, &cu); }, "cu_seqlens", "non-decreasing");
  std::vector<int64_t> over = {0, 4, 11};
  TensorDesc cu2(over.data(), DType::kInt64, {3});
  expect_rope_error([&] { apply_rope(x3, t.cd(), t.sd(), y3, thd, &cu2); }, "cu_seqlens", "out of range");
  TensorDesc fx(t.x.data(), DType::kFloat32, {t.S, t.B, t.H, t.D}, Device{DeviceType::kCUDA, 0});
  RopeOptions ok;
  ok.rope_dim = t.R;
  EXPECT_THROW(apply_rope(fx, t.cd(), t.sd(), y, ok), Error);  // devices differ / CUDA not implemented
}

// The CUDA path's offsets within a head are 32-bit numbers: a head dim past 2^28 is refused, naming
// x, before anything touches the device (descriptors only: the check runs without a GPU).
TEST(RopeCpu, CudaHeadDimLimit) {
#if MXMLA_WITH_CUDA
  const Device dev{DeviceType::kCUDA, 0};
  void* fake = reinterpret_cast<void*>(uintptr_t{1} << 40);  // never dereferenced
  const int64_t D = (int64_t{1} << 28) + 64;
  TensorDesc x(fake, DType::kBFloat16, {1, 1, 1, D}, dev), y(fake, DType::kBFloat16, {1, 1, 1, D}, dev);
  TensorDesc c(fake, DType::kFloat32, {1, 64}, dev), sn(fake, DType::kFloat32, {1, 64}, dev);
  RopeOptions o;
  o.rope_dim = 64;
  test::expect_error("mxmla.apply_rope", [&] { apply_rope(x, c, sn, y, o); }, "x", "at most 2^28");
#else
  GTEST_SKIP() << "a CPU-only build: no CUDA path to check";
#endif
}

TEST(RopeCpu, PositionsAndYarn) {
  const auto p = positions_context_parallel(8, 4, 1);
  EXPECT_EQ(p, (std::vector<double>{4, 5, 6, 7, 24, 25, 26, 27}));
  EXPECT_EQ(positions_from_cu_seqlens({0, 2, 2, 5}), (std::vector<double>{0, 1, 0, 1, 2}));
  EXPECT_NEAR(yarn_softmax_scale(192, YarnParams::deepseek_v3()), 0.135234, 1e-6);
  const auto f = rope_inv_freq(64, 10000.0, YarnParams::deepseek_v3());
  const auto f0 = rope_inv_freq(64, 10000.0, YarnParams{});
  for (int i = 0; i <= 10; ++i) EXPECT_DOUBLE_EQ(f[i], f0[i]);       // below the ramp: unchanged
  for (int i = 23; i < 32; ++i) EXPECT_DOUBLE_EQ(f[i], f0[i] / 40);  // above: interpolated by the factor
}

// The tile order of the rope_backward_quantize fast path (cuda/tile_scheduler.h). Head counts that
// are not a multiple of 8: one contiguous range per block, walked as each block walks it — every
// tile exactly once, block loads within one tile of each other, no run across a token tile, the
// cursor's (token tile, head) equal to the tile number's. Other head counts: the queue's runs
// cover the tiles once, in order, each inside one token tile, len0 = gcd(H, run0) halved down to
// 8 as the tiles left fall below 2 G len; then the kernel's claim protocol is simulated (blocks of
// different speeds, run 0 = the block's index, run n + 1 claimed at the start / two tiles before
// the end of run n - 1, the TMA producer's cursor three tiles ahead): no cursor reads a run
// number before it is claimed, every tile is done once, and the blocks finish within 2 + 2 x 8
// tiles of each other (the static deal's spread is the tiles per block times the speed range).
struct QueueSim {
  int tiles = 0;
  double spread = 0;    // the first block's finish to the last's, in tile times of the fastest
  bool stored = true;  // every run number read after it was claimed and stored
};
QueueSim simulate_queue(const detail::TileQueue& Q, int G, int H, std::vector<int>& seen) {
  using detail::TileRun;
  struct Blk {
    TileRun cur, ahead;
    int n = 0, an = 0;
    int runq[4] = {-1, -1, -1, -1}, runn[4] = {-1, -1, -1, -1};  // queue index, run number
    int runk[4] = {};  // the iteration from which the claim is visible
    int k = -1;        // the loop iteration (-1: before the loop)
    double time = 0, speed = 1;
  };
  int counter = 0;
  std::vector<Blk> b(G);
  QueueSim r;
  auto read = [&](Blk& x, int n) {  // run n's queue index, read in iteration x.k (after its barrier)
    const int slot = n & 3;
    if (x.runn[slot] != n || x.runk[slot] > x.k) r.stored = false;  // not claimed or not yet stored
    return x.runq[slot];
  };
  auto next = [&](Blk& x, TileRun& c, int& n) {  // the kernel's step(): the cursor's next tile
    if (++c.t != c.tend) return void(++c.h);
    detail::queue_run(c, Q, read(x, n + 1), H);
    ++n;
  };
  // claimed in iteration k, stored before iteration k + 1's barrier (at the start: before the loop)
  auto claim = [&](Blk& x, int n) { x.runq[n & 3] = G + counter++, x.runn[n & 3] = n, x.runk[n & 3] = x.k + 1; };
  for (int i = 0; i < G; ++i) {
    b[i].speed = 1.0 + 0.2 * ((i * 37) % 101) / 100.0;
    detail::queue_run(b[i].cur, Q, i, H);
    claim(b[i], 1);
    b[i].runk[1] = -1;  // the start's claim is followed by a barrier
    if (b[i].cur.lvl < 3) read(b[i], 1);  // the first table prefetch
    b[i].ahead = b[i].cur;
    for (int s = 0; s < 3 && b[i].ahead.lvl < 3; ++s) next(b[i], b[i].ahead, b[i].an);
  }
  double lo = 1e300, hi = 0;
  std::vector<int> order(G);
  for (int i = 0; i < G; ++i) order[i] = i;
  auto later = [&](int x, int y) { return b[x].time > b[y].time || (b[x].time == b[y].time && x > y); };
  std::make_heap(order.begin(), order.end(), later);
  while (!order.empty()) {  // the block that finishes its tile first steps first (and claims first)
    std::pop_heap(order.begin(), order.end(), later);
    Blk& x = b[order.back()];
    if (x.cur.lvl == 3) {
      lo = std::min(lo, x.time), hi = std::max(hi, x.time);
      order.pop_back();
      continue;
    }
    ++seen[x.cur.t], ++r.tiles, x.time += x.speed, ++x.k;
    if (x.ahead.lvl < 3) next(x, x.ahead, x.an);
    const int n = x.n;
    next(x, x.cur, x.n);
    if (x.cur.lvl < 3 && x.cur.t + 2 == x.cur.tend) claim(x, x.n + 2);
    if (x.n != n && x.cur.lvl < 3) read(x, x.n + 1);  // the table prefetch at a run boundary
    std::push_heap(order.begin(), order.end(), later);
  }
  r.spread = hi - lo;
  return r;
}

TEST(TileQueue, RunsCoverTilesInOrderBlocksFinishTogether) {
  using detail::TileQueue;
  using detail::TileRun;
  int configs = 0, queued = 0;
  for (int H : {1, 2, 3, 5, 7, 8, 16, 24, 40, 128, 129})
    for (int ntt : {1, 2, 3, 7, 33, 512, 900})
      for (int G : {1, 2, 3, 7, 132, 396})
        for (int run0 : {8, 32}) {
          const int ntiles = ntt * H;
          if (G > ntiles) continue;  // the launcher's grid never exceeds the tiles
          const TileQueue Q = detail::make_tile_queue(ntiles, G, H, run0);
          ASSERT_EQ(Q.ntiles, ntiles);
          std::vector<int> seen(ntiles, 0);
          ++configs;
          if (H % detail::kMinRun != 0) {
            ASSERT_EQ(Q.nseg, 0) << "H " << H;
            int lo = ntiles, hi = 0;
            for (int b = 0; b < G; ++b) {
              TileRun c;
              detail::range_first(c, ntiles, b, G, H);
              int count = 0, run_tt = -1, run_end = -1, last = -1;
              while (c.lvl < 3) {
                ASSERT_EQ(c.lvl, 1);
                if (last >= 0) ASSERT_EQ(c.t, last + 1) << "a contiguous range, H " << H << " G " << G;
                last = c.t;
                ASSERT_TRUE(c.t >= 0 && c.t < ntiles) << "tile " << c.t << " H " << H << " G " << G;
                ASSERT_EQ(c.tt, c.t / H);
                ASSERT_EQ(c.h, c.t % H);
                if (c.tend != run_end) run_end = c.tend, run_tt = c.tt;  // a new run
                ASSERT_EQ(c.tt, run_tt) << "a run crosses a token tile: H " << H << " G " << G;
                ++seen[c.t], ++count;
                if (++c.t == c.tend) detail::range_at(c, c.tend, c.hi, H);
                else ++c.h;
              }
              lo = std::min(lo, count), hi = std::max(hi, count);
            }
            EXPECT_LE(hi - lo, 1) << "H " << H << " token tiles " << ntt << " G " << G;
          } else {
            ++queued;
            ASSERT_TRUE(Q.nseg >= 1 && Q.nseg <= detail::kQueueSegs) << Q.nseg;
            int len0 = detail::gcd_pow2(H, run0);  // halved while fewer than 2 G len0 tiles
            while (len0 > detail::kMinRun && ntiles < detail::kQueueRounds * G * len0) len0 /= 2;
            ASSERT_EQ(Q.len[0], len0);
            ASSERT_EQ(Q.len[Q.nseg - 1], detail::kMinRun) << "the queue ends in the shortest runs";
            ASSERT_TRUE(Q.q0[0] == 0 && Q.t0[0] == 0);
            for (int s = 0; s < Q.nseg; ++s) {
              ASSERT_GT(Q.q0[s + 1], Q.q0[s]);
              ASSERT_EQ(Q.t0[s] % Q.len[s], 0);
              if (s > 0) ASSERT_EQ(Q.len[s], Q.len[s - 1] / 2);
              const int t_end = s + 1 < Q.nseg ? Q.t0[s + 1] : ntiles;
              ASSERT_EQ(t_end - Q.t0[s], (Q.q0[s + 1] - Q.q0[s]) * Q.len[s]) << "segment " << s;
              if (s + 1 < Q.nseg) {  // its last run started with >= 2 G len tiles left, the next one without
                ASSERT_GE(ntiles - (t_end - Q.len[s]), detail::kQueueRounds * G * Q.len[s]);
                ASSERT_LT(ntiles - t_end, detail::kQueueRounds * G * Q.len[s]);
              }
            }
            int t = 0;
            for (int j = 0; j < detail::queue_runs(Q); ++j) {
              TileRun c;
              detail::queue_run(c, Q, j, H);
              ASSERT_EQ(c.lvl, 0);
              ASSERT_EQ(c.t, t) << "runs in tile order, run " << j;
              ASSERT_GE(c.tend - c.t, detail::kMinRun) << "run " << j;
              ASSERT_EQ(c.tt, c.t / H);
              ASSERT_EQ(c.h, c.t % H);
              ASSERT_EQ((c.tend - 1) / H, c.tt) << "a run crosses a token tile: H " << H << " run " << j;
              t = c.tend;
            }
            ASSERT_EQ(t, ntiles);
            TileRun past;
            detail::queue_run(past, Q, detail::queue_runs(Q), H);
            ASSERT_EQ(past.lvl, 3);
            const int grid = std::min(G, detail::queue_runs(Q));  // the launcher's grid
            const QueueSim sim = simulate_queue(Q, grid, H, seen);
            ASSERT_EQ(sim.tiles, ntiles);
            ASSERT_TRUE(sim.stored) << "a run read before it was claimed and stored: H " << H << " G " << G;
            EXPECT_LE(sim.spread, (2 + 2 * detail::kMinRun) * 1.2) << "H " << H << " token tiles " << ntt << " G " << G;
          }
          for (int i = 0; i < ntiles; ++i) ASSERT_EQ(seen[i], 1) << "tile " << i << " H " << H << " G " << G;
        }
  EXPECT_GT(configs, 600);
  EXPECT_GT(queued, 250);
}

#if MXMLA_WITH_CUDA
// The CUDA kernel against the CPU reference, bit for bit (same fp32 semantics), over styles,
// dtypes, table dtypes, directions, layouts and in-place use; outputs poisoned first.
TEST(RopeGpu, MatchesReferenceBitExact) {
  MXMLA_REQUIRE_GPU();
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t S = 37, B = 2, H = 3, D = 192, R = 64, n = S * B * H * D;
  util::Rng rng(5);
  std::vector<float> xf(n), cf(S * B * R), sf(S * B * R);
  for (auto& v : xf) v = static_cast<float>(rng.normal() * 4);
  for (auto& v : cf) v = static_cast<float>(rng.normal());
  for (auto& v : sf) v = static_cast<float>(rng.normal());
  xf[5 * D + 130] = NAN;  // NaN propagates with one pattern on both sides
  for (RopeStyle st : {RopeStyle::kInterleavedInHalvesOut, RopeStyle::kInterleaved, RopeStyle::kRotateHalf})
    for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
      for (DType tt : {DType::kFloat32, DType::kBFloat16})
        for (RopeLayout l : {RopeLayout::kSBHD, RopeLayout::kBSHD, RopeLayout::kTHD})
          for (int bwd = 0; bwd < 2; ++bwd)
            for (int inplace = 0; inplace < 2; ++inplace) {
              RopeOptions o;
              o.style = st, o.layout = l, o.rope_dim = R, o.tables_per_token = (l == RopeLayout::kTHD);
              const std::vector<int64_t> shape = l == RopeLayout::kSBHD   ? std::vector<int64_t>{S, B, H, D}
                                                 : l == RopeLayout::kBSHD ? std::vector<int64_t>{B, S, H, D}
                                                                          : std::vector<int64_t>{S * B, H, D};
              const int64_t T = o.tables_per_token ? S * B : S;
              std::vector<uint8_t> x = test::encode(xf, dt), c = test::encode({cf.begin(), cf.begin() + T * R}, tt),
                                   s = test::encode({sf.begin(), sf.begin() + T * R}, tt);
              std::vector<uint8_t> ref(x.size(), 0xAB);
              TensorDesc rd(ref.data(), dt, shape);
              auto run = bwd ? rope_backward : apply_rope;
              run(TensorDesc(x.data(), dt, shape), TensorDesc(c.data(), tt, {T, R}), TensorDesc(s.data(), tt, {T, R}),
                  rd, o, nullptr, nullptr);
              util::DeviceBuffer dx(x.size()), dc(c.size()), ds(s.size()), dy(x.size());
              dx.upload(x.data()), dc.upload(c.data()), ds.upload(s.data());
              std::vector<uint8_t> poison(x.size(), 0xCD);
              dy.upload(poison.data());
              TensorDesc yd(inplace ? dx.ptr : dy.ptr, dt, shape, dev);
              run(TensorDesc(dx.ptr, dt, shape, dev), TensorDesc(dc.ptr, tt, {T, R}, dev),
                  TensorDesc(ds.ptr, tt, {T, R}, dev), yd, o, nullptr, nullptr);
              MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
              const auto got = (inplace ? dx : dy).download<uint8_t>();
              ASSERT_EQ(test::first_mismatch(got, ref), "")
                  << "style " << int(st) << " dtype " << dtype_name(dt) << " table " << dtype_name(tt) << " layout "
                  << int(l) << (bwd ? " backward" : " forward") << (inplace ? " in place" : "");
            }
}

// apply_rope / rope_backward on the GPU for thd with uneven cu_seqlens (an empty sequence
// included): table row = position inside the sequence, as on the CPU.
TEST(RopeGpu, CuSeqlensMatchesReference) {
  MXMLA_REQUIRE_GPU();
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t T = 77, H = 2, D = 192, R = 64, n = T * H * D;
  const std::vector<int64_t> cu = {0, 30, 30, 31, 77};  // lengths 30, 0, 1, 46
  util::Rng rng(11);
  std::vector<float> xf(n), cf(46 * R), sf(46 * R);
  for (auto& v : xf) v = static_cast<float>(rng.normal());
  for (auto& v : cf) v = static_cast<float>(rng.normal());
  for (auto& v : sf) v = static_cast<float>(rng.normal());
  const std::vector<uint8_t> x = test::encode(xf, DType::kBFloat16), c = test::encode(cf, DType::kFloat32),
                             s = test::encode(sf, DType::kFloat32);
  TensorDesc cud(const_cast<int64_t*>(cu.data()), DType::kInt64, {5});
  for (int bwd = 0; bwd < 2; ++bwd) {
    RopeOptions o;
    o.layout = RopeLayout::kTHD, o.rope_dim = R;
    auto run = bwd ? rope_backward : apply_rope;
    std::vector<uint8_t> ref(x.size());
    TensorDesc rd(ref.data(), DType::kBFloat16, {T, H, D});
    run(TensorDesc(const_cast<uint8_t*>(x.data()), DType::kBFloat16, {T, H, D}),
        TensorDesc(const_cast<uint8_t*>(c.data()), DType::kFloat32, {46, R}),
        TensorDesc(const_cast<uint8_t*>(s.data()), DType::kFloat32, {46, R}), rd, o, &cud, nullptr);
    util::DeviceBuffer dx(x.size()), dc(c.size()), ds(s.size()), dy(x.size());
    dx.upload(x.data()), dc.upload(c.data()), ds.upload(s.data());
    TensorDesc yd(dy.ptr, DType::kBFloat16, {T, H, D}, dev);
    run(TensorDesc(dx.ptr, DType::kBFloat16, {T, H, D}, dev), TensorDesc(dc.ptr, DType::kFloat32, {46, R}, dev),
        TensorDesc(ds.ptr, DType::kFloat32, {46, R}, dev), yd, o, &cud, nullptr);
    MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
    ASSERT_EQ(test::first_mismatch(dy.download<uint8_t>(), ref), "") << (bwd ? "backward" : "forward");
  }
}

// apply_rope / rope_backward on thd inputs of many geometries, bit for bit against the CPU
// reference with the same strides: many blocks of DeepSeek-V3 heads, head counts that are not a
// multiple of anything (40, 7, 5, 1), no nope part, rope dims 16 / 32 / 48 / 128 (1, 2, 3, 8
// threads per head), nope parts of 0 to 320 elements, heads padded differently in x and out,
// fp16 and bf16 tables, in place, cu_seqlens with an empty sequence. Padding elements of the
// output must keep their poison. (Written for a TMA variant of the kernel that was measured
// slower and dropped, docs/notes-rope.md; kept for the generic kernel.)
struct RopeGeomCase {
  int64_t T, H, D, R;
  int64_t pad_in = 0, pad_out = 0;  // elements after each head
  DType dt = DType::kBFloat16, tt = DType::kFloat32;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  bool inplace = false;
  std::vector<int64_t> cu;  // cu_seqlens (thd) when not empty
};

void check_rope_geometry(const RopeGeomCase& k, bool bwd) {
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t Pi = k.D + k.pad_in, Po = k.inplace ? Pi : k.D + k.pad_out;
  int64_t rows = k.T;
  if (!k.cu.empty()) {
    rows = 0;
    for (size_t i = 1; i < k.cu.size(); ++i) rows = std::max(rows, k.cu[i] - k.cu[i - 1]);
  }
  util::Rng rng(static_cast<uint64_t>(k.T * 131 + k.H * 17 + k.D + k.R + bwd));
  std::vector<float> xf(k.T * k.H * Pi), cf(rows * k.R), sf(rows * k.R);
  for (auto& v : xf) v = static_cast<float>(rng.normal() * 3);
  for (auto& v : cf) v = static_cast<float>(rng.normal());
  for (auto& v : sf) v = static_cast<float>(rng.normal());
  const std::vector<uint8_t> x = test::encode(xf, k.dt), c = test::encode(cf, k.tt), s = test::encode(sf, k.tt);
  const std::vector<int64_t> shape{k.T, k.H, k.D}, in_st{k.H * Pi, Pi, 1}, out_st{k.H * Po, Po, 1};
  const int64_t es = dtype_size(k.dt), out_bytes = k.T * k.H * Po * es;
  RopeOptions o;
  o.layout = RopeLayout::kTHD, o.rope_dim = k.R, o.style = k.style;
  std::vector<int64_t> cu = k.cu;
  TensorDesc cud(cu.data(), DType::kInt64, {static_cast<int64_t>(cu.size())});
  const TensorDesc* cup = cu.empty() ? nullptr : &cud;
  auto run = bwd ? rope_backward : apply_rope;
  // reference: the output buffer poisoned, then (in place) the input copied in
  std::vector<uint8_t> ref(out_bytes, 0xAB);
  if (k.inplace) ref = x;
  TensorDesc rd(ref.data(), k.dt, shape, {}, out_st);
  run(TensorDesc(k.inplace ? ref.data() : const_cast<uint8_t*>(x.data()), k.dt, shape, {}, in_st),
      TensorDesc(const_cast<uint8_t*>(c.data()), k.tt, {rows, k.R}), TensorDesc(const_cast<uint8_t*>(s.data()), k.tt, {rows, k.R}),
      rd, o, cup, nullptr);
  util::DeviceBuffer dx(x.size()), dc(c.size()), ds(s.size()), dy(k.inplace ? 0 : out_bytes);
  dx.upload(x.data()), dc.upload(c.data()), ds.upload(s.data());
  if (!k.inplace) {
    std::vector<uint8_t> poison(out_bytes, 0xAB);
    dy.upload(poison.data());
  }
  TensorDesc yd(k.inplace ? dx.ptr : dy.ptr, k.dt, shape, dev, out_st);
  run(TensorDesc(dx.ptr, k.dt, shape, dev, in_st), TensorDesc(dc.ptr, k.tt, {rows, k.R}, dev),
      TensorDesc(ds.ptr, k.tt, {rows, k.R}, dev), yd, o, cup, nullptr);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  ASSERT_EQ(test::first_mismatch((k.inplace ? dx : dy).download<uint8_t>(), ref), "")
      << "T " << k.T << " H " << k.H << " D " << k.D << " R " << k.R << " pads " << k.pad_in << "/" << k.pad_out << " "
      << dtype_name(k.dt) << " table " << dtype_name(k.tt) << " style " << int(k.style) << (bwd ? " backward" : " forward")
      << (k.inplace ? " in place" : "") << (k.cu.empty() ? "" : " cu_seqlens");
}

TEST(RopeGpu, GeometriesStridesAndTails) {
  MXMLA_REQUIRE_GPU();
  std::vector<RopeGeomCase> cases;
  cases.push_back({1200, 128, 192, 64});
  cases.push_back({3000, 16, 192, 64, 0, 0, DType::kBFloat16, DType::kBFloat16});  // one TP shard of heads
  cases.push_back({300, 40, 192, 64, 8, 8, DType::kFloat16, DType::kBFloat16, RopeStyle::kRotateHalf, true});
  cases.push_back({33, 1, 64, 64, 0, 8, DType::kBFloat16, DType::kFloat32, RopeStyle::kInterleaved});  // no nope
  cases.push_back({129, 5, 136, 128, 8, 0});                                   // 8 threads per head
  cases.push_back({50, 7, 48, 32, 16, 8, DType::kFloat16, DType::kFloat32, RopeStyle::kInterleaved});
  cases.push_back({70, 3, 32, 16, 0, 0, DType::kBFloat16, DType::kFloat32, RopeStyle::kRotateHalf});  // 1 thread per head
  cases.push_back({300, 128, 192, 64, 0, 0, DType::kBFloat16, DType::kFloat32, RopeStyle::kInterleavedInHalvesOut,
                   false, {0, 100, 100, 257, 300}});
  cases.push_back({300, 2, 192, 64, 0, 0, DType::kBFloat16, DType::kFloat32, RopeStyle::kRotateHalf, true,
                   {0, 17, 160, 300}});
  cases.push_back({40, 2, 112, 48});                                           // 3 threads per head
  cases.push_back({40, 3, 384, 64, 8, 0});                                     // nope 320: chunks past the first 4 per thread
  for (const RopeGeomCase& k : cases)
    for (bool bwd : {false, true}) check_rope_geometry(k, bwd);
}

// rope_backward_quantize: the fused CUDA kernel against the CPU reference, bit for bit: codes,
// scales (compact / swizzled, padding included) and the dx copy.
struct RbqCase {
  int64_t S, B, H, D, R;
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  DType dt = DType::kBFloat16, tt = DType::kFloat32;  // input, tables
  RopeLayout layout = RopeLayout::kTHD;
  bool rowwise = true, columnwise = true, swizzle = false, strided = false, use_cu = false;
  bool pad_dim1 = false;  // sbhd / bshd: dim 1 allocated one larger (tokens no longer at one stride)
  Fp8Format format = Fp8Format::kE4M3;
  int copy = 0;  // dx copy: none, bf16, fp32
  std::vector<int64_t> cu;  // thd cu_seqlens when use_cu
  int seed = 0;
  bool nan_payloads = false;  // fp32 input: NaNs with payloads (signalling and quiet) in nope and rope parts
};

void check_rope_quantize(const RbqCase& g) {
  const Device dev{DeviceType::kCUDA, 0};
  const int64_t tokens = g.S * g.B, HD = g.H * g.D;
  RopeBackwardQuantizeOptions o;
  o.rope.style = g.style, o.rope.layout = g.layout, o.rope.rope_dim = g.R;
  o.rowwise = g.rowwise, o.columnwise = g.columnwise, o.swizzle = g.swizzle, o.format = g.format;
  const RopeLayout l = g.layout;
  const std::vector<int64_t> shape = l == RopeLayout::kSBHD   ? std::vector<int64_t>{g.S, g.B, g.H, g.D}
                                     : l == RopeLayout::kBSHD ? std::vector<int64_t>{g.B, g.S, g.H, g.D}
                                                              : std::vector<int64_t>{tokens, g.H, g.D};
  std::vector<int64_t> cu = g.cu;
  TensorDesc cud(cu.data(), DType::kInt64, {static_cast<int64_t>(cu.size())});
  o.rope.tables_per_token = l == RopeLayout::kTHD && !g.use_cu;
  const int64_t T = l == RopeLayout::kTHD ? tokens : g.S;
  std::vector<float> xf = test::make_data(tokens, HD, test::Data::kAdversarial, 100 + g.seed);
  if (g.nan_payloads) {
    const uint32_t pats[] = {0x7FC00001u, 0xFFC12345u, 0x7F800001u, 0xFFA00000u};  // quiet and signalling, both signs
    for (size_t i = 0; i < xf.size(); i += 7) std::memcpy(&xf[i], &pats[(i / 7) % 4], 4);
  }
  util::Rng rng(g.seed);
  std::vector<float> cf(T * g.R), sf(T * g.R);
  for (auto& v : cf) v = static_cast<float>(rng.normal());
  for (auto& v : sf) v = static_cast<float>(rng.normal());
  const std::vector<uint8_t> x = test::encode(xf, g.dt), c = test::encode(cf, g.tt), s = test::encode(sf, g.tt);
  const std::string what = "case " + std::to_string(g.seed) + " style " + std::to_string(int(g.style)) + " dtype " +
                           dtype_name(g.dt) + " layout " + std::to_string(int(l)) + " D " + std::to_string(g.D) +
                           " tokens " + std::to_string(tokens) + " H " + std::to_string(g.H);
  // CPU reference
  const MXFP8Shapes qs = quantize_shapes({tokens, HD}, o.swizzle);
  test::HostQ ref = test::alloc_host(qs, o.rowwise, o.columnwise);
  const DType ct = g.copy == 2 ? DType::kFloat32 : DType::kBFloat16;
  std::vector<uint8_t> ref_dx(g.copy ? tokens * HD * dtype_size(ct) : 0, 0xAB);
  TensorDesc ref_dxd(ref_dx.data(), ct, shape);
  rope_backward_quantize(TensorDesc(const_cast<uint8_t*>(x.data()), g.dt, shape),
                         TensorDesc(const_cast<uint8_t*>(c.data()), g.tt, {T, g.R}),
                         TensorDesc(const_cast<uint8_t*>(s.data()), g.tt, {T, g.R}), ref.t, g.copy ? &ref_dxd : nullptr,
                         o, g.use_cu ? &cud : nullptr, nullptr);
  // GPU: the same logical input, strided (each head padded by 16 elements) and / or with dim 1
  // allocated one larger, when asked
  const int64_t es = dtype_size(g.dt), P = g.strided ? g.D + 16 : g.D;
  std::vector<int64_t> alloc = shape;
  alloc.back() = P;
  const bool pad1 = g.pad_dim1 && shape.size() == 4;
  if (pad1) alloc[1] += 1;
  int64_t alloc_rows = 1;
  for (size_t i = 0; i + 1 < alloc.size(); ++i) alloc_rows *= alloc[i];
  std::vector<uint8_t> xg(alloc_rows * P * es, 0x7F);
  for (int64_t r = 0; r < tokens * g.H; ++r) {
    int64_t ar = r;  // the logical row's row in the allocation
    if (pad1) {
      const int64_t inner = shape[1] * g.H, d0 = r / inner, d1 = (r % inner) / g.H, h = r % g.H;
      ar = (d0 * alloc[1] + d1) * g.H + h;
    }
    std::memcpy(&xg[ar * P * es], &x[r * g.D * es], g.D * es);
  }
  std::vector<int64_t> strides(shape.size(), 1);  // contiguous strides of the allocation
  int64_t acc = P;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) strides[i] = acc, acc *= alloc[i];
  util::DeviceBuffer dx(xg.size()), dc(c.size()), ds(s.size()), drow(ref.row.size()), drs(ref.rs.size()),
      dcol(ref.col.size()), dcs(ref.cs.size()), dcopy(ref_dx.size());
  dx.upload(xg.data()), dc.upload(c.data()), ds.upload(s.data());
  const std::vector<uint8_t> poison(
      std::max({ref.row.size(), ref.rs.size(), ref.col.size(), ref.cs.size(), ref_dx.size()}), 0xCD);
  MXFP8Tensor t;
  if (o.rowwise) {
    drow.upload(poison.data()), drs.upload(poison.data());
    t.rowwise_data = TensorDesc(drow.ptr, DType::kUInt8, qs.data, dev);
    t.rowwise_scale_inv = TensorDesc(drs.ptr, DType::kUInt8, qs.rowwise_scale, dev);
  }
  if (o.columnwise) {
    dcol.upload(poison.data()), dcs.upload(poison.data());
    t.columnwise_data = TensorDesc(dcol.ptr, DType::kUInt8, qs.data, dev);
    t.columnwise_scale_inv = TensorDesc(dcs.ptr, DType::kUInt8, qs.columnwise_scale, dev);
  }
  if (g.copy) dcopy.upload(poison.data());
  TensorDesc gpu_dxd(dcopy.ptr, ct, shape, dev);
  TensorDesc xd(dx.ptr, g.dt, shape, dev);
  xd.strides = strides;
  rope_backward_quantize(xd, TensorDesc(dc.ptr, g.tt, {T, g.R}, dev), TensorDesc(ds.ptr, g.tt, {T, g.R}, dev), t,
                         g.copy ? &gpu_dxd : nullptr, o, g.use_cu ? &cud : nullptr, nullptr);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  if (o.rowwise) {
    ASSERT_EQ(test::first_mismatch(drow.download<uint8_t>(), ref.row), "") << what << " rowwise codes";
    ASSERT_EQ(test::first_mismatch(drs.download<uint8_t>(), ref.rs), "") << what << " rowwise scales";
  }
  if (o.columnwise) {
    ASSERT_EQ(test::first_mismatch(dcol.download<uint8_t>(), ref.col), "") << what << " columnwise codes";
    ASSERT_EQ(test::first_mismatch(dcs.download<uint8_t>(), ref.cs), "") << what << " columnwise scales";
  }
  if (g.copy) ASSERT_EQ(test::first_mismatch(dcopy.download<uint8_t>(), ref_dx), "") << what << " dx copy";
}

// Over head geometries (tails: 74 tokens; one head; D 64 / 128 / 192 — bf16 at 192 / 64 takes the
// DeepSeek-V3 fast path, the rest the generic kernel), styles, dtypes, layouts (thd with uneven
// cu_seqlens), strided input, both formats, each direction alone, table dtypes; adversarial data
// (zero blocks, denormals, saturation and rounding boundaries, NaN, Inf).
TEST(RopeGpu, BackwardQuantizeMatchesReferenceBitExact) {
  MXMLA_REQUIRE_GPU();
  struct Geo {
    int64_t S, B, H, D, R;
  };
  int variant = 0;
  for (const Geo geo : {Geo{37, 2, 3, 192, 64}, Geo{1, 1, 1, 64, 64}, Geo{40, 1, 2, 128, 32}})
    for (RopeStyle st : {RopeStyle::kInterleavedInHalvesOut, RopeStyle::kInterleaved, RopeStyle::kRotateHalf})
      for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
        for (RopeLayout l : {RopeLayout::kSBHD, RopeLayout::kBSHD, RopeLayout::kTHD}) {
          ++variant;
          RbqCase g{geo.S, geo.B, geo.H, geo.D, geo.R};
          g.style = st, g.dt = dt, g.layout = l, g.seed = variant;
          g.rowwise = variant % 3 != 2, g.columnwise = variant % 3 != 1;
          g.swizzle = variant % 2 == 0;
          g.format = variant % 4 == 1 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
          g.tt = (variant / 2) % 2 ? DType::kBFloat16 : DType::kFloat32;
          g.copy = (variant / 3) % 3;
          g.strided = variant % 5 == 0;
          const int64_t tokens = geo.S * geo.B;
          g.cu = {0, tokens / 3, tokens / 3, tokens};  // uneven, one empty
          g.use_cu = l == RopeLayout::kTHD && variant % 2;
          check_rope_quantize(g);
          if (HasFatalFailure()) return;
        }
}

// fp32 dq with NaN payloads into an fp32 dx copy: the nope part is dq itself, bit for bit (as the
// reference and apply_rope pass it through); RoPE outputs and the codes follow the output rules.
TEST(RopeGpu, BackwardQuantizeFp32CopyKeepsNopeBits) {
  MXMLA_REQUIRE_GPU();
  int seed = 700;
  for (RopeLayout l : {RopeLayout::kSBHD, RopeLayout::kTHD}) {
    RbqCase a{45, 2, 3, 192, 64};
    a.dt = DType::kFloat32, a.layout = l, a.copy = 2, a.nan_payloads = true, a.seed = ++seed;
    check_rope_quantize(a);
    if (HasFatalFailure()) return;
  }
}

// DeepSeek-V3 heads (bf16, 192 / 64) whose tokens do not sit at one stride (a batch or sequence
// dim allocated one larger): the launcher falls back to the generic kernel; same bits.
TEST(RopeGpu, BackwardQuantizeDeepSeekHeadsNonUniformTokenStride) {
  MXMLA_REQUIRE_GPU();
  int seed = 600;
  for (RopeLayout l : {RopeLayout::kSBHD, RopeLayout::kBSHD}) {
    RbqCase a{70, 3, 4, 192, 64};
    a.layout = l, a.pad_dim1 = true, a.strided = l == RopeLayout::kBSHD, a.copy = 1, a.seed = ++seed;
    check_rope_quantize(a);
    if (HasFatalFailure()) return;
  }
}

// The fast path's tile-queue counter belongs to one call (stream-ordered scratch zeroed per call):
// calls on two streams, queued alternately so that they overlap, and a CUDA graph of one call
// replayed three times (outputs re-poisoned before each replay) all give the reference's bits. A
// shared or stale counter would leave runs undone (poisoned bytes). 128 heads x 32 token tiles =
// 4096 tiles: 512 runs of 8 on the H200's 396 blocks, 116 of them from the counter.
TEST(RopeGpu, BackwardQuantizeFastPathConcurrentStreamsAndGraph) {
  MXMLA_REQUIRE_GPU();
  const int64_t tokens = 1000, H = 128, D = 192, R = 64, HD = H * D;
  const std::vector<int64_t> shape{tokens, H, D};
  RopeBackwardQuantizeOptions o;  // thd with per-token fp32 tables, E4M3, both directions, compact scales
  o.rope.layout = RopeLayout::kTHD, o.rope.rope_dim = R, o.rope.tables_per_token = true;
  const std::vector<uint8_t> x =
      test::encode(test::make_data(tokens, HD, test::Data::kAdversarial, 900), DType::kBFloat16);
  util::Rng rng(900);
  std::vector<float> c(tokens * R), sn(tokens * R);
  for (auto& v : c) v = static_cast<float>(rng.normal());
  for (auto& v : sn) v = static_cast<float>(rng.normal());
  const MXFP8Shapes qs = quantize_shapes({tokens, HD}, false);
  test::HostQ ref = test::alloc_host(qs, true, true);
  rope_backward_quantize(TensorDesc(const_cast<uint8_t*>(x.data()), DType::kBFloat16, shape),
                         TensorDesc(c.data(), DType::kFloat32, {tokens, R}),
                         TensorDesc(sn.data(), DType::kFloat32, {tokens, R}), ref.t, nullptr, o, nullptr, nullptr);
  const Device dev{DeviceType::kCUDA, 0};
  util::DeviceBuffer dx(x.size()), dc(c.size() * 4), ds(sn.size() * 4);
  dx.upload(x.data()), dc.upload(c.data()), ds.upload(sn.data());
  const TensorDesc xd(dx.ptr, DType::kBFloat16, shape, dev), cd(dc.ptr, DType::kFloat32, {tokens, R}, dev),
      sd(ds.ptr, DType::kFloat32, {tokens, R}, dev);
  struct Out {
    util::DeviceBuffer row, rs, col, cs;
    MXFP8Tensor t;
  };
  std::vector<Out> outs;
  for (int i = 0; i < 2; ++i) {
    outs.push_back({util::DeviceBuffer(ref.row.size()), util::DeviceBuffer(ref.rs.size()),
                    util::DeviceBuffer(ref.col.size()), util::DeviceBuffer(ref.cs.size()), MXFP8Tensor{}});
    Out& u = outs.back();
    u.t.rowwise_data = TensorDesc(u.row.ptr, DType::kUInt8, qs.data, dev);
    u.t.rowwise_scale_inv = TensorDesc(u.rs.ptr, DType::kUInt8, qs.rowwise_scale, dev);
    u.t.columnwise_data = TensorDesc(u.col.ptr, DType::kUInt8, qs.data, dev);
    u.t.columnwise_scale_inv = TensorDesc(u.cs.ptr, DType::kUInt8, qs.columnwise_scale, dev);
  }
  auto poison = [](Out& u, cudaStream_t st) {
    for (util::DeviceBuffer* b : {&u.row, &u.rs, &u.col, &u.cs}) MXMLA_CUDA_CHECK(cudaMemsetAsync(b->ptr, 0xCD, b->bytes, st));
  };
  auto expect_ref = [&](const Out& u, const std::string& what) {
    EXPECT_EQ(test::first_mismatch(u.row.download<uint8_t>(), ref.row), "") << what << " rowwise codes";
    EXPECT_EQ(test::first_mismatch(u.rs.download<uint8_t>(), ref.rs), "") << what << " rowwise scales";
    EXPECT_EQ(test::first_mismatch(u.col.download<uint8_t>(), ref.col), "") << what << " columnwise codes";
    EXPECT_EQ(test::first_mismatch(u.cs.download<uint8_t>(), ref.cs), "") << what << " columnwise scales";
  };
  cudaStream_t st[2];
  for (auto& q : st) MXMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&q, cudaStreamNonBlocking));
  for (int i = 0; i < 2; ++i) poison(outs[i], st[i]);
  for (int rep = 0; rep < 4; ++rep)  // alternately queued: the two streams' kernels overlap
    for (int i = 0; i < 2; ++i) rope_backward_quantize(xd, cd, sd, outs[i].t, nullptr, o, nullptr, st[i]);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < 2; ++i) expect_ref(outs[i], "stream " + std::to_string(i));
  // a graph of one call (relaxed capture: the launcher's pointer checks are not stream work)
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MXMLA_CUDA_CHECK(cudaStreamBeginCapture(st[0], cudaStreamCaptureModeRelaxed));
  rope_backward_quantize(xd, cd, sd, outs[0].t, nullptr, o, nullptr, st[0]);
  MXMLA_CUDA_CHECK(cudaStreamEndCapture(st[0], &graph));
  MXMLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    poison(outs[0], st[0]);
    MXMLA_CUDA_CHECK(cudaGraphLaunch(exec, st[0]));
    MXMLA_CUDA_CHECK(cudaStreamSynchronize(st[0]));
    expect_ref(outs[0], "graph replay " + std::to_string(rep));
  }
  MXMLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MXMLA_CUDA_CHECK(cudaGraphDestroy(graph));
  for (auto& q : st) MXMLA_CUDA_CHECK(cudaStreamDestroy(q));
}

// The fast path over many tiles per block (table values reused across the heads of a token tile
// and reloaded at the next one), a tail tile, sequences that start inside a token tile, batch > 1,
// each style, swizzled scales and the dx copy.
TEST(RopeGpu, BackwardQuantizeFastPathManyTiles) {
  MXMLA_REQUIRE_GPU();
  int seed = 500;
  for (RopeStyle st : {RopeStyle::kInterleavedInHalvesOut, RopeStyle::kInterleaved, RopeStyle::kRotateHalf}) {
    RbqCase a{4100, 1, 8, 192, 64};   // thd, uneven sequences, fp32 tables
    a.style = st, a.use_cu = true, a.cu = {0, 1000, 1000, 2777, 4100}, a.seed = ++seed;
    check_rope_quantize(a);
    if (HasFatalFailure()) return;
    RbqCase b{2051, 2, 6, 192, 64};   // sbhd, bf16 tables, E5M2, swizzled, bf16 copy, strided heads
    b.style = st, b.layout = RopeLayout::kSBHD, b.tt = DType::kBFloat16, b.format = Fp8Format::kE5M2;
    b.swizzle = true, b.copy = 1, b.strided = true, b.seed = ++seed;
    check_rope_quantize(b);
    if (HasFatalFailure()) return;
    RbqCase c{1027, 3, 5, 192, 64};   // bshd, rowwise only / columnwise only
    c.style = st, c.layout = RopeLayout::kBSHD, c.columnwise = st != RopeStyle::kInterleaved, c.seed = ++seed;
    c.rowwise = st != RopeStyle::kRotateHalf;
    check_rope_quantize(c);
    if (HasFatalFailure()) return;
  }
}

// The fast path's long runs: 128 heads and enough token tiles (200 x 128 = 25600 tiles) that the
// queue holds runs of all three lengths on the H200's grid of 396 blocks (9 runs of 32 heads
// while 2 x 396 x 32 = 25344 tiles are left, 791 of 16, 1582 of 8), most of them taken from the
// counter; the next run's table rows are prefetched and handed off at every run boundary. Tokens
// not a multiple of 32 (a tail tile).
TEST(RopeGpu, BackwardQuantizeFastPathLongRuns) {
  MXMLA_REQUIRE_GPU();
  RbqCase a{6399, 1, 128, 192, 64};  // thd, fp32 tables per token
  a.seed = 700;
  check_rope_quantize(a);
}

// The queue with 8 heads, 594 token tiles (4752 tiles; a tail tile of 24 tokens): runs of 8 heads,
// whole rowwise-scale groups of 8 written as 16-byte stores; on the H200's grid (396 blocks) 198
// of the 594 runs come from the counter. (Partial groups, the byte path: the ranges of 6 and 5
// heads in BackwardQuantizeFastPathManyTiles.) Compact scales, then swizzled scales with rowwise
// codes alone.
TEST(RopeGpu, BackwardQuantizeFastPathQueuedRuns) {
  MXMLA_REQUIRE_GPU();
  RbqCase a{19000, 1, 8, 192, 64};  // thd, fp32 tables per token
  a.seed = 710;
  check_rope_quantize(a);
  if (HasFatalFailure()) return;
  RbqCase b{19000, 1, 8, 192, 64};
  b.swizzle = true, b.columnwise = false, b.style = RopeStyle::kRotateHalf, b.seed = 711;
  check_rope_quantize(b);
}
#endif

}  // namespace
}  // namespace mxmla
