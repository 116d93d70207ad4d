// mxmla — the attention forward API (include/mxmla/attention.h, SPEC §5): validation, the operands'
// element strides and scale geometry (common/attention_ops.h), dispatch to the CPU reference or the
// SM90 kernel.
//
// Operands. A bf16 operand is its descriptor: the shape in its format ([s, b, h, d], [b, s, h, d],
// [b, h, s, d] or [t, h, d]), any strides with the head dim contiguous. An MXFP8 operand is read
// through one direction (Q, K: rowwise; V: columnwise); that direction's codes descriptor plays
// the bf16 descriptor's role (shape in the format, any strides: a view of the codes, e.g. one of
// packed Q/K/V), and the tensor's `shape`, `scale_layout` and `attention` say how the scales were
// laid out when it was quantized:
//   attention (quantize_attention, sbhd / bshd; compact or BHSD scales): shape = the codes' shape,
//     scales per (sequence, head) as the library writes them (common/mxfp8_common.h);
//   plain quantize (compact or swizzled scales): `shape` is the shape it was quantized as, the
//     codes' shape with adjacent dimensions merged (the elements in the same order), flattened to
//     [M, K] with K = d (rows = every leading index: (s, b, h), (b, s, h), (b, h, s), (t, h)) or
//     K = h·d (token-major, e.g. rope_backward_quantize's [tokens, h·d]: rows = tokens in memory
//     order, sbhd / bshd / thd).
// Anything else (a permuted quantization, BHSD scales without `attention`, ...) is an Error: the
// scales could not be mapped to the elements.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/attention_ops.h"
#include "common/device.h"
#include "common/text.h"
#include "mxmla/attention.h"

#if MXMLA_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/attention_stage.h"  // clamp_cu_seqlens
#include "cuda/cuda_check.h"
#endif

