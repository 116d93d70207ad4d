// mxmla — the attention backward on CUDA cores (include/mxmla/attention.h: attention_backward): the
// fallback for the head dims the tensor-core kernel (attention_bwd_mma.cu) is not instantiated for
// (and the path MXMLA_ATTN_BWD=simt forces). It computes what the CPU reference computes
// (src/cpu/attention_backward_reference.cpp) in fp32 instead of float64:
//
//   D_i   = Σ_d O_id · dO_row,id                                   (preprocess, one warp per row)
//   s_ij  = (Q_row,i · K_row,j) · scale,  P_ij = exp(s_ij − LSE_i),  dP_ij = dO_row,i · V_row,j
//   dS_ij = P_ij · (dP_ij − D_i) · scale;  P̂, dŜ = bf16(P), bf16(dS)   (visible keys only)
//   dV_j = Σ_i P̂_ij · dO_col,i,  dK_j = Σ_i dŜ_ij · Q_col,i            (one CTA per 32 keys of a kv head)
//   dQ_i = Σ_j dŜ_ij · K_col,j                                         (one CTA per 32 query rows)
//
// Every operand element is read through its AttnRead (bf16, or code · 2^(e−127) through the copy's
// scale geometry), so every format, packed view and scale layout the API accepts runs here. P and
// dS are recomputed by both main kernels; there are no atomics, so the result does not depend on
// scheduling (deterministic). Arch-neutral (FP8 decode: sm_89+). The preprocess and the thd zero
// tail (attention_bwd_prologue) serve the tensor-core path too; the device helpers both paths use
// are in attention_bwd_common.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>

#include "common/attention_ops.h"
#include "cuda/attention_bwd_common.cuh"
#include "cuda/cuda_check.h"
#include "cuda/ptx/convert.cuh"
#include "cuda/stream_scratch.h"

