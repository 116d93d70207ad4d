// mxmla — the compiled Python module (_mxmla_core), nanobind.
//
// It holds no torch or numpy headers: the Python layer passes each tensor as a plain descriptor
// (data pointer, dtype name, shape, element strides, DLPack device type and index) read from the
// torch tensor or numpy array, so one build serves every torch version. Outputs are allocated
// by the Python layer.
//
// Options cross as the C++ option structs themselves (bound below with their enums, whose value
// names are the spellings the Python API accepts): the Python layer validates the user's strings
// once, builds one options struct per call and passes it with the tensor descriptors.
// mxmla::Error surfaces as ValueError (op, argument, rule; an argument the C++ API names
// differently from the Python function, e.g. 'input' for quantize's 'x', is renamed to the
// Python name), CUDA failures as RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "mxmla/attention.h"
#include "mxmla/blockfp8.h"
#include "mxmla/gemm.h"
#include "mxmla/linear.h"
#include "mxmla/mxfp8.h"
#include "mxmla/qproj.h"
#include "mxmla/rope.h"

namespace nb = nanobind;
using namespace mxmla;

namespace {

// (ptr, dtype, shape, strides, device_type (DLPack: 1 cpu, 2 cuda), device_index)
using Desc = std::tuple<uintptr_t, std::string, std::vector<int64_t>, std::vector<int64_t>, int, int>;
using OptDesc = std::optional<Desc>;

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
TensorDesc opt_desc(const OptDesc& d) { return d ? to_desc(*d) : TensorDesc(); }
Stream to_stream(uintptr_t s) { return reinterpret_cast<Stream>(s); }

MXFP8Tensor make_tensor(const OptDesc& rd, const OptDesc& rs, const OptDesc& cd, const OptDesc& cs) {
  MXFP8Tensor t;
  t.rowwise_data = opt_desc(rd), t.rowwise_scale_inv = opt_desc(rs);
  t.columnwise_data = opt_desc(cd), t.columnwise_scale_inv = opt_desc(cs);
  return t;
}

// Runs `fn`; an mxmla::Error whose argument the C++ API names differently from the Python
// function is re-thrown under the Python name (op and rule unchanged).
using Names = std::initializer_list<std::pair<const char*, const char*>>;
template <typename Fn>
void renamed(Names names, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    for (const auto& [from, to] : names)
      if (e.arg() == from) throw Error(e.op(), to, e.rule());
    throw;
  }
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

// What dequantize needs besides the buffers (the C++ API reads it from an MXFP8Tensor).
struct DequantizeOptions {
  std::vector<int64_t> shape;
  Fp8Format format = Fp8Format::kE4M3;
  ScaleLayout scale_layout = ScaleLayout::kCompact;
  QKVLayout qkv_layout = QKVLayout::kSBHD;
  bool attention = false;
  bool columnwise = false;
};

template <typename E>
const char* enum_name(E v);
template <>
const char* enum_name(Fp8Format v) { return v == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }
template <>
const char* enum_name(ScaleLayout v) {
  return v == ScaleLayout::kCompact ? "compact" : v == ScaleLayout::kSwizzled ? "swizzled" : "bhsd";
}
template <>
const char* enum_name(QKVLayout v) { return v == QKVLayout::kSBHD ? "sbhd" : "bshd"; }
template <>
const char* enum_name(RopeStyle v) {
  return v == RopeStyle::kInterleavedInHalvesOut ? "interleaved_in_halves_out"
         : v == RopeStyle::kInterleaved          ? "interleaved"
                                                 : "rotate_half";
}
template <>
const char* enum_name(RopeLayout v) { return v == RopeLayout::kSBHD ? "sbhd" : v == RopeLayout::kBSHD ? "bshd" : "thd"; }
template <>
const char* enum_name(WeightLayout v) { return v == WeightLayout::kNK ? "nk" : "kn"; }
template <>
const char* enum_name(AttnFormat v) {
  return v == AttnFormat::kSBHD ? "sbhd" : v == AttnFormat::kBSHD ? "bshd" : v == AttnFormat::kBHSD ? "bhsd" : "thd";
}
template <>
const char* enum_name(PFormat v) { return v == PFormat::kBF16 ? "bf16" : "e4m3"; }

std::string b(bool v) { return v ? "True" : "False"; }
std::string q(const char* s) { return std::string("'") + s + "'"; }

std::string repr(const QuantizeOptions& o) {
  return "QuantizeOptions(rowwise=" + b(o.rowwise) + ", columnwise=" + b(o.columnwise) + ", format=" +
         q(enum_name(o.format)) + ", swizzle=" + b(o.swizzle) + ")";
}
std::string repr(const RopeOptions& o) {
  return "RopeOptions(style=" + q(enum_name(o.style)) + ", layout=" + q(enum_name(o.layout)) +
         ", rope_dim=" + std::to_string(o.rope_dim) + ", tables_per_token=" + b(o.tables_per_token) + ")";
}

// An attention or GEMM operand: a bf16 tensor descriptor, or an MXFP8 tensor as (rowwise_data,
// rowwise_scale_inv, columnwise_data, columnwise_scale_inv, shape, fp8_format, scale_layout, layout,
// attention) -- the fields of the Python MXFP8Tensor, the direction attention does not read may be
// None. The codes of the direction read (q, k: rowwise; v: columnwise) are described as the operand
// in its format (a view); `shape` is the shape the tensor was quantized as.
using MxOperand = std::tuple<OptDesc, OptDesc, OptDesc, OptDesc, std::vector<int64_t>, Fp8Format, ScaleLayout, QKVLayout,
                             bool>;
using AttnOperand = std::variant<Desc, MxOperand>;

// The C++ operand of a Python one (owns the descriptors AttnInput points to; not copied).
struct HeldOperand {
  TensorDesc bf16;
  MXFP8Tensor mx;
  AttnInput in;
  explicit HeldOperand(const AttnOperand& a) {
    if (const Desc* d = std::get_if<Desc>(&a)) {
      bf16 = to_desc(*d);
      in.bf16 = &bf16;
      return;
    }
    const auto& [rd, rs, cd, cs, shape, format, scale_layout, layout, attention] = std::get<MxOperand>(a);
    mx = make_tensor(rd, rs, cd, cs);
    mx.shape = shape, mx.format = format, mx.scale_layout = scale_layout, mx.qkv_layout = layout;
    mx.attention = attention;
    in.mx = &mx;
  }
  HeldOperand(const HeldOperand&) = delete;
  HeldOperand& operator=(const HeldOperand&) = delete;
  GemmInput gemm_input() const { return {in.bf16, in.mx}; }
};

}  // namespace

