// mxmla internal — the probe interface of the persistent kernels. A kernel takes a
// Probe template parameter and calls it at fixed points (a phase's start or end per tile, the time
// spent waiting on a barrier, a CTA's start and end); the default, NoProbe, compiles to nothing,
// so production builds carry no measurement code. Probes that record (clock64 stamps, the global
// timer) are experiments and live in dev/cuda/.
#pragma once

#include <cstdint>

namespace mxmla::detail {

struct NoProbe {
  static constexpr bool kOn = false;
  __device__ __forceinline__ static constexpr unsigned long long clock() { return 0; }
  // stamp slot `slot` of the CTA's n-th tile with the clock / a value
  __device__ __forceinline__ static void stamp(uint32_t, int) {}
  __device__ __forceinline__ static void stamp_value(uint32_t, int, unsigned long long) {}
  // one thread of the CTA: its start, its end after `tiles` tiles, the end of its MMA warps' work
  __device__ __forceinline__ static void cta_begin() {}
  __device__ __forceinline__ static void cta_end(uint32_t) {}
  __device__ __forceinline__ static void mma_end() {}
};

}  // namespace mxmla::detail
