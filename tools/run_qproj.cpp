// mxmla run — the main job: a DeepSeek-V3-shaped fused Q up-projection (GEMM + RoPE + MXFP8) on
// random data with realistic scaling (x ~ N(0, 1) like c_q after RMSNorm, W ~ N(0, 1/K) so q ~ N(0, 1),
// YaRN tables), checked against the CPU reference on sampled 32-token groups x heads, timed against
// cuBLAS's bf16 GEMM alone and cuBLAS GEMM + mxmla's RoPE + mxmla's quantize in the same run.
// Without a GPU it runs the CPU reference at a smaller size and says so (in chunks of 32-token
// groups on every core: the same outputs as one call, since no block spans two groups).
// cuBLAS is loaded when the GPU job starts (dlopen), not linked: the tool, like the Python module,
// starts on a machine whose loader knows no CUDA library path (the CUDA runtime is linked statically).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/host_util.h"
#include "cpu/reference.h"
#include "mxmla/blockfp8.h"
#include "mxmla/qproj.h"
#include "tools/cli_args.h"
#include "tools/jobs.h"

#if MXMLA_WITH_CUDA
#include <cublas_v2.h>
#include <dlfcn.h>

#include "tools/gpu_timer.h"
#endif

namespace mxmla::tool {

namespace {

struct Inputs {
  std::vector<uint16_t> x, w;
  std::vector<float> cos, sin;
};

// a.heads is the resolved head count here.
Inputs make_inputs(const QProjRunArgs& a, int64_t T) {
  Inputs in;
  const int64_t N = a.heads * 192;
  util::Rng rng(a.seed);
  in.x.resize(T * a.k);
  for (auto& v : in.x) v = util::to_bf16(static_cast<float>(rng.normal()));
  in.w.resize(N * a.k);
  const double ws = 1.0 / std::sqrt(static_cast<double>(a.k));
  for (auto& v : in.w) v = util::to_bf16(static_cast<float>(rng.normal() * ws));
  in.cos.resize(T * 64), in.sin.resize(T * 64);
  TensorDesc c(in.cos.data(), DType::kFloat32, {T, 64}), s(in.sin.data(), DType::kFloat32, {T, 64});
  rope_tables(positions_arange(T), 64, 10000.0, YarnParams::deepseek_v3(), a.style, c, s);
  return in;
}

// --weights mxfp8: an MXFP8 operand's rowwise copy on the host ([R, K] codes, compact scales).
struct HostMx {
  std::vector<uint8_t> codes, scales;
  MXFP8Tensor t;
  HostMx(int64_t R, int64_t K, Fp8Format f) : codes(R * K), scales(R * K / 32) {
    t.shape = {R, K}, t.format = f;
    t.rowwise_data = TensorDesc(codes.data(), DType::kUInt8, {R, K});
    t.rowwise_scale_inv = TensorDesc(scales.data(), DType::kUInt8, {R, K / 32});
  }
};
void require_k32(const QProjRunArgs& a) {
  if (a.mxfp8_weights && a.k % 32 != 0)
    throw UsageError("mxmla run", "option '--k' is " + std::to_string(a.k) +
                                      ": with --weights mxfp8 it must be a multiple of 32 (rowwise MXFP8 blocks along K)");
}
// The rowwise copy's values as bf16 (what the MXFP8-weight op multiplies), which must be exact:
// the bf16 reference on them then computes that op.
[[maybe_unused]] std::vector<uint16_t> exact_bf16(const MXFP8Tensor& t) {
  const int64_t n = t.shape[0] * t.shape[1];
  std::vector<float> f(n);
  std::vector<uint16_t> b(n);
  TensorDesc fd(f.data(), DType::kFloat32, t.shape), bd(b.data(), DType::kBFloat16, t.shape);
  dequantize(t, fd), dequantize(t, bd);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(b[i]) << 16;
    float v;
    std::memcpy(&v, &u, 4);
    if (!(v == f[i]) && !(std::isnan(v) && std::isnan(f[i])))
      throw std::runtime_error("an MXFP8 value is not a bf16 value: the check's bf16 reference cannot hold it");
  }
  return b;
}

// --weights block-fp8: a block-FP8 operand on the host (codes [R, K], fp32 scale_inv of 1 x 128 or 128 x 128 blocks).
struct HostBlock {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  BlockFP8Tensor t;
  HostBlock(int64_t R, int64_t K, int64_t br) {
    const std::vector<int64_t> ss = block_scale_shape(R, K, br);
    codes.resize(R * K), scales.resize(ss[0] * ss[1]);
    t = BlockFP8Tensor{TensorDesc(codes.data(), DType::kUInt8, {R, K}), TensorDesc(scales.data(), DType::kFloat32, ss), br};
  }
};
// Its values as bf16 (code · scale_inv, exact with the power-of-two scales quantize_blockwise makes):
// the bf16 reference on them then computes the block-FP8 op.
[[maybe_unused]] std::vector<uint16_t> exact_bf16(const HostBlock& b) {
  const int64_t R = b.t.data.shape[0], K = b.t.data.shape[1], nk = b.t.scale_inv.shape[1];
  std::vector<uint16_t> out(R * K);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const double v = ref::fp8_to_double(b.codes[r * K + k], Fp8Format::kE4M3) *
                       static_cast<double>(b.scales[(r / b.t.block_rows) * nk + k / 128]);
      out[r * K + k] = ref::double_to_bf16(v);
      if (!(ref::bf16_to_double(out[r * K + k]) == v) && !std::isnan(v))
        throw std::runtime_error("a block-FP8 value is not a bf16 value: the check's bf16 reference cannot hold it");
    }
  return out;
}

