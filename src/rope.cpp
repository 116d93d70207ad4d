// mxmla — RoPE API: validation, table-row mapping, tables, positions, YaRN.
#include <algorithm>
#include <functional>
#include <utility>
#include <cmath>
#include <string>

#include "common/device.h"
#include "common/ops.h"
#include "common/rope_cuda.h"
#include "common/rope_ops.h"
#include "common/text.h"
#include "cpu/reference.h"
#include "mxmla/rope.h"

namespace mxmla {

namespace {

[[noreturn]] void fail(const char* op, const std::string& arg, const std::string& rule) { throw Error(op, arg, rule); }

bool is_float(DType t) { return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16; }

std::string dims(const std::vector<int64_t>& s) { return detail::shape_str(s); }

// [lowest, highest] byte touched by a strided tensor (for overlap checks).
std::pair<intptr_t, intptr_t> byte_extent(const TensorDesc& t) {
  intptr_t lo = reinterpret_cast<intptr_t>(t.data), hi = lo;
  const int64_t es = dtype_size(t.dtype);
  for (int64_t i = 0; i < t.ndim(); ++i) {
    const int64_t span = (t.shape[i] - 1) * t.stride(i) * es;
    (span < 0 ? lo : hi) += span;
  }
  return {lo, hi + es - 1};
}

// cu_seqlens as int64 values, checked: 1-D int32/int64 on the CPU, starts at 0, non-decreasing,
// ends at the number of tokens.
std::vector<int64_t> read_cu_seqlens(const char* op, const TensorDesc& cu, int64_t tokens) {
  if (cu.device.type != DeviceType::kCPU) fail(op, "cu_seqlens", "must be on the CPU");
  if (cu.dtype != DType::kInt32 && cu.dtype != DType::kInt64)
    fail(op, "cu_seqlens", std::string("dtype ") + dtype_name(cu.dtype) + " must be int32 or int64");
  if (cu.ndim() != 1 || cu.shape[0] < 2) fail(op, "cu_seqlens", "must be 1-D with at least 2 entries, got " + dims(cu.shape));
  if (cu.data == nullptr) fail(op, "cu_seqlens", "data pointer is null");
  std::vector<int64_t> v(cu.shape[0]);
  const int64_t st = cu.stride(0);
  for (int64_t i = 0; i < cu.shape[0]; ++i)
    v[i] = cu.dtype == DType::kInt64 ? static_cast<const int64_t*>(cu.data)[i * st]
                                     : static_cast<const int32_t*>(cu.data)[i * st];
  if (v[0] != 0) fail(op, "cu_seqlens", "must start at 0, got " + std::to_string(v[0]));
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] < v[i - 1]) fail(op, "cu_seqlens", "must be non-decreasing (entry " + std::to_string(i) + " is smaller)");
  if (v.back() != tokens)
    fail(op, "cu_seqlens", "last entry " + std::to_string(v.back()) + " is out of range: it must equal the number of tokens " +
                               std::to_string(tokens));
  return v;
}

