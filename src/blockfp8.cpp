// mxmla — the block-FP8 quantization API (include/mxmla/blockfp8.h): validation and dispatch.
// The fused Q up-projection's block-FP8 overload is in src/qproj.cpp beside the other two.
#include <string>
#include <utility>

#include "common/blockfp8_ops.h"
#include "common/device.h"
#include "common/text.h"
#include "mxmla/blockfp8.h"

namespace mxmla {

namespace {
constexpr const char* kOp = "mxmla.quantize_blockwise";
[[noreturn]] void fail(const std::string& arg, const std::string& rule) { throw Error(kOp, arg, rule); }
}  // namespace

std::vector<int64_t> block_scale_shape(int64_t rows, int64_t cols, int64_t block_rows) {
  if (block_rows != 1 && block_rows != 128)
    throw Error(kOp, "block_rows", std::to_string(block_rows) + " must be 1 (1 x 128 blocks) or 128 (128 x 128 blocks)");
  return {(rows + block_rows - 1) / block_rows, (cols + 127) / 128};
}

void quantize_blockwise(const TensorDesc& in, BlockFP8Tensor& out, const BlockQuantizeOptions& o, Stream stream) {
  if (in.ndim() != 2) fail("input", "must be 2-D [rows, cols], got shape " + detail::shape_str(in.shape));
  if (!in.strides.empty() && in.strides.size() != 2) fail("input", "has strides that do not match its shape");
  if (in.dtype != DType::kBFloat16 && in.dtype != DType::kFloat32)
    fail("input", std::string("dtype ") + dtype_name(in.dtype) + " must be bfloat16 or float32");
  const int64_t rows = in.shape[0], cols = in.shape[1];
  if (rows < 0 || cols < 0) fail("input", "shape " + detail::shape_str(in.shape) + " has a negative size");
  if (cols > 0 && in.stride(1) != 1) fail("input", "last dimension must be contiguous (stride 1)");
  if (in.numel() > 0 && in.data == nullptr) fail("input", "data pointer is null");
  const std::vector<int64_t> ss = block_scale_shape(rows, cols, o.block_rows);
  if (out.data.shape != in.shape) fail("data", "shape " + detail::shape_str(out.data.shape) + " must be " + detail::shape_str(in.shape));
  if (out.data.dtype != DType::kFloat8E4M3 && out.data.dtype != DType::kUInt8)
    fail("data", std::string("dtype ") + dtype_name(out.data.dtype) + " must be float8_e4m3fn (or uint8)");
  if (!out.data.is_contiguous()) fail("data", "must be contiguous");
  if (out.scale_inv.shape != ss)
    fail("scale_inv", "shape " + detail::shape_str(out.scale_inv.shape) + " must be " + detail::shape_str(ss));
  if (out.scale_inv.dtype != DType::kFloat32)
    fail("scale_inv", std::string("dtype ") + dtype_name(out.scale_inv.dtype) + " must be float32");
  if (!out.scale_inv.strides.empty() && out.scale_inv.strides.size() != 2) fail("scale_inv", "has strides that do not match its shape");
  if (ss[1] > 0 && out.scale_inv.stride(1) != 1) fail("scale_inv", "last dimension must be contiguous (stride 1)");
  if (ss[0] > 1 && out.scale_inv.stride(0) < ss[1]) fail("scale_inv", "rows overlap (row stride below its width)");
  for (const TensorDesc* t : {&out.data, &out.scale_inv}) {
    const char* n = t == &out.data ? "data" : "scale_inv";
    if (t->numel() > 0 && t->data == nullptr) fail(n, "data pointer is null");
    if (t->device != in.device) fail(n, "is on another device than input");
  }
  out.block_rows = o.block_rows;
  detail::BlockQuantizeProblem p;
  p.in = in.data, p.in_t = in.dtype, p.rows = rows, p.cols = cols, p.in_st = rows > 1 ? in.stride(0) : cols;
  p.codes = static_cast<uint8_t*>(out.data.data), p.scale_inv = static_cast<float*>(out.scale_inv.data);
  p.s_st = ss[0] > 1 ? out.scale_inv.stride(0) : ss[1];
  p.block_rows = o.block_rows, p.pow2 = o.pow2_scales;
  if (rows == 0 || cols == 0) return;
  if (in.device.type == DeviceType::kCPU) return detail::block_quantize_cpu(p);
#if MXMLA_WITH_CUDA
  for (const auto& [n, t] : {std::pair<const char*, const TensorDesc*>{"input", &in}, {"data", &out.data},
                             {"scale_inv", &out.scale_inv}})
    detail::check_cuda_pointer(kOp, n, t->data, in.device.index);
  detail::CudaDeviceGuard guard(in.device.index);
  detail::block_quantize_cuda(p, stream);
#else
  (void)stream;
  fail("input", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
}

}  // namespace mxmla
