"""First timings of the SM90 MXFP8 GEMM (experiment; the benchmark section comes with the kernel's
tuning): the three GEMMs of the Q up-projection and 8192^3, ours on MXFP8 operands against cuBLAS's
bf16 GEMM on the dequantized operands, mxmla.dequantize + that GEMM, and cuBLAS FP8 with per-tensor
scales (torch._scaled_mm) as the ceiling. TFLOP/s = 2 M N K / time; medians, L2 flushed.
Usage: PYTHONPATH=<build>/python python3 dev/bench/gemm_time.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402


def rnd(r, c):
    return torch.randn(r, c, device="cuda", dtype=torch.float32).to(torch.bfloat16)


def main():
    flush = flush_buffer(torch.device("cuda"))
    cases = [("fprop T16384", 16384, 24576, 1536), ("dgrad T16384", 16384, 1536, 24576),
             ("wgrad T16384", 24576, 1536, 16384), ("fprop T4096", 4096, 24576, 1536), ("8192^3", 8192, 8192, 8192)]
    print(f"{'case':14s} {'M':>6s} {'N':>6s} {'K':>6s} {'ours':>8s} {'cuBLAS bf16':>12s} {'deq+cuBLAS':>11s} "
          f"{'FP8 pt':>8s} {'ours/bf16':>9s} {'ours/(deq+)':>11s}")
    for name, M, N, K in cases:
        # the operands as the direction reads them: fprop x [M, K] . W [N, K]^T (rowwise copies)
        a, b = rnd(M, K), rnd(N, K)
        qa, qb = mxmla.quantize(a, columnwise=False), mxmla.quantize(b, columnwise=False)
        da, db = (mxmla.dequantize(q, "bfloat16") for q in (qa, qb))
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * M * N * K
        t_ours = timer(lambda: mxmla.gemm(qa, qb, out=out), 20, flush)
        t_bf16 = timer(lambda: torch.matmul(da, db.t()), 20, flush)
        t_deq = timer(lambda: torch.matmul(mxmla.dequantize(qa, "bfloat16"), mxmla.dequantize(qb, "bfloat16").t()),
                      20, flush)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        t_fp8 = timer(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), 20, flush)
        tf = lambda t: flops / t * 1e-9  # noqa: E731
        print(f"{name:14s} {M:6d} {N:6d} {K:6d} {tf(t_ours):8.0f} {tf(t_bf16):12.0f} {tf(t_deq):11.0f} "
              f"{tf(t_fp8):8.0f} {t_bf16 / t_ours:9.2f} {t_deq / t_ours:11.2f}")
        # the same call against the reference on a slice (a wrong kernel must not post a figure)
        ref = mxmla.gemm(mxmla.quantize(a[:64].cpu(), columnwise=False), mxmla.quantize(b[:64].cpu(), columnwise=False),
                         out_dtype="float32")
        got = mxmla.gemm(mxmla.quantize(a[:64], columnwise=False), mxmla.quantize(b[:64], columnwise=False),
                         out_dtype="float32").cpu()
        err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-30)
        print(f"{'':14s} check on a 64 x 64 corner vs the CPU reference: max rel error {err:.2e}"
              + ("" if err < 1e-4 else "  FAILED"))


if __name__ == "__main__":
    main()
