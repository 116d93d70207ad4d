// mxmla — MXFP8 dequantization and scale re-layout kernels (compact <-> swizzled, compact -> BHSD).
// Both are memory-bound elementwise passes; the layouts come from common/mxfp8_common.h. Arch-neutral
// (the FP8 -> f16 conversion needs sm_89+): built for every architecture in MXMLA_CUDA_ARCHS.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "common/ops.h"
#include "cuda/cuda_check.h"
#include "cuda/ptx/convert.cuh"
#include "cuda/heuristics.h"

namespace mxmla::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kDequantVec = 8;  // codes per thread (one 8-byte load); cols % 32 == 0

// 2^(e-127) in fp32 (e = 0 -> 2^-127, a subnormal; e = 255 -> NaN).
__device__ __forceinline__ float e8m0_to_float(uint8_t e) {
  if (e == 255) return __uint_as_float(0x7FFFFFFFu);
  if (e == 0) return __uint_as_float(0x00400000u);
  return __uint_as_float(static_cast<uint32_t>(e) << 23);
}

// codes [batch, rows, cols] -> out (fp32 or bf16, same shape); one thread = 8 consecutive codes of a row.
template <typename OutT, bool kE4M3>
__global__ void __launch_bounds__(kThreads) mxfp8_dequantize_kernel(const DequantizeProblem p) {
  const ScaleMap& m = p.map;
  const int64_t groups_per_row = m.cols / kDequantVec;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= m.batch * m.rows * groups_per_row) return;
  const int64_t c0 = (g % groups_per_row) * kDequantVec;
  const int64_t row = g / groups_per_row;  // bi * rows + r
  const int64_t bi = row / m.rows, r = row % m.rows;
  const int64_t idx0 = row * m.cols + c0;
  const uint2 codes = *reinterpret_cast<const uint2*>(p.codes + idx0);
  const uint32_t cw[2] = {codes.x, codes.y};
  float out[kDequantVec];
  const float row_scale = p.rowwise ? e8m0_to_float(p.scales[row_scale_offset(m, bi, r, c0 / 32)]) : 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t pair = static_cast<uint16_t>(cw[k / 2] >> (16 * (k % 2)));
    const uint32_t h2 = ptx::cvt_f16x2_from_fp8x2<kE4M3>(pair);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    out[2 * k] = f.x;
    out[2 * k + 1] = f.y;
  }
