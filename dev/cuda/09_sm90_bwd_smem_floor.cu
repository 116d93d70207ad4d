// Experiment 09 — how fast can the attention backward's tile run on SM90 with its GEMMs' operands in
// shared memory, whatever the schedule? The SM90 backward (src/cuda/sm90_attention_bwd.cu) and
// FlashAttention-4's share one tiling at head dims 192 / 128: a tile of 64 query rows × 96 keys, two
// consumer warpgroups of 48 keys, five GEMMs (S, dP, dV, dQ, dK) whose wgmmas read both operands
// from shared memory. By count a tile's GEMMs need 2 496 tensor-core cycles, but they read 348 160
// bytes of shared memory (a wgmma reads its A and B slices: each consumer reads every GEMM's A tile,
// and dV's and dK's B once per 64-row block of d), and the tile writes and reads 160 KB more (the
// producer's copies, P̂ᵀ and dŜᵀ, the dQ staging and its bulk reductions): 4 000 cycles at 128
// bytes a cycle with bf16 inputs. This measures what the hardware does with that mix, with no
// dependencies between its parts and no softmax: the floor of any schedule that issues this tiling's
// operations as this kernel does (the mixes, the table's rows):
//   gemms      the five GEMMs of both consumers, every wgmma issued back to back, one wait a tile
//   +traffic   the same, and the tile's other traffic issued under them: the producer's copies of
//              the next tile (Q_s and dO: bf16 inputs; with Q_g: MXFP8 inputs' second Q copy), by
//              cp.async as the kernel's (128 threads, swizzled 16-byte chunks, a wait a tile) or by
//              bulk copies (one thread, 8 KB each, an mbarrier: TMA's engine, unswizzled), P̂ᵀ and
//              dŜᵀ stores (24 KB), the dQ staging (48 KB of 8-byte stores in the kernel's pattern)
//              and its three bulk reductions a consumer into an fp32 accumulator in global memory
//              (192 MiB, the kernel's per-group size; the rows a CTA adds into follow the kernel's
//              walk, so that those in use stay in L2); also without the reductions
//   n96        the same FLOPs with GEMMs of N 96 (the K steps of S and dP, and the 64-row blocks
//              of d of dV and dK, dealt between the consumers; all 96 keys each): A tiles read once,
//              260 KB of operand reads instead of 340 — the mix of a design that does not split
//              the keys between the consumers; alone and with MXFP8 inputs' traffic
// Shared memory holds the kernel's tiles (Q_s, dO, K_s, V, K_g with its 64-byte swizzle, Q_g,
// P̂ᵀ / dŜᵀ) filled with small bf16 values; the copies and stores land over tiles the wgmmas read
// (the values are not checked: only the time counts). One CTA of 384 threads per SM on every SM,
// 96 tiles each (8 of them warm-up); printed per mix: the median over CTAs (median of 5 launches) of
// the cycles and ns a tile (clock64 and globaltimer of consumer 0's first thread from the end of the
// warm-up tiles to the last wait) and, by count, the tensor-core cycles and the shared-memory bytes /
// 128. dev/bench/attn_bwd_time.py --exp09=<this binary> turns the bulk-copy rows into the call's floor.
// Usage (GPU machine): <build>/dev/09_sm90_bwd_smem_floor   (or dev/scripts/attn-bwd-floor)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/ptx/common.cuh"
#include "dev_check.h"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"
#include "cuda/ptx/wgmma.cuh"

