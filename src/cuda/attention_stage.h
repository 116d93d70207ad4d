// mxmla internal — the attention kernels' conversion pass: one read of an operand (bf16, or MXFP8
// codes with the scales of the copy read; common/attention_ops.h: AttnRead) -> a bf16 copy in
// stream-ordered scratch, once per element. The backward converts every FP8 read before its main
// kernels (attention_bwd_mma.cu: stage_reads); the SM90 forward converts K and V (and Q where TMA
// cannot read its codes) before a kernel that reads them in bf16 (sm90_attention_fwd.cu). Defined in
// attention_stage.cu (arch-neutral).
//
// The copy: [B][heads][S][d], thd [heads][total tokens][d] (the heads converted); valid tokens only (tokens past a
// sequence's end, and thd tokens outside every sequence, are left unwritten). Values: bf16 copied;
// FP8 code · 2^(e−127) rounded to nearest even (cuda/sm90/dequant_mxfp8_bf16.cuh: exact for values
// in bf16's normal range), through the copy's scale geometry as attn_bwd::elem() reads it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/attention_ops.h"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {

// A grid extent of an attention kernel: x up to 2^31 - 1, y and z up to 65535 (an error naming q
// and `what` beyond).
inline unsigned grid_dim(const char* op, int64_t n, bool x, const char* what) {
  if (n > (x ? int64_t{0x7FFFFFFF} : int64_t{65535}))
    throw Error(op, "q", std::string("has too many ") + what + " for the CUDA kernel's grid");
  return static_cast<unsigned>(n);
}

// Sequences on a grid's z (at most 65535 a launch). thd launches run over chunks of sequences, each
// seeing cu_seqlens from its first sequence on (`launch(b0, n)` for sequences b0 .. b0 + n − 1): a
// thd operand's addresses, its scales' and the LSE / D rows' come from the token index alone (the
// views' and scale geometries' sequence strides are 0), so the chunks compute what one launch of
// all would. Other formats address by the sequence index: refused past 65535 (an error naming q).
constexpr int64_t kMaxGridSequences = 65535;
template <class Launch>
void for_sequence_chunks(const char* op, int64_t B, bool thd, Launch&& launch) {
  if (!thd && B > kMaxGridSequences)
    throw Error(op, "q", "has a batch of " + std::to_string(B) + " sequences: the CUDA kernels take at most " +
                             std::to_string(kMaxGridSequences) +
                             " in the sbhd / bshd / bhsd formats (a grid dimension); pack them as thd "
                             "(cu_seqlens), which has no such limit");
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridSequences)
    launch(b0, static_cast<unsigned>(B - b0 < kMaxGridSequences ? B - b0 : kMaxGridSequences));
}

// The sequences a read's tokens belong to (thd: cu_q / cu_kv in device memory, [B + 1]).
struct StageSeqs {
  int64_t B = 1, Sq = 0, Skv = 0;  // thd: the max lengths (the grid's extent)
  bool thd = false;
  const int32_t* cu_q = nullptr;
  const int32_t* cu_kv = nullptr;
  int64_t total_q = 0, total_kv = 0;
};

// thd without a host copy of cu_seqlens (the caller's max_seqlen_* bounds size the grids): queues a
// copy of cu_q and cu_kv ([B + 1] int32 each, device memory) in scratch on s, every entry clamped to
// [the clamped entry before it, min(total, that entry + bound)] (the first to [0, total]), and points
// cu_q, cu_kv at it; returns the scratch (freed on the stream when it goes: keep it until the call's
// kernels are queued). So the kernels read sequences that lie inside the tensors and are at most
// bound_q / bound_kv long, as the host checks ensure when they run: valid cu_seqlens within their
// bounds are copied unchanged; others (a sequence longer than its bound, entries outside the
// tokens or decreasing) give undefined results, never an access outside the tensors or a kernel
// that waits for blocks the grid does not have.
std::unique_ptr<StreamScratch> clamp_cu_seqlens(const char* op, const int32_t*& cu_q, const int32_t*& cu_kv, int64_t B,
                                                int64_t total_q, int64_t total_kv, int64_t bound_q, int64_t bound_kv,
                                                cudaStream_t s);

// What a staged read needs: 16-byte loads (data pointer and strides multiples of 16 bytes; else
// element loads), and scale lookups per 16-value chunk (chunks start at columns that are multiples
// of 16: one rowwise 32-column block; a columnwise chunk inside its head with BHSD scales).
bool attn_read_vec_ok(const AttnRead& r);
bool attn_read_chunk_scales_ok(const AttnRead& r);

// One read to convert: `src` (kv: a key-side read, cu_kv / Skv; else cu_q / Sq), `heads` heads from
// head h0 (h0 .. h0 + heads − 1 of src), d values a token (a multiple of 16, at most 512, and
// S·d / 16 below 2^31: else an error naming q). The conversion sets *view to the copy's bf16 view,
// addressed with src's head indices (its data pointer lies h0 heads before the scratch; only heads
// h0 .. h0 + heads − 1 may be read through it), and *keep to the scratch (freed on the stream when
// it goes).
struct StageRequest {
  const AttnRead* src = nullptr;
  bool kv = false;
  int64_t heads = 0, d = 0, h0 = 0;
  AttnTensorView* view = nullptr;
  std::unique_ptr<StreamScratch>* keep = nullptr;
};
// Queues the conversions of reqs[0 .. n) (n <= 7) on stream s, in one kernel launch. op names the
// caller in errors.
void stage_attn_reads(const char* op, const StageSeqs& g, const StageRequest* reqs, int n, cudaStream_t s);
// The bytes of that copy: 2 per value of B (thd: 1) x heads x tokens (kv ? Skv or total_kv : Sq or
// total_q) x d.
int64_t stage_attn_bytes(const StageSeqs& g, bool kv, int64_t heads, int64_t d);

}  // namespace mxmla::detail