// Validates and describes a RoPE call (out may be a caller-provided placeholder for the fused op).
detail::RopeProblem make_problem(const char* op, const TensorDesc& x, const TensorDesc& cos, const TensorDesc& sin,
                                 const TensorDesc& out, const RopeOptions& o, const TensorDesc* cu_seqlens,
                                 bool backward) {
  const char* xn = backward ? "grad" : "x";
  const char* on = backward ? "dx" : "out";
  const bool thd = o.layout == RopeLayout::kTHD;
  const int64_t want_nd = thd ? 3 : 4;
  if (x.ndim() != want_nd)
    fail(op, xn, std::string("must be ") + (thd ? "3-D [t, h, d]" : "4-D [s, b, h, d] or [b, s, h, d]") + ", got " +
                     dims(x.shape));
  for (const TensorDesc* t : {&x, &out, &cos, &sin})
    if (!t->strides.empty() && t->strides.size() != t->shape.size())
      fail(op, t == &x ? xn : t == &out ? on : t == &cos ? "cos" : "sin", "has strides that do not match its shape");
  if (!is_float(x.dtype)) fail(op, xn, std::string("dtype ") + dtype_name(x.dtype) + " is not supported");
  if (out.shape != x.shape) fail(op, on, "shape " + dims(out.shape) + " must be " + dims(x.shape));
  if (!is_float(out.dtype)) fail(op, on, std::string("dtype ") + dtype_name(out.dtype) + " is not supported");
  const int64_t D = x.shape.back();
  if (o.rope_dim <= 0 || o.rope_dim % 2 != 0)
    fail(op, "rope_dim", std::to_string(o.rope_dim) + " must be positive and even");
  if (o.rope_dim > D) fail(op, "rope_dim", std::to_string(o.rope_dim) + " exceeds the head dimension " + std::to_string(D));
  if (x.numel() > 0 && (x.data == nullptr || out.data == nullptr)) fail(op, x.data ? on : xn, "data pointer is null");
  if (out.data == x.data && x.numel() > 0) {
    bool same = out.dtype == x.dtype;
    for (int64_t i = 0; i < x.ndim(); ++i) same = same && out.stride(i) == x.stride(i);
    if (!same) fail(op, on, "aliases the input with another dtype or strides (in place needs both equal)");
  } else if (x.numel() > 0) {
    const auto a = byte_extent(x), b = byte_extent(out);
    if (a.first <= b.second && b.first <= a.second)
      fail(op, on, "overlaps the input without being the same tensor (in place must pass the input itself)");
  }
  for (const auto* t : {&cos, &sin}) {
    const char* n = t == &cos ? "cos" : "sin";
    if (t->ndim() != 2 || t->shape[1] != o.rope_dim)
      fail(op, n, "shape " + dims(t->shape) + " must be [T, rope_dim = " + std::to_string(o.rope_dim) + "]");
    if (t->dtype != DType::kFloat32 && t->dtype != DType::kBFloat16)
      fail(op, n, std::string("dtype ") + dtype_name(t->dtype) + " must be float32 or bfloat16");
    if (t->numel() > 0 && t->data == nullptr) fail(op, n, "data pointer is null");
  }
  if (sin.shape != cos.shape || sin.dtype != cos.dtype || sin.stride(0) != cos.stride(0) || sin.stride(1) != cos.stride(1))
    fail(op, "sin", "must match cos in shape, dtype and strides");
  for (const TensorDesc* t : {&x, static_cast<const TensorDesc*>(&out), &cos, &sin})
    if (t->device != x.device) fail(op, t == &cos ? "cos" : t == &sin ? "sin" : on, "is on another device than the input");

  detail::RopeProblem p;
  p.in = x.data, p.in_t = x.dtype, p.out = out.data, p.out_t = out.dtype;
  p.H = x.shape[want_nd - 2], p.D = D, p.rope_dim = o.rope_dim, p.style = o.style, p.backward = backward;
  p.cos = cos.data, p.sin = sin.data, p.tab_t = cos.dtype, p.tab_st[0] = cos.stride(0), p.tab_st[1] = cos.stride(1);
  const int64_t T = cos.shape[0];
  if (thd) {
    p.S = x.shape[0], p.B = 1;
    p.in_st[0] = x.stride(0), p.in_st[1] = 0, p.in_st[2] = x.stride(1), p.in_st[3] = x.stride(2);
    p.out_st[0] = out.stride(0), p.out_st[1] = 0, p.out_st[2] = out.stride(1), p.out_st[3] = out.stride(2);
  } else {
    const bool sbhd = o.layout == RopeLayout::kSBHD;
    p.S = x.shape[sbhd ? 0 : 1], p.B = x.shape[sbhd ? 1 : 0];
    const int sd = sbhd ? 0 : 1, bd = sbhd ? 1 : 0;
    p.in_st[0] = x.stride(sd), p.in_st[1] = x.stride(bd), p.in_st[2] = x.stride(2), p.in_st[3] = x.stride(3);
    p.out_st[0] = out.stride(sd), p.out_st[1] = out.stride(bd), p.out_st[2] = out.stride(2), p.out_st[3] = out.stride(3);
  }
  const int64_t tokens = p.S * p.B;
  const bool cpu = x.device.type == DeviceType::kCPU;
  p.row_of_token.resize(cpu ? tokens : 0);  // the CUDA kernel computes rows itself
  if (cu_seqlens != nullptr && !thd) fail(op, "cu_seqlens", "is only for the thd layout");
  if (o.tables_per_token) {
    if (cu_seqlens != nullptr) fail(op, "cu_seqlens", "cannot be combined with tables_per_token");
    if (T != tokens) fail(op, "cos", "has " + std::to_string(T) + " rows; tables_per_token needs one per token (" + std::to_string(tokens) + ")");
    const bool sbhd = o.layout != RopeLayout::kBSHD;  // thd: B == 1
    for (int64_t s = 0; cpu && s < p.S; ++s)
      for (int64_t b = 0; b < p.B; ++b) p.row_of_token[s * p.B + b] = sbhd ? s * p.B + b : b * p.S + s;
  } else if (thd && cu_seqlens != nullptr) {
    p.cu = read_cu_seqlens(op, *cu_seqlens, tokens);
    const std::vector<int64_t>& cu = p.cu;
    int64_t longest = 0;
    for (size_t i = 0; i + 1 < cu.size(); ++i) {
      longest = std::max(longest, cu[i + 1] - cu[i]);
      for (int64_t t = cu[i]; cpu && t < cu[i + 1]; ++t) p.row_of_token[t] = t - cu[i];
    }
    if (T < longest) fail(op, "cos", "has " + std::to_string(T) + " rows; the longest sequence needs " + std::to_string(longest));
  } else {
    if (T < p.S) fail(op, "cos", "has " + std::to_string(T) + " rows; " + std::to_string(p.S) + " positions are needed");
    for (int64_t s = 0; cpu && s < p.S; ++s)
      for (int64_t b = 0; b < p.B; ++b) p.row_of_token[s * p.B + b] = s;
  }
  return p;
}