namespace dev09 {
using namespace mxmla;
using dev::clock_now;

enum Mode : int {
  kGemms = 0, kTrafficBf16 = 1, kTrafficFp8 = 2, kN96 = 3, kN96TrafficFp8 = 4, kTrafficFp8NoRed = 5, kBulkBf16 = 6,
  kBulkFp8 = 7, kN96BulkFp8 = 8, kBulkFp8NoRed = 9
};
constexpr int kModes = 10;
constexpr const char* kModeName[] = {
    "gemms (the kernel's: m64n48 S, dP, dV, dK; m64n96 dQ)",
    "gemms + the tile's other traffic, bf16 inputs (Q_s, dO copied)",
    "gemms + the tile's other traffic, MXFP8 inputs (Q_g copied too)",
    "n96 gemms (A tiles read once)",
    "n96 gemms + the tile's other traffic, MXFP8 inputs",
    "gemms + the tile's other traffic, MXFP8 inputs, without the bulk reductions",
    "gemms + the tile's other traffic, bf16 inputs, copies by bulk copies (TMA) of 8 KB",
    "gemms + the tile's other traffic, MXFP8 inputs, copies by bulk copies (TMA) of 8 KB",
    "n96 gemms + the tile's other traffic, MXFP8 inputs, copies by bulk copies",
    "gemms + the tile's other traffic, MXFP8 inputs, copies by bulk copies, without the bulk reductions",
};
constexpr int kTiles = 96, kWarm = 8;

// shared-memory tiles (byte offsets; every swizzled tile starts at a 1024-byte boundary)
constexpr int kQs = 0;                   // Q_s [64][192]: 3 blocks [64 rows][128 B]
constexpr int kDo = kQs + 3 * 8192;      // dO [64][128]: 2 blocks
constexpr int kKs = kDo + 2 * 8192;      // K_s [96][192]: 3 blocks [96][128 B]
constexpr int kVs = kKs + 3 * 12288;     // V [96][128]: 2 blocks
constexpr int kKg = kVs + 2 * 12288;     // K_g [96][192]: 6 blocks [96][64 B], 64-byte swizzle
constexpr int kQg = kKg + 6 * 6144;      // Q_g [64][192]: 3 blocks
constexpr int kPd = kQg + 3 * 8192;      // P̂ᵀ, dŜᵀ: [consumer][2][48 keys][128 B] (n96: [2][96][128 B])
constexpr int kSmemUsed = kPd + 4 * 6144;
constexpr int kSmemBytes = kSmemUsed + 1024;
static_assert(kSmemUsed == 188416, "the kernel's operand tiles: 184 KB");
constexpr uint32_t kBf16Pair = 0x3C803C80u;  // two bf16 1/64
constexpr int64_t kAccRows = 2 * 64 * 4096;  // [consumer][64 heads' rows at s 4096][96] fp32: 192 MiB

template <int N>
__device__ __forceinline__ void fence_acc(float (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::fence_reg(a[i]);
}

// acc += A·Bᵀ over kD (A a [64][kD] tile, B kN keys of a [96][kD] tile, both K-major, 128-byte swizzle)
template <int kD, int kN, int kAcc>
__device__ __forceinline__ void rows_keys(float (&acc)[kAcc], uint64_t da, uint64_t db) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint64_t a = da + (kk / 4) * 512 + 2 * (kk % 4), b = db + (kk / 4) * 768 + 2 * (kk % 4);
    if constexpr (kN == 48)
      ptx::wgmma_m64n48k16_f32_bf16_bf16_ss<0, 0>(acc, a, b, true);
    else
      ptx::wgmma_m64n96k16_f32_bf16_bf16_ss<0, 0>(acc, a, b, true);
  }
}

// acc += (64 d of a [64 rows][d] tile)ᵀ · B over the 64 rows (A M-major, B kN keys of a [keys][64 rows] tile)
template <int kN, int kAcc>
__device__ __forceinline__ void d_keys(float (&acc)[kAcc], const uint8_t* a_block, uint64_t db) {
  const uint64_t da = ptx::wgmma_desc(a_block, ptx::SmemSwizzle::k128B, 8192, 1024);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    if constexpr (kN == 48)
      ptx::wgmma_m64n48k16_f32_bf16_bf16_ss<1, 0>(acc, da + kk * 128, db + 2 * kk, true);
    else
      ptx::wgmma_m64n96k16_f32_bf16_bf16_ss<1, 0>(acc, da + kk * 128, db + 2 * kk, true);
  }
}

