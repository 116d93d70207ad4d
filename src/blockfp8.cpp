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

namespace detail {
int64_t block_scale_stride(const char* op, const std::string& arg, const TensorDesc& s, const std::vector<int64_t>& ss) {
  auto bad = [&](const std::string& rule) { throw Error(op, arg, rule); };
  if (s.shape != ss) bad("shape " + shape_str(s.shape) + " must be " + shape_str(ss));
  if (s.dtype != DType::kFloat32) bad(std::string("dtype ") + dtype_name(s.dtype) + " must be float32");
  if (!s.strides.empty() && s.strides.size() != 2) bad("has strides that do not match its shape");
  if (ss[1] > 0 && s.stride(1) != 1) bad("last dimension must be contiguous (stride 1)");
  if (ss[0] > 1 && s.stride(0) < ss[1]) bad("rows overlap (row stride below its width)");
  if (s.numel() > 0 && s.data == nullptr) bad("data pointer is null");
  return ss[0] > 1 ? s.stride(0) : ss[1];
}
}  // namespace detail

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
  const int64_t s_st = detail::block_scale_stride(kOp, "scale_inv", out.scale_inv, ss);
  if (out.data.numel() > 0 && out.data.data == nullptr) fail("data", "data pointer is null");
  for (const TensorDesc* t : {&out.data, &out.scale_inv})
    if (t->device != in.device) fail(t == &out.data ? "data" : "scale_inv", "is on another device than input");
  out.block_rows = o.block_rows;
  detail::BlockQuantizeProblem p;
  p.in = in.data, p.in_t = in.dtype, p.rows = rows, p.cols = cols, p.in_st = rows > 1 ? in.stride(0) : cols;
  p.codes = static_cast<uint8_t*>(out.data.data), p.scale_inv = static_cast<float*>(out.scale_inv.data);
  p.s_st = s_st;
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
