#!/usr/bin/env python3
"""The attention forward on packed sequences (thd): DeepSeek-V3 dims (h 128, d_qk 192, d_v 128),
causal, sequences of mixed lengths packed into one [t, h, d] tensor with cu_seqlens (the same for
queries and keys), bf16 N(0, 1) inputs quantized token-major by mxmla.quantize on [t, h·d] (Q, K
rowwise, V columnwise along the packed tokens, E4M3, compact scales), codes viewed [t, h, d]. Timed in one run (bench/timing.py: CUDA events, L2 flushed before
each call, medians):
  ours         mxmla.attention on the MXFP8 tensors (its default path)
  ours-fused   the same with MXMLA_ATTN_FWD=fused (dequantization inside the kernel, per tile)
  ours-bf16    the same op on the bf16 tensors
  FA4          FlashAttention-4's SM90 varlen forward (flash_attn.cute.flash_attn_varlen_func) on the
               dequantized bf16 tensors, when installed (dev/scripts/fa4-install)
  deq+FA4      mxmla.dequantize of Q, K, V, then FA4
Before timing: ours and ours-fused must give the same bits, and ours must lie within
2^-8 (max|v| + |FA4|) of FA4 (bf16 P on both). TFLOP/s = sum over sequences of
2·h·(s²/2)·(d_qk + d_v) / time.
--parts: also each kernel of one call of ours and ours-bf16 under torch.profiler (L2 flushed, medians of
10; dev/bench/parts.py), with a device copy of the bytes the conversion pass moves (K and V: 1 read and
2 written per value) timed the same way.
--swizzle: the scales in the GEMM-swizzled layout instead of compact.
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_fwd_thd.py [--parts] [--swizzle] [LEN ...]
(default lengths: 4096 2048 1024 3000 512 4096 1500 200, 16 476 tokens)"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import flush_buffer, timer  # noqa: E402
from parts import conversion_copy_time, kernel_times, packed_fwd_mxfp8, packed_sequences, print_kernels  # noqa: E402
from attn_fwd import _with_env as with_env  # noqa: E402

import mxmla  # noqa: E402

H, D_QK, D_V = 128, 192, 128


def main() -> int:
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    lens, t, cu, q, k, v = packed_sequences(sys.argv[1:], dev, H, D_QK, D_V)
    mx = max(lens)
    swz = "--swizzle" in sys.argv
    (q8, q_deq), (k8, k_deq), (v8, v_deq) = (packed_fwd_mxfp8(x, rw, swz) for x, rw in ((q, True), (k, True), (v, False)))
    qd, kd, vd = q_deq(), k_deq(), v_deq()
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mx, max_seqlen_kv=mx, causal=True)
    ours = lambda: mxmla.attention(q8, k8, v8, **kw)  # noqa: E731
    fused = lambda: with_env("MXMLA_ATTN_FWD", "fused", ours)  # noqa: E731
    ours_bf16 = lambda: mxmla.attention(qd, kd, vd, **kw)  # noqa: E731
    fns = {"ours": ours, "ours-fused": fused, "ours-bf16": ours_bf16}
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
    except Exception as e:  # not installed or broken: not measured
        print(f"FA4: not measured ({type(e).__name__}: {str(e)[:200]})")
        fa4 = None
    if fa4 is not None:
        def fa4_call(a, b, c):
            r = fa4(a, b, c, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True)
            return r[0] if isinstance(r, (tuple, list)) else r

        fns["FA4"] = lambda: fa4_call(qd, kd, vd)
        fns["deq+FA4"] = lambda: fa4_call(q_deq(), k_deq(), v_deq())
    a, b = ours(), fused()
    same = torch.equal(a.view(torch.int16), b.view(torch.int16))
    print(f"check: ours and ours-fused bit for bit: {'yes' if same else 'NO'}")
    ok = same
    if fa4 is not None:
        try:
            ref = fns["FA4"]().float()
        except Exception as e:  # an FA4 that cannot run this case: not measured (the rest still is)
            print(f"FA4: not measured ({type(e).__name__}: {str(e)[:200]})")
            fa4 = None
            del fns["FA4"], fns["deq+FA4"]
    if fa4 is not None:
        vmax = vd.float().abs().amax(dim=(0, 2), keepdim=True)  # max |v| of each head
        beyond = int((~((a.float() - ref).abs() <= (vmax + ref.abs()) * 2.0 ** -8)).sum().item())
        print(f"check: ours against FA4: {beyond} of {ref.numel()} elements beyond 2^-8 (max|v| + |FA4|)")
        ok = ok and beyond == 0
    flop = sum(2.0 * H * (s * s / 2) * (D_QK + D_V) for s in lens)
    print(f"thd: {len(lens)} sequences {lens}, {t} tokens, h {H}, d_qk {D_QK}, d_v {D_V}, causal")
    ms = {name: timer(fn, 20, flush) for name, fn in fns.items()}
    for name, m in ms.items():
        print(f"{name:12s} {m:8.4f} ms {flop / m / 1e9:7.1f} TFLOP/s")
    for peer in ("FA4", "deq+FA4", "ours-fused"):
        if peer in ms:
            print(f"ours / {peer}: {ms[peer] / ms['ours']:.3f} (time ratio: >1 = ours faster)")
    if "--parts" in sys.argv:
        for name in ("ours", "ours-bf16"):
            total = print_kernels(f"parts {name:9s}", kernel_times(fns[name], 10, flush), 10)
            print(f"parts {name:9s} sum of kernels {total:.4f} ms")
        print(f"parts copy of the conversion's bytes (K, V: {t * H * (D_QK + D_V) / 1e6:.0f} M values) "
              f"{conversion_copy_time(t * H * (D_QK + D_V), flush, dev):.4f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
