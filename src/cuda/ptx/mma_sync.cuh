// mxmla internal — inline PTX: warp-level tensor-core MMA (mma.sync, sm_80+) and the ldmatrix
// loads that feed it (sm_75+), for kernels that tile with one warp per 16-row block (FA2 style)
// instead of wgmma warpgroups.
//
// Fragments of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (g = lane / 4, t = lane % 4):
//   A 16x16 (4 regs, bf16x2, low half = even column):  a0 (row g, cols 2t, 2t+1)
//        a1 (row g+8, cols 2t, 2t+1)  a2 (row g, cols 2t+8, +9)  a3 (row g+8, cols 2t+8, +9)
//   B 16x8  (2 regs): b0 (k 2t, 2t+1; col g)  b1 (k 2t+8, +9; col g)
//   C 16x8  (4 fp32): c0, c1 (row g, cols 2t, 2t+1)  c2, c3 (row g+8, cols 2t, 2t+1)
// ldmatrix .x4: lane l gives the shared address of row l % 8 of 8x8 matrix l / 8 (16 contiguous
// bytes); register i receives matrix i's (row g, cols 2t, 2t+1), or with .trans its
// (rows 2t, 2t+1; col g), the B layout read from a k-major [k][n] tile.
// (warpgroup.cuh has the generic-pointer ldmatrix_x4; these take shared-window addresses.)
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
#error "mxmla: mma.sync with bf16 operands needs sm_80 or newer; build for sm_90a"
#endif

namespace mxmla::ptx {

__device__ __forceinline__ void ldmatrix_x4(uint32_t row_addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(row_addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t row_addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(row_addr)
               : "memory");
}

// c += A · B (16x8x16, bf16 in, fp32 accumulate).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace mxmla::ptx
