// mxmla internal — RoPE backward fused with MXFP8 quantization (rope_backward_quantize): the two
// kernels (launchers: rope_quantize.cu). Arch-neutral within sm_90+ (the fast path loads by TMA
// onto mbarriers; no wgmma): built for every architecture in MXMLA_CUDA_ARCHS.
//
// dq [tokens, H, D] (any of sbhd / bshd / thd, strided) -> dx = R^T dq in fp32 -> E4M3/E5M2 codes
// and E8M0 scales of dx viewed as [tokens, H*D], rowwise and/or columnwise, plus an optional bf16 /
// fp32 copy of dx. A tile is 32 tokens x one head (the columnwise block height x a head, so every
// RoPE partner and every block is inside the tile); tiles are numbered head-fastest, so the
// heads of a token tile share table rows, which stay in cache while a block walks them.
// Two kernels: the generic one here (any head geometry and dtype), and further below a fast path
// for bf16 DeepSeek-V3 query heads (192 / 64) at one token stride, which the launcher prefers.
// Generic kernel: persistent blocks of 6 warps stream tiles through a kStages-deep cp.async ring of raw input
// tiles (no registers held by loads in flight) and, per tile:
//   2. RoPE backward in fp32 of the rope part only, into a shared fp32 tile [32][R + 4]; the nope
//      part is read from the raw tile (its fp32 values are the inputs themselves);
//   3. rowwise: lane = row, warp = 32-column block; lane pairs swap halves of their codes so each
//      store instruction writes whole 32-byte sectors;
//   4. columnwise: a lane owns 4 columns of 8 rows; 4 lanes combine a 32-row amax by shuffles;
//   5. the optional dx copy.
// Codes, amax and scales follow the quantize kernel's rules exactly (SPEC §2), on the fp32 values.
// Index math is 32-bit (the launcher checks tokens and tiles fit).
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_bf16.h>

#include "common/mxfp8_common.h"
#include "cuda/numerics.cuh"
#include "cuda/probe.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/convert.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/rope_common.cuh"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/stream_scratch.h"
#include "cuda/tile_scheduler.h"
#include "cuda/tma_desc.h"

namespace mxmla::detail::ropeq {

using namespace rope_dev;

// The fast path's probe points (cuda/probe.cuh; NoProbe compiles to nothing, the recording probe
// is dev/cuda/03_ropeq_profile.cu): per tile k, stamp slots 0-3 warp w's arrival at the tile
// barrier, 4-7 its iteration start, 8-10 warps 0-2's TMA wait (cycles), 11 the producer's TMA
// issue done (W3, after the barrier), each by lane 0 of the warp; cta_begin / cta_end(tiles) by
// thread 0. No stamp reads the barrier's exit: __syncthreads compiles to BAR.SYNC.DEFER_BLOCKING,
// and a clock read right after it issued before the last warp had arrived.

// Tile configuration.
constexpr int kThreads = 192;  // 6 warps: one per 32-column block of a DeepSeek head in the rowwise pass
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 32;      // tokens per tile = the MXFP8 block along the columnwise axis
constexpr int kStages = 2;     // raw tiles k+1 .. k+kStages-1 load while tile k is processed
constexpr int kMaxD = static_cast<int>(kRopeQuantizeMaxHeadDim);
static_assert(kStages >= 2, "the ring needs a stage to fill while one is processed");
static_assert(kMaxD % 32 == 0, "heads are whole MXFP8 blocks");
static_assert(kThreads % 32 == 0, "warp-uniform loop bounds");

// Shared memory: raw stages [kStages][32][D + pad] of T, then the fp32 rope tile [32][R + 4].
// Row pitches are an odd number of 16-byte units, so 8 lanes reading 16 bytes at the same column
// of 8 consecutive rows hit 8 different bank groups.
template <typename T>
__host__ __device__ __forceinline__ int raw_pitch(int D) { return D + 16 / static_cast<int>(sizeof(T)); }  // elements
__host__ __device__ __forceinline__ int rope_pitch(int R) { return R + 4; }                               // floats
template <typename T>
size_t smem_bytes(int64_t D, int64_t R) {
  return kStages * static_cast<size_t>(kRows * raw_pitch<T>(static_cast<int>(D))) * sizeof(T) +
         static_cast<size_t>(kRows * rope_pitch(static_cast<int>(R))) * sizeof(float);
}

struct Tile {
  int h, t0, nrows;  // head, first token, tokens present (0: past the end)
};
__device__ __forceinline__ Tile tile_at(const RopeKernelParams& p, int ntok, int64_t idx, int64_t end) {
  if (idx >= end) return {0, 0, 0};
  const int i = static_cast<int>(idx), H = static_cast<int>(p.H);
  const int t0 = (i / H) * kRows;
  return {i % H, t0, min(kRows, ntok - t0)};
}

// The tile's source view: element j of tile row r. dx values are the raw input in the nope
// part (exact in fp32) and the fp32 rope tile in the rope part.
template <typename T>
struct TileView {
  const T* raw;      // [32][raw_pitch]
  const float* rope;  // [32][rope_pitch]
  int D, nope, rp, rrp;
  // 8 consecutive values starting at j (j % 8 == 0; never straddles nope / rope)
  __device__ __forceinline__ void load8(int r, int j, float* v) const {
    if (j < nope) {
      unpack8<T>(*reinterpret_cast<const Raw8<T>*>(raw + r * rp + j), v);
    } else {
      const float4* q = reinterpret_cast<const float4*>(rope + r * rrp + (j - nope));
      const float4 a = q[0], b = q[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
  }
  // 4 consecutive values starting at j (j % 4 == 0)
  __device__ __forceinline__ float4 load4(int r, int j) const {
    if (j < nope) {
      const T* p = raw + r * rp + j;
      if constexpr (sizeof(T) == 4) {
        return *reinterpret_cast<const float4*>(p);
      } else {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        return make_float4(Elem<T>::to_float(static_cast<uint16_t>(w.x & 0xFFFF)),
                           Elem<T>::to_float(static_cast<uint16_t>(w.x >> 16)),
                           Elem<T>::to_float(static_cast<uint16_t>(w.y & 0xFFFF)),
                           Elem<T>::to_float(static_cast<uint16_t>(w.y >> 16)));
      }
    }
    return *reinterpret_cast<const float4*>(rope + r * rrp + (j - nope));
  }
};

// cp.async of a tile's rows (D elements of head h for 32 tokens) into a raw stage. Chunk c =
// tid + i * kThreads of the tile is (row c / cpr, chunk c % cpr), stepped without divisions.
template <typename T>
__device__ __forceinline__ void issue_tile(const RopeKernelParams& p, const Tile& t, T* stage, int r0, int k0, int dr,
                                           int dk) {
  const int cpr = static_cast<int>(p.D) * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
  const int rp_bytes = raw_pitch<T>(static_cast<int>(p.D)) * static_cast<int>(sizeof(T));
  for (int r = r0, k = k0; r < t.nrows; r += dr, k += dk) {
    if (k >= cpr) k -= cpr, ++r;
    if (r >= t.nrows) break;
    int s, b;
    token_sb(p, t.t0 + r, s, b);
    const char* src = reinterpret_cast<const char*>(static_cast<const T*>(p.in) + s * p.in_st[0] + b * p.in_st[1] +
                                                    t.h * p.in_st[2]);
    ptx::cp_async<16>(reinterpret_cast<char*>(stage) + r * rp_bytes + 16 * k, src + 16 * k, 16);
  }
}

// Phase 2: RoPE backward of the rope part into the fp32 rope tile. Unit u = (row, thread q).
template <typename T, typename TT>
__device__ __forceinline__ void rope_to_tile(const RopeKernelParams& p, const Tile& t, const T* raw, float* rope,
                                             const int64_t* cu, int64_t ncu, int tid) {
  const int D = static_cast<int>(p.D), R = static_cast<int>(p.R), nope = D - R, half = R / 2;
  const int lanes = R / 16, rp = raw_pitch<T>(D), rrp = rope_pitch(R);
  const SetChoice sc = sets_of(p.style, true);
  for (int u = tid; u < t.nrows * lanes; u += kThreads) {
    const int r = u / lanes, q = u % lanes;
    const T* xr = raw + r * rp + nope;
    float in[16], o[16], c[16], sn[16];
    unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + set_part(sc.in_c, q, half, 0)), in);
    unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + set_part(sc.in_c, q, half, 1)), in + 8);
    int s, b;
    token_sb(p, t.t0 + r, s, b);
    const int64_t row = table_row(p, cu, ncu, t.t0 + r, s);
    load_table16<TT>(p.cos, row, p.tab_row_stride, sc.tab_c, q, half, c);
    load_table16<TT>(p.sin, row, p.tab_row_stride, sc.tab_c, q, half, sn);
    rotate16(p.style, true, in, c, sn, o);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      float4* d = reinterpret_cast<float4*>(rope + r * rrp + set_part(sc.out_c, q, half, part));
      d[0] = make_float4(o[8 * part], o[8 * part + 1], o[8 * part + 2], o[8 * part + 3]);
      d[1] = make_float4(o[8 * part + 4], o[8 * part + 5], o[8 * part + 6], o[8 * part + 7]);
    }
  }
}