QProjOptions options(const QProjRunArgs& a) {
  QProjOptions o;
  o.style = a.style, o.format = a.format;
  return o;
}

// Compact outputs of one direction: codes [T, N], scales rowwise [T*NH, 6] / columnwise [ceil(T/32), N].
struct Compact {
  std::vector<uint8_t> row, rs, col, cs;
};

// Compare the reference of `g` = (32-token group, head) with the full run's outputs. Random data: the
// kernel's fp32 sums may differ from the exact ones in the last bit, which can move a bf16 rounding;
// codes may then differ by one FP8 step where the scales agree, and a scale by one at a power of two.
struct CheckStats {
  int64_t blocks = 0, scale_diff = 0, scale_far = 0, code_diff = 0, code_far = 0;
};
// Codes of nope elements (the bf16 GEMM value quantized): one FP8 step apart at most, or both within
// one subnormal step of zero (a value below the summation error may change sign). Rope elements
// (c x_a + s x_b of two bf16 values that may each move by one bf16 step): within
// (|c| + |s|) 2^-8 |x| <= 2^-7 of the block's range, i.e. 2^-7 * max normal in scaled units, plus a step.
void compare_block(const uint8_t* ref, int64_t ref_stride, const uint8_t* got, int64_t got_stride, uint8_t sref,
                   uint8_t sgot, int64_t n, bool rope, Fp8Format f, CheckStats& st) {
  ++st.blocks;
  if (sref != sgot) {
    ++st.scale_diff;
    if (std::abs(int(sref) - int(sgot)) > 1) ++st.scale_far;
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t a = ref[i * ref_stride], b = got[i * got_stride];
    if (a == b) continue;
    ++st.code_diff;
    auto ord = [](uint8_t c) { return (c & 0x80) ? -int(c & 0x7F) : int(c & 0x7F); };  // +0 == -0
    bool far = std::abs(ord(a) - ord(b)) > 1 && ((a & 0x7F) > 1 || (b & 0x7F) > 1);
    if (rope) {
      const double va = ref::fp8_to_double(a, f), vb = ref::fp8_to_double(b, f);
      const double maxn = f == Fp8Format::kE4M3 ? 448.0 : 57344.0, step = std::fabs(va) * (f == Fp8Format::kE4M3 ? 0.125 : 0.25);
      far = std::fabs(va - vb) > maxn / 128 + step;
    }
    if (far) ++st.code_far;
  }
}

void merge(CheckStats& into, const CheckStats& st) {
  into.blocks += st.blocks, into.scale_diff += st.scale_diff, into.scale_far += st.scale_far;
  into.code_diff += st.code_diff, into.code_far += st.code_far;
}

