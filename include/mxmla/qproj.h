// mxmla — the fused Q up-projection: GEMM + RoPE + MXFP8 quantization (SPEC §4).
//
//   q[t, h, :] = bf16( x[t, :] · W[h*D : h*D + D, :]^T )       fp32 accumulation, one rounding to bf16
//   q[t, h, nope:] = RoPE(q[t, h, nope:], cos[s], sin[s])       fp32 math (include/mxmla/rope.h), not re-rounded
//   codes/scales = MXFP8(q)                                     SPEC §2 on the fp32 values
// with D = nope_dim + rope_dim (DeepSeek-V3: 128 + 64) and s the token's position in its sequence.
// The quantized output is exactly what quantize_attention() makes of the 4-D q [s, b, NH, D]
// (sbhd) or [b, s, NH, D] (bshd) held in fp32: rowwise blocks along the head dim, columnwise blocks
// of 32 consecutive tokens of one sequence; scales compact or BHSD (ready for attention). With one
// sequence and compact scales these are the reference system's layouts: rowwise [T, NH, D/32],
// columnwise [ceil(T/32), NH, D].
#pragma once

#include <cstdint>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/rope.h"
#include "mxmla/tensor.h"

namespace mxmla {

enum class WeightLayout : uint8_t { kNK, kKN };  // W as [N, K] (nn.Linear's weight) or [K, N]

struct QProjOptions {
  int64_t nope_dim = 128, rope_dim = 64;  // per head; head dim D = nope + rope, a multiple of 32
  RopeStyle style = RopeStyle::kInterleavedInHalvesOut;
  QKVLayout layout = QKVLayout::kSBHD;  // token order of x's T = s*b tokens
  int64_t batch = 1;                    // b; s = T / b
  WeightLayout weight_layout = WeightLayout::kNK;
  bool rowwise = true, columnwise = true;
  Fp8Format format = Fp8Format::kE4M3;
  bool bhsd_scales = false;  // true: BHSD swizzled scales (SPEC §2.2), padding zero
};

// The 4-D q shape ([s, b, NH, D] or [b, s, NH, D]) and the shapes to allocate for `out`
// (attention_shapes() of that q).
std::vector<int64_t> qproj_q_shape(int64_t tokens, int64_t num_heads, const QProjOptions& opts);
MXFP8Shapes qproj_shapes(int64_t tokens, int64_t num_heads, const QProjOptions& opts);

// x [T, K] bf16 (innermost stride 1); w bf16 [N, K] or [K, N] (innermost stride 1), N = NH*D;
// cos/sin [>= s, rope_dim] fp32 or bf16 (rope_dim columns laid out for `style`, as rope_tables()
// builds them). `out` holds caller-allocated outputs of qproj_shapes(); `q` (optional) a contiguous
// bf16 tensor of the q shape that receives q after RoPE, rounded to bf16. CPU tensors run the
// reference; CUDA tensors the SM90 kernel, which adds: K % 8 == 0 and 16-byte aligned x / W
// pointers and row strides (TMA), (nope, rope) = (128, 64), 16-byte aligned table rows. W as
// [K, N] is transposed into a stream-ordered scratch buffer first (the kernel reads W K-major).
void fused_q_uproj_rope_quant(const TensorDesc& x, const TensorDesc& w, const TensorDesc& cos,
                              const TensorDesc& sin, MXFP8Tensor& out, TensorDesc* q, const QProjOptions& opts,
                              Stream stream = nullptr);

// The same op with MXFP8 x and W (the reference system's MXFP8-weight path, SPEC §4 and §6): x
// [T, K] and w [N, K] MXFP8Tensors from quantize (compact or swizzled scales, one FP8 format) with
// their rowwise copies (blocks of 32 along K), opts.weight_layout kNK. The GEMM runs on the
// exactly dequantized copies with fp32 accumulation (the CPU reference in float64, rounded as the
// bf16 op's), then the same RoPE + MXFP8 epilogue. CUDA: the bf16 op's kernel on bf16 copies of
// both (exact unless some scale byte puts values below bf16's normal range; then an exact fp32
// path inside the same kernel, much slower, takes over: decided on the device, no synchronisation).
void fused_q_uproj_rope_quant(const MXFP8Tensor& x, const MXFP8Tensor& w, const TensorDesc& cos,
                              const TensorDesc& sin, MXFP8Tensor& out, TensorDesc* q, const QProjOptions& opts,
                              Stream stream = nullptr);

}  // namespace mxmla
