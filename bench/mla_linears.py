"""The five Linears of one DeepSeek-V3 MLA block (hidden 7168, 128 heads, q_lora 1536, kv_lora 512,
heads 128 + 64 / 128) at T tokens, each GEMM of the "block-fp8" recipe (mxmla.gemm on block-FP8
operands: fprop x·Wᵀ, dgrad dY·W, wgrad dYᵀ·x into fp32) against cuBLAS's bf16 GEMM on the same
shapes (torch.matmul, bf16 out), and the recipe's quantization passes (x and dY in both directions,
quantize_blockwise_both) beside them. Operands pre-quantized; L2 flushed before each call; medians.
Usage: PYTHONPATH=<build>/python python3 bench/mla_linears.py [T]   (default 4096)"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402

LINEARS = [("wq_a", 7168, 1536), ("wq_b", 1536, 128 * 192), ("wkv_a", 7168, 512 + 64), ("wkv_b", 512, 128 * 256),
           ("wo", 128 * 128, 7168)]


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    q, both = mxmla.quantize_blockwise, mxmla.quantize_blockwise_both
    print(f"MLA Linears, T {T}: block-FP8 GEMMs (mxmla) against cuBLAS bf16, ms (medians, L2 flushed)")
    print(f"{'linear':6s} {'gemm':5s} {'M x N x K':>22s} {'mxmla':>8s} {'cuBLAS':>8s} {'speed-up':>8s}")
    tot = {"mxmla": 0.0, "cublas": 0.0, "quant": 0.0}
    for name, K, N in LINEARS:
        g = torch.Generator(device=dev).manual_seed(K + N)
        x = torch.randn(T, K, device=dev, generator=g).to(torch.bfloat16)
        dy = torch.randn(T, N, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(N, K, device=dev, generator=g) / K ** 0.5
        w16 = w.to(torch.bfloat16)
        (xq, xt), (dyq, dyt) = both(x), both(dy)
        wq, wt = q(w, 128), q(w, 128, transpose=True)
        cases = [("fprop", (T, N, K), lambda: mxmla.gemm(xq, wq), lambda: torch.matmul(x, w16.t())),
                 ("dgrad", (T, K, N), lambda: mxmla.gemm(dyq, wt), lambda: torch.matmul(dy, w16)),
                 ("wgrad", (N, K, T), lambda: mxmla.gemm(dyt, xt, out_dtype="float32"),
                  lambda: torch.matmul(dy.t(), x))]
        for gname, (m, n, k), ours, peer in cases:
            t_m, t_c = timer(ours, 20, flush), timer(peer, 20, flush)
            tot["mxmla"] += t_m
            tot["cublas"] += t_c
            print(f"{name:6s} {gname:5s} {f'{m} x {n} x {k}':>22s} {t_m:8.4f} {t_c:8.4f} {t_c / t_m:7.2f}x")
        t_q = timer(lambda: both(x), 20, flush) + timer(lambda: both(dy), 20, flush)
        tot["quant"] += t_q
        print(f"{name:6s} quant {'x and dY, both ways':>22s} {t_q:8.4f}")
        del x, dy, w, w16, xq, xt, dyq, dyt, wq, wt
    print(f"total: block-FP8 GEMMs {tot['mxmla']:.3f} ms + quantization {tot['quant']:.3f} ms = "
          f"{tot['mxmla'] + tot['quant']:.3f} ms; cuBLAS bf16 GEMMs {tot['cublas']:.3f} ms; "
          f"GEMMs alone {tot['cublas'] / tot['mxmla']:.2f}x, with the quantization "
          f"{tot['cublas'] / (tot['mxmla'] + tot['quant']):.2f}x")


if __name__ == "__main__":
    main()
