// mxmla internal — small host helpers shared by the command-line tool and the tests:
// a deterministic random source, bf16 conversion, and (with CUDA) an owning device buffer.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/reference.h"

#if MXMLA_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#endif

namespace mxmla::util {

// splitmix64: deterministic across platforms.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  double normal() {
    const double u1 = uniform() + 1e-300, u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

inline uint16_t to_bf16(float f) { return ref::float_to_bf16(f); }  // round to nearest even

// Activation-like bf16 data: N(0, 1) per element times a per-row scale drawn log-uniformly
// over [2^-lo, 2^hi], so that blocks exercise many scale exponents.
inline std::vector<uint16_t> random_bf16(int64_t rows, int64_t cols, uint64_t seed, int lo = 8, int hi = 8) {
  Rng rng(seed);
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const double scale = std::ldexp(1.0, -lo + static_cast<int>(rng.uniform() * (lo + hi + 1)));
    for (int64_t c = 0; c < cols; ++c) v[r * cols + c] = to_bf16(static_cast<float>(rng.normal() * scale));
  }
  return v;
}

#if MXMLA_WITH_CUDA
// An owning device allocation.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n) MXMLA_CUDA_CHECK(cudaMalloc(&ptr, n));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr, o.bytes = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr), std::swap(bytes, o.bytes);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
  void upload(const void* src) { MXMLA_CUDA_CHECK(cudaMemcpy(ptr, src, bytes, cudaMemcpyHostToDevice)); }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> v(bytes / sizeof(T));
    MXMLA_CUDA_CHECK(cudaMemcpy(v.data(), ptr, bytes, cudaMemcpyDeviceToHost));
    return v;
  }
};
#endif

}  // namespace mxmla::util