namespace mxmla::detail {
namespace {

constexpr const char* kOp = "mxmla.attention_backward";
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kBlk = 32;       // keys (dK/dV kernel) or query rows (dQ kernel) per CTA

using namespace attn_bwd;  // elem, Seq, seq_of, row_index, visible, warp_sum, write_bf16, bf16_round, ...

// D[row] = Σ_d O · dO_row; grid (ceil(Sq / kWarps), H, B), one warp per row. vec (bf16 dO; O's and
// dO's data 8-byte aligned, their strides and d_v multiples of 4): four values a lane per 8-byte
// load of each (the element path's 2-byte loads and per-element addressing left HBM idle).
__global__ void __launch_bounds__(kThreads) bwd_preprocess(const AttentionBwdProblem p, float* D, bool vec) {
  const int64_t b = blockIdx.z, h = blockIdx.y, i = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const Seq s = seq_of(p, b);
  if (i >= s.sq) return;
  const uint16_t* o = p.o + b * p.o_st_b + (s.q0 + i) * p.o_st_s + h * p.o_st_h;
  const int32_t* cq = p.thd ? p.cu_q : nullptr;
  float acc = 0.f;
  if (vec) {
    const AttnTensorView& g = p.do_s.view;
    const uint16_t* go = static_cast<const uint16_t*>(g.data) + b * g.st_b + (s.q0 + i) * g.st_s + h * g.st_h;
    for (int64_t d = 4 * lane; d < p.Dv; d += 128) {
      const uint2 x = *reinterpret_cast<const uint2*>(o + d), y = *reinterpret_cast<const uint2*>(go + d);
      acc += bf16_lo(x.x) * bf16_lo(y.x) + bf16_hi(x.x) * bf16_hi(y.x) + bf16_lo(x.y) * bf16_lo(y.y) +
             bf16_hi(x.y) * bf16_hi(y.y);
    }
  } else {
    for (int64_t d = lane; d < p.Dv; d += 32)
      acc += __uint_as_float(static_cast<uint32_t>(o[d]) << 16) * elem(p.do_s, cq, b, h, i, d);
  }
  acc = warp_sum(acc);
  if (lane == 0) D[row_index(p, s, b, h, i)] = acc;
}

// The same for d_v 128 with 16-byte loads (bf16 dO; O's and dO's data 16-byte aligned, their
// strides multiples of 8 values): grid (ceil(Sq / 32), H, B), warp w rows 4w .. 4w + 3 of the
// block's 32, half a warp a row (8 values a lane), all four loads of a lane issued before the sums
// (one row a warp kept too few bytes in flight to reach HBM's rate).
constexpr int kPreRows = 4 * kWarps;  // rows per block
__global__ void __launch_bounds__(kThreads) bwd_preprocess_d128(const AttentionBwdProblem p, float* D) {
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int lane = threadIdx.x % 32, half = lane / 16, seg = lane % 16;
  const int64_t i_first = int64_t{blockIdx.x} * kPreRows + 4 * (threadIdx.x / 32) + half;  // rows i_first, + 2
  const Seq s = seq_of(p, b);
  const AttnTensorView& g = p.do_s.view;
  const uint16_t* go = static_cast<const uint16_t*>(g.data);
  uint4 x[2], y[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int64_t i = i_first + 2 * k;
    x[k] = y[k] = make_uint4(0, 0, 0, 0);
    if (i < s.sq) {
      x[k] = *reinterpret_cast<const uint4*>(p.o + b * p.o_st_b + (s.q0 + i) * p.o_st_s + h * p.o_st_h + 8 * seg);
      y[k] = *reinterpret_cast<const uint4*>(go + b * g.st_b + (s.q0 + i) * g.st_s + h * g.st_h + 8 * seg);
    }
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t xw[4] = {x[k].x, x[k].y, x[k].z, x[k].w}, yw[4] = {y[k].x, y[k].y, y[k].z, y[k].w};
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc += bf16_lo(xw[e]) * bf16_lo(yw[e]) + bf16_hi(xw[e]) * bf16_hi(yw[e]);
#pragma unroll
    for (int o = 8; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);  // (within each half)
    const int64_t i = i_first + 2 * k;
    if (seg == 0 && i < s.sq) D[row_index(p, s, b, h, i)] = acc;
  }
}

// dK, dV of kBlk keys of kv head hk; grid (ceil(Skv / kBlk), Hkv, B).
// Shared: Ks, dK [kBlk][Dqk]; Vs, dV [kBlk][Dv]; q_s, q_g [Dqk]; do_s, do_g [Dv]; P̂, dŜ [kBlk].
__global__ void __launch_bounds__(kThreads) bwd_dkdv(const AttentionBwdProblem p, const float* D) {
  extern __shared__ float sm[];
  const int64_t b = blockIdx.z, hk = blockIdx.y, j0 = int64_t{blockIdx.x} * kBlk;
  const Seq s = seq_of(p, b);
  if (j0 >= s.skv) return;
  const int nj = static_cast<int>(imin(kBlk, s.skv - j0));
  const int64_t Dqk = p.Dqk, Dv = p.Dv;
  float *Ks = sm, *dK = Ks + kBlk * Dqk, *Vs = dK + kBlk * Dqk, *dV = Vs + kBlk * Dv;
  float *qs = dV + kBlk * Dv, *qg = qs + Dqk, *dos = qg + Dqk, *dog = dos + Dv, *Pb = dog + Dv, *dSb = Pb + kBlk;
  const int32_t *cq = p.thd ? p.cu_q : nullptr, *ck = p.thd ? p.cu_kv : nullptr;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int64_t x = tid; x < kBlk * Dqk; x += kThreads) {
    const int j = static_cast<int>(x / Dqk);
    Ks[x] = j < nj ? elem(p.k_s, ck, b, hk, j0 + j, x % Dqk) : 0.f;
    dK[x] = 0.f;
  }
  for (int64_t x = tid; x < kBlk * Dv; x += kThreads) {
    const int j = static_cast<int>(x / Dv);
    Vs[x] = j < nj ? elem(p.v_s, ck, b, hk, j0 + j, x % Dv) : 0.f;
    dV[x] = 0.f;
  }
  const int64_t group = p.H / p.Hkv;
  const float scale = p.softmax_scale;
  // rows that see at least key j0
  const int64_t i_first = p.causal ? imax(0, j0 - s.off) : 0;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
    for (int64_t i = i_first; i < s.sq; ++i) {
      __syncthreads();  // the previous row's q / dO and P̂ / dŜ are consumed
      for (int64_t d = tid; d < Dqk; d += kThreads) qs[d] = elem(p.q_s, cq, b, h, i, d), qg[d] = elem(p.q_g, cq, b, h, i, d);
      for (int64_t d = tid; d < Dv; d += kThreads) dos[d] = elem(p.do_s, cq, b, h, i, d), dog[d] = elem(p.do_g, cq, b, h, i, d);
      __syncthreads();
      const int64_t ri = row_index(p, s, b, h, i);
      const float lse = p.lse[ri], Di = D[ri];
      for (int j = warp; j < kBlk; j += kWarps) {
        float sv = 0.f, dp = 0.f;
        for (int64_t d = lane; d < Dqk; d += 32) sv += qs[d] * Ks[j * Dqk + d];
        for (int64_t d = lane; d < Dv; d += 32) dp += dos[d] * Vs[j * Dv + d];
        sv = warp_sum(sv), dp = warp_sum(dp);
        if (lane == 0) {
          const bool on = j < nj && visible(p, s, i, j0 + j);
          const float P = expf(sv * scale - lse);
          Pb[j] = on ? bf16_round(P) : 0.f;
          dSb[j] = on ? bf16_round(P * (dp - Di) * scale) : 0.f;
        }
      }
      __syncthreads();
      for (int64_t x = tid; x < kBlk * Dv; x += kThreads) dV[x] += Pb[x / Dv] * dog[x % Dv];
      for (int64_t x = tid; x < kBlk * Dqk; x += kThreads) dK[x] += dSb[x / Dqk] * qg[x % Dqk];
    }
  __syncthreads();
  for (int64_t x = tid; x < nj * Dqk; x += kThreads) write_bf16(p.dk, p.dk_v, b, s.kv0 + j0 + x / Dqk, hk, x % Dqk, dK[x]);
  for (int64_t x = tid; x < nj * Dv; x += kThreads) write_bf16(p.dv, p.dv_v, b, s.kv0 + j0 + x / Dv, hk, x % Dv, dV[x]);
}

// dQ of kBlk query rows of head h; grid (ceil(Sq / kBlk), H, B).
// Shared: Qs, dQ [kBlk][Dqk]; dOs [kBlk][Dv]; k_s, k_g [Dqk]; v_s [Dv]; dŜ, LSE, D [kBlk].
__global__ void __launch_bounds__(kThreads) bwd_dq(const AttentionBwdProblem p, const float* D) {
  extern __shared__ float sm[];
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = int64_t{blockIdx.x} * kBlk;
  const Seq s = seq_of(p, b);
  if (i0 >= s.sq) return;
  const int ni = static_cast<int>(imin(kBlk, s.sq - i0));
  const int64_t Dqk = p.Dqk, Dv = p.Dv, hk = h / (p.H / p.Hkv);
  float *Qs = sm, *dQ = Qs + kBlk * Dqk, *dOs = dQ + kBlk * Dqk, *ks = dOs + kBlk * Dv, *kg = ks + Dqk,
        *vs = kg + Dqk, *dSb = vs + Dv, *lse = dSb + kBlk, *Dr = lse + kBlk;
  const int32_t *cq = p.thd ? p.cu_q : nullptr, *ck = p.thd ? p.cu_kv : nullptr;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int64_t x = tid; x < kBlk * Dqk; x += kThreads) {
    const int i = static_cast<int>(x / Dqk);
    Qs[x] = i < ni ? elem(p.q_s, cq, b, h, i0 + i, x % Dqk) : 0.f;
    dQ[x] = 0.f;
  }
  for (int64_t x = tid; x < kBlk * Dv; x += kThreads) {
    const int i = static_cast<int>(x / Dv);
    dOs[x] = i < ni ? elem(p.do_s, cq, b, h, i0 + i, x % Dv) : 0.f;
  }
  for (int i = tid; i < kBlk; i += kThreads) {
    lse[i] = i < ni ? p.lse[row_index(p, s, b, h, i0 + i)] : 0.f;
    Dr[i] = i < ni ? D[row_index(p, s, b, h, i0 + i)] : 0.f;
  }
  const float scale = p.softmax_scale;
  const int64_t j_end = p.causal ? imin(imax(i0 + ni + s.off, 0), s.skv) : s.skv;  // keys any row sees
  for (int64_t j = 0; j < j_end; ++j) {
    __syncthreads();  // the previous key's rows and dŜ are consumed
    for (int64_t d = tid; d < Dqk; d += kThreads) ks[d] = elem(p.k_s, ck, b, hk, j, d), kg[d] = elem(p.k_g, ck, b, hk, j, d);
    for (int64_t d = tid; d < Dv; d += kThreads) vs[d] = elem(p.v_s, ck, b, hk, j, d);
    __syncthreads();
    for (int i = warp; i < kBlk; i += kWarps) {
      float sv = 0.f, dp = 0.f;
      for (int64_t d = lane; d < Dqk; d += 32) sv += Qs[i * Dqk + d] * ks[d];
      for (int64_t d = lane; d < Dv; d += 32) dp += dOs[i * Dv + d] * vs[d];
      sv = warp_sum(sv), dp = warp_sum(dp);
      if (lane == 0) {
        const bool on = i < ni && visible(p, s, i0 + i, j);
        const float P = expf(sv * scale - lse[i]);
        dSb[i] = on ? bf16_round(P * (dp - Dr[i]) * scale) : 0.f;
      }
    }
    __syncthreads();
    for (int64_t x = tid; x < kBlk * Dqk; x += kThreads) dQ[x] += dSb[x / Dqk] * kg[x % Dqk];
  }
  __syncthreads();
  for (int64_t x = tid; x < ni * Dqk; x += kThreads) write_bf16(p.dq, p.dq_v, b, s.q0 + i0 + x / Dqk, h, x % Dqk, dQ[x]);
}