// A row's 32 codes (8 words) of one block, lanes 2k / 2k+1 = rows 2k / 2k+1: the lanes swap
// halves so that each store instruction writes whole 32-byte sectors. dst_even: the block's
// first byte in row lane - odd, plus 16 odd. Evict-first stores (the fast path below, which
// writes its codes with the default policy, measured them 1.8 % slower there).
__device__ __forceinline__ void store_row_block(const uint32_t* w, uint8_t* dst_even, int64_t HD, int lane, int nrows) {
  const int odd = lane & 1;
  uint32_t mine[4], theirs[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    mine[k] = odd ? w[4 + k] : w[k];
    theirs[k] = __shfl_xor_sync(0xFFFFFFFFu, odd ? w[k] : w[4 + k], 1);
  }
  const uint4 even_half = odd ? make_uint4(theirs[0], theirs[1], theirs[2], theirs[3])
                              : make_uint4(mine[0], mine[1], mine[2], mine[3]);
  const uint4 odd_half = odd ? make_uint4(mine[0], mine[1], mine[2], mine[3])
                             : make_uint4(theirs[0], theirs[1], theirs[2], theirs[3]);
  uint4* de = reinterpret_cast<uint4*>(dst_even);
  uint4* dodd = reinterpret_cast<uint4*>(dst_even + HD);
  if (lane - odd < nrows) __stcs(de, even_half);
  if ((lane | 1) < nrows) __stcs(dodd, odd_half);
}

// Phase 3: rowwise. Lane = row, warp = 32-column block. Codes leave in whole 32-byte sectors:
// lanes 2k and 2k+1 swap halves so each store instruction writes both halves of one row's block.
template <typename T, bool kE4M3>
__device__ __forceinline__ void rowwise(const RopeQuantizeParams& P, const Tile& t, const TileView<T>& tv, int lane,
                                        int warp) {
  constexpr uint32_t rcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * tv.D;
  const int odd = lane & 1;
  for (int blk = warp; blk < tv.D / 32; blk += kWarps) {
    float v[32];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) tv.load8(lane, 32 * blk + 8 * k, v + 8 * k);
#pragma unroll
    for (int k = 0; k < 32; ++k) m = max(m, mag_bits(v[k]));  // rows past the end hold stale data: never stored
    const uint8_t e = block_scale_from_amax_bits(m, rcp);
    const float mul = e8m0_quant_multiplier(e);
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      w[k] = ptx::cvt_fp8x2<kE4M3>(v[4 * k] * mul, v[4 * k + 1] * mul) |
             (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(v[4 * k + 2] * mul, v[4 * k + 3] * mul)) << 16);
    store_row_block(w, P.row_codes + (t.t0 + lane - odd) * HD + col0 + 32 * blk + 16 * odd, HD, lane, t.nrows);
    if (lane < t.nrows) P.row_scales[cursor_offset(row_cursor(P.row_map, 0, col0 / 32 + blk), t.t0 + lane)] = e;
  }
}

// Columnwise scales of 4 consecutive columns starting at column `col` of the tile's block row,
// byte j of `s` for column col + j (both kernels).
__device__ __forceinline__ void col_scales4(const RopeQuantizeParams& P, int t0, int64_t col, uint32_t s) {
  const ScaleCursor cc = col_cursor(P.col_map, 0, t0 / kRows, col);
  uint8_t* d0 = P.col_scales + cursor_offset(cc, 0);
  if (cc.compact && reinterpret_cast<uintptr_t>(d0) % 4 == 0) {
    *reinterpret_cast<uint32_t*>(d0) = s;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) P.col_scales[cursor_offset(cc, j)] = static_cast<uint8_t>(s >> (8 * j));
  }
}

// Phase 4: columnwise. Unit u = (4 columns, 8 rows); lanes 8 apart share columns; D units.
template <typename T, bool kE4M3>
__device__ __forceinline__ void columnwise(const RopeQuantizeParams& P, const Tile& t, const TileView<T>& tv,
                                           int tid) {
  constexpr uint32_t rcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * tv.D;
  for (int u = tid; u < tv.D; u += kThreads) {
    const int lane = u & 31, part = lane >> 3, cg = (u >> 5) * 8 + (lane & 7);
    float4 v[8];
    uint32_t m[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * part + i;
      v[i] = tv.load4(r, 4 * cg);
      if (r < t.nrows) {
        m[0] = max(m[0], mag_bits(v[i].x)), m[1] = max(m[1], mag_bits(v[i].y));
        m[2] = max(m[2], mag_bits(v[i].z)), m[3] = max(m[3], mag_bits(v[i].w));
      }
    }
    float mul[4];
    uint32_t scales = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      m[j] = max(m[j], __shfl_xor_sync(0xFFFFFFFFu, m[j], 8));
      m[j] = max(m[j], __shfl_xor_sync(0xFFFFFFFFu, m[j], 16));
      const uint8_t e = block_scale_from_amax_bits(m[j], rcp);
      scales |= static_cast<uint32_t>(e) << (8 * j);
      mul[j] = e8m0_quant_multiplier(e);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * part + i;
      if (r < t.nrows) {
        const uint32_t w = ptx::cvt_fp8x2<kE4M3>(v[i].x * mul[0], v[i].y * mul[1]) |
                           (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(v[i].z * mul[2], v[i].w * mul[3])) << 16);
        __stcs(reinterpret_cast<unsigned int*>(P.col_codes + (t.t0 + r) * HD + col0 + 4 * cg), w);
      }
    }
    if (part == 0) col_scales4(P, t.t0, col0 + 4 * cg, scales);
  }
}

// Phase 5: the dx copy (contiguous, token order). fp32 dq into an fp32 copy: the nope part is dq
// itself, bit for bit (NaN payloads included, as the reference and apply_rope pass it through);
// everything else is rounded with the output rules (canonical NaN).
template <typename T>
__device__ __forceinline__ void copy_dx(const RopeQuantizeParams& P, const Tile& t, const TileView<T>& tv, int tid) {
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * tv.D;
  const int cpr = tv.D / 8;
  for (int u = tid; u < t.nrows * cpr; u += kThreads) {
    const int r = u / cpr, c8 = u % cpr;
    const int64_t off = (t.t0 + r) * HD + col0 + 8 * c8;
    if constexpr (sizeof(T) == 4) {
      if (P.dx_t == DType::kFloat32 && 8 * c8 < tv.nope) {
        store_raw8<float>(static_cast<float*>(P.dx) + off, *reinterpret_cast<const Raw8<float>*>(tv.raw + r * tv.rp + 8 * c8));
        continue;
      }
    }
    float v[8];
    tv.load8(r, 8 * c8, v);
    if (P.dx_t == DType::kFloat32) store_raw8<float>(static_cast<float*>(P.dx) + off, pack8<float>(v));
    else store_raw8<__nv_bfloat16>(static_cast<__nv_bfloat16*>(P.dx) + off, pack8<__nv_bfloat16>(v));
  }
}

