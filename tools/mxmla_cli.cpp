// mxmla — command-line tool.
//   mxmla info                 build, GPUs, which ops run where
//   mxmla run [options]        the main job: the fused Q up-projection GEMM + RoPE + MXFP8 of a
//                              DeepSeek-V3 layer (run_qproj.cpp)
//   mxmla run --op attention   the attention forward and backward of a DeepSeek-V3 layer on MXFP8 Q, K, V
//                              (run_attention.cpp); --op quantize is run-quantize
//   mxmla run-quantize [opts]  MXFP8 quantize of a query tensor [T, NH, D] bf16 (run_quantize.cpp)
//   mxmla --version | --help | <command> --help
// Exit status: 0 success, 1 a check failed or the GPU failed, 2 bad input (the message names the
// option and the rule).
#include <cstdio>
#include <string>
#include <vector>

#include "mxmla/mxfp8.h"
#include "mxmla/qproj.h"
#include "tools/cli_args.h"
#include "tools/jobs.h"
#include "tools/run_attention.h"

using namespace mxmla;
using namespace mxmla::tool;

namespace {

const char* kOverview =
    "mxmla %s: MXFP8 quantization, RoPE and the fused Q up-projection for DeepSeek-V3 MLA training\n"
    "on Hopper (sm_90a), each checked against a CPU reference.\n"
    "\n"
    "usage: mxmla <command> [options]      (options as '--opt value' or '--opt=value')\n"
    "       mxmla <command> --help\n"
    "       mxmla --version | --help\n"
    "\n"
    "commands:\n"
    "  info          the build (CUDA kernels on or off), the visible GPUs, which ops run where\n"
    "  run           the main job: the fused Q up-projection GEMM + RoPE + MXFP8 of a DeepSeek-V3\n"
    "                layer (T 4096, NH 128, K 1536) on the GPU, checked against the CPU reference and\n"
    "                timed against cuBLAS; without a GPU, the CPU reference at T 256, NH 16 (it says so)\n"
    "  run --op attention\n"
    "                the attention forward and backward of a DeepSeek-V3 layer (h 128, d 192/128,\n"
    "                causal, s 4096) on MXFP8 Q, K, V, checked against float64 and timed; without a\n"
    "                GPU, the CPU reference at s 256, h 2\n"
    "  run-quantize  MXFP8 quantize of a query tensor [T, NH, 192] bf16, rowwise + columnwise: on the\n"
    "                GPU checked bit for bit and timed against a copy; without a GPU, the CPU\n"
    "                reference at T 256\n"
    "\n"
    "Exit status: 0 done (and the check passed), 1 a check failed or a CUDA error, 2 bad input.\n"
    "Phases longer than 2 s report progress on stderr (MXMLA_PROGRESS_INTERVAL=seconds changes it).\n";

void print_overview(FILE* f) { std::fprintf(f, kOverview, build_info().version); }

std::string default_threads() { return std::to_string(cpu_threads(0)); }

Fp8Format parse_format(const std::string& cmd, const std::string& v) {
  return parse_choice(cmd, "--format", v, {"e4m3", "e5m2"}) == "e4m3" ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
}

std::string parse_device(const std::string& cmd, const std::string& v) {
  return parse_choice(cmd, "--device", v, {"auto", "cpu", "cuda"});
}

// The options every job takes alike.
OptionSpec seed_option(const std::string& cmd, uint64_t& seed) {
  return {"--seed", "S", "random seed, >= 0; default 1234",
          [&seed, cmd](const std::string& v) { seed = parse_int(cmd, "--seed", v, 0, INT64_MAX); }};
}
OptionSpec device_option(const std::string& cmd, std::string& device) {
  return {"--device", "D", "auto (default: the GPU when one is visible, else the CPU), cpu,\nor cuda (an error without a GPU)",
          [&device, cmd](const std::string& v) { device = parse_device(cmd, v); }};
}

// `mxmla run --op OP`: which job `run` runs. The option is taken out of argv before the job parses
// its own options (a job's help lists it too, as `--op`).
const std::vector<std::string> kOps = {"qproj", "attention", "quantize"};
OptionSpec op_option(const std::string& job) {
  return {"--op", "OP",
          "the job: qproj (the default: the fused Q up-projection), attention\n(the attention forward) or quantize "
          "(as mxmla run-quantize);\nthis text is " + job + "'s",
          [](const std::string&) {}};
}
std::string take_op(int& argc, char** argv) {
  std::string op = "qproj";
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    int n = 0;
    if (arg == "--op") {
      if (i + 1 >= argc) throw UsageError("mxmla run", "option '--op' needs a value (OP)");
      op = argv[i + 1], n = 2;
    } else if (arg.rfind("--op=", 0) == 0) {
      op = arg.substr(5), n = 1;
    } else {
      continue;
    }
    parse_choice("mxmla run", "--op", op, kOps);
    std::copy(argv + i + n, argv + argc, argv + i);
    argc -= n, --i;
  }
  return op;
}

