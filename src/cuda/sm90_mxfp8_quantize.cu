// mxmla — MXFP8 quantization kernel for SM90 (rowwise, columnwise, or both in one pass).
//
// Work decomposition (memory-bound; one pass over the input):
//   the input is viewed as [batch, rows, cols]; one warp owns a tile of 32 rows x (32*VEC) cols,
//   VEC = 16 bytes / sizeof(input) (8 for bf16/fp16, 4 for fp32). Lane l holds columns
//   [l*VEC, l*VEC + VEC) of all 32 rows in registers (32 16-byte loads in flight per thread).
//   * columnwise: each lane already holds its columns' 32 rows: amax with no communication;
//   * rowwise: a 32-wide block spans LPB = 32/VEC adjacent lanes: amax by xor-shuffles.
//   amax is an integer max of the magnitude bits (2 lanes per instruction for 16-bit inputs),
//   which also detects NaN (bits > Inf) and Inf (bits == Inf) for the SPEC §2 policy.
// Scales go through a ScaleMap (compact, swizzled or BHSD) so that the swizzle and the
// attention layout are written directly by this kernel; padding is zeroed by the launcher.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/ops.h"
#include "cuda/cuda_check.h"
#include "cuda/ptx.cuh"

namespace mxmla::detail {
namespace {

// Tile configuration (per warp: kStages x 32 rows x 512 bytes of shared memory).
constexpr int kWarpsPerBlock = 1;
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kTileRows = 32;  // = MXFP8 block size along the columnwise axis
#ifndef MXMLA_QUANT_STAGES
#define MXMLA_QUANT_STAGES 2
#endif
constexpr int kStages = MXMLA_QUANT_STAGES;  // tiles in flight per warp (tile i+1 loads while i computes)
#ifndef MXMLA_QUANT_LANE_BYTES
#define MXMLA_QUANT_LANE_BYTES 8
#endif
constexpr int kLaneBytes = MXMLA_QUANT_LANE_BYTES;  // bytes of one row a lane owns (8: 4 bf16 / 2 fp32)

template <typename T>
struct InputTraits;
template <>
struct InputTraits<__nv_bfloat16> {
  static constexpr uint32_t kMagMask = 0x7FFF7FFFu;  // two elements per word
  static constexpr int kPerWord = 2;
  // fp32 bits of a bf16 magnitude
  __device__ static uint32_t mag_to_f32_bits(uint32_t m) { return m << 16; }
  __device__ static float2 to_float2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  }
};
template <>
struct InputTraits<__half> {
  static constexpr uint32_t kMagMask = 0x7FFF7FFFu;
  static constexpr int kPerWord = 2;
  __device__ static uint32_t mag_to_f32_bits(uint32_t m) {
    if (m > 0x7C00u) return 0x7FC00000u;  // NaN
    if (m == 0x7C00u) return 0x7F800000u;
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(m))));
  }
  __device__ static float2 to_float2(uint32_t w) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    return __half22float2(h);
  }
};
template <>
struct InputTraits<float> {
  static constexpr uint32_t kMagMask = 0x7FFFFFFFu;
  static constexpr int kPerWord = 1;
  __device__ static uint32_t mag_to_f32_bits(uint32_t m) { return m; }
};

// Max of the magnitudes of one word's elements (packed per 16-bit half for 16-bit types).
template <typename T>
__device__ __forceinline__ uint32_t word_mag(uint32_t w) {
  return w & InputTraits<T>::kMagMask;
}
template <typename T>
__device__ __forceinline__ uint32_t mag_max(uint32_t a, uint32_t b) {
  if constexpr (InputTraits<T>::kPerWord == 2)
    return __vmaxu2(a, b);
  else
    return max(a, b);
}
// Collapse a packed magnitude word to the max of its elements.
template <typename T>
__device__ __forceinline__ uint32_t mag_collapse(uint32_t m) {
  if constexpr (InputTraits<T>::kPerWord == 2)
    return max(m & 0xFFFFu, m >> 16);
  else
    return m;
}
// Element j (0..kPerWord-1) of a packed magnitude word.
template <typename T>
__device__ __forceinline__ uint32_t mag_elem(uint32_t m, int j) {
  if constexpr (InputTraits<T>::kPerWord == 2)
    return j ? (m >> 16) : (m & 0xFFFFu);
  else
    return m;
}

// The lane's slot of one row: kWords 32-bit words (kLaneBytes = 4 * kWords bytes).
template <int kWords>
struct Slot {
  uint32_t w[kWords];
};

