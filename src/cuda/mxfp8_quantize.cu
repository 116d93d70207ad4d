// mxmla — MXFP8 quantization kernel (rowwise, columnwise, or both in one pass). Arch-neutral: it needs
// cp.async and the FP8 conversions (sm_89+) and is built for every architecture in MXMLA_CUDA_ARCHS.
//
// Memory-bound: one read of the input, one write of each output. Persistent blocks of two warps
// stream tiles of 32 rows x 32 16-byte chunks (32 x 256 bf16, 32 x 128 fp32) through a
// kStages-deep cp.async ring in shared memory and quantize a tile while the next ones load.
// Inside a tile the two directions use different thread mappings, so that every block's amax is
// a thread-local reduction and every scale is computed once, and they run on different warps:
//   * columnwise (warp 0): lane = chunk (VEC columns), walking down the 32 rows;
//   * rowwise    (warp 1): lane = row, walking along the row's 32-element blocks.
// Chunk c of row r sits at physical chunk c ^ r, which makes both walks bank-conflict free.
// amax is an integer max of magnitude bits (two 16-bit lanes per instruction), which also sees
// NaN (bits above Inf) and Inf for the SPEC §2 policy. Scales go through a ScaleCursor
// (compact or swizzled), so swizzled scales are written directly; padding is zeroed by the
// launcher. Tiles are walked in groups of four row tiles (one 128-row swizzle tile), so swizzled
// columnwise scales leave as whole words. BHSD scales (attention) take two passes: compact
// scales to scratch, then the staged re-layout kernel of mxfp8_scales.cu
// (quantize_bhsd_two_pass). The kCopies instantiation (bf16 input, E4M3) also writes the MXFP8
// Linear's bf16 operand copies (QuantizeProblem::row_copy / col_copy; src/cuda/sm90_mxfp8_gemm.cu,
// linear_forward_cuda): after a tile's scale pass each warp hands its scale bytes through shared
// memory to a copy pass whose lanes run along the output (a rowwise copy row's 512 bytes, or eight
// 64-byte pieces of the transposed columnwise copy, a store).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/ops.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.h"
#include "cuda/ptx/convert.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/heuristics.h"
#include "cuda/numerics.cuh"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {
namespace {

// Tile configuration (the values measured best on the H200: docs/notes-quantize.md).
constexpr int kWarpsPerBlock = 2;  // share one tile ring: columnwise and rowwise passes run side by side
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kTileRows = 32;    // = MXFP8 block size along the columnwise axis
constexpr int kTileChunks = 32;  // 16-byte chunks per tile row (one per lane)
constexpr int kRowUnroll = 4;    // rowwise blocks in flight per lane
constexpr int kStages = 3;       // ring depth: tiles k+1 .. k+kStages-1 load while k is quantized
static_assert(kStages >= 2 && kRowUnroll >= 1, "a ring of at least two stages");
constexpr int kTileBytes = kTileRows * kTileChunks * 16;
constexpr int kRowSinkBytes = kTileRows * 4 * 8;  // compact rowwise scales of a column group
constexpr int kSmemBytes = kStages * kTileBytes + kRowSinkBytes;  // one ring per block
// kCopies: the scale bytes each warp hands from its scale pass to its copy pass (rowwise: [2 warps]
// [32 rows][8 blocks]; columnwise: [256 columns])
constexpr int kCopyScaleBytes = 2 * kTileRows * 8 + kTileChunks * 8;
template <bool kCopies>
constexpr int smem_bytes() { return kSmemBytes + (kCopies ? kCopyScaleBytes : 0); }
static_assert(kTileRows == 32 && kTileChunks == 32, "the XOR layout maps rows and chunks onto the 32 lanes");

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

// Store VEC bytes held in the low bytes of `v`. Codes and scales are stored with the default
// cache policy: streaming (evict-first) stores measured 1.5 % slower for both directions
// (measured on the H200: git history of docs/performance.md).
template <int VEC>
__device__ __forceinline__ void store_bytes(uint8_t* dst, uint64_t v) {
  if constexpr (VEC == 8)
    *reinterpret_cast<unsigned long long*>(dst) = static_cast<unsigned long long>(v);
  else
    *reinterpret_cast<unsigned int*>(dst) = static_cast<unsigned int>(v);
}

// Two 16-bit elements of a word -> two codes (16 bits), each multiplied by its multiplier.
template <typename T, bool kE4M3>
__device__ __forceinline__ uint32_t cvt_word(uint32_t w, float m0, float m1) {
  static_assert(InputTraits<T>::kPerWord == 2, "fp32 words are converted in pairs by convert_chunk");
  const float2 a = InputTraits<T>::to_float2(w);
  return ptx::cvt_fp8x2<kE4M3>(a.x * m0, a.y * m1);
}

// A chunk (16 bytes = VEC elements) -> VEC codes in the low bytes of a uint64 (VEC = 8) or
// uint32 (VEC = 4), element j multiplied by mult[j].
template <typename T, bool kE4M3>
__device__ __forceinline__ uint64_t convert_chunk(const uint4& v, const float* mult) {
  if constexpr (InputTraits<T>::kPerWord == 2) {
    const uint32_t c0 = cvt_word<T, kE4M3>(v.x, mult[0], mult[1]), c1 = cvt_word<T, kE4M3>(v.y, mult[2], mult[3]);
    const uint32_t c2 = cvt_word<T, kE4M3>(v.z, mult[4], mult[5]), c3 = cvt_word<T, kE4M3>(v.w, mult[6], mult[7]);
    return static_cast<uint64_t>(c0 | (c1 << 16)) | (static_cast<uint64_t>(c2 | (c3 << 16)) << 32);
  } else {
    const uint32_t lo = ptx::cvt_fp8x2<kE4M3>(__uint_as_float(v.x) * mult[0], __uint_as_float(v.y) * mult[1]);
    const uint32_t hi = ptx::cvt_fp8x2<kE4M3>(__uint_as_float(v.z) * mult[2], __uint_as_float(v.w) * mult[3]);
    return lo | (hi << 16);
  }
}

// Max magnitude (packed for 16-bit types) of a chunk's words.
template <typename T>
__device__ __forceinline__ uint32_t chunk_mag(const uint4& v) {
  return mag_max<T>(mag_max<T>(word_mag<T>(v.x), word_mag<T>(v.y)), mag_max<T>(word_mag<T>(v.z), word_mag<T>(v.w)));
}

struct TileCoord {
  int64_t bi, tr, tc;
  int nrows;  // 0: a tile past the end (groups of 4 tiles may overhang)
};

// Tiles come in groups of 4 walked in order by one block: 4 consecutive row tiles of one column
// tile (swizzled / BHSD scales: the rows of one 128-row swizzle tile, so columnwise scales leave
// as words), or, with compact scales, 4 consecutive column tiles of one row tile (so a row's
// rowwise scales leave as one 32-byte sector). Group g, member q.
template <int VEC>
__device__ __forceinline__ TileCoord tile_coord(const QuantizeProblem& p, int64_t g, int q, bool by_columns) {
  const int64_t ntc = ceil_div(p.cols, kTileChunks * VEC);
  const int64_t ntr = ceil_div(p.rows, kTileRows);
  TileCoord c;
  int64_t left;
  if (by_columns) {
    const int64_t ntc4 = ceil_div(ntc, 4);
    c.tc = (g % ntc4) * 4 + q;
    c.tr = (g / ntc4) % ntr;
    c.bi = g / (ntc4 * ntr);
    left = c.tc < ntc ? p.rows - c.tr * kTileRows : 0;
  } else {
    const int64_t ntr4 = ceil_div(ntr, 4);
    c.tc = g % ntc;
    c.tr = ((g / ntc) % ntr4) * 4 + q;
    c.bi = g / (ntc * ntr4);
    left = p.rows - c.tr * kTileRows;
  }
  c.nrows = static_cast<int>(left <= 0 ? 0 : left < kTileRows ? left : kTileRows);
  return c;
}

// Rows of the tile row that a column group covers (every member shares the row tile).
__device__ __forceinline__ int cur_rows_of_group(const QuantizeProblem& p, const TileCoord& c) {
  const int64_t left = p.rows - c.tr * kTileRows;
  return static_cast<int>(left < kTileRows ? left : kTileRows);
}

// Groups of 4 column tiles only pay off when a row has that many tiles (otherwise 3 of 4
// pipeline slots would be empty, e.g. K = 192 has one): then fall back to groups of row tiles.
__host__ __device__ __forceinline__ bool groups_by_columns(const QuantizeProblem& p, int tile_cols) {
  return p.row_map.mode == MapMode::kCompact && p.col_map.mode == MapMode::kCompact &&
         ceil_div(p.cols, static_cast<int64_t>(tile_cols)) >= 4;
}

// Lane l of warp w copies chunk l of rows [16w, 16w + 16) of the tile into physical chunk l ^ r
// (missing rows and columns are zero-filled without a read).
template <typename T>
__device__ __forceinline__ void issue_tile(const QuantizeProblem& p, const TileCoord& c, uint4* stage, int lane,
                                           int warp) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kRowsPerWarp = kTileRows / kWarpsPerBlock;
  const int64_t col = (c.tc * kTileChunks + lane) * VEC;
  const bool col_ok = col < p.cols;
  const int r0 = warp * kRowsPerWarp;
  const T* src;
  int64_t rs;
  if (p.gather.seg == 0) {
    src = static_cast<const T*>(p.in) + c.bi * p.batch_stride + (c.tr * kTileRows + r0) * p.row_stride + col;
    rs = p.row_stride;
  } else {  // this lane's chunk lies in one part (seg and split are whole chunks)
    const InputRef at = input_ref(p, c.bi, c.tr * kTileRows + r0, col_ok ? col : 0);
    src = static_cast<const T*>(at.part == 0 ? p.in : p.gather.in1) + at.offset;
    rs = at.part == 0 ? p.row_stride : p.gather.row_stride1;
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = r0 + i;
    const bool ok = col_ok && r < c.nrows;
    ptx::cp_async<16>(stage + r * kTileChunks + (lane ^ r), ok ? static_cast<const void*>(src + i * rs) : p.in,
                      ok ? 16 : 0);
  }
}

