// mxmla — public API: argument validation, flattening to the backend problems, dispatch by device.
#include <algorithm>
#include <string>

#include "common/device.h"
#include "common/ops.h"
#include "common/text.h"
#include "mxmla/mxfp8.h"

namespace mxmla {

// ---------------------------------------------------------------- descriptors and errors
const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kE8M0: return "e8m0";
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "?";
}
const char* device_name(DeviceType t) { return t == DeviceType::kCPU ? "cpu" : "cuda"; }
int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    default: return 1;
  }
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
int64_t TensorDesc::numel() const { return mxmla::numel(shape); }
int64_t TensorDesc::stride(int64_t dim) const {
  if (!strides.empty()) return strides[dim];
  int64_t s = 1;
  for (int64_t i = ndim() - 1; i > dim; --i) s *= shape[i];
  return s;
}
bool TensorDesc::is_contiguous() const {
  int64_t expect = 1;
  for (int64_t i = ndim() - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride(i) != expect) return false;
    expect *= shape[i];
  }
  return true;
}

Error::Error(const std::string& op, const std::string& arg, const std::string& rule)
    : std::invalid_argument(op + ": argument '" + arg + "': " + rule), op_(op), arg_(arg), rule_(rule) {}

namespace {

using detail::ceil_div;
using detail::MapMode;
using detail::round_up;
using detail::ScaleMap;

using detail::shape_str;

struct Check {
  const char* op;
  [[noreturn]] void fail(const std::string& arg, const std::string& rule) const { throw Error(op, arg, rule); }

  void shape_valid(const std::string& arg, const TensorDesc& t) const {
    if (!t.strides.empty() && t.strides.size() != t.shape.size())
      fail(arg, "has " + std::to_string(t.strides.size()) + " strides for " + std::to_string(t.shape.size()) +
                    " dimensions");
    for (int64_t s : t.shape)
      if (s < 0) fail(arg, "shape " + shape_str(t.shape) + " has a negative size");
  }

  // A float input: dtype, non-null data (unless empty), last dim a positive multiple of 32 (whole
  // MXFP8 blocks; block32 false: positive, e.g. one part of a ConcatInput), unit inner stride.
  void float_input(const std::string& arg, const TensorDesc& t, bool block32 = true) const {
    shape_valid(arg, t);
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16)
      fail(arg, std::string("dtype ") + dtype_name(t.dtype) + " is not supported (bfloat16, float16 or float32)");
    if (t.ndim() < 1) fail(arg, "must have at least one dimension");
    const int64_t K = t.shape.back();
    if (block32 && (K <= 0 || K % 32 != 0))
      fail(arg, "last dimension " + std::to_string(K) + " must be a positive multiple of 32 (the MXFP8 block size)");
    if (!block32 && K <= 0) fail(arg, "last dimension must be positive, got shape " + shape_str(t.shape));
    if (t.stride(t.ndim() - 1) != 1)
      fail(arg, "last dimension must be contiguous (stride 1), got stride " + std::to_string(t.stride(t.ndim() - 1)));
    if (t.numel() > 0 && t.data == nullptr) fail(arg, "data pointer is null");
  }

  // A caller-allocated output: exact shape, contiguous, one of `dtypes`, non-null, on `dev`.
  void output(const std::string& arg, const TensorDesc& t, const std::vector<int64_t>& shape,
              std::initializer_list<DType> dtypes, const Device& dev) const {
    shape_valid(arg, t);
    if (t.shape != shape) fail(arg, "shape " + shape_str(t.shape) + " must be " + shape_str(shape));
    if (std::find(dtypes.begin(), dtypes.end(), t.dtype) == dtypes.end()) {
      std::string names;
      for (DType d : dtypes) names += std::string(names.empty() ? "" : " or ") + dtype_name(d);
      fail(arg, std::string("dtype ") + dtype_name(t.dtype) + " must be " + names);
    }
    if (!t.is_contiguous()) fail(arg, "must be contiguous");
    if (t.numel() > 0 && t.data == nullptr) fail(arg, "data pointer is null");
    same_device(arg, t, dev);
  }

  void same_device(const std::string& arg, const TensorDesc& t, const Device& dev) const {
    if (t.device != dev)
      fail(arg, "is on " + detail::device_str(t.device) + " but the input is on " + detail::device_str(dev));
  }

