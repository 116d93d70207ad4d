// mxmla internal — CUDA error checking for host code.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "mxmla/tensor.h"

#define MXMLA_CUDA_CHECK(expr)                                                                    \
  do {                                                                                            \
    const cudaError_t mxmla_err_ = (expr);                                                        \
    if (mxmla_err_ != cudaSuccess)                                                                \
      throw ::mxmla::CudaError(std::string("mxmla: CUDA error '") + cudaGetErrorString(mxmla_err_) + \
                               "' in " #expr " at " __FILE__ ":" + std::to_string(__LINE__));     \
  } while (0)
