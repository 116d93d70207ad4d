// mxmla — RoPE for MLA (SPEC §3): forward, backward, tables and positions.
//
// RoPE rotates the trailing `rope_dim` elements of every head of width D = nope_dim + rope_dim;
// the first nope_dim pass through (bit for bit when out has x's dtype). With c = cos row,
// s = sin row of the token (rope_dim each) and x the rope part of one head, each style is
// out[j] = c[j] * x[a(j)] + sign(j) * s[j] * x[b(j)]:
//   kInterleavedInHalvesOut (default; Megatron MLA, cuDNN): j < R/2: a = 2j, b = 2j+1, sign -1;
//                            j >= R/2 (i = j - R/2): a = 2i+1, b = 2i, sign +1.
//   kInterleaved (DeepSeek reference, complex multiply): a = j, b = j^1, sign -1 for even j.
//   kRotateHalf (TE default): a = j, b = j +- R/2, sign -1 for j < R/2.
// The backward is the transpose: dx[a(j)] += c[j] g[j], dx[b(j)] += sign(j) s[j] g[j].
// fp32 semantics (CPU reference and kernels alike, so results compare bit for bit):
//   forward  out[j] = fmaf(sign(j) s[j], x[b(j)], c[j] * x[a(j)])
//   backward dx[k]  = fmaf(sign(j2) s[j2], g[j2], c[j1] * g[j1])   with a(j1) = k, b(j2) = k
// (the product rounded to fp32 first), then one rounding to the output dtype.
// Tables: kInterleaved uses per-element angles [t0, t0, t1, t1, ...]; the other two use
// [t0, t1, ..., t0, t1, ...] (rope_tables() builds the right one for a style).
#pragma once

#include <cstdint>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/tensor.h"

namespace mxmla {

enum class RopeStyle : uint8_t { kInterleavedInHalvesOut, kInterleaved, kRotateHalf };
enum class RopeLayout : uint8_t { kSBHD, kBSHD, kTHD };

struct RopeOptions {
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  RopeLayout layout = RopeLayout::kSBHD;
  int64_t rope_dim = 64;           // trailing elements of each head that rotate; even, <= head dim
  bool tables_per_token = false;  // cos/sin hold one row per token, in x's token order
};

// Which table row a token uses (cos/sin [T, rope_dim]):
//   tables_per_token: row = the token's index in x's token order (T == number of tokens);
//   sbhd / bshd: row = s, shared by every sequence (T >= s);
//   thd (x [t, h, d]) with cu_seqlens [b + 1] (int32 or int64, on the CPU): row = position inside
//                the sequence, t - cu_seqlens[i] (T >= the longest sequence);
//   thd without cu_seqlens: row = t (T >= t).
// cos/sin: fp32 or bf16, last dimension contiguous. x / out: bf16, fp16 or fp32, any strides
// with a unit innermost stride; out may alias x (in place). fp32 math. CUDA tensors run the
// sm90 kernels, which add: rope_dim % 16 == 0, out has x's dtype, 16-byte aligned pointers and
// strides, cos/sin rows contiguous (cu_seqlens stays a CPU tensor; the launcher copies it).
void apply_rope(const TensorDesc& x, const TensorDesc& cos, const TensorDesc& sin, TensorDesc& out,
                const RopeOptions& opts, const TensorDesc* cu_seqlens = nullptr, Stream stream = nullptr);
// dx = R^T g (the gradient of apply_rope); same conventions; dx may alias g.
void rope_backward(const TensorDesc& grad, const TensorDesc& cos, const TensorDesc& sin, TensorDesc& dx,
                   const RopeOptions& opts, const TensorDesc* cu_seqlens = nullptr, Stream stream = nullptr);

// RoPE backward fused with MXFP8 quantization (what the backward GEMMs of the Q up-projection
// read): dq [s,b,h,d] / [b,s,h,d] / [t,h,d] (bf16, fp16, fp32) -> dx = R^T dq in fp32 ->
// MXFP8 codes of dx viewed as [tokens, h*d] (tokens in dq's memory order; rowwise blocks along
// h*d never cross a head since d % 32 == 0; columnwise blocks along tokens), and optionally a
// copy of dx (bf16, rounded to nearest even, or the fp32 values themselves). dx is the
// backward's fp32 value above (nope elements pass through); amax and codes follow SPEC §2 on
// these fp32 values (not re-rounded to bf16).
struct RopeBackwardQuantizeOptions {
  RopeOptions rope;
  bool rowwise = true;
  bool columnwise = true;
  Fp8Format format = Fp8Format::kE4M3;
  bool swizzle = false;
};
// `out` holds caller-allocated outputs of quantize_shapes({tokens, h*d}, swizzle) (data
// [tokens, h*d]); `dx_copy` (optional) is a contiguous bf16 or fp32 tensor of dq's shape.
// CUDA: the rules of apply_rope plus d <= 256, 16-byte aligned codes and dx_copy. Stream-ordered
// scratch (cudaMallocAsync on `stream`): the uploaded cu_seqlens, and the DeepSeek-V3 fast path's
// 4-byte tile-queue counter (zeroed per call), so concurrent calls on different streams are safe.
void rope_backward_quantize(const TensorDesc& dq, const TensorDesc& cos, const TensorDesc& sin, MXFP8Tensor& out,
                            TensorDesc* dx_copy, const RopeBackwardQuantizeOptions& opts,
                            const TensorDesc* cu_seqlens = nullptr, Stream stream = nullptr);

// YaRN (DeepSeek-V3: factor 40, original length 4096, beta_fast 32, beta_slow 1, mscale 1).
struct YarnParams {
  bool enabled = false;
  double factor = 40.0;
  int64_t original_max_position = 4096;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 1.0;
  static YarnParams deepseek_v3() {
    YarnParams y;
    y.enabled = true;
    return y;
  }
};

// Inverse frequencies (rope_dim / 2 of them), YaRN-corrected when enabled: DeepSeek-V3
// model.py precompute_freqs_cis (ramp between floor/ceil of the correction dims for beta_fast /
// beta_slow, clamped to [0, rope_dim/2 - 1]).
std::vector<double> rope_inv_freq(int64_t rope_dim, double base, const YarnParams& yarn);
// cos/sin tables [T, rope_dim] (fp32 or bf16, CPU) for the given positions, laid out for `style`,
// multiplied by yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
// (1 for DeepSeek-V3). Angles in float64, rounded once.
void rope_tables(const std::vector<double>& positions, int64_t rope_dim, double base, const YarnParams& yarn,
                 RopeStyle style, TensorDesc& cos, TensorDesc& sin);
// head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 with YaRN (0.135234 for DeepSeek-V3).
double yarn_softmax_scale(int64_t head_dim, const YarnParams& yarn);

// Position sources (one entry per token, in token order).
std::vector<double> positions_arange(int64_t n, int64_t offset = 0);
// thd: position inside each sequence; cu_seqlens non-decreasing, starting at 0.
std::vector<double> positions_from_cu_seqlens(const std::vector<int64_t>& cu_seqlens);
// Context parallelism with dual-chunk (load-balanced causal) sharding: rank r of cp holds chunks
// r and 2 cp - 1 - r of the global sequence; local length L (even).
std::vector<double> positions_context_parallel(int64_t local_len, int64_t cp_size, int64_t cp_rank);

}  // namespace mxmla