  void aligned(const std::string& arg, const void* p, int64_t bytes) const {
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
      fail(arg, "data pointer must be " + std::to_string(bytes) + "-byte aligned for the CUDA kernels");
  }

  void on_cuda(const std::string& arg, const TensorDesc& t) const {
    if (t.device.type == DeviceType::kCUDA && t.numel() > 0) detail::check_cuda_pointer(op, arg.c_str(), t.data, t.device.index);
  }
};

void check_code_dtype(const Check& c, const std::string& arg, const TensorDesc& t, Fp8Format f) {
  const DType want = f == Fp8Format::kE4M3 ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
  if (t.dtype != DType::kUInt8 && t.dtype != want)
    c.fail(arg, std::string("dtype ") + dtype_name(t.dtype) + " must be uint8 or " + dtype_name(want));
}

// Rows of a tensor whose leading dimensions collapse to one row stride; returns the row stride.
int64_t collapse_rows(const Check& c, const std::string& arg, const TensorDesc& t, int64_t& M) {
  const int64_t nd = t.ndim();
  M = 1;
  for (int64_t i = 0; i + 1 < nd; ++i) M *= t.shape[i];
  int64_t row_stride = t.shape.back();
  // find the innermost leading dim with size > 1 for the row stride; the rest must nest exactly
  int64_t expect = -1;
  for (int64_t i = nd - 2; i >= 0; --i) {
    if (t.shape[i] == 1) continue;
    if (expect < 0) {
      row_stride = t.stride(i);
      expect = row_stride * t.shape[i];
    } else {
      if (t.stride(i) != expect)
        c.fail(arg, "leading dimensions must collapse to one row stride (strides " + shape_str(t.strides) +
                        " for shape " + shape_str(t.shape) + "); make it contiguous first");
      expect *= t.shape[i];
    }
  }
  if (M > 1 && row_stride < t.shape.back())
    c.fail(arg, "row stride " + std::to_string(row_stride) + " is smaller than the last dimension");
  return row_stride;
}

void check_cuda_input_alignment(const Check& c, const std::string& arg, const TensorDesc& t, int64_t row_stride,
                                int64_t batch_stride) {
  if (t.device.type != DeviceType::kCUDA || t.numel() == 0) return;
  c.aligned(arg, t.data, 16);
  const int64_t es = dtype_size(t.dtype);
  if ((row_stride * es) % 16 != 0 || (batch_stride * es) % 16 != 0)
    c.fail(arg, "row and batch strides must be multiples of 16 bytes for the CUDA kernels");
}

// The descriptor of one direction's outputs, checked.
void check_direction(const Check& c, const char* which, const TensorDesc& data, const TensorDesc& scales,
                     const std::vector<int64_t>& data_shape, const std::vector<int64_t>& scale_shape, Fp8Format f,
                     const Device& dev) {
  const std::string d = std::string(which) + "_data", s = std::string(which) + "_scale_inv";
  c.output(d, data, data_shape, {DType::kUInt8, DType::kFloat8E4M3, DType::kFloat8E5M2}, dev);
  check_code_dtype(c, d, data, f);
  c.output(s, scales, scale_shape, {DType::kUInt8, DType::kE8M0}, dev);
  if (dev.type == DeviceType::kCUDA && data.numel() > 0) c.aligned(d, data.data, 16);
  c.on_cuda(d, data);
  c.on_cuda(s, scales);
}

// Both directions' outputs checked against `shapes`; out's shape and format set, a direction that
// is off gets null pointers.
void check_outputs(const Check& c, MXFP8Tensor& out, const std::vector<int64_t>& shape, const MXFP8Shapes& shapes,
                   bool rowwise, bool columnwise, Fp8Format f, const Device& dev) {
  if (rowwise)
    check_direction(c, "rowwise", out.rowwise_data, out.rowwise_scale_inv, shapes.data, shapes.rowwise_scale, f, dev);
  if (columnwise)
    check_direction(c, "columnwise", out.columnwise_data, out.columnwise_scale_inv, shapes.data,
                    shapes.columnwise_scale, f, dev);
  out.shape = shape;
  out.format = f;
  if (!rowwise) out.rowwise_data.data = nullptr, out.rowwise_scale_inv.data = nullptr;
  if (!columnwise) out.columnwise_data.data = nullptr, out.columnwise_scale_inv.data = nullptr;
}