#pragma unroll
  for (int j = 0; j < kDequantVec; ++j) {
    out[j] *= p.rowwise ? row_scale : e8m0_to_float(p.scales[col_scale_offset(m, bi, r / 32, c0 + j)]);
    if (isnan(out[j])) out[j] = __uint_as_float(0x7FC00000u);  // one NaN pattern (fp32 0x7FC00000, bf16 0x7FC0)
  }
  if constexpr (sizeof(OutT) == 4) {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p.out) + idx0);
    dst[0] = make_float4(out[0], out[1], out[2], out[3]);
    dst[1] = make_float4(out[4], out[5], out[6], out[7]);
  } else {
    uint32_t packed[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // NaN was canonicalised above; the conversion keeps 0x7FC00000 -> 0x7FC0 only when done by hand
      const uint32_t lo = isnan(out[2 * k]) ? 0x7FC0u : __bfloat16_as_ushort(__float2bfloat16_rn(out[2 * k]));
      const uint32_t hi = isnan(out[2 * k + 1]) ? 0x7FC0u : __bfloat16_as_ushort(__float2bfloat16_rn(out[2 * k + 1]));
      packed[k] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + idx0) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// Remap jobs of one launch. A compact destination is written 4 bytes per thread; a swizzled or
// BHSD destination one 512-byte (128 x 4) tile per warp, 16 bytes per lane: lane l owns rows
// i = l, l + 32, l + 64, l + 96 of the tile (SPEC §2.1: byte (i % 32) * 16 + (i % 128) / 32 * 4 + j % 4).
constexpr int kMaxRemapJobs = 8;
struct RemapBatch {
  RemapProblem job[kMaxRemapJobs];
  int64_t first[kMaxRemapJobs + 1];  // prefix sums of threads per job
  int count;
};

__host__ __device__ inline bool swizzled_dst(const RemapProblem& p) { return p.dst_map.mode != MapMode::kCompact; }

// Block coordinates of scale column j of row i in (b, h) matrix `mat` of a swizzled / BHSD
// layout, and how many of the columns j..j+3 are real blocks (0..4; the rest is padding).
// Index arithmetic in I (uint32_t when everything fits).
template <typename I>
__device__ __forceinline__ int swizzled_coords(const ScaleMap& m, bool rowwise, I mat, I i, I j, I& bi, I& a, I& b) {
  const I rows = static_cast<I>(m.rows), cols = static_cast<I>(m.cols), nrb = (rows + 31) / 32;
  I jlim;
  if (m.mode == MapMode::kSwizzled) {  // plain tensors: batch == 1
    if (rowwise) {
      if (i >= rows) return 0;
      bi = 0, a = i, b = j, jlim = cols / 32;
    } else {
      if (i >= cols) return 0;
      bi = 0, a = j, b = i, jlim = nrb;
    }
  } else {
    const I D = static_cast<I>(m.D), mats = cols / D, mm = mat % mats;
    bi = mat / mats;
    if (rowwise) {
      if (i >= rows) return 0;
      a = i, b = mm * (D / 32) + j, jlim = D / 32;
    } else {
      if (i >= D) return 0;
      a = j, b = mm * D + i, jlim = nrb;
    }
  }
  if (j >= jlim) return 0;
  return static_cast<int>(jlim - j < 4 ? jlim - j : 4);
}

template <typename I>
__global__ void __launch_bounds__(kThreads) remap_scales_kernel(const __grid_constant__ RemapBatch batch) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= batch.first[batch.count]) return;
  int k = 0;
  while (t >= batch.first[k + 1]) ++k;
  const RemapProblem& p = batch.job[k];
  const int64_t tl = t - batch.first[k];
  if (swizzled_dst(p)) {
    const int lane = static_cast<int>(tl % 32);
    const I tile = static_cast<I>(tl / 32);
    I mat = 0, tm = tile;
    if (p.dst_map.mode == MapMode::kBHSD) {
      const I per_mat = static_cast<I>(p.dst_map.mat_size / 512);
      mat = tile / per_mat, tm = tile % per_mat;
    }
    const I tx = static_cast<I>(p.dst_map.tiles_x), i0 = (tm / tx) * 128 + lane, j = (tm % tx) * 4;
    uint32_t w[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      I bi, a, b;
      const int n = swizzled_coords<I>(p.dst_map, p.rowwise, mat, i0 + 32 * m, j, bi, a, b);
      w[m] = 0;
      for (int q = 0; q < n; ++q)  // rowwise steps the block column, columnwise the row block
        w[m] |= static_cast<uint32_t>(p.src[scale_offset(p.src_map, p.rowwise, bi, p.rowwise ? a : a + q,
                                                         p.rowwise ? b + q : b)])
                << (8 * q);
    }
    uint8_t* d = p.dst + static_cast<int64_t>(tile) * 512 + lane * 16;
    if ((reinterpret_cast<uintptr_t>(d) % 16) == 0) {
      *reinterpret_cast<uint4*>(d) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      for (int q = 0; q < 16; ++q) d[q] = static_cast<uint8_t>(w[q / 4] >> (8 * (q % 4)));
    }
    return;
  }
  const int64_t off0 = tl * 4, bytes = map_bytes(p.dst_map, p.rowwise);
  uint32_t word = 0;
  for (int q = 0; q < 4 && off0 + q < bytes; ++q) {
    int64_t bi, a, b;
    offset_coords(p.dst_map, p.rowwise, off0 + q, bi, a, b);
    word |= static_cast<uint32_t>(p.src[scale_offset(p.src_map, p.rowwise, bi, a, b)]) << (8 * q);
  }
  if (off0 + 4 <= bytes && (reinterpret_cast<uintptr_t>(p.dst + off0) % 4) == 0) {
    *reinterpret_cast<uint32_t*>(p.dst + off0) = word;
  } else {
    for (int q = 0; q < 4 && off0 + q < bytes; ++q) p.dst[off0 + q] = static_cast<uint8_t>(word >> (8 * q));
  }
}

