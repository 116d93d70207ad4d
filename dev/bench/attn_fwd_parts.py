#!/usr/bin/env python3
"""Where one MXFP8 attention forward call's GPU time goes: runs mxmla.attention (DeepSeek-V3 dims:
b 1, h 128, 192 / 128, causal, bshd, MXFP8 Q, K, V from quantize_attention) under torch.profiler,
L2 flushed before each call, and prints per s the median GPU time of each kernel of the call (the
conversion pass `attn_stage`, the memset of the tile counter, the attention kernel), their sum, the
call's CUDA-event time (bench/timing.py), and the conversion's rate in bytes moved (1 read + 2
written per value) against a device-to-device copy of the same bytes timed the same way.
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_fwd_parts.py [S ...] [--fused]"""
from __future__ import annotations

import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402


def kernel_times(fn, iters, flush):
    """{kernel name: [GPU ms of each call]} over `iters` calls, L2 flushed before each."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    per = defaultdict(list)  # name, or "name #k" for its k-th launch in a call (k > 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            flush.fill_(i & 0xFF)
            torch.cuda._sleep(2_000_000)
            fn()
        torch.cuda.synchronize()
    seen = defaultdict(int)  # launches of each kernel since the call began (a spin kernel starts each)
    for ev in sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start):
        name = ev.name
        if "fill" in name or "elementwise_kernel" in name:
            continue
        if "spin_kernel" in name or "sleep" in name.lower():
            seen.clear()
            continue
        seen[name] += 1
        key = name if seen[name] == 1 else f"{name} #{seen[name]}"
        per[key].append(ev.device_time / 1000.0 if hasattr(ev, "device_time") else ev.cuda_time / 1000.0)
    return per


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sizes = [int(a) for a in args] or [2048, 4096, 8192]
    if "--fused" in sys.argv:
        os.environ["MXMLA_ATTN_FWD"] = "fused"
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    scale = mxmla.yarn_softmax_scale()
    print(f"{'s':>6} {'kernel':60s} {'ms':>8}")
    for S in sizes:
        torch.manual_seed(0)
        q, k = (torch.randn(1, S, 128, 192, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, S, 128, 128, device=dev, dtype=torch.bfloat16)
        q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
        del q, k, v
        fn = lambda: mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale)  # noqa: E731
        per = kernel_times(fn, 20, flush)
        total = 0.0
        stage = 0.0
        for name, ts in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
            m = statistics.median(ts)
            total += m * len(ts) / 20
            if "attn_stage" in name:
                stage += m * len(ts) / 20
            print(f"{S:6d} {name[:60]:60s} {m:8.4f}  x{len(ts) / 20:g}")
        call = timer(fn, 20, flush)
        values = S * 128 * (192 + 192 + 128)
        nbytes = 3 * values
        buf = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(buf)
        copy = timer(lambda: dst.copy_(buf), 20, flush)
        print(f"{S:6d} {'sum of kernels / call (events)':60s} {total:8.4f} / {call:.4f}")
        if stage > 0:
            print(f"{S:6d} conversion: {values / 1e6:.0f} M values, {nbytes / stage / 1e9:.0f} GB/s; "
                  f"copy of the same bytes {copy:.4f} ms, {nbytes / copy / 1e9:.0f} GB/s; conversion / copy "
                  f"{stage / copy:.2f}")
        del q8, k8, v8, buf, dst
    return 0


if __name__ == "__main__":
    sys.exit(main())