__device__ __forceinline__ bool ccur_compact(const QuantizeProblem& p) { return p.col_map.mode == MapMode::kCompact; }

// Store the group's collected columnwise scales (swizzled / BHSD): one 4-byte word per column.
template <int VEC>
__device__ __forceinline__ void store_group_scales(const QuantizeProblem& p, int64_t bi, int64_t tr0, int64_t col,
                                                   const uint32_t* group_scales) {
  if (col >= p.cols) return;
  const ScaleCursor cc = col_cursor(p.col_map, bi, tr0, col);  // tr0 % 4 == 0: word-aligned j
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    uint8_t* d = p.col_scales + cursor_offset(cc, j);
    if ((reinterpret_cast<uintptr_t>(d) % 4) == 0) {
      *reinterpret_cast<uint32_t*>(d) = group_scales[j];
    } else {
      for (int q = 0; q < 4; ++q) d[q] = static_cast<uint8_t>(group_scales[j] >> (8 * q));
    }
  }
}

// Columnwise: lane = chunk; 32 rows down, amax per column, then codes row by row (and, with
// kCopies and a col_copy, the transposed copy, its scales through col_scale_sink).
template <typename T, bool kE4M3, bool kCopies>
__device__ __forceinline__ void columnwise_tile(const QuantizeProblem& p, const TileCoord& c, const uint4* stage,
                                                int lane, int q, uint32_t* group_scales, uint8_t* col_scale_sink) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kPW = InputTraits<T>::kPerWord;
  constexpr uint32_t kRcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int64_t col = (c.tc * kTileChunks + lane) * VEC;
  if (!kCopies && col >= p.cols) return;  // (the copy pass below needs every lane)
  uint32_t cm[4] = {0, 0, 0, 0};
