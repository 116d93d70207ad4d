// mxmla experiments — what the numbered experiment drivers share: a fused Q up-projection problem
// on the GPU (random inputs, the op's outputs), event timing with the L2 flushed before each call
// (medians), and cuBLAS's bf16 GEMM of the same shape as the same-run peer. Not part of the library.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "common/host_util.h"
#include "common/ops.h"
#include "common/qproj_ops.h"
#include "mxmla/qproj.h"
#include "tools/gpu_timer.h"

namespace mxmla::dev {

// Median milliseconds of `iters` calls of fn() after 3 warm-ups, each after a 256 MiB memset
// (the L2 holds none of the inputs): the command-line tool's timer.
template <typename Fn>
float time_ms(Fn&& fn, int iters = 30) {
  return tool::GpuTimer(iters).median_ms(fn);
}

// The fused Q up-projection of T tokens x NH heads (K = 1536, D = 192, one sequence, compact
// scales, both directions, fp32 YaRN-free tables), with its buffers.
struct QProjCase {
  int64_t T, NH, K = 1536, D = 192;
  util::DeviceBuffer x, w, cos, sin, row, rs, col, cs;
  MXFP8Tensor out;
  detail::QProjProblem p;

  static std::vector<float> table(int64_t T, bool sine) {
    std::vector<float> v(T * 64);
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < 64; ++j) {
        const double a = t * std::pow(10000.0, -2.0 * (j % 32) / 64);
        v[t * 64 + j] = static_cast<float>(sine ? std::sin(a) : std::cos(a));
      }
    return v;
  }
  static MXFP8Shapes shapes(int64_t T, int64_t NH) { return qproj_shapes(T, NH, QProjOptions{}); }

  QProjCase(int64_t tokens, int64_t heads)
      : T(tokens), NH(heads), x(T * K * 2), w(NH * D * K * 2), cos(T * 64 * 4), sin(T * 64 * 4),
        row(numel(shapes(T, NH).data)), rs(numel(shapes(T, NH).rowwise_scale)), col(numel(shapes(T, NH).data)),
        cs(numel(shapes(T, NH).columnwise_scale)) {
    const int64_t N = NH * D;
    x.upload(util::random_bf16(T, K, 1, 0, 0).data());
    std::vector<uint16_t> wh = util::random_bf16(N, K, 2, 0, 0);
    for (auto& v : wh) v = util::to_bf16(static_cast<float>(ref::bf16_to_double(v) / 40.0));  // ~N(0, 1/K)
    w.upload(wh.data());
    cos.upload(table(T, false).data()), sin.upload(table(T, true).data());
    QProjOptions o;
    const MXFP8Shapes sh = shapes(T, NH);
    const Device dev{DeviceType::kCUDA, 0};
    out.rowwise_data = TensorDesc(row.ptr, DType::kUInt8, sh.data, dev);
    out.rowwise_scale_inv = TensorDesc(rs.ptr, DType::kUInt8, sh.rowwise_scale, dev);
    out.columnwise_data = TensorDesc(col.ptr, DType::kUInt8, sh.data, dev);
    out.columnwise_scale_inv = TensorDesc(cs.ptr, DType::kUInt8, sh.columnwise_scale, dev);
    AttentionQuantizeOptions ao;
    ao.bhsd_scales = false;
    const detail::QuantizeProblem qp =
        detail::attention_outputs("dev", qproj_q_shape(T, NH, o), out, ao, dev);
    p.x = x.ptr, p.B = 1, p.S = T, p.K = K, p.x_st_b = T * K, p.x_st_s = K;
    p.w = w.ptr, p.w_st = K, p.NH = NH, p.D = D, p.R = 64;
    p.cos = cos.ptr, p.sin = sin.ptr, p.tab_t = DType::kFloat32, p.tab_st = 64;
    p.row_codes = qp.row_codes, p.row_scales = qp.row_scales, p.col_codes = qp.col_codes, p.col_scales = qp.col_scales;
    p.row_map = qp.row_map, p.col_map = qp.col_map;
  }
  double flops() const { return 2.0 * T * NH * D * K; }
};

// cuBLAS's bf16 GEMM of the same shape (C [T, N] bf16 = x W^T, fp32 accumulation): the peer.
struct CublasPeer {
  cublasHandle_t h{};
  util::DeviceBuffer c;
  explicit CublasPeer(const QProjCase& q) : c(q.T * q.NH * q.D * 2) {
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw CudaError("cublasCreate failed");
  }
  ~CublasPeer() { cublasDestroy(h); }
  void run(const QProjCase& q) {
    const float one = 1.f, zero = 0.f;
    const int m = int(q.NH * q.D), n = int(q.T), k = int(q.K);  // column-major: C^T [N, T] = W [N, K] . x^T
    if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, q.w.ptr, CUDA_R_16BF, k, q.x.ptr, CUDA_R_16BF, k, &zero,
                     c.ptr, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
      throw CudaError("cublasGemmEx failed");
  }
};

}  // namespace mxmla::dev
