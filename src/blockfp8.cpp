// mxmla — the block-FP8 quantization API (include/mxmla/blockfp8.h): validation and dispatch.
// The fused Q up-projection's block-FP8 overload is in src/qproj.cpp beside the other two.
#include <cmath>
#include <string>
#include <utility>

#include "common/blockfp8_ops.h"
#include "common/device.h"
#include "common/gemm_ops.h"
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

namespace {
// in's checks (a 2-D bf16 / fp32 matrix, last dim contiguous); its row stride.
int64_t check_block_input(const TensorDesc& in) {
  if (in.ndim() != 2) fail("input", "must be 2-D [rows, cols], got shape " + detail::shape_str(in.shape));
  if (!in.strides.empty() && in.strides.size() != 2) fail("input", "has strides that do not match its shape");
  if (in.dtype != DType::kBFloat16 && in.dtype != DType::kFloat32)
    fail("input", std::string("dtype ") + dtype_name(in.dtype) + " must be bfloat16 or float32");
  if (in.shape[0] < 0 || in.shape[1] < 0) fail("input", "shape " + detail::shape_str(in.shape) + " has a negative size");
  if (in.shape[1] > 0 && in.stride(1) != 1) fail("input", "last dimension must be contiguous (stride 1)");
  if (in.numel() > 0 && in.data == nullptr) fail("input", "data pointer is null");
  return in.shape[0] > 1 ? in.stride(0) : in.shape[1];
}

// out's checks for the quantization of in (transposed: of inᵀ), arguments named `<pre>data` and
// `<pre>scale_inv`; sets out.block_rows; the scales' row stride.
int64_t check_block_output(const TensorDesc& in, BlockFP8Tensor& out, const BlockQuantizeOptions& o, bool transposed,
                           const std::string& pre) {
  const int64_t rows = in.shape[0], cols = in.shape[1];
  const std::vector<int64_t> qshape = transposed ? std::vector<int64_t>{cols, rows} : in.shape;
  const std::vector<int64_t> ss = block_scale_shape(qshape[0], qshape[1], o.block_rows);
  if (out.data.shape != qshape)
    fail(pre + "data", "shape " + detail::shape_str(out.data.shape) + " must be " + detail::shape_str(qshape) +
                           (transposed ? " (the input's shape transposed)" : " (the input's shape)"));
  if (out.data.dtype != DType::kFloat8E4M3 && out.data.dtype != DType::kUInt8)
    fail(pre + "data", std::string("dtype ") + dtype_name(out.data.dtype) + " must be float8_e4m3fn (or uint8)");
  if (!out.data.is_contiguous()) fail(pre + "data", "must be contiguous");
  const int64_t s_st = detail::block_scale_stride(kOp, pre + "scale_inv", out.scale_inv, ss);
  if (out.data.numel() > 0 && out.data.data == nullptr) fail(pre + "data", "data pointer is null");
  for (const TensorDesc* t : {&out.data, &out.scale_inv})
    if (t->device != in.device) fail(pre + (t == &out.data ? "data" : "scale_inv"), "is on another device than input");
  out.block_rows = o.block_rows;
  return s_st;
}

void run_block_quantize(const TensorDesc& in, const detail::BlockQuantizeProblem& p,
                        std::initializer_list<std::pair<std::string, const TensorDesc*>> outs, Stream stream) {
  if (p.rows == 0 || p.cols == 0) return;
  if (in.device.type == DeviceType::kCPU) {
    detail::block_quantize_cpu(p);
    if (p.codes_t != nullptr) {  // the reference: inᵀ's quantization on its own
      detail::BlockQuantizeProblem t = p;
      t.transpose = true, t.codes = p.codes_t, t.scale_inv = p.scale_inv_t, t.s_st = p.s_st_t, t.codes_t = nullptr;
      detail::block_quantize_cpu(t);
    }
    return;
  }
#if MXMLA_WITH_CUDA
  detail::check_cuda_pointer(kOp, "input", in.data, in.device.index);
  for (const auto& [n, t] : outs) detail::check_cuda_pointer(kOp, n.c_str(), t->data, in.device.index);
  detail::CudaDeviceGuard guard(in.device.index);
  detail::block_quantize_cuda(p, stream);
#else
  (void)outs, (void)stream;
  fail("input", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
}
}  // namespace

void quantize_blockwise(const TensorDesc& in, BlockFP8Tensor& out, const BlockQuantizeOptions& o, Stream stream) {
  detail::BlockQuantizeProblem p;
  p.in_st = check_block_input(in);
  p.s_st = check_block_output(in, out, o, o.transpose, "");
  p.in = in.data, p.in_t = in.dtype, p.rows = in.shape[0], p.cols = in.shape[1];
  p.codes = static_cast<uint8_t*>(out.data.data), p.scale_inv = static_cast<float*>(out.scale_inv.data);
  p.block_rows = o.block_rows, p.pow2 = o.pow2_scales, p.transpose = o.transpose;
  run_block_quantize(in, p, {{"data", &out.data}, {"scale_inv", &out.scale_inv}}, stream);
}

void quantize_blockwise(const TensorDesc& in, BlockFP8Tensor& out, BlockFP8Tensor& out_t, const BlockQuantizeOptions& o,
                        Stream stream) {
  if (o.transpose) fail("transpose", "must be false: both directions are written (out: in's, out_t: inᵀ's)");
  detail::BlockQuantizeProblem p;
  p.in_st = check_block_input(in);
  p.s_st = check_block_output(in, out, o, false, "");
  p.s_st_t = check_block_output(in, out_t, o, true, "t.");
  p.in = in.data, p.in_t = in.dtype, p.rows = in.shape[0], p.cols = in.shape[1];
  p.codes = static_cast<uint8_t*>(out.data.data), p.scale_inv = static_cast<float*>(out.scale_inv.data);
  p.codes_t = static_cast<uint8_t*>(out_t.data.data), p.scale_inv_t = static_cast<float*>(out_t.scale_inv.data);
  p.block_rows = o.block_rows, p.pow2 = o.pow2_scales;
  run_block_quantize(in, p, {{"data", &out.data}, {"scale_inv", &out.scale_inv}, {"t.data", &out_t.data},
                             {"t.scale_inv", &out_t.scale_inv}}, stream);
}

namespace {
constexpr const char* kGemmOp = "mxmla.gemm";
[[noreturn]] void gfail(const std::string& arg, const std::string& rule) { throw Error(kGemmOp, arg, rule); }

struct BlockOperand {
  const uint8_t* codes;
  int64_t rows, cols, ld;
  const float* s;
  int64_t s_ld, br;
};
BlockOperand block_operand(const char* name, const BlockFP8Tensor& t) {
  const std::string n(name), data = n + ".data", sc = n + ".scale_inv";
  detail::check_matrix(kGemmOp, data, t.data, "[rows, K] (K-major codes)");
  if (t.data.dtype != DType::kFloat8E4M3 && t.data.dtype != DType::kUInt8)
    gfail(data, std::string("dtype ") + dtype_name(t.data.dtype) + " must be float8_e4m3fn (or uint8)");
  if (t.block_rows != 1 && t.block_rows != 128)
    gfail(n + ".block_rows", std::to_string(t.block_rows) + " must be 1 (1 x 128 blocks) or 128 (128 x 128 blocks)");
  const int64_t rows = t.data.shape[0], cols = t.data.shape[1];
  if (rows > 1 && cols > 0 && t.data.stride(0) < cols)
    gfail(data, "row stride " + std::to_string(t.data.stride(0)) + " is smaller than its width " + std::to_string(cols));
  const std::vector<int64_t> ss = block_scale_shape(rows, cols, t.block_rows);
  const int64_t s_ld = detail::block_scale_stride(kGemmOp, sc, t.scale_inv, ss);
  if (t.scale_inv.device != t.data.device) gfail(sc, "is on another device than " + data);
  return {static_cast<const uint8_t*>(t.data.data), rows, cols, rows > 1 ? t.data.stride(0) : cols,
          static_cast<const float*>(t.scale_inv.data), s_ld, t.block_rows};
}
}  // namespace

void gemm(const BlockFP8Tensor& a, const BlockFP8Tensor& b, TensorDesc& out, const GemmOptions& opts, Stream stream) {
  if (opts.trans_a || !opts.trans_b)
    gfail(opts.trans_a ? "trans_a" : "trans_b",
          "block-FP8 operands are K-major (A [M, K], B [N, K]: trans_a = false, trans_b = true); quantize the "
          "transposed matrix instead (BlockQuantizeOptions::transpose)");
  if (!std::isfinite(opts.alpha)) gfail("alpha", "must be finite, got " + std::to_string(opts.alpha));
  const BlockOperand A = block_operand("a", a), B = block_operand("b", b);
  const int64_t M = A.rows, N = B.rows, K = A.cols;
  if (B.cols != K)
    gfail("b.data", "K = " + std::to_string(B.cols) + " (its last dim) does not match a's K = " + std::to_string(K));
  detail::check_gemm_out(kGemmOp, out, M, N, opts.accumulate, "D += alpha * A * Bᵀ");
  const Device dev = a.data.device;
  for (const auto& [n, t] : {std::pair<const char*, const TensorDesc*>{"b.data", &b.data}, {"out", &out}})
    if (t->device != dev)
      gfail(n, "is on " + detail::device_str(t->device) + " but a.data is on " + detail::device_str(dev) +
                   ": both operands and out must be on one device");
  detail::BlockGemmProblem p;
  p.M = M, p.N = N, p.K = K;
  p.a = A.codes, p.b = B.codes, p.a_ld = A.ld, p.b_ld = B.ld;
  p.sa = A.s, p.sb = B.s, p.sa_ld = A.s_ld, p.sb_ld = B.s_ld, p.a_br = A.br, p.b_br = B.br;
  p.out = out.data, p.out_t = out.dtype, p.ld_out = M > 1 ? out.stride(0) : N;
  p.accumulate = opts.accumulate, p.alpha = opts.alpha;
  if (M == 0 || N == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::block_gemm_cpu(p);
#if MXMLA_WITH_CUDA
  const int index = dev.index;
  for (const auto& [n, ptr] : {std::pair<const char*, const void*>{"a.data", A.codes}, {"a.scale_inv", A.s},
                               {"b.data", B.codes}, {"b.scale_inv", B.s}, {"out", out.data}})
    detail::check_cuda_pointer(kGemmOp, n, ptr, index);
  detail::CudaDeviceGuard guard(index);
  detail::block_gemm_cuda(p, stream);
#else
  (void)stream;
  gfail("a.data", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
}

}  // namespace mxmla
