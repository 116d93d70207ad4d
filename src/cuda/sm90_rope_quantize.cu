// mxmla — RoPE backward fused with MXFP8 quantization for SM90 (rope_backward_quantize).
//
// dq [tokens, H, D] (any of sbhd / bshd / thd, strided) -> dx = R^T dq in fp32 -> E4M3/E5M2 codes
// and E8M0 scales of dx viewed as [tokens, H*D], rowwise and/or columnwise, plus an optional bf16 /
// fp32 copy of dx. A tile is 32 tokens x one head (the columnwise block height x a head, so every
// RoPE partner and every block is inside the tile); tiles are numbered head-fastest, so the
// heads of a token tile share table rows, which stay in cache while a block walks them.
// Persistent blocks of 4 warps stream tiles through a kStages-deep cp.async ring of raw input
// tiles (no registers held by loads in flight) and, per tile:
//   2. RoPE backward in fp32 (nope elements pass through): raw tile -> shared fp32 tile [32][D + 4];
//   3. rowwise: lane pairs share a 32-element block (amax combined by one shuffle), each lane
//      converts 16 elements, so each store instruction writes whole 32-byte sectors;
//   4. columnwise: a lane owns 4 columns of 8 rows; 4 lanes combine a 32-row amax by shuffles;
//   5. the optional dx copy.
// Codes, amax and scales follow the quantize kernel's rules exactly (SPEC §2), on the fp32 values.
// Index math is 32-bit (the launcher checks tokens and tiles fit).
#include "common/mxfp8_common.h"
#include "cuda/ptx.cuh"
#include "cuda/sm90_rope_common.cuh"

#include <algorithm>

namespace mxmla::detail {
namespace {

using namespace rope_dev;

// Tile configuration.
constexpr int kThreads = 128;
constexpr int kRows = 32;    // tokens per tile = the MXFP8 block along the columnwise axis
#ifndef MXMLA_ROPEQ_STAGES
#define MXMLA_ROPEQ_STAGES 2
#endif
constexpr int kStages = MXMLA_ROPEQ_STAGES;  // raw tiles k+1 .. k+kStages-1 load while tile k is processed
static_assert(kStages >= 2, "the ring needs a stage to fill while one is processed");
constexpr int kPad = 4;      // fp32 row pitch D + 4: consecutive rows start 4 banks apart
constexpr int kMaxD = static_cast<int>(kRopeQuantizeMaxHeadDim);
static_assert(kMaxD % 32 == 0, "heads are whole MXFP8 blocks");
static_assert(kThreads % 64 == 0, "rowwise / columnwise loops assume warp-uniform bounds");

template <typename T>
size_t raw_bytes(int64_t D) { return static_cast<size_t>(kRows * D) * sizeof(T); }
template <typename T>
size_t smem_bytes(int64_t D) {
  return kStages * raw_bytes<T>(D) + static_cast<size_t>(kRows * (D + kPad)) * sizeof(float);
}

__device__ __forceinline__ uint16_t cvt2(bool e4m3, float a, float b) {
  return e4m3 ? ptx::cvt_fp8x2<true>(a, b) : ptx::cvt_fp8x2<false>(a, b);
}
__device__ __forceinline__ uint32_t mag_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

struct Tile {
  int h, t0, nrows;  // head, first token, tokens present (0: past the end)
};
__device__ __forceinline__ Tile tile_at(const RopeKernelParams& p, int ntok, int64_t idx, int64_t end) {
  if (idx >= end) return {0, 0, 0};
  const int i = static_cast<int>(idx), H = static_cast<int>(p.H);
  const int t0 = (i / H) * kRows;
  return {i % H, t0, min(kRows, ntok - t0)};
}

// Token (s, b) of token index t, 32-bit.
__device__ __forceinline__ void token_sb(const RopeKernelParams& p, int t, int& s, int& b) {
  if (p.B == 1) s = t, b = 0;
  else if (p.sbhd) s = t / static_cast<int>(p.B), b = t % static_cast<int>(p.B);
  else b = t / static_cast<int>(p.S), s = t % static_cast<int>(p.S);
}

// cp.async of a tile's rows (D elements of head h for 32 tokens) into a raw stage [32][D].
template <typename T>
__device__ __forceinline__ void issue_tile(const RopeKernelParams& p, const Tile& t, T* stage, int tid) {
  const int cpr = static_cast<int>(p.D) * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
  for (int c = tid; c < t.nrows * cpr; c += kThreads) {
    const int r = c / cpr, k = c % cpr;
    int s, b;
    token_sb(p, t.t0 + r, s, b);
    const char* src = reinterpret_cast<const char*>(static_cast<const T*>(p.in) + s * p.in_st[0] + b * p.in_st[1] +
                                                    t.h * p.in_st[2]);
    ptx::cp_async<16>(reinterpret_cast<char*>(stage) + c * 16, src + 16 * k, 16);
  }
}

// Phase 2: raw stage -> fp32 tile (RoPE backward on the rope part). Unit u = (row, 16 elements).
template <typename T, typename TT>
__device__ __forceinline__ void rope_to_tile(const RopeKernelParams& p, const Tile& t, const T* raw, float* tile,
                                             const int64_t* cu, int64_t ncu, int tid) {
  const int D = static_cast<int>(p.D), R = static_cast<int>(p.R), nope = D - R, half = R / 2, pitch = D + kPad;
  const int upr = D / 16, nope_units = nope / 16;
  const SetChoice sc = sets_of(p.style, true);
  for (int u = tid; u < t.nrows * upr; u += kThreads) {
    const int r = u / upr, k = u % upr;
    const T* xr = raw + r * D;
    float in[16], o[16];
    const float* v = in;
    int o0, o1;
    if (k < nope_units) {
      o0 = 16 * k, o1 = 16 * k + 8;
      unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + o0), in);
      unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + o1), in + 8);
    } else {
      const int q = k - nope_units;
      unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + nope + set_part(sc.in_c, q, half, 0)), in);
      unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + nope + set_part(sc.in_c, q, half, 1)), in + 8);
      int s, b;
      token_sb(p, t.t0 + r, s, b);
      const int64_t row = table_row(p, cu, ncu, t.t0 + r, s);
      float c[16], sn[16];
      load_table16<TT>(p.cos, row, p.tab_row_stride, sc.tab_c, q, half, c);
      load_table16<TT>(p.sin, row, p.tab_row_stride, sc.tab_c, q, half, sn);
      rotate16(p.style, true, in, c, sn, o);
      o0 = nope + set_part(sc.out_c, q, half, 0), o1 = nope + set_part(sc.out_c, q, half, 1);
      v = o;
    }
    float* trow = tile + r * pitch;
    reinterpret_cast<float4*>(trow + o0)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(trow + o0)[1] = make_float4(v[4], v[5], v[6], v[7]);
    reinterpret_cast<float4*>(trow + o1)[0] = make_float4(v[8], v[9], v[10], v[11]);
    reinterpret_cast<float4*>(trow + o1)[1] = make_float4(v[12], v[13], v[14], v[15]);
  }
}

