// mxmla internal — definitions shared by the CPU reference and the CUDA kernels:
// the E8M0 scale rule of SPEC §2 (TransformerEngine's float_to_e8m0) and the scale layouts
// (compact, F8_128x4 swizzle, BHSD). Element rounding is NOT shared: the reference rounds in
// software (float64), the kernels with PTX cvt.rn.satfinite, and the tests compare the two.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MXMLA_HD __host__ __device__ __forceinline__
#else
#define MXMLA_HD inline
#endif

namespace mxmla::detail {

MXMLA_HD uint32_t f32_as_u32(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
MXMLA_HD float u32_as_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// fp32 reciprocal of the format's largest normal: 1/448 = 0x3B124925, 1/57344 = 0x37924925.
constexpr uint32_t kRcpMaxE4M3Bits = 0x3B124925u;
constexpr uint32_t kRcpMaxE5M2Bits = 0x37924925u;

// TransformerEngine's float_to_e8m0 for a finite, non-negative fp32 value (round toward +inf,
// saturating at 0xFE; values at or below 2^-127 give 0).
MXMLA_HD uint8_t float_to_e8m0(float v) {
  const uint32_t bits = f32_as_u32(v);
  const uint32_t e = bits >> 23, m = bits & 0x7FFFFFu;
  // select-only (no branches: neighbouring GPU lanes often hold different blocks)
  const uint32_t up = static_cast<uint32_t>(m > 0u) & static_cast<uint32_t>(e != 0xFEu) &
                      (static_cast<uint32_t>(e != 0u) | static_cast<uint32_t>(m > 0x400000u));
  return static_cast<uint8_t>(e + up);
}

// The multiplier applied before conversion: 2^(127-e), with TransformerEngine's e = 0 -> 1.0,
// and (beyond TE) e = 254 (an Inf block) -> 2^-127 and e = 255 (a NaN block) -> NaN.
MXMLA_HD float e8m0_quant_multiplier(uint8_t e) {
  uint32_t bits = (254u - e) << 23;  // e in [1, 253]
  bits = e == 0 ? 0x3F800000u : bits;
  bits = e == 254 ? 0x00400000u : bits;  // 2^-127 (fp32 subnormal: 2^22 * 2^-149)
  bits = e == 255 ? 0x7FFFFFFFu : bits;
  return u32_as_f32(bits);
}

// Scale byte from the magnitude maximum of a block given as fp32 bits with the sign cleared
// (NaN bits > 0x7F800000, Inf == 0x7F800000).
// float_to_e8m0's rounding up is an integer add: for v = amax / max (fp32 bits b, never NaN),
// (b + 0x7FFFFF) >> 23 is the exponent plus one when the mantissa is non-zero; below 2^-126 the
// threshold is 2^-127 (TE: up when m > 0x400000), i.e. (b + 0x3FFFFF) >> 23; the min keeps finite
// blocks at 0xFE and maps an Inf amax (v = Inf) to 0xFE. Equal to float_to_e8m0 plus the rules
// above for every amax (tests: Reference.E8M0BitRuleEqualsTeFormulaExhaustive, checking all 2^31
// patterns, E8M0BitRuleMatchesCeilLog2 against the reference, ...SpecialBlocks).
MXMLA_HD uint8_t block_scale_from_amax_bits(uint32_t amax_bits, uint32_t rcp_max_bits) {
  const uint32_t v = f32_as_u32(u32_as_f32(amax_bits) * u32_as_f32(rcp_max_bits));
  uint32_t e = (v + (v < 0x800000u ? 0x3FFFFFu : 0x7FFFFFu)) >> 23;
  e = e < 0xFEu ? e : 0xFEu;
  e = amax_bits > 0x7F800000u ? 0xFFu : e;
  return static_cast<uint8_t>(e);
}

// The smallest scale byte whose block the bf16 GEMM designs (and the MXFP8 Linear's bf16 operand
// copies) hold exactly: the smallest non-zero code times 2^(e − 127) must be a normal bf16 (E4M3:
// 2^-9 · 2^(e−127) >= 2^-126; E5M2: 2^-16 · ...). A block below it with non-zero codes sends a GEMM
// to the FP8 design B.
MXMLA_HD constexpr uint32_t min_exact_e(bool e4m3) { return e4m3 ? 10u : 17u; }

// A block's scale byte as its factor 2^(e − 127) in fp32 (e = 0: 2^-127, a subnormal; e = 255: NaN,
// 0x7FC00000): what dequantization multiplies a code by.
MXMLA_HD float e8m0_factor(uint32_t e) {
  return e == 255u ? u32_as_f32(0x7FC00000u) : (e == 0u ? u32_as_f32(0x00400000u) : u32_as_f32(e << 23));
}
// a · b + c rounded once (fp32 FMA)
MXMLA_HD float fma_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Design B's fold (SPEC §7): a block's fp32 sum t (FP8 tensor cores) times the block's two scale
// factors fa = 2^(ea − 127), fb = 2^(eb − 127), added to acc.
// Scale bytes ea, eb whose factors' product 2^(ea + eb − 254) is an exact fp32 (normal or subnormal).
constexpr uint32_t kFactorProductLo = 105, kFactorProductHi = 381;
// acc + t · fa · fb where fa · fb is known to be exact (ea + eb in [kFactorProductLo, kFactorProductHi]):
// one rounding.
MXMLA_HD float fold_block_product(float t, float fa, float fb, float acc) { return fma_f32(t, fa * fb, acc); }
// acc + t · fa · fb at any scale bytes: the product where it is a finite non-zero fp32 (exact: one
// rounding); elsewhere (0, Inf, and NaN factors) both factors lie on the same side of 1, and t · fb
// leaves fp32's normal range only where the result does: one rounding too, but where t · fb falls
// below 2^-126 (then |t · fa · fb| < 2^-148 and the result may be one subnormal step, 2^-149, off).
// Test: GemmFold.* (every pair of scale bytes).
MXMLA_HD float fold_block_scales(float t, float fa, float fb, float acc) {
  const float f = fa * fb;
  const uint32_t mag = f32_as_u32(f) & 0x7FFFFFFFu;
  return mag - 1u < 0x7F7FFFFFu ? fma_f32(t, f, acc) : fma_f32(t * fb, fa, acc);
}

MXMLA_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MXMLA_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
// The largest extent (rows, columns, K, a sequence's tokens) the SM90 kernels take: their tile
// coordinates, TMA's included, are 32-bit numbers, and a tile rounded up past it must stay below 2^31.
constexpr int64_t kMaxCudaExtent = (int64_t{1} << 31) - 256;

// F8_128x4 swizzle (SPEC §2.1): i indexes the 128-row axis, j the 4-column axis.
MXMLA_HD int64_t swizzle_offset(int64_t i, int64_t j, int64_t tiles_x) {
  return ((i / 128) * tiles_x + j / 4) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + (j % 4);
}

enum class MapMode : uint8_t { kCompact, kSwizzled, kBHSD };

// Where the scale of one block lands. The quantized tensor is viewed as [batch, rows, cols]
// (columnwise blocks never cross a batch). For kBHSD the columns are [bc, H, D] with bc = B for
// sbhd (batch == 1) and bc = 1 for bshd (batch == B): the (b, h) matrix is b*H + h.
struct ScaleMap {
  MapMode mode = MapMode::kCompact;
  int64_t batch = 1, rows = 0, cols = 0;
  int64_t H = 1, D = 32;     // kBHSD only
  int64_t tiles_x = 0;       // swizzle tiles along j
  int64_t mat_size = 0;      // kBHSD: bytes of one (b, h) matrix
};

// Scale offsets through cursors: the division-heavy part (which (b, h) matrix, which block column)
// is computed once per (batch, block column) and the per-row part is shifts and adds.
//   offset = base + (compact ? i * stride : swizzle_offset(i0 + i, j, tiles_x))
struct ScaleCursor {
  int64_t base, stride, i0, j, tiles_x;
  bool compact;
};
MXMLA_HD int64_t cursor_offset(const ScaleCursor& c, int64_t i) {
  return c.base + (c.compact ? i * c.stride : swizzle_offset(c.i0 + i, c.j, c.tiles_x));
}

// The cursors' divisions by run-time values (kBHSD: cols / D, the block column's matrix and place)
// in the integer type I: int64_t, or in a kernel whose register allocation a 64-bit division
// subroutine's call disturbs, uint32_t where its caller has checked that cols fits 31 bits.
template <class I>
MXMLA_HD int64_t map_div(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<I>(a) / static_cast<I>(b)); }
template <class I>
MXMLA_HD int64_t map_mod(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<I>(a) % static_cast<I>(b)); }