// Slot elements -> codes (as bytes of a 4- or 8-byte word), element j multiplied by mult[j].
template <typename T, bool kE4M3, int kWords>
__device__ __forceinline__ uint64_t convert_slot(const Slot<kWords>& v, const float* mult) {
  uint64_t out = 0;
  if constexpr (InputTraits<T>::kPerWord == 2) {
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      const float2 a = InputTraits<T>::to_float2(v.w[k]);
      out |= static_cast<uint64_t>(ptx::cvt_fp8x2<kE4M3>(a.x * mult[2 * k], a.y * mult[2 * k + 1])) << (16 * k);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kWords; k += 2)
      out |= static_cast<uint64_t>(ptx::cvt_fp8x2<kE4M3>(__uint_as_float(v.w[k]) * mult[k],
                                                        __uint_as_float(v.w[k + 1]) * mult[k + 1]))
             << (8 * k);
  }
  return out;
}

// Store VEC code (or scale) bytes held in the low bytes of `v` (streaming: never re-read here).
template <int VEC>
__device__ __forceinline__ void store_bytes(uint8_t* dst, uint64_t v) {
  if constexpr (VEC == 8)
    __stcs(reinterpret_cast<unsigned long long*>(dst), static_cast<unsigned long long>(v));
  else if constexpr (VEC == 4)
    __stcs(reinterpret_cast<unsigned int*>(dst), static_cast<unsigned int>(v));
  else
    __stcs(reinterpret_cast<unsigned short*>(dst), static_cast<unsigned short>(v));
}

// One warp tile: 32 rows x (32 * VEC) columns of batch bi, in lane-private shared-memory slots:
// slot [r][lane] holds the lane's VEC elements of row r.
struct TileCoord {
  int64_t bi, tr, col0;
  int nrows;
  bool active;
};

template <int VEC>
__device__ __forceinline__ TileCoord tile_coord(const QuantizeProblem& p, int64_t t, int lane) {
  constexpr int kTileCols = 32 * VEC;
  const int64_t ntc = ceil_div(p.cols, kTileCols);
  const int64_t ntr = ceil_div(p.rows, kTileRows);
  TileCoord c;
  const int64_t tc = t % ntc;
  c.tr = (t / ntc) % ntr;
  c.bi = t / (ntc * ntr);
  c.col0 = tc * kTileCols + lane * VEC;
  c.active = c.col0 < p.cols;  // cols % 32 == 0: whole rowwise blocks are active or not
  const int64_t left = p.rows - c.tr * kTileRows;
  c.nrows = static_cast<int>(left < kTileRows ? left : kTileRows);
  return c;
}

// Issue the tile's 32 row loads into `stage` (missing rows / columns are zero-filled).
template <typename T, int kWords>
__device__ __forceinline__ void issue_tile(const QuantizeProblem& p, const TileCoord& c, Slot<kWords>* stage,
                                           int lane) {
  const T* src = static_cast<const T*>(p.in) + c.bi * p.batch_stride + c.tr * kTileRows * p.row_stride + c.col0;
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
    const bool ok = c.active && r < c.nrows;
    ptx::cp_async<4 * kWords>(stage + r * 32 + lane, ok ? static_cast<const void*>(src + r * p.row_stride) : p.in,
                              ok ? 4 * kWords : 0);
  }
}

template <typename T, bool kE4M3, int kWords>
__device__ __forceinline__ void compute_tile(const QuantizeProblem& p, const TileCoord& c,
                                             const Slot<kWords>* stage, int lane) {
  constexpr int kPW = InputTraits<T>::kPerWord;
  constexpr int VEC = kWords * kPW;  // elements per lane and row
  constexpr int LPB = 32 / VEC;      // lanes per rowwise block
  constexpr uint32_t kRcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const bool do_row = p.row_codes != nullptr, do_col = p.col_codes != nullptr;
  const int64_t row0 = c.tr * kTileRows;
  const int64_t out0 = (c.bi * p.rows + row0) * p.cols + c.col0;  // codes offset of (row0, col0)
  const ScaleCursor rcur = row_cursor(p.row_map, c.bi, c.col0 / 32);
  uint32_t cm[kWords] = {};

  // ---- pass 1: rowwise blocks (amax across LPB lanes) and the columnwise amax ----------------
#pragma unroll 8
  for (int r = 0; r < kTileRows; ++r) {
    const Slot<kWords> v = stage[r * 32 + lane];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      const uint32_t mk = word_mag<T>(v.w[k]);
      cm[k] = mag_max<T>(cm[k], mk);
      m = mag_max<T>(m, mk);
    }
    if (do_row) {
      m = mag_collapse<T>(m);
#pragma unroll
      for (int o = 1; o < LPB; o <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
      if (c.active && r < c.nrows) {
        const uint8_t e = block_scale_from_amax_bits(InputTraits<T>::mag_to_f32_bits(m), kRcp);
        const float mul = e8m0_quant_multiplier(e);
        float mult[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) mult[j] = mul;
        store_bytes<VEC>(p.row_codes + out0 + r * p.cols, convert_slot<T, kE4M3>(v, mult));
        if (lane % LPB == 0) p.row_scales[cursor_offset(rcur, row0 + r)] = e;
      }
    }
  }
  if (!do_col || !c.active) return;

  // ---- pass 2: columnwise scales and codes ---------------------------------------------------
  float mult[VEC];
  uint64_t scales = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const uint8_t e = block_scale_from_amax_bits(InputTraits<T>::mag_to_f32_bits(mag_elem<T>(cm[j / kPW], j % kPW)), kRcp);
    scales |= static_cast<uint64_t>(e) << (8 * j);
    mult[j] = e8m0_quant_multiplier(e);
  }
  const ScaleCursor ccur = col_cursor(p.col_map, c.bi, c.tr, c.col0);
  uint8_t* sdst = p.col_scales + cursor_offset(ccur, 0);
  if (ccur.compact && (reinterpret_cast<uintptr_t>(sdst) % VEC) == 0) {
    store_bytes<VEC>(sdst, scales);  // VEC contiguous scale bytes
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.col_scales[cursor_offset(ccur, j)] = static_cast<uint8_t>(scales >> (8 * j));
  }
