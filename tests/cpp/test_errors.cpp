// Bad input: every rule violation is an mxmla::Error naming the argument and the rule.
#include <gtest/gtest.h>

#include <functional>

#include "test_util.h"

namespace mxmla {
namespace {

// Expect `fn` to throw mxmla::Error whose message contains `arg` and `rule`.
void expect_error(const std::function<void()>& fn, const std::string& arg, const std::string& rule) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown (expected '" << arg << "': " << rule << ")";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'" + arg + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(rule), std::string::npos) << msg;
  }
}

struct Fixture {
  std::vector<uint16_t> x = std::vector<uint16_t>(64 * 96, 0x3F80);
  MXFP8Shapes s = quantize_shapes({64, 96}, false);
  test::HostQ q = test::alloc_host(s, true, true);
  TensorDesc in{x.data(), DType::kBFloat16, {64, 96}};
};

TEST(Errors, Quantize) {
  Fixture f;
  QuantizeOptions o;
  auto run = [&](TensorDesc in) { return [&, in] { quantize(in, f.q.t, o); }; };
  expect_error(run(TensorDesc(f.x.data(), DType::kUInt8, {64, 96})), "input", "dtype uint8 is not supported");
  expect_error(run(TensorDesc(f.x.data(), DType::kBFloat16, {64, 100})), "input", "multiple of 32");
  expect_error(run(TensorDesc(f.x.data(), DType::kBFloat16, {96, 0})), "input", "multiple of 32");
  expect_error(run(TensorDesc(nullptr, DType::kBFloat16, {64, 96})), "input", "null");
  expect_error(run(TensorDesc(f.x.data(), DType::kBFloat16, {96, 64}, Device{}, {1, 96})), "input", "contiguous");
  expect_error(run(TensorDesc(f.x.data(), DType::kBFloat16, {2, 2, 32}, Device{}, {96, 32, 1})), "input",
               "collapse to one row stride");
  expect_error(run(TensorDesc(f.x.data(), DType::kBFloat16, {64, 96}, Device{}, {1})), "input", "strides");
  expect_error(run(TensorDesc(f.x.data(), DType::kBFloat16, {})), "input", "at least one dimension");
  // outputs
  expect_error([&] {
    MXFP8Tensor t = f.q.t;
    t.rowwise_data.shape = {64, 64};
    quantize(f.in, t, o);
  }, "rowwise_data", "must be [64, 96]");
  expect_error([&] {
    MXFP8Tensor t = f.q.t;
    t.columnwise_scale_inv.shape = {64, 3};
    quantize(f.in, t, o);
  }, "columnwise_scale_inv", "must be [2, 96]");
  expect_error([&] {
    MXFP8Tensor t = f.q.t;
    t.rowwise_data.dtype = DType::kFloat8E5M2;
    quantize(f.in, t, o);
  }, "rowwise_data", "must be uint8 or float8_e4m3");
  expect_error([&] {
    MXFP8Tensor t = f.q.t;
    t.rowwise_scale_inv.data = nullptr;
    quantize(f.in, t, o);
  }, "rowwise_scale_inv", "null");
  expect_error([&] {
    MXFP8Tensor t = f.q.t;
    t.columnwise_data.device = Device{DeviceType::kCUDA, 0};
    quantize(f.in, t, o);
  }, "columnwise_data", "the input is on cpu");
  expect_error([&] {
    QuantizeOptions none;
    none.rowwise = none.columnwise = false;
    quantize(f.in, f.q.t, none);
  }, "options", "at least one");
  expect_error([&] {
    QuantizeOptions swz;
    swz.swizzle = true;  // outputs are compact-sized
    quantize(f.in, f.q.t, swz);
  }, "rowwise_scale_inv", "must be [128, 4]");
}