// thd: zeros for the tokens after the last sequence (dq: [cu_q[B], total_q); dk, dv: [cu_kv[B], total_kv)).
__global__ void __launch_bounds__(kThreads) bwd_zero_tail(const AttentionBwdProblem p) {
  const int64_t q_from = p.cu_q[p.B], kv_from = p.cu_kv[p.B];
  const int64_t nq = (p.total_q - q_from) * p.H * p.Dqk;
  const int64_t nk = (p.total_kv - kv_from) * p.Hkv * p.Dqk, nv = (p.total_kv - kv_from) * p.Hkv * p.Dv;
  for (int64_t x = int64_t{blockIdx.x} * kThreads + threadIdx.x; x < nq + nk + nv; x += int64_t{gridDim.x} * kThreads) {
    if (x < nq) {
      const int64_t d = x % p.Dqk, h = (x / p.Dqk) % p.H, t = q_from + x / (p.Dqk * p.H);
      write_bf16(p.dq, p.dq_v, 0, t, h, d, 0.f);
    } else if (x < nq + nk) {
      const int64_t y = x - nq, d = y % p.Dqk, h = (y / p.Dqk) % p.Hkv, t = kv_from + y / (p.Dqk * p.Hkv);
      write_bf16(p.dk, p.dk_v, 0, t, h, d, 0.f);
    } else {
      const int64_t y = x - nq - nk, d = y % p.Dv, h = (y / p.Dv) % p.Hkv, t = kv_from + y / (p.Dv * p.Hkv);
      write_bf16(p.dv, p.dv_v, 0, t, h, d, 0.f);
    }
  }
}

