// mxmla internal — the attention forward problem that src/attention.cpp (validation, layouts)
// hands to a backend: the CPU reference (src/cpu/attention_reference.cpp) or the SM90 kernel
// (src/cuda/sm90_attention_fwd.cu).
//
// Every operand is addressed by (b, h, s, d): b the sequence, h the head, s the token inside its
// sequence, d the head-dim index (contiguous). For thd the sequence b starts at packed token
// cu[b], and the b-stride is 0.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/mxfp8_common.h"
#include "mxmla/attention.h"

namespace mxmla::detail {

// Element (b, h, s, d) at data + b*st_b + (cu[b] + s)*st_s + h*st_h + d (elements; codes: bytes).
struct AttnTensorView {
  const void* data = nullptr;
  int64_t st_b = 0, st_s = 0, st_h = 0;
};

// The scale byte of element (b, h, s, d) of an MXFP8 operand, through the ScaleMap geometry of
// the buffer that holds it (common/mxfp8_common.h):
//   bi  = b*bi_b
//   row = (cu[b] + s)*row_s + b*row_b + h*row_h + row0
//   col = d + b*col_b + h*col_h
//   rowwise (Q, K): row_scale_offset(map, bi, row, col / 32)
//   columnwise (V): col_scale_offset(map, bi, row / 32, col)
// The CUDA kernel requires row_s == 1 for V (its blocks run along the keys).
struct AttnScaleView {
  const uint8_t* ptr = nullptr;
  ScaleMap map;
  int64_t bi_b = 0;
  int64_t row_s = 1, row_b = 0, row_h = 0, row0 = 0;
  int64_t col_b = 0, col_h = 0;
};

struct AttentionProblem {
  int64_t B = 1, Sq = 0, Skv = 0;  // thd: Sq / Skv are the max sequence lengths
  int64_t H = 1, Hkv = 1, Dqk = 0, Dv = 0;
  bool thd = false;
  const int32_t* cu_q = nullptr;   // thd: [B + 1] (device memory for CUDA problems)
  const int32_t* cu_kv = nullptr;
  int64_t total_q = 0;             // thd: packed query tokens of q (its leading extent, >= cu_q[B]; the lse row length)
  int64_t total_kv = 0;            // thd: packed key tokens of k and v (their leading extent)

  bool fp8 = false;                // q, k, v MXFP8 (codes + scales); else bf16
  Fp8Format fmt = Fp8Format::kE4M3;
  AttnTensorView q, k, v;
  AttnScaleView q_sc, k_sc, v_sc;  // fp8 only

  bool causal = false, bottom_right = false;
  float softmax_scale = 1.0f;
  PFormat p_format = PFormat::kBF16;

  uint16_t* o = nullptr;           // bf16, element (b, h, s, d) at o + b*o_st_b + (cu_q[b] + s)*o_st_s + h*o_st_h + d
  int64_t o_st_b = 0, o_st_s = 0, o_st_h = 0;
  float* lse = nullptr;            // optional: [B, H, Sq] (thd: [H, total_q]) contiguous
};

// The backward (include/mxmla/attention.h: attention_backward). One read of an operand: its values
// (bf16, or codes with the scales of the copy read) and which copy it is.
struct AttnRead {
  AttnTensorView view;
  AttnScaleView sc;
  bool fp8 = false, rowwise = true;
  Fp8Format fmt = Fp8Format::kE4M3;
};

struct AttentionBwdProblem {
  int64_t B = 1, Sq = 0, Skv = 0;  // thd: Sq / Skv are the max sequence lengths
  int64_t H = 1, Hkv = 1, Dqk = 0, Dv = 0;
  bool thd = false;
  const int32_t* cu_q = nullptr;  // thd: [B + 1]
  const int32_t* cu_kv = nullptr;
  int64_t total_q = 0, total_kv = 0;

  AttnRead q_s, k_s;    // S = Q·Kᵀ (rowwise copies)
  AttnRead do_s, v_s;   // dP = dO·Vᵀ (rowwise copies, blocks along d_v); do_s also gives D
  AttnRead do_g, q_g;   // dV = Pᵀ·dO, dK = dSᵀ·Q (blocks along the query tokens)
  AttnRead k_g;         // dQ = dS·K (blocks along the key tokens)

  const uint16_t* o = nullptr;  // bf16 in q's format, d_v columns
  int64_t o_st_b = 0, o_st_s = 0, o_st_h = 0;
  const float* lse = nullptr;   // [B, H, Sq] (thd: [H, total_q]) contiguous

  bool causal = false, bottom_right = false;
  float softmax_scale = 1.0f;
  bool deterministic = false;  // a fixed summation order (CUDA: no atomics)

  uint16_t *dq = nullptr, *dk = nullptr, *dv = nullptr;  // bf16, in q's / kv's formats
  AttnTensorView dq_v, dk_v, dv_v;
};

void attention_fwd_cpu(const AttentionProblem& p);
void attention_bwd_cpu(const AttentionBwdProblem& p);
// The CUDA backward (src/cuda/attention_bwd_mma.cu): the preprocess, then the SM90 wgmma kernel
// (sm90_attention_bwd.cu) where it applies, else the mma.sync kernels for the head dims they are
// instantiated for, else (or with MXMLA_ATTN_BWD=simt in the environment) the CUDA-core one.
void attention_bwd_cuda(const AttentionBwdProblem& p, Stream stream);
// The CUDA-core backward (src/cuda/attention_bwd_simt.cu): every format and head dims up to 256;
// the dynamic shared memory it needs for these head dims.
void attention_bwd_simt_cuda(const AttentionBwdProblem& p, Stream stream);
size_t attention_bwd_cuda_smem(int64_t Dqk, int64_t Dv);
void attention_fwd_cuda(const AttentionProblem& p, Stream stream);
// Whether the SM90 kernel has an instantiation for these head dims.
bool attention_cuda_supports(int64_t Dqk, int64_t Dv);

}  // namespace mxmla::detail
