// Experiment 08 — does a warpgroup's wgmma issue wait for the tensor cores, and how many wgmmas can
// be in flight before it does? The attention kernels' schedules rest on the answer: the backward
// issues S's 12 and dP's 8 wgmmas (m64n48k16, both operands in shared memory) back to back before
// P's math, the forward issues S_j's 12 (m64n128k16) then P_{j-1}·V_{j-1}'s 8 (m64n128k16, A from
// registers) before the softmax of S_j. If an issue returns only once the tensor cores have taken
// the instruction, the math after the last issue starts when most of both groups have run, and the
// math cannot overlap the second group (a phase probe of the backward, docs/notes-attention.md,
// found the issue of S and dP lasting about as long as their execution).
//
// One CTA, one or two warpgroups (as the kernels' two consumers), each issuing COUNT wgmmas of one
// shape into one commit group on shared-memory operands (the same tiles over and over), 64 times;
// clock64 before the first issue, after the last issue and after wait_group 0, by each warpgroup's
// first thread. Printed per shape, COUNT and warpgroups: the medians of the issue span and of the
// whole span, and the tensor-core cycles the MMAs need at 2 048 bf16 multiply-adds a cycle an SM
// (one warpgroup's or both's). Issue span ≈ whole span for large COUNT means the issue waits; the
// COUNT from which the issue span grows is the depth of the queue.
// Usage (GPU machine): <build>/dev/08_sm90_wgmma_issue
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/ptx/common.cuh"
#include "dev_check.h"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace dev08 {
using namespace mxmla;
using dev::clock_now;

enum Shape : int { kN48SS = 0, kN128SS = 1, kN128RS = 2 };
constexpr const char* kShapeName[] = {"m64n48k16 SS (backward: S, dP)", "m64n128k16 SS (forward: S)",
                                      "m64n128k16 RS (forward: P.V)"};
constexpr int kMacs[] = {64 * 48 * 16, 64 * 128 * 16, 64 * 128 * 16};
constexpr int kReps = 64, kWarmup = 4, kMaxWgs = 2;
constexpr int kSmemBytes = 8192 + 16384 + 1024;  // A [64 rows][128 bytes], B [128 rows][128 bytes], alignment
constexpr uint32_t kBf16Pair = 0x3C803C80u;       // two bf16 1/64: the sums stay small and finite

// out[wg][rep][2]: issue span, whole span (cycles)
template <int kShape, int kCount>
__global__ void __launch_bounds__(256, 1) issue_probe(int active_wgs, long long* out, float* sink) {
  extern __shared__ uint8_t raw[];
  uint8_t* const smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  for (int i = static_cast<int>(threadIdx.x); i < (8192 + 16384) / 16; i += static_cast<int>(blockDim.x))
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(kBf16Pair, kBf16Pair, kBf16Pair, kBf16Pair);
  ptx::fence_proxy_async();  // the generic-proxy stores before the wgmmas' reads
  __syncthreads();
  const int wg = static_cast<int>(threadIdx.x) / 128;
  if (wg >= active_wgs) return;
  constexpr int kAcc = kShape == kN48SS ? 24 : 64;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  const uint32_t afrag[4] = {kBf16Pair, kBf16Pair, kBf16Pair, kBf16Pair};
  const uint64_t da = ptx::wgmma_desc_k_sw128(smem), db = ptx::wgmma_desc_k_sw128(smem + 8192);
  for (int rep = -kWarmup; rep < kReps; ++rep) {
    ptx::named_barrier(1, 128 * active_wgs);  // the warpgroups start together
    const long long t0 = clock_now();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_reg(acc[i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kCount; ++kk) {
      const uint64_t a = da + 2 * (kk % 4), b = db + 2 * (kk % 4);
      if constexpr (kShape == kN48SS)
        ptx::wgmma_m64n48k16_f32_bf16_bf16_ss<0, 0>(acc, a, b, true);
      else if constexpr (kShape == kN128SS)
        ptx::wgmma_m64n128k16_f32_bf16_bf16_ss<0, 0>(acc, a, b, true);
      else
        ptx::wgmma_m64n128k16_f32_bf16_bf16_rs<0>(acc, afrag, b, true);
    }
    const long long t1 = clock_now();
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_reg(acc[i]);
    const long long t2 = clock_now();
    if (rep >= 0 && threadIdx.x % 128 == 0) {
      out[(wg * kReps + rep) * 2 + 0] = t1 - t0;
      out[(wg * kReps + rep) * 2 + 1] = t2 - t0;
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) sum += acc[i];
  sink[threadIdx.x] = sum;  // keeps the MMAs
}

struct Run {
  double issue, whole;
};

template <int kShape, int kCount>
Run run(int wgs, long long* d_out, float* d_sink) {
  auto kernel = issue_probe<kShape, kCount>;
  DEV_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<1, 256, kSmemBytes>>>(wgs, d_out, d_sink);
  DEV_CHECK_CUDA(cudaGetLastError());
  DEV_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<long long> h(kMaxWgs * kReps * 2);
  DEV_CHECK_CUDA(cudaMemcpy(h.data(), d_out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  std::vector<long long> issue, whole;
  for (int rep = 0; rep < kReps; ++rep) issue.push_back(h[rep * 2]), whole.push_back(h[rep * 2 + 1]);
  std::sort(issue.begin(), issue.end());
  std::sort(whole.begin(), whole.end());
  return {static_cast<double>(issue[kReps / 2]), static_cast<double>(whole[kReps / 2])};
}

template <int kShape, int... kCounts>
void table(long long* d_out, float* d_sink) {
  std::printf("\n%s: cycles, warpgroup 0's medians of %d\n", kShapeName[kShape], kReps);
  std::printf("| wgmmas | warpgroups | issue span | whole span | tensor cycles by count | issue / whole |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (int wgs = 1; wgs <= kMaxWgs; ++wgs) {
    const int counts[] = {kCounts...};
    const Run runs[] = {run<kShape, kCounts>(wgs, d_out, d_sink)...};
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); ++i) {
      const double tensor = static_cast<double>(counts[i]) * kMacs[kShape] * wgs / 2048.0;
      std::printf("| %d | %d | %.0f | %.0f | %.0f | %.2f |\n", counts[i], wgs, runs[i].issue, runs[i].whole, tensor,
                  runs[i].issue / runs[i].whole);
    }
  }
}

}  // namespace dev08

int main() {
  using namespace dev08;
  mxmla::dev::require_sm90("08_sm90_wgmma_issue");
  long long* d_out = nullptr;
  float* d_sink = nullptr;
  DEV_CHECK_CUDA(cudaMalloc(&d_out, kMaxWgs * kReps * 2 * sizeof(long long)));
  DEV_CHECK_CUDA(cudaMalloc(&d_sink, 256 * sizeof(float)));
  table<kN48SS, 1, 2, 4, 8, 12, 16, 20, 24>(d_out, d_sink);
  table<kN128SS, 1, 2, 4, 8, 12, 16, 20>(d_out, d_sink);
  table<kN128RS, 1, 2, 4, 8, 12, 16>(d_out, d_sink);
  DEV_CHECK_CUDA(cudaFree(d_out));
  DEV_CHECK_CUDA(cudaFree(d_sink));
  return 0;
}