#if MXMLA_WITH_CUDA
// The CUDA kernels' extra rules (vector access) for the input x (and out when given); the kernel
// parameters of the rope part.
detail::RopeKernelParams cuda_rope_params(const char* op, const char* xn, const char* on, const TensorDesc& x,
                                          const TensorDesc& cos, const TensorDesc& sin, const TensorDesc* out,
                                          const RopeOptions& o, const detail::RopeProblem& p) {
  if (out != nullptr && out->dtype != x.dtype) fail(op, on, "must have the input's dtype on the CUDA path");
  if (p.rope_dim % 16 != 0) fail(op, "rope_dim", "must be a multiple of 16 on the CUDA path");
  if ((p.D - p.rope_dim) % 8 != 0) fail(op, xn, "head dimension minus rope_dim must be a multiple of 8 on the CUDA path");
  if (p.D > (int64_t{1} << 28))  // the kernel's offsets within a head, byte counts included, are 32-bit numbers
    fail(op, xn, "head dimension " + std::to_string(p.D) + " is too large for the CUDA path (at most 2^28)");
  const int64_t es = dtype_size(x.dtype), ts = dtype_size(cos.dtype);
  for (const TensorDesc* t : {&x, out}) {
    if (t == nullptr) continue;
    const char* n = t == &x ? xn : on;
    if (t->stride(t->ndim() - 1) != 1) fail(op, n, "last dimension must be contiguous on the CUDA path");
    for (int64_t i = 0; i + 1 < t->ndim(); ++i)
      if ((t->stride(i) * es) % 16 != 0) fail(op, n, "strides must be multiples of 16 bytes on the CUDA path");
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) fail(op, n, "data pointer must be 16-byte aligned");
    detail::check_cuda_pointer(op, n, t->data, x.device.index);
  }
  for (const TensorDesc* t : {&cos, &sin}) {
    const char* n = t == &cos ? "cos" : "sin";
    if (t->stride(1) != 1 || (t->stride(0) * ts) % 16 != 0 || reinterpret_cast<uintptr_t>(t->data) % 16 != 0)
      fail(op, n, "rows must be contiguous, 16-byte aligned and 16-byte strided on the CUDA path");
    detail::check_cuda_pointer(op, n, t->data, x.device.index);
  }
  detail::RopeKernelParams k;
  k.in = x.data, k.out = out ? out->data : nullptr, k.cos = cos.data, k.sin = sin.data, k.io_t = x.dtype;
  k.tab_t = cos.dtype;
  k.S = p.S, k.B = p.B, k.H = p.H, k.D = p.D, k.R = p.rope_dim;
  for (int i = 0; i < 3; ++i) k.in_st[i] = p.in_st[i], k.out_st[i] = p.out_st[i];
  k.tab_row_stride = p.tab_st[0];
  k.sbhd = o.layout != RopeLayout::kBSHD, k.row_per_token = o.tables_per_token;
  k.copy_nope = out != nullptr && out->data != x.data;
  k.backward = p.backward, k.style = p.style;
  k.cu = p.cu.empty() ? nullptr : &p.cu;
  return k;
}
#endif

