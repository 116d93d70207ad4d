// mxmla internal — SM90 part: the mainloop of a warp-specialized FP8 GEMM tile with block scales
// along K (the DeepSeek-V3 recipe: 1 x 128 blocks of A, 128 x 128 blocks of B — or, with
// kColFactors, 1 x 128 blocks of B too, as wgrad's xᵀ has).
//
//   acc[kBM x kBN] = Σ_kb (A_kb · B_kbᵀ) ⊙ (sa_kb ⊗ sb_kb)     A [kBM x K], B [kBN x K] E4M3, K-major
//
// with kb the 128-wide blocks of K: sa_kb one fp32 factor per row of A, sb_kb one per 128 rows of B
// (kColFactors: one per row of B, i.e. per column of the tile: the fold then takes an FMUL and an
// FFMA per element).
// The producer is MainloopTmaWgmma's (one stage = one 128-byte swizzle row = exactly one block of
// K). Each consumer warpgroup multiplies its 64 rows in column slices of kSubN: the four FP8 wgmmas
// (K = 32 each) of a slice go into a temporary accumulator, and once they have retired it is folded
// into the fp32 accumulator with the row's and the slice's factors, acc += tmp · (sa · sb): one FMUL
// per row and one FFMA per element for every 128 of K, on the CUDA cores, while the other
// warpgroup's wgmmas keep the tensor cores busy. A slice never straddles two blocks of B's rows
// (kSubN divides the caller's block boundaries). Precision: the 128 products of a block are exact,
// the tensor cores add them in their own reduced precision (DeepSeek-V3 §3.3.2), every sum across
// blocks is fp32 (the "promotion" of DeepGEMM's sm90_fp8_gemm_1d2d, whose code is not used here).
#pragma once

#include <cstdint>

#include "cuda/probe.cuh"
#include "cuda/ptx/mma_sync.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/mainloop_tma_wgmma.cuh"

namespace mxmla::sm90 {

// kRegA (an experiment, off): each k-block's A rows are loaded into registers once (ldmatrix) and
// every slice's wgmmas read them there, so that shared memory serves B alone (off: A is re-read
// from shared memory by every slice). Measured in the fused Q up-projection: 1.075-1.084x the time, its 16
// more registers spilled (docs/notes-qproj.md).
// kPipelined (an experiment, off): two temporary accumulators, slice s + 1's wgmmas issued before
// slice s is folded (off: each slice's wgmmas retire before its fold, the other warpgroup's keep
// the tensor cores busy meanwhile). Measured in the block-FP8 GEMM (docs/notes-gemm.md): with
// 64-column slices 0.93-0.96x the time, but 128-column slices without it are faster (0.85-0.90x),
// and the two together do not fit the registers.
template <int kBM_, int kBN_, int kStages_, int kMmaWGs_, int kSubN_, bool kColFactors = false, bool kRegA = false,
          bool kPipelined = false>
struct MainloopTmaWgmmaBlockScaled {
  // The ring, the barriers and the producer: the plain mainloop's with FP8 operands (kBK = 128 bytes).
  using Ring = MainloopTmaWgmma<kBM_, kBN_, 128, kStages_, kMmaWGs_, ptx::MmaDtype::kE4M3, ptx::MmaDtype::kE4M3>;
  static constexpr int kBM = kBM_, kBN = kBN_, kBK = 128, kStages = kStages_, kMmaWGs = kMmaWGs_, kSubN = kSubN_;
  static constexpr int kSlices = kBN / kSubN;
  static constexpr int kAcc = kBN / 2, kSubAcc = kSubN / 2;  // accumulators per thread: the tile's, a slice's
  using Op = ptx::WgmmaOp<kSubN, ptx::MmaDtype::kE4M3, ptx::MmaDtype::kE4M3, kRegA>;
  static_assert(kBN % kSubN == 0, "whole slices");
  static_assert(!(kRegA && kPipelined), "one experiment at a time");
  static_assert((kSubN * kBK) % 1024 == 0, "a slice of B starts on a 1024-byte swizzle atom");
  static_assert(Op::kK == 32 && kBK / Op::kK == 4, "four wgmmas per stage (32 bytes = 2 descriptor units each)");

