// mxmla — the MXFP8 Linear's GEMMs with fused operand quantization (include/mxmla/linear.h):
// validation, then the CPU reference (quantize + the GEMM reference, the composition itself) or the
// CUDA path (src/cuda/sm90_mxfp8_gemm.cu, linear_forward_cuda / linear_backward_cuda).
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "common/device.h"
#include "common/gemm_ops.h"
#include "common/ops.h"
#include "common/rope_ops.h"
#include "common/text.h"
#include "mxmla/linear.h"

namespace mxmla {

namespace {

using detail::MapMode;
using detail::shape_str;

struct LinearCheck {
  const char* op;
  [[noreturn]] void fail(const std::string& arg, const std::string& rule) const { throw Error(op, arg, rule); }

  // A matrix [rows, cols] whose rows do not overlap.
  void matrix(const std::string& arg, const TensorDesc& t, const std::string& what) const {
    detail::check_matrix(op, arg, t, what);
    if (t.shape[0] > 1 && t.shape[1] > 0 && t.stride(0) < t.shape[1])
      fail(arg, "row stride " + std::to_string(t.stride(0)) + " is smaller than its row length " +
                    std::to_string(t.shape[1]) + " (rows would overlap)");
  }
  int64_t row_stride(const TensorDesc& t) const { return t.shape[0] > 1 ? t.stride(0) : t.shape[1]; }
  // x or dy: bf16 [T, C], C a positive multiple of 32 (its rowwise blocks)
  void input(const std::string& arg, const TensorDesc& t, const char* C) const {
    if (t.dtype != DType::kBFloat16) fail(arg, std::string("dtype ") + dtype_name(t.dtype) + " must be bfloat16");
    matrix(arg, t, std::string("[T, ") + C + "]");
    if (t.shape[1] <= 0 || t.shape[1] % 32 != 0)
      fail(arg, "last dimension " + std::to_string(t.shape[1]) + " (" + C + ") must be a positive multiple of 32 (the "
                "rowwise MXFP8 blocks)");
    if (t.device.type == DeviceType::kCUDA && t.numel() > 0) {
      if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) fail(arg, "data must be 16-byte aligned for the CUDA kernels");
      if ((row_stride(t) * 2) % 16 != 0) fail(arg, "row stride must be a multiple of 16 bytes for the CUDA kernels");
    }
  }
  void output(const std::string& arg, const TensorDesc& t, const std::vector<int64_t>& shape, bool fp32_ok,
              bool accumulate) const {
    matrix(arg, t, shape_str(shape));
    if (t.shape != shape) fail(arg, "shape " + shape_str(t.shape) + " must be " + shape_str(shape));
    if (t.dtype != DType::kBFloat16 && !(fp32_ok && t.dtype == DType::kFloat32))
      fail(arg, std::string("dtype ") + dtype_name(t.dtype) + (fp32_ok ? " must be float32 or bfloat16" : " must be bfloat16"));
    if (accumulate && t.dtype != DType::kFloat32)
      fail(arg, std::string("dtype ") + dtype_name(t.dtype) + " must be float32 with accumulate (the wgrad is added "
                "into an fp32 buffer)");
  }
  void e4m3(const std::string& arg, const MXFP8Tensor& t) const {
    if (t.format != Fp8Format::kE4M3)
      fail(arg, "FP8 format e5m2 must be e4m3: the Linear quantizes x and dy to E4M3, and a GEMM's operands share one "
                "format");
  }
  // Every named tensor (null: none to check) on `ref`'s device (ref first); on CUDA, each pointer
  // device memory of it.
  void one_device(std::initializer_list<std::pair<const char*, const TensorDesc*>> ts) const {
    const auto& [ref, rt] = *ts.begin();
    for (const auto& [name, t] : ts)
      if (t != nullptr && t->device != rt->device)
        fail(name, "is on " + detail::device_str(t->device) + " but " + ref + " is on " +
                       detail::device_str(rt->device) + ": every tensor must be on one device");
    if (rt->device.type == DeviceType::kCUDA)
      for (const auto& [name, t] : ts)
        if (t != nullptr) detail::check_cuda_pointer(op, name, t->data, rt->device.index);
  }
};

detail::GemmProblem gemm_of(int64_t M, int64_t N, int64_t K, const detail::GemmOperandView& b, TensorDesc& out,
                            bool accumulate) {
  detail::GemmProblem g;
  g.M = M, g.N = N, g.K = K, g.fp8 = true, g.fmt = Fp8Format::kE4M3;
  g.b = b;
  g.out = out.data, g.out_t = out.dtype, g.ld_out = M > 1 ? out.stride(0) : N;
  g.accumulate = accumulate;
  return g;
}

// The CPU reference's operand: one direction of quantize(t) in host buffers.
struct HostOperand {
  std::vector<uint8_t> codes, scales;
  detail::GemmOperandView view;
};
HostOperand host_quantize(detail::QuantizeProblem q, bool rowwise) {
  HostOperand h;
  const int64_t T = q.rows, C = q.cols;
  h.codes.resize(static_cast<size_t>(T * C));
  const detail::ScaleMap map = rowwise ? detail::make_row_map(MapMode::kCompact, 1, T, C)
                                       : detail::make_col_map(MapMode::kCompact, 1, T, C);
  h.scales.resize(static_cast<size_t>(rowwise ? T * (C / 32) : detail::ceil_div(T, 32) * C));
  q.row_codes = rowwise ? h.codes.data() : nullptr, q.row_scales = rowwise ? h.scales.data() : nullptr;
  q.col_codes = rowwise ? nullptr : h.codes.data(), q.col_scales = rowwise ? nullptr : h.scales.data();
  if (rowwise) q.row_map = map;
  else q.col_map = map;
  if (T > 0) detail::quantize_cpu(q);
  h.view.data = h.codes.data(), h.view.rows = T, h.view.cols = C, h.view.ld = C, h.view.contract_cols = rowwise;
  h.view.scales = h.scales.data(), h.view.map = map;
  return h;
}

}  // namespace

