// mxmla — the MXFP8 GEMM API (include/mxmla/gemm.h, SPEC §6): validation, the copy each operand is
// read through, dispatch: the CPU reference, or the SM90 MXFP8 GEMM (src/cuda/sm90_mxfp8_gemm.cu) for
// MXFP8 operands on CUDA (bf16 operands on CUDA: a clear error).
//
// Operands. Each is stored as a 2-D matrix [rows, cols]; the contraction runs along its cols or its
// rows, by the flags:
//   a: [M, K] (trans_a = false: along cols -> the rowwise copy) or [K, M] (trans_a: along rows -> the
//      columnwise copy);
//   b: [N, K] (trans_b = true: along cols -> the rowwise copy) or [K, N] (trans_b = false: along rows
//      -> the columnwise copy).
// An MXFP8 operand is an MXFP8Tensor from quantize (2-D `shape`, compact or swizzled scales) holding
// that copy; its codes are [rows, cols] with the last dim contiguous (any row stride), its scales the
// quantize_shapes() of `shape`, contiguous. A rowwise copy has blocks of 32 along cols, so its
// contraction length is a multiple of 32; a columnwise copy has blocks of 32 along rows, the last one
// a tail block when rows % 32 != 0 (SPEC §2.1), so it takes any contraction length. A bf16 operand
// is a 2-D bfloat16 tensor with the last dim contiguous (any row stride), any sizes.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/device.h"
#include "common/gemm_ops.h"
#include "common/text.h"
#include "mxmla/gemm.h"