void run_rope(const char* op, const TensorDesc& x, const TensorDesc& cos, const TensorDesc& sin, TensorDesc& out,
              const RopeOptions& o, const TensorDesc* cu_seqlens, bool backward, Stream stream) {
  const detail::RopeProblem p = make_problem(op, x, cos, sin, out, o, cu_seqlens, backward);
  if (x.numel() == 0) return;
  if (x.device.type == DeviceType::kCPU) return detail::rope_cpu(p);
#if MXMLA_WITH_CUDA
  const detail::RopeKernelParams k =
      cuda_rope_params(op, backward ? "grad" : "x", backward ? "dx" : "out", x, cos, sin, &out, o, p);
  detail::CudaDeviceGuard guard(x.device.index);
  detail::rope_cuda(k, stream);
#else
  (void)stream;
  fail(op, backward ? "grad" : "x", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
}

}  // namespace

void apply_rope(const TensorDesc& x, const TensorDesc& cos, const TensorDesc& sin, TensorDesc& out,
                const RopeOptions& opts, const TensorDesc* cu_seqlens, Stream stream) {
  run_rope("mxmla.apply_rope", x, cos, sin, out, opts, cu_seqlens, false, stream);
}

void rope_backward(const TensorDesc& grad, const TensorDesc& cos, const TensorDesc& sin, TensorDesc& dx,
                   const RopeOptions& opts, const TensorDesc* cu_seqlens, Stream stream) {
  run_rope("mxmla.rope_backward", grad, cos, sin, dx, opts, cu_seqlens, true, stream);
}