template <typename T, typename TT, bool kE4M3>
__global__ void __launch_bounds__(kThreads) rope_quantize_kernel(const RopeQuantizeParams P, const int64_t* cu,
                                                                      int64_t ncu, int ntiles) {
  if (P.run_if != nullptr && *P.run_if == 0u) return;  // a fallback launch whose flag is clear
  extern __shared__ __align__(16) float smem[];
  const RopeKernelParams& p = P.rope;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, ntok = static_cast<int>(p.S * p.B);
  const int D = static_cast<int>(p.D), R = static_cast<int>(p.R);
  const int stage_elems = kRows * raw_pitch<T>(D);
  T* raw = reinterpret_cast<T*>(smem);
  float* rope = reinterpret_cast<float*>(raw + kStages * stage_elems);
  // this thread's first chunk of a tile and the step between its chunks
  const int cpr = D * static_cast<int>(sizeof(T)) / 16;
  const int r0 = tid / cpr, k0 = tid % cpr, dr = kThreads / cpr, dk = kThreads % cpr;
  // Block b walks the contiguous tile range [lo, hi): runs of H tiles share their token rows, so
  // the table rows stay in L1 while the block walks the heads.
  const int64_t lo = blockIdx.x * static_cast<int64_t>(ntiles) / gridDim.x;
  const int64_t hi = (blockIdx.x + 1) * static_cast<int64_t>(ntiles) / gridDim.x;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const Tile t = tile_at(p, ntok, lo + s, hi);
    if (t.nrows > 0) issue_tile<T>(p, t, raw + s * stage_elems, r0, k0, dr, dk);
    ptx::cp_async_commit();
  }
  for (int64_t k = 0; lo + k < hi; ++k) {
    ptx::cp_async_wait<kStages - 2>();  // tile k has landed for this thread ...
    __syncthreads();                    // ... and for everybody; every pass over tile k - 1 is done
    const Tile tn = tile_at(p, ntok, lo + k + kStages - 1, hi);  // into the stage tile k - 1 used
    if (tn.nrows > 0) issue_tile<T>(p, tn, raw + ((k + kStages - 1) % kStages) * stage_elems, r0, k0, dr, dk);
    ptx::cp_async_commit();  // one group per step (empty at the tail): the wait count holds
    const Tile t = tile_at(p, ntok, lo + k, hi);
    const T* stage = raw + (k % kStages) * stage_elems;
    rope_to_tile<T, TT>(p, t, stage, rope, cu, ncu, tid);
    __syncthreads();  // the rope tile is complete
    const TileView<T> tv{stage, rope, D, D - R, raw_pitch<T>(D), rope_pitch(R)};
    if (P.row_codes != nullptr) rowwise<T, kE4M3>(P, t, tv, lane, warp);
    if (P.col_codes != nullptr) columnwise<T, kE4M3>(P, t, tv, tid);
    if (P.dx != nullptr) copy_dx<T>(P, t, tv, tid);
  }
}

// ---------------------------------------------------------------------------------------------
// Fast path: bf16 dq with DeepSeek-V3 query heads (D = 192, R = 64) whose tokens sit at one
// uniform stride (contiguous thd / sbhd / bshd, or head-strided). The generic kernel above spends
// ~40 instructions per element on run-time geometry and short per-thread units. This one fixes
// the geometry and, as the quantize kernel does, gives every thread a long unit whose amax is a
// thread-local reduction. A tile is 32 tokens x one head; four warps, one role each:
//   W0 RoPE:     lane = row: RoPE backward of the row's 64 rope elements (table values from
//                the lane's own shared-memory slots, which hold the current run's token tile:
//                see the tile order below), the fp32 result into the rope tile, then the row's
//                two rope blocks rowwise: the row's 64 code bytes go into its own row of the
//                stage's rope third (read and no longer needed), and after a __syncwarp each
//                store instruction writes 8 rows x 64 bytes (16 rows x 32 bytes straight from
//                registers: 1.1 % slower);
//   W1 nope row: the four nope blocks of every row, lane = (row 4i + lane / 8, 16 columns), two
//                lanes per block: each code store writes 4 whole 128-byte rows (lane = row
//                wrote 16 rows x 32 bytes per instruction: 1.8 % slower); lanes 4-7 of each
//                quarter warp take the neighbouring row, which keeps the 16-byte loads free of
//                bank conflicts without selects (0.4 % faster than swapping their two chunks);
//   W2 nope col: lane l = columns [4l, 4l + 4) of all 32 rows: packed bf16 amax in the lane, each
//                code store instruction writes one 128-byte row (lane = (8-column chunk, 16-row
//                half), 2 rows x 128 bytes per instruction and a shuffle joining the halves: 1.2 %
//                slower; 16 columns x 8 rows per lane, 4 rows per instruction: 30 % slower);
//   W3 rope col: one tile behind: the rope tile of the previous tile, lane = (4 fp32 columns,
//                16-row half). Lane 0 is also the TMA producer.
//   Rowwise scales: W0 / W1 put them in a sink that collects a group (the block's consecutive
//   tiles of one token tile inside one aligned block of 8 heads: 48 bytes per row), and W3
//   writes a closed group in 16-byte stores (three 2-byte stores per row and tile: 0.9 %
//   slower; the scales cost ~6.5 % of the time when written that way).
//   W1 / W3 also hold, lane = row, the cos / sin row of the block's next run in registers
//   (loaded a run ahead, issued just after the hand-off barrier so that they overlap a tile)
//   and store it into W0's slots between two runs (one extra barrier per run): W0 never waits
//   for a table load (W2 holding the cos row instead of W1: 0.6 % slower; a quarter row in
//   each of the four warps, 25 registers fewer: 3 % slower).
// Tile order: runs of up to 32 heads of one token tile from a queue in tile order (a global
// counter, zeroed per launch), shorter runs (16, then 8) at the end so that the blocks finish
// together (cuda/tile_scheduler.h): co-running blocks share DRAM pages, a block's contiguous range
// of tiles was 1.6 % slower (same-run A/B), runs of 8 throughout pay more in table reloads than
// they gain (runs of 16 equal runs of 32; runs of 64 / 128 were 0.4 / 0.6 % slower), and the
// queue took 2.8 % off the static round-robin deal of runs of 32 (measured on the H200: docs/notes-rope.md). Head
// counts that are not a multiple of 8 take contiguous ranges (short runs would hand the tables
// off every few tiles).
// Loads: three TMA copies per tile (a 3-D map {D, H, tokens}, boxes {64, 1, 32} with the 128-byte
// swizzle: a stage is [3 column thirds][32 rows][128 bytes], 16-byte chunk c of a row at c ^ (row
// % 8), so lane-per-row and lane-per-chunk reads are both conflict-free; rows past the last token
// are outside the tensor and land as zeros), on the stage's mbarrier; 3 stages. The TMA unit reads
// exactly the head's 384 bytes per row this way: one box {D + 8, 1, 32} into 400-byte rows (the
// padding made the reads conflict-free) took 2.3 times the L2 read requests, 10 % more DRAM reads
// and 5.5 % more time (measured on the H200: git history of docs/performance.md). The rope tile and the group
// sink are double-buffered, so one barrier per tile orders everything: W0-W2 work on tile k
// while W3 finishes tile k - 1 (and writes the group tile k - 1 closed). Rows past the last token
// are zero with zero tables, so every amax runs over all 32 rows unpredicated; only stores are
// predicated. The optional dx copy is written by W0 (rope part) and W1 (nope part). Codes are
// stored with the default cache policy (evict-first measured 1.8 % slower). What was measured
// and tried: docs/notes-rope.md.
namespace mla {
constexpr int kD = 192, kR = 64, kNope = kD - kR, kHalf = kR / 2;
constexpr int kThreads = 128;
constexpr int kStages = 3;
constexpr int kThird = 64;  // columns per TMA box: 128 bytes, the 128-byte swizzle's span
constexpr int kRopePitch = kR + 4;  // floats per rope-tile row: 272 bytes = 17 units (odd)
constexpr int kTileBytes = kRows * kD * 2;  // three boxes {kThird, 1, kRows}
constexpr int kStageElems = kRows * kD;
constexpr int kRopeFloats = kRows * kRopePitch;
constexpr int kTabSlots = 2 * kR / 4;  // float4 slots per lane: cos then sin, in column order
// shared memory: raw stages | 2 rope tiles | table slots [32][32] float4 | 2 group sinks [32][48] | mbarriers
constexpr int kRawBytes = kStages * kTileBytes, kRopeBytes = 2 * kRopeFloats * 4, kTabBytes = kTabSlots * 32 * 16;
constexpr int kGroup = 8, kGPitch = kGroup * 6;  // row scales collected per 8 heads: 48 bytes per row
constexpr int kSinkBytes = 2 * kRows * kGPitch;
constexpr int kSmemBytes = 1024 + kRawBytes + kRopeBytes + kTabBytes + kSinkBytes + kStages * 8;  // + alignment
static_assert(kNope == 4 * 32 && kR == 2 * 32, "roles: 4 nope blocks (W1), 2 rope blocks (W0) per row");
static_assert(kNope / 4 == 32 && kR / 4 == 16, "W2: 4 columns per lane; W3: 16 column chunks x 2 row halves");
static_assert(kD == 3 * kThird && kThird * 2 == 128, "a row is three 128-byte swizzle rows");
static_assert((kRows * kThird * 2) % 1024 == 0, "every box starts on a 1024-byte swizzle atom");
static_assert((kRawBytes + kRopeBytes + kTabBytes + kSinkBytes) % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(3 * (kSmemBytes + 1024) <= 228 * 1024, "three blocks per SM");

// Chunk c (16 bytes, columns [8c, 8c + 8), c < 24) of row r of a stage: the TMA 128-byte swizzle
// puts it at chunk (c % 8) ^ (r % 8) of row r of column third c / 8 (a third: 32 rows x 8 chunks).
__device__ __forceinline__ const uint4* chunk_at(const __nv_bfloat16* stage, int r, int c) {
  return reinterpret_cast<const uint4*>(stage) + (c >> 3) * (kRows * 8) + r * 8 + ((c & 7) ^ (r & 7));
}

__device__ __forceinline__ uint32_t bf_mag(uint32_t w) { return w & 0x7FFF7FFFu; }


// The table row of token `tok` (zero past the last token) for one table (t = 0: cos, 1: sin), held
// in registers by one lane of W1 (cos) or W3 (sin) while the block works through a run.
template <typename TT>
__device__ __forceinline__ void load_table_row(const RopeKernelParams& p, const int64_t* cu, int64_t ncu, int ntok,
                                               int tok, int t, float (&v)[kR]) {
  int s = 0, b = 0;
  int64_t row = 0;
  const bool ok = tok < ntok;
  if (ok) token_sb(p, tok, s, b), row = table_row(p, cu, ncu, tok, s);
  const TT* src = static_cast<const TT*>(t ? p.sin : p.cos) + row * p.tab_row_stride;
#pragma unroll
  for (int c = 0; c < kR; c += 8) {
    if (ok) {
      unpack8<TT>(load_raw8<TT, true>(src + c), v + c);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[c + j] = 0.f;
    }
  }
}
// ... into W0's slots: slot k < 16 holds cos[4k, 4k + 4), slot 16 + k sin[4k, 4k + 4), of tile row
// `lane` at tab[k * 32 + lane].
__device__ __forceinline__ void store_table_row(float4* tab, int t, int lane, const float (&v)[kR]) {
#pragma unroll
  for (int c = 0; c < kR; c += 4) tab[(16 * t + c / 4) * 32 + lane] = make_float4(v[c], v[c + 1], v[c + 2], v[c + 3]);
}

// Tile order: queued runs of up to kRun0 heads of one token tile (cuda/tile_scheduler.h).
constexpr int kRun0 = 32;
static_assert(kRun0 >= kMinRun && kRun0 <= kMaxRun && (kRun0 & (kRun0 - 1)) == 0, "a queue run length");

// 8 table values at column c (c % 4 == 0; two slots).
__device__ __forceinline__ void tab8(const float4* tab, int slot0, int lane, float* v) {
  const float4 a = tab[slot0 * 32 + lane], b = tab[(slot0 + 1) * 32 + lane];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Copies: lanes 2k and 2k + 1 each hold one 32-byte sector of the output as two 16-byte halves
// (x0, x1; their own sector at `mine`, the partner's at `theirs`). They swap one half, so that each
// of the two store instructions writes whole sectors: the first the even lane's sector, the second
// the odd lane's (16-byte stores from every lane to separate sectors took 10 % longer than the
// codes and the GEMMs' dequantizing passes together; same-run A/B on the H200, docs/notes-rope.md).
// Every lane of the warp calls it; `ok`: this pair stores (uniform in the pair).
__device__ __forceinline__ void store_sector_pair(uint4* mine, uint4* theirs, const uint4& x0, const uint4& x1, int lane,
                                                  bool ok) {
  const int odd = lane & 1;
  const uint4 give = odd ? x0 : x1;
  uint4 got;
  got.x = __shfl_xor_sync(0xFFFFFFFFu, give.x, 1), got.y = __shfl_xor_sync(0xFFFFFFFFu, give.y, 1);
  got.z = __shfl_xor_sync(0xFFFFFFFFu, give.z, 1), got.w = __shfl_xor_sync(0xFFFFFFFFu, give.w, 1);
  if (!ok) return;
  if (odd) {
    theirs[1] = got;  // the even lane's sector, second half
    mine[1] = x1;
  } else {
    mine[0] = x0;
    theirs[0] = got;  // the odd lane's sector, first half
  }
}

// W0 with copies: the rowwise copy of the row's two rope blocks (the dequantized codes, 128 bytes),
// staged in the row's own (consumed) row of the stage's rope third (16-byte chunk cc at cc ^ (row %
// 8)), then after a __syncwarp stored 4 rows x 128 bytes per instruction.
template <bool kE4M3>
__device__ __forceinline__ void rope_row_copy(const RopeQuantizeParams& P, const float* rr, uint4* third, const Tile& t,
                                              int lane) {
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    float4 v[8];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = *reinterpret_cast<const float4*>(rr + 32 * b + 4 * k);
      m = max(m, max(max(mag_bits(v[k].x), mag_bits(v[k].y)), max(mag_bits(v[k].z), mag_bits(v[k].w))));
    }
    const uint8_t e = block_scale_from_amax_bits(m, rcp_max_bits<kE4M3>());
    const float mul = e8m0_quant_multiplier(e), f = e8m0_factor(e);
    check_exact<kE4M3>(P.inexact, e, m);  // rows past the end are zero
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      const uint32_t w0 = fp8x4<kE4M3>(v[k].x, v[k].y, v[k].z, v[k].w, mul);
      const uint32_t w1 = fp8x4<kE4M3>(v[k + 1].x, v[k + 1].y, v[k + 1].z, v[k + 1].w, mul);
      third[lane * 8 + ((4 * b + k / 2) ^ (lane & 7))] =
          make_uint4(dequant_pair<kE4M3>(w0 & 0xFFFFu, f), dequant_pair<kE4M3>(w0 >> 16, f),
                     dequant_pair<kE4M3>(w1 & 0xFFFFu, f), dequant_pair<kE4M3>(w1 >> 16, f));
    }
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kRows / 4; ++j) {
    const int r = 4 * j + (lane >> 3), cc = lane & 7;
    const uint4 v = third[r * 8 + (cc ^ (r & 7))];
    if (r < t.nrows)
      *reinterpret_cast<uint4*>(P.row_copy + static_cast<int64_t>(t.t0 + r) * P.row_copy_ld +
                                static_cast<int64_t>(t.h) * kD + kNope + 8 * cc) = v;
  }
  ptx::fence_proxy_async();  // generic writes to the stage, before the TMA refills it
}

