#!/usr/bin/env python3
"""Where one MXFP8 attention forward call's GPU time goes: runs mxmla.attention (DeepSeek-V3 dims:
b 1, h 128, 192 / 128, causal, bshd, MXFP8 Q, K, V from quantize_attention) under torch.profiler,
L2 flushed before each call, and prints per s the median GPU time of each kernel of the call (the
conversion pass `attn_stage`, the memset of the tile counter, the attention kernel), their sum, the
call's CUDA-event time (bench/timing.py), and the conversion's rate in bytes moved (1 read + 2
written per value of K and V) against a device-to-device copy of the same bytes timed the same way.
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_fwd_parts.py [S ...] [--fused]"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import flush_buffer, timer  # noqa: E402
from parts import attention_inputs, conversion_copy_time, kernel_times, print_kernels  # noqa: E402

import mxmla  # noqa: E402


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sizes = [int(a) for a in args] or [2048, 4096, 8192]
    if "--fused" in sys.argv:
        os.environ["MXMLA_ATTN_FWD"] = "fused"
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    scale = mxmla.yarn_softmax_scale()
    for S in sizes:
        torch.manual_seed(0)
        t = attention_inputs(S, dev)
        q8, k8, v8 = t["q8"], t["k8"], t["v8"]
        del t
        fn = lambda: mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale)  # noqa: E731
        per = kernel_times(fn, 20, flush)
        total = print_kernels(f"{S:6d}", per, 20)
        stage = sum(statistics.median(ts) * len(ts) / 20 for name, ts in per.items() if "attn_stage" in name)
        call = timer(fn, 20, flush)
        values = S * 128 * (192 + 128)  # K and V (the kernel expands Q's codes itself)
        nbytes = 3 * values
        copy = conversion_copy_time(values, flush, dev)
        print(f"{S:6d} sum of kernels {total:.4f} ms; call (events) {call:.4f} ms")
        if stage > 0:
            print(f"{S:6d} conversion: {values / 1e6:.0f} M values, {nbytes / stage / 1e6:.0f} GB/s; "
                  f"copy of the same bytes {copy:.4f} ms, {nbytes / copy / 1e6:.0f} GB/s; conversion / copy "
                  f"{stage / copy:.2f}")
        del q8, k8, v8
    return 0


if __name__ == "__main__":
    sys.exit(main())
