// mxmla internal — what the two CUDA attention backward paths share: the CUDA-core kernel
// (attention_bwd_simt.cu, every head dim up to 256) and the tensor-core kernel
// (attention_bwd_mma.cu, the head dims it is instantiated for).
//
//   elem()      element (b, h, s, d) of one read of an operand: bf16, or code · 2^(e−127) through
//               the copy's scale geometry (common/attention_ops.h: AttnScaleView)
//   Seq         one sequence's lengths, first packed tokens (thd) and causal offset
//   row_index   the LSE / D row of (b, h, query i)
//   write_bf16  one element of dq / dk / dv through its view
//   attention_bwd_prologue  (host; defined in attention_bwd_simt.cu) the thd zero tail and
//               D_i = Σ_d O_id · dO_row,id, which both paths run once before their main kernels
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/attention_ops.h"
#include "cuda/attention_stage.h"  // grid_dim
#include "cuda/numerics.cuh"
#include "cuda/ptx/convert.cuh"
#include "cuda/stream_scratch.h"

namespace mxmla::detail::attn_bwd {

__device__ __forceinline__ float fp8_to_float(uint8_t c, Fp8Format f) {
  const uint32_t h2 = f == Fp8Format::kE4M3 ? ptx::cvt_f16x2_from_fp8x2<true>(c) : ptx::cvt_f16x2_from_fp8x2<false>(c);
  return __low2float(*reinterpret_cast<const __half2*>(&h2));
}

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Element (b, h, s, d) of one read of an operand (s counted inside sequence b).
__device__ inline float elem(const AttnRead& r, const int32_t* cu, int64_t b, int64_t h, int64_t s, int64_t d) {
  const int64_t tok = (cu ? cu[b] : 0) + s;
  const int64_t off = b * r.view.st_b + tok * r.view.st_s + h * r.view.st_h + d;
  if (!r.fp8) return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(r.view.data)[off]) << 16);
  const AttnScaleView& sc = r.sc;
  const int64_t bi = b * sc.bi_b;
  const int64_t row = tok * sc.row_s + b * sc.row_b + h * sc.row_h + sc.row0;
  const int64_t c = b * sc.col_b + h * sc.col_h + d;
  const int64_t so = r.rowwise ? row_scale_offset(sc.map, bi, row, c / 32) : col_scale_offset(sc.map, bi, row / 32, c);
  return fp8_to_float(static_cast<const uint8_t*>(r.view.data)[off], r.fmt) * e8m0_factor(sc.ptr[so]);
}

struct Seq {
  int64_t sq, skv, q0, kv0;  // lengths and first packed tokens (0 without thd)
  int64_t off;               // causal: key j is visible to row i iff j <= i + off
};

__device__ __forceinline__ Seq seq_of(const AttentionBwdProblem& p, int64_t b) {
  Seq s{p.Sq, p.Skv, 0, 0, 0};
  if (p.thd) s.q0 = p.cu_q[b], s.kv0 = p.cu_kv[b], s.sq = p.cu_q[b + 1] - s.q0, s.skv = p.cu_kv[b + 1] - s.kv0;
  s.off = p.bottom_right ? s.skv - s.sq : 0;
  return s;
}

__device__ __forceinline__ int64_t row_index(const AttentionBwdProblem& p, const Seq& s, int64_t b, int64_t h, int64_t i) {
  return p.thd ? h * p.total_q + s.q0 + i : (b * p.H + h) * p.Sq + i;  // lse / D
}

__device__ __forceinline__ bool visible(const AttentionBwdProblem& p, const Seq& s, int64_t i, int64_t j) {
  return !p.causal || j <= i + s.off;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ void write_bf16(uint16_t* base, const AttnTensorView& v, int64_t b, int64_t tok, int64_t h,
                                           int64_t d, float x) {
  base[b * v.st_b + tok * v.st_s + h * v.st_h + d] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Sequences b0 .. b0 + n − 1 of p (for_sequence_chunks: thd's cu_seqlens advanced to b0).
inline AttentionBwdProblem sequence_chunk(const AttentionBwdProblem& p, int64_t b0, unsigned n) {
  AttentionBwdProblem c = p;
  if (c.thd) c.cu_q += b0, c.cu_kv += b0;
  c.B = n;
  return c;
}

// Queues the thd zero tail (dq, dk, dv of the tokens after the last sequence) and, when there are
// rows (B, H > 0), D [rows] fp32 in stream-ordered scratch, which it returns (null: nothing more to
// compute). Defined in attention_bwd_simt.cu.
std::unique_ptr<StreamScratch> attention_bwd_prologue(const AttentionBwdProblem& p, cudaStream_t stream);

}  // namespace mxmla::detail::attn_bwd