namespace mxmla {

namespace {

constexpr const char* kOp = "mxmla.attention";

[[noreturn]] void fail(const std::string& arg, const std::string& rule) { throw Error(kOp, arg, rule); }

using detail::shape_str;

const char* format_name(AttnFormat f) {
  switch (f) {
    case AttnFormat::kSBHD: return "sbhd";
    case AttnFormat::kBSHD: return "bshd";
    case AttnFormat::kBHSD: return "bhsd";
    case AttnFormat::kTHD: return "thd";
  }
  return "?";
}
const char* format_dims(AttnFormat f) {
  switch (f) {
    case AttnFormat::kSBHD: return "[s, b, h, d]";
    case AttnFormat::kBSHD: return "[b, s, h, d]";
    case AttnFormat::kBHSD: return "[b, h, s, d]";
    case AttnFormat::kTHD: return "[t, h, d]";
  }
  return "?";
}

// Sizes of an operand in its format (thd: B is not known from the tensor, S is its token count).
struct Dims {
  int64_t B = 0, S = 0, H = 0, D = 0;
};

Dims dims_of(const std::string& arg, const TensorDesc& t, AttnFormat f) {
  const size_t rank = f == AttnFormat::kTHD ? 3 : 4;
  if (t.shape.size() != rank)
    fail(arg, "must be " + std::to_string(rank) + "-D " + format_dims(f) + " (format " + format_name(f) +
                  "), got shape " + shape_str(t.shape));
  if (!t.strides.empty() && t.strides.size() != rank)
    fail(arg, "has " + std::to_string(t.strides.size()) + " strides for " + std::to_string(rank) + " dimensions");
  for (int64_t s : t.shape)
    if (s < 0) fail(arg, "shape " + shape_str(t.shape) + " has a negative size");
  const auto& s = t.shape;
  Dims d;
  switch (f) {
    case AttnFormat::kSBHD: d.S = s[0], d.B = s[1], d.H = s[2]; break;
    case AttnFormat::kBSHD: d.B = s[0], d.S = s[1], d.H = s[2]; break;
    case AttnFormat::kBHSD: d.B = s[0], d.H = s[1], d.S = s[2]; break;
    case AttnFormat::kTHD: d.S = s[0], d.H = s[1]; break;
  }
  d.D = s.back();
  if (t.numel() > 0 && t.stride(static_cast<int64_t>(rank) - 1) != 1)
    fail(arg, "head dimension must be contiguous (stride 1), got stride " + std::to_string(t.stride(rank - 1)));
  if (t.numel() > 0 && t.data == nullptr) fail(arg, "data pointer is null");
  return d;
}

detail::AttnTensorView view_of(const TensorDesc& t, AttnFormat f) {
  detail::AttnTensorView v;
  v.data = t.data;
  switch (f) {
    case AttnFormat::kSBHD: v.st_s = t.stride(0), v.st_b = t.stride(1), v.st_h = t.stride(2); break;
    case AttnFormat::kBSHD: v.st_b = t.stride(0), v.st_s = t.stride(1), v.st_h = t.stride(2); break;
    case AttnFormat::kBHSD: v.st_b = t.stride(0), v.st_h = t.stride(1), v.st_s = t.stride(2); break;
    case AttnFormat::kTHD: v.st_b = 0, v.st_s = t.stride(0), v.st_h = t.stride(1); break;
  }
  return v;
}

// Whether `merged` is `shape` with runs of adjacent dimensions multiplied together (every prefix
// product of `merged` is one of `shape`'s; sizes > 0).
bool merges_dims(const std::vector<int64_t>& merged, const std::vector<int64_t>& shape) {
  if (merged.empty() || numel(merged) != numel(shape)) return false;
  std::vector<int64_t> prefix;
  int64_t a = 1;
  for (int64_t s : shape) prefix.push_back(a *= s);
  a = 1;
  for (int64_t m : merged)
    if (std::find(prefix.begin(), prefix.end(), a *= m) == prefix.end()) return false;
  return true;
}

struct Operand {
  std::string name;      // "q", "k", "v"
  std::string data_arg;  // "q" (bf16) or "q.rowwise_data" (codes)
  std::string dir;       // "rowwise" / "columnwise" (MXFP8)
  bool rowwise = true;
  const TensorDesc* data = nullptr;    // bf16 values or FP8 codes
  const TensorDesc* scales = nullptr;  // MXFP8 only
  const MXFP8Tensor* mx = nullptr;
  Dims dims;
  detail::AttnTensorView view;
  detail::AttnScaleView sc;
};

Operand read_operand(const char* name, const AttnInput& in, AttnFormat f, bool rowwise) {
  Operand op;
  op.name = name, op.rowwise = rowwise, op.dir = rowwise ? "rowwise" : "columnwise";
  if ((in.bf16 == nullptr) == (in.mx == nullptr))
    fail(name, "give exactly one of bf16 data (AttnInput::bf16) or an MXFP8 tensor (AttnInput::mx)");
  if (in.bf16 != nullptr) {
    op.data = in.bf16, op.data_arg = name;
    if (in.bf16->dtype != DType::kBFloat16)
      fail(name, std::string("dtype ") + dtype_name(in.bf16->dtype) + " must be bfloat16 (or pass an MXFP8 tensor)");
  } else {
    op.mx = in.mx;
    op.data = rowwise ? &in.mx->rowwise_data : &in.mx->columnwise_data;
    op.scales = rowwise ? &in.mx->rowwise_scale_inv : &in.mx->columnwise_scale_inv;
    op.data_arg = op.name + "." + op.dir + "_data";
    if (op.data->data == nullptr && (op.data->shape.empty() || op.data->numel() > 0))
      fail(op.data_arg, rowwise ? "is absent: Q and K are read through their rowwise copy (blocks of 32 along the "
                                  "head dim); quantize with rowwise enabled"
                                : "is absent: V is read through its columnwise copy (blocks of 32 along the keys); "
                                  "quantize with columnwise enabled");
    const DType want = in.mx->format == Fp8Format::kE4M3 ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
    if (op.data->dtype != DType::kUInt8 && op.data->dtype != want)
      fail(op.data_arg, std::string("dtype ") + dtype_name(op.data->dtype) + " must be uint8 or " + dtype_name(want));
  }
  op.dims = dims_of(op.data_arg, *op.data, f);
  op.view = view_of(*op.data, f);
  return op;
}

// The AttnScaleView of an MXFP8 operand (see the file comment), its scale descriptor checked.
void scale_geometry(Operand& op, AttnFormat f) {
  using detail::MapMode;
  const MXFP8Tensor& mx = *op.mx;
  const Dims& d = op.dims;
  const std::string scale_arg = op.name + "." + op.dir + "_scale_inv";
  const int64_t HD = d.H * d.D;
  detail::AttnScaleView& sc = op.sc;
  std::vector<int64_t> want;
  if (mx.attention) {
    const bool sbhd = f == AttnFormat::kSBHD;
    const QKVLayout lay = sbhd ? QKVLayout::kSBHD : QKVLayout::kBSHD;
    const char* lay_name = mx.qkv_layout == QKVLayout::kSBHD ? "sbhd" : "bshd";
    if ((f != AttnFormat::kSBHD && f != AttnFormat::kBSHD) || mx.qkv_layout != lay)
      fail(op.name, std::string("is an attention-quantized MXFP8 tensor in layout ") + lay_name +
                        " (quantize_attention): its format must be " + lay_name + ", not " + format_name(f));
    if (mx.scale_layout == ScaleLayout::kSwizzled)
      fail(op.name, "is attention-quantized but has swizzled scales (quantize_attention writes compact or BHSD scales)");
    if (mx.shape != op.data->shape)
      fail(op.name + ".shape", shape_str(mx.shape) + " must equal the shape of its codes " + shape_str(op.data->shape) +
                                   " (an attention-quantized tensor is read in its own layout)");
    const bool bhsd = mx.scale_layout == ScaleLayout::kBHSD;
    const MXFP8Shapes s = attention_shapes(mx.shape, lay, bhsd);
    want = op.rowwise ? s.rowwise_scale : s.columnwise_scale;
    // quantize_attention's [batch, rows, cols] view: sbhd [1, s, b*h*d], bshd [b, s, h*d]
    const MapMode mode = bhsd ? MapMode::kBHSD : MapMode::kCompact;
    const int64_t batch = sbhd ? 1 : d.B, cols = (sbhd ? d.B : 1) * HD;
    sc.map = op.rowwise ? detail::make_row_map(mode, batch, d.S, cols, d.H, d.D)
                        : detail::make_col_map(mode, batch, d.S, cols, d.H, d.D);
    sc.bi_b = sbhd ? 0 : 1;
    sc.row_s = 1;
    sc.col_b = sbhd ? HD : 0, sc.col_h = d.D;
  } else {
    if (mx.scale_layout == ScaleLayout::kBHSD)
      fail(op.name, "has BHSD scales but is not marked attention-quantized (MXFP8Tensor::attention); BHSD scales "
                    "come from quantize_attention");
    const int64_t K = mx.shape.empty() ? 0 : mx.shape.back();
    const bool token_major = K == HD && K != d.D;
    const bool mergeable = op.data->numel() == 0 || merges_dims(mx.shape, op.data->shape);
    if (!mergeable || (K != d.D && !token_major) || (token_major && f == AttnFormat::kBHSD))
      fail(op.name + ".shape",
           "the MXFP8 tensor was quantized as " + shape_str(mx.shape) + ", which cannot be read as its codes " +
               shape_str(op.data->shape) + " in format " + format_name(f) +
               ": the quantized shape must be the codes' shape with adjacent dimensions merged and end in the head "
               "dim d (or h*d, tokens major, for sbhd / bshd / thd)");
    const int64_t M = K > 0 ? numel(mx.shape) / K : 0;
    const bool swz = mx.scale_layout == ScaleLayout::kSwizzled;
    const MXFP8Shapes s = quantize_shapes(mx.shape, swz);
    want = op.rowwise ? s.rowwise_scale : s.columnwise_scale;
    const MapMode mode = swz ? MapMode::kSwizzled : MapMode::kCompact;
    sc.map = op.rowwise ? detail::make_row_map(mode, 1, M, K) : detail::make_col_map(mode, 1, M, K);
    if (!token_major) {  // row = the element's leading index, column = d
      switch (f) {
        case AttnFormat::kSBHD: sc.row_s = d.B * d.H, sc.row_b = d.H, sc.row_h = 1; break;
        case AttnFormat::kBSHD: sc.row_s = d.H, sc.row_b = d.S * d.H, sc.row_h = 1; break;
        case AttnFormat::kBHSD: sc.row_s = 1, sc.row_b = d.H * d.S, sc.row_h = d.S; break;
        case AttnFormat::kTHD: sc.row_s = d.H, sc.row_h = 1; break;
      }
    } else {  // row = the token, column = h*d + d
      switch (f) {
        case AttnFormat::kSBHD: sc.row_s = d.B, sc.row_b = 1; break;
        case AttnFormat::kBSHD: sc.row_s = 1, sc.row_b = d.S; break;
        default: sc.row_s = 1; break;  // thd
      }
      sc.col_h = d.D;
    }
  }
  const TensorDesc& t = *op.scales;
  if (t.shape != want)
    fail(scale_arg, "shape " + shape_str(t.shape) + " must be " + shape_str(want) + " (the " + op.dir +
                        " scales of an MXFP8 tensor of shape " + shape_str(mx.shape) + ")");
  if (t.dtype != DType::kUInt8 && t.dtype != DType::kE8M0)
    fail(scale_arg, std::string("dtype ") + dtype_name(t.dtype) + " must be uint8 or e8m0");
  if (!t.strides.empty() && t.strides.size() != t.shape.size()) fail(scale_arg, "has strides that do not match its shape");
  if (!t.is_contiguous()) fail(scale_arg, "must be contiguous");
  if (t.numel() > 0 && t.data == nullptr) fail(scale_arg, "data pointer is null");
  sc.ptr = static_cast<const uint8_t*>(t.data);
}

// Q, K, V of one precision and FP8 format; every operand read on q's device (returned).
Device check_kinds(const Operand& Q, std::initializer_list<const Operand*> kv,
                   std::initializer_list<const Operand*> all) {
  const bool fp8 = Q.mx != nullptr;
  for (const Operand* x : kv) {
    if ((x->mx != nullptr) != fp8)
      fail(x->name, std::string("is ") + (x->mx ? "MXFP8" : "bfloat16") + " but q is " + (fp8 ? "MXFP8" : "bfloat16") +
                        ": Q, K and V must all be bfloat16 or all MXFP8");
    if (fp8 && x->mx->format != Q.mx->format)
      fail(x->name, std::string("FP8 format ") + (x->mx->format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") +
                        " differs from q's: Q, K and V must share one format");
  }
  const Device dev = Q.data->device;
  for (const Operand* x : all) {
    if (x->data->device != dev)
      fail(x->data_arg, "is on " + detail::device_str(x->data->device) + " but q is on " + detail::device_str(dev) + ": all operands must be on one device");
    if (x->scales != nullptr && x->scales->device != dev)
      fail(x->name + "." + x->dir + "_scale_inv",
           "is on " + detail::device_str(x->scales->device) + " but q is on " + detail::device_str(dev) + ": all operands must be on one device");
  }
  return dev;
}

// The sizes of q, k, v agree (batch, keys, heads, head dims, GQA).
void check_sizes(const Dims& dq, const Dims& dk, const Dims& dv, bool thd) {
  if (!thd && dk.B != dq.B) fail("k", "batch size " + std::to_string(dk.B) + " does not match q's " + std::to_string(dq.B));
  if (!thd && dv.B != dq.B) fail("v", "batch size " + std::to_string(dv.B) + " does not match q's " + std::to_string(dq.B));
  if (dv.S != dk.S)
    fail("v", std::string("has ") + std::to_string(dv.S) + (thd ? " tokens" : " keys") + " but k has " + std::to_string(dk.S));
  if (dv.H != dk.H) fail("v", "has " + std::to_string(dv.H) + " heads but k has " + std::to_string(dk.H));
  if (dk.D != dq.D) fail("k", "head dim " + std::to_string(dk.D) + " does not match q's d_qk = " + std::to_string(dq.D));
  if (dq.D <= 0 || dq.D % 32 != 0)
    fail("q", "head dim d_qk = " + std::to_string(dq.D) + " must be a positive multiple of 32 (MXFP8 blocks)");
  if (dv.D <= 0 || dv.D % 32 != 0)
    fail("v", "head dim d_v = " + std::to_string(dv.D) + " must be a positive multiple of 32 (MXFP8 blocks)");
  if (dk.H < 1) fail("k", "must have at least one head");
  if (dq.H % dk.H != 0)
    fail("q", "has " + std::to_string(dq.H) + " heads, not a multiple of k's " + std::to_string(dk.H) +
                  " (grouped-query attention needs h % h_kv == 0)");
}

void check_cu_seqlens(const char* arg, const TensorDesc* cu, const Device& dev) {
  if (cu == nullptr) fail(arg, "is required for the thd format (int32 [b + 1], cumulative sequence lengths)");
  if (cu->dtype != DType::kInt32) fail(arg, std::string("dtype ") + dtype_name(cu->dtype) + " must be int32");
  if (cu->ndim() != 1 || cu->shape[0] < 1) fail(arg, "must be 1-D [b + 1], got shape " + shape_str(cu->shape));
  if (cu->stride(0) != 1 && cu->shape[0] > 1) fail(arg, "must be contiguous");
  if (cu->data == nullptr) fail(arg, "data pointer is null");
  if (cu->device != dev) fail(arg, "is on " + detail::device_str(cu->device) + " but q is on " + detail::device_str(dev) + " (cu_seqlens live on the data's device)");
}

// The number of sequences: q's batch, or (thd) the length of cu_seqlens minus one, both checked.
int64_t batch_count(int64_t q_batch, bool thd, const TensorDesc* cu_q, const TensorDesc* cu_kv, const Device& dev) {
  if (!thd) {
    if (cu_q != nullptr) fail("cu_seqlens_q", "is only for the thd format");
    if (cu_kv != nullptr) fail("cu_seqlens_kv", "is only for the thd format");
    return q_batch;
  }
  check_cu_seqlens("cu_seqlens_q", cu_q, dev);
  check_cu_seqlens("cu_seqlens_kv", cu_kv, dev);
  if (cu_kv->shape[0] != cu_q->shape[0])
    fail("cu_seqlens_kv", "has " + std::to_string(cu_kv->shape[0]) + " entries but cu_seqlens_q has " +
                              std::to_string(cu_q->shape[0]) + " (both are [b + 1])");
  return cu_q->shape[0] - 1;
}

// Checks host cu_seqlens values; returns the longest sequence.
int64_t check_lengths(const char* arg, const int32_t* cu, int64_t n, int64_t tokens, const char* who) {
  if (cu[0] != 0) fail(arg, "must start at 0, got " + std::to_string(cu[0]));
  int64_t longest = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (cu[i] < cu[i - 1]) fail(arg, "must be non-decreasing (entry " + std::to_string(i) + " is smaller than the one before)");
    longest = std::max<int64_t>(longest, cu[i] - cu[i - 1]);
  }
  if (cu[n - 1] > tokens)
    fail(arg, "last entry " + std::to_string(cu[n - 1]) + " exceeds the " + std::to_string(tokens) + " tokens of " + who);
  return longest;
}

// The longest query and key sequences of host cu_seqlens (checked), and the caller's bounds against them.
void longest_sequences(const int32_t* cq, const int32_t* ckv, int64_t B, int64_t q_tokens, int64_t kv_tokens,
                       const AttentionOptions& opts, int64_t& lq, int64_t& lkv) {
  lq = check_lengths("cu_seqlens_q", cq, B + 1, q_tokens, "q");
  lkv = check_lengths("cu_seqlens_kv", ckv, B + 1, kv_tokens, "k and v");
  if (opts.max_seqlen_q > 0 && opts.max_seqlen_q < lq)
    fail("max_seqlen_q", std::to_string(opts.max_seqlen_q) + " is smaller than the longest query sequence (" +
                             std::to_string(lq) + ")");
  if (opts.max_seqlen_kv > 0 && opts.max_seqlen_kv < lkv)
    fail("max_seqlen_kv", std::to_string(opts.max_seqlen_kv) + " is smaller than the longest key sequence (" +
                              std::to_string(lkv) + ")");
}

#if MXMLA_WITH_CUDA
// The SM90 kernel's requirements (TMA): 16-byte aligned data and strides of 16 bytes, a kernel
// instantiation for the head dims, V's scale blocks along the keys, 32-bit tile indices.
void check_cuda(const detail::AttentionProblem& p, const std::vector<const Operand*>& ops, const TensorDesc& o,
                const TensorDesc* lse, const TensorDesc* cu_q, const TensorDesc* cu_kv, int index) {
  if (!detail::attention_cuda_supports(p.Dqk, p.Dv))
    fail("q", "head dims d_qk = " + std::to_string(p.Dqk) + ", d_v = " + std::to_string(p.Dv) +
                  ": the SM90 kernel has no instantiation for this pair (use CPU tensors for the reference)");
  auto tma = [&](const std::string& arg, const TensorDesc& t) {
    if (t.numel() == 0) return;
    detail::check_cuda_pointer(kOp, arg.c_str(), t.data, index);
    const int64_t es = dtype_size(t.dtype);
    if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) fail(arg, "data pointer must be 16-byte aligned on the CUDA path (TMA)");
    for (int64_t i = 0; i + 1 < t.ndim(); ++i)
      if (t.shape[i] > 1 && (t.stride(i) < 0 || (t.stride(i) * es) % 16 != 0))
        fail(arg, "strides " + shape_str(t.strides) +
                      ": every stride but the head dim's must be a non-negative multiple of 16 bytes on the CUDA path (TMA)");
  };
  for (const Operand* op : ops) {
    tma(op->data_arg, *op->data);
    if (op->scales != nullptr && op->scales->numel() > 0)
      detail::check_cuda_pointer(kOp, (op->name + "." + op->dir + "_scale_inv").c_str(), op->scales->data, index);
  }
  tma("o", o);
  if (lse != nullptr && lse->numel() > 0) detail::check_cuda_pointer(kOp, "lse", lse->data, index);
  if (cu_q != nullptr) detail::check_cuda_pointer(kOp, "cu_seqlens_q", cu_q->data, index);
  if (cu_kv != nullptr) detail::check_cuda_pointer(kOp, "cu_seqlens_kv", cu_kv->data, index);
  if (p.fp8 && p.v_sc.row_s != 1)
    fail("v", "its columnwise scale blocks run across heads or sequences (quantized as a tensor whose rows are not "
              "the keys of one head); the CUDA kernel needs blocks of 32 consecutive keys: quantize V with "
              "quantize_attention, or as [tokens, h*d] (bshd, thd) or [b, h, s, d] (bhsd); the CPU reference reads any layout");
  // the kernels' 32-bit tile arithmetic: a length rounded up to whole 128-row tiles, tile indices and
  // the dynamic order's claims (up to the tiles + the grid)
  const int64_t tiles = p.B * p.H * detail::ceil_div(p.Sq, 128), max_len = detail::kMaxCudaExtent;
  if (p.Sq > max_len || p.Skv > max_len)
    fail(p.Sq > max_len ? "q" : "k", "has sequences of " + std::to_string(std::max(p.Sq, p.Skv)) +
                                         " tokens: the CUDA kernels take at most 2^31 - 256 (32-bit tile indices)");
  if (p.B >= (int64_t{1} << 31) || tiles > (int64_t{1} << 30))
    fail("q", "has " + std::to_string(tiles) + " (sequence, head, 128-row) tiles: the CUDA kernels take at most 2^30");
}

// cu_seqlens copied to the host (stream-ordered: they may be written on `stream`).
std::vector<int32_t> download(const TensorDesc& cu, Stream stream) {
  std::vector<int32_t> h(static_cast<size_t>(cu.shape[0]));
  MXMLA_CUDA_CHECK(cudaMemcpyAsync(h.data(), cu.data, h.size() * 4, cudaMemcpyDeviceToHost, stream));
  MXMLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return h;
}
#endif

// cu_seqlens readable on the host: the descriptors' memory (CPU), or copies (CUDA: a synchronizing
// copy on `stream`, the pointers checked first).
struct HostCu {
  std::vector<int32_t> hq, hkv;
  const int32_t *q = nullptr, *kv = nullptr;
};
HostCu host_cu(const char* op, const TensorDesc& cu_q, const TensorDesc& cu_kv, bool on_cuda, const Device& dev,
               Stream stream) {
  HostCu h;
  h.q = static_cast<const int32_t*>(cu_q.data), h.kv = static_cast<const int32_t*>(cu_kv.data);
#if MXMLA_WITH_CUDA
  if (on_cuda) {
    detail::check_cuda_pointer(op, "cu_seqlens_q", cu_q.data, dev.index);
    detail::check_cuda_pointer(op, "cu_seqlens_kv", cu_kv.data, dev.index);
    detail::CudaDeviceGuard guard(dev.index);
    h.hq = download(cu_q, stream), h.hkv = download(cu_kv, stream);
    h.q = h.hq.data(), h.kv = h.hkv.data();
  }
#else
  (void)op, (void)on_cuda, (void)dev, (void)stream;
#endif
  return h;
}

// thd on CUDA with both max_seqlen bounds: the caller's bounds size the grids and cu_seqlens are
// never copied to the host (no stream synchronization); the kernels read a clamped device copy.
bool lengths_on_device_only(bool thd, bool on_cuda, const AttentionOptions& opts) {
  return thd && on_cuda && opts.max_seqlen_q > 0 && opts.max_seqlen_kv > 0;
}

#if MXMLA_WITH_CUDA
// That copy (detail::clamp_cu_seqlens), queued on the stream; p's cu_seqlens then point at it. Keep
// the returned scratch until the call's kernels are queued (it is freed on the stream after them).
template <class Problem>
std::unique_ptr<detail::StreamScratch> clamp_lengths(const char* op, Problem& p, Stream stream) {
  return detail::clamp_cu_seqlens(op, p.cu_q, p.cu_kv, p.B, p.total_q, p.total_kv, p.Sq, p.Skv,
                                  reinterpret_cast<cudaStream_t>(stream));
}
#endif

}  // namespace