#pragma unroll 8
  for (int r = 0; r < kTileRows; ++r) {
    const uint4 v = stage[r * kTileChunks + (lane ^ r)];
    cm[0] = mag_max<T>(cm[0], word_mag<T>(v.x)), cm[1] = mag_max<T>(cm[1], word_mag<T>(v.y));
    cm[2] = mag_max<T>(cm[2], word_mag<T>(v.z)), cm[3] = mag_max<T>(cm[3], word_mag<T>(v.w));
  }
  float mult[VEC];
  uint64_t scales = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const uint8_t e = block_scale_from_amax_bits(InputTraits<T>::mag_to_f32_bits(mag_elem<T>(cm[j / kPW], j % kPW)), kRcp);
    scales |= static_cast<uint64_t>(e) << (8 * j);
    mult[j] = e8m0_quant_multiplier(e);
  }
  if constexpr (kCopies) {
    if (p.col_copy != nullptr) {
      static_assert(!kCopies || VEC == 8, "the copies take bf16 input");
      // the scale pass's bytes to shared memory (column lane * 8 + j), then the copy pass with the
      // lanes over the output: in step `it`, lane l writes column 8 it + l / 4, rows 8 (l % 4) .. + 7
      // of the tile (one 16-byte store; a warp writes 8 whole 64-byte row pieces of the copy)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        check_exact<kE4M3>(p.inexact + 1, static_cast<uint32_t>(scales >> (8 * j)) & 0xFFu,
                           mag_elem<T>(cm[j / kPW], j % kPW));
      __syncwarp();
      *reinterpret_cast<uint2*>(col_scale_sink + lane * VEC) =
          make_uint2(static_cast<uint32_t>(scales), static_cast<uint32_t>(scales >> 32));
      __syncwarp();
      const int r0 = 8 * (lane & 3), jj = lane >> 2;
      const uint16_t* st = reinterpret_cast<const uint16_t*>(stage);
#pragma unroll 4
      for (int it = 0; it < kTileChunks; ++it) {
        const int64_t cc = (c.tc * kTileChunks + it) * VEC + jj;  // the column this lane writes
        const uint32_t e = col_scale_sink[it * VEC + jj];
        const float m = e8m0_quant_multiplier(static_cast<uint8_t>(e)), f = e8m0_factor(e);
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = r0 + 2 * i;
          const float2 v = make_float2(
              __uint_as_float(static_cast<uint32_t>(st[(r * kTileChunks + (it ^ r)) * VEC + jj]) << 16),
              __uint_as_float(static_cast<uint32_t>(st[((r + 1) * kTileChunks + (it ^ (r + 1))) * VEC + jj]) << 16));
          w[i] = dequant_pair<kE4M3>(ptx::cvt_fp8x2<kE4M3>(v.x * m, v.y * m), f);
        }
        if (cc < p.cols)
          *reinterpret_cast<uint4*>(p.col_copy + cc * p.col_copy_ld + c.tr * kTileRows + r0) =
              make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    if (p.col_codes == nullptr || col >= p.cols) return;  // a copy without codes: no scales either
  }
  if (!ccur_compact(p)) {
    // F8_128x4 / BHSD: the row blocks 4g..4g+3 of a column are 4 contiguous bytes; collect the
    // group's scales and store them once per column after its last member (q == 3).
#pragma unroll
    for (int j = 0; j < VEC; ++j) group_scales[j] |= static_cast<uint32_t>((scales >> (8 * j)) & 0xFF) << (8 * q);
  } else {
    uint8_t* sdst = p.col_scales + cursor_offset(col_cursor(p.col_map, c.bi, c.tr, col), 0);
    if ((reinterpret_cast<uintptr_t>(sdst) % VEC) == 0) {
      store_bytes<VEC>(sdst, scales);  // VEC contiguous scale bytes
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) sdst[j] = static_cast<uint8_t>(scales >> (8 * j));
    }
  }
  uint8_t* dst = p.col_codes + (c.bi * p.rows + c.tr * kTileRows) * p.cols + col;