size_t dkdv_smem(const AttentionBwdProblem& p) {
  return sizeof(float) * (2 * kBlk * (p.Dqk + p.Dv) + 2 * (p.Dqk + p.Dv) + 2 * kBlk);
}
size_t dq_smem(const AttentionBwdProblem& p) {
  return sizeof(float) * (2 * kBlk * p.Dqk + kBlk * p.Dv + 2 * p.Dqk + p.Dv + 3 * kBlk);
}

}  // namespace

size_t attention_bwd_cuda_smem(int64_t Dqk, int64_t Dv) {
  AttentionBwdProblem p;
  p.Dqk = Dqk, p.Dv = Dv;
  return std::max(dkdv_smem(p), dq_smem(p));
}

std::unique_ptr<StreamScratch> attn_bwd::attention_bwd_prologue(const AttentionBwdProblem& p, cudaStream_t s) {
  if (p.thd) {
    bwd_zero_tail<<<1024, kThreads, 0, s>>>(p);
    MXMLA_CUDA_CHECK(cudaGetLastError());
  }
  if (p.B == 0 || p.H == 0) return nullptr;
  const unsigned H = grid_dim(kOp, p.H, false, "heads");
  const int64_t rows = p.thd ? p.H * p.total_q : p.B * p.H * p.Sq;
  auto D = std::make_unique<StreamScratch>(std::max<int64_t>(rows, 1) * 4, s);
  if (p.Sq > 0) {
    const AttnTensorView& g = p.do_s.view;
    // O and a bf16 dO read n values at a time: both data pointers 2n-byte aligned, every stride a
    // multiple of n values
    const auto vec_ok = [&](int64_t n) {
      return !p.do_s.fp8 && reinterpret_cast<uintptr_t>(p.o) % (2 * n) == 0 &&
             reinterpret_cast<uintptr_t>(g.data) % (2 * n) == 0 && p.o_st_b % n == 0 && p.o_st_s % n == 0 &&
             p.o_st_h % n == 0 && g.st_b % n == 0 && g.st_s % n == 0 && g.st_h % n == 0;
    };
    const bool d128 = p.Dv == 128 && vec_ok(8), vec = p.Dv % 4 == 0 && vec_ok(4);
    const int64_t rows_per_block = d128 ? kPreRows : kWarps;
    const unsigned blocks = grid_dim(kOp, (p.Sq + rows_per_block - 1) / rows_per_block, true, "rows");
    float* const Dp = reinterpret_cast<float*>(D->ptr);
    for_sequence_chunks(kOp, p.B, p.thd, [&](int64_t b0, unsigned n) {
      const AttentionBwdProblem c = sequence_chunk(p, b0, n);
      if (d128) bwd_preprocess_d128<<<dim3(blocks, H, n), kThreads, 0, s>>>(c, Dp);
      else bwd_preprocess<<<dim3(blocks, H, n), kThreads, 0, s>>>(c, Dp, vec);
      MXMLA_CUDA_CHECK(cudaGetLastError());
    });
  }
  return D;
}