#pragma unroll 8
  for (int r = 0; r < kTileRows; ++r) {
    if (r >= c.nrows) break;
    store_bytes<VEC>(p.col_codes + out0 + r * p.cols, convert_slot<T, kE4M3>(stage[r * 32 + lane], mult));
  }
}

// Persistent warps: warp w handles tiles w, w + W, w + 2W, ... (W = all warps of the grid),
// loading tile i+1 (cp.async into the next stage) while it computes tile i.
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads) sm90_mxfp8_quantize_kernel(const QuantizeProblem p, int64_t num_tiles) {
  constexpr int kWords = kLaneBytes / 4;
  constexpr int VEC = kLaneBytes / sizeof(T);
  static_assert(32 % VEC == 0 && kWords * 4 == kLaneBytes, "a lane's slot holds whole words");
  extern __shared__ __align__(16) unsigned char smem_raw[];  // [warps][kStages][32 rows][32 lanes] slots
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Slot<kWords>* ring = reinterpret_cast<Slot<kWords>*>(smem_raw) + warp * kStages * kTileRows * 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= num_tiles) return;
  TileCoord cur = tile_coord<VEC>(p, t, lane);
  issue_tile<T>(p, cur, ring, lane);
  ptx::cp_async_commit();
  for (int it = 0; t < num_tiles; ++it, t += stride) {
    const int64_t tn = t + stride;
    TileCoord next{};
    if (tn < num_tiles) {
      next = tile_coord<VEC>(p, tn, lane);
      issue_tile<T>(p, next, ring + ((it + 1) % kStages) * kTileRows * 32, lane);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();  // this tile's group has landed (each lane reads only its own slots)
    compute_tile<T, kE4M3, kWords>(p, cur, ring + (it % kStages) * kTileRows * 32, lane);
    cur = next;
  }
}

constexpr int kSmemBytes = kWarpsPerBlock * kStages * kTileRows * 32 * kLaneBytes;

template <typename T, bool kE4M3>
void launch(const QuantizeProblem& p, cudaStream_t stream) {
  constexpr int kTileCols = 32 * (kLaneBytes / sizeof(T));
  const int64_t tiles = p.batch * ceil_div(p.rows, kTileRows) * ceil_div(p.cols, kTileCols);
  if (tiles == 0) return;
  // Persistent grid: as many blocks as fit on the device at once (cached per device).
  static int cached_blocks[64] = {0};
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  int& fit = cached_blocks[dev & 63];
  if (fit == 0) {
    auto kernel = sm90_mxfp8_quantize_kernel<T, kE4M3>;
    MXMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    int per_sm = 0, sms = 0;
    MXMLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmemBytes));
    MXMLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    fit = per_sm * sms > 0 ? per_sm * sms : 1;
  }
  const int64_t blocks = std::min<int64_t>(fit, ceil_div(tiles, kWarpsPerBlock));
  sm90_mxfp8_quantize_kernel<T, kE4M3><<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, stream>>>(p, tiles);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void quantize_cuda(const QuantizeProblem& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  // Padding of swizzled / BHSD scale buffers is zero (SPEC §2.1): the kernel writes real blocks only.
  if (p.row_codes && row_map_bytes(p.row_map) > row_map_blocks(p.row_map))
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.row_scales, 0, row_map_bytes(p.row_map), stream));
  if (p.col_codes && col_map_bytes(p.col_map) > col_map_blocks(p.col_map))
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.col_scales, 0, col_map_bytes(p.col_map), stream));
  const bool e4m3 = p.fmt == Fp8Format::kE4M3;
  switch (p.in_dtype) {
    case DType::kBFloat16:
      return e4m3 ? launch<__nv_bfloat16, true>(p, stream) : launch<__nv_bfloat16, false>(p, stream);
    case DType::kFloat16:
      return e4m3 ? launch<__half, true>(p, stream) : launch<__half, false>(p, stream);
    default:
      return e4m3 ? launch<float, true>(p, stream) : launch<float, false>(p, stream);
  }
}

}  // namespace mxmla::detail