// The output pointers of a problem (null for a direction that is off: its data pointer is null).
void set_outputs(detail::QuantizeProblem& p, const MXFP8Tensor& out) {
  p.row_codes = static_cast<uint8_t*>(out.rowwise_data.data);
  p.row_scales = p.row_codes ? static_cast<uint8_t*>(out.rowwise_scale_inv.data) : nullptr;
  p.col_codes = static_cast<uint8_t*>(out.columnwise_data.data);
  p.col_scales = p.col_codes ? static_cast<uint8_t*>(out.columnwise_scale_inv.data) : nullptr;
}

void run_quantize(const detail::QuantizeProblem& p, const Device& dev, Stream stream) {
  if (dev.type == DeviceType::kCPU) return detail::quantize_cpu(p);
  detail::CudaDeviceGuard g(dev.index);
  detail::quantize_cuda(p, stream);
}

MapMode mode_of(ScaleLayout l) {
  return l == ScaleLayout::kCompact ? MapMode::kCompact : l == ScaleLayout::kSwizzled ? MapMode::kSwizzled : MapMode::kBHSD;
}

// Attention geometry: [batch, rows, cols] view and (H, D) of a 4-D Q/K/V shape.
struct AttnGeom {
  int64_t B, S, H, D, batch, rows, cols;
};
AttnGeom attn_geom(const Check& c, const std::string& arg, const std::vector<int64_t>& shape, QKVLayout layout) {
  if (shape.size() != 4)
    c.fail(arg, "must be 4-D ([s, b, h, d] or [b, s, h, d]), got shape " + shape_str(shape));
  AttnGeom g{};
  if (layout == QKVLayout::kSBHD) g.S = shape[0], g.B = shape[1];
  else g.B = shape[0], g.S = shape[1];
  g.H = shape[2], g.D = shape[3];
  if (g.D <= 0 || g.D % 32 != 0) c.fail(arg, "head dimension " + std::to_string(g.D) + " must be a positive multiple of 32");
  g.batch = layout == QKVLayout::kSBHD ? 1 : g.B;
  g.rows = g.S;
  g.cols = (layout == QKVLayout::kSBHD ? g.B : 1) * g.H * g.D;
  return g;
}

}  // namespace

namespace detail {
QuantizeProblem quantize_outputs(const char* op, const std::vector<int64_t>& shape, MXFP8Tensor& out,
                                 const QuantizeOptions& opts, const Device& dev) {
  const Check c{op};
  check_outputs(c, out, shape, quantize_shapes(shape, opts.swizzle), opts.rowwise, opts.columnwise, opts.format, dev);
  out.scale_layout = opts.swizzle ? ScaleLayout::kSwizzled : ScaleLayout::kCompact;
  out.attention = false;
  const int64_t K = shape.back(), M = numel(shape) / std::max<int64_t>(K, 1);
  QuantizeProblem p;
  p.fmt = opts.format, p.batch = 1, p.rows = M, p.cols = K;
  const MapMode mode = opts.swizzle ? MapMode::kSwizzled : MapMode::kCompact;
  p.row_map = make_row_map(mode, 1, M, K);
  p.col_map = make_col_map(mode, 1, M, K);
  set_outputs(p, out);
  return p;
}
QuantizeProblem attention_outputs(const char* op, const std::vector<int64_t>& shape, MXFP8Tensor& out,
                                  const AttentionQuantizeOptions& opts, const Device& dev) {
  const Check c{op};
  const AttnGeom g = attn_geom(c, "input", shape, opts.layout);
  check_outputs(c, out, shape, attention_shapes(shape, opts.layout, opts.bhsd_scales), opts.rowwise, opts.columnwise,
                opts.format, dev);
  out.scale_layout = opts.bhsd_scales ? ScaleLayout::kBHSD : ScaleLayout::kCompact;
  out.qkv_layout = opts.layout;
  out.attention = true;
  QuantizeProblem p;
  p.fmt = opts.format, p.batch = g.batch, p.rows = g.rows, p.cols = g.cols;
  const MapMode mode = opts.bhsd_scales ? MapMode::kBHSD : MapMode::kCompact;
  p.row_map = make_row_map(mode, g.batch, g.rows, g.cols, g.H, g.D);
  p.col_map = make_col_map(mode, g.batch, g.rows, g.cols, g.H, g.D);
  set_outputs(p, out);
  return p;
}
}  // namespace detail

