// Experiment 10 — how fast can a few SMs convert the attention forward's K and V? The MXFP8 forward
// runs on bf16 copies of K and V that a conversion pass makes on all SMs before the kernel (1 byte
// read, 2 written a value, at about a copy's rate: HBM-bound, ~25 GB/s an SM). Converting them on a
// few SMs while the others run the attention (compute-bound, little HBM traffic) costs the attention
// only those SMs' time, if a converting SM moves much more than its share of HBM: the in-kernel
// converter of dev/patches/attn_fwd_kv_converter.patch moved ~26 GB/s a CTA (st.global from
// registers after TMA loads, scale cursors with 64-bit divisions per unit, a barrier per unit), no
// more than the pass per SM, and lost. This measures what one CTA can move, alone, by two designs:
//   regs   a persistent CTA of 512 threads per SM; a unit (one KV head, 128 keys: K's 128 x 192 and
//          V's 128 x 128 codes) is 2 560 chunks of 16 values, 5 a thread; the next unit's codes and
//          scale bytes loaded into registers before this unit's are converted and stored (16-byte
//          st.global, a warp's 1 KB consecutive)
//   tma    warp-specialized: one thread loads each half-unit (K or V of 128 keys) by TMA (codes: a
//          3-D box, scales: a bulk copy) into kIn stages; 8 warps convert each into a row-major bf16
//          staging tile (kOut stages); one thread stores each staging tile by one bulk copy (48 or
//          32 KB; the copies' layout [H][S][d] makes a half-unit contiguous) and recycles the stage
//          once the copy has read it
// Both against a one-thread-per-chunk reference kernel: their copies must equal its bits. The values
// and layouts are the forward's at DeepSeek-V3's shape: H 128 KV heads, S keys, K codes [S][H][192]
// with BHSD rowwise scales [H][S][6], V codes [S][H][128] with BHSD columnwise scales [H][S/32][128],
// E4M3, scales in the fast range (every value takes the fast path, as random data does). Timing: the
// command-line tool's (L2 flushed, 1 ms busy wait, medians of 20), for grids of 1 .. all SMs; printed:
// ms, GB/s of all bytes moved (codes and scales read, copies written) and GB/s a CTA, the same for
// `regs` with the conversion left out (the codes stored as they are: the memory traffic alone), and
// a device copy of the same byte count (read + written) as the whole-GPU reference.
// Usage (GPU machine): build/dev/10_sm90_kv_convert_rate [S]   (default 4096)
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/attention_stage.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/tma_desc.h"
#include "dev/cuda/dev_check.h"
#include "tools/gpu_timer.h"

namespace mxmla::dev10 {

constexpr int kDk = 192, kDv = 128, kBN = 128;
constexpr int kKc = kDk / 16, kVc = kDv / 16;                 // chunks a row
constexpr int kUnitChunks = kBN * (kKc + kVc);                // 2 560
constexpr int kKCodeBytes = kBN * kDk, kVCodeBytes = kBN * kDv;  // a half-unit's codes
constexpr int kKScaleBytes = kBN * kDk / 32, kVScaleBytes = kBN / 32 * kDv;  // 768, 512

struct Prob {
  int H, S;
  const uint8_t *kc, *vc, *ks, *vs;  // codes [S][H][d]; scales K [H][S][6], V [H][S/32][128]
  uint16_t *ko, *vo;                 // bf16 copies [H][S][d]
};

// A chunk's 16 codes with their scale byte (K: e.x) or bytes (V) -> 16 bf16 (w[i]: values 2i, 2i + 1)
__device__ __forceinline__ void chunk_words(const uint4& codes, const uint4& e, bool k_part, uint32_t (&w)[8]) {
  uint4 stage[2];
  if (k_part)
    detail::attn_fp8::fp8_chunk_words<true, true, true>(codes, e, stage, w);
  else
    detail::attn_fp8::fp8_chunk_words<true, false, true>(codes, e, stage, w);
}

// ---------------------------------------------------------------- reference: a thread per chunk
__global__ void ref_kernel(const Prob p) {
  const int64_t g = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t units = int64_t{p.H} * (p.S / kBN);
  if (g >= units * kUnitChunks) return;
  const int u = static_cast<int>(g / kUnitChunks), ci = static_cast<int>(g % kUnitChunks);
  const int h = u / (p.S / kBN), j = u % (p.S / kBN);
  uint32_t w[8];
  if (ci < kBN * kKc) {
    const int row = ci / kKc, c = ci % kKc, s = j * kBN + row;
    const uint4 codes = *reinterpret_cast<const uint4*>(p.kc + (int64_t{s} * p.H + h) * kDk + 16 * c);
    const uint4 e = make_uint4(p.ks[(int64_t{h} * p.S + s) * (kDk / 32) + c / 2], 0, 0, 0);
    chunk_words(codes, e, true, w);
    uint4* o = reinterpret_cast<uint4*>(p.ko + (int64_t{h} * p.S + s) * kDk + 16 * c);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]), o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
    const int cv = ci - kBN * kKc, row = cv / kVc, c = cv % kVc, s = j * kBN + row;
    const uint4 codes = *reinterpret_cast<const uint4*>(p.vc + (int64_t{s} * p.H + h) * kDv + 16 * c);
    const uint4 e = *reinterpret_cast<const uint4*>(p.vs + (int64_t{h} * (p.S / 32) + s / 32) * kDv + 16 * c);
    chunk_words(codes, e, false, w);
    uint4* o = reinterpret_cast<uint4*>(p.vo + (int64_t{h} * p.S + s) * kDv + 16 * c);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]), o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// ---------------------------------------------------------------- regs: persistent, registers
