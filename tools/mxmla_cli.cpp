// mxmla — command-line tool.
//   mxmla info                 build, GPU, architecture, which ops run where
//   mxmla run [options]        the main job: the fused Q up-projection GEMM + RoPE + MXFP8 of a
//                              DeepSeek-V3 layer (tools/run_qproj.cpp): checked against the CPU
//                              reference, timed against cuBLAS (GPU), or the CPU reference at a
//                              smaller size when there is no GPU.
//   mxmla run-quantize [opts]  MXFP8-quantize a query tensor [T, NH, 192] bf16 (rowwise +
//                              columnwise), check it bit for bit, print time and GB/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/host_util.h"
#include "mxmla/mxfp8.h"
#include "mxmla/qproj.h"
#include "tools/run_qproj.h"
#if MXMLA_WITH_CUDA
#include "tools/gpu_timer.h"
#endif

using namespace mxmla;

namespace {

int usage(FILE* f) {
  std::fprintf(f,
               "usage: mxmla info\n"
               "       mxmla run [--tokens T] [--heads NH] [--k K] [--style halves|interleaved|rotate_half]\n"
               "                 [--format e4m3|e5m2] [--iters N] [--check-groups N] [--seed S] [--device auto|cpu|cuda]\n"
               "defaults: T 4096, NH 128, K 1536 (DeepSeek-V3 q up-projection); without a GPU the CPU\n"
               "          reference runs at T 256, NH 16\n"
               "       mxmla run-quantize [--tokens T] [--heads NH] [--head-dim D] [--device auto|cpu|cuda]\n"
               "                 [--format e4m3|e5m2] [--swizzle] [--iters N] [--check-blocks N] [--seed S]\n"
               "defaults: T 4096, NH 128, D 192 (DeepSeek-V3 query), device auto (GPU when present;\n"
               "          without one the CPU reference runs at T 256), iters 50, check-blocks 2048\n");
  return f == stderr ? 2 : 0;
}

struct RunArgs {
  int64_t tokens = -1, heads = 128, dim = 192, iters = 50, check_blocks = 2048;
  uint64_t seed = 1234;
  std::string device = "auto";
  Fp8Format format = Fp8Format::kE4M3;
  bool swizzle = false;
};

int64_t parse_int(const char* flag, const char* v) {
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (!v[0] || *end || x < 0) throw Error("mxmla run", flag, std::string("expects a non-negative integer, got '") + v + "'");
  return x;
}

// The value after flag argv[i] (advances i).
const char* next_value(int argc, char** argv, int& i) {
  if (i + 1 >= argc) throw Error("mxmla run", argv[i], "needs a value");
  return argv[++i];
}

RunArgs parse_run(int argc, char** argv) {
  RunArgs a;
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&] { return next_value(argc, argv, i); };
    if (f == "--tokens") a.tokens = parse_int("--tokens", value());
    else if (f == "--heads") a.heads = parse_int("--heads", value());
    else if (f == "--head-dim") a.dim = parse_int("--head-dim", value());
    else if (f == "--iters") a.iters = std::max<int64_t>(1, parse_int("--iters", value()));
    else if (f == "--check-blocks") a.check_blocks = parse_int("--check-blocks", value());
    else if (f == "--seed") a.seed = parse_int("--seed", value());
    else if (f == "--device") {
      a.device = value();
      if (a.device != "auto" && a.device != "cpu" && a.device != "cuda")
        throw Error("mxmla run", "--device", "must be auto, cpu or cuda, got '" + a.device + "'");
    } else if (f == "--format") {
      const std::string v = value();
      if (v == "e4m3") a.format = Fp8Format::kE4M3;
      else if (v == "e5m2") a.format = Fp8Format::kE5M2;
      else throw Error("mxmla run", "--format", "must be e4m3 or e5m2, got '" + v + "'");
    } else if (f == "--swizzle") a.swizzle = true;
    else throw Error("mxmla run", f, "is not a known option (see mxmla --help)");
  }
  if (a.heads <= 0) throw Error("mxmla run", "--heads", "must be positive");
  if (a.dim <= 0 || a.dim % 32) throw Error("mxmla run", "--head-dim", "must be a positive multiple of 32");
  return a;
}