// ---------------------------------------------------------------- shapes
MXFP8Shapes quantize_shapes(const std::vector<int64_t>& shape, bool swizzle) {
  const Check c{"mxmla.quantize_shapes"};
  if (shape.empty()) c.fail("shape", "must have at least one dimension");
  const int64_t K = shape.back();
  if (K <= 0 || K % 32 != 0) c.fail("shape", "last dimension " + std::to_string(K) + " must be a positive multiple of 32");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) M *= shape[i];
  MXFP8Shapes s;
  s.data = shape;
  if (swizzle) {
    s.rowwise_scale = {round_up(M, 128), round_up(K / 32, 4)};
    s.columnwise_scale = {round_up(ceil_div(M, 32), 4), round_up(K, 128)};
  } else {
    s.rowwise_scale = {M, K / 32};
    s.columnwise_scale = {ceil_div(M, 32), K};
  }
  return s;
}

MXFP8Shapes attention_shapes(const std::vector<int64_t>& shape, QKVLayout layout, bool bhsd) {
  const Check c{"mxmla.attention_shapes"};
  const AttnGeom g = attn_geom(c, "shape", shape, layout);
  MXFP8Shapes s;
  s.data = shape;
  if (bhsd) {
    s.rowwise_scale = {g.B, g.H, round_up(g.S, 128), round_up(g.D / 32, 4)};
    s.columnwise_scale = {g.B, g.H, round_up(ceil_div(g.S, 32), 4), round_up(g.D, 128)};
  } else {
    s.rowwise_scale = {g.B * g.S * g.H, g.D / 32};
    s.columnwise_scale = {g.batch * ceil_div(g.S, 32), g.cols};
  }
  return s;
}

// ---------------------------------------------------------------- quantize
void quantize(const TensorDesc& input, MXFP8Tensor& out, const QuantizeOptions& opts, Stream stream) {
  const Check c{"mxmla.quantize"};
  c.float_input("input", input);
  if (!opts.rowwise && !opts.columnwise) c.fail("options", "at least one of rowwise / columnwise must be set");
  int64_t M;
  const int64_t row_stride = collapse_rows(c, "input", input, M);
  check_cuda_input_alignment(c, "input", input, row_stride, 0);
  c.on_cuda("input", input);
  detail::QuantizeProblem p = detail::quantize_outputs(c.op, input.shape, out, opts, input.device);
  if (input.numel() == 0) return;
  p.in = input.data, p.in_dtype = input.dtype;
  p.batch_stride = 0, p.row_stride = row_stride;
  run_quantize(p, input.device, stream);
}

namespace {
// A 4-D attention input's strides by role: sbhd [s, b, h, d] (no batch: b is the outer index of
// the columns), bshd [b, s, h, d] (no outer index). Dimensions of size 1 count as stride 0.
struct AttnStrides {
  int64_t batch, seq, outer, head;
};
AttnStrides attn_strides(const TensorDesc& t, QKVLayout layout) {
  auto st = [&](int i) { return t.shape[i] == 1 ? int64_t{0} : t.stride(i); };
  return layout == QKVLayout::kSBHD ? AttnStrides{0, st(0), st(1), st(2)} : AttnStrides{st(0), st(1), 0, st(2)};
}

// An input read in place with free strides (all but the last, which is 1): none negative, and on
// CUDA a 16-byte aligned pointer and strides (the kernels load 16-byte pieces).
void check_free_strides(const Check& c, const std::string& arg, const TensorDesc& t) {
  const int64_t nd = t.ndim();
  for (int64_t i = 0; i < nd; ++i)
    if (t.shape[i] > 1 && t.stride(i) < 0) c.fail(arg, "strides " + shape_str(t.strides) + " must not be negative");
  if (t.device.type != DeviceType::kCUDA || t.numel() == 0) return;
  c.aligned(arg, t.data, 16);
  const int64_t es = dtype_size(t.dtype);
  for (int64_t i = 0; i + 1 < nd; ++i)
    if (t.shape[i] > 1 && (t.stride(i) * es) % 16 != 0)
      c.fail(arg, "strides " + shape_str(t.strides) + " must be multiples of 16 bytes for the CUDA kernels");
  c.on_cuda(arg, t);
}
}  // namespace

