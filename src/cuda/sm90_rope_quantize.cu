// mxmla — RoPE backward fused with MXFP8 quantization for SM90 (rope_backward_quantize).
//
// dq [tokens, H, D] (any of sbhd / bshd / thd, strided) -> dx = R^T dq in fp32 -> E4M3/E5M2 codes
// and E8M0 scales of dx viewed as [tokens, H*D], rowwise and/or columnwise, plus an optional bf16 /
// fp32 copy of dx. A tile is 32 tokens x one head (the columnwise block height x a head, so every
// RoPE partner and every block is inside the tile); tiles are numbered head-fastest, so the
// heads of a token tile share table rows, which stay in cache while a block walks them.
// Persistent blocks of 6 warps stream tiles through a kStages-deep cp.async ring of raw input
// tiles (no registers held by loads in flight) and, per tile:
//   2. RoPE backward in fp32 of the rope part only, into a shared fp32 tile [32][R + 4]; the nope
//      part is read from the raw tile (its fp32 values are the inputs themselves);
//   3. rowwise: lane = row, warp = 32-column block; lane pairs swap halves of their codes so each
//      store instruction writes whole 32-byte sectors;
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
constexpr int kThreads = 192;  // 6 warps: one per 32-column block of a DeepSeek head in the rowwise pass
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 32;      // tokens per tile = the MXFP8 block along the columnwise axis
#ifndef MXMLA_ROPEQ_STAGES
#define MXMLA_ROPEQ_STAGES 2
#endif
constexpr int kStages = MXMLA_ROPEQ_STAGES;  // raw tiles k+1 .. k+kStages-1 load while tile k is processed
constexpr int kMaxD = static_cast<int>(kRopeQuantizeMaxHeadDim);
static_assert(kStages >= 2, "the ring needs a stage to fill while one is processed");
static_assert(kMaxD % 32 == 0, "heads are whole MXFP8 blocks");
static_assert(kThreads % 32 == 0, "warp-uniform loop bounds");

