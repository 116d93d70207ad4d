// mxmla — CPU reference of the MXFP8 ops (SPEC §2). Plain loops, float64 arithmetic, rounding
// written out in software: this is what the CUDA kernels are checked against, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/ops.h"
#include "cpu/reference.h"

namespace mxmla::ref {

namespace {
struct Fp8Spec {
  int mant_bits;   // explicit mantissa bits
  int emin;        // exponent of the smallest normal
  int bias;
  double max_normal;
};
constexpr Fp8Spec spec_of(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? Fp8Spec{3, -6, 7, 448.0} : Fp8Spec{2, -14, 15, 57344.0};
}
}  // namespace

uint8_t round_to_fp8(double v, Fp8Format f) {
  const Fp8Spec s = spec_of(f);
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  double a = std::fabs(v);
  // Quantum (spacing of representable values) at a's binade; subnormals share the smallest one.
  int exp2;
  std::frexp(a, &exp2);  // a = m * 2^exp2, m in [0.5, 1)
  int e = (a == 0.0) ? s.emin : exp2 - 1;
  if (e < s.emin) e = s.emin;
  const double quantum = std::ldexp(1.0, e - s.mant_bits);
  double n = a / quantum;  // exact: a is a double and quantum a power of two in range
  double fl = std::floor(n);
  const double frac = n - fl;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(fl, 2.0) != 0.0)) fl += 1.0;
  double r = fl * quantum;
  if (r > s.max_normal || std::isinf(a)) r = s.max_normal;  // satfinite
  if (r == 0.0) return sign;
  // Encode r.
  std::frexp(r, &exp2);
  int re = exp2 - 1;
  uint32_t bits;
  if (re < s.emin) {  // subnormal: value = mant * 2^(emin - mant_bits)
    bits = static_cast<uint32_t>(r / std::ldexp(1.0, s.emin - s.mant_bits));
  } else {
    const double mant = r / std::ldexp(1.0, re) - 1.0;  // in [0, 1)
    bits = (static_cast<uint32_t>(re + s.bias) << s.mant_bits) |
           static_cast<uint32_t>(mant * (1 << s.mant_bits));
  }
  return static_cast<uint8_t>(sign | bits);
}

double fp8_to_double(uint8_t code, Fp8Format f) {
  const Fp8Spec s = spec_of(f);
  const bool neg = code & 0x80;
  const int ebits = 7 - s.mant_bits;
  const uint32_t e = (code & 0x7F) >> s.mant_bits;
  const uint32_t m = code & ((1u << s.mant_bits) - 1);
  double v;
  if (f == Fp8Format::kE4M3 && (code & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  if (f == Fp8Format::kE5M2 && e == (1u << ebits) - 1)
    return m ? std::numeric_limits<double>::quiet_NaN() : (neg ? -INFINITY : INFINITY);
  if (e == 0)
    v = std::ldexp(static_cast<double>(m), s.emin - s.mant_bits);
  else
    v = std::ldexp(1.0 + static_cast<double>(m) / (1 << s.mant_bits), static_cast<int>(e) - s.bias);
  return neg ? -v : v;
}

uint8_t e8m0_from_amax(double amax, Fp8Format f) {
  const float rcp = f == Fp8Format::kE4M3 ? 1.0f / 448.0f : 1.0f / 57344.0f;
  const float prod = static_cast<float>(amax) * rcp;  // fp32 multiply (SPEC §2), amax exact in fp32
  if (prod == 0.0f) return 0;
  int exp2;
  const double m = std::frexp(static_cast<double>(prod), &exp2);  // prod = m * 2^exp2
  int ceil_log2 = (m == 0.5) ? exp2 - 1 : exp2;                   // ceil(log2(prod))
  int biased = ceil_log2 + 127;
  if (biased < 0) biased = 0;
  if (biased > 254) biased = 254;
  return static_cast<uint8_t>(biased);
}

double e8m0_to_double(uint8_t e) {
  if (e == 255) return std::numeric_limits<double>::quiet_NaN();
  return std::ldexp(1.0, static_cast<int>(e) - 127);
}

double bf16_to_double(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double fp16_to_double(uint16_t bits) {
  const bool neg = bits & 0x8000;
  const int e = (bits >> 10) & 0x1F;
  const int m = bits & 0x3FF;
  double v;
  if (e == 31)
    v = m ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), -24);
  else
    v = std::ldexp(1.0 + m / 1024.0, e - 15);
  return neg ? -v : v;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

namespace {
// Round to nearest even with `mant_bits` explicit mantissa bits and smallest normal exponent
// `emin`; results above `max_finite` overflow to Inf.
double round_to_precision(double v, int mant_bits, int emin, double max_finite) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0) return v;
  const double a = std::fabs(v);
  int exp2;
  std::frexp(a, &exp2);
  const int e = std::max(exp2 - 1, emin);
  const double q = std::ldexp(1.0, e - mant_bits);
  const double n = a / q, fl = std::floor(n), frac = n - fl;
  const double k = (frac > 0.5 || (frac == 0.5 && std::fmod(fl, 2.0) != 0.0)) ? fl + 1.0 : fl;
  const double r = k * q > max_finite ? INFINITY : k * q;
  return std::copysign(r, v);
}
}  // namespace