// True when the job should run on the GPU; --device cuda without one is bad input.
bool use_gpu(const std::string& cmd, const std::string& device) {
  const bool gpu = cuda_device_count() > 0;
  if (device == "cuda" && !gpu)
    throw UsageError(cmd, build_info().cuda_enabled ? "option '--device' is cuda but no CUDA device is visible"
                                                    : "option '--device' is cuda but this build has no CUDA kernels "
                                                      "(built with MXMLA_ENABLE_CUDA=OFF or without nvcc)");
  if (device == "auto" && !gpu)
    std::printf("%s: no GPU found%s\n", cmd.c_str(), build_info().cuda_enabled ? "" : " (a CPU-only build)");
  return gpu && device != "cpu";
}

// ------------------------------------------------------------------ info
int cmd_info(int argc, char** argv) {
  const Command c{"mxmla info",
                  "Prints the version, whether the CUDA kernels are built (and for which architecture), the\n"
                  "visible GPUs, and which implementation of each op runs on the CPU and on CUDA.\n",
                  {}};
  if (!c.parse(argc, argv, 2)) return 0;
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
  std::printf("%-28s %-22s %s\n", "attention_forward", "reference", gpu);
  std::printf("%-28s %-22s %s\n", "attention_backward", "reference (float64)", gpu);
  std::printf("%-28s %-22s %s\n", "gemm (MXFP8 operands)", "reference (float64)", gpu);
  std::printf("%-28s %-22s %s\n", "gemm (bf16 operands)", "reference (float64)", b.cuda_enabled ? "raises (cuBLAS: torch.matmul)" : "not built");
  return 0;
}

// ------------------------------------------------------------------ run
int cmd_run_quantize(int argc, char** argv);
int cmd_run_attention(int argc, char** argv);