namespace {
// rope_backward_quantize's checks of dq and the tables (op names the call): the RoPE problem
// (dx: its fp32 output on the CPU, sized here; on CUDA the kernel keeps dx on chip and dq stands in
// for the output that the shared validation expects).
detail::RopeProblem grad_problem(const char* op, const TensorDesc& dq, const TensorDesc& cos, const TensorDesc& sin,
                                 const RopeOptions& o, const TensorDesc* cu_seqlens, std::vector<float>& dx) {
  const bool on_cpu = dq.device.type == DeviceType::kCPU;
  dx.assign(static_cast<size_t>(on_cpu ? std::max<int64_t>(dq.numel(), 0) : 0), 0.f);
  const TensorDesc dxd = on_cpu ? TensorDesc(dx.data(), DType::kFloat32, dq.shape, dq.device) : dq;
  detail::RopeProblem p = make_problem(op, dq, cos, sin, dxd, o, cu_seqlens, true);
  if (p.D % 32 != 0) fail(op, "grad", "head dimension " + std::to_string(p.D) + " must be a multiple of 32");
#if MXMLA_WITH_CUDA
  if (!on_cpu && p.D > detail::kRopeQuantizeMaxHeadDim)
    fail(op, "grad", "head dimension " + std::to_string(p.D) + " exceeds " +
                         std::to_string(detail::kRopeQuantizeMaxHeadDim) + " on the CUDA path");
#endif
  return p;
}

// The CPU path: dx = R^T dq in fp32 (contiguous [tokens, h*d] in dq's token order), quantized by q
// (its outputs set).
void grad_quantize_cpu(detail::RopeProblem& p, const RopeOptions& o, std::vector<float>& dx, detail::QuantizeProblem& q) {
  const int64_t H = p.H, D = p.D;
  p.out = dx.data(), p.out_t = DType::kFloat32;
  // contiguous strides of dq's logical shape, mapped to (s, b, h, d)
  const bool bshd = o.layout == RopeLayout::kBSHD, thd = o.layout == RopeLayout::kTHD;
  p.out_st[3] = 1, p.out_st[2] = D;
  if (thd) p.out_st[0] = H * D, p.out_st[1] = 0;
  else if (bshd) p.out_st[0] = H * D, p.out_st[1] = p.S * H * D;
  else p.out_st[0] = p.B * H * D, p.out_st[1] = H * D;
  detail::rope_cpu(p);
  q.in = dx.data(), q.in_dtype = DType::kFloat32, q.row_stride = H * D;
  detail::quantize_cpu(q);
}
}  // namespace

