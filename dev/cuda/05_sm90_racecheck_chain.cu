// Experiment 05 — does compute-sanitizer's racecheck follow the attention backward's stage-reuse
// chain? The SM90 backward kernel (src/cuda/sm90_attention_bwd.cu) reuses a two-stage buffer: the
// producer warpgroup loads tile t into stage t % 2 by cp.async; consumer warpgroup c stores its dQ
// part over that stage (st.shared), passes its warpgroup's named barrier, and one issuer thread adds
// the part to global memory with a bulk reduction; at tile t + 1 the issuer waits for the reduction
// to have read shared memory and arrives on the stage's empty mbarrier; the producer waits on it
// before loading tile t + 2 into the stage. racecheck reports write-write hazards between those
// loads and stores on the real kernel (docs/notes-attention.md, backward). This driver has the
// same chain and nothing else, in four modes:
//   0  as the kernel: stores -> named barrier -> issuer's bulk reduction, wait for its read (next
//      tile) -> issuer's arrival on empty -> producer's wait -> cp.async loads
//   1  the same without the bulk reduction (the issuer arrives after the named barrier, next tile)
//   2  as 0, but after the issuer's wait a named barrier, then lane 0 of every consumer warp arrives
//      (count 8), not the issuer
//   3  as 2, but every consumer thread arrives itself (count 256)
// A mode racecheck passes and the kernel's mode fails says which link it does not follow.
// Result (2026-12-02, H200, compute-sanitizer of CUDA 13.0): with 3 or more tiles racecheck reports
// hazards for modes 0, 1 and 2 and none for mode 3 — it orders a store before another thread's
// accesses through an mbarrier only when the storing thread arrives itself. The kernel now releases
// its stages that way (docs/notes-attention.md, backward).
// Usage (GPU machine): dev/scripts/racecheck-chain, or
//   compute-sanitizer --tool racecheck build/dev/05_sm90_racecheck_chain MODE [TILES]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/mbarrier.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/warpgroup.cuh"

namespace dev05 {
using namespace mxmla;

constexpr int kThreads = 384;
constexpr int kStageBytes = 16384;             // a stage: [2 consumers][8192 bytes]
constexpr int kPartBytes = kStageBytes / 2;    // a consumer's part: 128 threads x 64 bytes

struct Smem {
  alignas(128) uint8_t stage[2][kStageBytes];
  uint64_t full[2], empty[2];
};

__global__ void __launch_bounds__(kThreads, 1) chain(const uint8_t* src, float* acc, int tiles, int mode) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = static_cast<int>(threadIdx.x), wg = tid / 128;
  const uint32_t empty_count = mode == 2 ? 8u : mode == 3 ? 256u : 2u;
  if (tid == 0) {
    for (int i = 0; i < 2; ++i) ptx::mbar_init(&sm.full[i], 128), ptx::mbar_init(&sm.empty[i], empty_count);
    ptx::fence_barrier_init();
  }
  __syncthreads();
  if (wg == 0) {  // producer: tile t into stage t % 2, 16 bytes a copy, 8 copies a thread
    for (int t = 0; t < tiles; ++t) {
      const int st = t & 1;
      if (t >= 2) ptx::mbar_wait(&sm.empty[st], static_cast<uint32_t>(((t >> 1) - 1) & 1));
      for (int i = 0; i < kStageBytes / 16 / 128; ++i) {
        const int off = (i * 128 + tid) * 16;
        ptx::cp_async<16>(&sm.stage[st][off], src + static_cast<size_t>(t) * kStageBytes + off, 16u);
      }
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      ptx::fence_proxy_async();
      ptx::mbar_arrive(&sm.full[st]);
    }
    return;
  }
  const int c = wg - 1, r = tid % 128;
  const bool issuer = r == 0;
  for (int t = 0; t < tiles; ++t) {
    const int st = t & 1;
    ptx::mbar_wait(&sm.full[st], static_cast<uint32_t>((t >> 1) & 1));
    if (t > 0) {  // the previous tile's part has been read: its stage is free
      if (issuer && mode != 1) ptx::bulk_wait_read_all();
      if (mode >= 2) ptx::named_barrier(2 + c, 128);  // (the issuer's wait before the others' arrivals)
      if (mode == 3 || (mode == 2 && r % 32 == 0) || (mode < 2 && issuer)) ptx::mbar_arrive(&sm.empty[st ^ 1]);
    }
    // this consumer's part over the stage (the kernel's dQ staging): 64 bytes a thread
    float* part = reinterpret_cast<float*>(&sm.stage[st][c * kPartBytes]);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      ptx::st_shared_v2_f32(ptx::smem_u32(part + 2 * (i * 128 + r)), static_cast<float>(t), static_cast<float>(i));
    ptx::fence_proxy_async();
    ptx::named_barrier(2 + c, 128);
    if (issuer && mode != 1) {
      ptx::bulk_reduce_add_f32_s2g(acc + c * (kPartBytes / 4), part, kPartBytes);
      ptx::bulk_commit();
    }
  }
  if (issuer) ptx::bulk_wait_all();
}
}  // namespace dev05

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0, tiles = argc > 2 ? std::atoi(argv[2]) : 8;
  if (mode < 0 || mode > 3 || tiles < 1) {
    std::fprintf(stderr, "usage: %s MODE(0-3) [TILES>=1]\n", argv[0]);
    return 2;
  }
  uint8_t* src = nullptr;
  float* acc = nullptr;
  cudaMalloc(&src, static_cast<size_t>(tiles) * dev05::kStageBytes);
  cudaMalloc(&acc, dev05::kStageBytes);
  cudaMemset(src, 0, static_cast<size_t>(tiles) * dev05::kStageBytes);
  cudaMemset(acc, 0, dev05::kStageBytes);
  const int smem = static_cast<int>(sizeof(dev05::Smem));
  cudaFuncSetAttribute(dev05::chain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  dev05::chain<<<1, dev05::kThreads, smem>>>(src, acc, tiles, mode);
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("mode %d, %d tiles: %s\n", mode, tiles, cudaGetErrorString(e));
  cudaFree(src);
  cudaFree(acc);
  return e == cudaSuccess ? 0 : 1;
}
