// mxmla — the fused Q up-projection for SM90 (sm_90a): GEMM (bf16 wgmma, fp32 accumulation) + RoPE +
// MXFP8 quantization (SPEC §4, include/mxmla/qproj.h), one persistent warp-specialized kernel built
// from the SM90 parts:
//   mainloop   cuda/sm90/mainloop_tma_wgmma.cuh: one producer thread streams x [128 x 64] and
//              W [192 x 64] bf16 tiles by TMA into a 4-stage ring; two MMA warpgroups run
//              m64n192k16 wgmmas on 64 rows each;
//   hand-off   the MMA warpgroups round their accumulators to bf16 into a shared tile
//              (EpilogueRopeMxfp8::store_accumulators) and go straight on to the next tile;
//   epilogue   cuda/sm90/epilogue_rope_mxfp8.cuh: 7 warps take the tile while the next one is
//              multiplied: RoPE in fp32, rowwise and columnwise MXFP8, the optional bf16 q. q never
//              passes through global memory as bf16 unless asked for;
//   scheduler  cuda/tile_scheduler.h: static persistent; tile = (sequence, 128 tokens, one
//              head): BN equals the head dim, so every RoPE partner, every rowwise block and every
//              32-token columnwise block is inside one tile. Tiles run in groups of kGroupM token
//              tiles x all heads (x tiles stay in L2 while W streams); every role walks the same
//              sequence. The grid: cuda/heuristics.h (balanced_grid).
// The rope style and the FP8 format are compile-time (6 instantiations). Probes (timelines,
// alternative epilogues for the floor) are experiments: dev/cuda/.
#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_bf16.h>

#include "common/qproj_ops.h"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/mxfp8_bf16_operands.h"
#include "cuda/numerics.cuh"
#include "cuda/sm90_qproj_rope_quant.cuh"
#include "cuda/stream_scratch.h"
#include "cuda/tma_desc.h"

