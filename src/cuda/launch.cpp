// mxmla internal — host: cached device and kernel queries (cuda/launch.h).
#include "cuda/launch.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

#include "cuda/cuda_check.h"

namespace mxmla::detail {

namespace {
std::mutex g_mu;
}  // namespace

int device_sms() {
  static std::map<int, int> sms;
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = sms.find(dev);
  if (it != sms.end()) return it->second;
  int n = 0;
  MXMLA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return sms[dev] = n > 0 ? n : 1;
}

KernelFit kernel_fit(const void* kernel, int threads, size_t smem, size_t smem_limit) {
  static std::map<std::tuple<int, const void*, int, size_t>, KernelFit> fits;
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, kernel, threads, smem);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = fits.find(key);
    if (it != fits.end()) return it->second;
  }
  const int sms = device_sms();
  if (smem_limit > 48 * 1024)
    MXMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_limit)));
  int per_sm = 0;
  MXMLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const KernelFit f{sms, per_sm > 0 ? per_sm : 1};
  std::lock_guard<std::mutex> lock(g_mu);
  return fits[key] = f;
}

}  // namespace mxmla::detail