constexpr int kRegsThreads = 512, kRegsItems = kUnitChunks / kRegsThreads;  // 5
static_assert(kUnitChunks % kRegsThreads == 0, "whole items");

struct RegsItem {
  uint4 codes, e;
};
__device__ __forceinline__ void regs_load(const Prob& p, int u, RegsItem (&it)[kRegsItems]) {
  const int h = u / (p.S / kBN), j = u % (p.S / kBN);
#pragma unroll
  for (int i = 0; i < kRegsItems; ++i) {
    const int ci = static_cast<int>(threadIdx.x) + kRegsThreads * i;
    if (ci < kBN * kKc) {
      const int row = ci / kKc, c = ci % kKc, s = j * kBN + row;
      it[i].codes = __ldg(reinterpret_cast<const uint4*>(p.kc + (int64_t{s} * p.H + h) * kDk + 16 * c));
      it[i].e = make_uint4(__ldg(p.ks + (int64_t{h} * p.S + s) * (kDk / 32) + c / 2), 0, 0, 0);
    } else {
      const int cv = ci - kBN * kKc, row = cv / kVc, c = cv % kVc, s = j * kBN + row;
      it[i].codes = __ldg(reinterpret_cast<const uint4*>(p.vc + (int64_t{s} * p.H + h) * kDv + 16 * c));
      it[i].e = __ldg(reinterpret_cast<const uint4*>(p.vs + (int64_t{h} * (p.S / 32) + s / 32) * kDv + 16 * c));
    }
  }
}
// kConvert false: the same loads and stores with the codes copied into the words instead of
// converted (the memory traffic alone; its copies are not checked)
template <bool kConvert = true>
__global__ void __launch_bounds__(kRegsThreads, 1) regs_kernel(const Prob p) {
  const int units = p.H * (p.S / kBN);
  RegsItem cur[kRegsItems], nxt[kRegsItems];
  int u = blockIdx.x;
  if (u < units) regs_load(p, u, cur);
  for (; u < units; u += gridDim.x) {
    const int un = u + static_cast<int>(gridDim.x);
    if (un < units) regs_load(p, un, nxt);
    const int h = u / (p.S / kBN), j = u % (p.S / kBN);
#pragma unroll
    for (int i = 0; i < kRegsItems; ++i) {
      const int ci = static_cast<int>(threadIdx.x) + kRegsThreads * i;
      uint32_t w[8];
      uint4* o;
      if (ci < kBN * kKc) {
        const int row = ci / kKc, c = ci % kKc, s = j * kBN + row;
        if (kConvert) chunk_words(cur[i].codes, cur[i].e, true, w);
        o = reinterpret_cast<uint4*>(p.ko + (int64_t{h} * p.S + s) * kDk + 16 * c);
      } else {
        const int cv = ci - kBN * kKc, row = cv / kVc, c = cv % kVc, s = j * kBN + row;
        if (kConvert) chunk_words(cur[i].codes, cur[i].e, false, w);
        o = reinterpret_cast<uint4*>(p.vo + (int64_t{h} * p.S + s) * kDv + 16 * c);
      }
      if (!kConvert) {
        const uint4 x = cur[i].codes;
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w ^ cur[i].e.x, w[4] = x.x, w[5] = x.y, w[6] = x.z, w[7] = x.w;
      }
      o[0] = make_uint4(w[0], w[1], w[2], w[3]), o[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
#pragma unroll
    for (int i = 0; i < kRegsItems; ++i) cur[i] = nxt[i];
  }
}

// ---------------------------------------------------------------- tma: warp-specialized, bulk stores
constexpr int kIn = 3, kOut = 3, kConvWarps = 8, kTmaThreads = 64 + 32 * kConvWarps;
struct alignas(128) TmaSmem {
  uint8_t in[kIn][kKCodeBytes];
  uint8_t in_sc[kIn][kKScaleBytes];
  uint8_t out[kOut][kKCodeBytes * 2];
  uint64_t in_full[kIn], in_empty[kIn], out_full[kOut], out_empty[kOut];
};

__global__ void __launch_bounds__(kTmaThreads, 1)
    tma_kernel(const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, const Prob p) {
  extern __shared__ uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<TmaSmem*>((reinterpret_cast<uintptr_t>(smem_raw) + 127) & ~uintptr_t{127});
  constexpr int kConv = 32 * kConvWarps;
  const int halves = 2 * p.H * (p.S / kBN);  // half-unit n: unit n / 2, K (even) or V (odd)
  if (threadIdx.x == 0) {
    for (int i = 0; i < kIn; ++i) ptx::mbar_init(&sm.in_full[i], 1), ptx::mbar_init(&sm.in_empty[i], kConv);
    for (int i = 0; i < kOut; ++i) ptx::mbar_init(&sm.out_full[i], kConv), ptx::mbar_init(&sm.out_empty[i], 1);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  const int G = static_cast<int>(gridDim.x);
  if (threadIdx.x == 0) {  // loader
    uint32_t n = 0;
    for (int x = 2 * blockIdx.x; x < halves; x += (x & 1) ? 2 * G - 1 : 1, ++n) {
      const int s = n % kIn, u = x / 2, h = u / (p.S / kBN), j = u % (p.S / kBN);
      const bool kp = (x & 1) == 0;
      ptx::mbar_wait(&sm.in_empty[s], ((n / kIn) & 1) ^ 1);
      ptx::mbar_arrive_expect_tx(&sm.in_full[s], kp ? kKCodeBytes + kKScaleBytes : kVCodeBytes + kVScaleBytes);
      ptx::tma_load_3d(sm.in[s], kp ? &tk : &tv, &sm.in_full[s], 0, h, j * kBN);
      if (kp)
        ptx::bulk_load_g2s(sm.in_sc[s], p.ks + (int64_t{h} * p.S + j * kBN) * (kDk / 32), kKScaleBytes, &sm.in_full[s]);
      else
        ptx::bulk_load_g2s(sm.in_sc[s], p.vs + (int64_t{h} * (p.S / 32) + j * (kBN / 32)) * kDv, kVScaleBytes,
                           &sm.in_full[s]);
    }
  } else if (threadIdx.x == 32) {  // storer
    uint32_t n = 0;
    for (int x = 2 * blockIdx.x; x < halves; x += (x & 1) ? 2 * G - 1 : 1, ++n) {
      const int o = n % kOut, u = x / 2, h = u / (p.S / kBN), j = u % (p.S / kBN);
      const bool kp = (x & 1) == 0;
      ptx::mbar_wait(&sm.out_full[o], (n / kOut) & 1);
      if (kp)
        ptx::bulk_store_s2g(p.ko + (int64_t{h} * p.S + j * kBN) * kDk, sm.out[o], kKCodeBytes * 2);
      else
        ptx::bulk_store_s2g(p.vo + (int64_t{h} * p.S + j * kBN) * kDv, sm.out[o], kVCodeBytes * 2);
      ptx::bulk_commit();
      ptx::bulk_wait_read<kOut - 1>();  // the copy kOut - 1 half-units back has read its stage
      if (n >= kOut - 1) ptx::mbar_arrive(&sm.out_empty[(n - (kOut - 1)) % kOut]);
    }
    ptx::bulk_wait_all();
  } else if (threadIdx.x >= 64) {  // converters
    const int t = static_cast<int>(threadIdx.x) - 64;
    uint32_t n = 0;
    for (int x = 2 * blockIdx.x; x < halves; x += (x & 1) ? 2 * G - 1 : 1, ++n) {
      const int s = n % kIn, o = n % kOut;
      const bool kp = (x & 1) == 0;
      ptx::mbar_wait(&sm.in_full[s], (n / kIn) & 1);
      ptx::mbar_wait(&sm.out_empty[o], ((n / kOut) & 1) ^ 1);
      const int chunks = kp ? kBN * kKc : kBN * kVc;
      for (int ci = t; ci < chunks; ci += kConv) {  // codes at 16·ci, copies at 32·ci (row-major)
        const uint4 codes = *reinterpret_cast<const uint4*>(sm.in[s] + 16 * ci);
        uint4 e;
        if (kp) {
          e = make_uint4(sm.in_sc[s][(ci / kKc) * (kDk / 32) + (ci % kKc) / 2], 0, 0, 0);
        } else {
          e = *reinterpret_cast<const uint4*>(sm.in_sc[s] + (ci / kVc / 32) * kDv + 16 * (ci % kVc));
        }
        uint32_t w[8];
        chunk_words(codes, e, kp, w);
        uint4* dst = reinterpret_cast<uint4*>(sm.out[o] + 32 * ci);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]), dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
      }
      ptx::fence_proxy_async();  // the staging's generic writes before the bulk copy reads them
      ptx::mbar_arrive(&sm.in_empty[s]);
      ptx::mbar_arrive(&sm.out_full[o]);
    }
  }
}

}  // namespace mxmla::dev10

