// mxmla internal — host side of TMA: bf16 tensor maps through the runtime's driver entry point
// (no link against libcuda), shared by the kernels that load with cp.async.bulk.tensor.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cudaTypedefs.h>

#include <string>

#include "cuda/cuda_check.h"

namespace mxmla::detail {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    MXMLA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || f == nullptr)
      throw CudaError("mxmla: the CUDA driver has no cuTensorMapEncodeTiled (TMA needs driver >= 12.0)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A bf16 tensor map of `rank` (<= 3) dims (innermost first), strides in bytes of dims 1.., box in
// elements; elements outside the tensor read as zero.
inline CUtensorMap make_tmap_bf16(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides_bytes,
                                  const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
  CUtensorMap m;
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims,
                                          strides_bytes, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw CudaError("mxmla: cuTensorMapEncodeTiled failed (error " + std::to_string(r) + ")");
  return m;
}

}  // namespace mxmla::detail