TEST(Errors, AttentionAndScales) {
  std::vector<uint16_t> x(4 * 2 * 3 * 64, 0);
  AttentionQuantizeOptions o;
  const MXFP8Shapes s = attention_shapes({4, 2, 3, 64}, QKVLayout::kSBHD, true);
  test::HostQ q = test::alloc_host(s, true, true);
  expect_error([&] { quantize_attention(TensorDesc(x.data(), DType::kBFloat16, {8, 3, 64}), q.t, o); }, "input",
               "must be 4-D");
  expect_error([&] { attention_shapes({4, 2, 3, 48}, QKVLayout::kSBHD, true); }, "shape", "multiple of 32");
  expect_error([&] { attention_shapes({4, 32}, QKVLayout::kSBHD, true); }, "shape", "must be 4-D");
  expect_error([&] { attention_shapes({4, 32}, QKVLayout::kBSHD, false); }, "shape", "must be 4-D");
  expect_error([&] {
    quantize_attention(TensorDesc(x.data(), DType::kBFloat16, {4, 2, 3, 64}, Device{}, {384, 192, 1, 3}), q.t, o);
  }, "input", "contiguous");
  std::vector<uint8_t> a(100), b(100);
  expect_error([&] {
    TensorDesc c(a.data(), DType::kUInt8, {10, 10}), d(b.data(), DType::kUInt8, {10, 10});
    swizzle_scales(c, d, 10, 100, true);
  }, "K", "multiple of 32");
  expect_error([&] {
    TensorDesc c(a.data(), DType::kUInt8, {10, 1}), d(b.data(), DType::kUInt8, {10, 10});
    swizzle_scales(c, d, 10, 32, true);
  }, "swizzled", "must be [128, 4]");
  expect_error([&] {
    TensorDesc c(a.data(), DType::kFloat32, {10, 1}), d(b.data(), DType::kUInt8, {128, 4});
    swizzle_scales(c, d, 10, 32, true);
  }, "compact", "dtype float32 must be uint8 or e8m0");
}

TEST(Errors, Dequantize) {
  Fixture f;
  quantize(f.in, f.q.t, QuantizeOptions{});
  std::vector<float> out(64 * 96);
  TensorDesc od(out.data(), DType::kFloat32, {64, 96});
  expect_error([&] {
    TensorDesc bad(out.data(), DType::kFloat16, {64, 96});
    dequantize(f.q.t, bad);
  }, "output", "must be float32 or bfloat16");
  expect_error([&] {
    TensorDesc bad(out.data(), DType::kFloat32, {64, 64});
    dequantize(f.q.t, bad);
  }, "output", "must be [64, 96]");
  expect_error([&] {
    MXFP8Tensor t = f.q.t;
    t.columnwise_data.data = nullptr;
    dequantize(t, od, true);
  }, "columnwise_data", "absent");
}

TEST(Errors, CudaPointersAreChecked) {
  // A host pointer described as CUDA memory is rejected before any kernel runs (CPU-only builds
  // reject every CUDA descriptor).
  Fixture f;
  const Device cuda{DeviceType::kCUDA, 0};
  TensorDesc in(f.x.data(), DType::kBFloat16, {64, 96}, cuda);
  MXFP8Tensor t = f.q.t;
  for (TensorDesc* d : {&t.rowwise_data, &t.rowwise_scale_inv, &t.columnwise_data, &t.columnwise_scale_inv})
    d->device = cuda;
  EXPECT_THROW(quantize(in, t, QuantizeOptions{}), Error);
}

#if MXMLA_WITH_CUDA
TEST(Errors, CudaAlignmentAndDevice) {
  MXMLA_REQUIRE_GPU();
  const Device cuda{DeviceType::kCUDA, 0};
  util::DeviceBuffer buf(64 * 128 * 2 + 64), out(64 * 96 * 4);
  const MXFP8Shapes s = quantize_shapes({64, 96}, false);
  MXFP8Tensor t;
  t.rowwise_data = TensorDesc(out.ptr, DType::kUInt8, s.data, cuda);
  t.rowwise_scale_inv = TensorDesc(out.as<uint8_t>() + 64 * 96, DType::kUInt8, s.rowwise_scale, cuda);
  QuantizeOptions o;
  o.columnwise = false;
  expect_error([&] { quantize(TensorDesc(buf.as<uint8_t>() + 2, DType::kBFloat16, {64, 96}, cuda), t, o); }, "input",
               "16-byte aligned");
  expect_error([&] {
    quantize(TensorDesc(buf.ptr, DType::kBFloat16, {64, 96}, cuda, {100, 1}), t, o);
  }, "input", "multiples of 16 bytes");
  expect_error([&] { quantize(TensorDesc(buf.ptr, DType::kBFloat16, {64, 96}, Device{DeviceType::kCUDA, 64}), t, o); },
               "input", "CUDA device");
  MXFP8Tensor bad = t;
  bad.rowwise_data.data = out.as<uint8_t>() + 8;
  expect_error([&] { quantize(TensorDesc(buf.ptr, DType::kBFloat16, {64, 96}, cuda), bad, o); }, "rowwise_data",
               "16-byte aligned");
}
#endif

}  // namespace
}  // namespace mxmla