// Rowwise: block (bi, r, kb) covers columns [32 kb, 32 kb + 32) of row r of batch bi; the cursor
// is indexed by r.
template <class I = int64_t>
MXMLA_HD ScaleCursor row_cursor(const ScaleMap& m, int64_t bi, int64_t kb) {
  const int64_t nkb = m.cols / 32;
  switch (m.mode) {
    case MapMode::kCompact: return {bi * m.rows * nkb + kb, nkb, 0, 0, 0, true};
    case MapMode::kSwizzled: return {0, 0, bi * m.rows, kb, m.tiles_x, false};
    default: {
      const int64_t nd = m.D / 32;
      const int64_t bh = bi * map_div<I>(m.cols, m.D) + map_div<I>(kb, nd);  // b*H + h
      return {bh * m.mat_size, 0, 0, map_mod<I>(kb, nd), m.tiles_x, false};
    }
  }
}
// Columnwise: block (bi, rb, c) covers rows [32 rb, 32 rb + 32) of column c of batch bi; the
// cursor is indexed by the column offset dc from c (c + dc must stay in c's head for kBHSD).
template <class I = int64_t>
MXMLA_HD ScaleCursor col_cursor(const ScaleMap& m, int64_t bi, int64_t rb, int64_t c) {
  const int64_t nrb = ceil_div(m.rows, 32);
  switch (m.mode) {
    case MapMode::kCompact: return {(bi * nrb + rb) * m.cols + c, 1, 0, 0, 0, true};
    case MapMode::kSwizzled: return {0, 0, c, bi * nrb + rb, m.tiles_x, false};
    default: {
      const int64_t bh = bi * map_div<I>(m.cols, m.D) + map_div<I>(c, m.D);
      return {bh * m.mat_size, 0, map_mod<I>(c, m.D), rb, m.tiles_x, false};
    }
  }
}
MXMLA_HD int64_t row_scale_offset(const ScaleMap& m, int64_t bi, int64_t r, int64_t kb) {
  return cursor_offset(row_cursor(m, bi, kb), r);
}
MXMLA_HD int64_t col_scale_offset(const ScaleMap& m, int64_t bi, int64_t rb, int64_t c) {
  return cursor_offset(col_cursor(m, bi, rb, c), 0);
}