void linear_forward(const TensorDesc& x, const MXFP8Tensor& w, TensorDesc& y, MXFP8Tensor& x_saved, Stream stream) {
  const LinearCheck c{"mxmla.linear_forward"};
  c.input("x", x, "K");
  const int64_t T = x.shape[0], K = x.shape[1];
  const detail::GemmOperandView wv = detail::gemm_operand(c.op, "w", w, true);  // W [N, K], rowwise
  c.e4m3("w", w);
  if (wv.cols != K)
    c.fail("w", "shape " + shape_str(w.shape) + " must be [N, K] with K = " + std::to_string(K) + " (x's last dim)");
  const int64_t N = wv.rows;
  c.output("y", y, {T, N}, false, false);
  const Device dev = x.device;
  QuantizeOptions o;
  o.rowwise = false, o.columnwise = true, o.format = Fp8Format::kE4M3, o.swizzle = false;
  detail::QuantizeProblem q = detail::quantize_outputs(c.op, x.shape, x_saved, o, dev);  // checks x_saved
  c.one_device({{"x", &x}, {"w.rowwise_data", &w.rowwise_data}, {"w.rowwise_scale_inv", &w.rowwise_scale_inv},
                {"y", &y}, {"x_saved.columnwise_data", &x_saved.columnwise_data},
                {"x_saved.columnwise_scale_inv", &x_saved.columnwise_scale_inv}});
  q.in = x.data, q.in_dtype = DType::kBFloat16, q.batch_stride = 0, q.row_stride = c.row_stride(x);
  detail::GemmProblem g = gemm_of(T, N, K, wv, y, false);
  if (dev.type == DeviceType::kCUDA) {
    detail::CudaDeviceGuard guard(dev.index);
    detail::linear_forward_cuda(q, g, stream);
    return;
  }
  if (T > 0) detail::quantize_cpu(q);  // x_saved
  const HostOperand xr = host_quantize(q, true);
  g.a = xr.view;
  if (T > 0 && N > 0) detail::gemm_cpu(g);
}