[[maybe_unused]] CheckStats check_sample(const QProjRunArgs& a, int64_t T, const Inputs& in, const Compact& got, Progress& progress) {
  const int64_t N = a.heads * 192, groups = (T + 31) / 32;
  // block-FP8: the FP8 tensor cores add a block's 128 products in their own reduced precision, an
  // absolute error near 2^-10 of the sum's magnitude, which moves small values' codes by several
  // subnormal steps: every code is held to the rope codes' bound (2^-7 of the block's range + a step)
  const bool loose = a.block_weights;
  CheckStats total_st;
  std::mutex m;
  util::Rng pick(a.seed + 11);
  const int64_t total = groups * a.heads, n = std::min(total, a.check_groups);
  std::vector<int64_t> picked(n);
  for (int64_t i = 0; i < n; ++i) picked[i] = n == total ? i : static_cast<int64_t>(pick.uniform() * total);
  progress.begin("checking against the CPU reference", n, "(group, head) pairs");
  parallel_for(n, cpu_threads(a.threads), [&](int64_t i) {
    CheckStats st;
    const int64_t gi = picked[i];
    const int64_t g = gi / a.heads, h = gi % a.heads, t0 = g * 32, nt = std::min<int64_t>(32, T - t0);
    // the sub-problem: tokens [t0, t0 + nt) of head h, tables from row t0
    QProjOptions o = options(a);
    const MXFP8Shapes s = qproj_shapes(nt, 1, o);
    std::vector<uint8_t> row(numel(s.data)), rs(numel(s.rowwise_scale)), col(numel(s.data)), cs(numel(s.columnwise_scale));
    MXFP8Tensor ref = describe(s.data, s, row.data(), rs.data(), col.data(), cs.data(), Device{});
    TensorDesc x(const_cast<uint16_t*>(in.x.data() + t0 * a.k), DType::kBFloat16, {nt, a.k});
    TensorDesc w(const_cast<uint16_t*>(in.w.data() + h * 192 * a.k), DType::kBFloat16, {192, a.k});
    TensorDesc c(const_cast<float*>(in.cos.data() + t0 * 64), DType::kFloat32, {nt, 64});
    TensorDesc sn(const_cast<float*>(in.sin.data() + t0 * 64), DType::kFloat32, {nt, 64});
    fused_q_uproj_rope_quant(x, w, c, sn, ref, nullptr, o);
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t b = 0; b < 6; ++b)
        compare_block(&row[t * 192 + 32 * b], 1, &got.row[(t0 + t) * N + h * 192 + 32 * b], 1, rs[t * 6 + b],
                      got.rs[((t0 + t) * a.heads + h) * 6 + b], 32, b >= 4 || loose, a.format, st);
    for (int64_t d = 0; d < 192; ++d)
      compare_block(&col[d], 192, &got.col[t0 * N + h * 192 + d], N, cs[d], got.cs[g * N + h * 192 + d], nt,
                    d >= 128 || loose, a.format, st);
    std::lock_guard<std::mutex> lk(m);
    merge(total_st, st);
    progress.advance();
  });
  progress.end();
  return total_st;
}

[[maybe_unused]] bool report_check(const CheckStats& st, int64_t sampled, int64_t total, bool fp8_sums = false) {
  std::fflush(stderr);
  const bool ok = st.scale_far == 0 && st.code_far == 0 && st.scale_diff * 100 <= st.blocks;
  std::printf("check: %lld of %lld (32-token group, head) pairs against the CPU reference: %lld blocks, %lld scales "
              "differ by one, %lld codes differ (%s), %lld beyond the bound: %s\n",
              (long long)sampled, (long long)total, (long long)st.blocks, (long long)st.scale_diff,
              (long long)st.code_diff, fp8_sums ? "FP8 tensor-core sums" : "fp32 summation order",
              (long long)(st.scale_far + st.code_far), ok ? "OK" : "FAILED");
  return ok;
}

}  // namespace

