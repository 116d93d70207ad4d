"""Where the MXFP8 GEMM's design D (A's codes converted in the GEMM's registers) beats design C (a
dequantizing pass over A, then the bf16 GEMM), by contraction length and output width: forced C
against forced D (MXMLA_GEMM_DESIGN, same run, alternating) on A rowwise [M, K] (a dgrad's dy) and
A columnwise [K, M] (a wgrad's dy), B columnwise [K, N] as a Linear's GEMMs read it. M 24576 or
16384; N 1536 (the Q up-projection's) with K from 512 to 16384, then K 8192 with N from 3072 to
9216. The numbers behind heuristics::kGemmDesignDMinK and kGemmDesignDMaxN. Medians of 20, L2
flushed (bench/timing.py).
Usage: PYTHONPATH=<build>/python python3 dev/bench/gemm_d_crossover.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402


def main():
    flush = flush_buffer(torch.device("cuda"))
    print(f"{'A':10s} {'M':>6s} {'N':>6s} {'K':>6s} {'C ms':>8s} {'D ms':>8s} {'D / C':>6s}")
    cases = [(kind, M, 1536, K) for kind, M in (("columnwise", 24576), ("rowwise", 16384))
             for K in (512, 1024, 1536, 2048, 4096, 8192, 16384)]
    cases += [(kind, M, N, 8192) for kind, M in (("columnwise", 24576), ("rowwise", 16384))
              for N in (3072, 4608, 6144, 9216)]
    for kind, M, N, K in cases:
        if kind == "columnwise":  # dW [M, N] = dy^T x: dy [K, M], x [K, N], both columnwise
            a = mxmla.quantize(torch.randn(K, M, device="cuda").to(torch.bfloat16))
            b = mxmla.quantize(torch.randn(K, N, device="cuda").to(torch.bfloat16))
            call = lambda: mxmla.gemm(a, b, trans_a=True, trans_b=False)  # noqa: E731
        else:  # dx [M, N] = dy W: dy [M, K] rowwise, W [K, N] columnwise
            a = mxmla.quantize(torch.randn(M, K, device="cuda").to(torch.bfloat16))
            b = mxmla.quantize(torch.randn(K, N, device="cuda").to(torch.bfloat16))
            call = lambda: mxmla.gemm(a, b, trans_b=False)  # noqa: E731
        t = {}
        for d in ("C", "D", "C", "D"):
            os.environ["MXMLA_GEMM_DESIGN"] = d
            t.setdefault(d, []).append(timer(call, 20, flush))
        os.environ.pop("MXMLA_GEMM_DESIGN")
        c, dd = min(t["C"]), min(t["D"])
        print(f"{kind:10s} {M:6d} {N:6d} {K:6d} {c:8.4f} {dd:8.4f} {dd / c:6.3f}", flush=True)
        del a, b


if __name__ == "__main__":
    main()
