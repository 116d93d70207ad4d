#!/usr/bin/env python3
"""Where one attention backward call's GPU time goes: runs mxmla.attention_backward (DeepSeek-V3
dims: b 1, h 128, 192 / 128, causal, bshd, MXFP8 Q, K, V from quantize_attention, and the same on
their dequantized bf16 tensors) under torch.profiler, L2 flushed before each call, and prints per s
the median GPU time of each kernel of the call (the preprocess's D and conversion launches, the
main kernel per group of KV heads, dQ's rounding), their sum and the call's CUDA-event time; also
with Q and K quantized rowwise only (one copy serving every GEMM: the exact gradient of the forward on
the dequantized inputs), the cost of reading the columnwise copies that the semantics ask for.
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_bwd_parts.py [S ...]   (default 4096)"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import flush_buffer, timer  # noqa: E402
from parts import attention_inputs, kernel_times, print_kernels  # noqa: E402

import mxmla  # noqa: E402


def main() -> int:
    sizes = [int(a) for a in sys.argv[1:]] or [4096]
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    scale = mxmla.yarn_softmax_scale()
    for S in sizes:
        torch.manual_seed(0)
        t = attention_inputs(S, dev, backward=True, scale=scale)
        o, lse, do = t["o"], t["lse"], t["do"]
        # rowwise-only Q and K (the rowwise copy serves every GEMM): the cost of the columnwise reads
        q_row, k_row = (mxmla.quantize_attention(x, "bshd", columnwise=False) for x in (t["qb"], t["kb"]))
        for name, args, kw in (("mxfp8", (t["q8"], t["k8"], t["v8"]), {}),
                               ("rowwise", (q_row, k_row, t["v8"]), {}),
                               ("bf16", (t["qb"], t["kb"], t["vb"]), {"layout": "bshd"})):
            fn = lambda: mxmla.attention_backward(do, *args, o, lse, causal=True, softmax_scale=scale, **kw)  # noqa: E731
            total = print_kernels(f"{S:6d} {name:6s}", kernel_times(fn, 10, flush), 10)
            print(f"{S:6d} {name:6s} sum of kernels {total:.4f} ms; call (events) {timer(fn, 10, flush):.4f} ms")
        del t, o, lse, do, q_row, k_row
    return 0


if __name__ == "__main__":
    sys.exit(main())