uint16_t double_to_bf16(double v) {
  if (std::isnan(v)) return 0x7FC0;
  const float f = static_cast<float>(round_to_precision(v, 7, -126, 3.3895313892515355e38));  // exact
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t double_to_fp16(double v) {
  if (std::isnan(v)) return 0x7E00;
  const double r = round_to_precision(v, 10, -14, 65504.0);
  const uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(a / std::ldexp(1.0, -24));
  int exp2;
  std::frexp(a, &exp2);
  const int e = exp2 - 1;
  return sign | static_cast<uint16_t>(((e + 15) << 10) | static_cast<int>((a / std::ldexp(1.0, e) - 1.0) * 1024));
}

double load_as_double(const void* base, DType t, int64_t off) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(base)[off];
    case DType::kBFloat16: return bf16_to_double(static_cast<const uint16_t*>(base)[off]);
    default: return fp16_to_double(static_cast<const uint16_t*>(base)[off]);
  }
}

void store_from_double(void* base, DType t, int64_t off, double v) {
  switch (t) {
    case DType::kFloat32:  // one NaN pattern, 0x7FC00000, as the kernels write
      static_cast<float*>(base)[off] = std::isnan(v) ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(v);
      break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[off] = double_to_bf16(v); break;
    default: static_cast<uint16_t*>(base)[off] = double_to_fp16(v); break;
  }
}

}  // namespace mxmla::ref