int cmd_info() {
  const BuildInfo b = build_info();
  std::printf("mxmla %s\n", b.version);
  std::printf("build: CUDA kernels %s%s%s\n", b.cuda_enabled ? "ON (" : "OFF", b.cuda_archs, b.cuda_enabled ? ")" : "");
  const int n = cuda_device_count();
  if (n == 0) std::printf("gpu: none visible\n");
  for (int i = 0; i < n; ++i) std::printf("gpu %d: %s\n", i, cuda_device_description(i).c_str());
  const char* gpu = b.cuda_enabled ? (n ? "CUDA sm_90a kernel" : "CUDA kernel (no GPU here)") : "not built";
  std::printf("\n%-28s %-22s %s\n", "op", "CPU", "CUDA");
  const char* ops[] = {"quantize (row/col/both)", "dequantize", "swizzle/unswizzle_scales", "quantize_attention (BHSD)",
                       "attention_scales_to_bhsd"};
  for (const char* op : ops) std::printf("%-28s %-22s %s\n", op, "reference (float64)", gpu);
  std::printf("%-28s %-22s %s\n", "apply_rope / rope_backward", "reference (fp32 fma)", gpu);
  std::printf("%-28s %-22s %s\n", "rope_backward_quantize", "reference (fp32 fma)", gpu);
  std::printf("%-28s %-22s %s\n", "rope_tables (plain, YaRN)", "host (float64)", "-");
  std::printf("%-28s %-22s %s\n", "fused_q_uproj_rope_quant", "reference (float64)",
              b.cuda_enabled ? (n ? "CUDA sm_90a wgmma kernel" : "CUDA kernel (no GPU here)") : "not built");
  return 0;
}



// CPU reference run (no GPU): quantize, then check the round trip against the MX error bound.
int run_cpu(const RunArgs& a) {
  const int64_t T = a.tokens < 0 ? 256 : a.tokens;
  std::printf("mxmla run: no GPU in use: running the CPU reference at [%lld, %lld, %lld] bf16%s\n", (long long)T,
              (long long)a.heads, (long long)a.dim, a.tokens < 0 ? " (smaller than the GPU default T 4096)" : "");
  const std::vector<int64_t> shape = {T, a.heads, a.dim};
  const MXFP8Shapes s = quantize_shapes(shape, a.swizzle);
  std::vector<uint16_t> x = util::random_bf16(T * a.heads, a.dim, a.seed);
  std::vector<uint8_t> row(numel(s.data)), rs(numel(s.rowwise_scale)), col(numel(s.data)), cs(numel(s.columnwise_scale));
  MXFP8Tensor q = tool::describe(shape, s, row.data(), rs.data(), col.data(), cs.data(), Device{});
  QuantizeOptions o;
  o.format = a.format, o.swizzle = a.swizzle;
  const auto t0 = std::chrono::steady_clock::now();
  quantize(TensorDesc(x.data(), DType::kBFloat16, shape), q, o);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Round trip: every element within half a code step of its block (relative 2^-4 for E4M3, 2^-3 for E5M2).
  std::vector<float> back(numel(shape));
  TensorDesc out(back.data(), DType::kFloat32, shape);
  double num = 0, den = 0;
  for (int dir = 0; dir < 2; ++dir) {
    dequantize(q, out, dir == 1);
    for (size_t i = 0; i < back.size(); ++i) {
      uint32_t u = static_cast<uint32_t>(x[i]) << 16;
      float xf;
      std::memcpy(&xf, &u, 4);
      num += (back[i] - xf) * double(back[i] - xf);
      den += double(xf) * xf;
    }
  }
  const double rel = std::sqrt(num / den);
  const double bound = a.format == Fp8Format::kE4M3 ? 0.0625 : 0.125;
  std::printf("quantized rowwise + columnwise in %.3f s on the CPU reference (%.1f M elements/s)\n", secs,
              numel(shape) / secs / 1e6);
  std::printf("round-trip relative error %.4f (bound %.4f): %s\n", rel, bound, rel < bound ? "OK" : "FAILED");
  return rel < bound ? 0 : 1;
}