// W0: RoPE backward of row `lane`, its fp32 rope row, then its two rope blocks rowwise (codes
// staged in the stage's rope third, which only W0 reads; scales into the group sink: `sink` =
// the head's 6-byte column of row 0).
template <bool kE4M3, bool kCopies>
__device__ __forceinline__ void rope_row(const RopeQuantizeParams& P, const SetChoice& sc, __nv_bfloat16* stage,
                                         const float4* tab, float* rope, uint8_t* sink, const Tile& t, int64_t HD,
                                         int lane) {
  float* rr = rope + lane * kRopePitch;
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // the four 16-element sets of the shared RoPE helpers
    float in[16], c[16], s[16], o[16];
    unpack8<__nv_bfloat16>(Raw8<__nv_bfloat16>{{*chunk_at(stage, lane, 16 + set_part(sc.in_c, q, kHalf, 0) / 8)}}, in);
    unpack8<__nv_bfloat16>(Raw8<__nv_bfloat16>{{*chunk_at(stage, lane, 16 + set_part(sc.in_c, q, kHalf, 1) / 8)}}, in + 8);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const int col = set_part(sc.tab_c, q, kHalf, part);
      tab8(tab, col / 4, lane, c + 8 * part);
      tab8(tab, 16 + col / 4, lane, s + 8 * part);
    }
    rotate16(P.rope.style, true, in, c, s, o);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      float4* d = reinterpret_cast<float4*>(rr + set_part(sc.out_c, q, kHalf, part));
      d[0] = make_float4(o[8 * part], o[8 * part + 1], o[8 * part + 2], o[8 * part + 3]);
      d[1] = make_float4(o[8 * part + 4], o[8 * part + 5], o[8 * part + 6], o[8 * part + 7]);
    }
  }
  const int64_t row0 = static_cast<int64_t>(t.t0 + lane) * HD + static_cast<int64_t>(t.h) * kD;
  if (P.dx != nullptr && lane < t.nrows) {  // the rope part of the dx copy (own row: no barrier)
#pragma unroll
    for (int c = 0; c < kR; c += 8) {
      const float4 a = *reinterpret_cast<const float4*>(rr + c), b = *reinterpret_cast<const float4*>(rr + c + 4);
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      if (P.dx_t == DType::kFloat32) store_raw8<float>(static_cast<float*>(P.dx) + row0 + kNope + c, pack8<float>(v));
      else store_raw8<__nv_bfloat16>(static_cast<__nv_bfloat16*>(P.dx) + row0 + kNope + c, pack8<__nv_bfloat16>(v));
    }
  }
  uint4* third = reinterpret_cast<uint4*>(stage) + 2 * (kRows * 8);  // [32 rows][8 chunks]
  if constexpr (kCopies) {
    if (P.row_copy != nullptr) rope_row_copy<kE4M3>(P, rr, third, t, lane);
    return;
  }
  if (P.row_codes == nullptr) return;
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    float4 v[8];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = *reinterpret_cast<const float4*>(rr + 32 * b + 4 * k);
      m = max(m, max(max(mag_bits(v[k].x), mag_bits(v[k].y)), max(mag_bits(v[k].z), mag_bits(v[k].w))));
    }
    const uint8_t e = block_scale_from_amax_bits(m, rcp_max_bits<kE4M3>());
    const float mul = e8m0_quant_multiplier(e);
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = fp8x4<kE4M3>(v[k].x, v[k].y, v[k].z, v[k].w, mul);
    // the row's codes into its own (consumed) row of the stage's rope third, 16-byte chunk cc of
    // row r at ((cc + 4 (r % 2)) ^ (r % 8)): conflict-free for these writes and the reads below
    third[lane * 8 + ((2 * b + 4 * (lane & 1)) ^ (lane & 7))] = make_uint4(w[0], w[1], w[2], w[3]);
    third[lane * 8 + ((2 * b + 1 + 4 * (lane & 1)) ^ (lane & 7))] = make_uint4(w[4], w[5], w[6], w[7]);
    sink[lane * kGPitch + 4 + b] = e;
  }
  __syncwarp();
  // 8 rows x 64 bytes per store instruction (was 16 rows x 32 bytes)
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = 8 * j + (lane >> 2), cc = lane & 3;
    const uint4 v = third[r * 8 + ((cc + 4 * (r & 1)) ^ (r & 7))];
    if (r < t.nrows)
      *reinterpret_cast<uint4*>(P.row_codes + static_cast<int64_t>(t.t0 + r) * HD + static_cast<int64_t>(t.h) * kD +
                                kNope + 16 * cc) = v;
  }
  ptx::fence_proxy_async();  // generic writes to the stage, before the TMA refills it
}

