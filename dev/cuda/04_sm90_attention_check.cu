// mxmla experiment — the SM90 attention forward kernel on its own (no API layer): bshd inputs,
// bf16 or MXFP8 (E4M3, compact scales from the CPU quantizer), checked against a float64 attention
// on the dequantized inputs for a few heads, then timed (L2 flushed, median).
//   04_sm90_attention_check [B S H causal(0/1) fp8(0/1) check_heads Dqk]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/attention_ops.h"
#include "common/host_util.h"
#include "cpu/reference.h"
#include "dev/cuda/dev_util.h"
#include "mxmla/mxfp8.h"

using namespace mxmla;

namespace {

struct Operand {
  std::vector<uint16_t> bf16;   // [B, S, H, D]
  std::vector<float> deq;       // what the kernel computes with
  util::DeviceBuffer data, scales;
  detail::AttnScaleView sc;
};

Operand make(int64_t B, int64_t S, int64_t H, int64_t D, uint64_t seed, bool fp8, bool rowwise) {
  Operand o;
  o.bf16 = util::random_bf16(B * S * H, D, seed, 0, 0);
  o.deq.resize(o.bf16.size());
  if (!fp8) {
    for (size_t i = 0; i < o.bf16.size(); ++i) o.deq[i] = static_cast<float>(ref::bf16_to_double(o.bf16[i]));
    o.data = util::DeviceBuffer(o.bf16.size() * 2);
    o.data.upload(o.bf16.data());
    return o;
  }
  const std::vector<int64_t> shape{B, S, H, D};
  const MXFP8Shapes sh = attention_shapes(shape, QKVLayout::kBSHD, false);
  std::vector<uint8_t> codes(numel(sh.data)), scales(numel(rowwise ? sh.rowwise_scale : sh.columnwise_scale));
  MXFP8Tensor t;
  t.shape = shape;
  const TensorDesc in(o.bf16.data(), DType::kBFloat16, shape);
  (rowwise ? t.rowwise_data : t.columnwise_data) = TensorDesc(codes.data(), DType::kUInt8, sh.data);
  (rowwise ? t.rowwise_scale_inv : t.columnwise_scale_inv) =
      TensorDesc(scales.data(), DType::kUInt8, rowwise ? sh.rowwise_scale : sh.columnwise_scale);
  AttentionQuantizeOptions qo;
  qo.layout = QKVLayout::kBSHD, qo.rowwise = rowwise, qo.columnwise = !rowwise, qo.bhsd_scales = false;
  quantize_attention(in, t, qo);
  t.attention = true, t.qkv_layout = QKVLayout::kBSHD;
  TensorDesc out(o.deq.data(), DType::kFloat32, shape);
  dequantize(t, out, !rowwise);
  o.data = util::DeviceBuffer(codes.size());
  o.data.upload(codes.data());
  o.scales = util::DeviceBuffer(scales.size());
  o.scales.upload(scales.data());
  o.sc.ptr = o.scales.as<uint8_t>();
  o.sc.map = rowwise ? detail::make_row_map(detail::MapMode::kCompact, B, S, H * D)
                     : detail::make_col_map(detail::MapMode::kCompact, B, S, H * D);
  o.sc.bi_b = 1, o.sc.row_s = 1, o.sc.col_h = D;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t B = argc > 1 ? atoll(argv[1]) : 1, S = argc > 2 ? atoll(argv[2]) : 4096, H = argc > 3 ? atoll(argv[3]) : 128;
  const bool causal = argc > 4 ? atoi(argv[4]) != 0 : true, fp8 = argc > 5 ? atoi(argv[5]) != 0 : true;
  const int check_heads = argc > 6 ? atoi(argv[6]) : 2;
  const int64_t Dqk = argc > 7 ? atoll(argv[7]) : 192, Dv = 128;
  std::printf("attention fwd: B %lld S %lld H %lld d %lld/%lld causal %d %s\n", (long long)B, (long long)S,
              (long long)H, (long long)Dqk, (long long)Dv, causal, fp8 ? "MXFP8 e4m3" : "bf16");
  Operand q = make(B, S, H, Dqk, 1, fp8, true), k = make(B, S, H, Dqk, 2, fp8, true), v = make(B, S, H, Dv, 3, fp8, false);
  util::DeviceBuffer o(B * S * H * Dv * 2), lse(B * H * S * 4);
  detail::AttentionProblem p;
  p.B = B, p.Sq = S, p.Skv = S, p.H = H, p.Hkv = H, p.Dqk = Dqk, p.Dv = Dv;
  p.fp8 = fp8;
  p.q = {q.data.ptr, S * H * Dqk, H * Dqk, Dqk}, p.k = {k.data.ptr, S * H * Dqk, H * Dqk, Dqk};
  p.v = {v.data.ptr, S * H * Dv, H * Dv, Dv};
  p.q_sc = q.sc, p.k_sc = k.sc, p.v_sc = v.sc;
  p.causal = causal;
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dqk));
  p.softmax_scale = static_cast<float>(scale);
  p.o = o.as<uint16_t>(), p.o_st_b = S * H * Dv, p.o_st_s = H * Dv, p.o_st_h = Dv;
  p.lse = lse.as<float>();
  detail::attention_fwd_cuda(p, nullptr);
  MXMLA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> oh = o.download<uint16_t>();
  const std::vector<float> lh = lse.download<float>();

  // float64 check of `check_heads` heads (every row)
  double max_err = 0, se = 0, sr = 0, lse_err = 0;
  int64_t bad = 0;
  for (int c = 0; c < check_heads; ++c) {
    const int64_t b = c % B, h = (c * 37) % H;
    std::vector<double> srow(S);
    for (int64_t i = 0; i < S; ++i) {
      double mx = -INFINITY;
      const int64_t nk = causal ? i + 1 : S;
      for (int64_t j = 0; j < nk; ++j) {
        double acc = 0;
        for (int64_t d = 0; d < Dqk; ++d)
          acc += double(q.deq[((b * S + i) * H + h) * Dqk + d]) * k.deq[((b * S + j) * H + h) * Dqk + d];
        srow[j] = acc * scale;
        mx = std::max(mx, srow[j]);
      }
      double l = 0;
      for (int64_t j = 0; j < nk; ++j) l += (srow[j] = std::exp(srow[j] - mx));
      for (int64_t d = 0; d < Dv; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < nk; ++j) acc += srow[j] * v.deq[((b * S + j) * H + h) * Dv + d];
        const double ref = acc / l, got = ref::bf16_to_double(oh[((b * S + i) * H + h) * Dv + d]);
        const double e = std::fabs(got - ref);
        max_err = std::max(max_err, e), se += e * e, sr += ref * ref;
        if (!(e <= 0.02 + 0.02 * std::fabs(ref))) ++bad;
      }
      lse_err = std::max(lse_err, std::fabs(double(lh[(b * H + h) * S + i]) - (mx + std::log(l))));
    }
  }
  std::printf("check %d heads: max |err| %.3g, rel RMS %.3g, outside atol 0.02 + rtol 0.02: %lld, max LSE err %.3g -> %s\n",
              check_heads, max_err, std::sqrt(se / std::max(sr, 1e-300)), (long long)bad, lse_err,
              (bad == 0 && std::sqrt(se / std::max(sr, 1e-300)) < 5e-3 && lse_err < 1e-4) ? "PASS" : "FAIL");
  const float ms = dev::time_ms([&] { detail::attention_fwd_cuda(p, nullptr); }, 20);
  const double flops = 2.0 * B * H * double(S) * S * (Dqk + Dv) * (causal ? 0.5 : 1.0);
  std::printf("time %.3f ms, %.1f TFLOP/s (causal-halved FLOPs)\n", ms, flops / ms * 1e-9);
  return 0;
}
