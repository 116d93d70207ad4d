// Experiment 03 — the rope_backward_quantize fast path's per-tile timeline: the production kernel
// (src/cuda/rope_quantize.cuh) with a recording probe: per tile, each warp's iteration start, its
// arrival at the tile barrier and its TMA wait (clock64), the producer's issue; every block's start /
// end (global timer) and SM, whose spread shows whether the queue keeps the SMs finishing together.
// What was learned from it: docs/notes-rope.md.
// Usage (GPU machine): build/dev/03_ropeq_profile [T H]   (default 16384 128; bf16 dq [T, H, 192] thd,
// fp32 tables, rowwise + columnwise E4M3, compact scales)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/host_util.h"
#include "cuda/rope_quantize.cuh"
#include "dev/cuda/dev_util.h"
#include "dev/cuda/prof_spans.cuh"

using namespace mxmla;

namespace dev03 {
constexpr int kRqProfBlocks = 8, kRqProfTiles = 64, kRqProfSlots = 12, kRqSpanBlocks = 2048;
__device__ unsigned long long g_rq_prof[kRqProfBlocks][kRqProfTiles][kRqProfSlots];
__device__ detail::BlockSpan g_rq_span[kRqSpanBlocks];

struct RopeqProbe {
  static constexpr bool kOn = true;
  __device__ __forceinline__ static unsigned long long clock() { return clock64(); }
  __device__ __forceinline__ static void stamp_value(uint32_t k, int slot, unsigned long long v) {
    if (blockIdx.x < kRqProfBlocks && k < kRqProfTiles) g_rq_prof[blockIdx.x][k][slot] = v;
  }
  __device__ __forceinline__ static void stamp(uint32_t k, int slot) { stamp_value(k, slot, clock64()); }
  __device__ __forceinline__ static void cta_begin() {
    if (blockIdx.x < kRqSpanBlocks) detail::span_begin(g_rq_span[blockIdx.x]);
  }
  __device__ __forceinline__ static void cta_end(uint32_t tiles) {
    if (blockIdx.x < kRqSpanBlocks) detail::span_end(g_rq_span[blockIdx.x], static_cast<int>(tiles));
  }
  __device__ __forceinline__ static void mma_end() {}
};
}  // namespace dev03
using namespace dev03;

int main(int argc, char** argv) {
  using detail::BlockSpan;
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 16384, H = argc > 2 ? std::atoll(argv[2]) : 128, D = 192;
  util::DeviceBuffer dq(T * H * D * 2), cosb(T * 64 * 4), sinb(T * 64 * 4), row(T * H * D), rs(T * H * D / 32),
      col(T * H * D), cs(((T + 31) / 32) * H * D);
  dq.upload(util::random_bf16(T * H, D, 3).data());
  std::vector<float> c(T * 64), s(T * 64);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < 64; ++j) {
      const double a = t * std::pow(10000.0, -2.0 * (j % 32) / 64);
      c[t * 64 + j] = static_cast<float>(std::cos(a)), s[t * 64 + j] = static_cast<float>(std::sin(a));
    }
  cosb.upload(c.data()), sinb.upload(s.data());
  detail::RopeQuantizeParams p;
  detail::RopeKernelParams& r = p.rope;
  r.in = dq.ptr, r.cos = cosb.ptr, r.sin = sinb.ptr, r.io_t = DType::kBFloat16, r.tab_t = DType::kFloat32;
  r.S = T, r.B = 1, r.H = H, r.D = D, r.R = 64, r.in_st[0] = H * D, r.in_st[1] = H * D, r.in_st[2] = D;
  r.tab_row_stride = 64, r.sbhd = true, r.backward = true, r.copy_nope = false;
  p.row_codes = row.as<uint8_t>(), p.row_scales = rs.as<uint8_t>(), p.col_codes = col.as<uint8_t>(), p.col_scales = cs.as<uint8_t>();
  p.row_map = detail::make_row_map(detail::MapMode::kCompact, 1, T, H * D);
  p.col_map = detail::make_col_map(detail::MapMode::kCompact, 1, T, H * D);
  int64_t tok_stride = 0;
  if (!detail::ropeq::uniform_token_stride(r, tok_stride)) return std::printf("not the fast path's layout\n"), 1;
  int64_t blocks = 0;
  const float ms = dev::time_ms(
      [&] { blocks = detail::ropeq::launch_mla<float, true, RopeqProbe>(p, nullptr, 0, tok_stride, nullptr); }, 5);
  std::printf("rope_backward_quantize fast path, bf16 [%lld, %lld, 192] thd: %.4f ms (probed), %lld blocks\n",
              (long long)T, (long long)H, ms, (long long)blocks);
  static unsigned long long h[kRqProfBlocks][kRqProfTiles][kRqProfSlots];
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_rq_prof, sizeof(h)));
  static BlockSpan sp[kRqSpanBlocks];
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(sp, g_rq_span, sizeof(sp)));
  const int nb = static_cast<int>(std::min<int64_t>(blocks, kRqSpanBlocks));
  int per_block = 0x7FFFFFFF;  // the fewest tiles of a profiled block (the queue deals them)
  for (int b = 0; b < std::min(nb, kRqProfBlocks); ++b) per_block = std::min(per_block, static_cast<int>(sp[b].tiles));
  const int last = std::min(per_block - 2, kRqProfTiles - 1);
  double start[4] = {}, arrive[4] = {}, own[4] = {}, wait[3] = {};
  double cycle = 0, last_arrival = 0, issued = 0, own_max = 0;
  int cnt = 0, lastw[4] = {};
  auto d = [](unsigned long long a, unsigned long long b) { return double(static_cast<long long>(a - b)); };
  for (int b = 0; b < kRqProfBlocks; ++b)
    for (int k = 2; k < last; ++k, ++cnt) {
      const unsigned long long* s = h[b][k];
      const unsigned long long base = s[4];
      int w = 0;
      double om = 0;
      for (int i = 0; i < 4; ++i) {
        start[i] += d(s[4 + i], base), arrive[i] += d(s[i], base);
        own[i] += d(s[i], s[4 + i]), om = std::max(om, d(s[i], s[4 + i]));
        if (s[i] > s[w]) w = i;
      }
      for (int i = 0; i < 3; ++i) wait[i] += double(s[8 + i]);
      ++lastw[w], last_arrival += d(s[w], base), issued += d(s[11], base);
      own_max += om, cycle += d(h[b][k + 1][4], base);
    }
  const double n = std::max(cnt, 1);
  std::printf("rope_backward_quantize profile: %d tiles in the shortest profiled block, %d samples, mean "
                       "cycles per tile from warp 0's iteration start\n", per_block, cnt);
  const char* names[4] = {"W0 (RoPE rows)", "W1 (nope rows)", "W2 (nope cols)", "W3 (rope cols, scales)"};
  for (int i = 0; i < 4; ++i)
    std::printf("  %-24s start %6.0f  arrive %6.0f  own work+wait %6.0f  TMA wait %5.0f\n", names[i],
                 start[i] / n, arrive[i] / n, own[i] / n, i < 3 ? wait[i] / n : 0.0);
  std::printf("  last to arrive: W0 %d, W1 %d, W2 %d, W3 %d tiles; last arrival %.0f; "
               "per-tile max own %.0f\n", lastw[0], lastw[1], lastw[2], lastw[3], last_arrival / n, own_max / n);
  std::printf("  next TMA issued %.0f; tile cycle %.0f\n", issued / n, cycle / n);
  print_block_spans(sp, nb);  // the queue rebalances slow SMs

  return 0;
}