// W1: the four nope blocks of row `lane` (and the nope part of the dx copy); scales into the
// group sink as in rope_row.
template <bool kE4M3, bool kCopies>
__device__ __forceinline__ void nope_row(const RopeQuantizeParams& P, const __nv_bfloat16* stage, uint8_t* sink,
                                         const Tile& t, int64_t HD, int lane) {
  const int64_t row0 = static_cast<int64_t>(t.t0 + lane) * HD + static_cast<int64_t>(t.h) * kD;
  if (P.dx != nullptr && lane < t.nrows) {
#pragma unroll 4
    for (int c = 0; c < kNope / 8; ++c) {
      float v[8];
      unpack8<__nv_bfloat16>(Raw8<__nv_bfloat16>{{*chunk_at(stage, lane, c)}}, v);
      if (P.dx_t == DType::kFloat32) store_raw8<float>(static_cast<float*>(P.dx) + row0 + 8 * c, pack8<float>(v));
      else store_raw8<__nv_bfloat16>(static_cast<__nv_bfloat16*>(P.dx) + row0 + 8 * c, pack8<__nv_bfloat16>(v));
    }
  }
  if ((kCopies ? static_cast<const void*>(P.row_copy) : P.row_codes) == nullptr) return;
  // Codes: lane = (row 4i + rs, 16 columns 16 (lane % 8)); two lanes per 32-column block (amax
  // joined by one shuffle), so each store instruction writes 4 whole 128-byte code rows. rs =
  // lane / 8, but lanes 4-7 of each quarter warp (the second column third) take the neighbouring
  // row (rs ^ 1): a quarter warp's 16-byte loads then hit 8 different bank groups.
  const int cp = lane & 7, rs = (lane >> 3) ^ ((cp >> 2) & 1);
  // [i % 2][k]: chunk 2 cp + k of row 4 i + rs is src[i % 2][k][64 (i / 2)] (the swizzle repeats
  // every 8 rows = 64 chunks)
  const uint4* src[2][2];
#pragma unroll
  for (int par = 0; par < 2; ++par)
#pragma unroll
    for (int k = 0; k < 2; ++k) src[par][k] = chunk_at(stage, 4 * par + rs, 2 * cp + k);
  uint8_t* dst = kCopies ? nullptr : P.row_codes + static_cast<int64_t>(t.t0 + rs) * HD + static_cast<int64_t>(t.h) * kD + 16 * cp;
  // with copies: the lane's 16 bf16 values of a row (32 bytes) instead of its 16 codes
  uint16_t* cdst = kCopies ? P.row_copy + static_cast<int64_t>(t.t0 + rs) * P.row_copy_ld + static_cast<int64_t>(t.h) * kD + 16 * cp
                           : nullptr;
  uint8_t* sk = sink + rs * kGPitch + (cp >> 1);
#pragma unroll 1
  for (int m = 0; m < kRows / 8; ++m) {
#pragma unroll
    for (int par = 0; par < 2; ++par) {
      const int r = 8 * m + 4 * par + rs;
      const uint4 v0 = src[par][0][64 * m], v1 = src[par][1][64 * m];
      uint32_t mm = __vmaxu2(__vmaxu2(__vmaxu2(bf_mag(v0.x), bf_mag(v0.y)), __vmaxu2(bf_mag(v0.z), bf_mag(v0.w))),
                             __vmaxu2(__vmaxu2(bf_mag(v1.x), bf_mag(v1.y)), __vmaxu2(bf_mag(v1.z), bf_mag(v1.w))));
      mm = __vmaxu2(mm, __shfl_xor_sync(0xFFFFFFFFu, mm, 1));
      const uint32_t amax = max(mm & 0xFFFFu, mm >> 16) << 16;
      const uint8_t e = block_scale_from_amax_bits(amax, rcp_max_bits<kE4M3>());
      const float mul = e8m0_quant_multiplier(e);
      const uint4 w = make_uint4(fp8x4<kE4M3>(bf16_lo(v0.x), bf16_hi(v0.x), bf16_lo(v0.y), bf16_hi(v0.y), mul),
                                 fp8x4<kE4M3>(bf16_lo(v0.z), bf16_hi(v0.z), bf16_lo(v0.w), bf16_hi(v0.w), mul),
                                 fp8x4<kE4M3>(bf16_lo(v1.x), bf16_hi(v1.x), bf16_lo(v1.y), bf16_hi(v1.y), mul),
                                 fp8x4<kE4M3>(bf16_lo(v1.z), bf16_hi(v1.z), bf16_lo(v1.w), bf16_hi(v1.w), mul));
      if constexpr (kCopies) {
        const float f = e8m0_factor(e);
        if ((cp & 1) == 0) check_exact<kE4M3>(P.inexact, e, amax);  // rows past the end are zero
        // the lane's 32 bytes are one sector; its pair (lane ^ 1) holds the next 16 columns of the row
        uint4* mine = reinterpret_cast<uint4*>(cdst);
        store_sector_pair(mine, mine + ((lane & 1) ? -2 : 2),
                          make_uint4(dequant_pair<kE4M3>(w.x & 0xFFFFu, f), dequant_pair<kE4M3>(w.x >> 16, f),
                                     dequant_pair<kE4M3>(w.y & 0xFFFFu, f), dequant_pair<kE4M3>(w.y >> 16, f)),
                          make_uint4(dequant_pair<kE4M3>(w.z & 0xFFFFu, f), dequant_pair<kE4M3>(w.z >> 16, f),
                                     dequant_pair<kE4M3>(w.w & 0xFFFFu, f), dequant_pair<kE4M3>(w.w >> 16, f)),
                          lane, r < t.nrows);
        cdst += 4 * P.row_copy_ld;
      } else {
        if (r < t.nrows) *reinterpret_cast<uint4*>(dst) = w;
        dst += 4 * HD;
        if ((cp & 1) == 0) sk[(8 * m + 4 * par) * kGPitch] = e;
      }
    }
  }
}