namespace mxmla {

namespace {

constexpr const char* kOp = "mxmla.gemm";
// The op that errors name: mxmla.gemm, or another op checking its MXFP8 operands through
// detail::gemm_rowwise_operand (for the duration of that call).
thread_local const char* t_op = kOp;

[[noreturn]] void fail(const std::string& arg, const std::string& rule) { throw Error(t_op, arg, rule); }

using detail::MapMode;
using detail::shape_str;

std::string flag_str(bool v) { return v ? "true" : "false"; }

// Why an operand is read through the copy it is: the GEMM's view and the Linear's GEMMs that read it.
std::string copy_reason(bool is_a, bool contract_cols) {
  if (t_op != kOp)
    return std::string(t_op) + " reads its " + (contract_cols ? "rowwise" : "columnwise") +
           " copy: blocks of 32 along the contraction axis";
  if (is_a)
    return contract_cols
               ? "with trans_a = false A is [M, K] and the contraction runs along its last dim, so the GEMM reads A's "
                 "rowwise copy: blocks of 32 along K, the contraction axis (fprop reads x's, dgrad dy's)"
               : "with trans_a = true A is [K, M] and the contraction runs along its leading dim, so the GEMM reads "
                 "A's columnwise copy: blocks of 32 along K, the contraction axis (wgrad reads dy's: blocks of 32 "
                 "along the tokens)";
  return contract_cols
             ? "with trans_b = true B is [N, K] and the contraction runs along its last dim, so the GEMM reads B's "
               "rowwise copy: blocks of 32 along K, the contraction axis (fprop reads W's)"
             : "with trans_b = false B is [K, N] and the contraction runs along its leading dim, so the GEMM reads "
               "B's columnwise copy: blocks of 32 along K, the contraction axis (dgrad reads W's: blocks of 32 along "
               "N; wgrad reads x's: blocks of 32 along the tokens)";
}

struct Operand {
  std::string name;       // "a" / "b"
  bool contract_cols = true;
  std::string dir;        // "rowwise" / "columnwise" (MXFP8)
  std::string data_arg;   // "a" (bf16) or "a.rowwise_data" (codes)
  std::string scale_arg;  // "a.rowwise_scale_inv" (MXFP8)
  const TensorDesc* data = nullptr;
  const TensorDesc* scales = nullptr;
  const MXFP8Tensor* mx = nullptr;
  int64_t rows = 0, cols = 0;
  // the GEMM's sizes of this operand: `outer` (M or N) and the contraction length K
  int64_t outer() const { return contract_cols ? rows : cols; }
  int64_t contraction() const { return contract_cols ? cols : rows; }
};

// A 2-D matrix descriptor: rank, strides, sizes, last dim contiguous, data pointer.
void check_matrix(const std::string& arg, const TensorDesc& t, const std::string& what) {
  detail::check_matrix(t_op, arg, t, what);
}

}  // namespace

void detail::check_matrix(const char* op, const std::string& arg, const TensorDesc& t, const std::string& what) {
  auto fail = [op](const std::string& a, const std::string& rule) { throw Error(op, a, rule); };
  if (t.shape.size() != 2) fail(arg, "must be 2-D " + what + ", got shape " + shape_str(t.shape));
  if (!t.strides.empty() && t.strides.size() != 2)
    fail(arg, "has " + std::to_string(t.strides.size()) + " strides for 2 dimensions");
  for (int64_t s : t.shape)
    if (s < 0) fail(arg, "shape " + shape_str(t.shape) + " has a negative size");
  if (t.shape[1] > 1 && t.shape[0] > 0 && t.stride(1) != 1)
    fail(arg, "last dimension must be contiguous (stride 1), got stride " + std::to_string(t.stride(1)));
  if (t.numel() > 0 && t.data == nullptr) fail(arg, "data pointer is null");
}

void detail::check_gemm_out(const char* op, const TensorDesc& out, int64_t M, int64_t N, bool accumulate,
                            const std::string& formula) {
  auto fail = [op](const std::string& rule) { throw Error(op, "out", rule); };
  check_matrix(op, "out", out, "[M, N]");
  if (out.shape != std::vector<int64_t>{M, N}) fail("shape " + shape_str(out.shape) + " must be [M, N] = " + shape_str({M, N}));
  if (out.dtype != DType::kBFloat16 && out.dtype != DType::kFloat32)
    fail(std::string("dtype ") + dtype_name(out.dtype) + " must be bfloat16 or float32");
  if (accumulate && out.dtype != DType::kFloat32)
    fail(std::string("dtype ") + dtype_name(out.dtype) + " must be float32 with accumulate (" + formula +
         " reads and writes an fp32 D)");
  if (M > 1 && N > 0 && out.stride(0) < N)
    fail("row stride " + std::to_string(out.stride(0)) + " is smaller than N = " + std::to_string(N) +
         " (rows would overlap)");
}

namespace {

Operand read_operand(const char* name, const GemmInput& in, bool contract_cols) {
  Operand op;
  op.name = name, op.contract_cols = contract_cols;
  const bool is_a = op.name == "a";
  const char* A = is_a ? "A" : "B";
  if ((in.bf16 == nullptr) == (in.mx == nullptr))
    fail(name, "give exactly one of bf16 data (GemmInput::bf16) or an MXFP8 tensor (GemmInput::mx)");
  if (in.bf16 != nullptr) {
    op.data = in.bf16, op.data_arg = name;
    if (in.bf16->dtype != DType::kBFloat16)
      fail(name, std::string("dtype ") + dtype_name(in.bf16->dtype) + " must be bfloat16 (or pass an MXFP8 tensor)");
    check_matrix(name, *in.bf16, std::string("[rows, cols] (") + A + ")");
    op.rows = in.bf16->shape[0], op.cols = in.bf16->shape[1];
    return op;
  }
  const MXFP8Tensor& mx = *in.mx;
  op.mx = &mx;
  op.dir = contract_cols ? "rowwise" : "columnwise";
  op.data_arg = op.name + "." + op.dir + "_data", op.scale_arg = op.name + "." + op.dir + "_scale_inv";
  if (mx.attention || mx.scale_layout == ScaleLayout::kBHSD)
    fail(name, "is an attention hand-off tensor (quantize_attention / BHSD scales); a GEMM operand comes from "
               "quantize, with compact or swizzled scales");
  if (mx.shape.size() != 2)
    fail(op.name + ".shape", shape_str(mx.shape) + " must be 2-D [rows, cols]: quantize the operand as a matrix");
  const int64_t rows = mx.shape[0], cols = mx.shape[1];
  if (rows < 0) fail(op.name + ".shape", shape_str(mx.shape) + " has a negative size");
  if (cols <= 0 || cols % 32 != 0) {
    if (contract_cols && t_op != kOp)
      fail(op.name + ".shape", "contraction length K = " + std::to_string(cols) + " (the last dim of " +
                                   shape_str(mx.shape) + ") must be a positive multiple of 32: the rowwise copy has "
                                   "blocks of 32 along K");
    if (contract_cols)
      fail(op.name + ".shape",
           "contraction length K = " + std::to_string(cols) + " (the last dim of " + shape_str(mx.shape) +
               ") must be a positive multiple of 32: " + A + "'s rowwise copy has blocks of 32 along K (a columnwise "
               "copy, read with trans_" + op.name + " = " + flag_str(is_a) + ", takes any contraction length)");
    fail(op.name + ".shape", "last dimension " + std::to_string(cols) + " of " + shape_str(mx.shape) +
                                 " must be a positive multiple of 32 (the MXFP8 layout: rowwise blocks of 32 along "
                                 "it); the contraction along its rows may have any length");
  }
  op.rows = rows, op.cols = cols;
  op.data = contract_cols ? &mx.rowwise_data : &mx.columnwise_data;
  op.scales = contract_cols ? &mx.rowwise_scale_inv : &mx.columnwise_scale_inv;
  if (op.data->data == nullptr && (op.data->shape.empty() || op.data->numel() > 0))
    fail(op.data_arg, "is absent: " + copy_reason(is_a, contract_cols) + "; quantize " +
                          (t_op != kOp ? op.name : std::string(A)) + " with " + op.dir + " enabled");
  const DType want = mx.format == Fp8Format::kE4M3 ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
  if (op.data->dtype != DType::kUInt8 && op.data->dtype != want)
    fail(op.data_arg, std::string("dtype ") + dtype_name(op.data->dtype) + " must be uint8 or " + dtype_name(want));
  if (op.data->shape != mx.shape)
    fail(op.data_arg, "shape " + shape_str(op.data->shape) + " must equal the tensor's shape " + shape_str(mx.shape));
  check_matrix(op.data_arg, *op.data, "[rows, cols]");
  const bool swz = mx.scale_layout == ScaleLayout::kSwizzled;
  const MXFP8Shapes s = quantize_shapes(mx.shape, swz);
  const std::vector<int64_t>& want_s = contract_cols ? s.rowwise_scale : s.columnwise_scale;
  const TensorDesc& t = *op.scales;
  if (t.shape != want_s)
    fail(op.scale_arg, "shape " + shape_str(t.shape) + " must be " + shape_str(want_s) + " (the " + op.dir + " " +
                           (swz ? "swizzled" : "compact") + " scales of an MXFP8 tensor of shape " +
                           shape_str(mx.shape) + ")");
  if (t.dtype != DType::kUInt8 && t.dtype != DType::kE8M0)
    fail(op.scale_arg, std::string("dtype ") + dtype_name(t.dtype) + " must be uint8 or e8m0");
  if ((!t.strides.empty() && t.strides.size() != t.shape.size()) || !t.is_contiguous())
    fail(op.scale_arg, "must be contiguous");
  if (t.numel() > 0 && t.data == nullptr) fail(op.scale_arg, "data pointer is null");
  return op;
}

detail::GemmOperandView view_of(const Operand& op) {
  detail::GemmOperandView v;
  v.data = op.data->data;
  v.rows = op.rows, v.cols = op.cols;
  v.ld = op.rows > 1 ? op.data->stride(0) : op.cols;
  v.contract_cols = op.contract_cols;
  if (op.mx != nullptr) {
    v.scales = static_cast<const uint8_t*>(op.scales->data);
    const MapMode mode = op.mx->scale_layout == ScaleLayout::kSwizzled ? MapMode::kSwizzled : MapMode::kCompact;
    v.map = op.contract_cols ? detail::make_row_map(mode, 1, op.rows, op.cols)
                             : detail::make_col_map(mode, 1, op.rows, op.cols);
  }
  return v;
}

// bf16 operands on CUDA: the SM90 kernel takes MXFP8 operands.
[[noreturn]] void no_cuda_kernel(const Device& dev, bool /*fp8*/) {
  fail("a", "is on " + detail::device_str(dev) + ", but the CUDA bf16 GEMM kernel is not available in this build yet (the SM90 "
                "kernel takes MXFP8 operands); run a bf16 matmul (cuBLAS, torch.matmul), or call gemm on CPU tensors "
                "for the reference");
}

}  // namespace

detail::GemmOperandView detail::gemm_operand(const char* op, const char* name, const MXFP8Tensor& t,
                                             bool contract_cols) {
  struct Restore {
    ~Restore() { t_op = kOp; }
  } restore;
  t_op = op;
  GemmInput in;
  in.mx = &t;
  return view_of(read_operand(name, in, contract_cols));
}
detail::GemmOperandView detail::gemm_rowwise_operand(const char* op, const char* name, const MXFP8Tensor& t) {
  return gemm_operand(op, name, t, true);
}

void gemm(const GemmInput& a, const GemmInput& b, TensorDesc& out, const GemmOptions& opts, Stream stream) {
  if (!std::isfinite(opts.alpha)) fail("alpha", "must be finite, got " + std::to_string(opts.alpha));
  const Operand A = read_operand("a", a, !opts.trans_a);
  const Operand B = read_operand("b", b, opts.trans_b);

  // one precision, one FP8 format
  const bool fp8 = A.mx != nullptr;
  if ((B.mx != nullptr) != fp8)
    fail("b", std::string("is ") + (B.mx ? "MXFP8" : "bfloat16") + " but a is " + (fp8 ? "MXFP8" : "bfloat16") +
                  ": both operands must be MXFP8 or both bfloat16");
  if (fp8 && B.mx->format != A.mx->format)
    fail("b", std::string("FP8 format ") + (B.mx->format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") + " differs from a's " +
                  (A.mx->format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") + ": both operands must share one format");

  // sizes: op(A) [M, K], op(B) [K, N]
  const int64_t M = A.outer(), N = B.outer(), K = A.contraction();
  if (B.contraction() != K)
    fail("b", "contraction length " + std::to_string(B.contraction()) + " (b's " +
                  (B.contract_cols ? "last dim, trans_b = true" : "leading dim, trans_b = false") +
                  ") does not match a's K = " + std::to_string(K) + " (a's " +
                  (A.contract_cols ? "last dim, trans_a = false" : "leading dim, trans_a = true") + ")");

  detail::check_gemm_out(t_op, out, M, N, opts.accumulate, "D += alpha * op(A) * op(B)");

  // one device
  const Device dev = A.data->device;
  auto same_device = [&](const std::string& arg, const TensorDesc& t) {
    if (t.device != dev)
      fail(arg, "is on " + detail::device_str(t.device) + " but " + A.data_arg + " is on " + detail::device_str(dev) +
                    ": both operands and out must be on one device");
  };
  if (A.scales) same_device(A.scale_arg, *A.scales);
  same_device(B.data_arg, *B.data);
  if (B.scales) same_device(B.scale_arg, *B.scales);
  same_device("out", out);

  detail::GemmProblem p;
  p.M = M, p.N = N, p.K = K;
  p.fp8 = fp8, p.fmt = fp8 ? A.mx->format : Fp8Format::kE4M3;
  p.a = view_of(A), p.b = view_of(B);
  p.out = out.data, p.out_t = out.dtype, p.ld_out = M > 1 ? out.stride(0) : N;
  p.accumulate = opts.accumulate, p.alpha = opts.alpha;

  if (dev.type == DeviceType::kCUDA) {
    if (!fp8) no_cuda_kernel(dev, fp8);
    if (M == 0 || N == 0) return;
    const int index = dev.index;
    detail::check_cuda_pointer(kOp, A.data_arg.c_str(), A.data->data, index);
    detail::check_cuda_pointer(kOp, A.scale_arg.c_str(), A.scales->data, index);
    detail::check_cuda_pointer(kOp, B.data_arg.c_str(), B.data->data, index);
    detail::check_cuda_pointer(kOp, B.scale_arg.c_str(), B.scales->data, index);
    detail::check_cuda_pointer(kOp, "out", out.data, index);
    detail::CudaDeviceGuard guard(index);
    detail::mxfp8_gemm_cuda(p, stream);
    return;
  }
  if (M == 0 || N == 0) return;
  detail::gemm_cpu(p);
}

}  // namespace mxmla
