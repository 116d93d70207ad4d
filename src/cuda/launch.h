// mxmla internal — host: what the launchers read off the device, once per (device, kernel). The
// first query for a kernel also raises its dynamic shared-memory limit, which a launch with more
// than 48 KB needs. Thread-safe.
#pragma once

#include <cstddef>

namespace mxmla::detail {

struct KernelFit {
  int sms;     // multiprocessors of the current device
  int per_sm;  // CTAs of `kernel` resident per SM at `threads` threads and `smem` dynamic bytes (>= 1)
  int resident() const { return sms * per_sm; }
};
// `kernel`: the __global__ function's address. smem_limit: the dynamic shared memory the kernel
// may be launched with (set as its MaxDynamicSharedMemorySize when above 48 KB; >= smem).
KernelFit kernel_fit(const void* kernel, int threads, size_t smem, size_t smem_limit);
// The current device's SM count.
int device_sms();

}  // namespace mxmla::detail
