// mxmla — MXFP8 quantization API (SPEC §2).
//
// Every function validates its arguments and throws mxmla::Error naming the argument and the
// rule it broke. Data on the CPU runs the reference implementation; data on a CUDA device runs
// the CUDA kernels on `stream`. Outputs are caller-allocated: the *_shapes() helpers say what to
// allocate.
#pragma once

#include <cstdint>
#include <vector>

#include "mxmla/tensor.h"

namespace mxmla {

enum class Fp8Format : uint8_t { kE4M3, kE5M2 };

// How the E8M0 scale bytes are laid out.
//  kCompact : rowwise [M, K/32], columnwise [ceil(M/32), K] (row-major).
//  kSwizzled: cuBLAS/cuDNN F8_128x4 tiles (SPEC §2.1), padded to
//             rowwise [round_up(M,128), round_up(K/32,4)], columnwise [round_up(ceil(M/32),4), round_up(K,128)],
//             padding written as zero.
//  kBHSD    : attention hand-off (SPEC §2.2): per (batch, head) a swizzled matrix,
//             rowwise [b, h, round_up(s,128), round_up(d/32,4)], columnwise [b, h, round_up(ceil(s/32),4), round_up(d,128)].
enum class ScaleLayout : uint8_t { kCompact, kSwizzled, kBHSD };

// Token-major layouts of Q/K/V as they leave the projections.
enum class QKVLayout : uint8_t { kSBHD, kBSHD };

struct QuantizeOptions {
  bool rowwise = true;     // 1x32 blocks along the last dimension
  bool columnwise = true;  // 32x1 blocks along the flattened leading dimension
  Fp8Format format = Fp8Format::kE4M3;
  bool swizzle = false;  // write kSwizzled scales instead of kCompact
};

struct AttentionQuantizeOptions {
  QKVLayout layout = QKVLayout::kSBHD;
  bool rowwise = true;
  bool columnwise = true;  // blocks of 32 consecutive tokens of one sequence
  Fp8Format format = Fp8Format::kE4M3;
  bool bhsd_scales = true;  // true: write kBHSD scales directly (fused); false: compact (phase one)
};

// An MXFP8 tensor: codes (same shape as the logical tensor, row-major) and E8M0 scale bytes,
// one pair per direction. A direction whose data pointer is null is absent.
struct MXFP8Tensor {
  std::vector<int64_t> shape;  // logical shape
  Fp8Format format = Fp8Format::kE4M3;
  ScaleLayout scale_layout = ScaleLayout::kCompact;
  QKVLayout qkv_layout = QKVLayout::kSBHD;  // only meaningful with kBHSD (and attention compact scales)
  bool attention = false;                   // produced by quantize_attention (columnwise blocks per sequence)
  TensorDesc rowwise_data, rowwise_scale_inv;
  TensorDesc columnwise_data, columnwise_scale_inv;

