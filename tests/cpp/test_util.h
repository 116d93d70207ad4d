// Test helpers: input generation (random and adversarial), dtype encoding, running an op on the
// CPU reference and on the GPU with poisoned outputs, and GPU availability.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "common/host_util.h"
#include "mxmla/mxfp8.h"

namespace mxmla::test {

// True when this build has CUDA and a device is visible.
bool have_gpu();
#define MXMLA_REQUIRE_GPU()                                                                   \
  do {                                                                                         \
    if (!::mxmla::test::have_gpu())                                                            \
      GTEST_SKIP() << "no CUDA device visible (or a CPU-only build): GPU comparison skipped"; \
  } while (0)

// Sets (value) or unsets (nullptr) an environment variable for a scope, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) ::setenv(name_.c_str(), old_.c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

uint16_t float_to_fp16(float f);  // round to nearest even
// Encode fp32 values as `t` (bf16/fp16 round to nearest even).
std::vector<uint8_t> encode(const std::vector<float>& v, DType t);

enum class Data { kRandom, kAdversarial };
// rows x cols values; kAdversarial mixes, block by block: zero blocks, denormals, 448 / 449 and
// rounding midpoints relative to the block scale, NaN, +-Inf, -0, huge and tiny magnitudes.
std::vector<float> make_data(int64_t rows, int64_t cols, Data kind, uint64_t seed);

// The four output buffers of a quantization, host side, poisoned with 0xAB.
struct HostQ {
  std::vector<uint8_t> row, rs, col, cs;
  MXFP8Tensor t;
};
HostQ alloc_host(const MXFP8Shapes& s, bool rowwise, bool columnwise);

// Copy a host tensor's buffers to the GPU, run `fn` there and copy the results back.
// (Only with MXMLA_WITH_CUDA; declared always so tests compile in CPU-only builds.)
HostQ quantize_on_gpu(const std::vector<uint8_t>& input, const TensorDesc& in_host, const MXFP8Shapes& s,
                      bool rowwise, bool columnwise, bool attention, const QuantizeOptions& qo,
                      const AttentionQuantizeOptions& ao);

// Runs `fn`, which must throw mxmla::Error from `op` naming argument `arg`, its rule containing `rule`.
void expect_error(const std::string& op, const std::function<void()>& fn, const std::string& arg,
                  const std::string& rule);

std::string first_mismatch(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);

}  // namespace mxmla::test
