// mxmla — attention on MXFP8 (or bf16) Q, K, V (SPEC §5).
//
//   S = Q·Kᵀ · softmax_scale          fp32, Q and K dequantized exactly from their rowwise copies
//   P = softmax(S) (online, fp32)     masked: causal (top-left, or bottom-right when s_q != s_kv)
//   O = (P·V) / rowsum(P)             V dequantized exactly from its columnwise copy (blocks of 32
//                                     keys); P enters the GEMM in bf16 (default) or as the
//                                     reference system's E4M3 P (p·2^8 → e4m3, / 2^8)
//   O → bf16, LSE = max + ln(sum)     fp32, natural log; rows without keys: O = 0, LSE = -inf
//
// Tensor formats (TransformerEngine's names): sbhd [s, b, h, d], bshd [b, s, h, d], bhsd
// [b, h, s, d], thd [t, h, d] (packed sequences, cu_seqlens). Q, K and V may share one storage
// (sb3hd, bshd_bs2hd, ...): each is a strided view with the head dim contiguous.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/tensor.h"

namespace mxmla {

enum class AttnFormat : uint8_t { kSBHD, kBSHD, kBHSD, kTHD };
enum class PFormat : uint8_t { kBF16, kE4M3 };

struct AttentionOptions {
  AttnFormat q_format = AttnFormat::kSBHD;   // format of q and o
  AttnFormat kv_format = AttnFormat::kSBHD;  // format of k and v
  bool causal = false;
  bool bottom_right = false;   // causal alignment: key j is visible to query i iff j <= i (+ s_kv - s_q)
  double softmax_scale = 0.0;  // 0: d_qk^-0.5
  PFormat p_format = PFormat::kBF16;
  int64_t max_seqlen_q = 0, max_seqlen_kv = 0;  // thd: upper bounds of the sequence lengths (0: computed)
};

// One attention operand: bf16 data, or an MXFP8 tensor whose needed direction is present
// (Q, K: rowwise; V: columnwise). Exactly one of the two is set.
struct AttnInput {
  const TensorDesc* bf16 = nullptr;
  const MXFP8Tensor* mx = nullptr;
};

// q [.., s_q, h, d_qk], k [.., s_kv, h_kv, d_qk], v [.., s_kv, h_kv, d_v] in their formats;
// h % h_kv == 0; d_qk, d_v multiples of 32 (MXFP8 blocks; CUDA: d_qk in {64, 128, 192}, d_v in
// {64, 128}). o: caller-allocated bf16 in q's format with d_v columns (any strides, head dim
// contiguous). lse (optional): fp32 [b, h, s_q] (thd: [h, total_q]). thd needs cu_seqlens_q /
// cu_seqlens_kv: int32 [b + 1] on the data's device, non-decreasing, starting at 0.
void attention_forward(const AttnInput& q, const AttnInput& k, const AttnInput& v, TensorDesc& o, TensorDesc* lse,
                       const AttentionOptions& opts, const TensorDesc* cu_seqlens_q = nullptr,
                       const TensorDesc* cu_seqlens_kv = nullptr, Stream stream = nullptr);

// The attention backward (SPEC §5): dQ, dK, dV in bf16 from dO, the forward's inputs, O and LSE.
//
//   S  = Q_row·K_rowᵀ · scale (recomputed)      P  = exp(S − LSE) on the visible keys, 0 elsewhere
//   dP = dO_row·V_rowᵀ                          D  = rowsum(O ⊙ dO) (O bf16; dO bf16 or its rowwise copy)
//   dS = P ⊙ (dP − D) · scale
//   dV = bf16(P)ᵀ·dO_col    dQ = bf16(dS)·K_col    dK = bf16(dS)ᵀ·Q_col      (each rounded once to bf16)
//
// Each GEMM reads an MXFP8 operand through the copy quantized along its contraction axis ("_row":
// blocks along the head dim, "_col": blocks along the tokens). A missing copy falls back to the other
// one (a rowwise-only Q / K / dO: the rowwise copies serve every GEMM, the exact gradient of the
// forward on the dequantized inputs; a columnwise-only V serves dP). P and dS enter their GEMMs in
// bf16 (mxmla's default; p_format kE4M3 is not implemented for the backward). GQA: dK and dV sum over
// the query heads of a kv head. Rows without visible keys contribute nothing; their dQ is 0.
//
// dout: bf16 or MXFP8, in q's format with o's shape. q, k, v as in attention_forward (either
// precision, each MXFP8 tensor with any of its copies). o: bf16 (the forward's output); lse: fp32
// [b, h, s_q] (thd: [h, total_q]). dq, dk, dv: caller-allocated bf16 with the shapes of q, k, v's
// codes / data in their formats (any strides, head dim contiguous; thd tokens outside every sequence
// are written 0). `deterministic` asks for a fixed summation order (the CPU reference always has one).
// On CUDA: tensor-core kernels for (d_qk, d_v) = (192, 128), (128, 128), (64, 64) and a CUDA-core
// kernel for other head dims up to 256. On SM90 for (192, 128) and (128, 128) with one dO copy, the
// wgmma kernel sums dQ with fp32 reductions: deterministic = false in scheduling order (the last
// bit can vary between runs), deterministic = true in a fixed order (the same bits); every other
// case uses no reductions (the same bits).
void attention_backward(const AttnInput& dout, const AttnInput& q, const AttnInput& k, const AttnInput& v,
                        const TensorDesc& o, const TensorDesc& lse, TensorDesc& dq, TensorDesc& dk, TensorDesc& dv,
                        const AttentionOptions& opts, bool deterministic = false,
                        const TensorDesc* cu_seqlens_q = nullptr, const TensorDesc* cu_seqlens_kv = nullptr,
                        Stream stream = nullptr);

}  // namespace mxmla
