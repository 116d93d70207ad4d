// mxmla experiments — what the self-contained drivers (no library link: 08, 09) share: a CUDA
// runtime call checked with its file and line, and the SM's cycle counter. Not part of the library.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define DEV_CHECK_CUDA(x)                                                                              \
  do {                                                                                                 \
    const cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

namespace mxmla::dev {
__device__ __forceinline__ long long clock_now() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}
}  // namespace mxmla::dev
