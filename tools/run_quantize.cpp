// mxmla run-quantize — MXFP8-quantize a query-shaped tensor [T, NH, D] bf16 rowwise + columnwise.
// GPU: the CUDA kernel, checked bit for bit against the CPU reference on sampled 32-row groups,
// timed against a device-to-device copy in the same run. CPU: the reference (in 32-row chunks on
// every core), checked by its round trip against the MX error bound.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/host_util.h"
#include "mxmla/mxfp8.h"
#include "tools/cli_args.h"
#include "tools/jobs.h"
#if MXMLA_WITH_CUDA
#include "tools/gpu_timer.h"
#endif

namespace mxmla::tool {

namespace {
const char* format_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }

std::string sizes(int64_t T, const QuantizeRunArgs& a) {
  return "T " + std::to_string(T) + ", NH " + std::to_string(a.heads) + ", D " + std::to_string(a.dim);
}
}  // namespace

int run_quantize_cpu(const QuantizeRunArgs& a, Progress& progress) {
  const int64_t T = a.tokens < 0 ? 256 : a.tokens;
  const double n_d = double(T) * a.heads * a.dim;
  check_host_memory("mxmla run-quantize", 9.5 * n_d, sizes(T, a));
  const int threads = cpu_threads(a.threads);
  std::printf("mxmla run-quantize: no GPU in use: running the CPU reference at [%lld, %lld, %lld] bf16%s\n",
              (long long)T, (long long)a.heads, (long long)a.dim,
              a.tokens < 0 ? " (smaller than the GPU default T 4096)" : "");
  const std::vector<int64_t> shape = {T, a.heads, a.dim};
  const int64_t M = T * a.heads, K = a.dim;
  progress.begin("generating inputs");
  std::vector<uint16_t> x = util::random_bf16(M, K, a.seed);
  // Compact scales first (the reference runs on 32-row chunks that write disjoint parts of them),
  // swizzled afterwards when asked for.
  const MXFP8Shapes c = quantize_shapes(shape, false), s = quantize_shapes(shape, a.swizzle);
  std::vector<uint8_t> row(numel(c.data)), rs(numel(c.rowwise_scale)), col(numel(c.data)), cs(numel(c.columnwise_scale));
  QuantizeOptions o;
  o.format = a.format;
  const int64_t groups = (M + 31) / 32, per_chunk = std::max<int64_t>(1, std::min<int64_t>(64, groups / (8 * threads)));
  const int64_t chunks = (groups + per_chunk - 1) / per_chunk;
  const int used = static_cast<int>(std::min<int64_t>(threads, chunks));  // threads that get work
  progress.begin("quantizing on the CPU reference", M, "rows");
  const auto t0 = std::chrono::steady_clock::now();
  parallel_for(chunks, threads, [&](int64_t i) {
    const int64_t r0 = i * per_chunk * 32, nr = std::min(per_chunk * 32, M - r0);
    const MXFP8Shapes cs_i = quantize_shapes({nr, K}, false);
    MXFP8Tensor q = describe({nr, K}, cs_i, row.data() + r0 * K, rs.data() + r0 * (K / 32), col.data() + r0 * K,
                             cs.data() + (r0 / 32) * K, Device{});
    quantize(TensorDesc(x.data() + r0 * K, DType::kBFloat16, {nr, K}), q, o);
    progress.advance(nr);
  });
  std::vector<uint8_t> rsw, csw;
  MXFP8Tensor q = describe(shape, c, row.data(), rs.data(), col.data(), cs.data(), Device{});
  if (a.swizzle) {
    rsw.resize(numel(s.rowwise_scale)), csw.resize(numel(s.columnwise_scale));
    TensorDesc rsd(rsw.data(), DType::kUInt8, s.rowwise_scale), csd(csw.data(), DType::kUInt8, s.columnwise_scale);
    swizzle_scales(TensorDesc(rs.data(), DType::kUInt8, c.rowwise_scale), rsd, M, K, true);
    swizzle_scales(TensorDesc(cs.data(), DType::kUInt8, c.columnwise_scale), csd, M, K, false);
    q = describe(shape, s, row.data(), rsw.data(), col.data(), csw.data(), Device{});
    q.scale_layout = ScaleLayout::kSwizzled;
  }
  q.format = a.format;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Round trip: every element within half a code step of its block (relative 2^-4 for E4M3, 2^-3 for E5M2).
  progress.begin("round-trip check", 2, "directions");
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
    progress.advance();
  }
  progress.end();
  const double rel = std::sqrt(num / den);
  const double bound = a.format == Fp8Format::kE4M3 ? 0.0625 : 0.125;
  std::printf("quantized rowwise + columnwise (%s, %s scales) in %.3f s on the CPU reference, %d thread%s "
              "(%.1f M elements/s)\n",
              format_name(a.format), a.swizzle ? "swizzled" : "compact", secs, used, used == 1 ? "" : "s",
              n_d / secs / 1e6);
  std::printf("round-trip relative error %.4f (bound %.4f): %s\n", rel, bound, rel < bound ? "OK" : "FAILED");
  return rel < bound ? 0 : 1;
}

