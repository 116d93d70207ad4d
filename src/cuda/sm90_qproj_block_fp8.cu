// mxmla — the fused Q up-projection on block-FP8 x and W for SM90 (sm_90a; include/mxmla/blockfp8.h):
// the bf16 op's kernel (cuda/sm90_qproj_rope_quant.cuh: producer, hand-off, RoPE + MXFP8 epilogue,
// scheduler) with the block-scaled FP8 mainloop (cuda/sm90/mainloop_tma_wgmma_block_scaled.cuh):
// x [128 x 128] and W [192 x 128] E4M3 tiles by TMA, m64n64k32 FP8 wgmmas per 64-column slice, the
// slice folded into the fp32 accumulators with x's per-token and W's per-block factors every 128
// of K. One instantiation per RoPE style (E4M3 q).
#include <cuda.h>  // CUtensorMap (types only)

#include "common/blockfp8_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/sm90_qproj_rope_quant.cuh"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {
namespace {

template <RopeStyle kStyle>
void launch(const CUtensorMap& tx, const CUtensorMap& tw, const qproj::Params& kp, cudaStream_t stream) {
  using Kernel = qproj::KernelBlockFp8<kStyle, true>;
  const void* kernel = reinterpret_cast<const void*>(&qproj::sm90_qproj_rope_quant_kernel<Kernel>);
  const int sms = kernel_fit(kernel, Kernel::kThreads, Kernel::kSmemBytes, Kernel::kSmemBytes).sms;
  const int grid = heuristics::balanced_grid(kp.sched.num_tiles, sms);
  qproj::sm90_qproj_rope_quant_kernel<Kernel><<<grid, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(tx, tw, kp);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void qproj_block_fp8_cuda(const QProjProblem& p, const BlockFp8Operands& b, Stream s) {
  if (p.B * p.S == 0) return;
  auto stream = reinterpret_cast<cudaStream_t>(s);
  if (p.row_scales != nullptr && p.row_map.mode != MapMode::kCompact)  // BHSD padding nobody else writes
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.row_scales, 0, row_map_bytes(p.row_map), stream));
  if (p.col_scales != nullptr && p.col_map.mode != MapMode::kCompact)
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.col_scales, 0, col_map_bytes(p.col_map), stream));
  StreamScratch scratch_w(0, stream);
  StreamScratch scratch_tab(p.tab_t == DType::kFloat32 ? 0 : 2 * p.S * qproj::Cfg::kR * 4, stream);  // fp32 tables
  CUtensorMap tx, tw;
  qproj::Params kp{};
  qproj_prepare(p, stream, scratch_w, scratch_tab, tx, tw, kp, true);
  kp.bf = qproj::BlockFactors{b.sx, b.sx_ld, b.sw, b.sw_ld};
  switch (p.style) {
    case RopeStyle::kInterleavedInHalvesOut: return launch<RopeStyle::kInterleavedInHalvesOut>(tx, tw, kp, stream);
    case RopeStyle::kInterleaved: return launch<RopeStyle::kInterleaved>(tx, tw, kp, stream);
    case RopeStyle::kRotateHalf: return launch<RopeStyle::kRotateHalf>(tx, tw, kp, stream);
  }
}

}  // namespace mxmla::detail
