#!/usr/bin/env python3
"""Where one attention backward call's GPU time goes: runs mxmla.attention_backward (DeepSeek-V3
dims: b 1, h 128, 192 / 128, causal, bshd, MXFP8 Q, K, V from quantize_attention, and the same on
their dequantized bf16 tensors) under torch.profiler, L2 flushed before each call, and prints per s
the median GPU time of each kernel of the call (the preprocess's D and conversion launches, the
main kernel per group of KV heads, dQ's rounding), their sum and the call's CUDA-event time.
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_bwd_parts.py [S ...]   (default 4096)"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import flush_buffer, timer  # noqa: E402
from attn_fwd_parts import kernel_times  # noqa: E402

import mxmla  # noqa: E402


def main() -> int:
    sizes = [int(a) for a in sys.argv[1:]] or [4096]
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    scale = mxmla.yarn_softmax_scale()
    for S in sizes:
        torch.manual_seed(0)
        q, k = (torch.randn(1, S, 128, 192, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, S, 128, 128, device=dev, dtype=torch.bfloat16)
        q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
        o, lse = mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale, return_lse=True)
        do = torch.randn_like(o)
        qb, kb, vb = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape) for t in (q8, k8, v8))
        del q, k, v
        for name, args, kw in (("mxfp8", (q8, k8, v8), {}), ("bf16", (qb, kb, vb), {"layout": "bshd"})):
            fn = lambda: mxmla.attention_backward(do, *args, o, lse, causal=True, softmax_scale=scale, **kw)  # noqa: E731
            per = kernel_times(fn, 10, flush)
            total = 0.0
            for kname, ts in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
                m = statistics.median(ts) * len(ts) / 10
                total += m
                base = kname.replace("(anonymous namespace)::", "").split("(")[0].replace("void ", "")
                short = base.split("<")[0].split("::")[-1]
                tag = kname.rsplit(" #", 1)[1] if " #" in kname else "1"
                print(f"{S:6d} {name:6s} {short[:40] + ' #' + tag:46s} {statistics.median(ts):8.4f} x{len(ts) / 10:g}")
            print(f"{S:6d} {name:6s} sum of kernels {total:.4f} ms; call (events) {timer(fn, 10, flush):.4f} ms")
        del q8, k8, v8, qb, kb, vb, o, lse, do
    return 0


if __name__ == "__main__":
    sys.exit(main())
