"""Timings of the SM90 MXFP8 GEMM: the Q up-projection's three GEMMs (T 16384 and 4096, N 24576,
K 1536) as a Linear runs them, and 8192^3. Ours reads the copies each direction needs (fprop: x, W
rowwise; dgrad: dy rowwise, W columnwise; wgrad: dy, x columnwise -- a columnwise copy as stored:
design C's transposing pass makes its bf16 copy, design D reads wgrad's dy codes directly). Peers in the same run: cuBLAS's bf16 GEMM on the dequantized
operands in the same orientation, mxmla.dequantize of those copies + that GEMM (what a user runs
today), and cuBLAS FP8 with per-tensor scales (torch._scaled_mm on an [M, K] x [K, N] problem of the
same size) as the ceiling. TFLOP/s = 2 M N K / time; medians of 20, L2 flushed (bench/timing.py).
Each case also checks a corner of ours against the CPU reference (a wrong kernel posts no figure).
Usage: PYTHONPATH=<build>/python python3 dev/bench/gemm_time.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402


def rnd(r, c):
    return torch.randn(r, c, device="cuda", dtype=torch.float32).to(torch.bfloat16)


def deq(t, columnwise):
    return mxmla.dequantize(t, "bfloat16", columnwise=columnwise)


def main():
    flush = flush_buffer(torch.device("cuda"))
    cases = [("fprop", 16384, 24576, 1536), ("dgrad", 16384, 24576, 1536), ("wgrad", 16384, 24576, 1536),
             ("fprop", 4096, 24576, 1536), ("dgrad", 4096, 24576, 1536), ("wgrad", 4096, 24576, 1536),
             ("fprop", 8192, 8192, 8192)]
    print(f"{'case':14s} {'M':>6s} {'N':>6s} {'K':>6s} {'ours':>6s} {'cuBLAS bf16':>11s} {'deq+cuBLAS':>10s} "
          f"{'FP8 pt':>7s} {'ours/bf16':>9s} {'ours/(deq+)':>11s}")
    for direction, T, N, K in cases:
        x, w, dy = rnd(T, K), rnd(N, K), rnd(T, N)
        x8, w8, dy8 = (mxmla.quantize(t) for t in (x, w, dy))
        if direction == "fprop":    # y [T, N] = x . W^T
            M, Nn, Kk, call = T, N, K, lambda: mxmla.gemm(x8, w8)
            xd, wd = deq(x8, False), deq(w8, False)
            bf16, pipe = (lambda: xd @ wd.t()), (lambda: deq(x8, False) @ deq(w8, False).t())
        elif direction == "dgrad":  # dx [T, K] = dy . W
            M, Nn, Kk, call = T, K, N, lambda: mxmla.gemm(dy8, w8, trans_b=False)
            dyd, wd = deq(dy8, False), deq(w8, True)
            bf16, pipe = (lambda: dyd @ wd), (lambda: deq(dy8, False) @ deq(w8, True))
        else:                       # dW [N, K] = dy^T . x
            M, Nn, Kk, call = N, K, T, lambda: mxmla.gemm(dy8, x8, trans_a=True, trans_b=False)
            dyd, xd = deq(dy8, True), deq(x8, True)
            bf16, pipe = (lambda: dyd.t() @ xd), (lambda: deq(dy8, True).t() @ deq(x8, True))
        flops = 2.0 * M * Nn * Kk
        t_ours, t_bf16, t_deq = timer(call, 20, flush), timer(bf16, 20, flush), timer(pipe, 20, flush)
        a8 = torch.randn(M, Kk, device="cuda").to(torch.float8_e4m3fn)
        b8 = torch.randn(Nn, Kk, device="cuda").to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        t_fp8 = timer(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), 20, flush)
        tf = lambda t: flops / t * 1e-9  # noqa: E731
        name = f"{direction} T{T}" if direction != "fprop" or K != 8192 else "8192^3"
        print(f"{name:14s} {M:6d} {Nn:6d} {Kk:6d} {tf(t_ours):6.0f} {tf(t_bf16):11.0f} {tf(t_deq):10.0f} "
              f"{tf(t_fp8):7.0f} {t_bf16 / t_ours:9.2f} {t_deq / t_ours:11.2f}   "
              f"({t_ours:.3f} / {t_bf16:.3f} / {t_deq:.3f} / {t_fp8:.3f} ms)")
        del x8, w8, dy8, a8, b8
        # a corner against the CPU reference: fprop of the first 64 rows
        ref = mxmla.gemm(mxmla.quantize(x[:64].cpu()), mxmla.quantize(w[:64].cpu()), out_dtype="float32")
        got = mxmla.gemm(mxmla.quantize(x[:64]), mxmla.quantize(w[:64]), out_dtype="float32").cpu()
        err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-30)
        if err > 2.0 ** -10:
            print(f"{'':14s} FAILED: a 64 x 64 corner is {err:.2e} (relative to its max) off the CPU reference")


if __name__ == "__main__":
    main()