// dQ[:, 96 columns from kg_block0] over the 96 keys: A = dŜ M-major from dŜᵀ (keys 0-47 at ds0,
// 48-95 at ds1), B = K_g N-major (the kernel's dq_gemm_issue)
__device__ __forceinline__ void dq(float (&acc)[48], const uint8_t* ds0, const uint8_t* ds1, const uint8_t* kg_block0) {
  const uint64_t da0 = ptx::wgmma_desc(ds0, ptx::SmemSwizzle::k128B, 8192, 1024);
  const uint64_t da1 = ptx::wgmma_desc(ds1, ptx::SmemSwizzle::k128B, 8192, 1024);
  const uint64_t db = ptx::wgmma_desc(kg_block0, ptx::SmemSwizzle::k64B, 96 * 64, 512);
#pragma unroll
  for (int kk = 0; kk < 6; ++kk)
    ptx::wgmma_m64n96k16_f32_bf16_bf16_ss<1, 1>(acc, (kk < 3 ? da0 : da1) + (kk % 3) * 128, db + kk * 64, true);
}

template <int kMode>
__global__ void __launch_bounds__(384, 1) tile_floor(const uint16_t* __restrict__ src, float* dq_acc,
                                                     long long* out, float* sink) {
  constexpr bool kTraffic = kMode != kGemms && kMode != kN96;
  constexpr bool kQgCopy = kMode != kTrafficBf16 && kMode != kBulkBf16;
  constexpr bool kBulk = kMode == kBulkBf16 || kMode == kBulkFp8 || kMode == kN96BulkFp8 || kMode == kBulkFp8NoRed;
  __shared__ uint64_t copied;  // kBulk: the tile's bulk copies have landed
  constexpr bool kReduce = kTraffic && kMode != kTrafficFp8NoRed && kMode != kBulkFp8NoRed;
  constexpr bool kWide = kMode == kN96 || kMode == kN96TrafficFp8 || kMode == kN96BulkFp8;
  extern __shared__ uint8_t raw[];
  uint8_t* const sm = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  for (int i = static_cast<int>(threadIdx.x); i < kSmemUsed / 16; i += static_cast<int>(blockDim.x))
    reinterpret_cast<uint4*>(sm)[i] = make_uint4(kBf16Pair, kBf16Pair, kBf16Pair, kBf16Pair);
  ptx::fence_proxy_async();
  if (threadIdx.x == 0) {
    ptx::mbar_init(&copied, 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  const int wg = static_cast<int>(threadIdx.x) / 128, tid = static_cast<int>(threadIdx.x) % 128;
  const int threads = kTraffic ? 384 : 256;  // the tile-start barrier (the producer only with traffic)

  if (wg == 0) {  // ---------------------------------------------------------------- producer
    ptx::setmaxnreg_dec<40>();  // the kernel's split: 40 registers for the producer, 232 for the consumers
    if constexpr (kTraffic) {
      // the next tile's copies: Q_s, dO (and Q_g) from a per-CTA rotation over src, 16 bytes a thread
      // per chunk as the kernel's load_tile (swizzled chunk positions), then wait for them
      constexpr int kChunks = (3 + 2 + (kQgCopy ? 3 : 0)) * 512;  // 16-byte chunks: 8 KB blocks
      for (int t = 0; t < kTiles; ++t) {
        ptx::named_barrier(1, threads);
        const uint16_t* from = src + ((blockIdx.x * 7 + t) % 64) * (kChunks * 8);
        if constexpr (kBulk) {  // one thread, one 8 KB bulk copy a block (unswizzled: only the time counts)
          if (tid == 0) {
            ptx::mbar_arrive_expect_tx(&copied, kChunks * 16);
#pragma unroll
            for (int blk = 0; blk < kChunks / 512; ++blk)
              ptx::bulk_load_g2s(sm + (blk < 5 ? kQs + blk * 8192 : kQg + (blk - 5) * 8192), from + blk * 4096, 8192,
                                 &copied);
            ptx::mbar_wait(&copied, static_cast<uint32_t>(t & 1));
          }
        } else {
#pragma unroll 4
          for (int c = tid; c < kChunks; c += 128) {
            const int blk = c / 512, r = (c % 512) / 8, ch = c % 8;
            const int base = blk < 5 ? kQs + blk * 8192 : kQg + (blk - 5) * 8192;  // Q_s, dO adjacent
            ptx::cp_async<16>(sm + base + r * 128 + ((ch ^ (r % 8)) * 16), from + c * 8, 16u);
          }
          ptx::cp_async_commit();
          ptx::cp_async_wait<0>();
        }
      }
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  ptx::setmaxnreg_inc<232>();
  const int c = wg - 1, warp = tid / 32, lane = tid % 32;
  float a48[24], a96[48];
#pragma unroll
  for (int i = 0; i < 24; ++i) a48[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 48; ++i) a96[i] = 0.f;
  const bool issuer = tid == 0;
  long long t0 = 0;
  uint64_t g0 = 0;
  for (int t = 0; t < kTiles; ++t) {
    if (t == kWarm) t0 = clock_now(), g0 = ptx::globaltimer();
    ptx::named_barrier(1, threads);
    fence_acc(a48), fence_acc(a96);
    ptx::wgmma_fence();
    if constexpr (!kWide) {
      // S_c, dP_c [64][48] (K_c: this consumer's 48 keys); dV_cᵀ, dK_cᵀ [d][48]; dQ [64][96 columns]
      const uint64_t p_c = ptx::wgmma_desc_k_sw128(sm + kPd + (2 * c) * 6144);
      const uint64_t ds_c = ptx::wgmma_desc_k_sw128(sm + kPd + (2 * c + 1) * 6144);
      rows_keys<192, 48>(a48, ptx::wgmma_desc_k_sw128(sm + kQs), ptx::wgmma_desc_k_sw128(sm + kKs + c * 6144));
      rows_keys<128, 48>(a48, ptx::wgmma_desc_k_sw128(sm + kDo), ptx::wgmma_desc_k_sw128(sm + kVs + c * 6144));
#pragma unroll
      for (int m = 0; m < 2; ++m) d_keys<48>(a48, sm + kDo + m * 8192, p_c);
      dq(a96, sm + kPd + 6144, sm + kPd + 3 * 6144, sm + kKg + c * 3 * 6144);
#pragma unroll
      for (int m = 0; m < 3; ++m) d_keys<48>(a48, sm + kQg + m * 8192, ds_c);
    } else {
      // all 96 keys a GEMM, the K steps of S and dP (20) and the d blocks' K steps of dV and dK (20)
      // dealt half to each consumer by position (the values are not used: only the operand reads and
      // the multiply-adds count), descriptors chosen by arithmetic so that both consumers run one
      // instruction sequence (a branch would serialize the wgmmas); then dQ as the kernel
      const uint64_t p_all = ptx::wgmma_desc_k_sw128(sm + kPd);
      const uint64_t ds_all = ptx::wgmma_desc_k_sw128(sm + kPd + 2 * 6144);
      const uint64_t qs = ptx::wgmma_desc_k_sw128(sm + kQs), ks = ptx::wgmma_desc_k_sw128(sm + kKs);
      const uint64_t dov = ptx::wgmma_desc_k_sw128(sm + kDo), vs = ptx::wgmma_desc_k_sw128(sm + kVs);
      const uint64_t do_m = ptx::wgmma_desc(sm + kDo, ptx::SmemSwizzle::k128B, 8192, 1024);
      const uint64_t qg_m = ptx::wgmma_desc(sm + kQg, ptx::SmemSwizzle::k128B, 8192, 1024);
#pragma unroll
      for (int i = 0; i < 10; ++i) {  // S's 12 K steps, then dP's 8
        const int g = c * 10 + i, k = g < 12 ? g : g - 12;
        const uint64_t a = (g < 12 ? qs : dov) + (k / 4) * 512 + 2 * (k % 4);
        const uint64_t b = (g < 12 ? ks : vs) + (k / 4) * 768 + 2 * (k % 4);
        ptx::wgmma_m64n96k16_f32_bf16_bf16_ss<0, 0>(a96, a, b, true);
      }
#pragma unroll
      for (int i = 0; i < 10; ++i) {  // dV's 2 blocks x 4 K steps, then dK's 3 x 4
        const int g = c * 10 + i, h = g < 8 ? g : g - 8, m = h / 4, kk = h % 4;
        const uint64_t a = (g < 8 ? do_m : qg_m) + m * (8192 / 16) + kk * 128;
        const uint64_t b = (g < 8 ? p_all : ds_all) + 2 * kk;
        ptx::wgmma_m64n96k16_f32_bf16_bf16_ss<1, 0>(a96, a, b, true);
      }
      dq(a96, sm + kPd + 2 * 6144, sm + kPd + 3 * 6144, sm + kKg + c * 3 * 6144);
    }
    ptx::wgmma_commit();
    if constexpr (kTraffic) {
      // P̂ᵀ and dŜᵀ of this consumer (12 KB: 6 16-byte stores a thread), then the dQ staging: 24
      // 8-byte stores a thread (rows 0-15 over P̂ᵀ, 16-31 over the dO tile, 32-63 over Q_s)
      const uint32_t pd = ptx::smem_u32(sm + kPd + c * 12288);
#pragma unroll
      for (int i = 0; i < 6; ++i)
        ptx::st_shared_v4(pd + (i * 128 + tid) * 16, kBf16Pair, kBf16Pair, kBf16Pair, kBf16Pair);
      if (kReduce && issuer && t > 0) ptx::bulk_wait_read<0>();  // the previous tile's reductions have read the staging
      ptx::named_barrier(2 + c, 128);
      uint8_t* const buf0 = sm + kPd + c * 12288;
      uint8_t* const buf1 = sm + kDo + c * 6144;
      uint8_t* const buf2 = sm + kQs + c * 12288;
      uint8_t* const buf = warp == 0 ? buf0 : warp == 1 ? buf1 : buf2;
      const uint32_t base = ptx::smem_u32(buf) + ((warp == 3 ? 16 : 0) + lane / 4) * 384 + (lane % 4) * 8;
      const int rot = (t + lane / 4) % 8;
      const float v = static_cast<float>(t) * 0x1p-10f;  // (not the accumulators: the GEMMs are in flight)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int j = 0; j < 12; ++j) {
          const int jr = j + rot < 12 ? j + rot : j + rot - 12;
          ptx::st_shared_v2_f32(base + hh * 8 * 384 + jr * 32, v, v + 1.f);
        }
      ptx::fence_proxy_async();
      ptx::named_barrier(2 + c, 128);
      if (kReduce && issuer) {
        // the kernel's pattern: the CTAs in flight cover about three heads (43 key blocks of a head at
        // s 4096), each walks its head's 64 query tiles from a rotation by its key block: the
        // accumulator rows in use stay in L2 (9 MB)
        const int head = static_cast<int>(blockIdx.x) / 43, kb = static_cast<int>(blockIdx.x) % 43;
        const int row = c * static_cast<int>(kAccRows / 2) + head * 4096 + ((kb + t) % 64) * 64;
        float* to = dq_acc + static_cast<size_t>(row) * 96;
        ptx::bulk_reduce_add_f32_s2g(to, buf0, 16 * 384);
        ptx::bulk_reduce_add_f32_s2g(to + 16 * 96, buf1, 16 * 384);
        ptx::bulk_reduce_add_f32_s2g(to + 32 * 96, buf2, 32 * 384);
        ptx::bulk_commit();
      }
    }
    ptx::wgmma_wait<0>();
    fence_acc(a48), fence_acc(a96);
  }
  if (issuer && kReduce) ptx::bulk_wait_all();
  if (threadIdx.x == 128) {
    out[2 * blockIdx.x] = clock_now() - t0;
    out[2 * blockIdx.x + 1] = static_cast<long long>(ptx::globaltimer() - g0);
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 24; ++i) sum += a48[i];
#pragma unroll
  for (int i = 0; i < 48; ++i) sum += a96[i];
  sink[blockIdx.x * 256 + threadIdx.x - 128] = sum;  // keeps the MMAs
}

struct Run {
  double cycles, ns;  // a tile
};

template <int kMode>
Run run(int sms, const uint16_t* src, float* acc, long long* d_out, float* d_sink) {
  auto kernel = tile_floor<kMode>;
  DEV_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  std::vector<double> cyc, ns;
  for (int rep = 0; rep < 5; ++rep) {
    kernel<<<sms, 384, kSmemBytes>>>(src, acc, d_out, d_sink);
    DEV_CHECK_CUDA(cudaGetLastError());
    DEV_CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<long long> h(2 * sms), c(sms), g(sms);
    DEV_CHECK_CUDA(cudaMemcpy(h.data(), d_out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    for (int i = 0; i < sms; ++i) c[i] = h[2 * i], g[i] = h[2 * i + 1];
    std::sort(c.begin(), c.end());
    std::sort(g.begin(), g.end());
    cyc.push_back(static_cast<double>(c[sms / 2]) / (kTiles - kWarm));
    ns.push_back(static_cast<double>(g[sms / 2]) / (kTiles - kWarm));
  }
  std::sort(cyc.begin(), cyc.end());
  std::sort(ns.begin(), ns.end());
  return {cyc[2], ns[2]};
}

}  // namespace dev09

int main() {
  using namespace dev09;
  const int sms = mxmla::dev::require_sm90("09_sm90_bwd_smem_floor");
  const size_t src_elems = size_t{64} * (8 * 512) * 8 + 8;  // 64 tiles' copies (with Q_g), bf16
  const size_t acc_bytes = size_t{kAccRows} * 96 * 4;
  uint16_t* src = nullptr;
  float* acc = nullptr;
  long long* d_out = nullptr;
  float* d_sink = nullptr;
  DEV_CHECK_CUDA(cudaMalloc(&src, src_elems * 2));
  DEV_CHECK_CUDA(cudaMemset(src, 0x3C, src_elems * 2));
  DEV_CHECK_CUDA(cudaMalloc(&acc, acc_bytes));
  DEV_CHECK_CUDA(cudaMemset(acc, 0, acc_bytes));
  DEV_CHECK_CUDA(cudaMalloc(&d_out, 2 * sms * sizeof(long long)));
  DEV_CHECK_CUDA(cudaMalloc(&d_sink, sms * 256 * sizeof(float)));
  // by count, a tile: tensor cycles (5 111 808 multiply-adds at 2 048 a cycle) and shared-memory bytes
  const double tensor = 5111808.0 / 2048.0;
  const double gemm_bytes[] = {348160, 348160, 348160, 266240, 266240, 348160, 348160, 348160, 266240, 348160};
  const double other_bytes[] = {0, 40960 + 24576 + 98304, 65536 + 24576 + 98304, 0, 65536 + 24576 + 98304,
                                65536 + 24576 + 49152, 40960 + 24576 + 98304, 65536 + 24576 + 98304,
                                65536 + 24576 + 98304, 65536 + 24576 + 49152};
  const Run runs[] = {run<kGemms>(sms, src, acc, d_out, d_sink), run<kTrafficBf16>(sms, src, acc, d_out, d_sink),
                      run<kTrafficFp8>(sms, src, acc, d_out, d_sink), run<kN96>(sms, src, acc, d_out, d_sink),
                      run<kN96TrafficFp8>(sms, src, acc, d_out, d_sink), run<kTrafficFp8NoRed>(sms, src, acc, d_out, d_sink),
                      run<kBulkBf16>(sms, src, acc, d_out, d_sink), run<kBulkFp8>(sms, src, acc, d_out, d_sink),
                      run<kN96BulkFp8>(sms, src, acc, d_out, d_sink), run<kBulkFp8NoRed>(sms, src, acc, d_out, d_sink)};
  std::printf("the attention backward's tile (64 query rows x 96 keys, 192 / 128) on %d SMs, %d tiles a CTA "
              "(median over CTAs, median of 5 launches)\n", sms, kTiles - kWarm);
  std::printf("| mix | cycles a tile | ns a tile | tensor cycles by count | shared-memory bytes | bytes / 128 |\n"
              "|---|---|---|---|---|---|\n");
  for (int m = 0; m < kModes; ++m)
    std::printf("| %s | %.0f | %.1f | %.0f | %.0f | %.0f |\n", kModeName[m], runs[m].cycles, runs[m].ns, tensor,
                gemm_bytes[m] + other_bytes[m], (gemm_bytes[m] + other_bytes[m]) / 128.0);
  DEV_CHECK_CUDA(cudaFree(src));
  DEV_CHECK_CUDA(cudaFree(acc));
  DEV_CHECK_CUDA(cudaFree(d_out));
  DEV_CHECK_CUDA(cudaFree(d_sink));
  return 0;
}
