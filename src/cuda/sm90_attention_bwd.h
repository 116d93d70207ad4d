// mxmla internal — the SM90 attention backward main kernel (sm90_attention_bwd.cu, sm_90a), called by
// the backward's launcher (attention_bwd_mma.cu) after its preprocess has turned every read into a
// bf16 view with 16-byte aligned data and strides.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_ops.h"

namespace mxmla::detail {

struct Sm90BwdArgs {
  AttentionBwdProblem p;  // its reads: bf16 views (data and strides 16-byte aligned)
  const float* D;         // [rows] (attn_bwd::row_index order)
  bool q_once;            // the dK GEMM's Q read is the score GEMM's (one copy in shared memory)
};

// Whether the kernel serves this problem: (d_qk, d_v) in {(192, 128), (128, 128)}, one dO copy for
// both of its GEMMs (do_s and do_g the same values), not deterministic (dQ is summed with atomics),
// and the current device is an SM90 part.
bool sm90_attention_bwd_supported(const AttentionBwdProblem& p, bool do_once);
// dQ, dK, dV of the problem (the thd zero tail is the prologue's).
void sm90_attention_bwd(const Sm90BwdArgs& a, cudaStream_t stream);

}  // namespace mxmla::detail