#if MXMLA_WITH_CUDA
int run_cuda(const RunArgs& a) {
  const int64_t T = a.tokens < 0 ? 4096 : a.tokens;
  const std::vector<int64_t> shape = {T, a.heads, a.dim};
  const int64_t n = numel(shape);
  std::printf("mxmla run: GPU %s\n", cuda_device_description(0).c_str());
  std::printf("MXFP8 quantize (rowwise + columnwise, %s, %s scales) of q [%lld, %lld, %lld] bf16\n",
              a.format == Fp8Format::kE4M3 ? "E4M3" : "E5M2", a.swizzle ? "swizzled" : "compact", (long long)T,
              (long long)a.heads, (long long)a.dim);
  const MXFP8Shapes s = quantize_shapes(shape, a.swizzle);
  std::vector<uint16_t> x = util::random_bf16(T * a.heads, a.dim, a.seed);
  util::DeviceBuffer dx(n * 2), drow(n), dcol(n), drs(numel(s.rowwise_scale)), dcs(numel(s.columnwise_scale));
  util::DeviceBuffer copy_dst(n * 2);
  dx.upload(x.data());
  const Device dev{DeviceType::kCUDA, 0};
  MXFP8Tensor q = tool::describe(shape, s, drow.ptr, drs.ptr, dcol.ptr, dcs.ptr, dev);
  QuantizeOptions o;
  o.format = a.format, o.swizzle = a.swizzle;
  const TensorDesc in(dx.ptr, DType::kBFloat16, shape, dev);

  tool::GpuTimer timer(a.iters);
  auto time_it = [&](auto&& fn) { return timer.median_ms(fn); };
  const float t_q = time_it([&] { quantize(in, q, o); });
  const float t_copy = time_it([&] { MXMLA_CUDA_CHECK(cudaMemcpyAsync(copy_dst.ptr, dx.ptr, n * 2, cudaMemcpyDeviceToDevice)); });
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());

  // Check a sample of 32-row groups (every group when check_blocks covers them) bit for bit.
  const int64_t M = T * a.heads, K = a.dim, groups = (M + 31) / 32;
  const auto row = drow.download<uint8_t>(), col = dcol.download<uint8_t>();
  const auto rs = drs.download<uint8_t>(), cs = dcs.download<uint8_t>();
  std::vector<uint8_t> full_rs(rs), full_cs(cs);
  if (a.swizzle) {  // compare in the compact layout
    const MXFP8Shapes c = quantize_shapes(shape, false);
    full_rs.resize(numel(c.rowwise_scale));
    full_cs.resize(numel(c.columnwise_scale));
    TensorDesc rsw(const_cast<uint8_t*>(rs.data()), DType::kUInt8, s.rowwise_scale), csw(const_cast<uint8_t*>(cs.data()), DType::kUInt8, s.columnwise_scale);
    TensorDesc rc(full_rs.data(), DType::kUInt8, c.rowwise_scale), cc(full_cs.data(), DType::kUInt8, c.columnwise_scale);
    unswizzle_scales(rsw, rc, M, K, true);
    unswizzle_scales(csw, cc, M, K, false);
  }
  util::Rng pick(a.seed + 7);
  const int64_t nsample = std::min(groups, a.check_blocks);
  int64_t mismatches = 0;
  for (int64_t t = 0; t < nsample; ++t) {
    const int64_t g = nsample == groups ? t : static_cast<int64_t>(pick.uniform() * groups);
    const int64_t r0 = g * 32, nr = std::min<int64_t>(32, M - r0);
    const MXFP8Shapes gs = quantize_shapes({nr, K}, false);
    std::vector<uint8_t> rr(nr * K), rrs(numel(gs.rowwise_scale)), rc(nr * K), rcs(numel(gs.columnwise_scale));
    MXFP8Tensor ref = tool::describe({nr, K}, gs, rr.data(), rrs.data(), rc.data(), rcs.data(), Device{});
    QuantizeOptions ro;
    ro.format = a.format;
    quantize(TensorDesc(x.data() + r0 * K, DType::kBFloat16, {nr, K}), ref, ro);
    mismatches += !std::equal(rr.begin(), rr.end(), row.begin() + r0 * K);
    mismatches += !std::equal(rc.begin(), rc.end(), col.begin() + r0 * K);
    mismatches += !std::equal(rrs.begin(), rrs.end(), full_rs.begin() + r0 * (K / 32));
    mismatches += !std::equal(rcs.begin(), rcs.end(), full_cs.begin() + g * K);
  }
  const double bytes = n * 2.0 + 2.0 * n + (numel(quantize_shapes(shape, false).rowwise_scale) +
                                            numel(quantize_shapes(shape, false).columnwise_scale));
  std::printf("check: %lld of %lld 32-row groups against the CPU reference: %s\n", (long long)nsample,
              (long long)groups, mismatches ? "MISMATCH" : "bit-exact");
  std::printf("quantize: %.4f ms  %.0f GB/s (bytes: input read once + both outputs written once)\n", t_q,
              bytes / t_q / 1e6);
  std::printf("copy    : %.4f ms  %.0f GB/s (device-to-device, same run)\n", t_copy, 4.0 * n / t_copy / 1e6);
  std::printf("ratio   : quantize reaches %.0f%% of copy bandwidth\n", 100.0 * (bytes / t_q) / (4.0 * n / t_copy));
  return mismatches ? 1 : 0;
}
#endif

