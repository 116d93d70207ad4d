// mxmla — CUDA device queries and pointer checks (host code, CUDA runtime).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "common/device.h"
#include "cuda/cuda_check.h"
#include "mxmla/mxfp8.h"

namespace mxmla {
namespace detail {

void check_cuda_pointer(const char* op, const char* arg, const void* p, int index) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw Error(op, arg, "is on cuda:" + std::to_string(index) + " but no CUDA device is available");
  }
  if (index < 0 || index >= count)
    throw Error(op, arg, "is on cuda:" + std::to_string(index) + " but only " + std::to_string(count) +
                             " CUDA device(s) exist");
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    throw Error(op, arg, "data pointer is not a CUDA allocation");
  }
  if (a.type == cudaMemoryTypeUnregistered || a.type == cudaMemoryTypeHost)
    throw Error(op, arg, "is described as cuda:" + std::to_string(index) + " but its data pointer is host memory");
  if (a.type == cudaMemoryTypeDevice && a.device != index)
    throw Error(op, arg, "is described as cuda:" + std::to_string(index) + " but its data lives on cuda:" +
                             std::to_string(a.device));
}

CudaDeviceGuard::CudaDeviceGuard(int index) : previous(-1) {
  MXMLA_CUDA_CHECK(cudaGetDevice(&previous));
  if (previous != index) MXMLA_CUDA_CHECK(cudaSetDevice(index));
}
CudaDeviceGuard::~CudaDeviceGuard() {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != previous && previous >= 0) cudaSetDevice(previous);
}

void keep_pool_memory() {
  // devices 0..63 (more keep the driver's default, release at every synchronization)
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return;
  const uint64_t bit = uint64_t{1} << dev;
  if ((done.load(std::memory_order_relaxed) & bit) != 0) return;
  cudaMemPool_t pool;
  MXMLA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  // (what torch's cudaMallocAsync backend also sets on this pool: it then keeps its cache there)
  uint64_t threshold = UINT64_MAX;
  MXMLA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  done.fetch_or(bit, std::memory_order_relaxed);
}

}  // namespace detail

BuildInfo build_info() { return {true, MXMLA_CUDA_ARCHS, MXMLA_VERSION, true}; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

PoolUsage cuda_pool_usage(bool reset_high) {
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  MXMLA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t cur = 0, high = 0;  // (cuuint64_t)
  if (reset_high) MXMLA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));  // (0: now)
  MXMLA_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &cur));
  MXMLA_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
  return {static_cast<int64_t>(cur), static_cast<int64_t>(high)};
}

int64_t cuda_pool_release() {
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  MXMLA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());  // frees queued on streams take effect first
  uint64_t before = 0, after = 0;
  MXMLA_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &before));
  MXMLA_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
  MXMLA_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &after));
  return static_cast<int64_t>(before - std::min(before, after));
}

std::string cuda_device_description(int index) {
  cudaDeviceProp prop{};
  MXMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  return std::string(prop.name) + ", sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         std::to_string(prop.multiProcessorCount) + " SMs, " + std::to_string(prop.totalGlobalMem >> 30) +
         " GiB, L2 " + std::to_string(prop.l2CacheSize >> 20) + " MiB, driver " + std::to_string(drv) +
         ", runtime " + std::to_string(rt);
}

}  // namespace mxmla