namespace detail {
std::vector<int64_t> check_concat(const char* op, const std::string& arg, const ConcatInput& in, int64_t ndim,
                                  const std::string& dims) {
  const Check c{op};
  const std::string a0 = arg + ".part0", a1 = arg + ".part1";
  for (const auto& [a, t] : {std::pair<const std::string&, const TensorDesc&>{a0, in.part0}, {a1, in.part1}}) {
    if (t.ndim() != ndim) c.fail(a, "must be " + std::to_string(ndim) + "-D " + dims + ", got shape " + shape_str(t.shape));
    c.float_input(a, t, false);
  }
  const TensorDesc &p0 = in.part0, &p1 = in.part1;
  if (p1.dtype != p0.dtype)
    c.fail(a1, std::string("dtype ") + dtype_name(p1.dtype) + " must be part0's, " + dtype_name(p0.dtype));
  if (p1.device != p0.device)
    c.fail(a1, "is on " + device_str(p1.device) + " but part0 is on " + device_str(p0.device));
  for (int64_t i = 0; i + 1 < ndim; ++i)
    if (p1.shape[i] != p0.shape[i])
      c.fail(a1, "shape " + shape_str(p1.shape) + " must match part0's " + shape_str(p0.shape) + " but in the last dimension");
  const int64_t chunk = 16 / dtype_size(p0.dtype), d0 = p0.shape.back(), d = d0 + p1.shape.back();
  if (d0 % chunk != 0)
    c.fail(a0, "last dimension " + std::to_string(d0) + " must be a multiple of " + std::to_string(chunk) +
                   " (16 bytes: the parts are read in 16-byte pieces)");
  if (d % 32 != 0)
    c.fail(arg, "the parts' last dimensions add up to " + std::to_string(d) +
                    ", which must be a multiple of 32 (the MXFP8 block size)");
  std::vector<int64_t> shape = p0.shape;
  shape.back() = d;
  check_free_strides(c, a0, p0);
  check_free_strides(c, a1, p1);
  return shape;
}
}  // namespace detail

namespace {
void quantize_attention_parts(const Check& c, const TensorDesc& p0, const TensorDesc* p1, const std::vector<int64_t>& shape,
                              MXFP8Tensor& out, const AttentionQuantizeOptions& opts, Stream stream) {
  const AttnGeom g = attn_geom(c, "input", shape, opts.layout);
  const AttnStrides s0 = attn_strides(p0, opts.layout);
  detail::QuantizeProblem p = detail::attention_outputs(c.op, shape, out, opts, p0.device);
  if (numel(shape) == 0) return;
  p.in = p0.data, p.in_dtype = p0.dtype;
  p.batch_stride = s0.batch, p.row_stride = s0.seq;
  // columns (b?, h, d) nested contiguously: plain rows; else gathered head by head
  const bool sbhd = opts.layout == QKVLayout::kSBHD;
  const bool plain = p1 == nullptr && s0.head == (g.H > 1 ? g.D : 0) && s0.outer == (sbhd && g.B > 1 ? g.H * g.D : 0);
  if (!plain) {
    if (g.cols >= (int64_t{1} << 31))
      c.fail("input", "a token's " + std::to_string(g.cols) + " elements (b·h·d for sbhd, h·d for bshd) are too many "
                      "for a strided or concatenated input (at most 2^31 - 1)");
    detail::ColumnGather& gt = p.gather;
    gt.seg = g.D, gt.nh = g.H, gt.split = p0.shape.back();
    gt.outer_stride[0] = s0.outer, gt.head_stride[0] = s0.head;
    if (p1 != nullptr) {
      const AttnStrides s1 = attn_strides(*p1, opts.layout);
      gt.in1 = p1->data, gt.batch_stride1 = s1.batch, gt.row_stride1 = s1.seq;
      gt.outer_stride[1] = s1.outer, gt.head_stride[1] = s1.head;
    }
  }
  run_quantize(p, p0.device, stream);
}
}  // namespace

void quantize_attention(const TensorDesc& input, MXFP8Tensor& out, const AttentionQuantizeOptions& opts,
                        Stream stream) {
  const Check c{"mxmla.quantize_attention"};
  c.float_input("input", input);
  if (!opts.rowwise && !opts.columnwise) c.fail("options", "at least one of rowwise / columnwise must be set");
  attn_geom(c, "input", input.shape, opts.layout);
  check_free_strides(c, "input", input);
  quantize_attention_parts(c, input, nullptr, input.shape, out, opts, stream);
}

