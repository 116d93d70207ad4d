"""One MLA block's training step (forward + backward) at DeepSeek-V3 dims, the recipes of
mxmla.nn.MLA, same weights, same run: "bf16" (torch's GEMMs = cuBLAS, torch SDPA, RoPE in torch),
"mxfp8" (mxmla's MXFP8 GEMMs, fused Q up-projection, MXFP8 attention forward and backward) and
"block-fp8" (DeepSeek-V3's recipe: every Linear on mxmla's block-FP8 GEMM, attention as in "bf16");
with --recipes also "mxfp8-linears" ("mxfp8" with fp8_attention=False: the Linears in MXFP8, the
attention as in "bf16").
hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope / rope / v 128 / 64 / 128, b 1, causal, bshd.
Times: medians of the calls, L2 flushed before each (bench/timing.py); a step is forward + backward
with fresh gradients. Peak memory: the most allocated during one step above what was allocated
before it (weights, input, output gradient), counted in a second process where torch allocates
from the device's default memory pool (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), the pool
mxmla's scratch comes from, so that the pool's peak (mxmla.scratch_memory) counts both; "torch
only" is torch.cuda.max_memory_allocated in the timing process, which leaves mxmla's scratch out.
--thd: T tokens packed as four sequences (thd, cu_seqlens [0, 1500, 2200, 3300, T] scaled to T):
"mxfp8" as in bshd (the fused query path, K and V quantized in place), "bf16" torch SDPA on each
sequence in turn.
Usage: PYTHONPATH=<build>/python python3 bench/mla_step.py [--thd] [--recipes bf16,mxfp8,block-fp8] [T ...]
(default T 4096, all three recipes; bf16 always runs first, the baseline of the ratios)"""
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402
import mxmla.nn as mnn  # noqa: E402


def packed(T):
    """cu_seqlens of the four packed sequences (--thd)."""
    return [0] + [round(c * T / 4096) for c in (1500, 2200, 3300)] + [T]


def measure(m, x, dy, flush, cu=None):
    def step():
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x, cu_seqlens=cu).backward(dy)

    step()
    torch.cuda.synchronize()
    x.grad = None
    m.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m(x, cu_seqlens=cu).backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    t_step = timer(step, 10, flush)
    t_fwd = timer(lambda: m(x, cu_seqlens=cu), 10, flush)
    return t_step, t_fwd, peak / 2**30


def setup(T, recipe, ref=None, thd=False):
    kw = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=T, layout="thd" if thd else "bshd", seed=11)
    g = torch.Generator().manual_seed(5)
    lead = (T,) if thd else (1, T)
    x = torch.randn(*lead, 7168, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    dy = torch.randn(*lead, 7168, generator=g).to(torch.bfloat16).cuda()
    extra = dict(recipe="mxfp8", fp8_attention=False) if recipe == "mxfp8-linears" else dict(recipe=recipe)
    m = mnn.MLA(**kw, **extra).cuda()
    if ref is not None:
        m.load_state_dict(ref)
    return m, x, dy


RECIPES = ("bf16", "mxfp8", "block-fp8")  # the default run
KNOWN = RECIPES + ("mxfp8-linears",)


def pool_peaks(T, recipes, thd=False):
    """(In the child process, torch on the cudaMallocAsync backend.) Each recipe's step peak in the
    default pool above what is in use before it, in GiB."""
    out, ref = {}, None
    cu = packed(T) if thd else None
    for recipe in recipes:
        m, x, dy = setup(T, recipe, ref, thd)
        ref = ref if ref is not None else m.state_dict()
        for _ in range(2):
            x.grad = None
            m.zero_grad(set_to_none=True)
            m(x, cu_seqlens=cu).backward(dy)
        torch.cuda.synchronize()
        x.grad = None
        m.zero_grad(set_to_none=True)
        base = mxmla.scratch_memory(reset_peak=True)["in_use"]
        m(x, cu_seqlens=cu).backward(dy)
        torch.cuda.synchronize()
        out[recipe] = (mxmla.scratch_memory()["peak"] - base) / 2**30
        del m, x, dy
    return out


def main():
    if sys.argv[1:2] == ["--pool-peaks"]:
        print(json.dumps(pool_peaks(int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4:5] == ["--thd"])))
        return
    args, recipes = sys.argv[1:], list(RECIPES)
    if "--recipes" in args:
        i = args.index("--recipes")
        recipes = ["bf16"] + [r for r in args[i + 1].split(",") if r and r != "bf16"]
        bad = [r for r in recipes if r not in KNOWN]
        if bad:
            sys.exit(f"mla_step.py: --recipes: unknown {bad}; known: {', '.join(KNOWN)}")
        del args[i:i + 2]
    thd = "--thd" in args
    seqs = [int(a) for a in args if a != "--thd"] or [4096]
    flush = flush_buffer(torch.device("cuda"))
    print("MLA block, DeepSeek-V3 dims (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, 128 / 64 / 128), causal, " +
          ("thd: T tokens in four packed sequences" if thd else "b 1"))
    print(f"{'T':>6s} {'recipe':>13s} {'step ms':>9s} {'fwd ms':>8s} {'peak GiB':>9s} {'torch only':>10s}")
    for T in seqs:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
        child = subprocess.run([sys.executable, __file__, "--pool-peaks", str(T), ",".join(recipes)] +
                               (["--thd"] if thd else []), env=env, capture_output=True, text=True)
        if child.returncode != 0:
            print(f"the pool peak child failed: {child.stderr[-2000:]}")
            peaks = {r: float("nan") for r in recipes}
        else:
            peaks = json.loads(child.stdout.strip().splitlines()[-1])
        res, ref = {}, None
        for recipe in recipes:
            m, x, dy = setup(T, recipe, ref, thd)
            ref = ref if ref is not None else m.state_dict()
            res[recipe] = measure(m, x, dy, flush, packed(T) if thd else None)
            s, f, p = res[recipe]
            print(f"{T:6d} {recipe:>13s} {s:9.3f} {f:8.3f} {peaks[recipe]:9.2f} {p:10.2f}")
            del m, x, dy
            torch.cuda.empty_cache()
        sb, fb, _ = res["bf16"]
        for recipe in recipes[1:]:
            sm, fm, _ = res[recipe]
            print(f"{T:6d} ratios, {recipe}: step bf16/{recipe} {sb / sm:.2f}x (target >= 1.1), forward {fb / fm:.2f}x, "
                  f"peak {recipe}/bf16 {peaks[recipe] / peaks['bf16']:.2f} (target <= 0.75)")


if __name__ == "__main__":
    main()
