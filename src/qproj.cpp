// mxmla — the fused Q up-projection API: validation and dispatch (CPU reference or SM90 kernel).
#include <string>
#include <utility>

#include "common/blockfp8_ops.h"
#include "common/device.h"
#include "common/gemm_ops.h"
#include "common/ops.h"
#include "common/qproj_ops.h"
#include "common/text.h"
#include "mxmla/blockfp8.h"
#include "mxmla/qproj.h"

namespace mxmla {

namespace {

constexpr const char* kOp = "mxmla.fused_q_uproj_rope_quant";

[[noreturn]] void fail(const std::string& arg, const std::string& rule) { throw Error(kOp, arg, rule); }

int64_t head_dim(const QProjOptions& o) {
  if (o.nope_dim < 0) fail("nope_dim", std::to_string(o.nope_dim) + " must not be negative");
  if (o.rope_dim <= 0 || o.rope_dim % 2 != 0) fail("rope_dim", std::to_string(o.rope_dim) + " must be positive and even");
  const int64_t D = o.nope_dim + o.rope_dim;
  if (D % 32 != 0) fail("nope_dim", "nope_dim + rope_dim = " + std::to_string(D) + " must be a multiple of 32 (MXFP8 blocks)");
  return D;
}

void check_2d(const std::string& arg, const TensorDesc& t) {
  if (t.ndim() != 2) fail(arg, "must be 2-D, got shape " + detail::shape_str(t.shape));
  if (!t.strides.empty() && t.strides.size() != 2) fail(arg, "has strides that do not match its shape");
  if (t.shape[0] < 0 || t.shape[1] < 0) fail(arg, "shape " + detail::shape_str(t.shape) + " has a negative size");
  if (t.stride(1) != 1) fail(arg, "last dimension must be contiguous (stride 1)");
  if (t.numel() > 0 && t.data == nullptr) fail(arg, "data pointer is null");
}

}  // namespace

std::vector<int64_t> qproj_q_shape(int64_t tokens, int64_t num_heads, const QProjOptions& o) {
  const int64_t D = head_dim(o);
  if (o.batch < 1) fail("batch", std::to_string(o.batch) + " must be at least 1");
  if (tokens < 0 || tokens % o.batch != 0)
    fail("x", std::to_string(tokens) + " tokens do not split into batch = " + std::to_string(o.batch) + " sequences");
  if (num_heads < 1) fail("w", "must hold at least one head");
  const int64_t S = tokens / o.batch;
  return o.layout == QKVLayout::kSBHD ? std::vector<int64_t>{S, o.batch, num_heads, D}
                                      : std::vector<int64_t>{o.batch, S, num_heads, D};
}

MXFP8Shapes qproj_shapes(int64_t tokens, int64_t num_heads, const QProjOptions& o) {
  return attention_shapes(qproj_q_shape(tokens, num_heads, o), o.layout, o.bhsd_scales);
}

namespace {

// The options' own rules, checked first by both front ends; returns the head dim.
int64_t check_options(const QProjOptions& o) {
  if (!o.rowwise && !o.columnwise) fail("options", "at least one of rowwise / columnwise must be set");
  return head_dim(o);
}

// What both front ends check and fill after the options: head geometry, tables, q, the outputs;
// x's T tokens of K values and W's N rows on device `dev` (x, w and the CUDA-only rules are the
// callers').
detail::QProjProblem common_problem(int64_t T, int64_t K, int64_t N, const Device& dev, const TensorDesc& cos,
                                    const TensorDesc& sin, MXFP8Tensor& out, TensorDesc* q, const QProjOptions& o) {
  const int64_t D = head_dim(o);
  if (N < D || N % D != 0)
    fail("w", "N = " + std::to_string(N) + " must be a positive multiple of the head dim " + std::to_string(D));
  const int64_t NH = N / D;
  // the SM90 kernel's tile coordinates into x and W (K, and W's row h·d_head) are 32-bit numbers
  // (checked before the outputs' pointers are)
  if (dev.type == DeviceType::kCUDA && N > detail::kMaxCudaExtent)
    fail("w", "N = " + std::to_string(N) + " rows: the SM90 kernel takes at most 2^31 - 256 (32-bit tile coordinates)");
  if (dev.type == DeviceType::kCUDA && K > detail::kMaxCudaExtent)
    fail("x", "K = " + std::to_string(K) + ": the SM90 kernel takes at most 2^31 - 256 (32-bit tile coordinates)");
  const std::vector<int64_t> qshape = qproj_q_shape(T, NH, o);
  const int64_t S = T / o.batch;
  for (const TensorDesc* t : {&cos, &sin}) {
    const char* n = t == &cos ? "cos" : "sin";
    check_2d(n, *t);
    if (t->shape[1] != o.rope_dim)
      fail(n, "shape " + detail::shape_str(t->shape) + " must be [>= s, rope_dim = " + std::to_string(o.rope_dim) + "]");
    if (t->shape[0] < S) fail(n, "has " + std::to_string(t->shape[0]) + " rows; " + std::to_string(S) + " positions are needed");
    if (t->dtype != DType::kFloat32 && t->dtype != DType::kBFloat16)
      fail(n, std::string("dtype ") + dtype_name(t->dtype) + " must be float32 or bfloat16");
    if (t->device != dev) fail(n, "is on another device than x");
  }
  if (sin.shape != cos.shape || sin.dtype != cos.dtype || sin.stride(0) != cos.stride(0))
    fail("sin", "must match cos in shape, dtype and strides");
  if (q != nullptr) {
    if (q->shape != qshape) fail("q", "shape " + detail::shape_str(q->shape) + " must be " + detail::shape_str(qshape));
    if (q->dtype != DType::kBFloat16) fail("q", std::string("dtype ") + dtype_name(q->dtype) + " must be bfloat16");
    if (!q->is_contiguous()) fail("q", "must be contiguous");
    if (q->numel() > 0 && q->data == nullptr) fail("q", "data pointer is null");
    if (q->device != dev) fail("q", "is on another device than x");
  }
  AttentionQuantizeOptions ao;
  ao.layout = o.layout, ao.rowwise = o.rowwise, ao.columnwise = o.columnwise, ao.format = o.format;
  ao.bhsd_scales = o.bhsd_scales;
  const detail::QuantizeProblem qp = detail::attention_outputs(kOp, qshape, out, ao, dev);

  detail::QProjProblem p;
  p.B = o.batch, p.S = S, p.K = K;
  p.NH = NH, p.D = D, p.R = o.rope_dim;
  p.cos = cos.data, p.sin = sin.data, p.tab_t = cos.dtype, p.tab_st = cos.stride(0);
  p.style = o.style, p.sbhd = o.layout == QKVLayout::kSBHD, p.fmt = o.format;
  p.row_codes = qp.row_codes, p.row_scales = qp.row_scales, p.col_codes = qp.col_codes, p.col_scales = qp.col_scales;
  p.row_map = qp.row_map, p.col_map = qp.col_map;
  p.q = q != nullptr ? static_cast<uint16_t*>(q->data) : nullptr;
  return p;
}

#if MXMLA_WITH_CUDA
// The CUDA path's rules beyond x and W: the kernel's head dims, tile indices, 16-byte table rows,
// the output pointers' alignment and device.
void check_cuda(const detail::QProjProblem& p, const TensorDesc& cos, const TensorDesc& sin, const MXFP8Tensor& out,
                const TensorDesc* q, const QProjOptions& o, int device) {
  if (!detail::qproj_cuda_supports(p.D, o.rope_dim))
    fail("nope_dim", "the SM90 kernel is built for heads of nope 128 + rope 64 (got nope " + std::to_string(o.nope_dim) +
                         ", rope " + std::to_string(o.rope_dim) + "); use CPU tensors for the reference");
  const int64_t T = p.B * p.S;
  if (T >= (int64_t{1} << 31) || (p.S + 127) / 128 * p.B * p.NH >= (int64_t{1} << 31))
    fail("x", "has too many tokens x heads for the kernel's 32-bit tile indices");
  for (const TensorDesc* t : {&cos, &sin}) {
    const char* n = t == &cos ? "cos" : "sin";
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0 || (t->stride(0) * dtype_size(t->dtype)) % 16 != 0)
      fail(n, "rows must be 16-byte aligned and 16-byte strided on the CUDA path");
    detail::check_cuda_pointer(kOp, n, t->data, device);
  }
  if (o.columnwise && reinterpret_cast<uintptr_t>(out.columnwise_scale_inv.data) % 4 != 0)
    fail("columnwise_scale_inv", "data pointer must be 4-byte aligned on the CUDA path");
  if (q != nullptr) {
    if (reinterpret_cast<uintptr_t>(q->data) % 16 != 0) fail("q", "data pointer must be 16-byte aligned");
    detail::check_cuda_pointer(kOp, "q", q->data, device);
  }
}
#endif

}  // namespace