  using State = typename Ring::State;
  using Barriers = typename Ring::Barriers;
  using SharedStorage = typename Ring::SharedStorage;
  static constexpr uint32_t kStageBytes = Ring::kStageBytes;
  // a stage's release: lane 0 of every consumer warp; kColFactors every consumer thread (each has
  // read the stage's column factors, a table the caller writes beside the ring)
  static constexpr int kConsumerArrivals = kColFactors ? 128 * kMmaWGs : Ring::kConsumerArrivals;

  template <class Probe, class Issue>
  __device__ __forceinline__ static void produce(SharedStorage& sm, Barriers& bars, State& st, int kblocks, uint32_t n,
                                                 Issue&& issue) {
    Ring::template produce<Probe>(sm, bars, st, kblocks, n, issue);
  }

  struct Consumer {
    uint64_t da0, db0;
    uint32_t a_row;  // kRegA: this lane's ldmatrix row of the warpgroup's A tile in stage 0 (shared address)
    static constexpr uint32_t kAStep = sizeof(SharedStorage::a[0]) / 16, kBStep = sizeof(SharedStorage::b[0]) / 16;
    static constexpr uint32_t kSliceStep = kSubN * kBK / 16;  // descriptor units between slices of B

    __device__ __forceinline__ Consumer(const SharedStorage& sm, int cw)
        : da0(ptx::wgmma_desc_k_sw128(sm.a[0] + 64 * cw * kBK)),
          db0(ptx::wgmma_desc_k_sw128(sm.b[0])),
          // matrix l / 8 of an ldmatrix.x4: rows 8 ((l / 8) % 2) .. + 7 of the warp's 16
          a_row(ptx::smem_u32(sm.a[0] + (64 * cw + 16 * ((threadIdx.x / 32) % 4) + 8 * ((threadIdx.x / 8) % 2) +
                                         threadIdx.x % 8) * kBK)) {}

    // The k-block's A fragments (kRegA): k-step k's 32 bytes of the thread's rows r0, r0 + 8 as the
    // wgmma's register operand wants them (a[k][0 | 1]: bytes 0..15 of rows r0 | r0 + 8, a[k][2 | 3]
    // bytes 16..31), from the 128-byte-swizzled tile (16-byte chunk c of row r at c ^ (r % 8)).
    __device__ __forceinline__ void load_a(int stage, uint32_t (&a)[4][4]) const {
      const uint32_t row = a_row + stage * uint32_t(sizeof(SharedStorage::a[0]));
      const uint32_t l = threadIdx.x % 32;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        ptx::ldmatrix_x4(row + (((2 * k + l / 16) ^ (l % 8)) << 4), a[k][0], a[k][1], a[k][2], a[k][3]);
    }

    struct NoColFactors {
      __device__ __forceinline__ float2 operator()(uint32_t, int, int) const { return make_float2(0.f, 0.f); }
    };

