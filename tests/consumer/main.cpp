// Quantizes a small CPU tensor through the installed mxmla and checks a few values: what a C++
// user of find_package(mxmla) writes. Exit status 0 when every check holds.
#include <cstdint>
#include <cstdio>
#include <vector>

#include <mxmla/mxfp8.h>

int main() {
  using namespace mxmla;
  // x [2, 32] fp32: row 0 is 0, 1, ..., 31 (amax 31), row 1 is 448 at column 0 and zeros elsewhere
  std::vector<float> x(64, 0.0f);
  for (int i = 0; i < 32; ++i) x[i] = float(i);
  x[32] = 448.0f;
  const std::vector<int64_t> shape = {2, 32};

  const MXFP8Shapes s = quantize_shapes(shape, /*swizzle=*/false);  // codes [2, 32], scales [2, 1]
  std::vector<uint8_t> codes(numel(s.data)), scales(numel(s.rowwise_scale));
  MXFP8Tensor q;
  q.shape = shape;
  q.rowwise_data = TensorDesc(codes.data(), DType::kUInt8, s.data);
  q.rowwise_scale_inv = TensorDesc(scales.data(), DType::kUInt8, s.rowwise_scale);
  QuantizeOptions opts;
  opts.columnwise = false;
  try {
    quantize(TensorDesc(x.data(), DType::kFloat32, shape), q, opts);
  } catch (const Error& e) {
    std::printf("consumer: quantize failed: %s\n", e.what());
    return 1;
  }
  // SPEC §2: e = float_to_e8m0(amax / 448) rounded up: 31/448 -> 2^-3 (e 124); 448/448 -> 1 (e 127).
  // Codes: 31 * 2^3 = 248 lies halfway between the E4M3 values 240 and 256; ties to even gives 256
  // (0x78), so 31 comes back as 32. 448 * 2^0 = 448 is E4M3's largest value (0x7E); 1 * 2^3 = 8 is exact.
  std::vector<float> back(64);
  TensorDesc out(back.data(), DType::kFloat32, shape);
  dequantize(q, out);
  const BuildInfo b = build_info();
  const bool ok = scales[0] == 124 && scales[1] == 127 && codes[31] == 0x78 && codes[32] == 0x7E && back[31] == 32.0f &&
                  back[32] == 448.0f && back[1] == 1.0f;
  std::printf("consumer: mxmla %s (CUDA kernels %s): scales %d %d, codes 0x%02X 0x%02X, dequantized %g %g: %s\n",
              b.version, b.cuda_enabled ? "on" : "off", scales[0], scales[1], codes[31], codes[32], back[31], back[32],
              ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
