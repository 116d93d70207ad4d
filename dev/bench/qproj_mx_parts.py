#!/usr/bin/env python3
"""Where the fused Q up-projection's time goes with an MXFP8 weight (fused_q_uproj_rope_quant(x bf16,
quantize(w, columnwise=False), ...): x quantized rowwise + columnwise inside, the scale gathers and
their check, the bf16 copies of x and W, the fused kernel, its exact fallback's launch that the
check turns away): each kernel of one call under torch.profiler, L2 flushed, medians, per shape
(K 1536, heads of 128 + 64: T x NH = 16384 x 128, 4096 x 128, 16384 x 16), with cuBLAS's bf16
GEMM kernel and the bf16-weight fused op's kernel timed the same way. Last line per shape: the
kernels / cuBLAS, the floor of this design (its fused kernel + x's quantization, which the op must
return) / cuBLAS, and the bf16-weight fused kernel / cuBLAS.
Usage: PYTHONPATH=<build>/python python3 dev/bench/qproj_mx_parts.py"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import flush_buffer  # noqa: E402
from parts import kernel_times, print_kernels  # noqa: E402

import mxmla  # noqa: E402


def longest(per) -> float:
    """The median time of a call's longest kernel (the GEMM, the fused kernel, the quantize kernel)."""
    return max(statistics.median(v) for v in per.values())


def main() -> int:
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    iters, K = 20, 1536
    for T, NH in ((16384, 128), (4096, 128), (16384, 16)):
        torch.manual_seed(0)
        N = NH * 192
        x = torch.randn(T, K, device=dev).to(torch.bfloat16)
        w = (torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
        c, s = mxmla.rope_tables(torch.arange(T, device=dev), yarn="deepseek_v3")
        w8 = mxmla.quantize(w, columnwise=False)
        label = f"{T}x{NH}"
        per = kernel_times(lambda: mxmla.fused_q_uproj_rope_quant(x, w8, c, s), iters, flush)
        total = print_kernels(label, per, iters)
        gemm = longest(kernel_times(lambda: torch.matmul(x, w.t()), iters, flush))
        fk = longest(kernel_times(lambda: mxmla.fused_q_uproj_rope_quant(x, w, c, s), iters, flush))
        quant = longest(kernel_times(lambda: mxmla.quantize(x), iters, flush))
        print(f"{label} sum of kernels {total:.4f} ms; cuBLAS bf16 GEMM kernel {gemm:.4f}; bf16-W fused kernel {fk:.4f}; "
              f"x's quantize alone {quant:.4f}")
        own = longest(per)  # this call's fused kernel
        print(f"{label} MXFP8-W kernels / cuBLAS {total / gemm:.3f}; floor (this call's fused kernel + x's quantize) / "
              f"cuBLAS {(own + quant) / gemm:.3f}; bf16-W fused kernel / cuBLAS {fk / gemm:.3f}")
        del x, w, w8
    return 0


if __name__ == "__main__":
    sys.exit(main())