NB_MODULE(_mxmla_core, m) {
  m.doc() = "mxmla compiled core (use the mxmla package)";
  nb::exception<CudaError>(m, "CudaError", PyExc_RuntimeError);

  // ------------------------------------------------------------------ enums (value names = Python spellings)
  nb::enum_<Fp8Format>(m, "Fp8Format").value("e4m3", Fp8Format::kE4M3).value("e5m2", Fp8Format::kE5M2);
  nb::enum_<ScaleLayout>(m, "ScaleLayout")
      .value("compact", ScaleLayout::kCompact)
      .value("swizzled", ScaleLayout::kSwizzled)
      .value("bhsd", ScaleLayout::kBHSD);
  nb::enum_<QKVLayout>(m, "QKVLayout").value("sbhd", QKVLayout::kSBHD).value("bshd", QKVLayout::kBSHD);
  nb::enum_<RopeStyle>(m, "RopeStyle")
      .value("interleaved_in_halves_out", RopeStyle::kInterleavedInHalvesOut)
      .value("interleaved", RopeStyle::kInterleaved)
      .value("rotate_half", RopeStyle::kRotateHalf);
  nb::enum_<RopeLayout>(m, "RopeLayout")
      .value("sbhd", RopeLayout::kSBHD)
      .value("bshd", RopeLayout::kBSHD)
      .value("thd", RopeLayout::kTHD);
  nb::enum_<WeightLayout>(m, "WeightLayout").value("nk", WeightLayout::kNK).value("kn", WeightLayout::kKN);
  nb::enum_<AttnFormat>(m, "AttnFormat")
      .value("sbhd", AttnFormat::kSBHD)
      .value("bshd", AttnFormat::kBSHD)
      .value("bhsd", AttnFormat::kBHSD)
      .value("thd", AttnFormat::kTHD);
  nb::enum_<PFormat>(m, "PFormat").value("bf16", PFormat::kBF16).value("e4m3", PFormat::kE4M3);

  // ------------------------------------------------------------------ option structs (fields read/write)
  nb::class_<QuantizeOptions>(m, "QuantizeOptions")
      .def(nb::init<>())
      .def_rw("rowwise", &QuantizeOptions::rowwise)
      .def_rw("columnwise", &QuantizeOptions::columnwise)
      .def_rw("format", &QuantizeOptions::format)
      .def_rw("swizzle", &QuantizeOptions::swizzle)
      .def("__repr__", [](const QuantizeOptions& o) { return repr(o); });
  nb::class_<AttentionQuantizeOptions>(m, "AttentionQuantizeOptions")
      .def(nb::init<>())
      .def_rw("layout", &AttentionQuantizeOptions::layout)
      .def_rw("rowwise", &AttentionQuantizeOptions::rowwise)
      .def_rw("columnwise", &AttentionQuantizeOptions::columnwise)
      .def_rw("format", &AttentionQuantizeOptions::format)
      .def_rw("bhsd_scales", &AttentionQuantizeOptions::bhsd_scales)
      .def("__repr__", [](const AttentionQuantizeOptions& o) {
        return "AttentionQuantizeOptions(layout=" + q(enum_name(o.layout)) + ", rowwise=" + b(o.rowwise) +
               ", columnwise=" + b(o.columnwise) + ", format=" + q(enum_name(o.format)) +
               ", bhsd_scales=" + b(o.bhsd_scales) + ")";
      });
  nb::class_<RopeOptions>(m, "RopeOptions")
      .def(nb::init<>())
      .def_rw("style", &RopeOptions::style)
      .def_rw("layout", &RopeOptions::layout)
      .def_rw("rope_dim", &RopeOptions::rope_dim)
      .def_rw("tables_per_token", &RopeOptions::tables_per_token)
      .def("__repr__", [](const RopeOptions& o) { return repr(o); });
  nb::class_<RopeBackwardQuantizeOptions>(m, "RopeBackwardQuantizeOptions")
      .def(nb::init<>())
      .def_rw("rope", &RopeBackwardQuantizeOptions::rope)
      .def_rw("rowwise", &RopeBackwardQuantizeOptions::rowwise)
      .def_rw("columnwise", &RopeBackwardQuantizeOptions::columnwise)
      .def_rw("format", &RopeBackwardQuantizeOptions::format)
      .def_rw("swizzle", &RopeBackwardQuantizeOptions::swizzle)
      .def("__repr__", [](const RopeBackwardQuantizeOptions& o) {
        return "RopeBackwardQuantizeOptions(rope=" + repr(o.rope) + ", rowwise=" + b(o.rowwise) +
               ", columnwise=" + b(o.columnwise) + ", format=" + q(enum_name(o.format)) +
               ", swizzle=" + b(o.swizzle) + ")";
      });
  nb::class_<QProjOptions>(m, "QProjOptions")
      .def(nb::init<>())
      .def_rw("nope_dim", &QProjOptions::nope_dim)
      .def_rw("rope_dim", &QProjOptions::rope_dim)
      .def_rw("style", &QProjOptions::style)
      .def_rw("layout", &QProjOptions::layout)
      .def_rw("batch", &QProjOptions::batch)
      .def_rw("weight_layout", &QProjOptions::weight_layout)
      .def_rw("rowwise", &QProjOptions::rowwise)
      .def_rw("columnwise", &QProjOptions::columnwise)
      .def_rw("format", &QProjOptions::format)
      .def_rw("bhsd_scales", &QProjOptions::bhsd_scales)
      .def("__repr__", [](const QProjOptions& o) {
        return "QProjOptions(nope_dim=" + std::to_string(o.nope_dim) + ", rope_dim=" + std::to_string(o.rope_dim) +
               ", style=" + q(enum_name(o.style)) + ", layout=" + q(enum_name(o.layout)) +
               ", batch=" + std::to_string(o.batch) + ", weight_layout=" + q(enum_name(o.weight_layout)) +
               ", rowwise=" + b(o.rowwise) + ", columnwise=" + b(o.columnwise) + ", format=" +
               q(enum_name(o.format)) + ", bhsd_scales=" + b(o.bhsd_scales) + ")";
      });
  nb::class_<AttentionOptions>(m, "AttentionOptions")
      .def(nb::init<>())
      .def_rw("q_format", &AttentionOptions::q_format)
      .def_rw("kv_format", &AttentionOptions::kv_format)
      .def_rw("causal", &AttentionOptions::causal)
      .def_rw("bottom_right", &AttentionOptions::bottom_right)
      .def_rw("softmax_scale", &AttentionOptions::softmax_scale)
      .def_rw("p_format", &AttentionOptions::p_format)
      .def_rw("max_seqlen_q", &AttentionOptions::max_seqlen_q)
      .def_rw("max_seqlen_kv", &AttentionOptions::max_seqlen_kv)
      .def("__repr__", [](const AttentionOptions& o) {
        return "AttentionOptions(q_format=" + q(enum_name(o.q_format)) + ", kv_format=" + q(enum_name(o.kv_format)) +
               ", causal=" + b(o.causal) + ", bottom_right=" + b(o.bottom_right) +
               ", softmax_scale=" + std::to_string(o.softmax_scale) + ", p_format=" + q(enum_name(o.p_format)) +
               ", max_seqlen_q=" + std::to_string(o.max_seqlen_q) + ", max_seqlen_kv=" + std::to_string(o.max_seqlen_kv) +
               ")";
      });
  nb::class_<GemmOptions>(m, "GemmOptions")
      .def(nb::init<>())
      .def_rw("trans_a", &GemmOptions::trans_a)
      .def_rw("trans_b", &GemmOptions::trans_b)
      .def_rw("accumulate", &GemmOptions::accumulate)
      .def_rw("alpha", &GemmOptions::alpha)
      .def("__repr__", [](const GemmOptions& o) {
        return "GemmOptions(trans_a=" + b(o.trans_a) + ", trans_b=" + b(o.trans_b) + ", accumulate=" + b(o.accumulate) +
               ", alpha=" + std::to_string(o.alpha) + ")";
      });
  nb::class_<YarnParams>(m, "YarnParams")
      .def(nb::init<>())
      .def_static("deepseek_v3", &YarnParams::deepseek_v3)
      .def_rw("enabled", &YarnParams::enabled)
      .def_rw("factor", &YarnParams::factor)
      .def_rw("original_max_position", &YarnParams::original_max_position)
      .def_rw("beta_fast", &YarnParams::beta_fast)
      .def_rw("beta_slow", &YarnParams::beta_slow)
      .def_rw("mscale", &YarnParams::mscale)
      .def_rw("mscale_all_dim", &YarnParams::mscale_all_dim)
      .def("__repr__", [](const YarnParams& y) {
        return "YarnParams(enabled=" + b(y.enabled) + ", factor=" + std::to_string(y.factor) +
               ", original_max_position=" + std::to_string(y.original_max_position) +
               ", beta_fast=" + std::to_string(y.beta_fast) + ", beta_slow=" + std::to_string(y.beta_slow) +
               ", mscale=" + std::to_string(y.mscale) + ", mscale_all_dim=" + std::to_string(y.mscale_all_dim) + ")";
      });
  nb::class_<DequantizeOptions>(m, "DequantizeOptions")
      .def(nb::init<>())
      .def_rw("shape", &DequantizeOptions::shape)
      .def_rw("format", &DequantizeOptions::format)
      .def_rw("scale_layout", &DequantizeOptions::scale_layout)
      .def_rw("qkv_layout", &DequantizeOptions::qkv_layout)
      .def_rw("attention", &DequantizeOptions::attention)
      .def_rw("columnwise", &DequantizeOptions::columnwise);

  // ------------------------------------------------------------------ shapes (what the Python layer and the fakes allocate)
  m.def("quantize_shapes", [](const std::vector<int64_t>& shape, bool swizzle, const std::string& op,
                               const std::string& arg) {
    return shapes_for(op, arg, [&] { return quantize_shapes(shape, swizzle); });
  });
  m.def("attention_shapes", [](const std::vector<int64_t>& shape, QKVLayout layout, bool bhsd, const std::string& op,
                                const std::string& arg) {
    return shapes_for(op, arg, [&] { return attention_shapes(shape, layout, bhsd); });
  });
  // (q shape, codes, rowwise scales, columnwise scales); an error is re-thrown under `op` (the
  // Python function or class that asked), argument and rule unchanged.
  m.def("qproj_shapes", [](int64_t tokens, int64_t heads, const QProjOptions& o, const std::string& op) {
    try {
      const MXFP8Shapes s = qproj_shapes(tokens, heads, o);
      return nb::make_tuple(qproj_q_shape(tokens, heads, o), s.data, s.rowwise_scale, s.columnwise_scale);
    } catch (const Error& e) {
      throw Error(op, e.arg(), e.rule());
    }
  });

  // ------------------------------------------------------------------ MXFP8
  m.def(
      "quantize",
      [](const Desc& x, const OptDesc& rd, const OptDesc& rs, const OptDesc& cd, const OptDesc& cs,
         const QuantizeOptions& o, uintptr_t stream) {
        renamed({{"input", "x"}}, [&] {
          MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
          const TensorDesc xd = to_desc(x);
          nb::gil_scoped_release release;
          quantize(xd, t, o, to_stream(stream));
        });
      },
      nb::arg("x"), nb::arg("rowwise_data").none(), nb::arg("rowwise_scale_inv").none(),
      nb::arg("columnwise_data").none(), nb::arg("columnwise_scale_inv").none(), nb::arg("options"),
      nb::arg("stream"));

  m.def(
      "quantize_attention",
      [](const Desc& x, const OptDesc& rd, const OptDesc& rs, const OptDesc& cd, const OptDesc& cs,
         const AttentionQuantizeOptions& o, uintptr_t stream, const OptDesc& x2) {
        // x2: the second part of torch.cat([x, x2], -1) (ConcatInput), read in place
        renamed({{"input.part0", "x[0]"}, {"input.part1", "x[1]"}, {"input", "x"}}, [&] {
          MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
          const TensorDesc xd = to_desc(x);
          if (x2) {
            const ConcatInput in{xd, to_desc(*x2)};
            nb::gil_scoped_release release;
            quantize_attention(in, t, o, to_stream(stream));
          } else {
            nb::gil_scoped_release release;
            quantize_attention(xd, t, o, to_stream(stream));
          }
        });
      },
      nb::arg("x"), nb::arg("rowwise_data").none(), nb::arg("rowwise_scale_inv").none(),
      nb::arg("columnwise_data").none(), nb::arg("columnwise_scale_inv").none(), nb::arg("options"),
      nb::arg("stream"), nb::arg("x2").none() = nb::none());

  m.def(
      "dequantize",
      [](const Desc& data, const Desc& scale, const Desc& out, const DequantizeOptions& o, uintptr_t stream) {
        renamed({{"input", "q"},
                 {"input.shape", "q.shape"},
                 {"rowwise_data", "q.rowwise_data"},
                 {"rowwise_scale_inv", "q.rowwise_scale_inv"},
                 {"columnwise_data", "q.columnwise_data"},
                 {"columnwise_scale_inv", "q.columnwise_scale_inv"},
                 {"output", "out"}},
                [&] {
                  MXFP8Tensor t;
                  t.shape = o.shape, t.format = o.format, t.scale_layout = o.scale_layout;
                  t.attention = o.attention, t.qkv_layout = o.qkv_layout;
                  (o.columnwise ? t.columnwise_data : t.rowwise_data) = to_desc(data);
                  (o.columnwise ? t.columnwise_scale_inv : t.rowwise_scale_inv) = to_desc(scale);
                  TensorDesc od = to_desc(out);
                  nb::gil_scoped_release release;
                  dequantize(t, od, o.columnwise, to_stream(stream));
                });
      },
      nb::arg("data"), nb::arg("scale"), nb::arg("out"), nb::arg("options"), nb::arg("stream"));

  m.def(
      "swizzle_scales",
      [](const Desc& src, const Desc& dst, int64_t M, int64_t K, bool rowwise, uintptr_t stream) {
        renamed({{"compact", "scales"}}, [&] {
          const TensorDesc s = to_desc(src);
          TensorDesc d = to_desc(dst);
          nb::gil_scoped_release release;
          swizzle_scales(s, d, M, K, rowwise, to_stream(stream));
        });
      },
      nb::arg("scales"), nb::arg("out"), nb::arg("M"), nb::arg("K"), nb::arg("rowwise"), nb::arg("stream"));
  m.def(
      "unswizzle_scales",
      [](const Desc& src, const Desc& dst, int64_t M, int64_t K, bool rowwise, uintptr_t stream) {
        renamed({{"swizzled", "scales"}}, [&] {
          const TensorDesc s = to_desc(src);
          TensorDesc d = to_desc(dst);
          nb::gil_scoped_release release;
          unswizzle_scales(s, d, M, K, rowwise, to_stream(stream));
        });
      },
      nb::arg("scales"), nb::arg("out"), nb::arg("M"), nb::arg("K"), nb::arg("rowwise"), nb::arg("stream"));

  // Phase two for one or several scale tensors in one launch: jobs of (compact scales, BHSD output,
  // 4-D shape, layout, rowwise, the Python name of the compact scales for errors); `op` is the
  // Python function that asked (attention_scales_to_bhsd or to_bhsd), named in errors.
  m.def(
      "attention_scales_to_bhsd",
      [](const std::vector<std::tuple<Desc, Desc, std::vector<int64_t>, QKVLayout, bool, std::string>>& jobs,
         const std::string& op, uintptr_t stream) {
        std::vector<BhsdScaleJob> js;
        for (const auto& [src, dst, shape, layout, rowwise, name] : jobs)
          js.push_back(BhsdScaleJob{to_desc(src), to_desc(dst), shape, layout, rowwise});
        try {
          nb::gil_scoped_release release;
          attention_scales_to_bhsd(js, to_stream(stream));
        } catch (const Error& e) {
          // the C++ API tags a job k of several as "compact[k]" / "shape[k]"; name the Python argument
          for (size_t k = 0; k < jobs.size(); ++k) {
            const std::string tag = jobs.size() > 1 ? "[" + std::to_string(k) + "]" : "";
            const std::string& name = std::get<5>(jobs[k]);
            if (e.arg() == "compact" + tag) throw Error(op, name, e.rule());
            if (e.arg() == "shape" + tag)  // "tensors[i].x_scale_inv" -> "tensors[i].shape"; "scales" -> "shape"
              throw Error(op, name.find('.') == std::string::npos ? "shape" : name.substr(0, name.find('.')) + ".shape",
                          e.rule());
          }
          throw Error(op, e.arg(), e.rule());
        }
      },
      nb::arg("jobs"), nb::arg("op"), nb::arg("stream"));

  // ------------------------------------------------------------------ RoPE
  m.def(
      "apply_rope",
      [](const Desc& x, const Desc& cos, const Desc& sin, const Desc& out, const RopeOptions& o, const OptDesc& cu,
         uintptr_t stream) {
        const TensorDesc xd = to_desc(x), c = to_desc(cos), s = to_desc(sin), cud = opt_desc(cu);
        TensorDesc od = to_desc(out);
        nb::gil_scoped_release release;
        apply_rope(xd, c, s, od, o, cu ? &cud : nullptr, to_stream(stream));
      },
      nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("out"), nb::arg("options"), nb::arg("cu_seqlens").none(),
      nb::arg("stream"));
  m.def(
      "rope_backward",
      [](const Desc& grad, const Desc& cos, const Desc& sin, const Desc& dx, const RopeOptions& o, const OptDesc& cu,
         uintptr_t stream) {
        renamed({{"dx", "out"}}, [&] {
          const TensorDesc g = to_desc(grad), c = to_desc(cos), s = to_desc(sin), cud = opt_desc(cu);
          TensorDesc d = to_desc(dx);
          nb::gil_scoped_release release;
          rope_backward(g, c, s, d, o, cu ? &cud : nullptr, to_stream(stream));
        });
      },
      nb::arg("grad"), nb::arg("cos"), nb::arg("sin"), nb::arg("out"), nb::arg("options"),
      nb::arg("cu_seqlens").none(), nb::arg("stream"));
  m.def(
      "rope_backward_quantize",
      [](const Desc& dq, const Desc& cos, const Desc& sin, const OptDesc& rd, const OptDesc& rs, const OptDesc& cd,
         const OptDesc& cs, const OptDesc& dx, const RopeBackwardQuantizeOptions& o, const OptDesc& cu,
         uintptr_t stream) {
        renamed({{"grad", "dq"}, {"options", "rowwise"}}, [&] {
          MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
          const TensorDesc d = to_desc(dq), c = to_desc(cos), s = to_desc(sin), cud = opt_desc(cu);
          TensorDesc dxd = opt_desc(dx);
          nb::gil_scoped_release release;
          rope_backward_quantize(d, c, s, t, dx ? &dxd : nullptr, o, cu ? &cud : nullptr, to_stream(stream));
        });
      },
      nb::arg("dq"), nb::arg("cos"), nb::arg("sin"), nb::arg("rowwise_data").none(),
      nb::arg("rowwise_scale_inv").none(), nb::arg("columnwise_data").none(), nb::arg("columnwise_scale_inv").none(),
      nb::arg("dx_copy").none(), nb::arg("options"), nb::arg("cu_seqlens").none(), nb::arg("stream"));

  m.def(
      "rope_tables",
      [](const std::vector<double>& positions, int64_t rope_dim, double base, const YarnParams& yarn, RopeStyle style,
         const Desc& cos, const Desc& sin) {
        TensorDesc c = to_desc(cos), s = to_desc(sin);
        try {
          rope_tables(positions, rope_dim, base, yarn, style, c, s);
        } catch (const Error& e) {  // rope_tables checks its arguments through rope_inv_freq
          throw Error("mxmla.rope_tables", e.arg(), e.rule());
        }
      },
      nb::arg("positions"), nb::arg("rope_dim"), nb::arg("base"), nb::arg("yarn"), nb::arg("style"), nb::arg("cos"),
      nb::arg("sin"));
  m.def("rope_inv_freq", &rope_inv_freq, nb::arg("rope_dim"), nb::arg("base"), nb::arg("yarn"));
  m.def("yarn_softmax_scale", &yarn_softmax_scale, nb::arg("head_dim"), nb::arg("yarn"));
  m.def("positions_arange", &positions_arange, nb::arg("n"), nb::arg("offset") = 0);
  m.def("positions_from_cu_seqlens", &positions_from_cu_seqlens, nb::arg("cu_seqlens"));
  m.def("positions_context_parallel", &positions_context_parallel, nb::arg("local_len"), nb::arg("cp_size"),
        nb::arg("cp_rank"));

  // ------------------------------------------------------------------ fused Q up-projection
  m.def(
      "fused_q_uproj_rope_quant",
      [](const Desc& x, const Desc& w, const Desc& cos, const Desc& sin, const OptDesc& rd, const OptDesc& rs,
         const OptDesc& cd, const OptDesc& cs, const OptDesc& q, const QProjOptions& o, uintptr_t stream) {
        renamed({{"options", "rowwise"}}, [&] {
          MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
          const TensorDesc xd = to_desc(x), wd = to_desc(w), c = to_desc(cos), s = to_desc(sin);
          TensorDesc qd = opt_desc(q);
          nb::gil_scoped_release release;
          fused_q_uproj_rope_quant(xd, wd, c, s, t, q ? &qd : nullptr, o, to_stream(stream));
        });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("cos"), nb::arg("sin"), nb::arg("rowwise_data").none(),
      nb::arg("rowwise_scale_inv").none(), nb::arg("columnwise_data").none(), nb::arg("columnwise_scale_inv").none(),
      nb::arg("q").none(), nb::arg("options"), nb::arg("stream"));

  // x, w: MXFP8 operand tuples (see MxOperand; their rowwise copies are read) -- the MXFP8-weight path
  m.def(
      "fused_q_uproj_rope_quant_mx",
      [](const AttnOperand& x, const AttnOperand& w, const Desc& cos, const Desc& sin, const OptDesc& rd,
         const OptDesc& rs, const OptDesc& cd, const OptDesc& cs, const OptDesc& q, const QProjOptions& o,
         uintptr_t stream) {
        renamed({{"options", "rowwise"}}, [&] {
          const HeldOperand hx(x), hw(w);
          if (hx.in.mx == nullptr || hw.in.mx == nullptr)
            throw Error("mxmla.fused_q_uproj_rope_quant", hx.in.mx == nullptr ? "x" : "w",
                        "must be an MXFP8 tensor on this path");
          MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
          const TensorDesc c = to_desc(cos), s = to_desc(sin);
          TensorDesc qd = opt_desc(q);
          nb::gil_scoped_release release;
          fused_q_uproj_rope_quant(*hx.in.mx, *hw.in.mx, c, s, t, q ? &qd : nullptr, o, to_stream(stream));
        });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("cos"), nb::arg("sin"), nb::arg("rowwise_data").none(),
      nb::arg("rowwise_scale_inv").none(), nb::arg("columnwise_data").none(), nb::arg("columnwise_scale_inv").none(),
      nb::arg("q").none(), nb::arg("options"), nb::arg("stream"));

  // ------------------------------------------------------------------ block FP8 (DeepSeek-V3 recipe)
  m.def("block_scale_shape", &block_scale_shape, nb::arg("rows"), nb::arg("cols"), nb::arg("block_rows"));
  nb::class_<BlockQuantizeOptions>(m, "BlockQuantizeOptions")
      .def(nb::init<>())
      .def_rw("block_rows", &BlockQuantizeOptions::block_rows)
      .def_rw("pow2_scales", &BlockQuantizeOptions::pow2_scales)
      .def_rw("transpose", &BlockQuantizeOptions::transpose)
      .def("__repr__", [](const BlockQuantizeOptions& o) {
        return "BlockQuantizeOptions(block_rows=" + std::to_string(o.block_rows) + ", pow2_scales=" + b(o.pow2_scales) +
               ", transpose=" + b(o.transpose) + ")";
      });
  m.def(
      "quantize_blockwise",
      [](const Desc& in, const Desc& data, const Desc& scale_inv, const BlockQuantizeOptions& o, uintptr_t stream) {
        BlockFP8Tensor t{to_desc(data), to_desc(scale_inv), o.block_rows};
        const TensorDesc i = to_desc(in);
        nb::gil_scoped_release release;
        quantize_blockwise(i, t, o, to_stream(stream));
      },
      nb::arg("input"), nb::arg("data"), nb::arg("scale_inv"), nb::arg("options"), nb::arg("stream"));
  m.def(
      "quantize_blockwise_both",
      [](const Desc& in, const Desc& data, const Desc& scale_inv, const Desc& data_t, const Desc& scale_inv_t,
         const BlockQuantizeOptions& o, uintptr_t stream) {
        BlockFP8Tensor t{to_desc(data), to_desc(scale_inv), o.block_rows};
        BlockFP8Tensor tt{to_desc(data_t), to_desc(scale_inv_t), o.block_rows};
        const TensorDesc i = to_desc(in);
        nb::gil_scoped_release release;
        quantize_blockwise(i, t, tt, o, to_stream(stream));
      },
      nb::arg("input"), nb::arg("data"), nb::arg("scale_inv"), nb::arg("data_t"), nb::arg("scale_inv_t"),
      nb::arg("options"), nb::arg("stream"));
  // The block-FP8 GEMM: a, b as (codes, scale_inv, block_rows); out [M, N] bfloat16 or float32.
  m.def(
      "gemm_blockwise",
      [](const Desc& ac, const Desc& as, int64_t abr, const Desc& bc, const Desc& bs, int64_t bbr, const Desc& out,
         const GemmOptions& opts, uintptr_t stream) {
        const BlockFP8Tensor a{to_desc(ac), to_desc(as), abr}, bt{to_desc(bc), to_desc(bs), bbr};
        TensorDesc od = to_desc(out);
        nb::gil_scoped_release release;
        gemm(a, bt, od, opts, to_stream(stream));
      },
      nb::arg("a_data"), nb::arg("a_scale_inv"), nb::arg("a_block_rows"), nb::arg("b_data"), nb::arg("b_scale_inv"),
      nb::arg("b_block_rows"), nb::arg("out"), nb::arg("options"), nb::arg("stream"));
  // x: codes [T, K] + scale_inv [T, ceil(K / 128)]; w: codes [N, K] + scale_inv [ceil(N / 128), ceil(K / 128)]
  m.def(
      "fused_q_uproj_rope_quant_block",
      [](const Desc& xc, const Desc& xs, const Desc& wc, const Desc& ws, const Desc& cos, const Desc& sin,
         const OptDesc& rd, const OptDesc& rs, const OptDesc& cd, const OptDesc& cs, const OptDesc& q,
         const QProjOptions& o, uintptr_t stream) {
        renamed({{"options", "rowwise"}}, [&] {
          MXFP8Tensor t = make_tensor(rd, rs, cd, cs);
          const BlockFP8Tensor x{to_desc(xc), to_desc(xs), 1}, w{to_desc(wc), to_desc(ws), 128};
          const TensorDesc c = to_desc(cos), s = to_desc(sin);
          TensorDesc qd = opt_desc(q);
          nb::gil_scoped_release release;
          fused_q_uproj_rope_quant(x, w, c, s, t, q ? &qd : nullptr, o, to_stream(stream));
        });
      },
      nb::arg("x_data"), nb::arg("x_scale_inv"), nb::arg("w_data"), nb::arg("w_scale_inv"), nb::arg("cos"),
      nb::arg("sin"), nb::arg("rowwise_data").none(), nb::arg("rowwise_scale_inv").none(),
      nb::arg("columnwise_data").none(), nb::arg("columnwise_scale_inv").none(), nb::arg("q").none(),
      nb::arg("options"), nb::arg("stream"));

  // ------------------------------------------------------------------ attention
  // q, k, v: each a bf16 descriptor or an MXFP8 operand tuple (see MxOperand); o: bf16 in q's format
  // with d_v columns; lse: float32 [b, h, s_q] (thd: [h, t]) or None; cu_seqlens_*: int32 [b + 1]
  // on the data's device (thd) or None. Errors name the C++ arguments ('q', 'q.rowwise_data',
  // 'v.columnwise_scale_inv', 'o', 'lse', 'cu_seqlens_q', option fields ...).
  m.def(
      "attention_forward",
      [](const AttnOperand& q, const AttnOperand& k, const AttnOperand& v, const Desc& o, const OptDesc& lse,
         const AttentionOptions& opts, const OptDesc& cu_q, const OptDesc& cu_kv, uintptr_t stream) {
        const HeldOperand hq(q), hk(k), hv(v);
        TensorDesc od = to_desc(o), ld = opt_desc(lse);
        const TensorDesc cqd = opt_desc(cu_q), ckd = opt_desc(cu_kv);
        nb::gil_scoped_release release;
        attention_forward(hq.in, hk.in, hv.in, od, lse ? &ld : nullptr, opts, cu_q ? &cqd : nullptr,
                          cu_kv ? &ckd : nullptr, to_stream(stream));
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("lse").none(), nb::arg("options"),
      nb::arg("cu_seqlens_q").none(), nb::arg("cu_seqlens_kv").none(), nb::arg("stream"));

  // The backward: dout, q, k, v each a bf16 descriptor or an MXFP8 operand tuple with the copies it
  // has (each GEMM reads the copy along its contraction, else the other); o bf16; lse float32; dq,
  // dk, dv bf16 outputs with the shapes of q, k, v in their formats.
  m.def(
      "attention_backward",
      [](const AttnOperand& dout, const AttnOperand& q, const AttnOperand& k, const AttnOperand& v, const Desc& o,
         const Desc& lse, const Desc& dq, const Desc& dk, const Desc& dv, const AttentionOptions& opts,
         bool deterministic, const OptDesc& cu_q, const OptDesc& cu_kv, uintptr_t stream) {
        const HeldOperand hd(dout), hq(q), hk(k), hv(v);
        const TensorDesc od = to_desc(o), ld = to_desc(lse);
        TensorDesc dqd = to_desc(dq), dkd = to_desc(dk), dvd = to_desc(dv);
        const TensorDesc cqd = opt_desc(cu_q), ckd = opt_desc(cu_kv);
        nb::gil_scoped_release release;
        attention_backward(hd.in, hq.in, hk.in, hv.in, od, ld, dqd, dkd, dvd, opts, deterministic,
                           cu_q ? &cqd : nullptr, cu_kv ? &ckd : nullptr, to_stream(stream));
      },
      nb::arg("dout"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("lse"), nb::arg("dq"),
      nb::arg("dk"), nb::arg("dv"), nb::arg("options"), nb::arg("deterministic"), nb::arg("cu_seqlens_q").none(),
      nb::arg("cu_seqlens_kv").none(), nb::arg("stream"));

  // ------------------------------------------------------------------ GEMM
  // a, b: each a bf16 descriptor or an MXFP8 operand tuple (see MxOperand: the direction the GEMM
  // reads present, the other may be None); out: [M, N] bfloat16 or float32. Errors name the C++
  // arguments ('a', 'b.columnwise_data', 'out', 'alpha', ...).
  m.def(
      "gemm",
      [](const AttnOperand& a, const AttnOperand& b, const Desc& out, const GemmOptions& opts, uintptr_t stream) {
        const HeldOperand ha(a), hb(b);
        TensorDesc od = to_desc(out);
        nb::gil_scoped_release release;
        gemm(ha.gemm_input(), hb.gemm_input(), od, opts, to_stream(stream));
      },
      nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("options"), nb::arg("stream"));

  // The MXFP8 Linear's GEMMs with fused quantization (include/mxmla/linear.h): w and x_saved as
  // MXFP8 operand tuples (the copies the call reads present); x_saved's columnwise buffers written by
  // the forward.
  m.def(
      "linear_forward",
      [](const Desc& x, const AttnOperand& w, const Desc& y, const AttnOperand& x_saved, uintptr_t stream) {
        const HeldOperand hw(w), hs(x_saved);
        if (hw.in.mx == nullptr || hs.in.mx == nullptr)
          throw Error("mxmla.linear_forward", hw.in.mx == nullptr ? "w" : "x_saved", "must be an MXFP8 tensor");
        const TensorDesc xd = to_desc(x);
        TensorDesc yd = to_desc(y);
        MXFP8Tensor saved = hs.mx;
        nb::gil_scoped_release release;
        linear_forward(xd, hw.mx, yd, saved, to_stream(stream));
      },
      nb::arg("x"), nb::arg("w"), nb::arg("y"), nb::arg("x_saved"), nb::arg("stream"));
  m.def(
      "linear_backward",
      [](const Desc& dy, const AttnOperand& w, const AttnOperand& x_saved, const OptDesc& dx, const Desc& dw,
         bool accumulate, uintptr_t stream, const OptDesc& dy2) {
        // dy2: the second part of dy = torch.cat([dy, dy2], -1).flatten(-2) (ConcatInput), read in place
        const HeldOperand hw(w), hs(x_saved);
        if (hw.in.mx == nullptr || hs.in.mx == nullptr)
          throw Error("mxmla.linear_backward", hw.in.mx == nullptr ? "w" : "x_saved", "must be an MXFP8 tensor");
        renamed({{"dy.part0", "dy[0]"}, {"dy.part1", "dy[1]"}}, [&] {
          const TensorDesc dyd = to_desc(dy);
          TensorDesc dxd = opt_desc(dx), dwd = to_desc(dw);
          if (dy2) {
            const ConcatInput in{dyd, to_desc(*dy2)};
            nb::gil_scoped_release release;
            linear_backward(in, hw.mx, hs.mx, dx ? &dxd : nullptr, dwd, accumulate, to_stream(stream));
          } else {
            nb::gil_scoped_release release;
            linear_backward(dyd, hw.mx, hs.mx, dx ? &dxd : nullptr, dwd, accumulate, to_stream(stream));
          }
        });
      },
      nb::arg("dy"), nb::arg("w"), nb::arg("x_saved"), nb::arg("dx").none(), nb::arg("dw"), nb::arg("accumulate"),
      nb::arg("stream"), nb::arg("dy2").none() = nb::none());
  m.def(
      "rope_linear_backward",
      [](const Desc& dq, const Desc& cos, const Desc& sin, const RopeOptions& rope, const OptDesc& cu,
         const AttnOperand& w, const AttnOperand& x_saved, const OptDesc& dx, const Desc& dw, bool accumulate,
         uintptr_t stream) {
        const HeldOperand hw(w), hs(x_saved);
        if (hw.in.mx == nullptr || hs.in.mx == nullptr)
          throw Error("mxmla.rope_linear_backward", hw.in.mx == nullptr ? "w" : "x_saved", "must be an MXFP8 tensor");
        renamed({{"grad", "dq"}}, [&] {
          const TensorDesc cud = opt_desc(cu);
          const RopeGrad in{to_desc(dq), to_desc(cos), to_desc(sin), rope, cu ? &cud : nullptr};
          TensorDesc dxd = opt_desc(dx), dwd = to_desc(dw);
          nb::gil_scoped_release release;
          linear_backward(in, hw.mx, hs.mx, dx ? &dxd : nullptr, dwd, accumulate, to_stream(stream));
        });
      },
      nb::arg("dq"), nb::arg("cos"), nb::arg("sin"), nb::arg("rope"), nb::arg("cu_seqlens").none(), nb::arg("w"),
      nb::arg("x_saved"), nb::arg("dx").none(), nb::arg("dw"), nb::arg("accumulate"), nb::arg("stream"));

  m.def("build_info", [] {
    const BuildInfo bi = build_info();
    return nb::make_tuple(bi.version, bi.cuda_enabled, std::string(bi.cuda_archs), bi.cuda_rope);
  });
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_device_description", &cuda_device_description);
  m.def("cuda_pool_usage", [](bool reset_high) {
    const PoolUsage u = cuda_pool_usage(reset_high);
    return nb::make_tuple(u.current, u.high);
  });
  m.def("cuda_pool_release", &cuda_pool_release);
}
