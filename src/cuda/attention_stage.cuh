// mxmla internal — the device side of the attention kernels' FP8 reads, shared by the conversion
// pass (attention_stage.cu) and the SM90 backward's in-kernel conversion of a key block's K and V
// (sm90_attention_bwd.cu): 16 codes of a token with their scale bytes -> 16 bf16 values, the same
// bits wherever they are converted. A read is a common/attention_ops.h AttnRead (codes through its
// view, scales through its AttnScaleView); a chunk is 16 consecutive values of a token and head,
// starting at a multiple of 16 (attn_read_chunk_scales_ok: inside one rowwise 32-column block, or
// 16 columns of a columnwise copy whose scale bytes lie a fixed step apart). Arch-neutral (FP8
// decode sm_89+, bf16x2 multiply sm_90+).
#pragma once

#include <cstdint>

#include "common/attention_ops.h"
#include "common/mxfp8_common.h"
#include "cuda/ptx/common.cuh"
#include "cuda/sm90/dequant_mxfp8_bf16.cuh"

namespace mxmla::detail::attn_fp8 {

// 16 FP8 codes (byte i = element i) with their scale bytes (byte i of e = element i's; kUniform:
// one scale byte e.x for all 16, a rowwise copy's chunk) -> 16 bf16, out[i] = elements 2i, 2i+1
// (low half: 2i). Fast path: exact bit construction and one bf16 multiply; NaN / Inf codes and
// scales beyond the fast range take the exact fp32 path: out of line (sm90::dequant16_exact_store,
// through the thread's 32-byte shared slot `stage`), or with kInlineExact inline
// (sm90::dequant16_exact; `stage` unused), for a kernel whose registers a call would disturb.
template <bool kE4M3, bool kUniform, bool kInlineExact = false>
__device__ __forceinline__ void fp8_chunk_words(const uint4& codes, const uint4& e, uint4 (&stage)[2],
                                                uint32_t (&out)[8]) {
  uint32_t f[8];
  bool exact = false;
  if constexpr (kUniform) {
    const uint32_t e0 = e.x & 0xFFu, f0 = sm90::fast_factor_bits<kE4M3>(e0);
    exact = e0 > sm90::Fp8Bf16<kE4M3>::kMaxFastE;
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = f0 | (f0 << 16);
  } else {
    const uint32_t ew[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {  // the factors of elements 2i, 2i+1
      const uint32_t e0 = (ew[i / 2] >> (16 * (i % 2))) & 0xFFu, e1 = (ew[i / 2] >> (16 * (i % 2) + 8)) & 0xFFu;
      exact |= (e0 > sm90::Fp8Bf16<kE4M3>::kMaxFastE) | (e1 > sm90::Fp8Bf16<kE4M3>::kMaxFastE);
      f[i] = sm90::fast_factor_bits<kE4M3>(e0) | (sm90::fast_factor_bits<kE4M3>(e1) << 16);
    }
  }
  const uint32_t special = sm90::dequant16_fast<kE4M3>(codes, f, out);
  if (exact || special != 0) {
    const uint4 ee = kUniform ? make_uint4(e.x * 0x01010101u, e.x * 0x01010101u, e.x * 0x01010101u, e.x * 0x01010101u)
                              : e;
    if constexpr (kInlineExact) {
      sm90::dequant16_exact<kE4M3>(codes, ee, out);
    } else {
      sm90::dequant16_exact_store<kE4M3>(codes, ee, ptx::smem_u32(&stage[0]), ptx::smem_u32(&stage[1]));
      const uint4 lo = stage[0], hi = stage[1];  // this thread's own stores (the call clobbers memory)
      out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
      out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
    }
  }
}

// 16 values d0 .. d0 + 15 of token `tok` (packed) of sequence b, head h of read r: element
// (b, h, tok, d) at data + b·st_b + tok·st_s + h·st_h + d.
__device__ __forceinline__ int64_t value_offset(const AttnRead& r, int64_t b, int64_t h, int64_t tok, int64_t d0) {
  return b * r.view.st_b + tok * r.view.st_s + h * r.view.st_h + d0;
}

// FP8: the 16 codes (byte i = value i).
__device__ __forceinline__ uint4 fp8_codes(const AttnRead& r, bool vec, int64_t off) {
  const uint8_t* src = static_cast<const uint8_t*>(r.view.data) + off;
  if (vec) return *reinterpret_cast<const uint4*>(src);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(src[4 * i]) | (static_cast<uint32_t>(src[4 * i + 1]) << 8) |
           (static_cast<uint32_t>(src[4 * i + 2]) << 16) | (static_cast<uint32_t>(src[4 * i + 3]) << 24);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The scale row of token `tok` (its 32-row block for a columnwise copy: row / 32).
__device__ __forceinline__ int64_t scale_row(const AttnScaleView& sc, int64_t b, int64_t h, int64_t tok) {
  return tok * sc.row_s + b * sc.row_b + h * sc.row_h + sc.row0;
}

// The scale cursors of a thread block's chunks (one sequence b and head h: elem()'s geometry), made
// once per block so that no thread divides per value: chunk c's values (columns col = b·col_b +
// h·col_h + 16c .. + 15; host-checked: col_b, col_h multiples of 16, of D for BHSD) lie in one
// 32-column block of a rowwise copy (its cursor is indexed by the scale row); a columnwise copy's
// cursor is that of row block 0 and column col (col_scale_base moves it to row block rb; its 16
// columns' bytes lie `step` apart: swizzled and BHSD layouts keep 16 columns of a 32-aligned group
// 16 bytes apart, compact ones 1).
// I: the cursors' division type (mxfp8_common.h map_div; uint32_t needs the map's cols below 2^31).
template <class I = int64_t>
__device__ __forceinline__ ScaleCursor chunk_cursor(const AttnRead& r, int64_t b, int64_t h, int c) {
  const AttnScaleView& sc = r.sc;
  const int64_t bi = b * sc.bi_b, col = b * sc.col_b + h * sc.col_h + 16 * c;
  return r.rowwise ? row_cursor<I>(sc.map, bi, col / 32) : col_cursor<I>(sc.map, bi, 0, col);
}
__device__ __forceinline__ int64_t col_scale_base(const ScaleCursor& c0, int64_t cols, int64_t rb) {
  ScaleCursor c = c0;  // row block rb: compact bases step by a block row of bytes, swizzled ones by j
  if (c.compact) c.base += rb * cols;
  else c.j += rb;
  return cursor_offset(c, 0);
}
__device__ __forceinline__ uint4 col_scales(const uint8_t* ptr, const ScaleCursor& c0, int64_t cols, int64_t rb) {
  const uint8_t* p = ptr + col_scale_base(c0, cols, rb);
  const int64_t step = c0.compact ? c0.stride : 16;
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 16; ++k) w[k / 4] |= static_cast<uint32_t>(ptx::ld_global_nc_u8(p + k * step)) << (8 * (k % 4));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <bool kUniform, bool kInlineExact = false>
__device__ __forceinline__ void fp8_words(const AttnRead& r, const uint4& codes, const uint4& e, uint4 (&stage)[2],
                                          uint32_t (&out)[8]) {
  if (r.fmt == Fp8Format::kE4M3)
    fp8_chunk_words<true, kUniform, kInlineExact>(codes, e, stage, out);
  else
    fp8_chunk_words<false, kUniform, kInlineExact>(codes, e, stage, out);
}

}  // namespace mxmla::detail::attn_fp8
