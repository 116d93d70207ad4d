// The GEMM experiments' inputs (06, 07), made on the device from a hash of the index: E4M3 codes
// (never NaN), E8M0 scale bytes 120 .. 134 (every dequantized value exact in bf16), bf16 values;
// A dequantized to bf16 for the peers; one shape's operands, tensor maps and peers (GemmCase); and a
// CUDA error check that ends the driver.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "common/mxfp8_common.h"  // swizzle_offset (the F8_128x4 scale layout), e8m0_factor
#include "cpu/reference.h"        // bf16_to_double
#include "cuda/numerics.cuh"
#include "cuda/sm90_bf16_gemm.cuh"    // design C's bf16 GEMM kernel
#include "cuda/sm90_mxfp8_gemm.cuh"  // Params
#include "cuda/tma_desc.h"
#include "dev/cuda/dev_util.h"

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

// max |got - want| / max |want| over a sample of two bf16 [M][N] outputs: every 7th row, all columns.
inline double sampled_rel_diff(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int64_t M,
                               int64_t N) {
  double maxdiff = 0, maxwant = 0;
  for (int64_t m = 0; m < M; m += 7)
    for (int64_t n = 0; n < N; ++n) {
      const double x = ref::bf16_to_double(got[m * N + n]), y = ref::bf16_to_double(want[m * N + n]);
      maxdiff = std::max(maxdiff, std::fabs(x - y)), maxwant = std::max(maxwant, std::fabs(y));
    }
  return maxdiff / (maxwant + 1e-30);
}

// The shapes a driver runs: `full`, or with argv[2] == "small" one 1000 x 512 x 1024 case (a tail in
// M) for compute-sanitizer.
struct GemmShape {
  const char* name;
  int64_t M, N, K;
};
inline std::vector<GemmShape> gemm_shapes(int argc, char** argv, std::initializer_list<GemmShape> full) {
  if (argc > 2 && std::string(argv[2]) == "small") return {{"small", 1000, 512, 1024}};
  return full;
}

// One shape's operands on the device: A's E4M3 codes [M][K] with F8_128x4 scales, B bf16 [N][K],
// A dequantized to bf16 [M][K]; A's codes' tensor map (box [128 rows][64 B], 64-byte swizzle) and
// B's (box [256 rows][64], 128-byte swizzle); the unsplit 128 x 256 problem (the caller sets out);
// and the peers on the dequantized operands: cuBLAS's bf16 GEMM into dref, design C's GEMM kernel
// launched as the library launches it unsplit (TMA store) into dlib.
struct GemmCase {
  int64_t M, N, K, tiles_x, mpad;
  util::DeviceBuffer codes, scales, b, adeq, dref, dlib;
  CUtensorMap ta{}, tb{}, cta{}, cto{};
  detail::mxgemm::Params p{};

  GemmCase(int64_t m, int64_t n, int64_t k)
      : M(m), N(n), K(k), tiles_x((k + 127) / 128), mpad((m + 127) / 128 * 128), codes(m * k),
        scales(mpad / 128 * tiles_x * 512), b(n * k * 2), adeq(m * k * 2), dref(m * n * 2), dlib(m * n * 2) {
    fill_codes<<<1024, 256>>>(codes.as<uint8_t>(), M * K, 1);
    fill_scales<<<256, 256>>>(scales.as<uint8_t>(), mpad / 128 * tiles_x * 512, 2);
    fill_bf16<<<1024, 256>>>(b.as<uint16_t>(), N * K, 3);
    dequant_a<<<1024, 256>>>(codes.as<uint8_t>(), scales.as<uint8_t>(), adeq.as<uint16_t>(), M, K, tiles_x);
    check_cuda(cudaDeviceSynchronize(), "inputs");
    const cuuint64_t adims[2] = {cuuint64_t(K), cuuint64_t(M)}, ast[1] = {cuuint64_t(K)};
    const cuuint32_t abox[2] = {64, 128};
    ta = detail::make_tma_desc(codes.ptr, DType::kUInt8, 2, adims, ast, abox, CU_TENSOR_MAP_SWIZZLE_64B);
    tb = bf16_map(b.ptr, N, 256);
    cta = bf16_map(adeq.ptr, M, 128);
    const cuuint64_t odims[2] = {cuuint64_t(N), cuuint64_t(M)}, ost[1] = {cuuint64_t(N * 2)};
    const cuuint32_t obox[2] = {64, 64};
    cto = detail::make_tma_desc(dlib.ptr, DType::kBFloat16, 2, odims, ost, obox, CU_TENSOR_MAP_SWIZZLE_128B);
    p.M = int(M), p.N = int(N), p.K = int(K), p.kblocks = int(K / 64);
    p.m_tiles = int(mpad / 128), p.n_tiles = int((N + 255) / 256), p.num_tiles = p.m_tiles * p.n_tiles;
    p.sa = scales.as<const uint8_t>(), p.tiles_x = tiles_x;
    p.ld_out = N, p.out_f32 = false, p.accumulate = false, p.alpha = 1.f;
    p.design_flag = nullptr, p.k_splits = 1, p.kb_per_split = p.kblocks, p.check_flag = nullptr;
  }
  // a bf16 [rows][K] operand's map: box [box_rows][64], 128-byte swizzle
  CUtensorMap bf16_map(void* x, int64_t rows, uint32_t box_rows) const {
    const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(rows)}, st[1] = {cuuint64_t(K * 2)};
    const cuuint32_t box[2] = {64, box_rows};
    return detail::make_tma_desc(x, DType::kBFloat16, 2, dims, st, box, CU_TENSOR_MAP_SWIZZLE_128B);
  }
  void cublas(cublasHandle_t h) const {  // column-major: D^T [N, M] = B [N, K] . deq(A)^T
    const float one = 1.f, zero = 0.f;
    if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &one, b.ptr, CUDA_R_16BF, int(K), adeq.ptr,
                     CUDA_R_16BF, int(K), &zero, dref.ptr, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      std::fprintf(stderr, "cublasGemmEx failed\n");
  }
  void design_c(int sms) const {
    using CK = detail::mxgemm_c::Kernel;
    static const bool attr = (check_cuda(cudaFuncSetAttribute(detail::mxgemm_c::sm90_bf16_gemm_kernel<CK>,
                                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                              int(CK::kSmemBytes)),
                                         "smem attribute (design C)"),
                              true);
    (void)attr;
    detail::mxgemm::Params pc = p;
    pc.out = dlib.ptr, pc.tma_out = N * 2 % 16 == 0, pc.run_on_flag = false;
    detail::mxgemm_c::sm90_bf16_gemm_kernel<CK><<<std::min(pc.num_tiles, sms), CK::C::kThreads, CK::kSmemBytes>>>(
        cta, tb, cto, pc);
  }
};

}  // namespace mxmla::dev
