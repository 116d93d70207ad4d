#include "test_util.h"

#include <cmath>
#include <cstring>
#include <sstream>

namespace mxmla::test {

bool have_gpu() { return build_info().cuda_enabled && cuda_device_count() > 0; }

uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = (u >> 16) & 0x8000;
  if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7E00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;  // rounds to Inf
  int e;
  std::frexp(a, &e);
  int ex = (a == 0) ? -14 : std::max(e - 1, -14);
  const double q = std::ldexp(1.0, ex - 10);
  double n = std::nearbyint(a / q);  // default rounding mode: to nearest even
  double r = n * q;
  if (r == 0) return sign;
  std::frexp(r, &e);
  ex = e - 1;
  if (ex < -14) return sign | static_cast<uint16_t>(r / std::ldexp(1.0, -24));
  return sign | static_cast<uint16_t>(((ex + 15) << 10) | static_cast<uint16_t>((r / std::ldexp(1.0, ex) - 1.0) * 1024));
}

std::vector<uint8_t> encode(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::kFloat32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else {
      const uint16_t h = t == DType::kBFloat16 ? util::to_bf16(v[i]) : float_to_fp16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

std::vector<float> make_data(int64_t rows, int64_t cols, Data kind, uint64_t seed) {
  util::Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (auto& x : v) x = static_cast<float>(rng.normal());
  if (kind == Data::kRandom) {
    for (int64_t r = 0; r < rows; ++r) {  // per-row magnitudes over many binades
      const float s = std::ldexp(1.0f, static_cast<int>(rng.uniform() * 24) - 12);
      for (int64_t c = 0; c < cols; ++c) v[r * cols + c] *= s;
    }
    return v;
  }
  // Adversarial: decide per 32x32 patch (so both directions see each pattern).
  const float kSpecial[] = {448.0f, 449.0f, 464.0f, 456.0f, 440.0f, 1.0625f, 1.1875f, 0.0f, -0.0f,
                            57344.0f, 61440.0f, 1.0f, std::ldexp(1.0f, -9), std::ldexp(1.5f, -9)};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float& x = v[r * cols + c];
      const uint64_t patch = ((r / 32) * 131 + (c / 32) * 17 + seed) % 11;
      const uint64_t h = rng.next();
      switch (patch) {
        case 0: x = 0.0f; break;                                                      // zero block
        case 1: x = std::ldexp(x, -130); break;                                       // fp32/bf16 denormals
        case 2: x = kSpecial[h % 14] * ((h >> 8) & 1 ? -1.0f : 1.0f); break;          // boundaries
        case 3: x = kSpecial[h % 14] * std::ldexp(1.0f, static_cast<int>(h >> 20) % 20 - 10); break;
        case 4: if (h % 97 == 0) x = NAN; break;                                      // sparse NaN
        case 5:  // sparse Inf among huge finite values: the Inf block's multiplier 2^-127 gives them nonzero codes
          x = h % 89 == 0 ? ((h & 1) ? INFINITY : -INFINITY) : std::ldexp(x, 125);
          break;
        case 6: x = std::ldexp(x, 100); break;                                        // huge
        case 7: x = std::ldexp(x, -100); break;                                       // tiny normal
        case 8: x = std::ldexp(1.0f, static_cast<int>(h % 16) - 8) * ((h >> 5) & 1 ? 1.f : -1.f); break;  // powers of 2
        default: break;                                                               // plain N(0,1)
      }
    }
  return v;
}


HostQ alloc_host(const MXFP8Shapes& s, bool rowwise, bool columnwise) {
  HostQ h;
  if (rowwise) {
    h.row.assign(numel(s.data), 0xAB);
    h.rs.assign(numel(s.rowwise_scale), 0xAB);
    h.t.rowwise_data = TensorDesc(h.row.data(), DType::kUInt8, s.data);
    h.t.rowwise_scale_inv = TensorDesc(h.rs.data(), DType::kUInt8, s.rowwise_scale);
  }
  if (columnwise) {
    h.col.assign(numel(s.data), 0xAB);
    h.cs.assign(numel(s.columnwise_scale), 0xAB);
    h.t.columnwise_data = TensorDesc(h.col.data(), DType::kUInt8, s.data);
    h.t.columnwise_scale_inv = TensorDesc(h.cs.data(), DType::kUInt8, s.columnwise_scale);
  }
  return h;
}

HostQ quantize_on_gpu(const std::vector<uint8_t>& input, const TensorDesc& in_host, const MXFP8Shapes& s,
                      bool rowwise, bool columnwise, bool attention, const QuantizeOptions& qo,
                      const AttentionQuantizeOptions& ao) {
  HostQ h = alloc_host(s, rowwise, columnwise);
#if MXMLA_WITH_CUDA
  const Device dev{DeviceType::kCUDA, 0};
  util::DeviceBuffer din(input.size()), drow(h.row.size()), drs(h.rs.size()), dcol(h.col.size()), dcs(h.cs.size());
  din.upload(input.data());
  MXFP8Tensor t;
  if (rowwise) {
    drow.upload(h.row.data()), drs.upload(h.rs.data());  // poison
    t.rowwise_data = TensorDesc(drow.ptr, DType::kUInt8, s.data, dev);
    t.rowwise_scale_inv = TensorDesc(drs.ptr, DType::kUInt8, s.rowwise_scale, dev);
  }
  if (columnwise) {
    dcol.upload(h.col.data()), dcs.upload(h.cs.data());
    t.columnwise_data = TensorDesc(dcol.ptr, DType::kUInt8, s.data, dev);
    t.columnwise_scale_inv = TensorDesc(dcs.ptr, DType::kUInt8, s.columnwise_scale, dev);
  }
  TensorDesc in = in_host;
  in.data = static_cast<uint8_t*>(din.ptr) + (static_cast<const uint8_t*>(in_host.data) - input.data());
  in.device = dev;
  if (attention) quantize_attention(in, t, ao);
  else quantize(in, t, qo);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  if (rowwise) h.row = drow.download<uint8_t>(), h.rs = drs.download<uint8_t>();
  if (columnwise) h.col = dcol.download<uint8_t>(), h.cs = dcs.download<uint8_t>();
#else
  (void)input, (void)in_host, (void)attention, (void)qo, (void)ao;
  ADD_FAILURE() << "quantize_on_gpu called in a CPU-only build";
#endif
  return h;
}

std::string first_mismatch(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return "sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  size_t n = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      if (!n) first = i;
      ++n;
    }
  if (!n) return "";
  std::ostringstream o;
  o << n << " of " << a.size() << " bytes differ; first at " << first << ": 0x" << std::hex << int(a[first])
    << " vs 0x" << int(b[first]);
  return o.str();
}

void expect_error(const std::string& op, const std::function<void()>& fn, const std::string& arg,
                  const std::string& rule) {
  try {
    fn();
    ADD_FAILURE() << "no error (expected argument '" << arg << "': " << rule << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), op) << e.what();
    EXPECT_EQ(e.arg(), arg) << e.what();
    EXPECT_NE(e.rule().find(rule), std::string::npos) << e.what();
  }
}

}  // namespace mxmla::test