int cmd_run(int argc, char** argv) {
  const std::string op = take_op(argc, argv);
  if (op == "attention") return cmd_run_attention(argc, argv);
  if (op == "quantize") return cmd_run_quantize(argc, argv);
  const std::string cmd = "mxmla run";
  QProjRunArgs a;
  std::string device = "auto";
  auto count = [&](const char* opt, int64_t& field, int64_t lo = 1) {
    return [&field, opt, lo, cmd](const std::string& v) { field = parse_int(cmd, opt, v, lo); };
  };
  const Command c{
      cmd,
      "The main job. q = x . W^T (x [T, K] bf16, W [NH*192, K] bf16, fp32 accumulation, rounded to\n"
      "bf16), RoPE on the last 64 of each 192-wide head (fp32), MXFP8 of q rowwise (blocks along the\n"
      "head dim) and columnwise (blocks of 32 tokens): one fused kernel on the GPU. The data is random\n"
      "with realistic scaling: x ~ N(0, 1) like c_q after RMSNorm, W ~ N(0, 1/K), DeepSeek-V3 YaRN tables.\n"
      "\n"
      "On a GPU: checks sampled (32-token group, head) pairs against the CPU reference (nope codes\n"
      "within one FP8 step and scales within one where they differ at all: fp32 summation order;\n"
      "rope codes within 2^-7 of the block range), and times the fused kernel, cuBLAS's bf16 GEMM\n"
      "alone and cuBLAS + mxmla's RoPE + quantize in the same run (medians of --iters calls, L2\n"
      "flushed before each). Defaults: T 4096, NH 128, K 1536 (one DeepSeek-V3 layer).\n"
      "Without a GPU (or with --device cpu): the CPU reference (float64 GEMM, on every core) at\n"
      "T 256, NH 16 unless --tokens / --heads say otherwise, said on the first line; it checks the\n"
      "round trip of the rowwise codes against q within the MX error bound. A CPU run at the GPU's\n"
      "size (--tokens 4096 --heads 128) takes minutes; progress goes to stderr.\n",
      {
          op_option("the fused Q up-projection"),
          {"--tokens", "T", "tokens (rows of x), >= 1; default 4096 on the GPU, 256 on the CPU", count("--tokens", a.tokens)},
          {"--heads", "NH", "query heads of 192 (128 nope + 64 rope), >= 1;\ndefault 128 on the GPU, 16 on the CPU",
           count("--heads", a.heads)},
          {"--k", "K", "contraction size (q_lora_rank), >= 1 (the GPU kernel needs a\nmultiple of 8); default 1536",
           count("--k", a.k)},
          {"--style", "S",
           "RoPE style: interleaved_in_halves_out (default), interleaved or\nrotate_half (as in the Python API; "
           "'halves' is a short alias of\ninterleaved_in_halves_out)",
           [&](const std::string& v) {
             const std::string s = parse_choice(cmd, "--style", v,
                                                {"interleaved_in_halves_out", "interleaved", "rotate_half", "halves"});
             a.style = s == "interleaved"   ? RopeStyle::kInterleaved
                       : s == "rotate_half" ? RopeStyle::kRotateHalf
                                            : RopeStyle::kInterleavedInHalvesOut;
           }},
          {"--format", "F", "FP8 codes: e4m3 (default) or e5m2", [&](const std::string& v) { a.format = parse_format(cmd, v); }},
          {"--weights", "W",
           "bf16 (default), mxfp8: the MXFP8-weight path (W quantized once,\nrowwise; x quantized rowwise + "
           "columnwise in each call, as\nits saved activation; the GEMM on the exactly dequantized\ncodes; the "
           "same RoPE + MXFP8 epilogue), or block-fp8: the\nDeepSeek-V3 recipe (W quantized once in 128 x 128 "
           "blocks, x\nin 1 x 128 blocks in each call; the GEMM on the FP8 tensor\ncores)",
           [&](const std::string& v) {
             const std::string w = parse_choice(cmd, "--weights", v, {"bf16", "mxfp8", "block-fp8"});
             a.mxfp8_weights = w == "mxfp8", a.block_weights = w == "block-fp8";
           }},
          {"--iters", "N", "GPU: timed calls per measurement (after 3 warm-up calls), >= 1;\ndefault 10",
           count("--iters", a.iters)},
          {"--check-groups", "N", "GPU: (32-token group, head) pairs checked against the CPU\nreference, >= 1; default 64",
           count("--check-groups", a.check_groups)},
          seed_option(cmd, a.seed),
          device_option(cmd, device),
          {"--threads", "N", "CPU threads for the reference and the check, >= 1; default " + default_threads() +
                                 "\n(every core)",
           [&](const std::string& v) { a.threads = parse_int(cmd, "--threads", v, 1, 1024); }},
      }};
  if (!c.parse(argc, argv, 2)) return 0;
  Progress progress(cmd);
#if MXMLA_WITH_CUDA
  if (use_gpu(cmd, device)) return run_qproj_cuda(a, progress);
#else
  (void)use_gpu(cmd, device);
#endif
  return run_qproj_cpu(a, progress);
}