#pragma unroll 8
  for (int r = 0; r < kTileRows; ++r) {
    if (r >= c.nrows) break;
    store_bytes<VEC>(dst + r * p.cols, convert_chunk<T, kE4M3>(stage[r * kTileChunks + (lane ^ r)], mult));
  }
}

// Rowwise: lane = row; each 32-element block is CPB chunks of that row. Codes leave in full
// 32-byte sectors: lanes 2k and 2k+1 swap halves so that each store instruction writes both
// halves of one row's block. The tile row's scales leave in one wide store where contiguous.
// With kCopies and a row_copy, the scale bytes go through row_scale_sink ([32 rows][8 blocks], this
// warp's) to a copy pass with lane = chunk, row by row (a warp writes 512 contiguous bytes a store);
// without row codes, no codes and no scales.
template <typename T, bool kE4M3, bool kCopies>
__device__ __forceinline__ void rowwise_tile(const QuantizeProblem& p, const TileCoord& c, const uint4* stage,
                                             int lane, int b_begin, int b_end, uint8_t* scale_sink,
                                             uint8_t* row_scale_sink) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CPB = 32 / VEC;                // chunks per block
  constexpr int kBlocks = kTileChunks / CPB;  // blocks per tile row (8 bf16/fp16, 4 fp32)
  constexpr uint32_t kRcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const bool row_ok = lane < c.nrows;  // rows past the end still join the shuffles
  const int64_t row = c.tr * kTileRows + lane;
  const int64_t kb0 = c.tc * kBlocks;
  const int64_t nkb = p.cols / 32;
  const int odd = lane & 1;
  // rows 2k (even lane) and 2k+1 (odd lane) of this pair; this lane writes bytes [16*odd, 16*odd+16)
  uint8_t* dst_even = p.row_codes + (c.bi * p.rows + (row - odd)) * p.cols + kb0 * 32 + 16 * odd;
  const bool even_ok = (lane - odd) < c.nrows, odd_ok = (lane | 1) < c.nrows;
  const uint4* src = stage + lane * kTileChunks;
  uint64_t scales = 0;
