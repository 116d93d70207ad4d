// mxmla internal — the SM90 attention backward main kernel (sm90_attention_bwd.cu, sm_90a), called by
// the backward's launcher (attention_bwd_mma.cu) after its preprocess has turned every read into a
// bf16 view with 16-byte aligned data and strides, but for the key-side reads (K_s, K_g, V), which
// may stay FP8 with 16-byte aligned codes (the kernel converts them).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "common/attention_ops.h"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {

struct Sm90BwdArgs {
  AttentionBwdProblem p;  // its reads: bf16 views (data and strides 16-byte aligned); K_s, K_g, V also FP8
  const float* D;         // [rows] (attn_bwd::row_index order)
  bool q_once;            // the dK GEMM's Q read is the score GEMM's (one copy in shared memory)
};

// The fp32 dQ accumulator (stream-ordered scratch, zeroed; [2][rows][d_qk / 2], see the kernel) of
// query heads h0 .. h0 + heads − 1: attn_bwd::row_index rows row0 .. row0 + rows − 1 (all heads:
// B·H·Sq rows, thd H·total_q; a range of heads, b = 1 or thd: heads·Sq or heads·total_q rows).
struct Sm90DqAcc {
  std::unique_ptr<StreamScratch> mem;
  int* flag = nullptr;  // deterministic problems: the query tiles' flags (in mem, after the sums)
  int64_t rows = 0, row0 = 0, h0 = 0, heads = 0;
};

// Whether the kernel serves this problem: (d_qk, d_v) in {(192, 128), (128, 128)}, one dO copy for
// both of its GEMMs (do_s and do_g the same values), and the current device is an SM90 part. With
// p.deterministic its dQ sums run in a fixed order (bitwise reproducible), else in scheduling order.
bool sm90_attention_bwd_supported(const AttentionBwdProblem& p, bool do_once);
// dQ, dK, dV of the problem (the thd zero tail is the prologue's) in three steps on one stream: the
// accumulator (of query heads h0 .. h0 + heads − 1: all of them, or with b = 1 or thd a group's);
// the kernel for KV heads hk0 .. hk0 + n_kv − 1 (dK, dV of those heads, their query heads' dQ sums,
// which the accumulator must hold; a.p's reads need to hold only those heads), once per group of
// heads; dq of the accumulator's heads rounded from it.
Sm90DqAcc sm90_attention_bwd_acc(const AttentionBwdProblem& p, cudaStream_t stream, int64_t h0, int64_t heads);
void sm90_attention_bwd_heads(const Sm90BwdArgs& a, const Sm90DqAcc& acc, int64_t hk0, int64_t n_kv,
                              cudaStream_t stream);
void sm90_attention_bwd_finish(const AttentionBwdProblem& p, const Sm90DqAcc& acc, cudaStream_t stream);

}  // namespace mxmla::detail
