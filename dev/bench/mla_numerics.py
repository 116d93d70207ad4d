"""Numerics of the whole MLA block: the output and every gradient of mxmla.nn.MLA under the "bf16",
"mxfp8" and "block-fp8" recipes against the same block in float64 (same weights from one seed, same
input), as relative RMS errors per tensor; and each FP8 recipe against bf16. CPU (the references)
or CUDA (the kernels).
DeepSeek-V3's head dims (nope 128, rope 64, v 128) with a few heads; loss = Σ out·G with a fixed
random G, so every gradient is the vector-Jacobian product of one direction.
Usage: PYTHONPATH=<build>/python python3 dev/bench/mla_numerics.py [--device cpu|cuda] [--seq 128]
[--recipes mxfp8,block-fp8]"""
import argparse

import torch

import mxmla.nn as mnn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipes", default="mxfp8,block-fp8", help="the FP8 recipes to compare (comma-separated)")
    a = ap.parse_args()
    fp8 = [r for r in a.recipes.split(",") if r]
    kw = dict(hidden=a.hidden, heads=a.heads, q_lora_rank=a.hidden // 2, kv_lora_rank=a.hidden // 4, nope_dim=128,
              rope_dim=64, v_dim=128, max_seq_len=a.seq, seed=a.seed, layout="bshd", init_std=0.05)
    g = torch.Generator().manual_seed(a.seed + 1)
    x = torch.randn(a.batch, a.seq, a.hidden, generator=g).to(torch.bfloat16)  # bf16 values, exact in every dtype
    G = torch.randn(a.batch, a.seq, a.hidden, generator=g, dtype=torch.float64)
    runs = {}
    for name, extra in [("float64", dict(dtype=torch.float64)), ("bf16", {})] + [(r, dict(recipe=r)) for r in fp8]:
        m = mnn.MLA(**kw, **extra, device=a.device)
        xi = x.to(a.device, m.dtype).clone().requires_grad_()
        out = m(xi)
        (out.double() * G.to(a.device)).sum().backward()
        runs[name] = dict(out=out.detach().double().cpu(), dx=xi.grad.double().cpu(),
                          **{n: p.grad.double().cpu() for n, p in m.named_parameters()})
    rel = lambda u, v: float((u - v).norm() / (v.norm() + 1e-300))  # noqa: E731
    print(f"MLA block, hidden {a.hidden}, {a.heads} heads (192 / 128), q_lora {a.hidden // 2}, kv_lora "
          f"{a.hidden // 4}, b {a.batch}, s {a.seq}, causal; device {a.device}; relative RMS error")
    print("| tensor | bf16 vs float64 | " + " | ".join(f"{r} vs float64 | {r} vs bf16" for r in fp8) + " |")
    print("|---|---|" + "---|---|" * len(fp8))
    for k in runs["float64"]:
        f, b = runs["float64"][k], runs["bf16"][k]
        cells = [f"{rel(b, f):.4f}"] + [f"{rel(runs[r][k], f):.4f} | {rel(runs[r][k], b):.4f}" for r in fp8]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