    // acc = the tile's block-scaled product over kblocks blocks of K (overwritten). factors(kb, fr,
    // fs) gives block kb's factors: fr[h] for the thread's rows r0 + 8 h (r0 = 16 · warp + lane / 4 of
    // the warpgroup's 64), fs[s] for slice s of the columns; it is called before the block's stage is
    // waited for (its loads hit L1 after a tile's first block: a row's factors are adjacent).
    // kColFactors: fs is not used; col_factors(stage, s, j) gives the factors (float2) of the thread's
    // columns 8 j + 2 (lane % 4) + {0, 1} of slice s (stage: the ring slot of the block, waited for
    // already), called as the slice is folded (two registers live, not a slice's 16).
    // Returns with every wgmma retired and every stage released.
    template <class Probe, class Factors, class ColFactors = NoColFactors>
    __device__ __forceinline__ void mma(Barriers& bars, State& st, int kblocks, float (&acc)[kAcc], Factors&& factors,
                                        bool stamps, uint32_t n, ColFactors&& col_factors = {}) const {
      const int lane = threadIdx.x % 32;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
      unsigned long long waited = 0;  // (probes only)
      for (int kb = 0; kb < kblocks; ++kb) {
        float fr[2], fs[kSlices];
        factors(kb, fr, fs);
        const unsigned long long w0 = Probe::clock();
        bars.consumer_wait(st);
        waited += Probe::clock() - w0;
        const uint64_t da = da0 + st.index * kAStep, db = db0 + st.index * kBStep;
        uint32_t a[4][4];
        if constexpr (kRegA) load_a(st.index, a);
        // hand the stage back (kConsumerArrivals)
        auto release = [&](uint32_t index) {
          if (kColFactors || lane == 0) bars.consumer_release(index);
        };
        // fold a slice's retired temporary accumulator into acc with its factors
        auto fold = [&](int s, float (&tmp)[kSubAcc]) {
#pragma unroll
          for (int i = 0; i < kSubAcc; ++i) ptx::fence_reg(tmp[i]);
          if constexpr (kColFactors) {
#pragma unroll
            for (int j = 0; j < kSubN / 8; ++j) {  // elements 4 j + 2 h + e: row r0 + 8 h, column 8 j + 2 (lane % 4) + e
              const float2 fc = col_factors(st.index, s, j);
#pragma unroll
              for (int i = 4 * j; i < 4 * j + 4; ++i) {
                const int a = s * kSubAcc + i;
                acc[a] = fmaf(tmp[i], fr[(i / 2) % 2] * (i % 2 ? fc.y : fc.x), acc[a]);
              }
            }
          } else {
            const float f0 = fr[0] * fs[s], f1 = fr[1] * fs[s];
#pragma unroll
            for (int i = 0; i < kSubAcc; ++i) {  // element i: row r0 + 8 ((i / 2) % 2)
              const int a = s * kSubAcc + i;
              acc[a] = fmaf(tmp[i], (i & 2) ? f1 : f0, acc[a]);
            }
          }
        };
        auto issue = [&](int s, float (&tmp)[kSubAcc]) {
          ptx::wgmma_fence();
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if constexpr (kRegA) Op::mma(tmp, a[k], db + s * kSliceStep + 2 * k, k > 0);
            else Op::mma(tmp, da + 2 * k, db + s * kSliceStep + 2 * k, k > 0);
          }
          ptx::wgmma_commit();
        };
        if constexpr (kPipelined) {  // slice s + 1's wgmmas run while slice s is folded
          float tmp[2][kSubAcc];
#pragma unroll
          for (int s = 0; s < kSlices; ++s) {
            issue(s, tmp[s % 2]);
            if (s > 0) {
              ptx::wgmma_wait<1>();
              fold(s - 1, tmp[(s - 1) % 2]);
            }
          }
          ptx::wgmma_wait<0>();
          if constexpr (!kColFactors) release(st.index);  // the stage is read (its factors are in registers)
          fold(kSlices - 1, tmp[(kSlices - 1) % 2]);
          if constexpr (kColFactors) release(st.index);  // ... and its column factors
        } else {
#pragma unroll
          for (int s = 0; s < kSlices; ++s) {
            float tmp[kSubAcc];
            issue(s, tmp);
            ptx::wgmma_wait<0>();
            if (!kColFactors && s == kSlices - 1) release(st.index);  // the stage is read
            fold(s, tmp);
            if (kColFactors && s == kSlices - 1) release(st.index);  // ... and its column factors
          }
        }
        st.advance();
      }
      if (stamps) Probe::stamp(n, 1), Probe::stamp_value(n, 15, waited);
    }
  };
};

}  // namespace mxmla::sm90