// W2's codes: row 8 g + j from src[j][128 g], stored at dst + (8 g + j) HD; kTail: rows >= nrows are skipped.
template <bool kE4M3, bool kTail>
__device__ __forceinline__ void nope_col_codes(const uint2* const (&src)[8], uint8_t* dst, int64_t HD, int nrows,
                                               float mul0, float mul1, float mul2, float mul3) {
#pragma unroll 1
  for (int g = 0; g < kRows / 8; ++g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint2 v = src[j][128 * g];
      const uint32_t w = ptx::cvt_fp8x2<kE4M3>(bf16_lo(v.x) * mul0, bf16_hi(v.x) * mul1) |
                         (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(bf16_lo(v.y) * mul2, bf16_hi(v.y) * mul3)) << 16);
      if (!kTail || j < nrows) *reinterpret_cast<uint32_t*>(dst) = w;
      dst += HD;
    }
    nrows -= 8;
  }
}

// W2: columnwise nope. Lane l owns columns [4l, 4l + 4) of the head (8 bytes at byte 8 (l % 2) of
// chunk l / 2) in all 32 rows: the amax is lane-local (packed bf16 magnitudes of two column pairs),
// and each code store instruction writes one row's 128 nope bytes. A half warp reads one whole
// swizzled 128-byte row of a column third: conflict-free. The lane's 8 shared-memory addresses of
// a group of 8 rows are computed once (the swizzle repeats every 8 rows), and full tiles store
// without a row predicate (fewer address instructions than chunk_at per row: level alone, -0.3 %
// together with W1's row permutation, git history of docs/performance.md).
// W2 / W3 with copies: 8 rows x 4 columns of codes (a[i]: columns 0-1 of row i, b[i]: columns 2-3,
// factors f) dequantized, as out[c]: column c's 8 bf16 values (16 bytes of the transposed copy).
template <bool kE4M3>
__device__ __forceinline__ void col_copy8(const uint32_t (&a)[8], const uint32_t (&b)[8], const float (&f)[4],
                                          uint4 (&out)[4]) {
  uint32_t d[4][8];  // d[c][i]: row i of column c, bf16
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t x = dequant_pair<kE4M3>(a[i], f[0], f[1]), y = dequant_pair<kE4M3>(b[i], f[2], f[3]);
    d[0][i] = x & 0xFFFFu, d[1][i] = x >> 16, d[2][i] = y & 0xFFFFu, d[3][i] = y >> 16;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c)
    out[c] = make_uint4(d[c][0] | (d[c][1] << 16), d[c][2] | (d[c][3] << 16), d[c][4] | (d[c][5] << 16),
                        d[c][6] | (d[c][7] << 16));
}
// ... rows row0 .. row0 + 15 of the lane's 4 columns (lo: rows row0 .. + 7, hi: the next 8) into the
// transposed copy, whole sectors per store: the lane pair's columns are 8 apart (col: this lane's first).
__device__ __forceinline__ void store_col_copy16(const RopeQuantizeParams& P, int64_t col, int row0, const uint4 (&lo)[4],
                                                 const uint4 (&hi)[4], int lane) {
  const int64_t partner = col + ((lane & 1) ? -4 : 4);
#pragma unroll
  for (int c = 0; c < 4; ++c)
    store_sector_pair(reinterpret_cast<uint4*>(P.col_copy + (col + c) * P.col_copy_ld + row0),
                      reinterpret_cast<uint4*>(P.col_copy + (partner + c) * P.col_copy_ld + row0), lo[c], hi[c], lane,
                      true);
}

template <bool kE4M3, bool kCopies>
__device__ __forceinline__ void nope_col(const RopeQuantizeParams& P, const __nv_bfloat16* stage, const Tile& t,
                                         int64_t HD, int lane) {
  // lane's 8 bytes of row 8 g + j: src[j][128 g] (the 128-byte swizzle repeats every 8 rows = 1024 bytes)
  const uint2* src[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) src[j] = reinterpret_cast<const uint2*>(chunk_at(stage, j, lane >> 1)) + (lane & 1);
  uint32_t m0 = 0, m1 = 0;  // columns (0, 1), (2, 3)
#pragma unroll 1
  for (int g = 0; g < kRows / 8; ++g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint2 v = src[j][128 * g];
      m0 = __vmaxu2(m0, bf_mag(v.x)), m1 = __vmaxu2(m1, bf_mag(v.y));
    }
  }
  const uint32_t e0 = block_scale_from_amax_bits(m0 << 16, rcp_max_bits<kE4M3>());
  const uint32_t e1 = block_scale_from_amax_bits(m0 & 0xFFFF0000u, rcp_max_bits<kE4M3>());
  const uint32_t e2 = block_scale_from_amax_bits(m1 << 16, rcp_max_bits<kE4M3>());
  const uint32_t e3 = block_scale_from_amax_bits(m1 & 0xFFFF0000u, rcp_max_bits<kE4M3>());
  const float mul0 = e8m0_quant_multiplier(static_cast<uint8_t>(e0)), mul1 = e8m0_quant_multiplier(static_cast<uint8_t>(e1));
  const float mul2 = e8m0_quant_multiplier(static_cast<uint8_t>(e2)), mul3 = e8m0_quant_multiplier(static_cast<uint8_t>(e3));
  const int64_t col = static_cast<int64_t>(t.h) * kD + 4 * lane;
  if constexpr (kCopies) {  // the transposed copy: every row of the tile (rows past the end are zero)
    check_exact<kE4M3>(P.inexact + 1, e0, m0 << 16), check_exact<kE4M3>(P.inexact + 1, e1, m0 & 0xFFFF0000u);
    check_exact<kE4M3>(P.inexact + 1, e2, m1 << 16), check_exact<kE4M3>(P.inexact + 1, e3, m1 & 0xFFFF0000u);
    const float f[4] = {e8m0_factor(e0), e8m0_factor(e1), e8m0_factor(e2), e8m0_factor(e3)};
#pragma unroll 1
    for (int g = 0; g < kRows / 8; g += 2) {  // rows 8 g .. 8 g + 15
      uint4 half[2][4];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        uint32_t a[8], b[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint2 v = src[j][128 * (g + k)];
          a[j] = ptx::cvt_fp8x2<kE4M3>(bf16_lo(v.x) * mul0, bf16_hi(v.x) * mul1);
          b[j] = ptx::cvt_fp8x2<kE4M3>(bf16_lo(v.y) * mul2, bf16_hi(v.y) * mul3);
        }
        col_copy8<kE4M3>(a, b, f, half[k]);
      }
      store_col_copy16(P, col, t.t0 + 8 * g, half[0], half[1], lane);
    }
    return;
  }
  uint8_t* dst = P.col_codes + static_cast<int64_t>(t.t0) * HD + col;
  if (t.nrows == kRows) nope_col_codes<kE4M3, false>(src, dst, HD, t.nrows, mul0, mul1, mul2, mul3);
  else nope_col_codes<kE4M3, true>(src, dst, HD, t.nrows, mul0, mul1, mul2, mul3);
  col_scales4(P, t.t0, col, e0 | (e1 << 8) | (e2 << 16) | (e3 << 24));
}

// W3: columnwise rope of the previous tile from its fp32 rope tile, lane = (4-column chunk c =
// lane % 16, row half lane / 16: rows [16 half, 16 half + 16)). Pass 1 takes the amax of the lane's
// 16 rows and one shuffle joins the halves; pass 2 reads again and converts. Each code store
// instruction writes 2 rows x 64 bytes (one row per instruction, 2 bytes per lane: 0.5 % slower).
template <bool kE4M3, bool kCopies>
__device__ __forceinline__ void rope_col(const RopeQuantizeParams& P, const float* rope, const Tile& t, int64_t HD,
                                         int lane) {
  constexpr int kStep = kRopePitch / 4;  // float4 per row
  const int c = lane & 15, r0 = 16 * (lane >> 4);
  const uint4* src = reinterpret_cast<const uint4*>(rope + 4 * c) + r0 * kStep;
  uint32_t m[4] = {0, 0, 0, 0};  // magnitude bits
#pragma unroll 8
  for (int i = 0; i < 16; ++i) {
    const uint4 v = src[i * kStep];
    m[0] = max(m[0], v.x & 0x7FFFFFFFu), m[1] = max(m[1], v.y & 0x7FFFFFFFu);
    m[2] = max(m[2], v.z & 0x7FFFFFFFu), m[3] = max(m[3], v.w & 0x7FFFFFFFu);
  }
  float mul[4], f[4];
  uint32_t scales = 0;  // byte j: the scale of column col + j
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t amax = max(m[j], __shfl_xor_sync(0xFFFFFFFFu, m[j], 16));
    const uint32_t e = block_scale_from_amax_bits(amax, rcp_max_bits<kE4M3>());
    scales |= e << (8 * j);
    mul[j] = e8m0_quant_multiplier(static_cast<uint8_t>(e));
    if constexpr (kCopies) {
      f[j] = e8m0_factor(e);
      if (r0 == 0) check_exact<kE4M3>(P.inexact + 1, e, amax);  // rows past the end are zero
    }
  }
  const int64_t col = static_cast<int64_t>(t.h) * kD + kNope + 4 * c;
  if constexpr (kCopies) {  // the transposed copy of the lane's 16 rows, 8 at a time
    uint4 half[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t a[8], b[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint4 v = src[(8 * h + i) * kStep];
        a[i] = ptx::cvt_fp8x2<kE4M3>(__uint_as_float(v.x) * mul[0], __uint_as_float(v.y) * mul[1]);
        b[i] = ptx::cvt_fp8x2<kE4M3>(__uint_as_float(v.z) * mul[2], __uint_as_float(v.w) * mul[3]);
      }
      col_copy8<kE4M3>(a, b, f, half[h]);
    }
    store_col_copy16(P, col, t.t0 + r0, half[0], half[1], lane);  // the pair (lane ^ 1): the same rows
    return;
  }
  uint8_t* dst = P.col_codes + static_cast<int64_t>(t.t0 + r0) * HD + col;
