// The GEMM experiments' inputs (06, 07), made on the device from a hash of the index: E4M3 codes
// (never NaN), E8M0 scale bytes 120 .. 134 (every dequantized value exact in bf16), bf16 values;
// A dequantized to bf16 for the peers; and a CUDA error check that ends the driver.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cuda/numerics.cuh"
#include "common/mxfp8_common.h"  // swizzle_offset (the F8_128x4 scale layout), e8m0_factor

namespace mxmla::dev {

__device__ __forceinline__ uint32_t hash32(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 29;
  return static_cast<uint32_t>(x >> 16);
}
// a random E4M3 code, never NaN (0x7F, 0xFF)
__device__ __forceinline__ uint32_t e4m3_code(uint64_t i, uint32_t seed) {
  const uint32_t v = hash32(i, seed) & 0xFFu;
  return (v & 0x7Fu) == 0x7Fu ? v ^ 1u : v;
}
__global__ void fill_codes(uint8_t* c, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    c[i] = static_cast<uint8_t>(e4m3_code(i, seed));
}
__global__ void fill_scales(uint8_t* s, int64_t n, uint32_t seed) {  // 120 .. 134
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    s[i] = static_cast<uint8_t>(120 + hash32(i, seed) % 15);
}
__global__ void fill_bf16(uint16_t* b, int64_t n, uint32_t seed) {  // a random E4M3 value / 64, as bf16
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    b[i] = static_cast<uint16_t>(detail::dequant_pair<true>(e4m3_code(i, seed), 0x1p-6f) & 0xFFFFu);
}
// A dequantized to bf16 [M][K] (the peers' operand)
__global__ void dequant_a(const uint8_t* c, const uint8_t* s, uint16_t* a, int64_t M, int64_t K, int64_t tiles_x) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < M * K; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / K, k = e % K;
    const uint8_t sb = s[detail::swizzle_offset(r, k / 32, tiles_x)];
    a[e] = static_cast<uint16_t>(detail::dequant_pair<true>(c[e], detail::e8m0_factor(sb)) & 0xFFFFu);
  }
}

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace mxmla::dev