// Shared memory: raw stages [kStages][32][D + pad] of T, then the fp32 rope tile [32][R + 4].
// Row pitches are an odd number of 16-byte units, so 8 lanes reading 16 bytes at the same column
// of 8 consecutive rows hit 8 different bank groups.
template <typename T>
__host__ __device__ __forceinline__ int raw_pitch(int D) { return D + 16 / static_cast<int>(sizeof(T)); }  // elements
__host__ __device__ __forceinline__ int rope_pitch(int R) { return R + 4; }                               // floats
template <typename T>
size_t smem_bytes(int64_t D, int64_t R) {
  return kStages * static_cast<size_t>(kRows * raw_pitch<T>(static_cast<int>(D))) * sizeof(T) +
         static_cast<size_t>(kRows * rope_pitch(static_cast<int>(R))) * sizeof(float);
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

// The tile's source view: element j of tile row r. dx values are the raw input in the nope
// part (exact in fp32) and the fp32 rope tile in the rope part.
template <typename T>
struct TileView {
  const T* raw;      // [32][raw_pitch]
  const float* rope;  // [32][rope_pitch]
  int D, nope, rp, rrp;
  // 8 consecutive values starting at j (j % 8 == 0; never straddles nope / rope)
  __device__ __forceinline__ void load8(int r, int j, float* v) const {
    if (j < nope) {
      unpack8<T>(*reinterpret_cast<const Raw8<T>*>(raw + r * rp + j), v);
    } else {
      const float4* q = reinterpret_cast<const float4*>(rope + r * rrp + (j - nope));
      const float4 a = q[0], b = q[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
  }
  // 4 consecutive values starting at j (j % 4 == 0)
  __device__ __forceinline__ float4 load4(int r, int j) const {
    if (j < nope) {
      const T* p = raw + r * rp + j;
      if constexpr (sizeof(T) == 4) {
        return *reinterpret_cast<const float4*>(p);
      } else {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        return make_float4(Elem<T>::to_float(static_cast<uint16_t>(w.x & 0xFFFF)),
                           Elem<T>::to_float(static_cast<uint16_t>(w.x >> 16)),
                           Elem<T>::to_float(static_cast<uint16_t>(w.y & 0xFFFF)),
                           Elem<T>::to_float(static_cast<uint16_t>(w.y >> 16)));
      }
    }
    return *reinterpret_cast<const float4*>(rope + r * rrp + (j - nope));
  }
};

// cp.async of a tile's rows (D elements of head h for 32 tokens) into a raw stage. Chunk c =
// tid + i * kThreads of the tile is (row c / cpr, chunk c % cpr), stepped without divisions.
template <typename T>
__device__ __forceinline__ void issue_tile(const RopeKernelParams& p, const Tile& t, T* stage, int r0, int k0, int dr,
                                           int dk) {
  const int cpr = static_cast<int>(p.D) * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
  const int rp_bytes = raw_pitch<T>(static_cast<int>(p.D)) * static_cast<int>(sizeof(T));
  for (int r = r0, k = k0; r < t.nrows; r += dr, k += dk) {
    if (k >= cpr) k -= cpr, ++r;
    if (r >= t.nrows) break;
    int s, b;
    token_sb(p, t.t0 + r, s, b);
    const char* src = reinterpret_cast<const char*>(static_cast<const T*>(p.in) + s * p.in_st[0] + b * p.in_st[1] +
                                                    t.h * p.in_st[2]);
    ptx::cp_async<16>(reinterpret_cast<char*>(stage) + r * rp_bytes + 16 * k, src + 16 * k, 16);
  }
}

// Phase 2: RoPE backward of the rope part into the fp32 rope tile. Unit u = (row, thread q).
template <typename T, typename TT>
__device__ __forceinline__ void rope_to_tile(const RopeKernelParams& p, const Tile& t, const T* raw, float* rope,
                                             const int64_t* cu, int64_t ncu, int tid) {
  const int D = static_cast<int>(p.D), R = static_cast<int>(p.R), nope = D - R, half = R / 2;
  const int lanes = R / 16, rp = raw_pitch<T>(D), rrp = rope_pitch(R);
  const SetChoice sc = sets_of(p.style, true);
  for (int u = tid; u < t.nrows * lanes; u += kThreads) {
    const int r = u / lanes, q = u % lanes;
    const T* xr = raw + r * rp + nope;
    float in[16], o[16], c[16], sn[16];
    unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + set_part(sc.in_c, q, half, 0)), in);
    unpack8<T>(*reinterpret_cast<const Raw8<T>*>(xr + set_part(sc.in_c, q, half, 1)), in + 8);
    int s, b;
    token_sb(p, t.t0 + r, s, b);
    const int64_t row = table_row(p, cu, ncu, t.t0 + r, s);
    load_table16<TT>(p.cos, row, p.tab_row_stride, sc.tab_c, q, half, c);
    load_table16<TT>(p.sin, row, p.tab_row_stride, sc.tab_c, q, half, sn);
    rotate16(p.style, true, in, c, sn, o);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      float4* d = reinterpret_cast<float4*>(rope + r * rrp + set_part(sc.out_c, q, half, part));
      d[0] = make_float4(o[8 * part], o[8 * part + 1], o[8 * part + 2], o[8 * part + 3]);
      d[1] = make_float4(o[8 * part + 4], o[8 * part + 5], o[8 * part + 6], o[8 * part + 7]);
    }
  }
}

