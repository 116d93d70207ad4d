// mxmla internal — device checks implemented by the CUDA backend (src/cuda/device.cpp) or by the
// stand-ins of a CPU-only build (src/cpu/no_cuda.cpp).
#pragma once

namespace mxmla::detail {

// Throws mxmla::Error (op, arg) unless `p` is device memory of CUDA device `index`.
void check_cuda_pointer(const char* op, const char* arg, const void* p, int index);

// Makes CUDA device `index` current for its scope.
struct CudaDeviceGuard {
  explicit CudaDeviceGuard(int index);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;
  int previous;
};

// Raises the current device's default memory pool's release threshold, once per device and process,
// so that the pool keeps what mxmla's scratch reserved across synchronizations (StreamScratch calls it).
void keep_pool_memory();

}  // namespace mxmla::detail
