// mxmla internal — host side of TMA: tensor maps (CUtensorMap) for any element type, encoded through
// the runtime's driver entry point (no link against libcuda). Kernels load / store with
// cuda/ptx/tma.cuh and take the maps as __grid_constant__ parameters.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "cuda/cuda_check.h"
#include "mxmla/tensor.h"

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

// The tensor-map element type of a DType: FP8 codes, E8M0 scales and raw bytes travel as uint8.
inline CUtensorMapDataType tma_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    case DType::kFloat16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kBFloat16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kInt32: return CU_TENSOR_MAP_DATA_TYPE_INT32;
    case DType::kInt64: return CU_TENSOR_MAP_DATA_TYPE_INT64;
    default: return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // kFloat8E4M3, kFloat8E5M2, kE8M0, kUInt8
  }
}

// A tensor map of `rank` (1..5) dims of `dtype` elements: dims innermost first, strides in bytes
// of dims 1.. (multiples of 16), box in elements (box[0] * element size a multiple of 16 bytes,
// at most the swizzle span when swizzled). Elements outside the tensor read as zero.
// A dim of extent 1 is never stepped over, so its stride is free: a view may carry any value there
// (0, or one that is not a multiple of 16 bytes, as PyTorch gives a one-token view), which the
// driver rejects. Such a stride is replaced by the packed one: the next inner dim's span, rounded
// up to 16 bytes.
inline CUtensorMap make_tma_desc(const void* base, DType dtype, int rank, const cuuint64_t* dims,
                                 const cuuint64_t* strides_bytes, const cuuint32_t* box, CUtensorMapSwizzle swizzle,
                                 CUtensorMapL2promotion l2 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMap m;
  const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
  cuuint64_t st[4] = {0, 0, 0, 0};  // strides of dims 1 .. rank - 1, in bytes
  for (int i = 1; i < rank && i < 5; ++i) {
    const cuuint64_t inner = i == 1 ? static_cast<cuuint64_t>(dtype_size(dtype)) : st[i - 2];
    st[i - 1] = dims[i] == 1 ? (dims[i - 1] * inner + 15) / 16 * 16 : strides_bytes[i - 1];
  }
  const CUresult r = tensor_map_encoder()(&m, tma_dtype(dtype), rank, const_cast<void*>(base), dims, st, box,
                                          estr, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw CudaError("mxmla: cuTensorMapEncodeTiled failed (error " + std::to_string(r) + ", " + dtype_name(dtype) +
                    ", rank " + std::to_string(rank) + ")");
  return m;
}

}  // namespace mxmla::detail