// ---------------------------------------------------------------- compact attention scales -> BHSD
// The common case of the remap: compact attention scales (SPEC §2.2 phase one) to BHSD swizzled
// tiles, through shared memory. One block = one item: it stages a [R x seg] byte region of the
// compact source with wide coalesced loads (zero rows past the source), then writes whole 512-byte
// swizzle tiles of G (b, h) matrices, one tile per warp at a time, 16 bytes per lane.
//   rowwise:    source [batch][rows][mats * nd] (nd = D / 32); item (bi, 128-row tile ri, mat group)
//               stage [R = 128][G * nd]; tile (m, sub) of matrix (bi, m): index ri * txs + sub,
//               row i = bytes stage[i][m * nd + 4 sub + q], q < min(4, nd - 4 sub)
//   columnwise: source [batch][nrb][mats * D]; item (bi, 4-row-block column ri, mat group)
//               stage [R = 4][G * D]; tile (m, sub): index sub * ntx + ri,
//               row i, byte q = stage[q][m * D + 128 sub + i] while 128 sub + i < D
// Everything else (zero padding, tail rows / row blocks) is zero in the staged rows or masked.
constexpr int kBhsdThreads = 256;
constexpr int kBhsdStageBudget = 8192;        // bytes of staged source per item (several blocks per SM)
constexpr int kBhsdMaxSmem = 48 * 1024;       // larger stages (huge D) take the generic kernel
struct BhsdJob {
  const uint8_t* src;
  uint8_t* dst;
  int64_t src_row_bytes;   // ncb (rowwise) or cols (columnwise)
  int64_t src_rows;        // rows (rowwise) or nrb (columnwise) of one batch entry
  int64_t mat_size;        // bytes of one (b, h) matrix of dst
  int32_t rowwise, unit;   // unit: bytes of one matrix in a source row (nd or D)
  int32_t mats, group;     // (b, h) matrices per batch entry; matrices per item
  int32_t subs;            // tiles per matrix per item: txs (rowwise) or ceil(D / 128)
  int32_t ri_count, groups;  // items along the source rows (128-row tiles / 4-block columns), mat groups
  int32_t tile_ri, tile_sub;  // tile index in its matrix = ri * tile_ri + sub * tile_sub
  int32_t vec;             // bytes per global load: 16, 4 or 1
  int32_t pitch;           // staged row pitch in bytes (a multiple of 4, an odd number of words)
  int32_t dst16;           // dst 16-byte aligned
};
struct BhsdBatch {
  BhsdJob job[kMaxRemapJobs];
  int64_t first[kMaxRemapJobs + 1];  // prefix sums of items (blocks)
  int count;
};

__global__ void __launch_bounds__(kBhsdThreads) scales_to_bhsd_kernel(const __grid_constant__ BhsdBatch batch) {
  extern __shared__ __align__(16) uint8_t stage[];
  int k = 0;
  while (blockIdx.x >= batch.first[k + 1]) ++k;
  const BhsdJob& p = batch.job[k];
  int64_t item = blockIdx.x - batch.first[k];
  const int mg = static_cast<int>(item % p.groups);
  item /= p.groups;
  const int ri = static_cast<int>(item % p.ri_count);
  const int64_t bi = item / p.ri_count;
  const int R = p.rowwise ? 128 : 4;
  const int m0 = mg * p.group, gm = min(p.group, p.mats - m0);  // matrices of this item
  const int seg = gm * p.unit;                                  // staged bytes per row
  const int64_t row0 = static_cast<int64_t>(ri) * R;
  const int nrows = static_cast<int>(p.src_rows - row0 < R ? p.src_rows - row0 : R);
  const uint8_t* src = p.src + (bi * p.src_rows + row0) * p.src_row_bytes + static_cast<int64_t>(m0) * p.unit;

  // 1. stage: rows < nrows from the source (vec-byte loads, 4-byte shared stores), the rest zero
  const int upr = seg / p.vec, units = R * upr;
  if (p.vec == 16) {  // kU loads in flight per thread before their stores
    constexpr int kU = 4;
    for (int u0 = threadIdx.x; u0 < units; u0 += kU * kBhsdThreads) {
      uint4 v[kU];
#pragma unroll
      for (int e = 0; e < kU; ++e) {
        const int u = u0 + e * kBhsdThreads, r = u / upr, c = (u - r * upr) * 16;
        v[e] = make_uint4(0, 0, 0, 0);
        if (u < units && r < nrows) v[e] = __ldg(reinterpret_cast<const uint4*>(src + r * p.src_row_bytes + c));
      }
#pragma unroll
      for (int e = 0; e < kU; ++e) {
        const int u = u0 + e * kBhsdThreads, r = u / upr, c = (u - r * upr) * 16;
        if (u < units) {
          uint32_t* d = reinterpret_cast<uint32_t*>(stage + r * p.pitch + c);
          d[0] = v[e].x, d[1] = v[e].y, d[2] = v[e].z, d[3] = v[e].w;
        }
      }
    }
  } else if (p.vec == 4) {
    for (int u = threadIdx.x; u < units; u += kBhsdThreads) {
      const int r = u / upr, c = (u - r * upr) * 4;
      const uint32_t v = r < nrows ? __ldg(reinterpret_cast<const uint32_t*>(src + r * p.src_row_bytes + c)) : 0u;
      *reinterpret_cast<uint32_t*>(stage + r * p.pitch + c) = v;
    }
  } else {
    for (int u = threadIdx.x; u < units; u += kBhsdThreads) {
      const int r = u / upr, c = u - r * upr;
      stage[r * p.pitch + c] = r < nrows ? __ldg(src + r * p.src_row_bytes + c) : uint8_t{0};
    }
  }
  __syncthreads();

  // 2. tiles: warp w takes tiles w, w + 8, ... of the item's gm * subs; lane l owns rows l + 32 j
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = warp; t < gm * p.subs; t += kBhsdThreads / 32) {
    const int m = t / p.subs, sub = t - m * p.subs;
    uint32_t w[4];
    if (p.rowwise) {
      const int c0 = m * p.unit + 4 * sub, n = min(4, p.unit - 4 * sub);  // block columns of this tile
      const uint32_t mask = n == 4 ? 0xFFFFFFFFu : (1u << (8 * n)) - 1u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // the n bytes at c0 from one or two aligned words (a funnel shift)
        const uint32_t* row = reinterpret_cast<const uint32_t*>(stage + (lane + 32 * j) * p.pitch);
        const uint32_t lo = row[c0 / 4], hi = (c0 % 4 + n > 4) ? row[c0 / 4 + 1] : 0u;  // never past the segment
        w[j] = __funnelshift_r(lo, hi, 8 * (c0 % 4)) & mask;
      }
    } else {
      const int d0 = 128 * sub, c0 = m * p.unit + d0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = lane + 32 * j;
        uint32_t v = 0;
        if (d0 + i < p.unit)
#pragma unroll
          for (int q = 0; q < 4; ++q) v |= static_cast<uint32_t>(stage[q * p.pitch + c0 + i]) << (8 * q);
        w[j] = v;
      }
    }
    const int64_t tile = static_cast<int64_t>(ri) * p.tile_ri + static_cast<int64_t>(sub) * p.tile_sub;
    uint8_t* d = p.dst + (bi * p.mats + m0 + m) * p.mat_size + tile * 512 + lane * 16;
    if (p.dst16) {
      *reinterpret_cast<uint4*>(d) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      for (int q = 0; q < 16; ++q) d[q] = static_cast<uint8_t>(w[q / 4] >> (8 * (q % 4)));
    }
  }
}

