#!/usr/bin/env python3
"""Same-run A/B of builds of the kernels (dev/scripts/ab-trees runs this once per build and round):
times every kernel the library ships at its benchmark shape with the bench's timer (CUDA events,
L2 flushed before each call, medians) and prints one JSON line per case with a checksum of the
outputs, so that builds which must be bit-identical can be seen to be.

Cases: quantize bf16 [16384, 24576] (both directions; rowwise only), apply_rope / rope_backward
bf16 [16384, 128, 192] thd (fp32 YaRN tables, out of place), rope_backward_quantize of the same,
the fused Q up-projection at T x NH = 16384 x 128, 4096 x 128, 16384 x 16 (K 1536); with --only
attnbwd (not in the default set) the attention backward at DeepSeek-V3 dims (b 1, h 128, 192 / 128,
causal, bshd, s 4096 and 8192) on MXFP8 Q, K, V from quantize_attention and on their dequantized
bf16 tensors (its checksum covers dK and dV: dQ's fp32 sums run in scheduling order), with
attnbwddet added also deterministic=True on the MXFP8 tensors (all three gradients); with --only
linear mxmla.nn.Linear's mxfp8 forward + backward at the MLA block's shapes (T 4096); with --only mla one
MLA block's training step (recipe mxfp8, T 4096, bench/mla_step.py's); with --only mlathd the same
on four packed sequences (thd); with --only qprojbwd the backward of mxmla.nn.MLAQUpProj (weights mxfp8,
T 4096, 128 heads, K 1536: RoPE backward, quantization and the two GEMMs); with --only
attnfwd the attention forward at the same dims, s 2048 / 4096 / 8192, on the MXFP8 tensors (the
default path; at s 4096 also MXMLA_ATTN_FWD=fused) and on the dequantized bf16 tensors; with --only
attnfwdthd the same on dev/bench/attn_fwd_thd.py's eight packed sequences (16 476 tokens; MXFP8 and
bf16 inputs); with --only
gemm the MXFP8 GEMM's fprop, dgrad and wgrad of the Q up-projection at T 16384 and 4096 (N 24576, K 1536), and 8192³.
With --only qblock the fused Q up-projection on block-FP8 x and W (DeepSeek-V3 recipe) at the qproj shapes;
with --only bquant the block-FP8 quantization of bf16 [16384, 24576] (both directions, rowwise, transposed; 1 x 128
and both directions with 128 x 128);
with --only bgemm the block-FP8 GEMM at bench.py --block-gemm-only's shapes.
Usage: PYTHONPATH=<build>/python python3 dev/bench/ab_kernels.py [--iters 30] [--only quant,rope,ropeq,qproj]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import flush_buffer, timer  # noqa: E402  (bench/timing.py, the harness's timer)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import attention_inputs, packed_fwd_mxfp8, packed_sequences  # noqa: E402

import mxmla  # noqa: E402


def checksum(*ts) -> str:
    """Position-weighted sum of the output bytes: equal across builds = same outputs (almost surely)."""
    tot = 0
    for t in ts:
        b = t.contiguous().view(-1).view(torch.uint8)
        w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
        tot = (tot * 31 + int((b.to(torch.int64) * w).sum())) % (1 << 61)
    return f"{tot:016x}"


def q_bufs(q):
    return [t for t in (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv) if t is not None]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--only", default="quant,rope,ropeq,qproj")
    a = ap.parse_args()
    only = set(a.only.split(","))
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    out = []

    def case(name, fn, outputs):
        ms = timer(fn, a.iters, flush)
        out.append({"case": name, "ms": ms, "sum": checksum(*outputs())})

    torch.manual_seed(0)
    if "quant" in only:
        x = torch.randn(16384, 24576, device=dev, dtype=torch.bfloat16)
        case("quantize both", lambda: mxmla.quantize(x), lambda: q_bufs(mxmla.quantize(x)))
        case("quantize rowwise", lambda: mxmla.quantize(x, columnwise=False),
             lambda: q_bufs(mxmla.quantize(x, columnwise=False)))
        del x
    T, H, D = 16384, 128, 192
    if only & {"rope", "ropeq"}:
        x = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        c, s = mxmla.rope_tables(torch.arange(T, device=dev), yarn="deepseek_v3")
        y = torch.empty_like(x)
        if "rope" in only:
            case("apply_rope", lambda: mxmla.apply_rope(x, c, s, layout="thd", out=y),
                 lambda: [mxmla.apply_rope(x, c, s, layout="thd")])
            case("rope_backward", lambda: mxmla.rope_backward(x, c, s, layout="thd", out=y),
                 lambda: [mxmla.rope_backward(x, c, s, layout="thd")])
        if "ropeq" in only:
            case("rope_backward_quantize", lambda: mxmla.rope_backward_quantize(x, c, s, layout="thd"),
                 lambda: q_bufs(mxmla.rope_backward_quantize(x, c, s, layout="thd")))
        del x, y
    if "qproj" in only:
        K = 1536
        for T, NH in ((16384, 128), (4096, 128), (16384, 16)):
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            w = (torch.randn(NH * 192, K, device=dev) / K ** 0.5).to(torch.bfloat16)
            c, s = mxmla.rope_tables(torch.arange(T, device=dev), yarn="deepseek_v3")
            case(f"fused Q {T} x {NH}", lambda: mxmla.fused_q_uproj_rope_quant(x, w, c, s),
                 lambda: q_bufs(mxmla.fused_q_uproj_rope_quant(x, w, c, s)))
    if "qblock" in only and hasattr(mxmla, "quantize_blockwise"):  # the same with block-FP8 x and W (FP8 wgmma)
        K = 1536
        for T, NH in ((16384, 128), (4096, 128), (16384, 16)):
            xb = mxmla.quantize_blockwise(torch.randn(T, K, device=dev, dtype=torch.bfloat16))
            wb = mxmla.quantize_blockwise(torch.randn(NH * 192, K, device=dev) / K ** 0.5, block_rows=128)
            c, s = mxmla.rope_tables(torch.arange(T, device=dev), yarn="deepseek_v3")
            case(f"fused Q block-FP8 {T} x {NH}", lambda: mxmla.fused_q_uproj_rope_quant(xb, wb, c, s),
                 lambda: q_bufs(mxmla.fused_q_uproj_rope_quant(xb, wb, c, s)))
    if "bquant" in only:  # block-FP8 quantization of bf16 [16384, 24576] (bench.py --quant-only's block cases)
        x = torch.randn(16384, 24576, device=dev, dtype=torch.bfloat16)
        bt = lambda q: [q.data, q.scale_inv]  # noqa: E731
        case("block quantize both", lambda: mxmla.quantize_blockwise_both(x),
             lambda: [t for q in mxmla.quantize_blockwise_both(x) for t in bt(q)])
        case("block quantize rowwise", lambda: mxmla.quantize_blockwise(x), lambda: bt(mxmla.quantize_blockwise(x)))
        case("block quantize transposed", lambda: mxmla.quantize_blockwise(x, transpose=True),
             lambda: bt(mxmla.quantize_blockwise(x, transpose=True)))
        case("block quantize 128x128 both", lambda: mxmla.quantize_blockwise_both(x, 128),
             lambda: [t for q in mxmla.quantize_blockwise_both(x, 128) for t in bt(q)])
        del x
    if "bgemm" in only and hasattr(mxmla._mxmla_core, "gemm_blockwise"):  # the block-FP8 GEMM (bench.py --block-gemm-only's cases)
        q = mxmla.quantize_blockwise
        for name, M, N, K, b_br in (("fprop 16384", 16384, 24576, 1536, 128), ("dgrad 16384", 16384, 1536, 24576, 128),
                                    ("wgrad 16384", 24576, 1536, 16384, 1), ("fprop 4096", 4096, 24576, 1536, 128),
                                    ("dgrad 4096", 4096, 1536, 24576, 128), ("wgrad 4096", 24576, 1536, 4096, 1),
                                    ("8192^3", 8192, 8192, 8192, 128)):
            ab, bb = q(torch.randn(M, K, device=dev)), q(torch.randn(N, K, device=dev) / K ** 0.5, b_br)
            case(f"block gemm {name}", lambda: mxmla.gemm(ab, bb), lambda: [mxmla.gemm(ab, bb)])
            del ab, bb
    if "gemm" in only:  # the Q up-projection's three GEMMs at T 16384 and 4096, and 8192³ (mxmla.gemm, as
        # dev/bench/gemm_time.py runs them)
        N, K = 24576, 1536
        for T in (16384, 4096):
            x8, w8, dy8 = (mxmla.quantize(torch.randn(r, c, device=dev).to(torch.bfloat16))
                           for r, c in ((T, K), (N, K), (T, N)))
            for name, fn in ((f"gemm fprop {T}", lambda: mxmla.gemm(x8, w8)),
                             (f"gemm dgrad {T}", lambda: mxmla.gemm(dy8, w8, trans_b=False)),
                             (f"gemm wgrad {T}", lambda: mxmla.gemm(dy8, x8, trans_a=True, trans_b=False))):
                case(name, fn, lambda fn=fn: [fn()])
            del x8, w8, dy8
        a8, b8 = (mxmla.quantize(torch.randn(8192, 8192, device=dev).to(torch.bfloat16), columnwise=False)
                  for _ in range(2))
        case("gemm 8192^3", lambda: mxmla.gemm(a8, b8), lambda: [mxmla.gemm(a8, b8)])
        del a8, b8
    if "attnbwd" in only:
        scale = mxmla.yarn_softmax_scale()
        for S in (4096, 8192):
            t = attention_inputs(S, dev, backward=True, scale=scale)
            q8, k8, v8, qb, kb, vb, o, lse, do = (t[n] for n in ("q8", "k8", "v8", "qb", "kb", "vb", "o", "lse", "do"))
            del t
            for name, args, kw in ((f"attention bwd mxfp8 {S}", (q8, k8, v8), {}),
                                   (f"attention bwd bf16 {S}", (qb, kb, vb), {"layout": "bshd"})):
                def run(args=args, kw=kw):
                    return mxmla.attention_backward(do, *args, o, lse, causal=True, softmax_scale=scale, **kw)
                case(name, run, lambda run=run: run()[1:])
            if "attnbwddet" in only:  # deterministic=True: its checksum covers dQ too
                def run_det():
                    return mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale,
                                                    deterministic=True)
                case(f"attention bwd mxfp8 det {S}", run_det, run_det)
            del q8, k8, v8, qb, kb, vb, o, lse, do
    if "attnfwd" in only:
        import os
        scale = mxmla.yarn_softmax_scale()
        for S in (2048, 4096, 8192):
            t = attention_inputs(S, dev)
            q8, k8, v8, qb, kb, vb = (t[n] for n in ("q8", "k8", "v8", "qb", "kb", "vb"))
            del t
            runs = [(f"attention fwd mxfp8 {S}", (q8, k8, v8), {}, None),
                    (f"attention fwd bf16 {S}", (qb, kb, vb), {"layout": "bshd"}, None)]
            if S == 4096:
                runs.append((f"attention fwd fused {S}", (q8, k8, v8), {}, "fused"))
            for name, args, kw, path in runs:
                def run(args=args, kw=kw):
                    return mxmla.attention(*args, causal=True, softmax_scale=scale, **kw)
                if path:
                    os.environ["MXMLA_ATTN_FWD"] = path
                case(name, run, lambda run=run: [run()])
                os.environ.pop("MXMLA_ATTN_FWD", None)
            del q8, k8, v8, qb, kb, vb
    if "attnfwdthd" in only:  # the forward on dev/bench/attn_fwd_thd.py's eight packed sequences (its inputs)
        lens, _, cu, q, k, v = packed_sequences([], dev)
        (q8, _), (k8, _), (v8, _) = (packed_fwd_mxfp8(x, rw) for x, rw in ((q, True), (k, True), (v, False)))
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens), causal=True)
        for name, args in (("mxfp8", (q8, k8, v8)), ("bf16", (q, k, v))):
            def run(args=args):
                return mxmla.attention(*args, **kw)
            case(f"attention fwd thd {name}", run, lambda run=run: [run()])
        del q, k, v, q8, k8, v8
    if "linear" in only:  # mxmla.nn.Linear (recipe mxfp8) forward + backward at the MLA block's shapes, T 4096
        import mxmla.nn as mnn
        for K, N in ((512, 32768), (16384, 7168), (7168, 1536)):
            lin = mnn.Linear(K, N, recipe="mxfp8").to(dev)
            x = torch.randn(4096, K, device=dev).to(torch.bfloat16).requires_grad_()
            dy = torch.randn(4096, N, device=dev).to(torch.bfloat16)

            def run(lin=lin, x=x, dy=dy):
                x.grad, lin.weight.grad = None, None
                y = lin(x)
                y.backward(dy)
                return y, x.grad, lin.weight.grad
            case(f"linear mxfp8 {K}->{N}", run, lambda run=run: [t.detach() for t in run()])
            del lin, x, dy
    if "qprojbwd" in only:  # mxmla.nn.MLAQUpProj's backward (weights mxfp8, sbhd), T 4096, 128 heads, K 1536
        import mxmla.nn as mnn
        qp = mnn.MLAQUpProj(1536, 128, weights="mxfp8", layout="sbhd", max_seq_len=4096).to(dev)
        x = torch.randn(4096, 1, 1536, device=dev).to(torch.bfloat16).requires_grad_()
        q8, anchor = qp(x)
        dq = torch.randn(anchor.shape, device=dev).to(torch.bfloat16)

        def qbwd():
            return torch.autograd.grad(anchor, [x, qp.weight], dq, retain_graph=True)
        case("qproj backward mxfp8 4096", qbwd, lambda: list(qbwd()))
        del qp, x, q8, anchor, dq
    if "mla" in only:  # one MLA block's training step (bench/mla_step.py's, recipe mxfp8), T 4096
        import mxmla.nn as mnn
        T = 4096
        m = mnn.MLA(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128,
                    max_seq_len=T, layout="bshd", seed=11, recipe="mxfp8").to(dev)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(1, T, 7168, generator=g).to(torch.bfloat16).to(dev).requires_grad_()
        dy = torch.randn(1, T, 7168, generator=g).to(torch.bfloat16).to(dev)

        def step():
            x.grad = None
            m.zero_grad(set_to_none=True)
            y = m(x)
            y.backward(dy)
            return y

        # (the checksum: y and the output projection's weight gradient; dQ's fp32 sums, and so x.grad, run in
        # scheduling order)
        case("mla step mxfp8 4096", step, lambda: [step().detach(), m.wo.weight.grad])
        del m, x, dy
    if "mlathd" in only:  # the same block on packed sequences (thd, bench/mla_step.py --thd's four), T 4096
        import mxmla.nn as mnn
        T, cu = 4096, [0, 1500, 2200, 3300, 4096]
        m = mnn.MLA(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128,
                    max_seq_len=T, layout="thd", seed=11, recipe="mxfp8").to(dev)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(T, 7168, generator=g).to(torch.bfloat16).to(dev).requires_grad_()
        dy = torch.randn(T, 7168, generator=g).to(torch.bfloat16).to(dev)

        def step_thd():
            x.grad = None
            m.zero_grad(set_to_none=True)
            y = m(x, cu_seqlens=cu)
            y.backward(dy)
            return y

        case("mla step mxfp8 thd 4096", step_thd, lambda: [step_thd().detach(), m.wo.weight.grad])
        del m, x, dy
    for r in out:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
