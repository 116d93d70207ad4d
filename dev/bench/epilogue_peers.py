#!/usr/bin/env python3
"""Is a fused GEMM epilogue free for cuBLAS itself on this GPU? (context for issue 4's "fusion is free")

At the three Q up-projection shapes (K 1536, N = NH * 192, bf16), single calls timed like bench.py
(L2 flushed before each, medians): the plain GEMM (torch.matmul, cuBLAS), the GEMM with a bias
epilogue (torch.addmm with a 1-D bias: cuBLASLt's BIAS epilogue) and with a bias + GELU epilogue
(torch._addmm_activation: cuBLASLt's GELU_BIAS epilogue). Same output bytes in all three; the
epilogues add per-element arithmetic only. Prints each time and its ratio to the plain GEMM.
Needs a CUDA GPU; mxmla is not used.
"""
from __future__ import annotations

import argparse
import sys

import torch

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import flush_buffer, timer  # noqa: E402  (bench/timing.py, the harness's timer)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kernels", action="store_true", help="also print the kernel each case runs (torch.profiler)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("epilogue_peers: no CUDA GPU here; nothing to time")
        return 0
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    K = 1536
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call, ratio to the plain GEMM")
    for r in range(a.rounds):
        for T, NH in ((16384, 128), (4096, 128), (16384, 16)):
            N = NH * 192
            flop = 2.0 * T * N * K
            torch.manual_seed(0)
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            w = (torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
            bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
            cases = (("GEMM (torch.matmul)", lambda: torch.matmul(x, w.t())),
                     ("GEMM + bias (addmm)", lambda: torch.addmm(bias, x, w.t())),
                     ("GEMM + bias + GELU (_addmm_activation)", lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True)))
            if a.kernels and r == 0:
                for name, fn in cases:
                    fn()
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
                    print(f"kernels  {T:>5} x {NH:<3}  {name:<40} {'; '.join(n[:110] for n in names)}")
            t0 = None
            for name, fn in cases:
                t = timer(fn, a.iters, flush)
                t0 = t0 or t
                print(f"round {r + 1}  {T:>5} x {NH:<3}  {name:<40} {t:8.4f} ms  {flop / t / 1e9:5.0f} TFLOP/s  {t / t0:.3f}")
            del x, w, bias
    return 0


if __name__ == "__main__":
    sys.exit(main())
