// mxmla internal — a kernel that keeps the GPU busy for a while (one thread spinning on the global
// timer). Timers enqueue it before their start event so that the host's enqueueing of the timed
// call happens while the GPU is busy: the events then measure the GPU's time for the call, not the
// host's launch overhead (the Python benchmarks do the same with torch.cuda._sleep).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mxmla::detail {

void gpu_busy_wait(cudaStream_t stream, uint64_t nanoseconds);

}  // namespace mxmla::detail