namespace {
// linear_backward's checks and GEMM problems for dy [T, N] (`dy`: the tensor the device checks name,
// as `dy_name`), then on CUDA cuda(dgrad or null, wgrad), on the CPU the GEMM reference on host(need
// the rowwise operand)'s (rowwise, columnwise) operands of dy.
template <class Cuda, class Host>
void linear_backward_with(const LinearCheck& c, int64_t T, int64_t N, const TensorDesc& dy, const char* dy_name,
                          const MXFP8Tensor& w, const MXFP8Tensor& x_saved, TensorDesc* dx, TensorDesc& dw,
                          bool accumulate, Cuda&& cuda, Host&& host) {
  const detail::GemmOperandView wv = detail::gemm_operand(c.op, "w", w, false);         // W [N, K], columnwise
  const detail::GemmOperandView xv = detail::gemm_operand(c.op, "x_saved", x_saved, false);  // x [T, K], columnwise
  c.e4m3("w", w);
  c.e4m3("x_saved", x_saved);
  if (wv.rows != N)
    c.fail("w", "shape " + shape_str(w.shape) + " must be [N, K] with N = " + std::to_string(N) + " (" +
                    (std::string(dy_name) == "dy" ? "dy's last dim" : "h·d of dq") + ")");
  const int64_t K = wv.cols;
  if (xv.rows != T || xv.cols != K)
    c.fail("x_saved", "shape " + shape_str(x_saved.shape) + " must be [T, K] = " + shape_str({T, K}) + " (" +
                          (std::string(dy_name) == "dy" ? "dy" : "dq") + "'s tokens, w's in_features)");
  if (dx != nullptr) c.output("dx", *dx, {T, K}, false, false);
  c.output("dw", dw, {N, K}, true, accumulate);
  const Device dev = dy.device;
  c.one_device({{dy_name, &dy}, {"w.columnwise_data", &w.columnwise_data},
                {"w.columnwise_scale_inv", &w.columnwise_scale_inv}, {"x_saved.columnwise_data", &x_saved.columnwise_data},
                {"x_saved.columnwise_scale_inv", &x_saved.columnwise_scale_inv}, {"dx", dx}, {"dw", &dw}});
  detail::GemmProblem dgrad;
  if (dx != nullptr) dgrad = gemm_of(T, K, N, wv, *dx, false);
  detail::GemmProblem wgrad = gemm_of(N, K, T, xv, dw, accumulate);
  if (dev.type == DeviceType::kCUDA) {
    detail::CudaDeviceGuard guard(dev.index);
    cuda(dx != nullptr ? &dgrad : nullptr, wgrad);
    return;
  }
  const bool need_row = dx != nullptr && T > 0 && K > 0;
  const std::pair<HostOperand, HostOperand> ops = host(need_row);
  if (need_row) {
    dgrad.a = ops.first.view;
    detail::gemm_cpu(dgrad);
  }
  wgrad.a = ops.second.view;
  if (N > 0 && K > 0) detail::gemm_cpu(wgrad);
}

// linear_backward on dy's quantize problem q (its input set; T = q.rows, N = q.cols).
void linear_backward_q(const LinearCheck& c, detail::QuantizeProblem q, const TensorDesc& dy, const MXFP8Tensor& w,
                       const MXFP8Tensor& x_saved, TensorDesc* dx, TensorDesc& dw, bool accumulate, Stream stream) {
  const int64_t T = q.rows, N = q.cols;
  q.fmt = Fp8Format::kE4M3, q.batch = 1;
  q.row_map = detail::make_row_map(MapMode::kCompact, 1, T, N);
  q.col_map = detail::make_col_map(MapMode::kCompact, 1, T, N);
  linear_backward_with(
      c, T, N, dy, "dy", w, x_saved, dx, dw, accumulate,
      [&](const detail::GemmProblem* dgrad, const detail::GemmProblem& wgrad) {
        detail::linear_backward_cuda(q, dgrad, wgrad, stream);
      },
      [&](bool need_row) {
        return std::make_pair(need_row ? host_quantize(q, true) : HostOperand{}, host_quantize(q, false));
      });
}
}  // namespace

void linear_backward(const TensorDesc& dy, const MXFP8Tensor& w, const MXFP8Tensor& x_saved, TensorDesc* dx,
                     TensorDesc& dw, bool accumulate, Stream stream) {
  const LinearCheck c{"mxmla.linear_backward"};
  c.input("dy", dy, "N");
  detail::QuantizeProblem q;
  q.in = dy.data, q.in_dtype = DType::kBFloat16;
  q.rows = dy.shape[0], q.cols = dy.shape[1], q.batch_stride = 0, q.row_stride = c.row_stride(dy);
  linear_backward_q(c, q, dy, w, x_saved, dx, dw, accumulate, stream);
}

