"""Timing of the attention backward's CUDA path (src/cuda/sm90_attention_bwd.cu at these head dims;
deterministic=True: the same kernel, its dQ sums in a fixed order; MXMLA_ATTN_BWD=simt: the
CUDA-core kernel) against cuDNN's bf16 SDPA backward (torch, cuDNN backend) on the dequantized
inputs, same run: DeepSeek-V3 head dims (192 / 128), causal, bshd, b 1,
H heads, s tokens. TFLOP/s on the causal triangle, 2·(3·d_qk + 2·d_v) per causal element; medians, L2 flushed (bench/timing.py).
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_bwd_time.py [H] [s ...]   (default 16, 2048)"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402


def main():
    H = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    seqs = [int(x) for x in sys.argv[2:]] or [2048]
    flush = flush_buffer(torch.device("cuda"))
    scale = mxmla.yarn_softmax_scale()
    print(f"{'s':>6s} {'H':>4s} {'ours ms':>9s} {'TFLOP/s':>8s} {'det. ms':>9s} {'TFLOP/s':>8s} {'cuDNN ms':>9s} "
          f"{'TFLOP/s':>8s} {'ours/cuDNN':>10s} {'det./cuDNN':>10s} {'bf16-in ms':>10s} {'TFLOP/s':>8s}")
    for s in seqs:
        q, k = (torch.randn(1, s, H, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, s, H, 128, device="cuda", dtype=torch.bfloat16)
        q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
        o, lse = mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale, return_lse=True)
        do = torch.randn_like(o)
        t_ours = timer(lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale), 5,
                       flush)
        qb, kb, vb = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape) for t in (q8, k8, v8))
        t_bf16 = timer(lambda: mxmla.attention_backward(do, qb, kb, vb, o, lse, causal=True, softmax_scale=scale,
                                                        layout="bshd"), 5,
                       flush)
        t_det = timer(lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale,
                                                       deterministic=True), 5, flush)
        qd, kd, vd = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape).transpose(1, 2).detach()
                      .requires_grad_() for t in (q8, k8, v8))
        try:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                od = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            dod = do.transpose(1, 2)
            t_cudnn = timer(lambda: torch.autograd.grad(od, (qd, kd, vd), dod, retain_graph=True), 20, flush)
        except RuntimeError as e:  # no cuDNN SDPA for these dims in this torch
            print(f"cuDNN SDPA backward not available: {str(e).splitlines()[0]}")
            t_cudnn = float("nan")
        flops = 2.0 * (3 * 192 + 2 * 128) * H * s * s / 2
        tf = lambda t: flops / t * 1e-9  # noqa: E731
        print(f"{s:6d} {H:4d} {t_ours:9.3f} {tf(t_ours):8.1f} {t_det:9.3f} {tf(t_det):8.1f} {t_cudnn:9.3f} "
              f"{tf(t_cudnn):8.1f} {t_cudnn / t_ours:10.3f} {t_cudnn / t_det:10.3f} {t_bf16:10.3f} {tf(t_bf16):8.1f}")


if __name__ == "__main__":
    main()
