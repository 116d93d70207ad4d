// mxmla experiments — what the drivers 08, 09 (self-contained: no library link) and 10 share: a CUDA
// runtime call checked with its file and line, the SM90 check, and the SM's cycle counter. Not part of
// the library.
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
// The current device's SM count; exits with status 2 and a message naming the driver `name` unless
// the device is an SM90 GPU (the sm_90a drivers run nowhere else).
inline int require_sm90(const char* name) {
  int dev = 0, major = 0, minor = 0, sms = 0;
  DEV_CHECK_CUDA(cudaGetDevice(&dev));
  DEV_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  DEV_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  DEV_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (major != 9 || minor != 0) {
    std::fprintf(stderr, "%s: needs an SM90 GPU (found sm_%d%d)\n", name, major, minor);
    std::exit(2);
  }
  return sms;
}

__device__ __forceinline__ long long clock_now() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}
}  // namespace mxmla::dev