void attention_forward(const AttnInput& q, const AttnInput& k, const AttnInput& v, TensorDesc& o, TensorDesc* lse,
                       const AttentionOptions& opts, const TensorDesc* cu_seqlens_q, const TensorDesc* cu_seqlens_kv,
                       Stream stream) {
  const bool thd = opts.q_format == AttnFormat::kTHD;
  if (thd != (opts.kv_format == AttnFormat::kTHD))
    fail("kv_format", std::string("q_format and kv_format must both be thd (packed sequences) or neither; got q ") +
                          format_name(opts.q_format) + ", kv " + format_name(opts.kv_format));
  if (opts.p_format != PFormat::kBF16 && opts.p_format != PFormat::kE4M3) fail("p_format", "must be bf16 or e4m3");
  Operand Q = read_operand("q", q, opts.q_format, true);
  Operand K = read_operand("k", k, opts.kv_format, true);
  Operand V = read_operand("v", v, opts.kv_format, false);

  // one precision, one FP8 format, one device
  const bool fp8 = Q.mx != nullptr;
  const Device dev = check_kinds(Q, {&K, &V}, {&Q, &K, &V});

  // sizes
  const Dims &dq = Q.dims, &dk = K.dims, &dv = V.dims;
  check_sizes(dq, dk, dv, thd);
  if (fp8)
    for (Operand* x : {&Q, &K, &V}) scale_geometry(*x, x == &Q ? opts.q_format : opts.kv_format);

  // o, cu_seqlens, lse
  std::vector<int64_t> oshape = Q.data->shape;
  oshape.back() = dv.D;
  if (o.shape != oshape)
    fail("o", "shape " + shape_str(o.shape) + " must be " + shape_str(oshape) + " (q's shape with the head dim d_v = " +
                  std::to_string(dv.D) + ")");
  dims_of("o", o, opts.q_format);
  if (o.dtype != DType::kBFloat16) fail("o", std::string("dtype ") + dtype_name(o.dtype) + " must be bfloat16");
  if (o.device != dev) fail("o", "is on " + detail::device_str(o.device) + " but q is on " + detail::device_str(dev));
  const int64_t B = batch_count(dq.B, thd, cu_seqlens_q, cu_seqlens_kv, dev);
  if (lse != nullptr) {
    const std::vector<int64_t> want = thd ? std::vector<int64_t>{dq.H, dq.S} : std::vector<int64_t>{B, dq.H, dq.S};
    if (lse->shape != want)
      fail("lse", "shape " + shape_str(lse->shape) + " must be " + shape_str(want) + (thd ? " ([h, t])" : " ([b, h, s_q])"));
    if (lse->dtype != DType::kFloat32) fail("lse", std::string("dtype ") + dtype_name(lse->dtype) + " must be float32");
    if ((!lse->strides.empty() && lse->strides.size() != lse->shape.size()) || !lse->is_contiguous())
      fail("lse", "must be contiguous");
    if (lse->numel() > 0 && lse->data == nullptr) fail("lse", "data pointer is null");
    if (lse->device != dev) fail("lse", "is on " + detail::device_str(lse->device) + " but q is on " + detail::device_str(dev));
  }
  if (!std::isfinite(opts.softmax_scale)) fail("softmax_scale", "must be finite, got " + std::to_string(opts.softmax_scale));
  if (opts.max_seqlen_q < 0) fail("max_seqlen_q", "must not be negative");
  if (opts.max_seqlen_kv < 0) fail("max_seqlen_kv", "must not be negative");

  detail::AttentionProblem p;
  p.B = B, p.H = dq.H, p.Hkv = dk.H, p.Dqk = dq.D, p.Dv = dv.D;
  p.Sq = dq.S, p.Skv = dk.S;
  p.thd = thd;
  p.fp8 = fp8, p.fmt = fp8 ? Q.mx->format : Fp8Format::kE4M3;
  p.q = Q.view, p.k = K.view, p.v = V.view;
  p.q_sc = Q.sc, p.k_sc = K.sc, p.v_sc = V.sc;
  p.causal = opts.causal, p.bottom_right = opts.bottom_right;
  p.softmax_scale = static_cast<float>(opts.softmax_scale != 0.0 ? opts.softmax_scale : 1.0 / std::sqrt(double(dq.D)));
  p.p_format = opts.p_format;
  const detail::AttnTensorView ov = view_of(o, opts.q_format);
  p.o = static_cast<uint16_t*>(o.data), p.o_st_b = ov.st_b, p.o_st_s = ov.st_s, p.o_st_h = ov.st_h;
  p.lse = lse != nullptr ? static_cast<float*>(lse->data) : nullptr;

  const bool on_cuda = dev.type == DeviceType::kCUDA;
#if !MXMLA_WITH_CUDA
  if (on_cuda) fail("q", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif
  const bool cu_device_only = lengths_on_device_only(thd, on_cuda, opts);
  if (thd) {
    // Sequence lengths: read on the host (the CPU reference; or CUDA without both max_seqlen
    // bounds, a synchronizing copy), else the caller's bounds, not checked against the device data
    // (the kernels read a clamped copy: clamp_cu_seqlens).
    p.cu_q = static_cast<const int32_t*>(cu_seqlens_q->data);
    p.cu_kv = static_cast<const int32_t*>(cu_seqlens_kv->data);
    p.total_q = dq.S, p.total_kv = dk.S;  // the packed extents (lse rows: [h, t])
    p.Sq = opts.max_seqlen_q, p.Skv = opts.max_seqlen_kv;
    if (!cu_device_only) {
      const HostCu h = host_cu(kOp, *cu_seqlens_q, *cu_seqlens_kv, on_cuda, dev, stream);
      int64_t lq = 0, lkv = 0;
      longest_sequences(h.q, h.kv, B, dq.S, dk.S, opts, lq, lkv);
      if (opts.max_seqlen_q == 0) p.Sq = lq;
      if (opts.max_seqlen_kv == 0) p.Skv = lkv;
    }
    p.Sq = std::min(p.Sq, dq.S), p.Skv = std::min(p.Skv, dk.S);  // no sequence is longer than its tokens
  }
  if (p.B == 0 || p.H == 0 || p.Sq == 0) return;  // no query rows

  if (!on_cuda) return detail::attention_fwd_cpu(p);
#if MXMLA_WITH_CUDA
  check_cuda(p, {&Q, &K, &V}, o, lse, cu_seqlens_q, cu_seqlens_kv, dev.index);
  detail::CudaDeviceGuard guard(dev.index);
  const std::unique_ptr<detail::StreamScratch> cu_copy = cu_device_only ? clamp_lengths(kOp, p, stream) : nullptr;
  detail::attention_fwd_cuda(p, stream);
#else
  (void)stream;
#endif
}

}  // namespace mxmla