void quantize_attention(const ConcatInput& input, MXFP8Tensor& out, const AttentionQuantizeOptions& opts,
                        Stream stream) {
  const Check c{"mxmla.quantize_attention"};
  const std::vector<int64_t> shape = detail::check_concat(c.op, "input", input, 4, "([s, b, h, d] or [b, s, h, d])");
  if (!opts.rowwise && !opts.columnwise) c.fail("options", "at least one of rowwise / columnwise must be set");
  quantize_attention_parts(c, input.part0, &input.part1, shape, out, opts, stream);
}

// ---------------------------------------------------------------- dequantize
void dequantize(const MXFP8Tensor& in, TensorDesc& out, bool columnwise, Stream stream) {
  const Check c{"mxmla.dequantize"};
  const TensorDesc& data = columnwise ? in.columnwise_data : in.rowwise_data;
  const TensorDesc& scales = columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv;
  const char* which = columnwise ? "columnwise" : "rowwise";
  if (data.data == nullptr && !in.shape.empty() && numel(in.shape) > 0)
    c.fail(std::string(which) + "_data", "is absent: the tensor was not quantized in this direction");
  if (in.shape.empty()) c.fail("input", "shape must have at least one dimension");
  const Device dev = data.device;
  MXFP8Shapes shapes;
  ScaleMap map;
  if (in.attention) {
    const AttnGeom g = attn_geom(c, "input.shape", in.shape, in.qkv_layout);
    shapes = attention_shapes(in.shape, in.qkv_layout, in.scale_layout == ScaleLayout::kBHSD);
    const MapMode mode = in.scale_layout == ScaleLayout::kBHSD ? MapMode::kBHSD : MapMode::kCompact;
    map = columnwise ? detail::make_col_map(mode, g.batch, g.rows, g.cols, g.H, g.D)
                     : detail::make_row_map(mode, g.batch, g.rows, g.cols, g.H, g.D);
  } else {
    if (in.scale_layout == ScaleLayout::kBHSD) c.fail("input", "BHSD scales need an attention-quantized tensor");
    shapes = quantize_shapes(in.shape, in.scale_layout == ScaleLayout::kSwizzled);
    const int64_t K = in.shape.back(), M = numel(in.shape) / K;
    map = columnwise ? detail::make_col_map(mode_of(in.scale_layout), 1, M, K)
                     : detail::make_row_map(mode_of(in.scale_layout), 1, M, K);
  }
  check_direction(c, which, data, scales, shapes.data, columnwise ? shapes.columnwise_scale : shapes.rowwise_scale,
                  in.format, dev);
  c.output("output", out, in.shape, {DType::kFloat32, DType::kBFloat16}, dev);
  if (dev.type == DeviceType::kCUDA && out.numel() > 0) c.aligned("output", out.data, 16);
  c.on_cuda("output", out);
  if (out.numel() == 0) return;
  detail::DequantizeProblem p;
  p.codes = static_cast<const uint8_t*>(data.data);
  p.scales = static_cast<const uint8_t*>(scales.data);
  p.fmt = in.format, p.rowwise = !columnwise, p.map = map, p.out = out.data, p.out_dtype = out.dtype;
  if (dev.type == DeviceType::kCPU) return detail::dequantize_cpu(p);
  detail::CudaDeviceGuard guard(dev.index);
  detail::dequantize_cuda(p, stream);
}