void linear_backward(const ConcatInput& dy, const MXFP8Tensor& w, const MXFP8Tensor& x_saved, TensorDesc* dx,
                     TensorDesc& dw, bool accumulate, Stream stream) {
  const LinearCheck c{"mxmla.linear_backward"};
  for (const auto& [a, t] : {std::pair<const char*, const TensorDesc*>{"dy.part0", &dy.part0}, {"dy.part1", &dy.part1}})
    if (t->dtype != DType::kBFloat16) c.fail(a, std::string("dtype ") + dtype_name(t->dtype) + " must be bfloat16");
  const std::vector<int64_t> shape = detail::check_concat(c.op, "dy", dy, 3, "[T, h, d]");
  const int64_t T = shape[0], H = shape[1], D = shape[2];
  if (H * D >= (int64_t{1} << 31)) c.fail("dy", "N = h·d = " + std::to_string(H * D) + " is too large (at most 2^31 - 1)");
  auto st = [](const TensorDesc& t, int i) { return t.shape[i] == 1 ? int64_t{0} : t.stride(i); };
  detail::QuantizeProblem q;
  q.in = dy.part0.data, q.in_dtype = DType::kBFloat16;
  q.rows = T, q.cols = H * D, q.batch_stride = 0, q.row_stride = st(dy.part0, 0);
  detail::ColumnGather& g = q.gather;
  g.seg = D, g.nh = H, g.split = dy.part0.shape[2];
  g.head_stride[0] = st(dy.part0, 1);
  g.in1 = dy.part1.data, g.row_stride1 = st(dy.part1, 0), g.head_stride[1] = st(dy.part1, 1);
  linear_backward_q(c, q, dy.part0, w, x_saved, dx, dw, accumulate, stream);
}

void linear_backward(const RopeGrad& dy, const MXFP8Tensor& w, const MXFP8Tensor& x_saved, TensorDesc* dx,
                     TensorDesc& dw, bool accumulate, Stream stream) {
  const LinearCheck c{"mxmla.rope_linear_backward"};
  const TensorDesc& dq = dy.dq;
  const bool thd = dy.rope.layout == RopeLayout::kTHD;
  if (dq.ndim() != (thd ? 3 : 4))
    c.fail("grad", std::string("must be ") + (thd ? "3-D [t, h, d]" : "4-D [s, b, h, d] or [b, s, h, d]") + ", got " +
                       shape_str(dq.shape));
  const int64_t N = dq.shape[dq.ndim() - 2] * dq.shape[dq.ndim() - 1], T = thd ? dq.shape[0] : dq.shape[0] * dq.shape[1];
  if (N >= (int64_t{1} << 31)) c.fail("grad", "h·d = " + std::to_string(N) + " is too large (at most 2^31 - 1)");
  linear_backward_with(
      c, T, N, dq, "grad", w, x_saved, dx, dw, accumulate,
      [&](const detail::GemmProblem* dgrad, const detail::GemmProblem& wgrad) {
        detail::rope_grad_run(c.op, dq, dy.cos, dy.sin, dy.rope, dy.cu_seqlens, nullptr,
                              [&](const detail::RopeQuantizeParams& k) {
                                detail::rope_linear_backward_cuda(k, dgrad, wgrad, stream);
                              });
      },
      [&](bool need_row) {
        std::pair<HostOperand, HostOperand> h;
        HostOperand& r = h.first;
        HostOperand& cq = h.second;
        r.codes.resize(static_cast<size_t>(need_row ? T * N : 0)), r.scales.resize(static_cast<size_t>(need_row ? T * (N / 32) : 0));
        cq.codes.resize(static_cast<size_t>(T * N)), cq.scales.resize(static_cast<size_t>(detail::ceil_div(T, 32) * N));
        detail::QuantizeProblem q;
        q.rows = T, q.cols = N, q.fmt = Fp8Format::kE4M3, q.batch = 1, q.batch_stride = 0;
        q.row_map = detail::make_row_map(MapMode::kCompact, 1, T, N);
        q.col_map = detail::make_col_map(MapMode::kCompact, 1, T, N);
        if (need_row) q.row_codes = r.codes.data(), q.row_scales = r.scales.data();
        q.col_codes = cq.codes.data(), q.col_scales = cq.scales.data();
        detail::rope_grad_run(c.op, dq, dy.cos, dy.sin, dy.rope, dy.cu_seqlens, &q, {});
        for (auto [o, rowwise] : {std::pair<HostOperand*, bool>{&r, true}, {&cq, false}}) {
          o->view.data = o->codes.data(), o->view.rows = T, o->view.cols = N, o->view.ld = N;
          o->view.contract_cols = rowwise, o->view.scales = o->scales.data();
          o->view.map = rowwise ? q.row_map : q.col_map;
        }
        return h;
      });
}

}  // namespace mxmla