// Phase 3: rowwise. Lane = row, warp = 32-column block. Codes leave in whole 32-byte sectors:
// lanes 2k and 2k+1 swap halves so each store instruction writes both halves of one row's block.
template <typename T, bool kE4M3>
__device__ __forceinline__ void rowwise(const RopeQuantizeParams& P, const Tile& t, const TileView<T>& tv, int lane,
                                        int warp) {
  constexpr uint32_t rcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * tv.D;
  const int odd = lane & 1;
  for (int blk = warp; blk < tv.D / 32; blk += kWarps) {
    float v[32];
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) tv.load8(lane, 32 * blk + 8 * k, v + 8 * k);
#pragma unroll
    for (int k = 0; k < 32; ++k) m = max(m, mag_bits(v[k]));  // rows past the end hold stale data: never stored
    const uint8_t e = block_scale_from_amax_bits(m, rcp);
    const float mul = e8m0_quant_multiplier(e);
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      w[k] = ptx::cvt_fp8x2<kE4M3>(v[4 * k] * mul, v[4 * k + 1] * mul) |
             (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(v[4 * k + 2] * mul, v[4 * k + 3] * mul)) << 16);
    // even lane keeps w[0..3] and receives the odd row's w[0..3]; odd lane keeps w[4..7] and
    // receives the even row's w[4..7]
    uint32_t mine[4], theirs[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      mine[k] = odd ? w[4 + k] : w[k];
      theirs[k] = __shfl_xor_sync(0xFFFFFFFFu, odd ? w[k] : w[4 + k], 1);
    }
    const uint4 even_half = odd ? make_uint4(theirs[0], theirs[1], theirs[2], theirs[3])
                                : make_uint4(mine[0], mine[1], mine[2], mine[3]);
    const uint4 odd_half = odd ? make_uint4(mine[0], mine[1], mine[2], mine[3])
                               : make_uint4(theirs[0], theirs[1], theirs[2], theirs[3]);
    uint8_t* dst_even = P.row_codes + (t.t0 + lane - odd) * HD + col0 + 32 * blk + 16 * odd;
    if (lane - odd < t.nrows) __stcs(reinterpret_cast<uint4*>(dst_even), even_half);
    if ((lane | 1) < t.nrows) __stcs(reinterpret_cast<uint4*>(dst_even + HD), odd_half);
    if (lane < t.nrows) P.row_scales[cursor_offset(row_cursor(P.row_map, 0, col0 / 32 + blk), t.t0 + lane)] = e;
  }
}