namespace mxmla::detail {

namespace {

// Quantize one block of 32 (or fewer, at a tail) values; writes codes through `code_at`.
template <typename CodeAt>
uint8_t quantize_block(const double* v, int n, Fp8Format fmt, CodeAt code_at) {
  bool has_nan = false, has_inf = false;
  double amax = 0.0;
  for (int i = 0; i < n; ++i) {
    if (std::isnan(v[i])) has_nan = true;
    else if (std::isinf(v[i])) has_inf = true;
    else amax = std::fmax(amax, std::fabs(v[i]));
  }
  uint8_t e;
  double mult;
  if (has_nan) {
    e = 0xFF;  // (beyond) NaN block: scale NaN, every code NaN
    for (int i = 0; i < n; ++i) code_at(i) = 0x7F;
    return e;
  }
  if (has_inf) {
    e = 0xFE;  // (beyond) Inf block: scale 2^127, multiplier 2^-127, Inf saturates
    mult = std::ldexp(1.0, -127);
  } else {
    e = ref::e8m0_from_amax(amax, fmt);
    mult = (e == 0) ? 1.0 : std::ldexp(1.0, 127 - e);  // TE: e = 0 -> multiplier 1
  }
  for (int i = 0; i < n; ++i) code_at(i) = ref::round_to_fp8(v[i] * mult, fmt);
  return e;
}

void zero_padding(uint8_t* buf, int64_t bytes, int64_t blocks) {
  if (buf && bytes > blocks) std::memset(buf, 0, static_cast<size_t>(bytes));
}

}  // namespace

void quantize_cpu(const QuantizeProblem& p) {
  const int64_t nrb = ceil_div(p.rows, 32);
  double v[32];
  auto load = [&](int64_t bi, int64_t r, int64_t c) {
    const InputRef at = input_ref(p, bi, r, c);
    return ref::load_as_double(at.part == 0 ? p.in : p.gather.in1, p.in_dtype, at.offset);
  };
  if (p.row_codes) {
    zero_padding(p.row_scales, row_map_bytes(p.row_map), row_map_blocks(p.row_map));
    for (int64_t bi = 0; bi < p.batch; ++bi)
      for (int64_t r = 0; r < p.rows; ++r)
        for (int64_t kb = 0; kb < p.cols / 32; ++kb) {
          for (int i = 0; i < 32; ++i) v[i] = load(bi, r, kb * 32 + i);
          uint8_t* out = p.row_codes + (bi * p.rows + r) * p.cols + kb * 32;
          p.row_scales[row_scale_offset(p.row_map, bi, r, kb)] =
              quantize_block(v, 32, p.fmt, [&](int i) -> uint8_t& { return out[i]; });
        }
  }
  if (p.col_codes) {
    zero_padding(p.col_scales, col_map_bytes(p.col_map), col_map_blocks(p.col_map));
    for (int64_t bi = 0; bi < p.batch; ++bi)
      for (int64_t rb = 0; rb < nrb; ++rb) {
        const int n = static_cast<int>(std::min<int64_t>(32, p.rows - rb * 32));  // tail block: n < 32
        for (int64_t c = 0; c < p.cols; ++c) {
          for (int i = 0; i < n; ++i) v[i] = load(bi, rb * 32 + i, c);
          uint8_t* out = p.col_codes + (bi * p.rows + rb * 32) * p.cols + c;
          p.col_scales[col_scale_offset(p.col_map, bi, rb, c)] =
              quantize_block(v, n, p.fmt, [&](int i) -> uint8_t& { return out[i * p.cols]; });
        }
      }
  }
}

void dequantize_cpu(const DequantizeProblem& p) {
  const ScaleMap& m = p.map;
  for (int64_t bi = 0; bi < m.batch; ++bi)
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t c = 0; c < m.cols; ++c) {
        const int64_t idx = (bi * m.rows + r) * m.cols + c;
        const int64_t so = p.rowwise ? row_scale_offset(m, bi, r, c / 32) : col_scale_offset(m, bi, r / 32, c);
        const double val = ref::fp8_to_double(p.codes[idx], p.fmt) * ref::e8m0_to_double(p.scales[so]);
        // exact (SPEC §2: codes times powers of two); one NaN pattern, 0x7FC00000
        const float f = std::isnan(val) ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(val);
        if (p.out_dtype == DType::kFloat32)
          static_cast<float*>(p.out)[idx] = f;
        else
          static_cast<uint16_t*>(p.out)[idx] = ref::float_to_bf16(f);
      }
}

void remap_scales_cpu(const std::vector<RemapProblem>& jobs) {
  for (const RemapProblem& p : jobs) {
    const int64_t bytes = map_bytes(p.dst_map, p.rowwise);
    for (int64_t off = 0; off < bytes; ++off) {
      int64_t bi, a, b;
      p.dst[off] = offset_coords(p.dst_map, p.rowwise, off, bi, a, b)
                       ? p.src[scale_offset(p.src_map, p.rowwise, bi, a, b)]
                       : 0;
    }
  }
}

}  // namespace mxmla::detail