// ------------------------------------------------------------------------------------------ backward
namespace mxmla {

namespace {

constexpr const char* kBwdOp = "mxmla.attention_backward";

// The copy a GEMM reads: the preferred one (blocks along its contraction), else the other one when
// the preferred copy is absent (bf16 operands have no copies).
bool pick_rowwise(const AttnInput& in, bool prefer_rowwise) {
  if (in.mx == nullptr) return prefer_rowwise;
  const TensorDesc& want = prefer_rowwise ? in.mx->rowwise_data : in.mx->columnwise_data;
  const TensorDesc& other = prefer_rowwise ? in.mx->columnwise_data : in.mx->rowwise_data;
  const bool absent = want.data == nullptr && (want.shape.empty() || want.numel() > 0);
  const bool other_there = other.data != nullptr || (!other.shape.empty() && other.numel() == 0);
  return absent && other_there ? !prefer_rowwise : prefer_rowwise;
}

// One read of an operand in the backward (an Error from the forward's helpers is renamed to the
// backward's op).
Operand read_bwd(const char* name, const AttnInput& in, AttnFormat f, bool prefer_rowwise) {
  try {
    Operand op = read_operand(name, in, f, pick_rowwise(in, prefer_rowwise));
    if (op.mx != nullptr) scale_geometry(op, f);
    return op;
  } catch (const Error& e) {
    throw Error(kBwdOp, e.arg(), e.rule());
  }
}

detail::AttnRead read_of(const Operand& op) {
  detail::AttnRead r;
  r.view = op.view, r.sc = op.sc, r.fp8 = op.mx != nullptr, r.rowwise = op.rowwise;
  r.fmt = op.mx != nullptr ? op.mx->format : Fp8Format::kE4M3;
  return r;
}

[[noreturn]] void bfail(const std::string& arg, const std::string& rule) { throw Error(kBwdOp, arg, rule); }

// A bf16 tensor of the backward (o, dq, dk, dv): its shape, dtype, device and layout checked.
detail::AttnTensorView bf16_tensor(const char* arg, const TensorDesc& t, const std::vector<int64_t>& shape,
                                   AttnFormat f, const Device& dev, const char* what) {
  if (t.shape != shape) bfail(arg, "shape " + shape_str(t.shape) + " must be " + shape_str(shape) + " (" + what + ")");
  try {
    dims_of(arg, t, f);
  } catch (const Error& e) {
    throw Error(kBwdOp, e.arg(), e.rule());
  }
  if (t.dtype != DType::kBFloat16) bfail(arg, std::string("dtype ") + dtype_name(t.dtype) + " must be bfloat16");
  if (t.device != dev) bfail(arg, "is on " + detail::device_str(t.device) + " but q is on " + detail::device_str(dev));
  return view_of(t, f);
}

}  // namespace

void attention_backward(const AttnInput& dout, const AttnInput& q, const AttnInput& k, const AttnInput& v,
                        const TensorDesc& o, const TensorDesc& lse, TensorDesc& dq, TensorDesc& dk, TensorDesc& dv,
                        const AttentionOptions& opts, bool deterministic, const TensorDesc* cu_seqlens_q,
                        const TensorDesc* cu_seqlens_kv, Stream stream) {
  const bool thd = opts.q_format == AttnFormat::kTHD;
  if (thd != (opts.kv_format == AttnFormat::kTHD))
    bfail("kv_format", std::string("q_format and kv_format must both be thd (packed sequences) or neither; got q ") +
                           format_name(opts.q_format) + ", kv " + format_name(opts.kv_format));
  if (opts.p_format != PFormat::kBF16)
    bfail("p_format", "the backward keeps P and dS in bf16 (the reference system's E4M3 P / MXFP8 dS are not "
                      "implemented for the backward)");
  // S = Q_row·K_rowᵀ, dP = dO_row·V_rowᵀ, dV = Pᵀ·dO_col, dK = dSᵀ·Q_col, dQ = dS·K_col
  const Operand Qs = read_bwd("q", q, opts.q_format, true), Qg = read_bwd("q", q, opts.q_format, false);
  const Operand Ks = read_bwd("k", k, opts.kv_format, true), Kg = read_bwd("k", k, opts.kv_format, false);
  const Operand Vs = read_bwd("v", v, opts.kv_format, true);
  const Operand Ds = read_bwd("dout", dout, opts.q_format, true), Dg = read_bwd("dout", dout, opts.q_format, false);

  Device dev;
  try {
    dev = check_kinds(Qs, {&Ks, &Vs}, {&Qs, &Qg, &Ks, &Kg, &Vs, &Ds, &Dg});
  } catch (const Error& e) {
    throw Error(kBwdOp, e.arg(), e.rule());
  }
  // the two copies of one tensor describe the same elements
  for (const auto& pr : {std::make_pair(&Qs, &Qg), std::make_pair(&Ks, &Kg), std::make_pair(&Ds, &Dg)})
    if (pr.first->data->shape != pr.second->data->shape)
      bfail(pr.second->data_arg, "shape " + shape_str(pr.second->data->shape) + " differs from " + pr.first->data_arg +
                                     "'s " + shape_str(pr.first->data->shape) + " (both copies hold the same tensor)");

  const Dims &dq_ = Qs.dims, &dk_ = Ks.dims, &dv_ = Vs.dims;
  try {
    check_sizes(dq_, dk_, dv_, thd);
  } catch (const Error& e) {
    throw Error(kBwdOp, e.arg(), e.rule());
  }

  std::vector<int64_t> oshape = Qs.data->shape;
  oshape.back() = dv_.D;
  if (Ds.data->shape != oshape)
    bfail(Ds.data_arg, "shape " + shape_str(Ds.data->shape) + " must be " + shape_str(oshape) +
                           " (the gradient of O: q's shape with the head dim d_v = " + std::to_string(dv_.D) + ")");
  const detail::AttnTensorView ov = bf16_tensor("o", o, oshape, opts.q_format, dev, "the forward's O: q's shape with d_v columns");
  const detail::AttnTensorView dqv = bf16_tensor("dq", dq, Qs.data->shape, opts.q_format, dev, "q's shape");
  const detail::AttnTensorView dkv = bf16_tensor("dk", dk, Ks.data->shape, opts.kv_format, dev, "k's shape");
  const detail::AttnTensorView dvv = bf16_tensor("dv", dv, Vs.data->shape, opts.kv_format, dev, "v's shape");

  int64_t B = 0;
  try {
    B = batch_count(dq_.B, thd, cu_seqlens_q, cu_seqlens_kv, dev);
  } catch (const Error& e) {
    throw Error(kBwdOp, e.arg(), e.rule());
  }
  const std::vector<int64_t> lse_shape = thd ? std::vector<int64_t>{dq_.H, dq_.S} : std::vector<int64_t>{B, dq_.H, dq_.S};
  if (lse.shape != lse_shape)
    bfail("lse", "shape " + shape_str(lse.shape) + " must be " + shape_str(lse_shape) +
                     (thd ? " ([h, t], the forward's LSE)" : " ([b, h, s_q], the forward's LSE)"));
  if (lse.dtype != DType::kFloat32) bfail("lse", std::string("dtype ") + dtype_name(lse.dtype) + " must be float32");
  if ((!lse.strides.empty() && lse.strides.size() != lse.shape.size()) || !lse.is_contiguous()) bfail("lse", "must be contiguous");
  if (lse.numel() > 0 && lse.data == nullptr) bfail("lse", "data pointer is null");
  if (lse.device != dev) bfail("lse", "is on " + detail::device_str(lse.device) + " but q is on " + detail::device_str(dev));
  if (!std::isfinite(opts.softmax_scale)) bfail("softmax_scale", "must be finite, got " + std::to_string(opts.softmax_scale));
  if (opts.max_seqlen_q < 0) bfail("max_seqlen_q", "must not be negative");
  if (opts.max_seqlen_kv < 0) bfail("max_seqlen_kv", "must not be negative");

  const bool on_cuda = dev.type == DeviceType::kCUDA;
#if !MXMLA_WITH_CUDA
  if (on_cuda) bfail("q", "is on a CUDA device, but this build has no CUDA kernels: use CPU tensors");
#endif

  detail::AttentionBwdProblem p;
  p.B = B, p.H = dq_.H, p.Hkv = dk_.H, p.Dqk = dq_.D, p.Dv = dv_.D;
  p.Sq = dq_.S, p.Skv = dk_.S, p.thd = thd;
  p.q_s = read_of(Qs), p.q_g = read_of(Qg), p.k_s = read_of(Ks), p.k_g = read_of(Kg), p.v_s = read_of(Vs);
  p.do_s = read_of(Ds), p.do_g = read_of(Dg);
  p.o = static_cast<const uint16_t*>(o.data), p.o_st_b = ov.st_b, p.o_st_s = ov.st_s, p.o_st_h = ov.st_h;
  p.lse = static_cast<const float*>(lse.data);
  p.causal = opts.causal, p.bottom_right = opts.bottom_right, p.deterministic = deterministic;
  p.softmax_scale = static_cast<float>(opts.softmax_scale != 0.0 ? opts.softmax_scale : 1.0 / std::sqrt(double(dq_.D)));
  p.dq = static_cast<uint16_t*>(dq.data), p.dk = static_cast<uint16_t*>(dk.data), p.dv = static_cast<uint16_t*>(dv.data);
  p.dq_v = dqv, p.dk_v = dkv, p.dv_v = dvv;
#if MXMLA_WITH_CUDA
  if (on_cuda) {
    // the CUDA kernels (attention_bwd_mma.cu, attention_bwd_simt.cu): pointers on the device, head dims up to 256
    const int index = dev.index;
    auto ptr = [&](const std::string& arg, const void* d) {
      if (d != nullptr) detail::check_cuda_pointer(kBwdOp, arg.c_str(), d, index);
    };
    for (const Operand* x : {&Qs, &Qg, &Ks, &Kg, &Vs, &Ds, &Dg}) {
      if (x->data->numel() > 0) ptr(x->data_arg, x->data->data);
      if (x->scales != nullptr && x->scales->numel() > 0) ptr(x->name + "." + x->dir + "_scale_inv", x->scales->data);
    }
    const std::pair<const char*, const TensorDesc*> outs[] = {{"o", &o}, {"lse", &lse}, {"dq", &dq}, {"dk", &dk},
                                                              {"dv", &dv}};
    for (const auto& [arg, t] : outs)
      if (t->numel() > 0) ptr(arg, t->data);
    if (dq_.D > 256 || dv_.D > 256)
      bfail("q", "head dims d_qk = " + std::to_string(dq_.D) + ", d_v = " + std::to_string(dv_.D) +
                     ": the CUDA backward takes head dims up to 256 (use CPU tensors for the reference)");
  }
#endif
  const bool cu_device_only = lengths_on_device_only(thd, on_cuda, opts);
  if (thd) {
    p.cu_q = static_cast<const int32_t*>(cu_seqlens_q->data);
    p.cu_kv = static_cast<const int32_t*>(cu_seqlens_kv->data);
    p.total_q = dq_.S, p.total_kv = dk_.S;
    if (cu_device_only) {
      // the caller's bounds size the grids, as in the forward: no copy to the host, so no stream
      // synchronization (CUDA graphs can capture the call); not checked against the device data:
      // the kernels read a copy clamped to the tensors and to these bounds (clamp_cu_seqlens)
      detail::check_cuda_pointer(kBwdOp, "cu_seqlens_q", cu_seqlens_q->data, dev.index);
      detail::check_cuda_pointer(kBwdOp, "cu_seqlens_kv", cu_seqlens_kv->data, dev.index);
      p.Sq = std::min(opts.max_seqlen_q, dq_.S), p.Skv = std::min(opts.max_seqlen_kv, dk_.S);
    } else {
      // the lengths on the host (grid sizes, checks): on CUDA a synchronizing copy
      const HostCu h = host_cu(kBwdOp, *cu_seqlens_q, *cu_seqlens_kv, on_cuda, dev, stream);
      try {
        longest_sequences(h.q, h.kv, B, dq_.S, dk_.S, opts, p.Sq, p.Skv);
      } catch (const Error& e) {
        throw Error(kBwdOp, e.arg(), e.rule());
      }
    }
  }
  if (!on_cuda) return detail::attention_bwd_cpu(p);
#if MXMLA_WITH_CUDA
  detail::CudaDeviceGuard guard(dev.index);
  const std::unique_ptr<detail::StreamScratch> cu_copy = cu_device_only ? clamp_lengths(kBwdOp, p, stream) : nullptr;
  detail::attention_bwd_cuda(p, stream);
#else
  (void)stream;
#endif
}

}  // namespace mxmla