void attention_bwd_simt_cuda(const AttentionBwdProblem& p, Stream stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const std::unique_ptr<StreamScratch> D = attn_bwd::attention_bwd_prologue(p, s);
  if (D == nullptr) return;
  const unsigned H = grid_dim(kOp, p.H, false, "heads"), Hkv = grid_dim(kOp, p.Hkv, false, "heads");
  const unsigned key_blocks = grid_dim(kOp, (p.Skv + kBlk - 1) / kBlk, true, "keys"),
                 row_blocks = grid_dim(kOp, (p.Sq + kBlk - 1) / kBlk, true, "rows");
  float* Dp = reinterpret_cast<float*>(D->ptr);
  const size_t kv_smem = dkdv_smem(p), q_smem = dq_smem(p);
  MXMLA_CUDA_CHECK(cudaFuncSetAttribute(bwd_dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kv_smem)));
  MXMLA_CUDA_CHECK(cudaFuncSetAttribute(bwd_dq, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(q_smem)));
  for_sequence_chunks(kOp, p.B, p.thd, [&](int64_t b0, unsigned n) {
    const AttentionBwdProblem c = sequence_chunk(p, b0, n);
    if (p.Skv > 0) {
      bwd_dkdv<<<dim3(key_blocks, Hkv, n), kThreads, kv_smem, s>>>(c, Dp);
      MXMLA_CUDA_CHECK(cudaGetLastError());
    }
    if (p.Sq > 0) {
      bwd_dq<<<dim3(row_blocks, H, n), kThreads, q_smem, s>>>(c, Dp);
      MXMLA_CUDA_CHECK(cudaGetLastError());
    }
  });
}

}  // namespace mxmla::detail
