// mxmla — the attention kernels' conversion pass (cuda/attention_stage.h): one launch for every
// read of a call, a thread per 4 chunks of 16 consecutive values of a token. Arch-neutral (FP8
// decode sm_89+, bf16x2 multiply sm_90+).
#include "cuda/attention_stage.h"

#include <cuda_bf16.h>

#include <string>

#include "common/attention_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/attention_stage.cuh"
#include "cuda/ptx/common.cuh"

namespace mxmla::detail {
namespace {

using namespace attn_fp8;  // fp8_codes, fp8_words, chunk_cursor, col_scales, scale_row, value_offset

constexpr int kThreads = 256;
constexpr int kMaxChunks = 32;  // d <= 512 (host-checked)

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

// A converted chunk's 32 bytes (out[i]: values 2i, 2i + 1) to its place in the copy.
__device__ __forceinline__ void store_chunk(uint16_t* dst, const uint32_t (&w)[8]) {
  uint4* o = reinterpret_cast<uint4*>(dst);
  o[0] = make_uint4(w[0], w[1], w[2], w[3]);
  o[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// One conversion: src -> dst (values of (b, h, tok, d) at dst + b·st_b + tok·st_s + h·st_h + d;
// tok packed, as the kernels address it), over blocks [x0, x0 + blocks·heads) of the launch.
struct StageJob {
  AttnRead src;
  bool vec;            // src's 16-byte loads (attn_read_vec_ok)
  bool kv;             // a key-side read (cu_kv, Skv) or a query-side one (cu_q, Sq)
  int32_t d;           // values per token and head (a multiple of 16, at most 16·kMaxChunks)
  int64_t h0;          // the first head converted
  int64_t blocks;      // thread blocks per head (and sequence)
  int64_t x0;          // the job's first block (blockIdx.x)
  uint16_t* dst;       // addressed with src's head indices: the scratch lies h0 heads in
  AttnTensorView view;  // dst's strides (view.data = dst)
};
// Every conversion of one call in one launch (the forward's Q, K, V; a backward group's reads).
constexpr int kMaxJobs = 7;
struct StageJobs {
  StageJob job[kMaxJobs];
  int n;
};
static_assert(sizeof(StageSeqs) + sizeof(StageJobs) <= 4000, "kernel parameter space");

// Chunks a thread converts, their loads issued together: kItems consecutive tokens of one chunk
// for a columnwise FP8 copy (their scale bytes, 16 loads, fetched once: the tokens lie in one
// 32-row block but where thd's packing starts a block among them), else kItems chunks one block's
// width apart.
constexpr int kItems = 4;
// Thread blocks a head (and sequence) takes: S tokens of `chunks` chunks (host-checked:
// S·chunks < 2^31, so that a thread's index within the head is a 32-bit number).
__host__ __device__ __forceinline__ int64_t stage_blocks(const AttnRead& r, int64_t S, int64_t chunks) {
  if (r.fp8 && !r.rowwise) return ((S + kItems - 1) / kItems * chunks + kThreads - 1) / kThreads;
  return (S * chunks + int64_t{kThreads} * kItems - 1) / (int64_t{kThreads} * kItems);
}

// grid (Σ jobs blocks·heads, 1, B): block x belongs to the job j with x0 <= x < x0 + blocks·heads,
// head h = h0 + (x - x0) / blocks. A thread converts kItems 16-value chunks (values 16c .. 16c + 15
// of a token) of sequence b, head h: for a columnwise FP8 copy chunk c of kItems consecutive
// tokens, else the chunks x, x + kThreads, … of the block's kThreads·kItems (consecutive threads:
// consecutive chunks of a token, then the next token; coalesced). Tokens past the sequence's end
// are left alone (the kernels read only the valid ones, or mask them).
__global__ void __launch_bounds__(kThreads) attn_stage(const __grid_constant__ StageSeqs g,
                                                       const __grid_constant__ StageJobs jobs) {
  __shared__ uint4 stage[kThreads][2];  // the exact path's 32 bytes a thread
  __shared__ ScaleCursor cursor[kMaxChunks];
  int j = 0;
  while (j + 1 < jobs.n && int64_t{blockIdx.x} >= jobs.job[j + 1].x0) ++j;
  const StageJob& job = jobs.job[j];
  const int64_t local = int64_t{blockIdx.x} - job.x0;
  const int64_t b = blockIdx.z, h = job.h0 + local / job.blocks;
  const uint32_t blk = static_cast<uint32_t>(local % job.blocks);
  int64_t len = job.kv ? g.Skv : g.Sq, t0 = 0;
  if (g.thd) {
    const int32_t* cu = job.kv ? g.cu_kv : g.cu_q;
    t0 = cu[b], len = cu[b + 1] - t0;
  }
  const AttnRead& r = job.src;
  const uint32_t chunks = static_cast<uint32_t>(job.d / 16);
  const bool col = r.fp8 && !r.rowwise;
  {  // a block wholly past its sequence's end (thd: every sequence gets the longest one's blocks) stops here
    const uint32_t x0 = col ? blk * kThreads : blk * kItems * kThreads;  // the block's first chunk index
    if ((col ? int64_t{x0 / chunks} * kItems : int64_t{x0 / chunks}) >= len) return;
  }
  if (r.fp8) {
    if (threadIdx.x < chunks) cursor[threadIdx.x] = chunk_cursor(r, b, h, static_cast<int>(threadIdx.x));
    __syncthreads();
  }
  int64_t tok[kItems];
  uint32_t c[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const uint32_t x = col ? blk * kThreads + threadIdx.x : (blk * kItems + k) * kThreads + threadIdx.x;
    tok[k] = col ? int64_t{x / chunks} * kItems + k : int64_t{x / chunks};
    c[k] = x % chunks;
  }
  // tok[k] < len: item k is valid (columnwise: a prefix of the items)
  uint16_t* const dst = job.dst + b * job.view.st_b + h * job.view.st_h;
  if (!r.fp8) {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      if (tok[k] >= len) continue;
      uint32_t w[8];
      bf16_words(r, job.vec, value_offset(r, b, h, t0 + tok[k], 16 * c[k]), w);
      store_chunk(dst + (t0 + tok[k]) * job.view.st_s + 16 * c[k], w);
    }
    return;
  }
  uint4 codes[kItems], ec = make_uint4(0, 0, 0, 0);
  uint32_t sb[kItems];  // rowwise: each item's scale byte
  int64_t cached = -1;  // columnwise: the 32-row block whose bytes ec holds
#pragma unroll
  for (int k = 0; k < kItems; ++k)  // every load first
    if (tok[k] < len) codes[k] = fp8_codes(r, job.vec, value_offset(r, b, h, t0 + tok[k], 16 * c[k]));
  if (col) {
    if (tok[0] < len) {
      const int64_t rb = scale_row(r.sc, b, h, t0 + tok[0]) / 32;
      ec = col_scales(r.sc.ptr, cursor[c[0]], r.sc.map.cols, rb), cached = rb;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kItems; ++k)
      if (tok[k] < len)
        sb[k] = ptx::ld_global_nc_u8(r.sc.ptr + cursor_offset(cursor[c[k]], scale_row(r.sc, b, h, t0 + tok[k])));
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    if (tok[k] >= len) continue;
    uint32_t w[8];
    if (col) {
      const int64_t rb = scale_row(r.sc, b, h, t0 + tok[k]) / 32;
      if (rb != cached) ec = col_scales(r.sc.ptr, cursor[c[k]], r.sc.map.cols, rb), cached = rb;
      fp8_words<false>(r, codes[k], ec, stage[threadIdx.x], w);
    } else {
      fp8_words<true>(r, codes[k], make_uint4(sb[k], 0, 0, 0), stage[threadIdx.x], w);
    }
    store_chunk(dst + (t0 + tok[k]) * job.view.st_s + 16 * c[k], w);
  }
}

// clamp_cu_seqlens: threads 0 and 32 scan cu_q and cu_kv in chunks staged in shared memory (their
// loads issued by the whole block), each entry clamped to [previous, min(total, previous + bound)].
constexpr int kCuChunk = 2048;
__global__ void __launch_bounds__(kThreads) clamp_cu(const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_kv,
                                                     int32_t* __restrict__ out, int64_t n, int64_t total_q,
                                                     int64_t total_kv, int64_t bound_q, int64_t bound_kv) {
  __shared__ int32_t buf[2][kCuChunk];
  int64_t prev[2] = {0, 0};  // (threads 0 and 32: the clamped entry before the chunk)
  for (int64_t i0 = 0; i0 < n; i0 += kCuChunk) {
    const int m = static_cast<int>(n - i0 < kCuChunk ? n - i0 : kCuChunk);
    for (int i = threadIdx.x; i < m; i += kThreads) buf[0][i] = cu_q[i0 + i], buf[1][i] = cu_kv[i0 + i];
    __syncthreads();
    if (threadIdx.x % 32 == 0 && threadIdx.x < 64) {
      const int a = threadIdx.x / 32;
      const int64_t total = a ? total_kv : total_q, bound = a ? bound_kv : bound_q;
      int64_t v = prev[a];
      for (int i = 0; i < m; ++i) {
        const int64_t lo = i0 + i == 0 ? 0 : v, hi = i0 + i == 0 ? total : (v + bound < total ? v + bound : total);
        const int64_t x = buf[a][i];
        v = x < lo ? lo : (x > hi ? hi : x);
        buf[a][i] = static_cast<int32_t>(v);
      }
      prev[a] = v;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < m; i += kThreads) out[i0 + i] = buf[0][i], out[n + i0 + i] = buf[1][i];
    __syncthreads();
  }
}

}  // namespace

std::unique_ptr<StreamScratch> clamp_cu_seqlens(const char* op, const int32_t*& cu_q, const int32_t*& cu_kv, int64_t B,
                                                int64_t total_q, int64_t total_kv, int64_t bound_q, int64_t bound_kv,
                                                cudaStream_t s) {
  const int64_t n = B + 1;
  if (n > (int64_t{1} << 30)) throw Error(op, "cu_seqlens_q", "has too many entries");
  auto mem = std::make_unique<StreamScratch>(2 * n * 4, s);
  int32_t* out = reinterpret_cast<int32_t*>(mem->ptr);
  clamp_cu<<<1, kThreads, 0, s>>>(cu_q, cu_kv, out, n, total_q, total_kv, bound_q, bound_kv);
  MXMLA_CUDA_CHECK(cudaGetLastError());
  cu_q = out, cu_kv = out + n;
  return mem;
}

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

void stage_attn_reads(const char* op, const StageSeqs& g, const StageRequest* reqs, int n, cudaStream_t s) {
  if (n < 0 || n > kMaxJobs) throw Error(op, "q", "internal: more reads to convert than one launch takes");
  StageJobs jobs{};
  jobs.n = 0;
  int64_t x = 0;
  for (int k = 0; k < n; ++k) {
    const StageRequest& q = reqs[k];
    const AttnRead& r = *q.src;
    const int64_t S = q.kv ? g.Skv : g.Sq, tokens = g.thd ? (q.kv ? g.total_kv : g.total_q) : S;
    if (q.d % 16 != 0 || q.d > 16 * kMaxChunks)
      throw Error(op, "q", "the conversion pass needs head dims that are multiples of 16, at most " +
                               std::to_string(16 * kMaxChunks) + ", got " + std::to_string(q.d));
    if (S * (q.d / 16) >= (int64_t{1} << 31))
      throw Error(op, "q", "has too many tokens a sequence for the conversion pass (" + std::to_string(S) + ")");
    // [B][heads][S][d], thd [heads][total tokens][d]
    *q.keep = std::make_unique<StreamScratch>(stage_attn_bytes(g, q.kv, q.heads, q.d), s);
    StageJob job;
    job.src = r;
    job.vec = attn_read_vec_ok(r);
    job.kv = q.kv;
    job.d = static_cast<int32_t>(q.d);
    job.h0 = q.h0;
    job.view.st_b = g.thd ? 0 : q.heads * tokens * q.d;
    job.view.st_s = q.d;
    job.view.st_h = tokens * q.d;
    // head h of r at scratch + (h − h0)·st_h (integer arithmetic: the pointer may lie before the scratch)
    job.dst = reinterpret_cast<uint16_t*>(reinterpret_cast<uintptr_t>((*q.keep)->ptr) -
                                          static_cast<uintptr_t>(q.h0 * job.view.st_h * 2));
    job.view.data = job.dst;
    *q.view = job.view;
    job.blocks = stage_blocks(r, S, q.d / 16);
    job.x0 = x;
    if (job.blocks <= 0 || q.heads <= 0) continue;
    x += job.blocks * q.heads;
    jobs.job[jobs.n++] = job;
  }
  if (jobs.n == 0 || g.B == 0) return;
  const unsigned blocks = grid_dim(op, x, true, "rows");
  for_sequence_chunks(op, g.B, g.thd, [&](int64_t b0, unsigned n) {
    StageSeqs c = g;
    if (c.thd) c.cu_q += b0, c.cu_kv += b0;
    c.B = n;
    attn_stage<<<dim3(blocks, 1, n), kThreads, 0, s>>>(c, jobs);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace mxmla::detail
