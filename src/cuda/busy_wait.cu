// mxmla internal — see busy_wait.h.
#include "cuda/busy_wait.h"

#include "cuda/cuda_check.h"
#include "cuda/ptx/common.cuh"

namespace mxmla::detail {
namespace {

__global__ void busy_wait_kernel(uint64_t ns) {
  const uint64_t t0 = ptx::globaltimer();
  while (ptx::globaltimer() - t0 < ns) __nanosleep(1000);
}

}  // namespace

void gpu_busy_wait(cudaStream_t stream, uint64_t nanoseconds) {
  busy_wait_kernel<<<1, 1, 0, stream>>>(nanoseconds);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace mxmla::detail
