// mxmla — the compiled Python module (_mxmla_core), nanobind.
//
// It holds no torch or numpy headers: the Python layer passes each tensor as a plain descriptor
// (data pointer, dtype name, shape, element strides, DLPack device type and index) read from the
// torch tensor or numpy array, so one build serves every torch version. Outputs are allocated
// by the Python layer. mxmla::Error surfaces as ValueError, CUDA failures as RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/qproj.h"
#include "mxmla/rope.h"

namespace nb = nanobind;
using namespace mxmla;

namespace {

// (ptr, dtype, shape, strides, device_type (DLPack: 1 cpu, 2 cuda), device_index)
using Desc = std::tuple<uintptr_t, std::string, std::vector<int64_t>, std::vector<int64_t>, int, int>;

DType parse_dtype(const std::string& s) {
  if (s == "float32") return DType::kFloat32;
  if (s == "float16") return DType::kFloat16;
  if (s == "bfloat16") return DType::kBFloat16;
  if (s == "uint8") return DType::kUInt8;
  if (s == "float8_e4m3") return DType::kFloat8E4M3;
  if (s == "float8_e5m2") return DType::kFloat8E5M2;
  if (s == "e8m0") return DType::kE8M0;
  if (s == "int32") return DType::kInt32;
  if (s == "int64") return DType::kInt64;
  throw Error("mxmla", "dtype", "'" + s + "' is not a supported dtype");
}

TensorDesc to_desc(const Desc& d) {
  const auto& [ptr, dtype, shape, strides, dev_type, dev_index] = d;
  Device dev;
  if (dev_type == 1) dev = Device{DeviceType::kCPU, 0};
  else if (dev_type == 2) dev = Device{DeviceType::kCUDA, dev_index};
  else throw Error("mxmla", "device", "DLPack device type " + std::to_string(dev_type) + " is not supported (cpu or cuda)");
  return TensorDesc(reinterpret_cast<void*>(ptr), parse_dtype(dtype), shape, dev, strides);
}
TensorDesc opt_desc(const std::optional<Desc>& d) { return d ? to_desc(*d) : TensorDesc(); }

// Enum from its Python spelling; the error lists every choice: "must be 'a', 'b' or 'c', got 'x'".
template <typename E>
E parse_choice(const char* arg, const std::string& s, std::initializer_list<std::pair<const char*, E>> choices) {
  std::string list;
  size_t i = 0;
  for (const auto& [name, value] : choices) {
    if (s == name) return value;
    list += std::string(i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + "'" + name + "'";
    ++i;
  }
  throw Error("mxmla", arg, "must be " + list + ", got '" + s + "'");
}
Fp8Format parse_format(const std::string& s) {
  return parse_choice<Fp8Format>("fp8_format", s, {{"e4m3", Fp8Format::kE4M3}, {"e5m2", Fp8Format::kE5M2}});
}
QKVLayout parse_layout(const std::string& s) {
  return parse_choice<QKVLayout>("layout", s, {{"sbhd", QKVLayout::kSBHD}, {"bshd", QKVLayout::kBSHD}});
}
ScaleLayout parse_scale_layout(const std::string& s) {
  return parse_choice<ScaleLayout>(
      "scale_layout", s,
      {{"compact", ScaleLayout::kCompact}, {"swizzled", ScaleLayout::kSwizzled}, {"bhsd", ScaleLayout::kBHSD}});
}
Stream to_stream(uintptr_t s) { return reinterpret_cast<Stream>(s); }

RopeStyle parse_style(const std::string& s) {
  return parse_choice<RopeStyle>("style", s,
                                 {{"interleaved_in_halves_out", RopeStyle::kInterleavedInHalvesOut},
                                  {"interleaved", RopeStyle::kInterleaved},
                                  {"rotate_half", RopeStyle::kRotateHalf}});
}
RopeLayout parse_rope_layout(const std::string& s) {
  return parse_choice<RopeLayout>("layout", s,
                                  {{"sbhd", RopeLayout::kSBHD}, {"bshd", RopeLayout::kBSHD}, {"thd", RopeLayout::kTHD}});
}
YarnParams parse_yarn(const std::optional<std::tuple<double, int64_t, double, double, double, double>>& y) {
  YarnParams p;
  if (!y) return p;
  p.enabled = true;
  std::tie(p.factor, p.original_max_position, p.beta_fast, p.beta_slow, p.mscale, p.mscale_all_dim) = *y;
  return p;
}

MXFP8Tensor make_tensor(const std::optional<Desc>& rd, const std::optional<Desc>& rs, const std::optional<Desc>& cd,
                        const std::optional<Desc>& cs) {
  MXFP8Tensor t;
  t.rowwise_data = opt_desc(rd), t.rowwise_scale_inv = opt_desc(rs);
  t.columnwise_data = opt_desc(cd), t.columnwise_scale_inv = opt_desc(cs);
  return t;
}

nb::tuple shapes_tuple(const MXFP8Shapes& s) { return nb::make_tuple(s.data, s.rowwise_scale, s.columnwise_scale); }

// Output shapes for op `op`, whose input argument is `arg`: a shape error names that op and argument.
template <typename Fn>
nb::tuple shapes_for(const std::string& op, const std::string& arg, Fn&& fn) {
  try {
    return shapes_tuple(fn());
  } catch (const Error& e) {
    throw Error(op, arg, e.rule());
  }
}

}  // namespace

NB_MODULE(_mxmla_core, m) {
  m.doc() = "mxmla compiled core (use the mxmla package)";
  nb::exception<CudaError>(m, "CudaError", PyExc_RuntimeError);

  m.def("quantize_shapes", [](const std::vector<int64_t>& shape, bool swizzle, const std::string& op,
                               const std::string& arg) {
    return shapes_for(op, arg, [&] { return quantize_shapes(shape, swizzle); });
  });
  m.def("attention_shapes", [](const std::vector<int64_t>& shape, const std::string& layout, bool bhsd,
                                const std::string& op, const std::string& arg) {
    return shapes_for(op, arg, [&] { return attention_shapes(shape, parse_layout(layout), bhsd); });
  });

  m.def(
      "quantize",
      [](const Desc& x, const std::optional<Desc>& rd, const std::optional<Desc>& rs, const std::optional<Desc>& cd,
         const std::optional<Desc>& cs, const std::string& fmt, bool swizzle, uintptr_t stream) {
        QuantizeOptions o;
        o.rowwise = rd.has_value(), o.columnwise = cd.has_value(), o.format = parse_format(fmt), o.swizzle = swizzle;
        MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
        nb::gil_scoped_release release;
        quantize(to_desc(x), t, o, to_stream(stream));
      },
      nb::arg("x"), nb::arg("rowwise_data").none(), nb::arg("rowwise_scale").none(), nb::arg("columnwise_data").none(),
      nb::arg("columnwise_scale").none(), nb::arg("fp8_format"), nb::arg("swizzle"), nb::arg("stream"));

  m.def(
      "quantize_attention",
      [](const Desc& x, const std::optional<Desc>& rd, const std::optional<Desc>& rs, const std::optional<Desc>& cd,
         const std::optional<Desc>& cs, const std::string& layout, const std::string& fmt, bool bhsd, uintptr_t stream) {
        AttentionQuantizeOptions o;
        o.layout = parse_layout(layout), o.rowwise = rd.has_value(), o.columnwise = cd.has_value();
        o.format = parse_format(fmt), o.bhsd_scales = bhsd;
        MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
        nb::gil_scoped_release release;
        quantize_attention(to_desc(x), t, o, to_stream(stream));
      },
      nb::arg("x"), nb::arg("rowwise_data").none(), nb::arg("rowwise_scale").none(), nb::arg("columnwise_data").none(),
      nb::arg("columnwise_scale").none(), nb::arg("layout"), nb::arg("fp8_format"), nb::arg("bhsd"), nb::arg("stream"));

  m.def(
      "dequantize",
      [](const Desc& data, const Desc& scale, const Desc& out, const std::vector<int64_t>& shape, const std::string& fmt,
         const std::string& scale_layout, bool columnwise, bool attention, const std::string& layout, uintptr_t stream) {
        MXFP8Tensor t;
        t.shape = shape, t.format = parse_format(fmt), t.scale_layout = parse_scale_layout(scale_layout);
        t.attention = attention, t.qkv_layout = parse_layout(layout);
        (columnwise ? t.columnwise_data : t.rowwise_data) = to_desc(data);
        (columnwise ? t.columnwise_scale_inv : t.rowwise_scale_inv) = to_desc(scale);
        TensorDesc o = to_desc(out);
        nb::gil_scoped_release release;
        dequantize(t, o, columnwise, to_stream(stream));
      },
      nb::arg("data"), nb::arg("scale"), nb::arg("out"), nb::arg("shape"), nb::arg("fp8_format"),
      nb::arg("scale_layout"), nb::arg("columnwise"), nb::arg("attention"), nb::arg("layout"), nb::arg("stream"));

  m.def("swizzle_scales", [](const Desc& src, const Desc& dst, int64_t M, int64_t K, bool rowwise, uintptr_t stream) {
    TensorDesc d = to_desc(dst);
    nb::gil_scoped_release release;
    swizzle_scales(to_desc(src), d, M, K, rowwise, to_stream(stream));
  });
  m.def("unswizzle_scales", [](const Desc& src, const Desc& dst, int64_t M, int64_t K, bool rowwise, uintptr_t stream) {
    TensorDesc d = to_desc(dst);
    nb::gil_scoped_release release;
    unswizzle_scales(to_desc(src), d, M, K, rowwise, to_stream(stream));
  });
  m.def("attention_scales_to_bhsd", [](const Desc& src, const Desc& dst, const std::vector<int64_t>& shape,
                                       const std::string& layout, bool rowwise, uintptr_t stream) {
    TensorDesc d = to_desc(dst);
    nb::gil_scoped_release release;
    attention_scales_to_bhsd(to_desc(src), d, shape, parse_layout(layout), rowwise, to_stream(stream));
  });

  m.def("attention_scales_to_bhsd_batch",
        [](const std::vector<std::tuple<Desc, Desc, std::vector<int64_t>, std::string, bool>>& jobs, uintptr_t stream) {
          std::vector<BhsdScaleJob> js;
          for (const auto& [src, dst, shape, layout, rowwise] : jobs)
            js.push_back(BhsdScaleJob{to_desc(src), to_desc(dst), shape, parse_layout(layout), rowwise});
          nb::gil_scoped_release release;
          attention_scales_to_bhsd(js, to_stream(stream));
        });

  m.def(
      "rope",
      [](const Desc& x, const Desc& cos, const Desc& sin, const Desc& out, const std::string& style,
         const std::string& layout, int64_t rope_dim, bool per_token, const std::optional<Desc>& cu, bool backward,
         uintptr_t stream) {
        RopeOptions o;
        o.style = parse_style(style), o.layout = parse_rope_layout(layout), o.rope_dim = rope_dim;
        o.tables_per_token = per_token;
        TensorDesc od = to_desc(out);
        TensorDesc cud = cu ? to_desc(*cu) : TensorDesc();
        nb::gil_scoped_release release;
        if (backward)
          rope_backward(to_desc(x), to_desc(cos), to_desc(sin), od, o, cu ? &cud : nullptr, to_stream(stream));
        else
          apply_rope(to_desc(x), to_desc(cos), to_desc(sin), od, o, cu ? &cud : nullptr, to_stream(stream));
      },
      nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("out"), nb::arg("style"), nb::arg("layout"),
      nb::arg("rope_dim"), nb::arg("tables_per_token"), nb::arg("cu_seqlens").none(), nb::arg("backward"),
      nb::arg("stream"));
  m.def(
      "rope_backward_quantize",
      [](const Desc& dq, const Desc& cos, const Desc& sin, const std::optional<Desc>& rd, const std::optional<Desc>& rs,
         const std::optional<Desc>& cd, const std::optional<Desc>& cs, const std::optional<Desc>& dx,
         const std::string& style, const std::string& layout, int64_t rope_dim, bool per_token,
         const std::optional<Desc>& cu, const std::string& fmt, bool swizzle, uintptr_t stream) {
        RopeBackwardQuantizeOptions o;
        o.rope.style = parse_style(style), o.rope.layout = parse_rope_layout(layout), o.rope.rope_dim = rope_dim;
        o.rope.tables_per_token = per_token;
        o.rowwise = rd.has_value(), o.columnwise = cd.has_value(), o.format = parse_format(fmt), o.swizzle = swizzle;
        MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
        TensorDesc dxd = dx ? to_desc(*dx) : TensorDesc();
        TensorDesc cud = cu ? to_desc(*cu) : TensorDesc();
        nb::gil_scoped_release release;
        rope_backward_quantize(to_desc(dq), to_desc(cos), to_desc(sin), t, dx ? &dxd : nullptr, o, cu ? &cud : nullptr,
                               to_stream(stream));
      },
      nb::arg("dq"), nb::arg("cos"), nb::arg("sin"), nb::arg("rowwise_data").none(), nb::arg("rowwise_scale").none(),
      nb::arg("columnwise_data").none(), nb::arg("columnwise_scale").none(), nb::arg("dx").none(), nb::arg("style"),
      nb::arg("layout"), nb::arg("rope_dim"), nb::arg("tables_per_token"), nb::arg("cu_seqlens").none(),
      nb::arg("fp8_format"), nb::arg("swizzle"), nb::arg("stream"));
  m.def("rope_tables", [](const std::vector<double>& positions, int64_t rope_dim, double base,
                          const std::optional<std::tuple<double, int64_t, double, double, double, double>>& yarn,
                          const std::string& style, const Desc& cos, const Desc& sin) {
    TensorDesc c = to_desc(cos), s = to_desc(sin);
    rope_tables(positions, rope_dim, base, parse_yarn(yarn), parse_style(style), c, s);
  }, nb::arg("positions"), nb::arg("rope_dim"), nb::arg("base"), nb::arg("yarn").none(), nb::arg("style"),
     nb::arg("cos"), nb::arg("sin"));
  m.def("rope_inv_freq", [](int64_t rope_dim, double base,
                            const std::optional<std::tuple<double, int64_t, double, double, double, double>>& yarn) {
    return rope_inv_freq(rope_dim, base, parse_yarn(yarn));
  }, nb::arg("rope_dim"), nb::arg("base"), nb::arg("yarn").none());
  m.def("yarn_softmax_scale", [](int64_t head_dim,
                                 const std::optional<std::tuple<double, int64_t, double, double, double, double>>& yarn) {
    return yarn_softmax_scale(head_dim, parse_yarn(yarn));
  }, nb::arg("head_dim"), nb::arg("yarn").none());
  m.def("positions_arange", &positions_arange, nb::arg("n"), nb::arg("offset") = 0);
  m.def("positions_from_cu_seqlens", &positions_from_cu_seqlens);
  m.def("positions_context_parallel", &positions_context_parallel);

  m.def("qproj_shapes", [](int64_t tokens, int64_t heads, int64_t nope, int64_t rope, const std::string& layout,
                           int64_t batch, bool bhsd) {
    QProjOptions o;
    o.nope_dim = nope, o.rope_dim = rope, o.layout = parse_layout(layout), o.batch = batch, o.bhsd_scales = bhsd;
    const MXFP8Shapes s = qproj_shapes(tokens, heads, o);
    return nb::make_tuple(qproj_q_shape(tokens, heads, o), s.data, s.rowwise_scale, s.columnwise_scale);
  });
  m.def(
      "fused_q_uproj_rope_quant",
      [](const Desc& x, const Desc& w, const Desc& cos, const Desc& sin, const std::optional<Desc>& rd,
         const std::optional<Desc>& rs, const std::optional<Desc>& cd, const std::optional<Desc>& cs,
         const std::optional<Desc>& q, int64_t nope, int64_t rope, const std::string& style, const std::string& layout,
         int64_t batch, const std::string& weight_layout, const std::string& fmt, bool bhsd, uintptr_t stream) {
        QProjOptions o;
        o.nope_dim = nope, o.rope_dim = rope, o.style = parse_style(style), o.layout = parse_layout(layout);
        o.batch = batch, o.format = parse_format(fmt), o.bhsd_scales = bhsd;
        if (weight_layout != "nk" && weight_layout != "kn")
          throw Error("mxmla.fused_q_uproj_rope_quant", "weight_layout", "must be 'nk' ([N, K]) or 'kn' ([K, N]), got '" + weight_layout + "'");
        o.weight_layout = weight_layout == "kn" ? WeightLayout::kKN : WeightLayout::kNK;
        o.rowwise = rd.has_value(), o.columnwise = cd.has_value();
        MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
        TensorDesc qd = q ? to_desc(*q) : TensorDesc();
        nb::gil_scoped_release release;
        fused_q_uproj_rope_quant(to_desc(x), to_desc(w), to_desc(cos), to_desc(sin), t, q ? &qd : nullptr, o,
                                 to_stream(stream));
      },
      nb::arg("x"), nb::arg("w"), nb::arg("cos"), nb::arg("sin"), nb::arg("rowwise_data").none(),
      nb::arg("rowwise_scale").none(), nb::arg("columnwise_data").none(), nb::arg("columnwise_scale").none(),
      nb::arg("q").none(), nb::arg("nope_dim"), nb::arg("rope_dim"), nb::arg("style"), nb::arg("layout"),
      nb::arg("batch"), nb::arg("weight_layout"), nb::arg("fp8_format"), nb::arg("bhsd_scales"), nb::arg("stream"));

  m.def("build_info", [] {
    const BuildInfo b = build_info();
    return nb::make_tuple(b.version, b.cuda_enabled, std::string(b.cuda_archs), b.cuda_rope);
  });
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_device_description", &cuda_device_description);
}
