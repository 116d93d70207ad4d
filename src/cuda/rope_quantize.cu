// mxmla — rope_backward_quantize: the launchers of the two kernels in rope_quantize.cuh (the generic
// one, and the fast path for bf16 DeepSeek-V3 query heads at one token stride, which it prefers).
#include "cuda/rope_quantize.cuh"

#include <algorithm>

#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/stream_scratch.h"
#include "cuda/tma_desc.h"

namespace mxmla::detail {
namespace {

using namespace ropeq;
using namespace rope_dev;

template <typename T, typename TT, bool kE4M3>
void launch(const RopeQuantizeParams& p, const int64_t* cu, int64_t ncu, cudaStream_t stream) {
  const int64_t tokens = p.rope.S * p.rope.B, tiles = ceil_div(tokens, kRows) * p.rope.H;
  if (tokens > 0x7FFFFFFF - kRows || tiles > 0x7FFFFFFF)
    throw Error("mxmla.rope_backward_quantize", "grad", "too many tokens or tiles for the 32-bit tile index");
  const size_t smem = smem_bytes<T>(p.rope.D, p.rope.R);
  const void* kernel = reinterpret_cast<const void*>(&rope_quantize_kernel<T, TT, kE4M3>);
  // Persistent grid: as many blocks as fit at this head geometry.
  const int64_t blocks =
      heuristics::persistent_grid(kernel_fit(kernel, kThreads, smem, smem_bytes<T>(kMaxD, kMaxD)).resident(), tiles);
  rope_quantize_kernel<T, TT, kE4M3><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, cu, ncu,
                                                                                              static_cast<int>(tiles));
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_table(const RopeQuantizeParams& p, const int64_t* cu, int64_t ncu, cudaStream_t s) {
  const bool e4m3 = p.fmt == Fp8Format::kE4M3;  // the format is a template argument: one cvt per code pair
  if (p.rope.tab_t == DType::kFloat32)
    e4m3 ? launch<T, float, true>(p, cu, ncu, s) : launch<T, float, false>(p, cu, ncu, s);
  else
    e4m3 ? launch<T, __nv_bfloat16, true>(p, cu, ncu, s) : launch<T, __nv_bfloat16, false>(p, cu, ncu, s);
}

}  // namespace

void rope_quantize_cuda(const RopeQuantizeParams& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  if (p.rope.S * p.rope.B * p.rope.H == 0) return;
  // Padding of swizzled scale buffers is zero (SPEC §2.1): the kernel writes real blocks only.
  if (p.row_codes && row_map_bytes(p.row_map) > row_map_blocks(p.row_map))
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.row_scales, 0, row_map_bytes(p.row_map), stream));
  if (p.col_codes && col_map_bytes(p.col_map) > col_map_blocks(p.col_map))
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.col_scales, 0, col_map_bytes(p.col_map), stream));
  DeviceCuSeqlens cu(p.rope.cu, stream, "mxmla.rope_backward_quantize");
  int64_t tok_stride = 0;
  if (p.rope.io_t == DType::kBFloat16 && p.rope.D == mla::kD && p.rope.R == mla::kR &&
      uniform_token_stride(p.rope, tok_stride)) {  // DeepSeek-V3 query heads: the fast path
    const bool e4m3 = p.fmt == Fp8Format::kE4M3, f32 = p.rope.tab_t == DType::kFloat32;
    if (f32) return e4m3 ? (void)launch_mla<float, true>(p, cu.ptr, cu.n, tok_stride, stream)
                         : (void)launch_mla<float, false>(p, cu.ptr, cu.n, tok_stride, stream);
    return e4m3 ? (void)launch_mla<__nv_bfloat16, true>(p, cu.ptr, cu.n, tok_stride, stream)
                : (void)launch_mla<__nv_bfloat16, false>(p, cu.ptr, cu.n, tok_stride, stream);
  }
  switch (p.rope.io_t) {
    case DType::kBFloat16: return dispatch_table<__nv_bfloat16>(p, cu.ptr, cu.n, stream);
    case DType::kFloat16: return dispatch_table<__half>(p, cu.ptr, cu.n, stream);
    default: return dispatch_table<float>(p, cu.ptr, cu.n, stream);
  }
}

bool rope_quantize_copies_cuda(const RopeQuantizeParams& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  int64_t tok_stride = 0;
  if (p.fmt != Fp8Format::kE4M3 || p.rope.io_t != DType::kBFloat16 || p.rope.D != mla::kD || p.rope.R != mla::kR ||
      !uniform_token_stride(p.rope, tok_stride))
    return false;
  if (p.row_codes != nullptr || p.col_codes != nullptr || p.dx != nullptr || p.inexact == nullptr)
    throw Error("mxmla.rope_backward_quantize", "copies", "take no codes and no dx copy, and need the inexact flags");
  if (p.rope.S * p.rope.B * p.rope.H == 0) return true;
  DeviceCuSeqlens cu(p.rope.cu, stream, "mxmla.rope_backward_quantize");
  if (p.rope.tab_t == DType::kFloat32) launch_mla<float, true, NoProbe, true>(p, cu.ptr, cu.n, tok_stride, stream);
  else launch_mla<__nv_bfloat16, true, NoProbe, true>(p, cu.ptr, cu.n, tok_stride, stream);
  return true;
}

}  // namespace mxmla::detail