#pragma unroll 8
  for (int i = 0; i < 16; ++i) {
    const uint4 v = src[i * kStep];
    const uint32_t w = ptx::cvt_fp8x2<kE4M3>(__uint_as_float(v.x) * mul[0], __uint_as_float(v.y) * mul[1]) |
                       (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(__uint_as_float(v.z) * mul[2],
                                                                    __uint_as_float(v.w) * mul[3]))
                        << 16);
    if (r0 + i < t.nrows) *reinterpret_cast<unsigned int*>(dst) = w;
    dst += HD;
  }
  if (r0 == 0) col_scales4(P, t.t0, col, scales);
}

// The rowwise scales of a group: consecutive tiles of one token tile whose heads h0 .. h0 + n - 1
// lie in one aligned block of 8 heads; sink row r holds head h's 6 bytes at (h % 8) * 6.
struct RowGroup {
  int t0, nrows, h0, n;
};
__device__ __forceinline__ void flush_group(const RopeQuantizeParams& P, const uint8_t* sink, const RowGroup& g,
                                            int lane) {
  const int64_t nkb = P.rope.H * (kD / 32);
  const int c0 = (g.h0 & 7) * 6, bytes = g.n * 6;
  uint8_t* base = P.row_scales + static_cast<int64_t>(g.t0) * nkb + static_cast<int64_t>(g.h0) * 6;
  if (P.row_map.mode == MapMode::kCompact) {
    if (g.n == kGroup && nkb % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0) {
#pragma unroll
      for (int k = 0; k < 3; ++k) {  // (row, 16-byte chunk) i = lane + 32 k, 3 per row
        const int i = lane + 32 * k, r = i / 3, c = i - 3 * r;
        if (r < g.nrows)
          *reinterpret_cast<uint4*>(base + r * nkb + 16 * c) = *reinterpret_cast<const uint4*>(sink + 16 * i);
      }
    } else {
      for (int i = lane; i < g.nrows * bytes; i += 32) {
        const int r = i / bytes, c = i - r * bytes;
        base[r * nkb + c] = sink[r * kGPitch + c0 + c];
      }
    }
  } else {
    for (int i = lane; i < g.nrows * bytes; i += 32) {
      const int r = i / bytes, c = i - r * bytes;
      P.row_scales[cursor_offset(row_cursor(P.row_map, 0, static_cast<int64_t>(g.h0) * 6 + c), g.t0 + r)] =
          sink[r * kGPitch + c0 + c];
    }
  }
}

// The producer: tile (t0, h) into a stage with three TMA copies, one per column third.
__device__ __forceinline__ void issue(const CUtensorMap* tmap, int t0, int h, __nv_bfloat16* stage, uint64_t* bar) {
  ptx::mbar_arrive_expect_tx(bar, kTileBytes);  // whole boxes, zero-filled rows included
#pragma unroll
  for (int s = 0; s < 3; ++s) ptx::tma_load_3d(stage + s * kRows * kThird, tmap, bar, s * kThird, h, t0);
}

}  // namespace mla

