// mxmla — the MXFP8 GEMM for SM90 (sm_90a): the launcher of sm90_mxfp8_gemm.cuh. The kernel reads
// both operands K-major with F8_128x4-swizzled scales; an operand given the other way (a columnwise
// copy: dgrad's W, wgrad's dY and x) or with a row stride TMA cannot take is first repacked into a
// stream-ordered scratch buffer (codes transposed in 32 x 32 tiles; scales gathered into the swizzled
// rowwise layout of the transposed matrix). Instantiations: E4M3 and E5M2.
#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>

#include "common/gemm_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/sm90_mxfp8_gemm.cuh"
#include "cuda/stream_scratch.h"
#include "cuda/tma_desc.h"

namespace mxmla::detail {
namespace {

constexpr const char* kOp = "mxmla.gemm";

// dst [R, Kp] (K contiguous, zero beyond K) from src: [R, K] row-major (!trans) or [K, R] (trans),
// row stride ld. 32 x 32 byte tiles through shared memory.
__global__ void __launch_bounds__(256) repack_kmajor(const uint8_t* __restrict__ src, int64_t ld, bool trans,
                                                     uint8_t* __restrict__ dst, int64_t R, int64_t K, int64_t Kp) {
  __shared__ uint8_t t[32][33];
  const int64_t r0 = int64_t{blockIdx.y} * 32, k0 = int64_t{blockIdx.x} * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {  // load: rows of the source
    if (trans) {
      const int64_t k = k0 + i, r = r0 + threadIdx.x;
      t[i][threadIdx.x] = (k < K && r < R) ? src[k * ld + r] : uint8_t{0};
    } else {
      const int64_t r = r0 + i, k = k0 + threadIdx.x;
      t[threadIdx.x][i] = (k < K && r < R) ? src[r * ld + k] : uint8_t{0};
    }
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {  // store: rows of dst (t[k][r])
    const int64_t r = r0 + i, k = k0 + threadIdx.x;
    if (r < R && k < Kp) dst[r * Kp + k] = t[threadIdx.x][i];
  }
}

// The swizzled rowwise scales of op(X) = [R, K] (every padded byte written; padding zero) from the
// operand's scales as stored: rowwise of [R, K] (contract_cols) or columnwise of [K, R].
__global__ void __launch_bounds__(256) gather_scales(const uint8_t* __restrict__ src, ScaleMap map, bool contract_cols,
                                                     uint8_t* __restrict__ dst, int64_t R, int64_t kb_count,
                                                     int64_t rows_pad, int64_t cols_pad) {
  const int64_t n = rows_pad * cols_pad;
  const int64_t tiles_x = cols_pad / 4;
  for (int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < n; idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx / cols_pad, j = idx % cols_pad;
    uint8_t v = 0;
    if (i < R && j < kb_count) v = src[contract_cols ? row_scale_offset(map, 0, i, j) : col_scale_offset(map, 0, j, i)];
    dst[swizzle_offset(i, j, tiles_x)] = v;
  }
}

struct KMajor {
  const uint8_t* codes;
  int64_t ld;             // bytes
  const uint8_t* scales;  // swizzled rowwise, [round_up(R, 128), 4 * ceil(K / 128)]
};

// op(X) as the kernel reads it: [R, K] K-major codes and swizzled scales (scratch when needed).
KMajor kmajor(const GemmOperandView& v, int64_t R, int64_t K, cudaStream_t s, std::unique_ptr<StreamScratch>& codes,
              std::unique_ptr<StreamScratch>& scales) {
  KMajor out{static_cast<const uint8_t*>(v.data), v.ld, nullptr};
  const bool aligned = reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && v.ld % 16 == 0;
  if (!v.contract_cols || !aligned) {
    const int64_t Kp = (K + 15) / 16 * 16;
    codes = std::make_unique<StreamScratch>(R * Kp, s);
    const dim3 grid(static_cast<unsigned>((Kp + 31) / 32), static_cast<unsigned>((R + 31) / 32));
    repack_kmajor<<<grid, dim3(32, 8), 0, s>>>(static_cast<const uint8_t*>(v.data), v.ld, !v.contract_cols, codes->ptr,
                                                R, K, Kp);
    MXMLA_CUDA_CHECK(cudaGetLastError());
    out.codes = codes->ptr, out.ld = Kp;
  }
  const int64_t kb = (K + 31) / 32, rows_pad = (R + 127) / 128 * 128, cols_pad = (kb + 3) / 4 * 4;
  scales = std::make_unique<StreamScratch>(rows_pad * cols_pad, s);
  const int64_t n = rows_pad * cols_pad;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  gather_scales<<<blocks, 256, 0, s>>>(v.scales, v.map, v.contract_cols, scales->ptr, R, kb, rows_pad,
                                            cols_pad);
  MXMLA_CUDA_CHECK(cudaGetLastError());
  out.scales = scales->ptr;
  return out;
}

CUtensorMap operand_map(const KMajor& x, int64_t R, int64_t K) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(R)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(x.ld)};
  const cuuint32_t box[2] = {128, 128};
  return make_tma_desc(x.codes, DType::kUInt8, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

template <ptx::MmaDtype kFmt>
void launch(const CUtensorMap& ta, const CUtensorMap& tb, const mxgemm::Params& p, cudaStream_t s) {
  using K = mxgemm::Kernel;
  const void* kernel = reinterpret_cast<const void*>(&mxgemm::sm90_mxfp8_gemm_kernel<K, kFmt>);
  const KernelFit fit = kernel_fit(kernel, K::C::kThreads, K::kSmemBytes, K::kSmemBytes);
  const int grid = static_cast<int>(heuristics::persistent_grid(fit.resident(), p.num_tiles));
  mxgemm::sm90_mxfp8_gemm_kernel<K, kFmt><<<grid, K::C::kThreads, K::kSmemBytes, s>>>(ta, tb, p);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void mxfp8_gemm_cuda(const GemmProblem& pr, Stream stream) {
  if (!pr.fp8) throw Error(kOp, "a", "bf16 operands: the SM90 kernel takes MXFP8 operands");
  if (pr.M == 0 || pr.N == 0) return;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (pr.K == 0) {  // D = 0 (+ D)
    if (!pr.accumulate) {
      const int64_t esz = pr.out_t == DType::kFloat32 ? 4 : 2;
      MXMLA_CUDA_CHECK(cudaMemset2DAsync(pr.out, pr.ld_out * esz, 0, pr.N * esz, pr.M, s));
    }
    return;
  }
  std::unique_ptr<StreamScratch> ca, sa, cb, sb;
  const KMajor a = kmajor(pr.a, pr.M, pr.K, s, ca, sa);
  const KMajor b = kmajor(pr.b, pr.N, pr.K, s, cb, sb);
  mxgemm::Params p{};
  p.M = static_cast<int>(pr.M), p.N = static_cast<int>(pr.N), p.K = static_cast<int>(pr.K);
  p.kblocks = static_cast<int>((pr.K + 127) / 128);
  p.m_tiles = static_cast<int>((pr.M + 127) / 128), p.n_tiles = static_cast<int>((pr.N + 127) / 128);
  p.num_tiles = p.m_tiles * p.n_tiles;
  p.sa = a.scales, p.sb = b.scales, p.tiles_x = p.kblocks;
  p.out = pr.out, p.ld_out = pr.ld_out;
  p.out_f32 = pr.out_t == DType::kFloat32, p.accumulate = pr.accumulate;
  p.alpha = static_cast<float>(pr.alpha);
  const CUtensorMap ta = operand_map(a, pr.M, pr.K), tb = operand_map(b, pr.N, pr.K);
  if (pr.fmt == Fp8Format::kE4M3) launch<ptx::MmaDtype::kE4M3>(ta, tb, p, s);
  else launch<ptx::MmaDtype::kE5M2>(ta, tb, p, s);
}

}  // namespace mxmla::detail
