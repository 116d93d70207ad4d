// mxmla — stand-ins for the CUDA backend in a build without a CUDA compiler: every CUDA request
// fails with a clear error instead of crashing.
#include <string>

#include "common/device.h"
#include "common/attention_ops.h"
#include "common/gemm_ops.h"
#include "common/ops.h"

namespace mxmla {
namespace detail {

[[noreturn]] static void no_cuda(const char* op, const char* arg) {
  throw Error(op, arg, "is on a CUDA device, but this mxmla build has no CUDA support (rebuild with nvcc)");
}
void check_cuda_pointer(const char* op, const char* arg, const void*, int) { no_cuda(op, arg); }
CudaDeviceGuard::CudaDeviceGuard(int) : previous(0) { no_cuda("mxmla", "input"); }
CudaDeviceGuard::~CudaDeviceGuard() = default;
void quantize_cuda(const QuantizeProblem&, Stream) { no_cuda("mxmla.quantize", "input"); }
void dequantize_cuda(const DequantizeProblem&, Stream) { no_cuda("mxmla.dequantize", "input"); }
void remap_scales_cuda(const std::vector<RemapProblem>&, Stream) { no_cuda("mxmla.remap_scales", "input"); }
void attention_fwd_cuda(const AttentionProblem&, Stream) { no_cuda("mxmla.attention", "q"); }
bool attention_cuda_supports(int64_t, int64_t) { return false; }
void attention_bwd_cuda(const AttentionBwdProblem&, Stream) { no_cuda("mxmla.attention_backward", "q"); }
size_t attention_bwd_cuda_smem(int64_t, int64_t) { return 0; }
void mxfp8_gemm_cuda(const GemmProblem&, Stream, const GemmPrepared*) { no_cuda("mxmla.gemm", "a"); }
void linear_forward_cuda(const QuantizeProblem&, GemmProblem, Stream) { no_cuda("mxmla.linear_forward", "x"); }
void linear_backward_cuda(const QuantizeProblem&, const GemmProblem*, GemmProblem, Stream) {
  no_cuda("mxmla.linear_backward", "dy");
}
void rope_linear_backward_cuda(const RopeQuantizeParams&, const GemmProblem*, GemmProblem, Stream) {
  no_cuda("mxmla.rope_linear_backward", "dq");
}

}  // namespace detail

BuildInfo build_info() { return {false, "", MXMLA_VERSION, false}; }
int cuda_device_count() { return 0; }
PoolUsage cuda_pool_usage(bool) { return {}; }
int64_t cuda_pool_release() { return 0; }
std::string cuda_device_description(int) { return "no CUDA support in this build"; }

}  // namespace mxmla
