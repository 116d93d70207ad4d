// mxmla — the attention kernels' conversion pass (cuda/attention_stage.h): one thread per 16
// consecutive values of a token. Arch-neutral (FP8 decode sm_89+, bf16x2 multiply sm_90+).
#include "cuda/attention_stage.h"

#include <cuda_bf16.h>

#include <string>

#include "common/attention_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/ptx/common.cuh"
#include "cuda/sm90/dequant_mxfp8_bf16.cuh"

namespace mxmla::detail {
namespace {

constexpr int kThreads = 256;

// 16 FP8 codes (byte i = element i) with their scale bytes (byte i of e = element i's) -> 16 bf16,
// out[i] = elements 2i, 2i+1 (low half: 2i). Fast path: exact bit construction and one bf16
// multiply; NaN / Inf codes and scales beyond the fast range take the exact fp32 path
// (sm90::dequant16_exact_store), through the thread's 32-byte shared slot `stage`.
template <bool kE4M3>
__device__ __forceinline__ void fp8_chunk_words(const uint4& codes, const uint4& e, uint4 (&stage)[2],
                                                uint32_t (&out)[8]) {
  const uint32_t ew[4] = {e.x, e.y, e.z, e.w};
  uint32_t f[8];
  bool exact = false;
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // the factors of elements 2i, 2i+1
    const uint32_t e0 = (ew[i / 2] >> (16 * (i % 2))) & 0xFFu, e1 = (ew[i / 2] >> (16 * (i % 2) + 8)) & 0xFFu;
    exact |= (e0 > sm90::Fp8Bf16<kE4M3>::kMaxFastE) | (e1 > sm90::Fp8Bf16<kE4M3>::kMaxFastE);
    f[i] = sm90::fast_factor_bits<kE4M3>(e0) | (sm90::fast_factor_bits<kE4M3>(e1) << 16);
  }
  const uint32_t special = sm90::dequant16_fast<kE4M3>(codes, f, out);
  if (exact || special != 0) {
    sm90::dequant16_exact_store<kE4M3>(codes, e, ptx::smem_u32(&stage[0]), ptx::smem_u32(&stage[1]));
    const uint4 lo = stage[0], hi = stage[1];  // this thread's own stores (the call clobbers memory)
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
    out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
  }
}

// 16 values d0 .. d0 + 15 of token `tok` (packed) of sequence b, head h of read r: element
// (b, h, tok, d) at data + b·st_b + tok·st_s + h·st_h + d.
__device__ __forceinline__ int64_t value_offset(const AttnRead& r, int64_t b, int64_t h, int64_t tok, int64_t d0) {
  return b * r.view.st_b + tok * r.view.st_s + h * r.view.st_h + d0;
}

// bf16: the 16 values copied (out[i]: values 2i, 2i + 1).
__device__ __forceinline__ void bf16_words(const AttnRead& r, bool vec, int64_t off, uint32_t (&out)[8]) {
  const uint16_t* src = static_cast<const uint16_t*>(r.view.data) + off;
  if (vec) {
    const uint4 lo = reinterpret_cast<const uint4*>(src)[0], hi = reinterpret_cast<const uint4*>(src)[1];
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
    out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      out[i] = static_cast<uint32_t>(src[2 * i]) | (static_cast<uint32_t>(src[2 * i + 1]) << 16);
  }
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

// The 16 values' scale bytes (byte i of e = value i's), through the geometry elem() uses (d0 is a
// multiple of 16: host-checked): a rowwise copy's 16 values lie in one 32-column block of the row;
// a columnwise copy has a block per column (32 rows of it): 16 bytes through one cursor (BHSD:
// inside d0's head).
__device__ __forceinline__ uint4 chunk_scales(const AttnRead& r, int64_t b, int64_t h, int64_t row, int64_t d0) {
  const AttnScaleView& sc = r.sc;
  const int64_t bi = b * sc.bi_b, col = b * sc.col_b + h * sc.col_h + d0;
  if (r.rowwise) {
    const uint32_t s = ptx::ld_global_nc_u8(sc.ptr + row_scale_offset(sc.map, bi, row, col / 32)) * 0x01010101u;
    return make_uint4(s, s, s, s);
  }
  const ScaleCursor cur = col_cursor(sc.map, bi, row / 32, col);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 16; ++k)
    w[k / 4] |= static_cast<uint32_t>(ptx::ld_global_nc_u8(sc.ptr + cursor_offset(cur, k))) << (8 * (k % 4));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void fp8_words(const AttnRead& r, const uint4& codes, const uint4& e, uint4 (&stage)[2],
                                          uint32_t (&out)[8]) {
  if (r.fmt == Fp8Format::kE4M3)
    fp8_chunk_words<true>(codes, e, stage, out);
  else
    fp8_chunk_words<false>(codes, e, stage, out);
}

// One conversion: src -> dst (values of (b, h, tok, d) at dst + b·st_b + tok·st_s + h·st_h + d;
// tok packed, as the kernels address it).
struct StageJob {
  AttnRead src;
  bool vec;            // src's 16-byte loads (attn_read_vec_ok)
  bool kv;             // a key-side read (cu_kv, Skv) or a query-side one (cu_q, Sq)
  int32_t d;           // values per token and head (a multiple of 16)
  int64_t h0;          // the first head converted (blockIdx.y = head − h0)
  uint16_t* dst;       // addressed with src's head indices: the scratch lies h0 heads in
  AttnTensorView view;  // dst's strides (view.data = dst)
};
static_assert(sizeof(StageSeqs) + sizeof(StageJob) <= 4000, "kernel parameter space");

// Tokens a thread converts: 1, or kColRows consecutive ones for a columnwise FP8 copy (their
// scale bytes, 16 loads, fetched once per 32-row block instead of once per token).
constexpr int kColRows = 4;
__host__ __device__ __forceinline__ int rows_per_thread(const AttnRead& r) { return r.fp8 && !r.rowwise ? kColRows : 1; }

// grid (ceil(ceil(S / rows) · d / 16 / kThreads), heads, B), rows = rows_per_thread: a thread
// converts one 16-value chunk c (values 16c .. 16c + 15) of `rows` consecutive tokens of sequence
// b, head h = h0 + blockIdx.y; consecutive threads take consecutive chunks of a token, then the
// next token group (coalesced 16-byte stores). Tokens past the sequence's end are left alone (the kernels read only
// the valid ones, or mask them).
__global__ void __launch_bounds__(kThreads) attn_stage(const __grid_constant__ StageSeqs g,
                                                       const __grid_constant__ StageJob job) {
  __shared__ uint4 stage[kThreads][2];  // the exact path's 32 bytes a thread
  const int64_t b = blockIdx.z, h = job.h0 + blockIdx.y;
  int64_t len = job.kv ? g.Skv : g.Sq, t0 = 0;
  if (g.thd) {
    const int32_t* cu = job.kv ? g.cu_kv : g.cu_q;
    t0 = cu[b], len = cu[b + 1] - t0;
  }
  const AttnRead& r = job.src;
  const int chunks = job.d / 16, rows = rows_per_thread(r);
  const int64_t x = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int64_t i0 = x / chunks * rows;
  const int64_t d0 = int64_t{16} * (x % chunks);
  int64_t cached = -1;  // the scale row (rowwise) or 32-row block (columnwise) whose bytes e holds
  uint4 e = make_uint4(0, 0, 0, 0);
  for (int ii = 0; ii < rows; ++ii) {
    const int64_t i = i0 + ii;
    if (i >= len) return;
    const int64_t tok = t0 + i;
    const int64_t off = value_offset(r, b, h, tok, d0);
    uint32_t w[8];
    if (!r.fp8) {
      bf16_words(r, job.vec, off, w);
    } else {
      const uint4 codes = fp8_codes(r, job.vec, off);
      const int64_t row = scale_row(r.sc, b, h, tok), key = r.rowwise ? row : row / 32;
      if (key != cached) e = chunk_scales(r, b, h, row, d0), cached = key;
      fp8_words(r, codes, e, stage[threadIdx.x], w);
    }
    uint4* dst = reinterpret_cast<uint4*>(job.dst + b * job.view.st_b + tok * job.view.st_s + h * job.view.st_h + d0);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

}  // namespace

bool attn_read_vec_ok(const AttnRead& r) {
  const int64_t es = r.fp8 ? 1 : 2;
  const AttnTensorView& v = r.view;
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && v.st_b * es % 16 == 0 && v.st_s * es % 16 == 0 &&
         v.st_h * es % 16 == 0;
}

bool attn_read_chunk_scales_ok(const AttnRead& r) {
  if (!r.fp8) return true;
  const AttnScaleView& sc = r.sc;
  if (sc.col_b % 16 != 0 || sc.col_h % 16 != 0) return false;
  if (sc.map.mode == MapMode::kBHSD)
    return sc.map.D % 16 == 0 && sc.col_b % sc.map.D == 0 && sc.col_h % sc.map.D == 0;
  return true;
}

int64_t stage_attn_bytes(const StageSeqs& g, bool kv, int64_t heads, int64_t d) {
  const int64_t S = kv ? g.Skv : g.Sq, tokens = g.thd ? (kv ? g.total_kv : g.total_q) : S;
  return (g.thd ? 1 : g.B) * heads * tokens * d * 2;
}

std::unique_ptr<StreamScratch> stage_attn_read(const char* op, const StageSeqs& g, const AttnRead& r, bool kv,
                                               int64_t heads, int64_t d, cudaStream_t s, AttnTensorView* view,
                                               int64_t h0) {
  const int64_t S = kv ? g.Skv : g.Sq, tokens = g.thd ? (kv ? g.total_kv : g.total_q) : S;
  // [B][heads][S][d], thd [heads][total tokens][d]
  auto keep = std::make_unique<StreamScratch>(stage_attn_bytes(g, kv, heads, d), s);
  StageJob job;
  job.src = r;
  job.vec = attn_read_vec_ok(r);
  job.kv = kv;
  job.d = static_cast<int32_t>(d);
  job.h0 = h0;
  job.view.st_b = g.thd ? 0 : heads * tokens * d;
  job.view.st_s = d;
  job.view.st_h = tokens * d;
  // head h of r at scratch + (h − h0)·st_h (integer arithmetic: the pointer may lie before the scratch)
  job.dst = reinterpret_cast<uint16_t*>(reinterpret_cast<uintptr_t>(keep->ptr) -
                                        static_cast<uintptr_t>(h0 * job.view.st_h * 2));
  job.view.data = job.dst;
  const int64_t rows = rows_per_thread(r);
  const int64_t blocks = ((S + rows - 1) / rows * (d / 16) + kThreads - 1) / kThreads;
  if (blocks > 0 && heads > 0 && g.B > 0) {
    attn_stage<<<dim3(grid_dim(op, blocks, true, "rows"), grid_dim(op, heads, false, "heads"),
                      grid_dim(op, g.B, false, "sequences")),
                 kThreads, 0, s>>>(g, job);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
  *view = job.view;
  return keep;
}

}  // namespace mxmla::detail