#pragma unroll kRowUnroll
  for (int b = b_begin; b < b_end; ++b) {
    if (kb0 + b >= nkb) break;  // uniform across the warp
    uint4 v[CPB];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < CPB; ++k) {
      v[k] = src[(b * CPB + k) ^ lane];
      m = mag_max<T>(m, chunk_mag<T>(v[k]));
    }
    const uint8_t e = block_scale_from_amax_bits(InputTraits<T>::mag_to_f32_bits(mag_collapse<T>(m)), kRcp);
    scales |= static_cast<uint64_t>(e) << (8 * b);
    if constexpr (kCopies) {
      if (p.row_copy != nullptr) {
        static_assert(!kCopies || CPB == 4, "the copies take bf16 input");
        if (row_ok) check_exact<kE4M3>(p.inexact, e, InputTraits<T>::mag_to_f32_bits(mag_collapse<T>(m)));
        row_scale_sink[lane * 8 + b] = e;
        if (p.row_codes == nullptr) continue;  // (uniform across the warp)
      }
    }
    const float mul = e8m0_quant_multiplier(e);
    float mult[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) mult[j] = mul;
    uint32_t codes[8];  // this row's 32 codes
#pragma unroll
    for (int k = 0; k < CPB; ++k) {
      const uint64_t q = convert_chunk<T, kE4M3>(v[k], mult);
      if constexpr (VEC == 8) {
        codes[2 * k] = static_cast<uint32_t>(q), codes[2 * k + 1] = static_cast<uint32_t>(q >> 32);
      } else {
        codes[k] = static_cast<uint32_t>(q);
      }
    }
    // even lane keeps codes[0..3] of its row and receives codes[0..3] of the odd row;
    // odd lane keeps codes[4..7] of its row and receives codes[4..7] of the even row.
    uint32_t mine[4], theirs[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      mine[k] = odd ? codes[4 + k] : codes[k];
      const uint32_t give = odd ? codes[k] : codes[4 + k];
      theirs[k] = __shfl_xor_sync(0xFFFFFFFFu, give, 1);
    }
    const uint4 even_half = odd ? make_uint4(theirs[0], theirs[1], theirs[2], theirs[3])
                                : make_uint4(mine[0], mine[1], mine[2], mine[3]);
    const uint4 odd_half = odd ? make_uint4(mine[0], mine[1], mine[2], mine[3])
                               : make_uint4(theirs[0], theirs[1], theirs[2], theirs[3]);
    if (even_ok) *reinterpret_cast<uint4*>(dst_even + b * 32) = even_half;
    if (odd_ok) *reinterpret_cast<uint4*>(dst_even + p.cols + b * 32) = odd_half;
  }
  if constexpr (kCopies) {
    if (p.row_copy != nullptr) {
      __syncwarp();  // the sink's bytes of this tile are written
      const int64_t col = (c.tc * kTileChunks + lane) * 8;  // lane = chunk: 8 columns of every row
      const int b = lane / CPB;
      if (b >= b_begin && b < b_end && col < p.cols) {
#pragma unroll 4
        for (int r = 0; r < c.nrows; ++r) {
          const uint32_t e = row_scale_sink[r * 8 + b];
          float mult[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) mult[j] = e8m0_quant_multiplier(static_cast<uint8_t>(e));
          const uint64_t q = convert_chunk<T, kE4M3>(stage[r * kTileChunks + (lane ^ r)], mult);
          const float f = e8m0_factor(e);
          const uint32_t lo = static_cast<uint32_t>(q), hi = static_cast<uint32_t>(q >> 32);
          *reinterpret_cast<uint4*>(p.row_copy + (c.tr * kTileRows + r) * p.row_copy_ld + col) =
              make_uint4(dequant_pair<kE4M3>(lo & 0xFFFFu, f), dequant_pair<kE4M3>(lo >> 16, f),
                         dequant_pair<kE4M3>(hi & 0xFFFFu, f), dequant_pair<kE4M3>(hi >> 16, f));
        }
      }
      __syncwarp();  // every lane has read the sink before the next tile writes it
    }
  }
  if (!row_ok) return;
  if (kCopies && p.row_codes == nullptr) return;
  if (scale_sink != nullptr) {  // compact: collected per row for the whole column group
    for (int b = b_begin; b < b_end; ++b) scale_sink[b] = static_cast<uint8_t>(scales >> (8 * b));
    return;
  }
  // scales of blocks [b_begin, b_begin + nb) of this row, in bits [8 b, 8 b + 8) of `scales`
  const int64_t b_stop = nkb - kb0 < b_end ? nkb - kb0 : b_end;
  const int nb = static_cast<int>(b_stop - b_begin);
  if (nb <= 0) return;
  scales >>= 8 * b_begin;
  const ScaleCursor rc = row_cursor(p.row_map, c.bi, kb0 + b_begin);
  uint8_t* sdst = p.row_scales + cursor_offset(rc, row);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(sdst);
  if (rc.compact && nb == 8 && addr % 8 == 0) {
    store_bytes<8>(sdst, scales);  // contiguous scale bytes
  } else if (rc.compact && nb == 4 && addr % 4 == 0) {
    store_bytes<4>(sdst, scales);
  } else if (p.row_map.mode == MapMode::kSwizzled && nb % 4 == 0 && (kb0 + b_begin) % 4 == 0 &&
             (reinterpret_cast<uintptr_t>(p.row_scales) % 4) == 0) {
    for (int g = 0; g < nb; g += 4)  // F8_128x4: scale columns 4g..4g+3 of a row are 4 contiguous bytes
      store_bytes<4>(p.row_scales + cursor_offset(row_cursor(p.row_map, c.bi, kb0 + b_begin + g), row),
                     scales >> (8 * g));
  } else {
    for (int b = 0; b < nb; ++b)
      p.row_scales[cursor_offset(row_cursor(p.row_map, c.bi, kb0 + b_begin + b), row)] =
          static_cast<uint8_t>(scales >> (8 * b));
  }
}