// Phase 3: rowwise. Unit u = (half of a block, row, block): 2D units, a multiple of 64.
__device__ __forceinline__ void rowwise(const RopeQuantizeParams& P, const Tile& t, const float* tile, int tid) {
  const int D = static_cast<int>(P.rope.D), pitch = D + kPad;
  const bool e4m3 = P.fmt == Fp8Format::kE4M3;
  const uint32_t rcp = e4m3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * D;
  for (int u = tid; u < 2 * D; u += kThreads) {
    const int odd = u & 1, r = (u >> 1) & 31, blk = u >> 6;
    const float4* src = reinterpret_cast<const float4*>(tile + r * pitch + 32 * blk + 16 * odd);
    float v[16];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 f = src[k];
      v[4 * k] = f.x, v[4 * k + 1] = f.y, v[4 * k + 2] = f.z, v[4 * k + 3] = f.w;
      m = max(max(m, max(mag_bits(f.x), mag_bits(f.y))), max(mag_bits(f.z), mag_bits(f.w)));
    }
    m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));  // rows past the end hold stale data: never stored
    const uint8_t e = block_scale_from_amax_bits(m, rcp);
    const float mul = e8m0_quant_multiplier(e);
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = cvt2(e4m3, v[4 * k] * mul, v[4 * k + 1] * mul) |
             (static_cast<uint32_t>(cvt2(e4m3, v[4 * k + 2] * mul, v[4 * k + 3] * mul)) << 16);
    if (r < t.nrows) {
      const int64_t row = t.t0 + r;
      __stcs(reinterpret_cast<uint4*>(P.row_codes + row * HD + col0 + 32 * blk + 16 * odd),
             make_uint4(w[0], w[1], w[2], w[3]));
      if (!odd) P.row_scales[cursor_offset(row_cursor(P.row_map, 0, col0 / 32 + blk), row)] = e;
    }
  }
}