void fused_q_uproj_rope_quant(const TensorDesc& x, const TensorDesc& w, const TensorDesc& cos, const TensorDesc& sin,
                              MXFP8Tensor& out, TensorDesc* q, const QProjOptions& o, Stream stream) {
  check_options(o);
  check_2d("x", x);
  check_2d("w", w);
  if (x.dtype != DType::kBFloat16) fail("x", std::string("dtype ") + dtype_name(x.dtype) + " must be bfloat16");
  if (w.dtype != DType::kBFloat16) fail("w", std::string("dtype ") + dtype_name(w.dtype) + " must be bfloat16");
  const int64_t T = x.shape[0], K = x.shape[1];
  if (K < 1) fail("x", "needs K >= 1 columns");
  const bool kn = o.weight_layout == WeightLayout::kKN;
  const int64_t wK = kn ? w.shape[0] : w.shape[1], N = kn ? w.shape[1] : w.shape[0];
  if (wK != K)
    fail("w", "shape " + detail::shape_str(w.shape) + " does not match K = " + std::to_string(K) + " of x (layout " +
                  (kn ? "[K, N]" : "[N, K]") + ")");
  if (w.device != x.device) fail("w", "is on another device than x");
  detail::QProjProblem p = common_problem(T, K, N, x.device, cos, sin, out, q, o);
  p.x = x.data;
  const int64_t xr = x.stride(0);
  p.x_st_s = o.layout == QKVLayout::kSBHD ? o.batch * xr : xr;
  p.x_st_b = o.layout == QKVLayout::kSBHD ? xr : p.S * xr;
  p.w = w.data, p.w_st = w.stride(0), p.w_kn = kn;
  if (T == 0) return;
  if (x.device.type == DeviceType::kCPU) return detail::qproj_cpu(p);

#if MXMLA_WITH_CUDA
  check_cuda(p, cos, sin, out, q, o, x.device.index);
  if (K % 8 != 0) fail("x", "K = " + std::to_string(K) + " must be a multiple of 8 on the CUDA path (TMA: 16-byte rows)");
  for (const TensorDesc* t : {&x, &w}) {
    const char* n = t == &x ? "x" : "w";
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) fail(n, "data pointer must be 16-byte aligned (TMA)");
    if ((t->stride(0) * 2) % 16 != 0 || t->stride(0) * 2 >= (int64_t{1} << 40))
      fail(n, "row stride must be a multiple of 16 bytes below 2^40 (TMA)");
    detail::check_cuda_pointer(kOp, n, t->data, x.device.index);
  }
  if (p.x_st_b * 2 >= (int64_t{1} << 40) || p.x_st_s * 2 >= (int64_t{1} << 40)) fail("x", "is too large for a TMA descriptor");
  detail::CudaDeviceGuard guard(x.device.index);
  detail::qproj_cuda(p, stream);