// Persistent blocks of two warps: block i walks the tile groups i, i + G, i + 2G, ... (G = grid
// size), four row tiles per group, loading the next tile (cp.async into the next stage) while it
// quantizes the current one. With both directions, warp 0 runs the columnwise pass and warp 1
// the rowwise pass of the same tile; with one direction the warps split it (rowwise: half the
// blocks of each row each; columnwise: warp 0 alone).
// kCopies: the MXFP8 Linear's bf16 operand copies (row_copy, col_copy, inexact; bf16 input, E4M3).
// run_if (any instantiation): return at once while the flag is clear.
template <typename T, bool kE4M3, bool kCopies>
__global__ void __launch_bounds__(kThreads) mxfp8_quantize_kernel(const QuantizeProblem p, int64_t num_groups) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kBlocks = kTileChunks * VEC / 32;  // rowwise blocks per tile row
  static_assert(32 % VEC == 0 && VEC * sizeof(T) == 16, "a chunk is 16 bytes of whole elements");
  static_assert(kWarpsPerBlock == 2, "the pass split below is written for two warps");
  extern __shared__ __align__(16) uint4 smem[];  // [kStages][32 rows][32 chunks]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (p.run_if != nullptr && *p.run_if == 0u) return;
  const bool do_col = p.col_codes != nullptr || (kCopies && p.col_copy != nullptr);
  const bool do_row = p.row_codes != nullptr || (kCopies && p.row_copy != nullptr);
  const bool col_warp = do_col && warp == 0;
  const bool row_warp = do_row && (!do_col || warp == 1);
  const int b_begin = do_col ? 0 : warp * (kBlocks / 2), b_end = do_col ? kBlocks : b_begin + kBlocks / 2;
  const int64_t g0 = blockIdx.x, stride = gridDim.x;
  if (g0 >= num_groups) return;
  const int64_t steps = 4 * ceil_div(num_groups - g0, stride);  // this block's tiles, in order
  const bool by_cols = groups_by_columns(p, kTileChunks * VEC);
  auto tile_at = [&](int64_t k) {
    return tile_coord<VEC>(p, g0 + (k / 4) * stride, static_cast<int>(k % 4), by_cols);
  };
  // compact rowwise scales of a column group: [32 rows][4 tiles x kBlocks] bytes
  uint8_t* row_sink = reinterpret_cast<uint8_t*>(smem + kStages * kTileRows * kTileChunks);
  // kCopies: each warp's rowwise scale bytes [32][8], then the columnwise ones [256]
  uint8_t* copy_row_sink = row_sink + kRowSinkBytes + warp * kTileRows * 8;
  uint8_t* copy_col_sink = row_sink + kRowSinkBytes + 2 * kTileRows * 8;
  // Pipeline: tile k + kStages - 1 is issued while tile k is quantized.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) issue_tile<T>(p, tile_at(s), smem + s * kTileRows * kTileChunks, lane, warp);
    ptx::cp_async_commit();
  }
  uint32_t group_scales[VEC] = {};
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t kn = k + kStages - 1;  // refills the stage that tile k - 1 used
    if (kn < steps) issue_tile<T>(p, tile_at(kn), smem + (kn % kStages) * kTileRows * kTileChunks, lane, warp);
    ptx::cp_async_commit();             // one group per step (empty at the tail): the count below holds
    ptx::cp_async_wait<kStages - 1>();  // groups of tiles <= k have landed for this thread ...
    __syncthreads();                    // ... and for everybody
    const TileCoord cur = tile_at(k);
    const uint4* stage = smem + (k % kStages) * kTileRows * kTileChunks;
    const int q = static_cast<int>(k % 4);
    if (cur.nrows > 0) {
      if (col_warp) columnwise_tile<T, kE4M3, kCopies>(p, cur, stage, lane, q, group_scales, copy_col_sink);
      if (row_warp)
        rowwise_tile<T, kE4M3, kCopies>(p, cur, stage, lane, b_begin, b_end,
                                        by_cols ? row_sink + lane * 4 * kBlocks + q * kBlocks : nullptr,
                                        copy_row_sink);
    }
    if (q == 3 && col_warp && !ccur_compact(p)) {
      store_group_scales<VEC>(p, cur.bi, cur.tr - 3, (cur.tc * kTileChunks + lane) * VEC, group_scales);
#pragma unroll
      for (int j = 0; j < VEC; ++j) group_scales[j] = 0;
    }
    __syncthreads();  // the stage is read by both warps before it is refilled
    if (q == 3 && by_cols && p.row_codes != nullptr && warp == kWarpsPerBlock - 1) {
      // the group's rowwise scales of row `lane`: 4 * kBlocks contiguous bytes
      const int64_t kb0 = (cur.tc - 3) * kBlocks, nkb = p.cols / 32;
      const int64_t row = cur.tr * kTileRows + lane;
      const int64_t n = nkb - kb0 < 4 * kBlocks ? nkb - kb0 : 4 * kBlocks;
      if (lane < cur_rows_of_group(p, cur) && n > 0) {
        uint8_t* d = p.row_scales + (cur.bi * p.rows + row) * nkb + kb0;
        const uint4* srow = reinterpret_cast<const uint4*>(row_sink + lane * 4 * kBlocks);
        if (n == 4 * kBlocks && (reinterpret_cast<uintptr_t>(d) % 16) == 0) {
#pragma unroll
          for (int v = 0; v < 4 * kBlocks / 16; ++v) reinterpret_cast<uint4*>(d)[v] = srow[v];
        } else {
          for (int64_t b = 0; b < n; ++b) d[b] = row_sink[lane * 4 * kBlocks + b];
        }
      }
    }
  }
}