namespace {
// Host bytes of a run: inputs, the float64 copy of W each reference thread decodes, outputs and the check.
double host_bytes(int64_t T, int64_t NH, int64_t K, int threads, bool cpu) {
  const double N = double(NH) * 192, tk = double(T) * K, nk = N * K, tn = double(T) * N;
  return 2 * tk + 2 * nk + 8 * T * 64.0 + (cpu ? 8 * nk * threads + 12 * tn + 6 * tn / 32 : 2.1 * tn + 8 * 192.0 * K * threads);
}
std::string sizes(int64_t T, int64_t NH, int64_t K) {
  return "T " + std::to_string(T) + ", NH " + std::to_string(NH) + ", K " + std::to_string(K);
}
}  // namespace

int run_qproj_cpu(const QProjRunArgs& a, Progress& progress) {
  const int64_t T = a.tokens < 0 ? 256 : a.tokens;
  QProjRunArgs b = a;
  if (a.heads < 0) b.heads = 16;
  const int threads = cpu_threads(a.threads);
  check_host_memory("mxmla run", host_bytes(T, b.heads, b.k, threads, true), sizes(T, b.heads, b.k));
  const int64_t N = b.heads * 192;
  require_k32(b);
  std::printf("mxmla run: no GPU in use: running the CPU reference of the fused Q up-projection at T %lld, NH %lld, "
              "K %lld%s\n",
              (long long)T, (long long)b.heads, (long long)b.k,
              a.tokens < 0 && a.heads < 0 ? " (smaller than the GPU default T 4096, NH 128)" : "");
  progress.begin("generating inputs");
  const Inputs in = make_inputs(b, T);
  const QProjOptions o = options(b);
  const MXFP8Shapes s = qproj_shapes(T, b.heads, o);
  // --weights mxfp8: x and W quantized rowwise once (the op reads their rowwise copies)
  HostMx x8(b.mxfp8_weights ? T : 0, b.k, b.format), w8(b.mxfp8_weights ? N : 0, b.k, b.format);
  if (b.mxfp8_weights) {
    QuantizeOptions qo;
    qo.columnwise = false, qo.format = b.format;
    quantize(TensorDesc(const_cast<uint16_t*>(in.x.data()), DType::kBFloat16, {T, b.k}), x8.t, qo);
    quantize(TensorDesc(const_cast<uint16_t*>(in.w.data()), DType::kBFloat16, {N, b.k}), w8.t, qo);
    std::printf("--weights mxfp8: x and W quantized rowwise (%s); the GEMM on their exactly dequantized codes\n",
                b.format == Fp8Format::kE4M3 ? "E4M3" : "E5M2");
  }
  // --weights block-fp8: x (1 x 128 blocks) and W (128 x 128 blocks) quantized once, power-of-two scales
  HostBlock bx(b.block_weights ? T : 0, b.k, 1), bw(b.block_weights ? N : 0, b.k, 128);
  if (b.block_weights) {
    BlockQuantizeOptions qo;
    quantize_blockwise(TensorDesc(const_cast<uint16_t*>(in.x.data()), DType::kBFloat16, {T, b.k}), bx.t, qo);
    qo.block_rows = 128;
    quantize_blockwise(TensorDesc(const_cast<uint16_t*>(in.w.data()), DType::kBFloat16, {N, b.k}), bw.t, qo);
    std::printf("--weights block-fp8: x (1 x 128 blocks) and W (128 x 128 blocks) quantized to E4M3 with fp32 "
                "scales; the GEMM on code x scale_inv\n");
  }
  Compact out;
  out.row.resize(numel(s.data)), out.rs.resize(numel(s.rowwise_scale));
  out.col.resize(numel(s.data)), out.cs.resize(numel(s.columnwise_scale));
  std::vector<uint16_t> q(T * N);
  // Chunks of whole 32-token groups (columnwise blocks never span two), about 8 per thread.
  const int64_t groups = (T + 31) / 32, per_chunk = std::max<int64_t>(1, groups / (8 * threads));
  const int64_t chunk = per_chunk * 32, chunks = (T + chunk - 1) / chunk;
  const int used = static_cast<int>(std::min<int64_t>(threads, chunks));  // threads that get work
  progress.begin("CPU reference (GEMM in float64, RoPE, MXFP8)", T, "tokens");
  const auto t0 = std::chrono::steady_clock::now();
  parallel_for(chunks, threads, [&](int64_t i) {
    const int64_t r0 = i * chunk, nt = std::min(chunk, T - r0);
    const MXFP8Shapes cs = qproj_shapes(nt, b.heads, o);
    MXFP8Tensor t = describe(cs.data, cs, out.row.data() + r0 * N, out.rs.data() + r0 * b.heads * 6,
                             out.col.data() + r0 * N, out.cs.data() + (r0 / 32) * N, Device{});
    TensorDesc qd(q.data() + r0 * N, DType::kBFloat16, qproj_q_shape(nt, b.heads, o));
    const TensorDesc c(const_cast<float*>(in.cos.data() + r0 * 64), DType::kFloat32, {nt, 64});
    const TensorDesc sn(const_cast<float*>(in.sin.data() + r0 * 64), DType::kFloat32, {nt, 64});
    if (b.mxfp8_weights) {  // the chunk's rows of x's rowwise copy
      MXFP8Tensor xc = x8.t;
      xc.shape = {nt, b.k};
      xc.rowwise_data = TensorDesc(x8.codes.data() + r0 * b.k, DType::kUInt8, {nt, b.k});
      xc.rowwise_scale_inv = TensorDesc(x8.scales.data() + r0 * b.k / 32, DType::kUInt8, {nt, b.k / 32});
      fused_q_uproj_rope_quant(xc, w8.t, c, sn, t, &qd, o);
    } else if (b.block_weights) {  // the chunk's rows of x's codes and scales
      const int64_t nk = bx.t.scale_inv.shape[1];
      const BlockFP8Tensor xc{TensorDesc(bx.codes.data() + r0 * b.k, DType::kUInt8, {nt, b.k}),
                              TensorDesc(bx.scales.data() + r0 * nk, DType::kFloat32, {nt, nk}), 1};
      fused_q_uproj_rope_quant(xc, bw.t, c, sn, t, &qd, o);
    } else {
      fused_q_uproj_rope_quant(TensorDesc(const_cast<uint16_t*>(in.x.data() + r0 * b.k), DType::kBFloat16, {nt, b.k}),
                               TensorDesc(const_cast<uint16_t*>(in.w.data()), DType::kBFloat16, {N, b.k}), c, sn, t,
                               &qd, o);
    }
    progress.advance(nt);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Round trip of the rowwise codes against the bf16 q: within the MX error bound.
  progress.begin("round-trip check");
  MXFP8Tensor t = describe(s.data, s, out.row.data(), out.rs.data(), out.col.data(), out.cs.data(), Device{});
  t.format = b.format, t.attention = true, t.qkv_layout = QKVLayout::kSBHD;
  std::vector<float> back(T * N);
  TensorDesc bd(back.data(), DType::kFloat32, s.data);
  dequantize(t, bd, false);
  double num = 0, den = 0;
  for (int64_t i = 0; i < T * N; ++i) {
    uint32_t u = static_cast<uint32_t>(q[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    num += double(back[i] - f) * (back[i] - f), den += double(f) * f;
  }
  progress.end();
  const double rel = std::sqrt(num / den), bound = b.format == Fp8Format::kE4M3 ? 0.0625 : 0.125;
  std::printf("fused q up-projection + RoPE + MXFP8 in %.3f s on the CPU reference, %d thread%s (%.2f GFLOP/s, "
              "float64 GEMM)\n",
              secs, used, used == 1 ? "" : "s", 2.0 * T * N * b.k / secs / 1e9);
  std::printf("round-trip relative error of the rowwise codes vs q %.4f (bound %.4f): %s\n", rel, bound,
              rel < bound ? "OK" : "FAILED");
  return rel < bound ? 0 : 1;
}

#if MXMLA_WITH_CUDA
namespace {
// The three cuBLAS entry points the peer needs, from the libcublas of this toolkit's major
// version: MXMLA_CUBLAS=path if set, else where the loader finds it, else in the library
// directory of the toolkit the tool was built with. Loaded when the GPU job starts.
struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  // the C entry point (the header adds a C++ overload taking cudaDataType as the compute type)
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                    const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                    cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  GemmEx gemm = nullptr;
  std::string tried;

  bool load() {
    std::vector<std::string> names;
    if (const char* e = std::getenv("MXMLA_CUBLAS")) names.push_back(e);
    names.push_back("libcublas.so." + std::to_string(CUBLAS_VER_MAJOR));
    names.push_back("libcublas.so");
#ifdef MXMLA_CUDA_LIBRARY_DIR
    names.push_back(MXMLA_CUDA_LIBRARY_DIR "/libcublas.so." + std::to_string(CUBLAS_VER_MAJOR));
#endif
    for (const std::string& n : names) {
      void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      tried += (tried.empty() ? "" : ", ") + n;
      if (h == nullptr) continue;
      create = reinterpret_cast<decltype(create)>(dlsym(h, "cublasCreate_v2"));
      destroy = reinterpret_cast<decltype(destroy)>(dlsym(h, "cublasDestroy_v2"));
      gemm = reinterpret_cast<decltype(gemm)>(dlsym(h, "cublasGemmEx"));
      if (create && destroy && gemm) return true;
    }
    return false;
  }
};

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw CudaError(std::string("mxmla run: cuBLAS ") + what + " failed (status " + std::to_string(int(s)) + ")");
}
}  // namespace

int run_qproj_cuda(const QProjRunArgs& args, Progress& progress) {
  QProjRunArgs a = args;
  if (a.heads < 0) a.heads = 128;
  const int64_t T = a.tokens < 0 ? 4096 : a.tokens, N = a.heads * 192, K = a.k;
  check_host_memory("mxmla run", host_bytes(T, a.heads, K, cpu_threads(a.threads), false), sizes(T, a.heads, K));
  if (N > INT32_MAX || T > INT32_MAX)
    throw UsageError("mxmla run", "option '--heads' gives N = NH * 192 = " + std::to_string(N) +
                                      ", beyond what cuBLAS takes (2^31 - 1)");
  std::printf("mxmla run: GPU %s\n", cuda_device_description(0).c_str());
  require_k32(a);
  std::printf("fused Q up-projection + RoPE + MXFP8 (%s, rowwise + columnwise, compact scales): x [%lld, %lld] bf16, "
              "W [%lld, %lld] %s -> q [%lld, %lld, 192]\n",
              a.format == Fp8Format::kE4M3 ? "E4M3" : "E5M2", (long long)T, (long long)K, (long long)N, (long long)K,
              a.mxfp8_weights  ? "MXFP8 (rowwise, quantized once; x quantized rowwise + columnwise in each call)"
              : a.block_weights ? "block-FP8 (128 x 128 blocks, quantized once; x quantized 1 x 128 in each call)"
                                : "bf16",
              (long long)T, (long long)a.heads);
  progress.begin("generating inputs");
  const Inputs in = make_inputs(a, T);
  const QProjOptions o = options(a);
  const MXFP8Shapes s = qproj_shapes(T, a.heads, o);
  const Device dev{DeviceType::kCUDA, 0};
  util::DeviceBuffer dx(in.x.size() * 2), dw(in.w.size() * 2), dc(in.cos.size() * 4), ds(in.sin.size() * 4);
  dx.upload(in.x.data()), dw.upload(in.w.data()), dc.upload(in.cos.data()), ds.upload(in.sin.data());
  util::DeviceBuffer drow(T * N), dcol(T * N), drs(numel(s.rowwise_scale)), dcs(numel(s.columnwise_scale));
  util::DeviceBuffer dq(T * N * 2);
  MXFP8Tensor q = describe(s.data, s, drow.ptr, drs.ptr, dcol.ptr, dcs.ptr, dev);
  const TensorDesc x(dx.ptr, DType::kBFloat16, {T, K}, dev), w(dw.ptr, DType::kBFloat16, {N, K}, dev);
  const TensorDesc c(dc.ptr, DType::kFloat32, {T, 64}, dev), sn(ds.ptr, DType::kFloat32, {T, 64}, dev);
  // --weights mxfp8: W's rowwise copy made once; each call quantizes x (both copies: the columnwise
  // one is what a training step saves for the weight gradient) and runs the op on the MXFP8 x, W
  const bool mx = a.mxfp8_weights;
  const MXFP8Shapes xs = mx ? quantize_shapes({T, K}, false) : MXFP8Shapes{};  // (K % 32 == 0: require_k32)
  const MXFP8Shapes wsh = mx ? quantize_shapes({N, K}, false) : MXFP8Shapes{};
  util::DeviceBuffer x8r(mx ? T * K : 0), x8rs(mx ? numel(xs.rowwise_scale) : 0), x8c(mx ? T * K : 0),
      x8cs(mx ? numel(xs.columnwise_scale) : 0), w8r(mx ? N * K : 0), w8rs(mx ? numel(wsh.rowwise_scale) : 0);
  MXFP8Tensor x8, w8;
  if (mx) x8 = describe({T, K}, xs, x8r.ptr, x8rs.ptr, x8c.ptr, x8cs.ptr, dev);
  x8.format = a.format;
  QuantizeOptions xq;
  xq.format = a.format;
  if (mx) {
    w8.shape = {N, K}, w8.format = a.format;
    w8.rowwise_data = TensorDesc(w8r.ptr, DType::kUInt8, {N, K}, dev);
    w8.rowwise_scale_inv = TensorDesc(w8rs.ptr, DType::kUInt8, wsh.rowwise_scale, dev);
    QuantizeOptions wq = xq;
    wq.columnwise = false;
    quantize(w, w8, wq);
  }
  // --weights block-fp8: W quantized once (128 x 128 blocks); each call quantizes x (1 x 128) and runs
  // the op on the FP8 tensor cores
  const bool bk = a.block_weights;
  const std::vector<int64_t> bxs = block_scale_shape(T, K, 1), bws = block_scale_shape(N, K, 128);
  util::DeviceBuffer bxc(bk ? T * K : 0), bxsc(bk ? numel(bxs) * 4 : 0), bwc(bk ? N * K : 0), bwsc(bk ? numel(bws) * 4 : 0);
  const BlockFP8Tensor bx0{TensorDesc(bxc.ptr, DType::kUInt8, {T, K}, dev), TensorDesc(bxsc.ptr, DType::kFloat32, bxs, dev), 1};
  const BlockFP8Tensor bw0{TensorDesc(bwc.ptr, DType::kUInt8, {N, K}, dev), TensorDesc(bwsc.ptr, DType::kFloat32, bws, dev), 128};
  BlockFP8Tensor bx = bx0, bw = bw0;
  if (bk) {
    BlockQuantizeOptions wq;
    wq.block_rows = 128;
    quantize_blockwise(w, bw, wq);
  }
  auto fused = [&] {
    if (bk) {
      quantize_blockwise(x, bx, BlockQuantizeOptions{});
      fused_q_uproj_rope_quant(bx, bw, c, sn, q, nullptr, o);
    } else if (mx) {
      quantize(x, x8, xq);
      fused_q_uproj_rope_quant(x8, w8, c, sn, q, nullptr, o);
    } else {
      fused_q_uproj_rope_quant(x, w, c, sn, q, nullptr, o);
    }
  };
  fused();  // argument errors (K % 8, ...) before anything is timed

  // peers: cuBLAS bf16 GEMM q[T, N] = x W^T (fp32 accumulation) alone, and followed by mxmla's RoPE
  // (in place, bf16) and mxmla's quantize_attention (rowwise + columnwise, compact): the unfused pipeline
  Cublas blas;
  const bool have_blas = blas.load();
  if (!have_blas)
    std::printf("cuBLAS not found (tried %s; MXMLA_CUBLAS=path names it): its peers are not timed\n",
                blas.tried.c_str());
  cublasHandle_t handle = nullptr;
  if (have_blas) cublas_check(blas.create(&handle), "create");
  const float one = 1.f, zero = 0.f;
  auto gemm = [&] {
    cublas_check(blas.gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(T), int(K), &one, dw.ptr, CUDA_R_16BF, int(K),
                           dx.ptr, CUDA_R_16BF, int(K), &zero, dq.ptr, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT),
                 "GemmEx");
  };
  const std::vector<int64_t> q4 = qproj_q_shape(T, a.heads, o);
  TensorDesc qd(dq.ptr, DType::kBFloat16, q4, dev);
  RopeOptions ro;
  ro.style = a.style, ro.layout = RopeLayout::kSBHD;
  AttentionQuantizeOptions ao;
  ao.format = a.format, ao.bhsd_scales = false;
  MXFP8Tensor q2 = describe(s.data, s, drow.ptr, drs.ptr, dcol.ptr, dcs.ptr, dev);
  auto unfused = [&] {
    gemm();
    apply_rope(qd, c, sn, qd, ro);
    quantize_attention(qd, q2, ao);
  };

  GpuTimer timer(a.iters);
  progress.begin("timing (fused, cuBLAS GEMM, unfused; 3 rounds)", have_blas ? 9 : 3, "measurements");
  auto time_it = [&](auto&& fn) {
    const float ms = timer.median_ms(fn);
    progress.advance();
    return ms;
  };
  // interleave the three so that clocks and neighbours affect them alike
  std::vector<float> tf, tg, tu;
  for (int rep = 0; rep < 3; ++rep) {
    tf.push_back(time_it(fused));
    if (have_blas) tg.push_back(time_it(gemm)), tu.push_back(time_it(unfused));
  }
  const float t_f = median(tf);
  fused();  // the outputs to check
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  Compact got{drow.download<uint8_t>(), drs.download<uint8_t>(), dcol.download<uint8_t>(), dcs.download<uint8_t>()};
  const int64_t total = (T + 31) / 32 * a.heads;
  Inputs ref_in;  // --weights mxfp8: the reference multiplies the GPU's MXFP8 x and W, exactly dequantized
  if (mx) {
    HostMx hx(T, K, a.format), hw(N, K, a.format);
    hx.codes = x8r.download<uint8_t>(), hx.scales = x8rs.download<uint8_t>();
    hw.codes = w8r.download<uint8_t>(), hw.scales = w8rs.download<uint8_t>();
    hx.t.rowwise_data.data = hx.codes.data(), hx.t.rowwise_scale_inv.data = hx.scales.data();
    hw.t.rowwise_data.data = hw.codes.data(), hw.t.rowwise_scale_inv.data = hw.scales.data();
    ref_in = in;
    ref_in.x = exact_bf16(hx.t), ref_in.w = exact_bf16(hw.t);
  }
  if (bk) {  // --weights block-fp8: the GPU's codes and scales, exactly dequantized (power-of-two scales)
    HostBlock hx(T, K, 1), hw(N, K, 128);
    hx.codes = bxc.download<uint8_t>(), hx.scales = bxsc.download<float>();
    hw.codes = bwc.download<uint8_t>(), hw.scales = bwsc.download<float>();
    ref_in = in;
    ref_in.x = exact_bf16(hx), ref_in.w = exact_bf16(hw);
  }
  const bool ok =
      report_check(check_sample(a, T, mx || bk ? ref_in : in, got, progress), std::min(total, a.check_groups), total, bk);
  const double flop = 2.0 * T * N * K;
  std::printf("fused        : %.4f ms  %.0f TFLOP/s%s\n", t_f, flop / t_f / 1e9,
              mx ? " (MXFP8 W; x's quantization, both copies, included)"
              : bk ? " (block-FP8 W; x's 1 x 128 quantization included)"
                   : "");
  if (have_blas) {
    const float t_g = median(tg), t_u = median(tu);
    std::printf("cuBLAS GEMM  : %.4f ms  %.0f TFLOP/s (bf16 out, same run)\n", t_g, flop / t_g / 1e9);
    std::printf("GEMM+RoPE+Q  : %.4f ms  %.0f TFLOP/s (cuBLAS + mxmla apply_rope + quantize_attention)\n", t_u,
                flop / t_u / 1e9);
    std::printf("ratio        : fused / cuBLAS GEMM alone = %.3f (%s); unfused / fused = %.2fx\n", t_f / t_g,
                mx   ? "target <= 1.15 with an MXFP8 weight"
                : bk ? "<= 1.00 with a block-FP8 weight: the FP8 tensor cores"
                     : "<= 1.00: the fusion is free",
                t_u / t_f);
    blas.destroy(handle);
  }
  return ok ? 0 : 1;
}
#endif

}  // namespace mxmla::tool
