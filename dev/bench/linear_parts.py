#!/usr/bin/env python3
"""Where an MXFP8 Linear's time goes: each kernel of mxmla.nn.Linear(recipe="mxfp8")'s forward +
backward under torch.profiler (L2 flushed before each step, medians of 10), at the MLA block's Linear
shapes with T 4096 (or the given K:N pairs), with the sum of the kernels and a device copy that moves
as many bytes as one pass over x and dy with two bf16 copies (read 2, write 4 a value).
Usage: PYTHONPATH=<build>/python python3 dev/bench/linear_parts.py [K:N ...]   (default 512:32768
16384:7168 7168:1536)"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import flush_buffer, timer  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import kernel_times, print_kernels  # noqa: E402

import mxmla.nn as mnn  # noqa: E402


def main() -> int:
    pairs = [tuple(int(v) for v in a.split(":")) for a in sys.argv[1:]] or [(512, 32768), (16384, 7168), (7168, 1536)]
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    T, iters = 4096, 10
    for K, N in pairs:
        lin = mnn.Linear(K, N, recipe="mxfp8").to(dev)
        x = torch.randn(T, K, device=dev).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(T, N, device=dev).to(torch.bfloat16)

        def step():
            x.grad, lin.weight.grad = None, None
            lin(x).backward(dy)

        total = print_kernels(f"Linear {K} -> {N}, T {T}: forward + backward", kernel_times(step, iters, flush), iters)
        step_ms = timer(step, 20, flush)
        src = torch.empty(T * (K + N) * 3, dtype=torch.uint8, device=dev)  # 6 bytes moved a value, as read 2
        dst = torch.empty_like(src)                                          # + write 4
        copy_ms = timer(lambda: dst.copy_(src), 20, flush)
        print(f"sum of kernels {total:.4f} ms; step (events) {step_ms:.4f} ms; a copy moving 6 bytes a value of "
              f"x and dy {copy_ms:.4f} ms")
        del lin, x, dy, src, dst
    return 0


if __name__ == "__main__":
    sys.exit(main())