// Phase 4: columnwise. Unit u = (4 columns, 8 rows); lanes 8 apart share columns; D units.
__device__ __forceinline__ void columnwise(const RopeQuantizeParams& P, const Tile& t, const float* tile, int tid) {
  const int D = static_cast<int>(P.rope.D), pitch = D + kPad;
  const bool e4m3 = P.fmt == Fp8Format::kE4M3;
  const uint32_t rcp = e4m3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * D;
  for (int u = tid; u < D; u += kThreads) {
    const int lane = u & 31, part = lane >> 3, cg = (u >> 5) * 8 + (lane & 7);
    float4 v[8];
    uint32_t m[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * part + i;
      v[i] = *reinterpret_cast<const float4*>(tile + r * pitch + 4 * cg);
      if (r < t.nrows) {
        m[0] = max(m[0], mag_bits(v[i].x)), m[1] = max(m[1], mag_bits(v[i].y));
        m[2] = max(m[2], mag_bits(v[i].z)), m[3] = max(m[3], mag_bits(v[i].w));
      }
    }
    float mul[4];
    uint32_t scales = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      m[j] = max(m[j], __shfl_xor_sync(0xFFFFFFFFu, m[j], 8));
      m[j] = max(m[j], __shfl_xor_sync(0xFFFFFFFFu, m[j], 16));
      const uint8_t e = block_scale_from_amax_bits(m[j], rcp);
      scales |= static_cast<uint32_t>(e) << (8 * j);
      mul[j] = e8m0_quant_multiplier(e);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * part + i;
      if (r < t.nrows) {
        const uint32_t w = cvt2(e4m3, v[i].x * mul[0], v[i].y * mul[1]) |
                           (static_cast<uint32_t>(cvt2(e4m3, v[i].z * mul[2], v[i].w * mul[3])) << 16);
        __stcs(reinterpret_cast<unsigned int*>(P.col_codes + (t.t0 + r) * HD + col0 + 4 * cg), w);
      }
    }
    if (part == 0) {
      const ScaleCursor cc = col_cursor(P.col_map, 0, t.t0 / kRows, col0 + 4 * cg);
      uint8_t* d0 = P.col_scales + cursor_offset(cc, 0);
      if (cc.compact && reinterpret_cast<uintptr_t>(d0) % 4 == 0) {
        *reinterpret_cast<uint32_t*>(d0) = scales;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) P.col_scales[cursor_offset(cc, j)] = static_cast<uint8_t>(scales >> (8 * j));
      }
    }
  }
}

// Phase 5: the dx copy (contiguous, token order).
__device__ __forceinline__ void copy_dx(const RopeQuantizeParams& P, const Tile& t, const float* tile, int tid) {
  const int D = static_cast<int>(P.rope.D), pitch = D + kPad;
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * D;
  for (int u = tid; u < t.nrows * (D / 8); u += kThreads) {
    const int r = u / (D / 8), c8 = u % (D / 8);
    const float4* src = reinterpret_cast<const float4*>(tile + r * pitch + 8 * c8);
    const float4 a = src[0], b = src[1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const int64_t off = (t.t0 + r) * HD + col0 + 8 * c8;
    if (P.dx_t == DType::kFloat32) store_raw8<float>(static_cast<float*>(P.dx) + off, pack8<float>(v));
    else store_raw8<__nv_bfloat16>(static_cast<__nv_bfloat16*>(P.dx) + off, pack8<__nv_bfloat16>(v));
  }
}

template <typename T, typename TT>
__global__ void __launch_bounds__(kThreads) sm90_rope_quantize_kernel(const RopeQuantizeParams P, const int64_t* cu,
                                                                      int64_t ncu, int ntiles) {
  extern __shared__ __align__(16) float smem[];  // [kStages][32][D] raw T, then [32][D + kPad] fp32
  const RopeKernelParams& p = P.rope;
  const int tid = threadIdx.x, ntok = static_cast<int>(p.S * p.B);
  const int stage_elems = kRows * static_cast<int>(p.D);
  T* raw = reinterpret_cast<T*>(smem);
  float* tile = reinterpret_cast<float*>(raw + kStages * stage_elems);
  // Block b walks the contiguous tile range [lo, hi): runs of H tiles share their token rows, so
  // the table rows stay in L1 while the block walks the heads.
  const int64_t lo = blockIdx.x * static_cast<int64_t>(ntiles) / gridDim.x;
  const int64_t hi = (blockIdx.x + 1) * static_cast<int64_t>(ntiles) / gridDim.x;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const Tile t = tile_at(p, ntok, lo + s, hi);
    if (t.nrows > 0) issue_tile<T>(p, t, raw + s * stage_elems, tid);
    ptx::cp_async_commit();
  }
  for (int64_t k = 0; lo + k < hi; ++k) {
    const Tile tn = tile_at(p, ntok, lo + k + kStages - 1, hi);  // refills the stage of tile k - 1
    if (tn.nrows > 0) issue_tile<T>(p, tn, raw + ((k + kStages - 1) % kStages) * stage_elems, tid);
    ptx::cp_async_commit();             // one group per step (empty at the tail): the count below holds
    ptx::cp_async_wait<kStages - 1>();  // tile k has landed for this thread ...
    __syncthreads();                    // ... and for everybody; the fp32 tile of k - 1 is read
    const Tile t = tile_at(p, ntok, lo + k, hi);
    rope_to_tile<T, TT>(p, t, raw + (k % kStages) * stage_elems, tile, cu, ncu, tid);
    __syncthreads();  // the fp32 tile is complete; the raw stage is free
    if (P.row_codes != nullptr) rowwise(P, t, tile, tid);
    if (P.col_codes != nullptr) columnwise(P, t, tile, tid);
    if (P.dx != nullptr) copy_dx(P, t, tile, tid);
  }
}