tool::QProjRunArgs parse_qproj(int argc, char** argv, std::string& device) {
  tool::QProjRunArgs a;
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&] { return next_value(argc, argv, i); };
    if (f == "--tokens") a.tokens = parse_int("--tokens", value());
    else if (f == "--heads") a.heads = parse_int("--heads", value()), a.heads_given = true;
    else if (f == "--k") a.k = parse_int("--k", value());
    else if (f == "--iters") a.iters = std::max<int64_t>(1, parse_int("--iters", value()));
    else if (f == "--check-groups") a.check_groups = parse_int("--check-groups", value());
    else if (f == "--seed") a.seed = parse_int("--seed", value());
    else if (f == "--device") {
      device = value();
      if (device != "auto" && device != "cpu" && device != "cuda")
        throw Error("mxmla run", "--device", "must be auto, cpu or cuda, got '" + device + "'");
    } else if (f == "--style") {
      const std::string v = value();
      if (v == "halves") a.style = RopeStyle::kInterleavedInHalvesOut;
      else if (v == "interleaved") a.style = RopeStyle::kInterleaved;
      else if (v == "rotate_half") a.style = RopeStyle::kRotateHalf;
      else throw Error("mxmla run", "--style", "must be halves, interleaved or rotate_half, got '" + v + "'");
    } else if (f == "--format") {
      const std::string v = value();
      if (v == "e4m3") a.format = Fp8Format::kE4M3;
      else if (v == "e5m2") a.format = Fp8Format::kE5M2;
      else throw Error("mxmla run", "--format", "must be e4m3 or e5m2, got '" + v + "'");
    } else throw Error("mxmla run", f, "is not a known option (see mxmla --help)");
  }
  if (a.heads <= 0) throw Error("mxmla run", "--heads", "must be positive");
  if (a.k <= 0) throw Error("mxmla run", "--k", "must be positive");
  if (a.tokens == 0) throw Error("mxmla run", "--tokens", "must be positive");
  return a;
}

bool gpu_wanted(const std::string& device) {
  const bool gpu = cuda_device_count() > 0;
  if (device == "cuda" && !gpu)
    throw Error("mxmla run", "--device", build_info().cuda_enabled ? "is cuda but no CUDA device is visible"
                                                                   : "is cuda but this build has no CUDA support");
  if (device == "auto" && !gpu) std::printf("mxmla run: no GPU found\n");
  return gpu && device != "cpu";
}

int cmd_run(int argc, char** argv) {
  std::string device = "auto";
  const tool::QProjRunArgs a = parse_qproj(argc, argv, device);
#if MXMLA_WITH_CUDA
  if (gpu_wanted(device)) return tool::run_qproj_cuda(a);
#else
  (void)gpu_wanted(device);
#endif
  return tool::run_qproj_cpu(a);
}

int cmd_run_quantize(int argc, char** argv) {
  const RunArgs a = parse_run(argc, argv);
  const bool gpu = cuda_device_count() > 0;
  if (a.device == "cuda" && !gpu)
    throw Error("mxmla run", "--device", build_info().cuda_enabled ? "is cuda but no CUDA device is visible"
                                                                   : "is cuda but this build has no CUDA support");
#if MXMLA_WITH_CUDA
  if (gpu && a.device != "cpu") return run_cuda(a);
#endif
  if (a.device == "auto" && !gpu) std::printf("mxmla run: no GPU found\n");
  return run_cpu(a);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) return usage(stderr);
    const std::string cmd = argv[1];
    if (cmd == "info") return cmd_info();
    if (cmd == "run") return cmd_run(argc, argv);
    if (cmd == "run-quantize") return cmd_run_quantize(argc, argv);
    if (cmd == "--help" || cmd == "-h" || cmd == "help") return usage(stdout);
    std::fprintf(stderr, "mxmla: unknown command '%s'\n", cmd.c_str());
    return usage(stderr);
  } catch (const Error& e) {
    std::fprintf(stderr, "mxmla: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mxmla: failure: %s\n", e.what());
    return 1;
  }
}