template <typename TT, bool kE4M3, class Probe = NoProbe, bool kCopies = false>
__global__ void __launch_bounds__(mla::kThreads, 3)
    rope_quantize_mla_kernel(const __grid_constant__ CUtensorMap tmap, const RopeQuantizeParams P,
                                  const int64_t* cu, int64_t ncu, const __grid_constant__ TileQueue Q,
                                  int* queue) {
  using mla::kRopeFloats, mla::kStageElems, mla::kStages;
  static_assert(!kCopies || kE4M3, "the GEMM's copies are of E4M3 operands");
  if (P.run_if != nullptr && *P.run_if == 0u) return;  // a fallback launch whose flag is clear
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const RopeKernelParams& p = P.rope;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ntok = static_cast<int>(p.S * p.B), H = static_cast<int>(p.H);
  const int64_t HD = p.H * mla::kD;
  // TMA destinations 1024-byte aligned in the shared window (the 128-byte swizzle atom)
  __nv_bfloat16* raw = reinterpret_cast<__nv_bfloat16*>(smem_raw + ((1024 - ptx::smem_u32(smem_raw) % 1024) % 1024));
  float* rope0 = reinterpret_cast<float*>(raw + kStages * kStageElems);      // [2][32][kRopePitch]
  float4* tab = reinterpret_cast<float4*>(rope0 + 2 * kRopeFloats);          // [32 slots][32 lanes]
  uint8_t* sink0 = reinterpret_cast<uint8_t*>(tab + mla::kTabSlots * 32);    // [2][32][kGPitch]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sink0 + mla::kSinkBytes);     // [kStages]
  if (threadIdx.x == 0) Probe::cta_begin();
  const bool producer = threadIdx.x == 96;  // W3, lane 0
  if (producer) {
    ptx::prefetch_tmap(&tmap);
    for (int s = 0; s < kStages; ++s) ptx::mbar_init(&bars[s], 1);
    ptx::fence_barrier_init();
  }
  const SetChoice sc = sets_of(p.style, true);
  const bool col_on = kCopies ? P.col_copy != nullptr : P.col_codes != nullptr;
  // every block has a run (the launcher's grid <= the queue's runs, <= the tiles)
  const int G = gridDim.x, blk = blockIdx.x;
  const bool queued = Q.nseg > 0;  // else the block's range (cuda/tile_scheduler.h)
  // runq[n % 4]: the queue index of the block's run n (run 0 is run blk): run 1 is claimed at
  // the start, run n + 2 two tiles before the end of run n (by W2's lane 0, off the critical
  // path; its atomic returns while W2 works on the tile and it stores the index before the tile
  // barrier). The next run's index is then read at least two barriers later: at run n's end by
  // the table prefetch, and by the TMA producer's cursor, three tiles ahead, at run n + 1's
  // start at the earliest (runs of at least three tiles).
  __shared__ int runq[4];
  int claim_slot = -1, claim = 0;
  TileRun cur, ahead, nrun;  // tile k and tile k + kStages of this block; the next run's first tile
  int cur_n = 0, ahead_n = 0;  // the run numbers of cur and ahead
  if (queued) {
    queue_run(cur, Q, blk, H);
    if (threadIdx.x == 0) runq[1] = G + atomicAdd(queue, 1);
    __syncthreads();
  } else {
    range_first(cur, Q.ntiles, blk, G, H);
  }
  ahead = cur;
  auto next_run = [&](const TileRun& c, int n) {  // the run after c, the block's run n
    TileRun r = c;
    if (queued) queue_run(r, Q, runq[(n + 1) & 3], H);
    else range_at(r, c.tend, c.hi, H);
    return r;
  };
  auto step = [&](TileRun& c, int& n) {  // the block's next tile
    if (++c.t == c.tend) c = next_run(c, n++);
    else ++c.h;
  };
  // W1 / W3 lane r: the cos / sin row of token r of a run's token tile: the first run's now, the
  // next run's in registers (loaded a run ahead, stored into the slots between two runs)
  const bool tab_warp = warp & 1;
  const int tab_t = warp >> 1;  // 0: cos (W1), 1: sin (W3)
  float nxt[mla::kR];
  if (tab_warp && cur.lvl < 3) {
    mla::load_table_row<TT>(p, cu, ncu, ntok, cur.tt * kRows + lane, tab_t, nxt);
    mla::store_table_row(tab, tab_t, lane, nxt);
    nrun = next_run(cur, cur_n);
    if (nrun.lvl < 3) mla::load_table_row<TT>(p, cu, ncu, ntok, nrun.tt * kRows + lane, tab_t, nxt);
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (producer && ahead.lvl < 3) mla::issue(&tmap, ahead.tt * kRows, ahead.h, raw + s * kStageElems, &bars[s]);
    step(ahead, ahead_n);
  }
  Tile prev{0, 0, 0};
  bool have_prev = false;
  mla::RowGroup grp{0, 0, 0, 0};  // the group of the current tile, in sink buffer gpar
  int gpar = 0;
  int st = 0;
  uint32_t parity = 0;
  int k = 0;  // the loop's iteration: tile k of this block
  for (;; ++k) {
    if (lane == 0) Probe::stamp_value(k, 4 + warp, Probe::clock());
    const bool have = cur.lvl < 3;
    if (!have && !have_prev) break;
    const Tile t{cur.h, cur.tt * kRows, min(kRows, ntok - cur.tt * kRows)};
    const bool newgrp = have && !(have_prev && t.t0 == prev.t0 && t.h == prev.h + 1 && (t.h & 7) != 0);
    const bool flush = have_prev && (!have || newgrp);  // tile k - 1 closed its group
    const mla::RowGroup done = grp;
    const int done_par = gpar;
    if (newgrp) {
      if (have_prev) gpar ^= 1;
      grp = {t.t0, t.nrows, t.h, 0};
    }
    if (have) ++grp.n;
    if (have && warp < 3) {
      __nv_bfloat16* stage = raw + st * kStageElems;
      uint8_t* sink = sink0 + gpar * kRows * mla::kGPitch + (t.h & 7) * 6;
      const unsigned long long w0 = Probe::clock();
      ptx::mbar_wait(&bars[st], parity);  // tile k has landed
      if (lane == 0) Probe::stamp_value(k, 8 + warp, Probe::clock() - w0);
      if (warp == 0) {
        mla::rope_row<kE4M3, kCopies>(P, sc, stage, tab, rope0 + (k & 1) * kRopeFloats, sink, t, HD, lane);
      } else if (warp == 1) {
        mla::nope_row<kE4M3, kCopies>(P, stage, sink, t, HD, lane);
      } else if (col_on) {
        mla::nope_col<kE4M3, kCopies>(P, stage, t, HD, lane);
      }
    }
    if (have_prev && warp == 3) {  // tile k - 1
      if (col_on) mla::rope_col<kE4M3, kCopies>(P, rope0 + ((k - 1) & 1) * kRopeFloats, prev, HD, lane);
      if (!kCopies && P.row_codes != nullptr && flush)
        mla::flush_group(P, sink0 + done_par * kRows * mla::kGPitch, done, lane);
    }
    // Tile k's stage is read by W0-W2 and free; its rope tile and sink are complete for W3; W3
    // is done with tile k - 1's, which tile k + 1 reuses.
    if (lane == 0) Probe::stamp_value(k, warp, Probe::clock());
    if (claim_slot >= 0) runq[claim_slot] = G + claim, claim_slot = -1;
    __syncthreads();
    if (producer && ahead.lvl < 3) mla::issue(&tmap, ahead.tt * kRows, ahead.h, raw + st * kStageElems, &bars[st]);
    if (warp == 3 && lane == 0) Probe::stamp_value(k, 11, Probe::clock());
    step(ahead, ahead_n);
    const bool boundary = have && cur.t + 1 == cur.tend;
    prev = t, have_prev = have;
    step(cur, cur_n);
    if (queued && threadIdx.x == 64 && cur.lvl < 3 && cur.t + 2 == cur.tend)  // claim run cur_n + 2
      claim = atomicAdd(queue, 1), claim_slot = (cur_n + 2) & 3;
    if (boundary && cur.lvl < 3) {  // W0 is done with this run's tables: the next run's take the slots
      if (tab_warp) mla::store_table_row(tab, tab_t, lane, nxt);
      __syncthreads();
      if (tab_warp) {  // after the barrier, so that the loads overlap the next tile's work
        nrun = next_run(cur, cur_n);
        if (nrun.lvl < 3) mla::load_table_row<TT>(p, cu, ncu, ntok, nrun.tt * kRows + lane, tab_t, nxt);
      }
    }
    if (++st == kStages) st = 0, parity ^= 1;
  }
  if (threadIdx.x == 0) Probe::cta_end(k - 1);  // the loop's last iteration had no tile
}

// ---------------------------------------------------------------- fast path: launch (host)
// Tokens of the fast path sit at one stride: sbhd / thd token s * B + b, bshd b * S + s. The
// fast path also wants the heads and tokens laid out without overlap (what TMA's tensor map
// describes); anything else — overlapping views — takes the generic kernel.
inline bool uniform_token_stride(const RopeKernelParams& p, int64_t& stride) {
  const int64_t ss = p.in_st[0], bs = p.in_st[1];
  bool ok = false;
  if (p.sbhd) {
    if (p.B == 1 || ss == p.B * bs) stride = p.B == 1 ? ss : bs, ok = true;
  } else {
    if (p.S == 1 || bs == p.S * ss) stride = p.S == 1 ? bs : ss, ok = true;
  }
  const int64_t hs = p.H > 1 ? p.in_st[2] : p.D;
  return ok && hs >= p.D && (p.S * p.B == 1 || stride >= hs * p.H);
}

// Launches the fast path on `stream`; returns its grid size.
template <typename TT, bool kE4M3, class Probe = NoProbe, bool kCopies = false>
int64_t launch_mla(const RopeQuantizeParams& p, const int64_t* cu, int64_t ncu, int64_t tok_stride, cudaStream_t stream) {
  const int64_t tokens = p.rope.S * p.rope.B, tiles = ceil_div(tokens, kRows) * p.rope.H;
  if (tokens > 0x7FFFFFFF - kRows || tiles > 0x7FFFFFFF / 2)  // tile indices and the queue counter fit 32 bits
    throw Error("mxmla.rope_backward_quantize", "grad", "too many tokens or tiles for the 32-bit tile index");
  // dq as {D, H, tokens}; a tile is three boxes {64, 1, 32} (one 128-byte swizzle row per token)
  const cuuint64_t dims[3] = {cuuint64_t(mla::kD), cuuint64_t(p.rope.H), cuuint64_t(tokens)};
  // a dimension of extent 1 may carry any stride: give TMA a legal one
  const int64_t hs = p.rope.H > 1 ? p.rope.in_st[2] : mla::kD, ts = tokens > 1 ? tok_stride : hs * p.rope.H;
  const cuuint64_t strides[2] = {cuuint64_t(hs * 2), cuuint64_t(ts * 2)};
  const cuuint32_t box[3] = {cuuint32_t(mla::kThird), 1, cuuint32_t(kRows)};
  const CUtensorMap tmap = make_tma_desc(p.rope.in, DType::kBFloat16, 3, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
  const void* kernel = reinterpret_cast<const void*>(&rope_quantize_mla_kernel<TT, kE4M3, Probe, kCopies>);
  int64_t blocks = heuristics::persistent_grid(kernel_fit(kernel, mla::kThreads, mla::kSmemBytes, mla::kSmemBytes).resident(), tiles);
  const TileQueue Q = make_tile_queue(static_cast<int>(tiles), static_cast<int>(blocks), static_cast<int>(p.rope.H),
                                      mla::kRun0);
  if (Q.nseg > 0) blocks = heuristics::queue_grid(blocks, tiles, queue_runs(Q));  // every block's first run is run blockIdx.x
  // the queue's counter, zero at launch (stream-ordered: concurrent launches and graphs each get their own)
  StreamScratch counter(Q.nseg > 0 ? static_cast<int64_t>(sizeof(int)) : 0, stream);
  if (Q.nseg > 0) MXMLA_CUDA_CHECK(cudaMemsetAsync(counter.ptr, 0, sizeof(int), stream));
  rope_quantize_mla_kernel<TT, kE4M3, Probe, kCopies><<<static_cast<unsigned>(blocks), mla::kThreads, mla::kSmemBytes, stream>>>(
      tmap, p, cu, ncu, Q, reinterpret_cast<int*>(counter.ptr));
  MXMLA_CUDA_CHECK(cudaGetLastError());
  return blocks;
}

}  // namespace mxmla::detail::ropeq
