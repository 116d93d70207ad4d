"""Peak memory of one attention training step (forward + backward), MXFP8 against bf16, same run.

A step as a model runs it: q, k, v are made by the step (here: leaf tensors times 1, whose backward
saves nothing, standing in for the projections that produce them), handed to attention and dropped
by the caller, so that only what attention's autograd saved keeps them; then the backward from a
given dO produces dq, dk, dv. Recipes:
  mxfp8  mxmla.nn.DotProductAttention (bf16 q, k, v quantized to MXFP8 with both copies; saved: the
         MXFP8 tensors, of v its rowwise copy, O, LSE; the backward's bf16 copies and fp32 dQ
         accumulator in stream-ordered scratch);
  bf16   torch SDPA with the cuDNN backend on the bf16 tensors (the bf16 path a user runs).
Peak = the most memory in use during the step above what was in use before it (the leaves, dO),
counted in the device's default memory pool, where torch allocates too (this script sets
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync before torch loads), so mxmla's scratch and
torch's (and cuDNN's workspace) are all counted. "saved" = the bytes autograd holds between forward
and backward (distinct storages, counted by saved-tensor hooks); "floor" = saved + dO + the three
gradients: what any backward of this recipe holds at its end with no scratch at all.
DeepSeek-V3 head dims 192 / 128, causal, bshd, b 1, H heads.
Usage: PYTHONPATH=<build>/python python3 bench/attn_step_memory.py [H] [s ...]   (default 128, 4096 8192)"""
import os
import sys

os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"  # before torch initialises CUDA

import torch  # noqa: E402

import mxmla  # noqa: E402
import mxmla.nn as mnn  # noqa: E402

MiB = 2**20


def saved_bytes_hooks():
    """saved_tensors_hooks that record the distinct storages autograd saves (data_ptr -> bytes)."""
    seen = {}

    def pack(t):
        if t.is_cuda:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def step(recipe, leaves, do, scale):
    """One training step's attention; returns (peak above the state before it, saved bytes)."""
    q0, k0, v0 = leaves
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = mxmla.scratch_memory(reset_peak=True)["in_use"]
    hooks, seen = saved_bytes_hooks()
    with hooks:
        q, k, v = q0 * 1, k0 * 1, v0 * 1  # stand-ins for the projections' outputs (nothing saved)
        if recipe == "mxfp8":
            o = mnn.DotProductAttention(softmax_scale=scale, causal=True, layout="bshd")(q, k, v)
        else:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale).transpose(1, 2)
        del q, k, v
    saved = sum(seen.values())
    o.backward(do)
    del o
    torch.cuda.synchronize()
    return mxmla.scratch_memory()["peak"] - base, saved


def main():
    if not torch.cuda.is_available():
        sys.exit("bench/attn_step_memory.py: needs a CUDA GPU (it measures the device memory pool)")
    H = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    seqs = [int(x) for x in sys.argv[2:]] or [4096, 8192]
    scale = mxmla.yarn_softmax_scale()
    print(f"attention training step, DeepSeek-V3 head dims 192 / 128, causal, bshd, b 1, H {H}; MiB in the default pool")
    print(f"{'s':>6s} {'recipe':>7s} {'peak':>8s} {'saved':>8s} {'floor':>8s}")
    for s in seqs:
        g = torch.Generator(device="cuda").manual_seed(s)
        leaves = [torch.randn(1, s, H, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                  for d in (192, 192, 128)]
        do = torch.randn(1, s, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        grads = sum(t.numel() * 2 for t in leaves)
        res = {}
        for recipe in ("bf16", "mxfp8"):
            for _ in range(2):  # warm-up: cuDNN plans, lazy inits
                step(recipe, leaves, do, scale)
            peak, saved = step(recipe, leaves, do, scale)
            floor = saved + do.numel() * 2 + grads
            res[recipe] = (peak, saved, floor)
            print(f"{s:6d} {recipe:>7s} {peak / MiB:8.0f} {saved / MiB:8.0f} {floor / MiB:8.0f}")
        (pb, sb, _), (pm, sm, fm) = res["bf16"], res["mxfp8"]
        print(f"{s:6d} ratios mxfp8 / bf16: peak {pm / pb:.3f} (target <= 0.75), saved {sm / sb:.3f}, "
              f"mxfp8 floor / bf16 peak {fm / pb:.3f}")
        del leaves, do


if __name__ == "__main__":
    main()
