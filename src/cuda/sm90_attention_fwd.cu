// mxmla — the attention forward for SM90 (sm_90a): the launcher of the warp-specialized kernel in
// sm90_attention_fwd.cuh (MXFP8 or bf16 Q, K, V; bf16 wgmma with fp32 accumulation, online
// softmax). MXFP8 inputs are converted to bf16 once by a pass before the kernel (staged, the
// default where it applies) or inside the kernel per tile (fused): attention_fwd_cuda below.
// Instantiations: (d_qk, d_v) in {(192, 128), (128, 128)} x {bf16 inputs (the dequantizer idle);
// the staged path's (Q's codes, E4M3 or E5M2); every mode, the fused path's (E4M3 or E5M2)}.
#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "common/attention_ops.h"
#include "cuda/attention_stage.h"
#include "cuda/cuda_check.h"
#include "cuda/heuristics.h"
#include "cuda/launch.h"
#include "cuda/sm90_attention_fwd.cuh"
#include "cuda/stream_scratch.h"
#include "cuda/tma_desc.h"

namespace mxmla::detail {
namespace {

constexpr const char* kOp = "mxmla.attention";

// A 4-D map over an operand: dims {d, heads, tokens, batch}, box {64, 1, rows, 1}; FP8 codes with the
// 64-byte swizzle (the dequantizer's staging), bf16 with the 128-byte swizzle (the wgmma layout; O's
// stores from its staging, 64 rows a box).
// TMA reads an operand when its data pointer and its head, token and batch strides are multiples of
// 16 bytes; the stride of a dim of extent 1 (one head, one token, one sequence) is never stepped
// over and does not count (make_tma_desc gives it the packed value).
bool tma_aligned(const AttnTensorView& v, bool fp8, int64_t heads, int64_t tokens, int64_t batch) {
  const int64_t esz = fp8 ? 1 : 2;
  const auto aligned = [](int64_t bytes) { return bytes % 16 == 0; };
  return reinterpret_cast<uintptr_t>(v.data) % 16 == 0 && (heads <= 1 || aligned(v.st_h * esz)) &&
         (tokens <= 1 || aligned(v.st_s * esz)) && (batch <= 1 || aligned(v.st_b * esz));
}

CUtensorMap operand_map(const char* arg, const AttnTensorView& v, bool fp8, int64_t d, int64_t heads, int64_t tokens,
                        int64_t batch, uint32_t rows = 128) {
  tokens = std::max<int64_t>(tokens, 1);
  if (!tma_aligned(v, fp8, heads, tokens, batch))
    throw Error(kOp, arg,
                "the CUDA kernel reads it with TMA: its data pointer and its head, token and batch strides must be "
                "multiples of 16 bytes");
  const int64_t esz = fp8 ? 1 : 2;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(tokens), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(v.st_h * esz), static_cast<cuuint64_t>(v.st_s * esz),
                                 static_cast<cuuint64_t>(v.st_b * esz)};  // (extent-1 dims': replaced)
  const cuuint32_t box[4] = {64, 1, rows, 1};
  return make_tma_desc(v.data, fp8 ? DType::kUInt8 : DType::kBFloat16, 4, dims, strides, box,
                       fp8 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B);
}

// q_codes: pr.q is FP8 (codes and scales, pr.fmt) while K and V are bf16 (pr.fp8 false; the staged path).
template <int kDqk, int kDv, bool kE4M3, attn::Inputs kIn>
void launch(const AttentionProblem& pr, bool q_codes, cudaStream_t stream) {
  using K = attn::Kernel<kDqk, kDv, kE4M3, kIn>;
  attn::Params p{};
  p.B = static_cast<int>(pr.B), p.H = static_cast<int>(pr.H), p.Hkv = static_cast<int>(pr.Hkv);
  p.Sq = static_cast<int>(pr.Sq), p.Skv = static_cast<int>(pr.Skv);
  p.thd = pr.thd, p.causal = pr.causal, p.bottom_right = pr.bottom_right, p.fp8 = pr.fp8;
  p.q_fp8 = !pr.fp8 && q_codes;
  p.e4m3_p = pr.p_format == PFormat::kE4M3;
  p.cu_q = pr.cu_q, p.cu_kv = pr.cu_kv, p.total_q = pr.total_q, p.total_kv = pr.total_kv;
  p.scale_log2 = static_cast<float>(static_cast<double>(pr.softmax_scale) * 1.4426950408889634);
  p.q = {pr.q, pr.q_sc}, p.k = {pr.k, pr.k_sc}, p.v = {pr.v, pr.v_sc};
  p.o = pr.o, p.o_st_b = pr.o_st_b, p.o_st_s = pr.o_st_s, p.o_st_h = pr.o_st_h;
  p.lse = pr.lse;
  p.num_mblocks = static_cast<int>((pr.Sq + 127) / 128);
  const int64_t BH = pr.B * pr.H;
  // heads whose K and V stay in L2 together (a third of the H200's 60 MB), whole query blocks of them
  const int64_t kv_bytes = std::max<int64_t>(1, pr.Skv * (kDqk + kDv) * (pr.fp8 ? 1 : 2));
  p.heads_per_group = static_cast<int>(std::clamp<int64_t>((20ll << 20) / kv_bytes, 1, BH));
  const int64_t tiles = BH * p.num_mblocks;
  if (tiles == 0) return;
  // tile indices, and the dynamic order's claims (up to tiles + the grid), fit 31 bits
  if (tiles > (int64_t{1} << 30)) throw Error(kOp, "q", "has too many (sequence, head, 128-row) tiles (at most 2^30)");
  p.num_tiles = static_cast<int>(tiles);

  const int64_t q_tokens = pr.thd ? pr.total_q : pr.Sq, kv_tokens = pr.thd ? pr.total_kv : pr.Skv;
  const int64_t batch = pr.thd ? 1 : pr.B;
  // O by TMA stores where the kernel has bf16 K / V slots to stage it in (not the fused path); the
  // API has checked that TMA can write O (attention.cpp)
  AttnTensorView ov;
  ov.data = pr.o, ov.st_b = pr.o_st_b, ov.st_s = pr.o_st_s, ov.st_h = pr.o_st_h;
  p.tma_o = !pr.fp8 && q_tokens > 0;  // (no query rows: no tile stores O)
  const CUtensorMap to = p.tma_o ? operand_map("o", ov, false, pr.Dv, pr.H, q_tokens, batch, 64) : CUtensorMap{};
  const CUtensorMap tq = operand_map("q", pr.q, pr.fp8 || q_codes, pr.Dqk, pr.H, q_tokens, batch);
  // no keys at all (s_kv = 0, or thd with every KV sequence empty): every tile has n_blocks = 0 and the
  // kernel never reads K or V, but TMA cannot describe an empty tensor (zero extents and strides): K's
  // and V's maps then describe a placeholder of one token over Q's data, never dereferenced.
  const bool no_keys = kv_tokens == 0;
  const auto placeholder = [&](int64_t d) {
    AttnTensorView v = pr.q;
    v.st_h = (d + 15) / 16 * 16, v.st_s = v.st_h * pr.Hkv, v.st_b = v.st_s;
    return v;
  };
  const CUtensorMap tk = operand_map("k", no_keys ? placeholder(pr.Dqk) : pr.k, pr.fp8, pr.Dqk, pr.Hkv,
                                     std::max<int64_t>(kv_tokens, 1), no_keys ? 1 : batch);
  const CUtensorMap tv = operand_map("v", no_keys ? placeholder(pr.Dv) : pr.v, pr.fp8, pr.Dv, pr.Hkv,
                                     std::max<int64_t>(kv_tokens, 1), no_keys ? 1 : batch);

  const void* kernel = reinterpret_cast<const void*>(&attn::sm90_attention_fwd_kernel<K>);
  const KernelFit fit = kernel_fit(kernel, K::C::kThreads, K::kSmemBytes, K::kSmemBytes);
  const int grid = static_cast<int>(heuristics::persistent_grid(fit.resident(), tiles));
  // the dynamic order's counter, zero at launch (stream-ordered: each launch, also in a graph, its own)
  const bool dynamic = heuristics::attn_fwd_dynamic_order(pr.causal, pr.thd, tiles, grid);
  StreamScratch counter(dynamic ? static_cast<int64_t>(sizeof(int)) : 0, stream);
  if (dynamic) MXMLA_CUDA_CHECK(cudaMemsetAsync(counter.ptr, 0, sizeof(int), stream));
  p.tile_counter = reinterpret_cast<int*>(counter.ptr);
  attn::sm90_attention_fwd_kernel<K><<<grid, K::C::kThreads, K::kSmemBytes, stream>>>(tq, tk, tv, to, p);
  MXMLA_CUDA_CHECK(cudaGetLastError());
}


// The FP8 inputs' path: "staged" (default where it applies) converts K and V once into bf16
// scratch (cuda/attention_stage.h) and runs the kernel on those copies, the dequantizer warpgroup
// expanding each work tile's Q codes in place (Q is read once per tile; Q too is converted by the
// pass where TMA cannot read its codes); "fused" dequantizes every K / V tile inside the kernel,
// once per query block that reads it. Both give the same bits (the same bf16 values into the same
// consumers; with thd, the V rows of a key tile past its sequence's end are zeros on both: the
// kernel zeroes them on bf16 tiles). Staged applies where the scale lookups go per 16-value chunk.
// MXMLA_ATTN_FWD in the environment, read at every call: "fused" forces the fused path, "staged"
// the staged one (an error where it does not apply); A/B comparisons and tests.
bool staged_applies(const AttentionProblem& p, const AttnRead (&r)[3]) {
  const char* env = std::getenv("MXMLA_ATTN_FWD");
  if (env != nullptr && std::strcmp(env, "fused") == 0) return false;
  bool ok = p.fp8 && (p.thd || p.B <= kMaxGridSequences);  // (the pass's grid; the kernel's is persistent)
  for (const AttnRead& x : r) ok = ok && attn_read_chunk_scales_ok(x);
  if (!ok && p.fp8 && env != nullptr && std::strcmp(env, "staged") == 0)
    throw Error(kOp, "q", "MXMLA_ATTN_FWD=staged: the staged path does not apply (scale lookups that do not go per "
                          "16-value chunk, or more than 65535 sequences outside thd)");
  return ok;
}

template <attn::Inputs kIn>
void launch_fp8(const AttentionProblem& p, bool q_codes, cudaStream_t s) {
  const bool e4m3 = p.fmt == Fp8Format::kE4M3;
  if (p.Dqk == 192) {
    if (e4m3) launch<192, 128, true, kIn>(p, q_codes, s);
    else launch<192, 128, false, kIn>(p, q_codes, s);
  } else {
    if (e4m3) launch<128, 128, true, kIn>(p, q_codes, s);
    else launch<128, 128, false, kIn>(p, q_codes, s);
  }
}

void run(const AttentionProblem& p, cudaStream_t s, bool q_codes = false) {
  using attn::Inputs;
  if (!p.fp8 && !q_codes) {  // bf16 Q, K, V: the instantiation without the FP8 modes
    if (p.Dqk == 192) launch<192, 128, true, Inputs::kBf16>(p, q_codes, s);
    else launch<128, 128, true, Inputs::kBf16>(p, q_codes, s);
  } else if (!p.fp8) {  // the staged path: Q's codes, bf16 K and V
    launch_fp8<Inputs::kQCodes>(p, q_codes, s);
  } else {  // the fused path
    launch_fp8<Inputs::kAny>(p, q_codes, s);
  }
}

}  // namespace