// The job of scales_to_bhsd_kernel for a compact -> BHSD remap, or false when it does not
// apply (other layouts, a stage over kBhsdMaxSmem, extents past 32 bits).
bool make_bhsd_job(const RemapProblem& p, BhsdJob& j, int& smem) {
  const ScaleMap& s = p.src_map;
  const ScaleMap& d = p.dst_map;
  if (s.mode != MapMode::kCompact || d.mode != MapMode::kBHSD) return false;
  const int64_t nrb = ceil_div(d.rows, 32), mats = d.cols / d.D;
  j = BhsdJob{};
  j.src = p.src, j.dst = p.dst, j.rowwise = p.rowwise;
  j.mat_size = d.mat_size;
  const int64_t unit = p.rowwise ? d.D / 32 : d.D;
  const int R = p.rowwise ? 128 : 4;
  j.src_row_bytes = p.rowwise ? d.cols / 32 : d.cols;
  j.src_rows = p.rowwise ? d.rows : nrb;
  const int64_t ri_count = ceil_div(j.src_rows, R);
  if (unit > (1 << 20) || mats > (1 << 30) || ri_count > (1 << 30) || ri_count == 0 || mats == 0) return false;
  j.unit = static_cast<int32_t>(unit), j.mats = static_cast<int32_t>(mats), j.ri_count = static_cast<int32_t>(ri_count);
  // matrices per item: within the stage budget, a multiple of what makes a row segment 16-byte long
  int64_t g = std::max<int64_t>(1, kBhsdStageBudget / (R * unit));
  const int64_t g16 = 16 / std::gcd<int64_t>(unit, 16);
  if (g >= g16) g = g / g16 * g16;
  g = std::min(g, mats);
  j.group = static_cast<int32_t>(g), j.groups = static_cast<int32_t>(ceil_div(mats, g));
  const auto aligned = [&](int v) {
    return reinterpret_cast<uintptr_t>(p.src) % v == 0 && j.src_row_bytes % v == 0 && (g * unit) % v == 0;
  };
  j.vec = aligned(16) ? 16 : aligned(4) ? 4 : 1;
  const int64_t words = ceil_div(g * unit, 4);
  j.pitch = static_cast<int32_t>((words | 1) * 4);
  smem = R * j.pitch;
  if (smem > kBhsdMaxSmem) return false;
  if (p.rowwise) {
    j.subs = static_cast<int32_t>(d.tiles_x), j.tile_ri = j.subs, j.tile_sub = 1;
  } else {
    j.subs = static_cast<int32_t>(ceil_div(d.D, 128)), j.tile_ri = 1, j.tile_sub = static_cast<int32_t>(d.tiles_x);
  }
  j.dst16 = reinterpret_cast<uintptr_t>(p.dst) % 16 == 0;
  return true;
}