// The scale of block kb of row r of a GEMM operand op(X) = [R, K] whose map is compact or swizzled
// (the layouts the GEMM takes), in the form the dequantizing passes index without a per-element
// switch: compact r · sr + kb · skb, swizzled swizzle_offset(r, kb, tiles_x). Equal to
// row_scale_offset(m, 0, r, kb) for a rowwise map (contract_cols: X [R, K]) and to
// col_scale_offset(m, 0, kb, r) for a columnwise one (X [K, R]) (tests: GemmScaleIndex).
struct OpScaleIndex {
  int64_t sr = 0, skb = 0, tiles_x = 0;
  bool swizzled = false;
  MXMLA_HD int64_t at(int64_t r, int64_t kb) const {
    return swizzled ? swizzle_offset(r, kb, tiles_x) : r * sr + kb * skb;
  }
};
inline OpScaleIndex op_scale_index(const ScaleMap& m, bool contract_cols) {
  OpScaleIndex x;
  x.swizzled = m.mode == MapMode::kSwizzled, x.tiles_x = m.tiles_x;
  if (!x.swizzled) x.sr = contract_cols ? m.cols / 32 : 1, x.skb = contract_cols ? 1 : m.cols;
  return x;
}

// Constructors of the maps (sizes in bytes via map_bytes()).
inline ScaleMap make_row_map(MapMode mode, int64_t batch, int64_t rows, int64_t cols, int64_t H = 1,
                             int64_t D = 32) {
  ScaleMap m;
  m.mode = mode, m.batch = batch, m.rows = rows, m.cols = cols, m.H = H, m.D = D;
  if (mode == MapMode::kSwizzled) m.tiles_x = ceil_div(cols / 32, 4);
  if (mode == MapMode::kBHSD) {
    m.tiles_x = ceil_div(D / 32, 4);
    m.mat_size = round_up(rows, 128) * round_up(D / 32, 4);
  }
  return m;
}
inline ScaleMap make_col_map(MapMode mode, int64_t batch, int64_t rows, int64_t cols, int64_t H = 1,
                             int64_t D = 32) {
  ScaleMap m;
  m.mode = mode, m.batch = batch, m.rows = rows, m.cols = cols, m.H = H, m.D = D;
  const int64_t nrb = ceil_div(rows, 32);
  if (mode == MapMode::kSwizzled) m.tiles_x = ceil_div(batch * nrb, 4);
  if (mode == MapMode::kBHSD) {
    m.tiles_x = ceil_div(nrb, 4);
    m.mat_size = round_up(nrb, 4) * round_up(D, 128);
  }
  return m;
}
// Bytes the scale buffer of a map spans (padding included) and the number of real blocks.
MXMLA_HD int64_t row_map_bytes(const ScaleMap& m) {
  switch (m.mode) {
    case MapMode::kCompact: return m.batch * m.rows * (m.cols / 32);
    case MapMode::kSwizzled: return round_up(m.batch * m.rows, 128) * round_up(m.cols / 32, 4);
    default: return m.batch * (m.cols / m.D) * m.mat_size;
  }
}
MXMLA_HD int64_t col_map_bytes(const ScaleMap& m) {
  const int64_t nrb = ceil_div(m.rows, 32);
  switch (m.mode) {
    case MapMode::kCompact: return m.batch * nrb * m.cols;
    case MapMode::kSwizzled: return round_up(m.batch * nrb, 4) * round_up(m.cols, 128);
    default: return m.batch * (m.cols / m.D) * m.mat_size;
  }
}
inline int64_t row_map_blocks(const ScaleMap& m) { return m.batch * m.rows * (m.cols / 32); }
inline int64_t col_map_blocks(const ScaleMap& m) { return m.batch * ceil_div(m.rows, 32) * m.cols; }