int main(int argc, char** argv) {
  using namespace mxmla;
  using namespace mxmla::dev10;
  const int sms = mxmla::dev::require_sm90("10_sm90_kv_convert_rate");
  const int H = 128, S = argc > 1 ? std::atoi(argv[1]) : 4096;
  if (S <= 0 || S % kBN != 0) {
    std::fprintf(stderr, "S must be a positive multiple of %d\n", kBN);
    return 2;
  }
  const size_t nk = size_t{H} * S * kDk, nv = size_t{H} * S * kDv;
  std::vector<uint8_t> hkc(nk), hvc(nv), hks(nk / 32), hvs(nv / 32);
  std::mt19937 rng(10);
  for (auto* v : {&hkc, &hvc})
    for (auto& c : *v) {
      c = static_cast<uint8_t>(rng());
      if ((c & 0x7F) == 0x7F) c ^= 1;  // no NaN codes: the fast path throughout
    }
  for (auto* v : {&hks, &hvs})
    for (auto& e : *v) e = static_cast<uint8_t>(110 + rng() % 30);
  uint8_t *kc, *vc, *ks, *vs;
  uint16_t *ko, *vo, *rk, *rv;
  DEV_CHECK_CUDA(cudaMalloc(&kc, nk));
  DEV_CHECK_CUDA(cudaMalloc(&vc, nv));
  DEV_CHECK_CUDA(cudaMalloc(&ks, nk / 32));
  DEV_CHECK_CUDA(cudaMalloc(&vs, nv / 32));
  DEV_CHECK_CUDA(cudaMalloc(&ko, nk * 2));
  DEV_CHECK_CUDA(cudaMalloc(&vo, nv * 2));
  DEV_CHECK_CUDA(cudaMalloc(&rk, nk * 2));
  DEV_CHECK_CUDA(cudaMalloc(&rv, nv * 2));
  DEV_CHECK_CUDA(cudaMemcpy(kc, hkc.data(), nk, cudaMemcpyHostToDevice));
  DEV_CHECK_CUDA(cudaMemcpy(vc, hvc.data(), nv, cudaMemcpyHostToDevice));
  DEV_CHECK_CUDA(cudaMemcpy(ks, hks.data(), nk / 32, cudaMemcpyHostToDevice));
  DEV_CHECK_CUDA(cudaMemcpy(vs, hvs.data(), nv / 32, cudaMemcpyHostToDevice));
  Prob ref{H, S, kc, vc, ks, vs, rk, rv}, p{H, S, kc, vc, ks, vs, ko, vo};
  const int64_t units = int64_t{H} * (S / kBN), chunks = units * kUnitChunks;
  ref_kernel<<<static_cast<unsigned>((chunks + 255) / 256), 256>>>(ref);
  DEV_CHECK_CUDA(cudaGetLastError());

  const cuuint64_t kdims[3] = {kDk, static_cast<cuuint64_t>(H), static_cast<cuuint64_t>(S)};
  const cuuint64_t kst[2] = {kDk, static_cast<cuuint64_t>(H) * kDk};
  const cuuint64_t vdims[3] = {kDv, static_cast<cuuint64_t>(H), static_cast<cuuint64_t>(S)};
  const cuuint64_t vst[2] = {kDv, static_cast<cuuint64_t>(H) * kDv};
  const cuuint32_t kbox[3] = {kDk, 1, kBN}, vbox[3] = {kDv, 1, kBN};
  const CUtensorMap tk = detail::make_tma_desc(kc, DType::kUInt8, 3, kdims, kst, kbox, CU_TENSOR_MAP_SWIZZLE_NONE);
  const CUtensorMap tv = detail::make_tma_desc(vc, DType::kUInt8, 3, vdims, vst, vbox, CU_TENSOR_MAP_SWIZZLE_NONE);
  const size_t tma_smem = sizeof(TmaSmem) + 128;
  DEV_CHECK_CUDA(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(tma_smem)));

  const auto check = [&](const char* name) {
    std::vector<uint16_t> a(nk), b(nk), c(nv), d(nv);
    DEV_CHECK_CUDA(cudaDeviceSynchronize());
    DEV_CHECK_CUDA(cudaMemcpy(a.data(), ko, nk * 2, cudaMemcpyDeviceToHost));
    DEV_CHECK_CUDA(cudaMemcpy(b.data(), rk, nk * 2, cudaMemcpyDeviceToHost));
    DEV_CHECK_CUDA(cudaMemcpy(c.data(), vo, nv * 2, cudaMemcpyDeviceToHost));
    DEV_CHECK_CUDA(cudaMemcpy(d.data(), rv, nv * 2, cudaMemcpyDeviceToHost));
    const bool ok = std::memcmp(a.data(), b.data(), nk * 2) == 0 && std::memcmp(c.data(), d.data(), nv * 2) == 0;
    std::printf("check %s: %s\n", name, ok ? "copies equal the reference's bits" : "MISMATCH");
    DEV_CHECK_CUDA(cudaMemset(ko, 0, nk * 2));
    DEV_CHECK_CUDA(cudaMemset(vo, 0, nv * 2));
    return ok;
  };
  bool ok = true;
  regs_kernel<true><<<sms, kRegsThreads>>>(p);
  DEV_CHECK_CUDA(cudaGetLastError());
  ok &= check("regs, all SMs");
  regs_kernel<true><<<3, kRegsThreads>>>(p);
  ok &= check("regs, 3 CTAs");
  tma_kernel<<<sms, kTmaThreads, tma_smem>>>(tk, tv, p);
  DEV_CHECK_CUDA(cudaGetLastError());
  ok &= check("tma, all SMs");
  tma_kernel<<<3, kTmaThreads, tma_smem>>>(tk, tv, p);
  ok &= check("tma, 3 CTAs");

  const double bytes = double(nk + nv) * 3 + double(nk + nv) / 32;  // codes + scales read, copies written
  util::DeviceBuffer ca(static_cast<size_t>(bytes / 2)), cb(static_cast<size_t>(bytes / 2));
  tool::GpuTimer timer(20);
  const float copy_ms = timer.median_ms([&] { DEV_CHECK_CUDA(cudaMemcpyAsync(cb.ptr, ca.ptr, ca.bytes, cudaMemcpyDeviceToDevice)); });
  std::printf("K / V conversion, H %d, S %d: %.1f MB moved; device copy of as many bytes (read + written): %.4f ms, "
              "%.0f GB/s\n", H, S, bytes / 1e6, copy_ms, bytes / copy_ms / 1e6);
  std::printf("| CTAs | regs ms | regs GB/s | regs GB/s a CTA | tma ms | tma GB/s | tma GB/s a CTA | regs, no conversion: ms | GB/s a CTA |\n|---|---|---|---|---|---|---|---|---|\n");
  for (int g : {1, 2, 4, 8, 12, 16, 32, 66, sms}) {
    if (g > sms) continue;
    const float r = timer.median_ms([&] { regs_kernel<true><<<g, kRegsThreads>>>(p); });
    const float t = timer.median_ms([&] { tma_kernel<<<g, kTmaThreads, tma_smem>>>(tk, tv, p); });
    const float m = timer.median_ms([&] { regs_kernel<false><<<g, kRegsThreads>>>(p); });
    std::printf("| %d | %.4f | %.0f | %.1f | %.4f | %.0f | %.1f | %.4f | %.1f |\n", g, r, bytes / r / 1e6, bytes / r / 1e6 / g, t,
                bytes / t / 1e6, bytes / t / 1e6 / g, m, bytes / m / 1e6 / g);
  }
  DEV_CHECK_CUDA(cudaGetLastError());
  tma_kernel<<<sms, kTmaThreads, tma_smem>>>(tk, tv, p);
  ok &= check("tma after the timings");
  return ok ? 0 : 1;
}
