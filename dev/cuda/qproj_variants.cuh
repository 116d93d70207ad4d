// mxmla experiments — alternative epilogues and a recording probe for the fused Q up-projection
// kernel (src/cuda/sm90_qproj_rope_quant.cuh), shared by experiments 01 and 02. They instantiate the
// production kernel body with these in place of its defaults; every epilogue here but the real one
// writes wrong outputs and is for timing only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/ptx/common.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/sm90_qproj_rope_quant.cuh"
#include "dev/cuda/prof_spans.cuh"

namespace mxmla::dev {

using detail::BlockSpan;
using detail::print_block_spans;
using detail::qproj::Cfg;
using detail::span_begin;
using detail::span_end;
template <RopeStyle kStyle = RopeStyle::kInterleavedInHalvesOut, bool kE4M3 = true>
using RealEpilogue = sm90::EpilogueRopeMxfp8<Cfg::kD, Cfg::kR, Cfg::kBM, kStyle, kE4M3>;

// The mainloop and the tile hand-off alone: the epilogue warps take each tile and do nothing.
struct NoEpilogue : RealEpilogue<> {
  template <class Probe>
  __device__ __forceinline__ static void run(const sm90::RopeMxfp8Params&, SharedStorage&, int, int, int, int, uint32_t) {}
};

// The floor: the tile's 48 KB of output bytes (its row and column code rows, as many bytes as the
// real epilogue writes) copied to global memory by the TMA unit straight from the shared tile, no
// RoPE, no amax, no quantization: the cheapest output this structure can produce.
struct OutputBytesEpilogue : RealEpilogue<> {
  template <class Probe>
  __device__ __forceinline__ static void run(const sm90::RopeMxfp8Params& p, SharedStorage& sm, int tid, int bi, int m0,
                                             int h, uint32_t) {
    for (int i = tid; i < 2 * kBM; i += kThreads) {
      const int r = i % kBM, si = m0 + r;
      uint8_t* base = i < kBM ? p.row_codes : p.col_codes;
      if (si < p.S && base != nullptr)
        ptx::bulk_store_s2g(base + token_of(p, bi, si) * p.N + static_cast<int64_t>(h) * kD, sm.tile + r * kTileRow, kD);
    }
    ptx::bulk_commit();
    ptx::bulk_wait_read_all();  // the tile is the next hand-off's
  }
};

// ---------------------------------------------------------------- the recording probe
// Stamp slots per tile (clock64 of the SM): MMA warp 0 of warpgroup 0: 0 tile start, 1 mainloop
// done, 2 tile hand-off slot free, 3 hand-off done, 15 cycles waiting for stage data (sum over the
// tile's k-blocks); epilogue: 4 hand-off received (warp 0), 5..11 each warp's end, 12 warp 0 after
// N, 13 after R, 14 after the named barrier; producer: 16 cycles waiting for free stages (sum). Per
// CTA: its start and end on the global timer, its SM and tile count, and when its MMA warps handed
// over their last tile (the end minus that is the drain: the epilogue no mainloop hides).
constexpr int kProfCtas = 8, kProfTiles = 64, kProfSlots = 17, kProfSpans = 1024;
__device__ unsigned long long g_prof[kProfCtas][kProfTiles][kProfSlots];
__device__ BlockSpan g_spans[kProfSpans];
__device__ unsigned long long g_mma_end[kProfSpans];

struct ClockProbe {
  static constexpr bool kOn = true;
  __device__ __forceinline__ static unsigned long long clock() { return clock64(); }
  __device__ __forceinline__ static void stamp_value(uint32_t n, int slot, unsigned long long v) {
    if (blockIdx.x < kProfCtas && n < kProfTiles) g_prof[blockIdx.x][n][slot] = v;
  }
  __device__ __forceinline__ static void stamp(uint32_t n, int slot) { stamp_value(n, slot, clock64()); }
  __device__ __forceinline__ static void cta_begin() {
    if (blockIdx.x < kProfSpans) span_begin(g_spans[blockIdx.x]);
  }
  __device__ __forceinline__ static void cta_end(uint32_t tiles) {
    if (blockIdx.x < kProfSpans) span_end(g_spans[blockIdx.x], static_cast<int>(tiles));
  }
  __device__ __forceinline__ static void mma_end() {
    if (blockIdx.x < kProfSpans) g_mma_end[blockIdx.x] = ptx::globaltimer();
  }
};

// Mean cycles per tile of each phase over the profiled CTAs (tiles 2 .. last-1), then the spread of
// every CTA's span and the drain. `epilogue`: false when the epilogue did nothing (its rows are skipped).
inline void print_profile(int tiles, int grid, bool epilogue) {
  static unsigned long long h[kProfCtas][kProfTiles][kProfSlots];
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(h, g_prof, sizeof(h)));
  double a[16] = {};
  int cnt = 0;
  for (int c = 0; c < kProfCtas; ++c)
    for (int n = 2; n + 1 < std::min(tiles - 1, kProfTiles); ++n, ++cnt) {
      auto d = [&](int from, int to, int n_to = 0) { return double(h[c][n + n_to][to]) - double(h[c][n][from]); };
      a[0] += d(0, 1), a[1] += d(1, 2), a[2] += d(2, 3), a[3] += d(0, 0, 1), a[4] += d(3, 4);
      a[5] += d(4, 12), a[6] += d(12, 13), a[7] += d(13, 14), a[8] += d(4, 4, 1);
      double last = 0;
      for (int w = 0; w < 7; ++w) {  // epilogue warps
        const double e = d(4, 5 + w);
        last = std::max(last, e);
        a[w < 4 ? 10 : w < 6 ? 11 : 12] += e / (w < 4 ? 4 : w < 6 ? 2 : 1);
      }
      a[9] += last, a[13] += d(4, 4, 1) - last;
      a[14] += double(h[c][n][15]), a[15] += double(h[c][n][16]);
    }
  const char* names[16] = {"MMA mainloop", "MMA wait for the hand-off slot", "MMA hand-off (stmatrix)", "MMA tile cycle",
                           "hand-off -> epilogue starts", "epilogue warp 0: N", "epilogue warp 0: R",
                           "epilogue warp 0: barrier wait", "epilogue tile cycle", "epilogue: last warp done",
                           "epilogue warps 0-3 (nope C)", "epilogue warps 4-5 (rope C)", "epilogue warp 6 (no C)",
                           "epilogue idle (last warp -> next tile)", "MMA waits for stage data (in mainloop)",
                           "producer waits for free stages"};
  std::printf("  %d tiles per CTA, %d tile samples, mean cycles per tile\n", tiles, cnt);
  for (int i = 0; i < 16; ++i)
    if (epilogue || i < 4 || i >= 14) std::printf("  %-40s %8.0f\n", names[i], a[i] / std::max(cnt, 1));
  static BlockSpan sp[kProfSpans];
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(sp, g_spans, sizeof(sp)));
  print_block_spans(sp, std::min(grid, kProfSpans));
  static unsigned long long me[kProfSpans];
  MXMLA_CUDA_CHECK(cudaMemcpyFromSymbol(me, g_mma_end, sizeof(me)));
  std::vector<double> drain;
  for (int b = 0; b < std::min(grid, kProfSpans); ++b) drain.push_back(1e-3 * double(sp[b].end - me[b]));
  std::sort(drain.begin(), drain.end());
  if (!drain.empty())
    std::printf("  drain (epilogue end - MMA warps' last hand-off) us min/med/max %.2f / %.2f / %.2f\n", drain.front(),
                drain[drain.size() / 2], drain.back());
}

// Launches kernel K (qproj::Kernel<..., Epilogue, Probe>) on problem `c` (prepared by qproj_prepare,
// as the library's launcher does); returns the grid.
template <class K>
int launch(const detail::QProjProblem& p, const CUtensorMap& tx, const CUtensorMap& tw, const detail::qproj::Params& kp) {
  const void* kernel = reinterpret_cast<const void*>(&detail::qproj::sm90_qproj_rope_quant_kernel<K>);
  const int sms = detail::kernel_fit(kernel, K::kThreads, K::kSmemBytes, K::kSmemBytes).sms;
  const int grid = detail::heuristics::balanced_grid(kp.sched.num_tiles, sms);
  detail::qproj::sm90_qproj_rope_quant_kernel<K><<<grid, K::kThreads, K::kSmemBytes>>>(tx, tw, kp);
  MXMLA_CUDA_CHECK(cudaGetLastError());
  (void)p;
  return grid;
}

}  // namespace mxmla::dev