bool attention_cuda_supports(int64_t Dqk, int64_t Dv) { return (Dqk == 192 || Dqk == 128) && Dv == 128; }

void attention_fwd_cuda(const AttentionProblem& p, Stream stream) {
  if (!attention_cuda_supports(p.Dqk, p.Dv))
    throw Error(kOp, "q", "the CUDA kernel supports head dims (d_qk, d_v) = (192, 128) and (128, 128), got (" +
                              std::to_string(p.Dqk) + ", " + std::to_string(p.Dv) + ")");
  if (p.fp8 && p.v_sc.row_s != 1)
    throw Error(kOp, "v", "the CUDA kernel needs V's columnwise scale blocks to run along the keys of a sequence");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  AttnRead r[3];  // Q, K rowwise; V columnwise
  const AttnTensorView* views[] = {&p.q, &p.k, &p.v};
  const AttnScaleView* scales[] = {&p.q_sc, &p.k_sc, &p.v_sc};
  for (int i = 0; i < 3; ++i) {
    r[i].view = *views[i], r[i].sc = *scales[i];
    r[i].fp8 = p.fp8, r[i].rowwise = i < 2, r[i].fmt = p.fmt;
  }
  if (!staged_applies(p, r)) return run(p, s);
  StageSeqs g;
  g.B = p.B, g.Sq = p.Sq, g.Skv = p.Skv;
  g.thd = p.thd, g.cu_q = p.cu_q, g.cu_kv = p.cu_kv, g.total_q = p.total_q, g.total_kv = p.total_kv;
  std::unique_ptr<StreamScratch> keep[3];  // freed on the stream after the kernel
  AttentionProblem b = p;                  // the same problem on the bf16 copies (Q's codes where TMA reads them)
  const bool q_codes = tma_aligned(p.q, true, p.H, p.thd ? p.total_q : p.Sq, p.thd ? 1 : p.B);
  b.fp8 = false, b.k_sc = b.v_sc = AttnScaleView{};
  if (!q_codes) b.fmt = Fp8Format::kE4M3, b.q_sc = AttnScaleView{};
  AttnTensorView* out[] = {&b.q, &b.k, &b.v};
  StageRequest req[3];
  int n = 0;
  for (int i = q_codes ? 1 : 0; i < 3; ++i, ++n) {
    req[n].src = &r[i], req[n].kv = i > 0, req[n].heads = i == 0 ? p.H : p.Hkv, req[n].d = i == 2 ? p.Dv : p.Dqk;
    req[n].view = out[i], req[n].keep = &keep[i];
  }
  stage_attn_reads(kOp, g, req, n, s);
  run(b, s, q_codes);
}

}  // namespace mxmla::detail