// ------------------------------------------------------------------ run-quantize
int cmd_run_quantize(int argc, char** argv) {
  const std::string cmd = "mxmla run-quantize";
  QuantizeRunArgs a;
  std::string device = "auto";
  auto count = [&](const char* opt, int64_t& field, int64_t lo = 1) {
    return [&field, opt, lo, cmd](const std::string& v) { field = parse_int(cmd, opt, v, lo); };
  };
  const Command c{
      cmd,
      "MXFP8 quantize of a query-shaped tensor [T, NH, D] bf16 (random, per-row scales spread over\n"
      "2^-8 .. 2^8), rowwise and columnwise in one pass, compact or swizzled (F8_128x4) scales.\n"
      "On a GPU: the CUDA kernel, checked bit for bit against the CPU reference on sampled 32-row\n"
      "groups, timed (median of --iters calls, L2 flushed) against a device-to-device copy of the\n"
      "input in the same run. Defaults: T 4096, NH 128, D 192 (a DeepSeek-V3 query).\n"
      "Without a GPU (or with --device cpu): the CPU reference at T 256 unless --tokens says otherwise,\n"
      "said on the first line; it checks the round trip of both directions within the MX error bound.\n",
      {
          {"--tokens", "T", "tokens, >= 1; default 4096 on the GPU, 256 on the CPU", count("--tokens", a.tokens)},
          {"--heads", "NH", "heads, >= 1; default 128", count("--heads", a.heads)},
          {"--head-dim", "D", "head dim, a positive multiple of 32; default 192",
           [&](const std::string& v) {
             a.dim = parse_int(cmd, "--head-dim", v, 1);
             if (a.dim % 32)
               throw UsageError(cmd, "option '--head-dim' must be a positive multiple of 32 (MX blocks are 32 wide), "
                                     "got '" + v + "'");
           }},
          {"--format", "F", "FP8 codes: e4m3 (default) or e5m2", [&](const std::string& v) { a.format = parse_format(cmd, v); }},
          {"--swizzle", "", "write swizzled (F8_128x4, GEMM-ready) scales instead of compact ones",
           [&](const std::string&) { a.swizzle = true; }},
          {"--iters", "N", "GPU: timed calls per measurement, >= 1; default 50", count("--iters", a.iters)},
          {"--check-blocks", "N", "GPU: 32-row groups checked bit for bit, >= 1; default 2048",
           count("--check-blocks", a.check_blocks)},
          seed_option(cmd, a.seed),
          device_option(cmd, device),
          {"--threads", "N", "CPU threads for the reference, >= 1; default " + default_threads() + " (every core)",
           [&](const std::string& v) { a.threads = parse_int(cmd, "--threads", v, 1, 1024); }},
      }};
  if (!c.parse(argc, argv, 2)) return 0;
  Progress progress(cmd);
#if MXMLA_WITH_CUDA
  if (use_gpu(cmd, device)) return run_quantize_cuda(a, progress);
#else
  (void)use_gpu(cmd, device);
#endif
  return run_quantize_cpu(a, progress);
}