template <typename T, typename TT>
void launch(const RopeQuantizeParams& p, const int64_t* cu, int64_t ncu, cudaStream_t stream) {
  const int64_t tokens = p.rope.S * p.rope.B, tiles = ceil_div(tokens, kRows) * p.rope.H;
  if (tokens > 0x7FFFFFFF - kRows || tiles > 0x7FFFFFFF)
    throw Error("mxmla.rope_backward_quantize", "grad", "too many tokens or tiles for the 32-bit tile index");
  const size_t smem = smem_bytes<T>(p.rope.D);
  auto kernel = sm90_rope_quantize_kernel<T, TT>;
  // Persistent grid: as many blocks as fit at this head width (cached per device and width).
  static int cached[64][kMaxD / 32 + 1] = {};
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  int& fit = cached[dev & 63][p.rope.D / 32];
  if (fit == 0) {
    MXMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_bytes<T>(kMaxD))));
    int per_sm = 0, sms = 0;
    MXMLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    MXMLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    fit = per_sm * sms > 0 ? per_sm * sms : 1;
  }
  const int64_t blocks = std::min<int64_t>(fit, tiles);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p, cu, ncu, static_cast<int>(tiles));
  MXMLA_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void dispatch_table(const RopeQuantizeParams& p, const int64_t* cu, int64_t ncu, cudaStream_t s) {
  if (p.rope.tab_t == DType::kFloat32) launch<T, float>(p, cu, ncu, s);
  else launch<T, __nv_bfloat16>(p, cu, ncu, s);
}

}  // namespace

void rope_quantize_cuda(const RopeQuantizeParams& p, Stream s) {
  auto stream = reinterpret_cast<cudaStream_t>(s);
  if (p.rope.S * p.rope.B * p.rope.H == 0) return;
  // Padding of swizzled scale buffers is zero (SPEC §2.1): the kernel writes real blocks only.
  if (p.row_codes && row_map_bytes(p.row_map) > row_map_blocks(p.row_map))
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.row_scales, 0, row_map_bytes(p.row_map), stream));
  if (p.col_codes && col_map_bytes(p.col_map) > col_map_blocks(p.col_map))
    MXMLA_CUDA_CHECK(cudaMemsetAsync(p.col_scales, 0, col_map_bytes(p.col_map), stream));
  DeviceCuSeqlens cu(p.rope.cu, stream);
  switch (p.rope.io_t) {
    case DType::kBFloat16: return dispatch_table<__nv_bfloat16>(p, cu.ptr, cu.n, stream);
    case DType::kFloat16: return dispatch_table<__half>(p, cu.ptr, cu.n, stream);
    default: return dispatch_table<float>(p, cu.ptr, cu.n, stream);
  }
}

}  // namespace mxmla::detail