  bool has_rowwise() const { return rowwise_data.data != nullptr; }
  bool has_columnwise() const { return columnwise_data.data != nullptr; }
};

// Shapes the caller must allocate (data shape equals the input shape).
struct MXFP8Shapes {
  std::vector<int64_t> data;
  std::vector<int64_t> rowwise_scale;
  std::vector<int64_t> columnwise_scale;
};
MXFP8Shapes quantize_shapes(const std::vector<int64_t>& input_shape, bool swizzle);
// Attention: input [s, b, h, d] (kSBHD) or [b, s, h, d] (kBSHD). Compact columnwise scales are
// [ceil(s/32), b*h*d] (sbhd) or [b*ceil(s/32), h*d] (bshd); rowwise [s*b*h, d/32] or [b*s*h, d/32].
MXFP8Shapes attention_shapes(const std::vector<int64_t>& input_shape, QKVLayout layout, bool bhsd_scales);

// quantize: input bf16 / fp16 / fp32, at least 1-D, last dimension a multiple of 32, innermost
// stride 1 and leading dimensions collapsible to one row stride. Fills the directions asked for
// in `opts`; `out` must hold caller-allocated, contiguous uint8/fp8/e8m0 tensors of quantize_shapes().
void quantize(const TensorDesc& input, MXFP8Tensor& out, const QuantizeOptions& opts, Stream stream = nullptr);

// dequantize one direction of `in` (rowwise unless `columnwise`) to fp32 or bf16 `out`
// (contiguous, shape in.shape).
void dequantize(const MXFP8Tensor& in, TensorDesc& out, bool columnwise = false, Stream stream = nullptr);

// Convert scales of an [M, K] tensor between kCompact and kSwizzled (rowwise or columnwise).
void swizzle_scales(const TensorDesc& compact, TensorDesc& swizzled, int64_t M, int64_t K, bool rowwise,
                    Stream stream = nullptr);
void unswizzle_scales(const TensorDesc& swizzled, TensorDesc& compact, int64_t M, int64_t K, bool rowwise,
                      Stream stream = nullptr);

// Attention hand-off. Fused: quantize and write BHSD scales (opts.bhsd_scales = true); phase one:
// quantize with compact per-sequence scales (opts.bhsd_scales = false); phase two:
// attention_scales_to_bhsd(). `shape` is the 4-D Q/K/V shape in `layout`. The input's last
// dimension is contiguous; its other strides are free (non-negative; on CUDA multiples of 16 bytes),
// e.g. V as a view of a fused K/V projection's output.
void quantize_attention(const TensorDesc& input, MXFP8Tensor& out, const AttentionQuantizeOptions& opts,
                        Stream stream = nullptr);

// A tensor given as torch.cat([part0, part1], dim=-1), read in place: it is never materialised.
// Both parts have one dtype and device and the same sizes but the last; each has its own strides
// (the last one 1; the others non-negative, on CUDA multiples of 16 bytes, and 0 broadcasts: e.g.
// DeepSeek-V3's k_pe, one rope key shared by every head, expanded over the heads). part0's last
// dimension is a multiple of 16 bytes' elements (8 for bf16 / fp16, 4 for fp32), the two together a
// multiple of 32.
struct ConcatInput {
  TensorDesc part0, part1;
};
// quantize_attention of torch.cat([part0, part1], -1) (4-D parts in opts.layout): exactly the codes and
// scales of quantize_attention on the concatenated tensor, in one pass over the parts (MLA's
// K = [k_nope | k_pe] without a concatenation pass).
void quantize_attention(const ConcatInput& input, MXFP8Tensor& out, const AttentionQuantizeOptions& opts,
                        Stream stream = nullptr);
void attention_scales_to_bhsd(const TensorDesc& compact, TensorDesc& bhsd, const std::vector<int64_t>& shape,
                              QKVLayout layout, bool rowwise, Stream stream = nullptr);
// Several phase-two conversions (e.g. Q, K, V in both directions) in one launch.
struct BhsdScaleJob {
  TensorDesc compact;  // compact attention scales (input)
  TensorDesc bhsd;     // BHSD swizzled scales (output)
  std::vector<int64_t> shape;
  QKVLayout layout = QKVLayout::kSBHD;
  bool rowwise = true;
};
void attention_scales_to_bhsd(const std::vector<BhsdScaleJob>& jobs, Stream stream = nullptr);

// Build information for `mxmla info`.
struct BuildInfo {
  bool cuda_enabled;
  const char* cuda_archs;
  const char* version;
  bool cuda_rope;  // the CUDA RoPE kernels are built (with the CUDA kernels)
};
BuildInfo build_info();
// Number of usable CUDA devices (0 when built without CUDA or none present) and a description.
int cuda_device_count();
std::string cuda_device_description(int index);
// The current device's default memory pool (where cudaMallocAsync allocates: mxmla's stream-ordered
// scratch, and torch's allocations under PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync): bytes in
// use now and the most in use since the last reset; reset_high resets that high-water mark to the
// bytes in use now. {0, 0} without CUDA.
struct PoolUsage {
  int64_t current = 0, high = 0;
};
PoolUsage cuda_pool_usage(bool reset_high);
// mxmla's scratch keeps the memory it has reserved in that pool across synchronizations (its release
// threshold is raised the first time mxmla allocates on a device: otherwise every stream or device
// synchronization returns the free memory to the driver, and the next call maps it again). This
// returns the current device's unused reserved memory to the driver, like torch.cuda.empty_cache()
// for torch's cache, and gives the bytes released; 0 without CUDA.
int64_t cuda_pool_release();

}  // namespace mxmla