// ------------------------------------------------------------------ run --op attention
int cmd_run_attention(int argc, char** argv) {
  const std::string cmd = "mxmla run --op attention";
  AttentionRunArgs a;
  std::string device = "auto";
  auto count = [&](const char* opt, int64_t& field, int64_t lo = 1) {
    return [&field, opt, lo, cmd](const std::string& v) { field = parse_int(cmd, opt, v, lo); };
  };
  const Command c{
      cmd,
      "The attention forward and backward of a DeepSeek-V3 layer on MXFP8 Q, K, V (b 1, h = h_kv,\n"
      "d_qk 192, d_v 128, s_q = s_kv): q from the fused Q up-projection of x ~ N(0, 1) [s, 1536] (rowwise,\n"
      "BHSD scales, one kernel), k and v ~ N(0, 1) bf16 quantized by quantize_attention (k rowwise, v\n"
      "columnwise, BHSD scales), sbhd; softmax scale 192^-0.5; O bf16 and LSE fp32. The backward takes\n"
      "dO ~ N(0, 1) bf16 and the forward's O and LSE, the same MXFP8 copies serving every GEMM, P and dS\n"
      "in bf16; dQ, dK, dV bf16.\n"
      "\n"
      "On a GPU: checks sampled (b, h, row) triples of O and LSE against a float64 attention on the\n"
      "dequantized inputs (P bf16: |err| <= 2^-8 (max|v| + |O|); P E4M3: the reference system's\n"
      "atol 0.12, rtol 0.2), and times the op (median of --iters calls, L2 flushed, 3 rounds) with the\n"
      "same op on the bf16 q, k, v in the same run; TFLOP/s = 2*b*h*(s^2/2)*(d_qk + d_v) / time when\n"
      "causal. The backward likewise: --check-rows rows (dQ) and keys (dK, dV) against the float64\n"
      "backward on the same inputs, O and LSE (|err| <= 0.02 + 0.05 |ref|), timed with the same op on\n"
      "the bf16 inputs; TFLOP/s = 2*b*h*(s^2/2)*(3*d_qk + 2*d_v) / time when causal.\n"
      "Defaults: s 4096, h 128, causal (one DeepSeek-V3 layer).\n"
      "Without a GPU (or with --device cpu): the CPU reference at s 256, h 2 unless --seq / --heads\n"
      "say otherwise, said on the first line, checked the same way.\n",
      {
          op_option("the attention forward and backward"),
          {"--seq", "S", "sequence length (queries = keys), >= 1; default 4096 on the\nGPU, 256 on the CPU",
           count("--seq", a.seq)},
          {"--heads", "H", "heads (query = key/value heads), >= 1; default 128 on the GPU,\n2 on the CPU",
           count("--heads", a.heads)},
          {"--causal", "", "causal mask, top-left aligned (the default)", [&](const std::string&) { a.causal = true; }},
          {"--no-causal", "", "no mask", [&](const std::string&) { a.causal = false; }},
          {"--p-format", "P",
           "P in the P.V GEMM: bfloat16 (default; 'bf16' is a short alias) or\ne4m3 (the reference system's "
           "p*2^8 -> E4M3 -> /2^8)",
           [&](const std::string& v) {
             a.p_format = parse_choice(cmd, "--p-format", v, {"bfloat16", "bf16", "e4m3"}) == "e4m3" ? PFormat::kE4M3
                                                                                                      : PFormat::kBF16;
           }},
          {"--format", "F", "FP8 codes of q, k, v: e4m3 (default) or e5m2",
           [&](const std::string& v) { a.format = parse_format(cmd, v); }},
          {"--iters", "N", "GPU: timed calls per measurement (after 3 warm-up calls), >= 1;\ndefault 10",
           count("--iters", a.iters)},
          {"--check-rows", "N",
           "(b, h, row) triples checked against the float64 attention, >= 1;\ndefault 256 on the GPU, 1024 on the "
           "CPU (every row at s 256, h 2)",
           count("--check-rows", a.check_rows)},
          seed_option(cmd, a.seed),
          device_option(cmd, device),
          {"--threads", "N", "CPU threads for the check, >= 1; default " + default_threads() + " (every core)",
           [&](const std::string& v) { a.threads = parse_int(cmd, "--threads", v, 1, 1024); }},
      }};
  if (!c.parse(argc, argv, 2)) return 0;
  Progress progress(cmd);
#if MXMLA_WITH_CUDA
  if (use_gpu(cmd, device)) return run_attention_cuda(a, progress);
#else
  (void)use_gpu(cmd, device);
#endif
  return run_attention_cpu(a, progress);
}

}  // namespace

int main(int argc, char** argv) {
  std::string cmd = argc > 1 ? argv[1] : "";
  char* help_argv[] = {argv[0], nullptr, const_cast<char*>("--help"), nullptr};
  try {
    if (argc < 2) {
      print_overview(stderr);
      return 2;
    }
    if (cmd == "--version" || cmd == "-V") {
      std::printf("mxmla %s\n", build_info().version);
      return 0;
    }
    if (cmd == "--help" || cmd == "-h") {
      print_overview(stdout);
      return 0;
    }
    if (cmd == "help") {  // mxmla help [command]
      if (argc < 3) {
        print_overview(stdout);
        return 0;
      }
      help_argv[1] = argv[2];
      argv = help_argv, argc = 3, cmd = argv[1];
    }
    if (cmd == "info") return cmd_info(argc, argv);
    if (cmd == "run") return cmd_run(argc, argv);
    if (cmd == "run-quantize") return cmd_run_quantize(argc, argv);
    std::fprintf(stderr, "mxmla: error: unknown command '%s' (commands: info, run, run-quantize; see mxmla --help)\n",
                 cmd.c_str());
    return 2;
  } catch (const UsageError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s: error: %s (see '%s --help')\n", e.command().c_str(), e.what(), e.command().c_str());
    return 2;
  } catch (const Error& e) {  // the library rejected an argument (e.g. --k not a multiple of 8 on the GPU)
    std::fflush(stdout);
    std::fprintf(stderr, "mxmla %s: error: %s\n", cmd.c_str(), e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "mxmla %s: error: out of host memory for this size\n", cmd.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "mxmla %s: failure: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
