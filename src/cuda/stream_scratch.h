// mxmla internal — stream-ordered scratch memory for one launcher call: allocated on the stream,
// freed on the stream by the destructor (after the work queued before it), also when the caller
// throws. Host code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device.h"
#include "cuda/cuda_check.h"

namespace mxmla::detail {

struct StreamScratch {
  uint8_t* ptr = nullptr;  // null when bytes == 0
  cudaStream_t stream;
  StreamScratch(int64_t bytes, cudaStream_t s) : stream(s) {
    if (bytes <= 0) return;
    keep_pool_memory();  // (once per device)
    MXMLA_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ptr), bytes, stream));
  }
  ~StreamScratch() {
    if (ptr != nullptr) (void)cudaFreeAsync(ptr, stream);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
};

}  // namespace mxmla::detail