template <typename T, bool kE4M3, bool kCopies = false>
void launch(const QuantizeProblem& p, cudaStream_t stream) {
  constexpr int kTileCols = kTileChunks * (16 / sizeof(T));
  const bool by_cols = groups_by_columns(p, kTileCols);
  const int64_t groups = by_cols ? p.batch * ceil_div(p.rows, kTileRows) * ceil_div(ceil_div(p.cols, kTileCols), 4)
                                 : p.batch * ceil_div(p.rows, 4 * kTileRows) * ceil_div(p.cols, kTileCols);
  if (groups == 0) return;
  // Persistent grid: as many blocks as fit on the device at once.
  const void* kernel = reinterpret_cast<const void*>(&mxfp8_quantize_kernel<T, kE4M3, kCopies>);
  constexpr int smem = smem_bytes<kCopies>();
  const int64_t blocks = heuristics::persistent_grid(kernel_fit(kernel, kThreads, smem, smem).resident(), groups);
  mxfp8_quantize_kernel<T, kE4M3, kCopies><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, groups);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

// BHSD scales (the attention hand-off) in two passes: the quantize kernel writes compact scales
// to scratch, then the staged remap kernel (mxfp8_scales.cu) writes whole 512-byte BHSD
// swizzle tiles, padding included. Faster than the quantize kernel scattering BHSD scale bytes
// itself (0.1248 vs 0.1342 ms for Q, K, V at b 2, h 16, s 4096: git history of docs/performance.md).
void quantize_bhsd_two_pass(const QuantizeProblem& p, Stream s) {
  QuantizeProblem q = p;
  const bool row = p.row_codes && p.row_map.mode == MapMode::kBHSD, col = p.col_codes && p.col_map.mode == MapMode::kBHSD;
  if (row) q.row_map = make_row_map(MapMode::kCompact, p.batch, p.rows, p.cols);
  if (col) q.col_map = make_col_map(MapMode::kCompact, p.batch, p.rows, p.cols);
  const int64_t rb = row ? round_up(row_map_bytes(q.row_map), 16) : 0, cb = col ? col_map_bytes(q.col_map) : 0;
  StreamScratch scratch(rb + cb, reinterpret_cast<cudaStream_t>(s));
  std::vector<RemapProblem> jobs;
  if (row) {
    q.row_scales = scratch.ptr;
    jobs.push_back({scratch.ptr, p.row_scales, q.row_map, p.row_map, true});
  }
  if (col) {
    q.col_scales = scratch.ptr + rb;
    jobs.push_back({scratch.ptr + rb, p.col_scales, q.col_map, p.col_map, false});
  }
  quantize_cuda(q, s);
  remap_scales_cuda(jobs, s);
}
}  // namespace

void quantize_cuda(const QuantizeProblem& p, Stream s) {
  if (p.row_copy != nullptr || p.col_copy != nullptr) {
    // the MXFP8 Linear's copies (api: linear.cpp): bf16, E4M3, compact scales, one batch
    if (p.in_dtype != DType::kBFloat16 || p.fmt != Fp8Format::kE4M3 || p.batch != 1 || p.inexact == nullptr ||
        (p.row_codes && p.row_map.mode != MapMode::kCompact) || (p.col_codes && p.col_map.mode != MapMode::kCompact) ||
        (p.col_copy && p.col_copy_ld < round_up(p.rows, kTileRows)))
      throw Error("mxmla.quantize", "input", "internal: the operand copies take bf16 input, E4M3, compact scales");
    return launch<__nv_bfloat16, true, true>(p, reinterpret_cast<cudaStream_t>(s));
  }
  if ((p.row_codes && p.row_map.mode == MapMode::kBHSD) || (p.col_codes && p.col_map.mode == MapMode::kBHSD))
    return quantize_bhsd_two_pass(p, s);
  auto stream = reinterpret_cast<cudaStream_t>(s);
  // Padding of swizzled scale buffers is zero (SPEC §2.1): the kernel writes real blocks only.
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
