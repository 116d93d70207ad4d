// mxmla internal — the MXFP8 GEMM's design C preparation for another bf16 kernel (the fused Q
// up-projection with MXFP8 x and W): both operands dequantized once into K-major bf16 copies, the
// scale check that says whether those copies are exact, and what an exact fallback reads
// (src/cuda/sm90_mxfp8_gemm.cu).
//
// A copy holds every value exactly unless a block with non-zero codes has a scale byte below
// min_exact_e (its smallest codes fall below bf16's normal range); the dequantizing passes check
// for such blocks and set *flag then, in device memory, without a host synchronisation. A kernel
// that reads the copies looks at the flag and, when it is set, computes from the codes and the
// gathered scales instead (exactly in fp32; the gathers and code repacks return at once unless the
// flag is set).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "common/gemm_ops.h"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {

// op(X) [R, K] as the exact fallback reads it: K-major codes (ld bytes a row) and the gathered
// scales in the swizzled rowwise layout (block (r, kb) at swizzle_offset(r, kb, tiles_x)).
struct Mxfp8ExactOperand {
  const uint8_t* codes = nullptr;
  int64_t ld = 0;
  const uint8_t* scales = nullptr;
  int64_t tiles_x = 0;  // ceil(K / 128)
};
struct Mxfp8Exact {
  const uint32_t* flag = nullptr;  // null: no MXFP8 operands (bf16 inputs); else non-zero: take the exact path
  Mxfp8ExactOperand a, b;
  int K = 0;
  bool e4m3 = true;
};

struct Mxfp8Bf16Operands {
  const uint16_t* a16 = nullptr;  // [M, ld] bf16, columns K .. ld − 1 zero
  const uint16_t* b16 = nullptr;  // [N, ld]
  int64_t ld = 0;                 // K rounded up to a multiple of 16
  Mxfp8Exact exact;
  std::unique_ptr<StreamScratch> keep[7];  // the flag, scales, codes and copies (freed on the stream)
};

// pr.a [M, K] and pr.b [N, K] as mxfp8_gemm_cuda reads them (pr.out unused): queues the K-major
// code repacks the copies need, the dequantizing passes (with the check) and the exact path's scale
// gathers and repacks (gated on the flag) on stream s.
void mxfp8_bf16_operands(const GemmProblem& pr, cudaStream_t s, Mxfp8Bf16Operands& out);

}  // namespace mxmla::detail