// ---------------------------------------------------------------- scale re-layout
namespace {
// Checks one remap's buffers and describes it.
detail::RemapProblem remap_job(const Check& c, const TensorDesc& src, const std::string& src_arg, const TensorDesc& dst,
                               const std::string& dst_arg, const std::vector<int64_t>& src_shape,
                               const std::vector<int64_t>& dst_shape, const ScaleMap& sm, const ScaleMap& dm,
                               bool rowwise, const Device& dev) {
  c.output(src_arg, src, src_shape, {DType::kUInt8, DType::kE8M0}, dev);
  c.output(dst_arg, dst, dst_shape, {DType::kUInt8, DType::kE8M0}, dev);
  c.on_cuda(src_arg, src);
  c.on_cuda(dst_arg, dst);
  detail::RemapProblem p;
  p.src = static_cast<const uint8_t*>(src.data), p.dst = static_cast<uint8_t*>(dst.data);
  p.src_map = sm, p.dst_map = dm, p.rowwise = rowwise;
  return p;
}

void run_remaps(const std::vector<detail::RemapProblem>& jobs, const Device& dev, Stream stream) {
  if (jobs.empty()) return;
  if (dev.type == DeviceType::kCPU) return detail::remap_scales_cpu(jobs);
  detail::CudaDeviceGuard guard(dev.index);
  detail::remap_scales_cuda(jobs, stream);
}

void swizzle_common(const char* op, const TensorDesc& from, TensorDesc& to, int64_t M, int64_t K, bool rowwise,
                    bool to_swizzled, Stream stream) {
  const Check c{op};
  if (M < 0) c.fail("M", "must be >= 0, got " + std::to_string(M));
  if (K <= 0 || K % 32 != 0) c.fail("K", std::to_string(K) + " must be a positive multiple of 32");
  const MXFP8Shapes compact = quantize_shapes({M, K}, false), swz = quantize_shapes({M, K}, true);
  const auto& cs = rowwise ? compact.rowwise_scale : compact.columnwise_scale;
  const auto& ss = rowwise ? swz.rowwise_scale : swz.columnwise_scale;
  const ScaleMap cm = rowwise ? detail::make_row_map(MapMode::kCompact, 1, M, K) : detail::make_col_map(MapMode::kCompact, 1, M, K);
  const ScaleMap sm = rowwise ? detail::make_row_map(MapMode::kSwizzled, 1, M, K) : detail::make_col_map(MapMode::kSwizzled, 1, M, K);
  const detail::RemapProblem job = to_swizzled
                                       ? remap_job(c, from, "compact", to, "swizzled", cs, ss, cm, sm, rowwise, from.device)
                                       : remap_job(c, from, "swizzled", to, "compact", ss, cs, sm, cm, rowwise, from.device);
  run_remaps({job}, from.device, stream);
}
}  // namespace

void swizzle_scales(const TensorDesc& compact, TensorDesc& swizzled, int64_t M, int64_t K, bool rowwise, Stream s) {
  swizzle_common("mxmla.swizzle_scales", compact, swizzled, M, K, rowwise, true, s);
}
void unswizzle_scales(const TensorDesc& swizzled, TensorDesc& compact, int64_t M, int64_t K, bool rowwise, Stream s) {
  swizzle_common("mxmla.unswizzle_scales", swizzled, compact, M, K, rowwise, false, s);
}

void attention_scales_to_bhsd(const std::vector<BhsdScaleJob>& jobs, Stream stream) {
  const Check c{"mxmla.attention_scales_to_bhsd"};
  std::vector<detail::RemapProblem> problems;
  for (size_t k = 0; k < jobs.size(); ++k) {
    const BhsdScaleJob& j = jobs[k];
    std::string tag;  // built by append: GCC 12's -Wrestrict misfires on "[" + to_string(k) + "]"
    if (jobs.size() > 1) tag.append("[").append(std::to_string(k)).append("]");
    const AttnGeom g = attn_geom(c, "shape" + tag, j.shape, j.layout);
    const MXFP8Shapes cs = attention_shapes(j.shape, j.layout, false), bs = attention_shapes(j.shape, j.layout, true);
    const ScaleMap cm = j.rowwise ? detail::make_row_map(MapMode::kCompact, g.batch, g.rows, g.cols, g.H, g.D)
                                  : detail::make_col_map(MapMode::kCompact, g.batch, g.rows, g.cols, g.H, g.D);
    const ScaleMap bm = j.rowwise ? detail::make_row_map(MapMode::kBHSD, g.batch, g.rows, g.cols, g.H, g.D)
                                  : detail::make_col_map(MapMode::kBHSD, g.batch, g.rows, g.cols, g.H, g.D);
    problems.push_back(remap_job(c, j.compact, "compact" + tag, j.bhsd, "bhsd" + tag,
                                 j.rowwise ? cs.rowwise_scale : cs.columnwise_scale,
                                 j.rowwise ? bs.rowwise_scale : bs.columnwise_scale, cm, bm, j.rowwise,
                                 jobs[0].compact.device));
  }
  if (!jobs.empty()) run_remaps(problems, jobs[0].compact.device, stream);
}

void attention_scales_to_bhsd(const TensorDesc& compact, TensorDesc& bhsd, const std::vector<int64_t>& shape,
                              QKVLayout layout, bool rowwise, Stream stream) {
  attention_scales_to_bhsd({BhsdScaleJob{compact, bhsd, shape, layout, rowwise}}, stream);
}

}  // namespace mxmla
