// mxmla command-line tool — timing on the GPU: CUDA events around each call, L2 flushed before
// each (a 256 MiB memset) and the GPU kept busy for 1 ms before the start event (so the host's
// enqueueing of the call, its launch overhead, stays outside the events, as in bench/timing.py),
// the median of `iters` calls after 3 warm-up calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "common/host_util.h"
#include "cuda/busy_wait.h"

namespace mxmla::tool {

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

class GpuTimer {
 public:
  explicit GpuTimer(int64_t iters) : iters_(iters), flush_(256ull << 20) {
    MXMLA_CUDA_CHECK(cudaEventCreate(&e0_));
    MXMLA_CUDA_CHECK(cudaEventCreate(&e1_));
  }
  ~GpuTimer() {
    cudaEventDestroy(e0_);
    cudaEventDestroy(e1_);
  }
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;

  template <typename Fn>
  float median_ms(Fn&& fn) {
    std::vector<float> ms;
    for (int64_t it = 0; it < iters_ + 3; ++it) {
      MXMLA_CUDA_CHECK(cudaMemsetAsync(flush_.ptr, it & 0xFF, flush_.bytes));  // flush L2
      detail::gpu_busy_wait(nullptr, 1000000);
      MXMLA_CUDA_CHECK(cudaEventRecord(e0_));
      fn();
      MXMLA_CUDA_CHECK(cudaEventRecord(e1_));
      MXMLA_CUDA_CHECK(cudaEventSynchronize(e1_));
      float t;
      MXMLA_CUDA_CHECK(cudaEventElapsedTime(&t, e0_, e1_));
      if (it >= 3) ms.push_back(t);
    }
    return median(ms);
  }

 private:
  int64_t iters_;
  util::DeviceBuffer flush_;
  cudaEvent_t e0_{}, e1_{};
};

}  // namespace mxmla::tool