// Phase 4: columnwise. Unit u = (4 columns, 8 rows); lanes 8 apart share columns; D units.
template <typename T, bool kE4M3>
__device__ __forceinline__ void columnwise(const RopeQuantizeParams& P, const Tile& t, const TileView<T>& tv,
                                           int tid) {
  constexpr uint32_t rcp = kE4M3 ? kRcpMaxE4M3Bits : kRcpMaxE5M2Bits;
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * tv.D;
  for (int u = tid; u < tv.D; u += kThreads) {
    const int lane = u & 31, part = lane >> 3, cg = (u >> 5) * 8 + (lane & 7);
    float4 v[8];
    uint32_t m[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * part + i;
      v[i] = tv.load4(r, 4 * cg);
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
        const uint32_t w = ptx::cvt_fp8x2<kE4M3>(v[i].x * mul[0], v[i].y * mul[1]) |
                           (static_cast<uint32_t>(ptx::cvt_fp8x2<kE4M3>(v[i].z * mul[2], v[i].w * mul[3])) << 16);
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
template <typename T>
__device__ __forceinline__ void copy_dx(const RopeQuantizeParams& P, const Tile& t, const TileView<T>& tv, int tid) {
  const int64_t HD = P.rope.H * P.rope.D, col0 = static_cast<int64_t>(t.h) * tv.D;
  const int cpr = tv.D / 8;
  for (int u = tid; u < t.nrows * cpr; u += kThreads) {
    const int r = u / cpr, c8 = u % cpr;
    float v[8];
    tv.load8(r, 8 * c8, v);
    const int64_t off = (t.t0 + r) * HD + col0 + 8 * c8;
    if (P.dx_t == DType::kFloat32) store_raw8<float>(static_cast<float*>(P.dx) + off, pack8<float>(v));
    else store_raw8<__nv_bfloat16>(static_cast<__nv_bfloat16*>(P.dx) + off, pack8<__nv_bfloat16>(v));
  }
}

template <typename T, typename TT, bool kE4M3>
__global__ void __launch_bounds__(kThreads) sm90_rope_quantize_kernel(const RopeQuantizeParams P, const int64_t* cu,
                                                                      int64_t ncu, int ntiles) {
  extern __shared__ __align__(16) float smem[];
  const RopeKernelParams& p = P.rope;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, ntok = static_cast<int>(p.S * p.B);
  const int D = static_cast<int>(p.D), R = static_cast<int>(p.R);
  const int stage_elems = kRows * raw_pitch<T>(D);
  T* raw = reinterpret_cast<T*>(smem);
  float* rope = reinterpret_cast<float*>(raw + kStages * stage_elems);
  // this thread's first chunk of a tile and the step between its chunks
  const int cpr = D * static_cast<int>(sizeof(T)) / 16;
  const int r0 = tid / cpr, k0 = tid % cpr, dr = kThreads / cpr, dk = kThreads % cpr;
  // Block b walks the contiguous tile range [lo, hi): runs of H tiles share their token rows, so
  // the table rows stay in L1 while the block walks the heads.
  const int64_t lo = blockIdx.x * static_cast<int64_t>(ntiles) / gridDim.x;
  const int64_t hi = (blockIdx.x + 1) * static_cast<int64_t>(ntiles) / gridDim.x;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const Tile t = tile_at(p, ntok, lo + s, hi);
    if (t.nrows > 0) issue_tile<T>(p, t, raw + s * stage_elems, r0, k0, dr, dk);
    ptx::cp_async_commit();
  }
  for (int64_t k = 0; lo + k < hi; ++k) {
    ptx::cp_async_wait<kStages - 2>();  // tile k has landed for this thread ...
    __syncthreads();                    // ... and for everybody; every pass over tile k - 1 is done
    const Tile tn = tile_at(p, ntok, lo + k + kStages - 1, hi);  // into the stage tile k - 1 used
    if (tn.nrows > 0) issue_tile<T>(p, tn, raw + ((k + kStages - 1) % kStages) * stage_elems, r0, k0, dr, dk);
    ptx::cp_async_commit();  // one group per step (empty at the tail): the wait count holds
    const Tile t = tile_at(p, ntok, lo + k, hi);
    const T* stage = raw + (k % kStages) * stage_elems;
    rope_to_tile<T, TT>(p, t, stage, rope, cu, ncu, tid);
    __syncthreads();  // the rope tile is complete
    const TileView<T> tv{stage, rope, D, D - R, raw_pitch<T>(D), rope_pitch(R)};
    if (P.row_codes != nullptr) rowwise<T, kE4M3>(P, t, tv, lane, warp);
    if (P.col_codes != nullptr) columnwise<T, kE4M3>(P, t, tv, tid);
    if (P.dx != nullptr) copy_dx<T>(P, t, tv, tid);
  }
}

template <typename T, typename TT, bool kE4M3>
void launch(const RopeQuantizeParams& p, const int64_t* cu, int64_t ncu, cudaStream_t stream) {
  const int64_t tokens = p.rope.S * p.rope.B, tiles = ceil_div(tokens, kRows) * p.rope.H;
  if (tokens > 0x7FFFFFFF - kRows || tiles > 0x7FFFFFFF)
    throw Error("mxmla.rope_backward_quantize", "grad", "too many tokens or tiles for the 32-bit tile index");
  const size_t smem = smem_bytes<T>(p.rope.D, p.rope.R);
  auto kernel = sm90_rope_quantize_kernel<T, TT, kE4M3>;
  // Persistent grid: as many blocks as fit at this head geometry (cached per device, D and R).
  static int cached[64][kMaxD / 32 + 1][kMaxD / 16 + 1] = {};
  int dev = 0;
  MXMLA_CUDA_CHECK(cudaGetDevice(&dev));
  int& fit = cached[dev & 63][p.rope.D / 32][p.rope.R / 16];
  if (fit == 0) {
    MXMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_bytes<T>(kMaxD, kMaxD))));
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
  const bool e4m3 = p.fmt == Fp8Format::kE4M3;  // the format is a template argument: one cvt per code pair
  if (p.rope.tab_t == DType::kFloat32)
    e4m3 ? launch<T, float, true>(p, cu, ncu, s) : launch<T, float, false>(p, cu, ncu, s);
  else
    e4m3 ? launch<T, __nv_bfloat16, true>(p, cu, ncu, s) : launch<T, __nv_bfloat16, false>(p, cu, ncu, s);
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