namespace mxmla::detail {
namespace {

// ---------------------------------------------------------------- W given as [K, N]
// The kernel reads W K-major ([N, K], the TMA box of one head). A [K, N] weight is first transposed
// into a stream-ordered scratch buffer (one extra read + write of W: ~2 % of the op at T 16384,
// NH 128). 32 x 32 tiles through shared memory; dst [N, K] contiguous.
// Grid (ceil(N / 32), min(ceil(K / 32), 65535)): a block walks the 32 x 32 tiles of its 32 columns of
// N, gridDim.y tiles of K apart (K may take more tiles than a grid's y).
__global__ void __launch_bounds__(256) transpose_kn_to_nk(const uint16_t* __restrict__ src, int64_t src_st,
                                                          uint16_t* __restrict__ dst, int64_t K, int64_t N) {
  __shared__ uint16_t t[32][33];
  const int64_t n0 = int64_t{blockIdx.x} * 32;
  for (int64_t k0 = int64_t{blockIdx.y} * 32; k0 < K; k0 += int64_t{gridDim.y} * 32) {
    for (int i = threadIdx.y; i < 32; i += 8) {
      const int64_t k = k0 + i, n = n0 + threadIdx.x;
      if (k < K && n < N) t[i][threadIdx.x] = src[k * src_st + n];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8) {
      const int64_t n = n0 + i, k = k0 + threadIdx.x;
      if (k < K && n < N) dst[n * K + k] = t[threadIdx.x][i];
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- bf16 tables
// Rows [0, rows) of bf16 cos / sin (row stride st elements) widened to fp32 (exact) into dst:
// [2][rows][R] (cos, then sin), so that the epilogue has one table type to load.
__global__ void __launch_bounds__(256) widen_tables(const uint16_t* __restrict__ c, const uint16_t* __restrict__ sn,
                                                    int64_t st, float* __restrict__ dst, int64_t rows) {
  constexpr int kR = qproj::Cfg::kR;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= rows * kR) return;
  const int64_t off = (i / kR) * st + i % kR;
  dst[i] = bf16_lo(c[off]);
  dst[rows * kR + i] = bf16_lo(sn[off]);
}

template <RopeStyle kStyle, bool kE4M3, bool kExact = false>
void launch_one(const CUtensorMap& tx, const CUtensorMap& tw, const qproj::Params& kp, cudaStream_t stream) {
  using Kernel = qproj::Kernel<kStyle, kE4M3, sm90::EpilogueRopeMxfp8<qproj::Cfg::kD, qproj::Cfg::kR, qproj::Cfg::kBM, kStyle, kE4M3>,
                               NoProbe, kExact>;
  const void* kernel = reinterpret_cast<const void*>(&qproj::sm90_qproj_rope_quant_kernel<Kernel>);
  const int sms = kernel_fit(kernel, Kernel::kThreads, Kernel::kSmemBytes, Kernel::kSmemBytes).sms;
  const int grid = heuristics::balanced_grid(kp.sched.num_tiles, sms);
  qproj::sm90_qproj_rope_quant_kernel<Kernel><<<grid, Kernel::kThreads, Kernel::kSmemBytes, stream>>>(tx, tw, kp);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}
// The wgmma kernel; with MXFP8 inputs (kp.ex.flag set) also its exact fallback, of which the flag
// lets one run (the other returns at once).
template <RopeStyle kStyle, bool kE4M3>
void launch(const CUtensorMap& tx, const CUtensorMap& tw, const qproj::Params& kp, cudaStream_t stream) {
  launch_one<kStyle, kE4M3>(tx, tw, kp, stream);
  if (kp.ex.flag != nullptr) launch_one<kStyle, kE4M3, true>(tx, tw, kp, stream);
}

}  // namespace

bool qproj_cuda_supports(int64_t D, int64_t R) { return D == qproj::Cfg::kD && R == qproj::Cfg::kR; }

// The kernel's inputs for problem p: tensor maps of x and W (W transposed into `scratch_w` first
// when given as [K, N]) and the parameters, with bf16 tables widened into `scratch_tab`.
void qproj_prepare(const QProjProblem& p, cudaStream_t stream, StreamScratch& scratch_w, StreamScratch& scratch_tab,
                   CUtensorMap& tx, CUtensorMap& tw, qproj::Params& kp, bool fp8) {
  using Cfg = qproj::Cfg;
  // x: {K, B, S} (sbhd) or {K, S, B} (bshd), box {kBK, 1, 128} / {kBK, 128, 1}: 128 bytes of K (64
  // bf16 values, or 128 E4M3 codes)
  const int64_t es = fp8 ? 1 : 2;
  const DType et = fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  const cuuint32_t bk = cuuint32_t(128 / es);
  cuuint64_t xd[3], xs[2];
  cuuint32_t xb[3];
  xd[0] = p.K, xb[0] = bk;
  const int64_t st_b = p.B > 1 ? p.x_st_b : p.x_st_s * p.S;  // any legal stride when there is one sequence
  if (p.sbhd) xd[1] = p.B, xd[2] = p.S, xs[0] = st_b * es, xs[1] = p.x_st_s * es, xb[1] = 1, xb[2] = Cfg::kBM;
  else xd[1] = p.S, xd[2] = p.B, xs[0] = p.x_st_s * es, xs[1] = st_b * es, xb[1] = Cfg::kBM, xb[2] = 1;
  tx = make_tma_desc(p.x, et, 3, xd, xs, xb, CU_TENSOR_MAP_SWIZZLE_128B);
  const void* w = p.w;
  int64_t w_st = p.w_st;
  if (p.w_kn) {  // (bf16 only)
    const int64_t N = p.NH * p.D;
    const dim3 grid(unsigned((N + 31) / 32), unsigned(std::min<int64_t>((p.K + 31) / 32, 65535))), block(32, 8);
    transpose_kn_to_nk<<<grid, block, 0, stream>>>(static_cast<const uint16_t*>(p.w), p.w_st,
                                                   reinterpret_cast<uint16_t*>(scratch_w.ptr), p.K, N);
    MXMLA_CUDA_CHECK(cudaGetLastError());
    w = scratch_w.ptr, w_st = p.K;
  }
  const cuuint64_t wd[2] = {cuuint64_t(p.K), cuuint64_t(p.NH * p.D)}, ws[1] = {cuuint64_t(w_st * es)};
  const cuuint32_t wb[2] = {bk, Cfg::kD};
  tw = make_tma_desc(w, et, 2, wd, ws, wb, CU_TENSOR_MAP_SWIZZLE_128B);

  kp = qproj::Params{};
  kp.sched.B = int(p.B), kp.sched.NH = int(p.NH);
  kp.sched.mtiles = int((p.S + Cfg::kBM - 1) / Cfg::kBM);
  kp.sched.num_tiles = int(p.B * kp.sched.mtiles * p.NH);
  kp.kblocks = int((p.K + bk - 1) / bk);
  sm90::RopeMxfp8Params& e = kp.epi;
  e.B = int(p.B), e.S = int(p.S), e.NH = int(p.NH), e.sbhd = p.sbhd;
  if (p.tab_t == DType::kFloat32) {
    e.cos = static_cast<const float*>(p.cos), e.sin = static_cast<const float*>(p.sin), e.tab_st = p.tab_st;
  } else {
    const int64_t n = p.S * Cfg::kR;
    widen_tables<<<unsigned((n + 255) / 256), 256, 0, stream>>>(static_cast<const uint16_t*>(p.cos),
                                                               static_cast<const uint16_t*>(p.sin), p.tab_st,
                                                               reinterpret_cast<float*>(scratch_tab.ptr), p.S);
    MXMLA_CUDA_CHECK(cudaGetLastError());
    e.cos = reinterpret_cast<const float*>(scratch_tab.ptr), e.sin = e.cos + n, e.tab_st = Cfg::kR;
  }
  e.N = p.NH * p.D;
  e.row_codes = p.row_codes, e.row_scales = p.row_scales, e.col_codes = p.col_codes, e.col_scales = p.col_scales;
  e.row_map = p.row_map, e.col_map = p.col_map, e.q = p.q;
}

namespace {
// The kernel on problem p (x and W bf16); ex: MXFP8 x and W's exact fallback (null: bf16 inputs).
void run(const QProjProblem& p, cudaStream_t stream, const Mxfp8Exact* ex) {
  // BHSD scales have padding that nobody else writes.
  if (p.row_scales != nullptr && p.row_map.mode != MapMode::kCompact)
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.row_scales, 0, row_map_bytes(p.row_map), stream));
  if (p.col_scales != nullptr && p.col_map.mode != MapMode::kCompact)
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.col_scales, 0, col_map_bytes(p.col_map), stream));
  StreamScratch scratch_w(p.w_kn ? p.NH * p.D * p.K * 2 : 0, stream);                       // W as [N, K]
  StreamScratch scratch_tab(p.tab_t == DType::kFloat32 ? 0 : 2 * p.S * qproj::Cfg::kR * 4, stream);  // fp32 tables
  CUtensorMap tx, tw;
  qproj::Params kp{};
  qproj_prepare(p, stream, scratch_w, scratch_tab, tx, tw, kp, false);
  if (ex != nullptr) kp.ex = *ex;
  const bool e4m3 = p.fmt == Fp8Format::kE4M3;
  switch (p.style) {
    case RopeStyle::kInterleavedInHalvesOut:
      return e4m3 ? launch<RopeStyle::kInterleavedInHalvesOut, true>(tx, tw, kp, stream)
                  : launch<RopeStyle::kInterleavedInHalvesOut, false>(tx, tw, kp, stream);
    case RopeStyle::kInterleaved:
      return e4m3 ? launch<RopeStyle::kInterleaved, true>(tx, tw, kp, stream)
                  : launch<RopeStyle::kInterleaved, false>(tx, tw, kp, stream);
    case RopeStyle::kRotateHalf:
      return e4m3 ? launch<RopeStyle::kRotateHalf, true>(tx, tw, kp, stream)
                  : launch<RopeStyle::kRotateHalf, false>(tx, tw, kp, stream);
  }
}
}  // namespace

void qproj_cuda(const QProjProblem& p, Stream s) {
  if (p.B * p.S == 0) return;
  run(p, reinterpret_cast<cudaStream_t>(s), nullptr);
}

// MXFP8 x and W (g.a = x [T, K] rowwise, g.b = W [N, K] rowwise; p.x, p.w unused): design C's bf16
// copies of both (one dequantizing pass each) feed the same kernel; the scale check's flag switches
// its MMA warpgroups to the exact fallback when a copy would not be exact.
void qproj_mxfp8_cuda(const QProjProblem& p0, const GemmProblem& g, Stream s) {
  if (p0.B * p0.S == 0) return;
  auto stream = reinterpret_cast<cudaStream_t>(s);
  Mxfp8Bf16Operands ops;  // (its scratch is freed on the stream after the kernel)
  mxfp8_bf16_operands(g, stream, ops);
  QProjProblem p = p0;
  p.x = ops.a16, p.x_st_s = p.sbhd ? p.B * ops.ld : ops.ld, p.x_st_b = p.sbhd ? ops.ld : p.S * ops.ld;
  p.w = ops.b16, p.w_st = ops.ld, p.w_kn = false;
  run(p, stream, &ops.exact);
}

}  // namespace mxmla::detail