void rope_backward_quantize(const TensorDesc& dq, const TensorDesc& cos, const TensorDesc& sin, MXFP8Tensor& out,
                            TensorDesc* dx_copy, const RopeBackwardQuantizeOptions& opts,
                            const TensorDesc* cu_seqlens, Stream stream) {
  const char* op = "mxmla.rope_backward_quantize";
  if (!opts.rowwise && !opts.columnwise) fail(op, "options", "at least one of rowwise / columnwise must be set");
  const bool on_cpu = dq.device.type == DeviceType::kCPU;
  std::vector<float> dx;
  detail::RopeProblem p = grad_problem(op, dq, cos, sin, opts.rope, cu_seqlens, dx);
  const int64_t H = p.H, D = p.D, T = p.S * p.B;
  if (dx_copy != nullptr) {
    if (dx_copy->shape != dq.shape || !dx_copy->is_contiguous() ||
        (dx_copy->dtype != DType::kBFloat16 && dx_copy->dtype != DType::kFloat32))
      fail(op, "dx_copy", "must be a contiguous bfloat16 or float32 tensor of shape " + dims(dq.shape));
    if (dq.numel() > 0 && dx_copy->data == nullptr) fail(op, "dx_copy", "data pointer is null");
    if (dx_copy->device != dq.device) fail(op, "dx_copy", "is on another device than the input");
  }
  QuantizeOptions qo;
  qo.rowwise = opts.rowwise, qo.columnwise = opts.columnwise, qo.format = opts.format, qo.swizzle = opts.swizzle;
  // data [tokens, h*d], scales of quantize_shapes (16-byte aligned codes on the GPU)
  detail::QuantizeProblem qp = detail::quantize_outputs(op, {T, H * D}, out, qo, dq.device);
  if (!on_cpu) {
#if MXMLA_WITH_CUDA
    if (dx_copy != nullptr && dq.numel() > 0) {
      if (reinterpret_cast<uintptr_t>(dx_copy->data) % 16 != 0) fail(op, "dx_copy", "data pointer must be 16-byte aligned");
      detail::check_cuda_pointer(op, "dx_copy", dx_copy->data, dq.device.index);
    }
    if (dq.numel() == 0) return;
    detail::RopeQuantizeParams k;
    k.rope = cuda_rope_params(op, "grad", "dx", dq, cos, sin, nullptr, opts.rope, p);
    k.fmt = opts.format, k.row_map = qp.row_map, k.col_map = qp.col_map;
    k.row_codes = qp.row_codes, k.row_scales = qp.row_scales, k.col_codes = qp.col_codes, k.col_scales = qp.col_scales;
    if (dx_copy != nullptr) k.dx = dx_copy->data, k.dx_t = dx_copy->dtype;
    detail::CudaDeviceGuard guard(dq.device.index);
    detail::rope_quantize_cuda(k, stream);
    return;
#else
    (void)stream;
    fail(op, "grad", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
  }
  if (dq.numel() == 0) return;
  grad_quantize_cpu(p, opts.rope, dx, qp);
  if (dx_copy != nullptr && dx_copy->dtype == DType::kFloat32)
    std::copy(dx.begin(), dx.end(), static_cast<float*>(dx_copy->data));
  else if (dx_copy != nullptr)
    for (size_t i = 0; i < dx.size(); ++i) static_cast<uint16_t*>(dx_copy->data)[i] = ref::float_to_bf16(dx[i]);
}

namespace detail {
void rope_grad_run(const char* op, const TensorDesc& dq, const TensorDesc& cos, const TensorDesc& sin,
                   const RopeOptions& o, const TensorDesc* cu_seqlens, QuantizeProblem* host,
                   const std::function<void(const RopeQuantizeParams&)>& cuda) {
  std::vector<float> dx;
  RopeProblem p = grad_problem(op, dq, cos, sin, o, cu_seqlens, dx);
  if (dq.device.type != DeviceType::kCPU) {
#if MXMLA_WITH_CUDA
    RopeQuantizeParams k;
    if (dq.numel() > 0) {
      k.rope = cuda_rope_params(op, "grad", "dx", dq, cos, sin, nullptr, o, p);
    } else {  // no tokens (or no heads): the GEMMs alone
      k.rope.S = p.S, k.rope.B = p.B, k.rope.H = p.H, k.rope.D = p.D, k.rope.R = p.rope_dim;
    }
    k.fmt = Fp8Format::kE4M3;
    cuda(k);
    return;
#else
    (void)cuda;
    fail(op, "grad", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
  }
  if (dq.numel() > 0) grad_quantize_cpu(p, o, dx, *host);
}
}  // namespace detail

// ---------------------------------------------------------------- tables
namespace {
double yarn_get_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }
// DeepSeek-V3 model.py: find_correction_dim
double correction_dim(double rotations, int64_t dim, double base, int64_t max_pos) {
  return dim * std::log(max_pos / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
}
}  // namespace

std::vector<double> rope_inv_freq(int64_t rope_dim, double base, const YarnParams& y) {
  const char* op = "mxmla.rope_inv_freq";
  if (rope_dim <= 0 || rope_dim % 2) fail(op, "rope_dim", std::to_string(rope_dim) + " must be positive and even");
  if (!(base > 1.0)) fail(op, "base", "must be > 1");
  const int64_t half = rope_dim / 2;
  std::vector<double> f(half);
  for (int64_t i = 0; i < half; ++i) f[i] = 1.0 / std::pow(base, static_cast<double>(2 * i) / rope_dim);
  if (!y.enabled) return f;
  if (!(y.factor >= 1.0)) fail(op, "yarn.factor", "must be >= 1");
  if (y.original_max_position <= 0) fail(op, "yarn.original_max_position", "must be positive");
  const double lo_d = std::floor(correction_dim(y.beta_fast, rope_dim, base, y.original_max_position));
  const double hi_d = std::ceil(correction_dim(y.beta_slow, rope_dim, base, y.original_max_position));
  const double low = std::max(lo_d, 0.0);
  double high = std::min(hi_d, static_cast<double>(rope_dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double smooth = 1.0 - ramp;
    f[i] = f[i] / y.factor * (1.0 - smooth) + f[i] * smooth;
  }
  return f;
}

void rope_tables(const std::vector<double>& positions, int64_t rope_dim, double base, const YarnParams& y,
                 RopeStyle style, TensorDesc& cos, TensorDesc& sin) {
  const char* op = "mxmla.rope_tables";
  const std::vector<double> f = rope_inv_freq(rope_dim, base, y);
  const std::vector<int64_t> want = {static_cast<int64_t>(positions.size()), rope_dim};
  for (auto* t : {&cos, &sin}) {
    const char* n = t == &cos ? "cos" : "sin";
    if (t->shape != want) fail(op, n, "shape " + dims(t->shape) + " must be " + dims(want));
    if (t->dtype != DType::kFloat32 && t->dtype != DType::kBFloat16) fail(op, n, "dtype must be float32 or bfloat16");
    if (t->device.type != DeviceType::kCPU) fail(op, n, "must be on the CPU (copy the small table to the GPU after)");
    if (!t->is_contiguous()) fail(op, n, "must be contiguous");
    if (!positions.empty() && t->data == nullptr) fail(op, n, "data pointer is null");
  }
  const double m = y.enabled ? yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim) : 1.0;
  const int64_t half = rope_dim / 2;
  for (size_t t = 0; t < positions.size(); ++t)
    for (int64_t j = 0; j < rope_dim; ++j) {
      // kInterleaved: angles [t0, t0, t1, t1, ...]; the others: [t0 .. t(h-1), t0 .. t(h-1)]
      const int64_t i = style == RopeStyle::kInterleaved ? j / 2 : j % half;
      const double a = positions[t] * f[i];
      ref::store_from_double(cos.data, cos.dtype, static_cast<int64_t>(t) * rope_dim + j, m * std::cos(a));
      ref::store_from_double(sin.data, sin.dtype, static_cast<int64_t>(t) * rope_dim + j, m * std::sin(a));
    }
}

double yarn_softmax_scale(int64_t head_dim, const YarnParams& y) {
  if (head_dim <= 0) fail("mxmla.yarn_softmax_scale", "head_dim", "must be positive");
  double s = 1.0 / std::sqrt(static_cast<double>(head_dim));
  if (y.enabled) {
    const double m = yarn_get_mscale(y.factor, y.mscale_all_dim);
    s *= m * m;
  }
  return s;
}

// ---------------------------------------------------------------- positions
std::vector<double> positions_arange(int64_t n, int64_t offset) {
  if (n < 0) fail("mxmla.positions_arange", "n", "must be >= 0");
  std::vector<double> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<double>(offset + i);
  return p;
}

std::vector<double> positions_from_cu_seqlens(const std::vector<int64_t>& cu) {
  const char* op = "mxmla.positions_from_cu_seqlens";
  if (cu.size() < 2 || cu[0] != 0) fail(op, "cu_seqlens", "must start at 0 and have at least 2 entries");
  std::vector<double> p;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    if (cu[i + 1] < cu[i]) fail(op, "cu_seqlens", "must be non-decreasing (entry " + std::to_string(i + 1) + ")");
    for (int64_t t = cu[i]; t < cu[i + 1]; ++t) p.push_back(static_cast<double>(t - cu[i]));
  }
  return p;
}

std::vector<double> positions_context_parallel(int64_t L, int64_t cp, int64_t r) {
  const char* op = "mxmla.positions_context_parallel";
  if (L <= 0 || L % 2) fail(op, "local_len", std::to_string(L) + " must be positive and even");
  if (cp <= 0) fail(op, "cp_size", "must be positive");
  if (r < 0 || r >= cp) fail(op, "cp_rank", std::to_string(r) + " must be in [0, cp_size)");
  std::vector<double> p(L);
  for (int64_t s = 0; s < L; ++s)
    p[s] = static_cast<double>(s < L / 2 ? s + r * L / 2 : s + L * cp - (r + 1) * L / 2 - L / 2);
  return p;
}

}  // namespace mxmla