unsigned grid_for(int64_t threads, const char* op) {
  const int64_t blocks = heuristics::elementwise_grid(threads, kThreads);
  if (blocks > 0x7FFFFFFF) throw Error(op, "input", "too many elements for one launch");
  return static_cast<unsigned>(blocks);
}

}  // namespace

void dequantize_cuda(const DequantizeProblem& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  const int64_t threads = p.map.batch * p.map.rows * (p.map.cols / kDequantVec);
  if (threads == 0) return;
  const unsigned grid = grid_for(threads, "mxmla.dequantize");
  const bool e4m3 = p.fmt == Fp8Format::kE4M3;
  if (p.out_dtype == DType::kFloat32) {
    if (e4m3) mxfp8_dequantize_kernel<float, true><<<grid, kThreads, 0, stream>>>(p);
    else mxfp8_dequantize_kernel<float, false><<<grid, kThreads, 0, stream>>>(p);
  } else {
    if (e4m3) mxfp8_dequantize_kernel<__nv_bfloat16, true><<<grid, kThreads, 0, stream>>>(p);
    else mxfp8_dequantize_kernel<__nv_bfloat16, false><<<grid, kThreads, 0, stream>>>(p);
  }
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

void remap_scales_cuda(const std::vector<RemapProblem>& all, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  // compact -> BHSD jobs through the staged kernel, up to kMaxRemapJobs per launch; the rest below
  std::vector<RemapProblem> jobs;
  BhsdBatch bb{};
  int smem = 0;
  const auto flush_bhsd = [&] {
    if (bb.count > 0 && bb.first[bb.count] > 0) {
      if (bb.first[bb.count] > 0x7FFFFFFF) throw Error("mxmla.remap_scales", "input", "too many scale tiles for one launch");
      scales_to_bhsd_kernel<<<static_cast<unsigned>(bb.first[bb.count]), kBhsdThreads, smem, stream>>>(bb);
      MXMLA_CUDA_CHECK(cudaGetLastError());
    }
    bb = BhsdBatch{}, smem = 0;
  };
  for (const RemapProblem& p : all) {
    BhsdJob j;
    int sm = 0;
    if (!make_bhsd_job(p, j, sm)) {
      jobs.push_back(p);
      continue;
    }
    bb.job[bb.count] = j;
    bb.first[bb.count + 1] = bb.first[bb.count] + int64_t{j.ri_count} * j.groups * p.dst_map.batch;
    smem = std::max(smem, sm);
    if (++bb.count == kMaxRemapJobs) flush_bhsd();
  }
  flush_bhsd();
  for (size_t j0 = 0; j0 < jobs.size(); j0 += kMaxRemapJobs) {
    RemapBatch batch{};
    batch.count = static_cast<int>(std::min<size_t>(kMaxRemapJobs, jobs.size() - j0));
    for (int k = 0; k < batch.count; ++k) {
      batch.job[k] = jobs[j0 + k];
      const int64_t bytes = map_bytes(batch.job[k].dst_map, batch.job[k].rowwise);  // whole tiles when swizzled
      batch.first[k + 1] = batch.first[k] + (swizzled_dst(batch.job[k]) ? bytes / 512 * 32 : ceil_div(bytes, 4));
    }
    if (batch.first[batch.count] == 0) continue;
    bool fits32 = true;  // 32-bit index arithmetic when every buffer and extent fits
    for (int k = 0; k < batch.count; ++k) {
      const ScaleMap& m = batch.job[k].dst_map;
      fits32 = fits32 && map_bytes(m, batch.job[k].rowwise) < (int64_t{1} << 31) && m.cols < (int64_t{1} << 31) &&
               m.rows < (int64_t{1} << 31);
    }
    const unsigned grid = grid_for(batch.first[batch.count], "mxmla.remap_scales");
    if (fits32)
      remap_scales_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(batch);
    else
      remap_scales_kernel<int64_t><<<grid, kThreads, 0, stream>>>(batch);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace mxmla::detail