#if MXMLA_WITH_CUDA
int run_quantize_cuda(const QuantizeRunArgs& a, Progress& progress) {
  const int64_t T = a.tokens < 0 ? 4096 : a.tokens;
  const double n_d = double(T) * a.heads * a.dim;
  check_host_memory("mxmla run-quantize", 7.0 * n_d, sizes(T, a));
  const std::vector<int64_t> shape = {T, a.heads, a.dim};
  const int64_t n = numel(shape);
  std::printf("mxmla run-quantize: GPU %s\n", cuda_device_description(0).c_str());
  std::printf("MXFP8 quantize (rowwise + columnwise, %s, %s scales) of q [%lld, %lld, %lld] bf16\n",
              format_name(a.format), a.swizzle ? "swizzled" : "compact", (long long)T, (long long)a.heads,
              (long long)a.dim);
  progress.begin("generating inputs");
  const MXFP8Shapes s = quantize_shapes(shape, a.swizzle);
  std::vector<uint16_t> x = util::random_bf16(T * a.heads, a.dim, a.seed);
  util::DeviceBuffer dx(n * 2), drow(n), dcol(n), drs(numel(s.rowwise_scale)), dcs(numel(s.columnwise_scale));
  util::DeviceBuffer copy_dst(n * 2);
  dx.upload(x.data());
  const Device dev{DeviceType::kCUDA, 0};
  MXFP8Tensor q = describe(shape, s, drow.ptr, drs.ptr, dcol.ptr, dcs.ptr, dev);
  QuantizeOptions o;
  o.format = a.format, o.swizzle = a.swizzle;
  const TensorDesc in(dx.ptr, DType::kBFloat16, shape, dev);

  progress.begin("timing (quantize, copy)", 2, "measurements");
  GpuTimer timer(a.iters);
  auto time_it = [&](auto&& fn) {
    const float ms = timer.median_ms(fn);
    progress.advance();
    return ms;
  };
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
    TensorDesc rsw(const_cast<uint8_t*>(rs.data()), DType::kUInt8, s.rowwise_scale),
        csw(const_cast<uint8_t*>(cs.data()), DType::kUInt8, s.columnwise_scale);
    TensorDesc rc(full_rs.data(), DType::kUInt8, c.rowwise_scale), cc(full_cs.data(), DType::kUInt8, c.columnwise_scale);
    unswizzle_scales(rsw, rc, M, K, true);
    unswizzle_scales(csw, cc, M, K, false);
  }
  util::Rng pick(a.seed + 7);
  const int64_t nsample = std::min(groups, a.check_blocks);
  progress.begin("checking against the CPU reference", nsample, "groups");
  int64_t mismatches = 0;
  for (int64_t t = 0; t < nsample; ++t) {
    const int64_t g = nsample == groups ? t : static_cast<int64_t>(pick.uniform() * groups);
    const int64_t r0 = g * 32, nr = std::min<int64_t>(32, M - r0);
    const MXFP8Shapes gs = quantize_shapes({nr, K}, false);
    std::vector<uint8_t> rr(nr * K), rrs(numel(gs.rowwise_scale)), rc(nr * K), rcs(numel(gs.columnwise_scale));
    MXFP8Tensor ref = describe({nr, K}, gs, rr.data(), rrs.data(), rc.data(), rcs.data(), Device{});
    QuantizeOptions ro;
    ro.format = a.format;
    quantize(TensorDesc(x.data() + r0 * K, DType::kBFloat16, {nr, K}), ref, ro);
    mismatches += !std::equal(rr.begin(), rr.end(), row.begin() + r0 * K);
    mismatches += !std::equal(rc.begin(), rc.end(), col.begin() + r0 * K);
    mismatches += !std::equal(rrs.begin(), rrs.end(), full_rs.begin() + r0 * (K / 32));
    mismatches += !std::equal(rcs.begin(), rcs.end(), full_cs.begin() + g * K);
    progress.advance();
  }
  progress.end();
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

}  // namespace mxmla::tool