// Remap every real block of one direction from `src` to `dst` layout (same geometry).
// Block index t enumerates (bi, r, kb) rowwise or (bi, rb, c) columnwise, row-major.
MXMLA_HD void block_coords(const ScaleMap& m, bool rowwise, int64_t t, int64_t& bi, int64_t& a, int64_t& b) {
  const int64_t inner = rowwise ? m.cols / 32 : m.cols;
  const int64_t mid = rowwise ? m.rows : ceil_div(m.rows, 32);
  b = t % inner;
  t /= inner;
  a = t % mid;
  bi = t / mid;
}
MXMLA_HD int64_t scale_offset(const ScaleMap& m, bool rowwise, int64_t bi, int64_t a, int64_t b) {
  return rowwise ? row_scale_offset(m, bi, a, b) : col_scale_offset(m, bi, a, b);
}

// The inverse: which block a byte `off` of a scale buffer holds. Returns false for padding.
MXMLA_HD bool offset_coords(const ScaleMap& m, bool rowwise, int64_t off, int64_t& bi, int64_t& a, int64_t& b) {
  if (m.mode == MapMode::kCompact) {
    block_coords(m, rowwise, off, bi, a, b);
    return true;
  }
  const int64_t nrb = ceil_div(m.rows, 32);
  int64_t mat = 0;
  if (m.mode == MapMode::kBHSD) mat = off / m.mat_size, off %= m.mat_size;
  const int64_t tile = off / 512, o = off % 512;
  const int64_t i = (tile / m.tiles_x) * 128 + ((o % 16) / 4) * 32 + o / 16;
  const int64_t j = (tile % m.tiles_x) * 4 + o % 4;
  if (m.mode == MapMode::kSwizzled) {
    if (rowwise) {  // i = flattened row, j = block column
      if (i >= m.batch * m.rows || j >= m.cols / 32) return false;
      bi = i / m.rows, a = i % m.rows, b = j;
    } else {  // i = column, j = flattened row block
      if (i >= m.cols || j >= m.batch * nrb) return false;
      bi = j / nrb, a = j % nrb, b = i;
    }
    return true;
  }
  const int64_t mats = m.cols / m.D;  // (b, h) matrices per batch entry
  bi = mat / mats;
  if (rowwise) {  // i = s, j = d block
    if (i >= m.rows || j >= m.D / 32) return false;
    a = i, b = (mat % mats) * (m.D / 32) + j;
  } else {  // i = d, j = s block
    if (i >= m.D || j >= nrb) return false;
    a = j, b = (mat % mats) * m.D + i;
  }
  return true;
}

MXMLA_HD int64_t map_bytes(const ScaleMap& m, bool rowwise) { return rowwise ? row_map_bytes(m) : col_map_bytes(m); }

}  // namespace mxmla::detail