#else
  (void)stream;
  fail("x", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
}

void fused_q_uproj_rope_quant(const MXFP8Tensor& x, const MXFP8Tensor& w, const TensorDesc& cos,
                              const TensorDesc& sin, MXFP8Tensor& out, TensorDesc* q, const QProjOptions& o,
                              Stream stream) {
  check_options(o);
  if (o.weight_layout != WeightLayout::kNK)
    fail("weight_layout", "an MXFP8 w is [N, K] with its blocks along K: weight_layout must be nk");
  detail::GemmProblem g;
  g.fp8 = true;
  g.a = detail::gemm_rowwise_operand(kOp, "x", x);
  g.b = detail::gemm_rowwise_operand(kOp, "w", w);
  if (w.format != x.format)
    fail("w", std::string("FP8 format ") + (w.format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") + " differs from x's " +
                  (x.format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") + ": both must share one format");
  g.fmt = x.format;
  g.M = g.a.rows, g.N = g.b.rows, g.K = g.a.cols;
  if (g.b.cols != g.K)
    fail("w", "shape " + detail::shape_str(w.shape) + " does not match K = " + std::to_string(g.K) + " of x ([N, K])");
  const Device dev = x.rowwise_data.device;
  const std::pair<const char*, const TensorDesc*> bufs[] = {{"x.rowwise_data", &x.rowwise_data},
                                                            {"x.rowwise_scale_inv", &x.rowwise_scale_inv},
                                                            {"w.rowwise_data", &w.rowwise_data},
                                                            {"w.rowwise_scale_inv", &w.rowwise_scale_inv}};
  for (const auto& [name, t] : bufs)
    if (t->device != dev) fail(name, "is on another device than x.rowwise_data");
  detail::QProjProblem p = common_problem(g.M, g.K, g.N, dev, cos, sin, out, q, o);
  if (g.M == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::qproj_mxfp8_cpu(p, g);

#if MXMLA_WITH_CUDA
  check_cuda(p, cos, sin, out, q, o, dev.index);
  for (const auto& [name, t] : bufs) detail::check_cuda_pointer(kOp, name, t->data, dev.index);
  detail::CudaDeviceGuard guard(dev.index);
  detail::qproj_mxfp8_cuda(p, g, stream);
#else
  (void)stream;
  fail("x", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
}

namespace {
// A block-FP8 operand of the fused op: 2-D codes [rows, K] (E4M3 / uint8, innermost stride 1) and
// fp32 scale_inv of block_scale_shape; returns the scales' row stride.
int64_t check_block_operand(const char* arg, const BlockFP8Tensor& t, int64_t block_rows) {
  const std::string a(arg);
  if (t.block_rows != block_rows)
    fail(a + ".block_rows", std::to_string(t.block_rows) + " must be " + std::to_string(block_rows) + " (" +
                                (block_rows == 1 ? "x: 1 x 128 blocks" : "w: 128 x 128 blocks") + ")");
  check_2d(a + ".data", t.data);
  if (t.data.dtype != DType::kFloat8E4M3 && t.data.dtype != DType::kUInt8)
    fail(a + ".data", std::string("dtype ") + dtype_name(t.data.dtype) + " must be float8_e4m3fn (or uint8)");
  const std::vector<int64_t> ss = block_scale_shape(t.data.shape[0], t.data.shape[1], block_rows);
  const int64_t st = detail::block_scale_stride(kOp, a + ".scale_inv", t.scale_inv, ss);
  if (t.scale_inv.device != t.data.device) fail(a + ".scale_inv", "is on another device than " + a + ".data");
  return st;
}
}  // namespace

void fused_q_uproj_rope_quant(const BlockFP8Tensor& x, const BlockFP8Tensor& w, const TensorDesc& cos,
                              const TensorDesc& sin, MXFP8Tensor& out, TensorDesc* q, const QProjOptions& o,
                              Stream stream) {
  check_options(o);
  if (o.weight_layout != WeightLayout::kNK)
    fail("weight_layout", "a block-FP8 w is [N, K] (128 x 128 blocks): weight_layout must be nk");
  detail::BlockFp8Operands bo;
  bo.sx_ld = check_block_operand("x", x, 1);
  bo.sw_ld = check_block_operand("w", w, 128);
  bo.sx = static_cast<const float*>(x.scale_inv.data), bo.sw = static_cast<const float*>(w.scale_inv.data);
  const int64_t T = x.data.shape[0], K = x.data.shape[1];
  if (K < 1) fail("x", "needs K >= 1 columns");
  if (w.data.shape[1] != K)
    fail("w", "shape " + detail::shape_str(w.data.shape) + " does not match K = " + std::to_string(K) + " of x ([N, K])");
  const Device dev = x.data.device;
  if (w.data.device != dev) fail("w.data", "is on another device than x.data");
  detail::QProjProblem p = common_problem(T, K, w.data.shape[0], dev, cos, sin, out, q, o);
  p.x = x.data.data;
  const int64_t xr = x.data.stride(0);
  p.x_st_s = o.layout == QKVLayout::kSBHD ? o.batch * xr : xr;
  p.x_st_b = o.layout == QKVLayout::kSBHD ? xr : p.S * xr;
  p.w = w.data.data, p.w_st = w.data.stride(0), p.w_kn = false;
  if (T == 0) return;
  if (dev.type == DeviceType::kCPU) return detail::qproj_block_fp8_cpu(p, bo);

#if MXMLA_WITH_CUDA
  check_cuda(p, cos, sin, out, q, o, dev.index);
  if (o.format != Fp8Format::kE4M3) fail("fp8_format", "the block-FP8 CUDA path writes E4M3 q (got e5m2)");
  if (K % 16 != 0) fail("x", "K = " + std::to_string(K) + " must be a multiple of 16 on the CUDA path (TMA: 16-byte rows)");
  const std::pair<const char*, const BlockFP8Tensor*> ops[] = {{"x", &x}, {"w", &w}};
  for (const auto& [n, t] : ops) {
    const std::string d = std::string(n) + ".data";
    if (reinterpret_cast<uintptr_t>(t->data.data) % 16 != 0) fail(d, "data pointer must be 16-byte aligned (TMA)");
    if (t->data.stride(0) % 16 != 0 || t->data.stride(0) >= (int64_t{1} << 40))
      fail(d, "row stride must be a multiple of 16 bytes below 2^40 (TMA)");
    detail::check_cuda_pointer(kOp, d.c_str(), t->data.data, dev.index);
    detail::check_cuda_pointer(kOp, (std::string(n) + ".scale_inv").c_str(), t->scale_inv.data, dev.index);
  }
  if (p.x_st_b >= (int64_t{1} << 40) || p.x_st_s >= (int64_t{1} << 40)) fail("x", "is too large for a TMA descriptor");
  if (T * bo.sx_ld >= (int64_t{1} << 31)) fail("x.scale_inv", "is too large for the kernel's 32-bit offsets");
  if (((w.data.shape[0] + 127) / 128) * bo.sw_ld >= (int64_t{1} << 31))
    fail("w.scale_inv", "is too large for the kernel's 32-bit offsets");
  detail::CudaDeviceGuard guard(dev.index);
  detail::qproj_block_fp8_cuda(p, bo, stream);
#else
  (void)stream;
  fail("x", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
}

}  // namespace mxmla
