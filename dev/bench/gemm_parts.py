#!/usr/bin/env python3
"""Where one MXFP8 GEMM call's GPU time goes: runs mxmla.gemm on dev/bench/gemm_time.py's cases
(fprop / dgrad / wgrad of the Q up-projection at T 16384 and 4096, 8192^3) under torch.profiler,
L2 flushed before each call, and prints per case the median GPU time of each kernel of the call
(scale gathers, dequantizing passes, the GEMM, the split reduction, the kernels the design flag
turns away), their sum, the call's CUDA-event time, cuBLAS's bf16 GEMM alone, and a device copy's
time for the bytes the conversions move (1 read + 2 written per value of both operands).
Usage: PYTHONPATH=<build>/python python3 dev/bench/gemm_parts.py [case ...]   (e.g. dgrad16384)"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import flush_buffer, timer  # noqa: E402
from parts import kernel_times, print_kernels  # noqa: E402

import mxmla  # noqa: E402


def rnd(r, c):
    return torch.randn(r, c, device="cuda", dtype=torch.float32).to(torch.bfloat16)


def main() -> int:
    want = set(sys.argv[1:])
    flush = flush_buffer(torch.device("cuda"))
    cases = [("fprop", 16384, 24576, 1536), ("dgrad", 16384, 24576, 1536), ("wgrad", 16384, 24576, 1536),
             ("fprop", 4096, 24576, 1536), ("dgrad", 4096, 24576, 1536), ("wgrad", 4096, 24576, 1536),
             ("fprop", 8192, 8192, 8192)]
    for direction, T, N, K in cases:
        name = f"{direction}{T}" if K != 8192 else "8192^3"
        if want and name not in want:
            continue
        x, w, dy = rnd(T, K), rnd(N, K), rnd(T, N)
        x8, w8, dy8 = (mxmla.quantize(t) for t in (x, w, dy))
        xd, wd = x.clone(), w.clone()
        if direction == "fprop":
            call, bf16, vals = (lambda: mxmla.gemm(x8, w8)), (lambda: xd @ wd.t()), T * K + N * K
        elif direction == "dgrad":
            dyd = dy.clone()
            call, bf16, vals = (lambda: mxmla.gemm(dy8, w8, trans_b=False)), (lambda: dyd @ wd), T * N + N * K
        else:
            dyd = dy.clone()
            call = lambda: mxmla.gemm(dy8, x8, trans_a=True, trans_b=False)  # noqa: E731
            bf16, vals = (lambda: dyd.t() @ xd), T * N + T * K
        total = print_kernels(f"{name:10s}", kernel_times(call, 20, flush), 20)
        t_call, t_bf16 = timer(call, 20, flush), timer(bf16, 20, flush)
        buf = torch.empty(3 * vals // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(buf)
        t_copy = timer(lambda: dst.copy_(buf), 20, flush)
        print(f"{name:10s} sum of kernels {total:.4f} ms; call {t_call:.4f}; cuBLAS bf16 {t_bf16:.4f}; "
              f"copy of the conversions' bytes ({vals / 1e6:.0f} M values) {t_copy:.4f}")
        del x, w, dy, x8, w8, dy8, xd, wd, buf, dst
    return 0


if __name__ == "__main__":
    sys.exit(main())
