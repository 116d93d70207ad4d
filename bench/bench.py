#!/usr/bin/env python3
"""mxmla benchmark harness: our kernels and the peers users run instead, timed in the same run.

Timing: CUDA events around each call, L2 flushed before each (a 256 MiB memset), medians of
--iters calls after warm-up. Prints a table and writes JSON (--json).

Cases (issue 2):
  quant_both   bf16 [16384, 24576] -> E4M3 rowwise + columnwise, compact scales
  quant_row    the same, rowwise only
  quant_swz    rowwise + columnwise with swizzled scales (cost vs compact)
  attn_bhsd    Q, K (d 192), V (d 128), b 2, h 16, s 4096, sbhd: phase-2 BHSD transpose+swizzle
               of all six scale tensors vs quantizing them (phase 1); fused vs two-phase
  rope         RoPE forward / backward, [16384, 128, 192] bf16; rope_backward_quantize
  qproj        fused Q up-projection (GEMM + RoPE + MXFP8, K 1536) at T x NH = 16384 x 128,
               4096 x 128, 16384 x 16
  qproj-block  the same with a block-FP8 weight (DeepSeek-V3 recipe: 128 x 128 W blocks, 1 x 128 x
               blocks, FP8 tensor cores); peers: cuBLAS bf16 GEMM, cuBLAS block-scaled FP8 GEMM
               (torch.nn.functional.scaled_mm), cuBLAS FP8 per-tensor GEMM (the ceiling)
  block-gemm   the block-FP8 GEMM (mxmla.gemm on BlockFP8Tensors) for the Q up-projection's fprop,
               dgrad and wgrad at T 16384 / 4096 (N 24576, K 1536) and 8192^3; peers: cuBLAS bf16
               GEMM, cuBLAS block-scaled FP8 GEMM (scaled_mm), cuBLAS FP8 per-tensor (the ceiling)
  attn_fwd     attention forward on MXFP8 Q, K, V (DeepSeek-V3: b 1, h 128, d 192/128, causal,
               s 2048 / 4096 / 8192), TFLOP/s = 2*b*h*(s^2/2)*(d_qk + d_v) / time; bench/attn_fwd.py
Peers: device-to-device copy (torch), torch.compile'd MXFP8 quantizers (rowwise, rowwise+columnwise),
torch.compile'd RoPE, cuBLAS bf16 GEMM (torch.matmul) alone / + mxmla RoPE + quantize / + a
torch.compile'd RoPE + quantize epilogue; attention: the same op on bf16 inputs, cuDNN SDPA (bf16),
FlashAttention-4's SM90 path (when installed), mxmla.dequantize + the faster of those two.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import attn_fwd  # bench/attn_fwd.py
import mxmla
from timing import flush_buffer, timer  # bench/timing.py (the script's folder is on sys.path)


# ----------------------------------------------------------------------------- torch peers
def _e8m0_and_mult(amax: torch.Tensor):
    """TE's float_to_e8m0(amax * fp32(1/448)) and the multiplier 2^(127-e) (e = 0 -> 1), in torch ops."""
    v = (amax.float() * (1.0 / 448.0)).view(torch.int32)
    e = v >> 23
    m = v & 0x7FFFFF
    up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    e = (e + up.to(torch.int32)).clamp(0, 255)
    mult = ((254 - e) << 23).view(torch.float32)
    mult = torch.where(e == 0, torch.ones_like(mult), mult)
    return e.to(torch.uint8), mult


def torch_quant_rowwise(x: torch.Tensor):
    M, K = x.shape
    xb = x.view(M, K // 32, 32).float()
    e, mult = _e8m0_and_mult(xb.abs().amax(-1))
    q = (xb * mult.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(M, K), e


def torch_quant_both(x: torch.Tensor):
    M, K = x.shape
    qr, er = torch_quant_rowwise(x)
    xc = x.view(M // 32, 32, K).float()
    ec, multc = _e8m0_and_mult(xc.abs().amax(1))
    qc = (xc * multc.unsqueeze(1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return qr, er, qc.view(M, K), ec


def torch_block_quant(x: torch.Tensor):
    """1 x 128 block FP8 (DeepSeek-V3's activations; pow2 scales) in plain torch: (codes, scale_inv)."""
    M, K = x.shape
    xb = x.float().reshape(M, K // 128, 128)
    amax = xb.abs().amax(-1, keepdim=True)
    s = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(amax), 448.0 / amax)
    s = (s.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000: a power of two
    return (xb * s).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(M, K), (1.0 / s).squeeze(-1)


def torch_block_quant_both(x: torch.Tensor):
    return torch_block_quant(x), torch_block_quant(x.t())


def bench_block_quant(x, iters, flush, add, copy_bw, compile_peer: bool):
    """quantize_blockwise on x [M, K] bf16 in 1 x 128 blocks: both directions in one pass (a block-FP8
    Linear's x and dY), the transposed one alone and the rowwise one alone, as a share of the copy
    bandwidth; the peer: the same formula in torch, torch.compile'd (bit-identical, checked)."""
    M, K = x.shape
    b_both, b_one = 2.0 * M * K + 2.0 * M * K + 8.0 * M * K / 128, 2.0 * M * K + M * K + 4.0 * M * K / 128
    q, t = mxmla.quantize_blockwise_both(x)
    (rc, rs), (tc, ts) = torch_block_quant_both(x)
    same = all(torch.equal(a_.view(torch.uint8), b_.view(torch.uint8)) for a_, b_ in ((q.data, rc), (t.data, tc))) and \
        torch.equal(q.scale_inv, rs) and torch.equal(t.scale_inv, ts)
    del q, t, rc, rs, tc, ts
    t_both = timer(lambda: mxmla.quantize_blockwise_both(x), iters, flush)
    add("block_quant_both", "mxmla", t_both, b_both,
        f"{100 * b_both / t_both / 1e6 / copy_bw:.0f}% of copy; torch formula bit-exact: {same}")
    t_tr = timer(lambda: mxmla.quantize_blockwise(x, transpose=True), iters, flush)
    add("block_quant_transposed", "mxmla", t_tr, b_one, f"{100 * b_one / t_tr / 1e6 / copy_bw:.0f}% of copy")
    t_row = timer(lambda: mxmla.quantize_blockwise(x), iters, flush)
    add("block_quant_row", "mxmla", t_row, b_one, f"{100 * b_one / t_row / 1e6 / copy_bw:.0f}% of copy")
    if compile_peer:
        c_both, c_row = torch.compile(torch_block_quant_both), torch.compile(torch_block_quant)
        t = timer(lambda: c_both(x), iters, flush)
        add("block_quant_both", "torch.compile", t, b_both, f"mxmla {t / t_both:.2f}x faster")
        t = timer(lambda: c_row(x), iters, flush)
        add("block_quant_row", "torch.compile", t, b_one, f"mxmla {t / t_row:.2f}x faster")


def bench_attention(iters, flush, dev, add):
    """Q, K (d 192), V (d 128), b 2, h 16, s 4096, sbhd: phase 1 (compact), phase 2 (to BHSD), fused."""
    b, h, s = 2, 16, 4096
    qkv = [torch.randn(s, b, h, d, device=dev, dtype=torch.bfloat16) for d in (192, 192, 128)]
    attn_bytes = sum(2.0 * t.numel() + 2.0 * t.numel() for t in qkv)

    def phase1():
        return [mxmla.quantize_attention(t, "sbhd", bhsd_scales=False) for t in qkv]

    comp = phase1()

    def phase2():  # all six scale tensors in one launch
        return mxmla.to_bhsd(*comp)

    def phase2_separate():
        for t, qt in zip(qkv, comp):
            mxmla.attention_scales_to_bhsd(qt.rowwise_scale_inv, t.shape, "sbhd", True)
            mxmla.attention_scales_to_bhsd(qt.columnwise_scale_inv, t.shape, "sbhd", False)

    def fused():
        return [mxmla.quantize_attention(t, "sbhd", bhsd_scales=True) for t in qkv]

    t1 = timer(phase1, iters, flush)
    t2 = timer(phase2, iters, flush)
    t2s = timer(phase2_separate, iters, flush)
    tf = timer(fused, iters, flush)
    add("attn_bhsd", "phase 1: quantize Q,K,V", t1, attn_bytes)
    add("attn_bhsd", "phase 2: to_bhsd(q, k, v)", t2, 0.0, f"{100 * t2 / t1:.1f}% of phase 1")
    add("attn_bhsd", "phase 2: 6 separate calls", t2s, 0.0, f"{100 * t2s / t1:.1f}% of phase 1")
    add("attn_bhsd", "fused quantize->BHSD", tf, attn_bytes, f"{100 * tf / (t1 + t2):.0f}% of two-phase")


def torch_rope_iho(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """interleaved_in_halves_out RoPE on the trailing 64 of each 192-wide head, fp32 math (the peer)."""
    nope, pe = x[..., :128], x[..., 128:].float()
    x1, x2 = pe[..., 0::2], pe[..., 1::2]
    c, s = c[:, None, :].float(), s[:, None, :].float()
    out = torch.cat([x1 * c[..., :32] - x2 * s[..., :32], x2 * c[..., 32:] + x1 * s[..., 32:]], dim=-1)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


def torch_rope_iho_bwd(g: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The gradient of torch_rope_iho (the backward peer): dx = R^T g on the rope part."""
    nope, pe = g[..., :128], g[..., 128:].float()
    g1, g2 = pe[..., :32], pe[..., 32:]
    c, s = c[:, None, :].float(), s[:, None, :].float()
    dx1 = g1 * c[..., :32] + g2 * s[..., 32:]
    dx2 = g2 * c[..., 32:] - g1 * s[..., :32]
    return torch.cat([nope, torch.stack([dx1, dx2], dim=-1).flatten(-2).to(g.dtype)], dim=-1)


def bench_rope(iters, flush, dev, add, compile_peer: bool):
    """RoPE forward / backward on [16384, 128, 192] bf16 (thd, fp32 tables [T, 64])."""
    T, H, D = 16384, 128, 192
    x = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(T, device=dev), yarn="deepseek_v3")
    full = 2.0 * 2 * x.numel() + 2 * c.numel() * 4  # out of place: read + write every element
    rope_only = 2.0 * 2 * T * H * 64 + 2 * c.numel() * 4  # in place: the rotated part only
    y = torch.empty_like(x)
    t_copy = timer(lambda: y.copy_(x), iters, flush)
    add("rope", "d2d copy (torch)", t_copy, 4.0 * x.numel())
    copy_bw = 4.0 * x.numel() / t_copy / 1e6
    t_f = timer(lambda: mxmla.apply_rope(x, c, s, layout="thd", out=y), iters, flush)
    add("rope", "mxmla fwd (out of place)", t_f, full, f"{100 * full / t_f / 1e6 / copy_bw:.0f}% of copy")
    t_b = timer(lambda: mxmla.rope_backward(x, c, s, layout="thd", out=y), iters, flush)
    add("rope", "mxmla bwd (out of place)", t_b, full, f"{100 * full / t_b / 1e6 / copy_bw:.0f}% of copy")
    t_i = timer(lambda: mxmla.apply_rope(y, c, s, layout="thd", out=y), iters, flush)
    add("rope", "mxmla fwd (in place)", t_i, rope_only, f"{100 * rope_only / t_i / 1e6 / copy_bw:.0f}% of copy")
    if compile_peer:
        peer = torch.compile(torch_rope_iho)
        ok = torch.equal(peer(x, c, s), mxmla.apply_rope(x, c, s, layout="thd"))
        t = timer(lambda: peer(x, c, s), iters, flush)
        add("rope", "torch.compile fwd", t, full, f"mxmla {t / t_f:.2f}x faster; peer bit-equal: {ok}")
        peer_b = torch.compile(torch_rope_iho_bwd)
        ok = torch.equal(peer_b(x, c, s), mxmla.rope_backward(x, c, s, layout="thd"))
        t = timer(lambda: peer_b(x, c, s), iters, flush)
        add("rope", "torch.compile bwd", t, full, f"mxmla {t / t_b:.2f}x faster; peer bit-equal: {ok}")

    # rope_backward_quantize (rowwise + columnwise, compact scales) vs the project's own two ops
    n = x.numel()
    fused_bytes = 2.0 * n + 2.0 * n + 2.0 * n / 32 + 2 * c.numel() * 4  # read dq; codes + scales of both
    t_q = timer(lambda: mxmla.rope_backward_quantize(x, c, s, layout="thd"), iters, flush)
    add("rope_bq", "mxmla fused", t_q, fused_bytes, f"{100 * fused_bytes / t_q / 1e6 / copy_bw:.0f}% of copy")

    def separate():
        mxmla.rope_backward(x, c, s, layout="thd", out=y)
        mxmla.quantize(y.view(T, H * D))

    t_sep = timer(separate, iters, flush)
    saved = 4.0 * n  # the bf16 dx written and read back
    need = t_sep - saved / copy_bw / 1e6
    add("rope_bq", "rope_backward + quantize", t_sep, fused_bytes + saved,
        f"fused {t_sep / t_q:.2f}x faster; saved traffic alone allows {t_sep / need:.2f}x "
        f"({'met' if t_q <= need else 'NOT met'})")


def qproj_cases(dev, K: int = 1536):
    """The fused Q up-projection's shapes, T x NH = 16384 x 128, 4096 x 128, 16384 x 16 (K 1536), with
    their inputs: (T, NH, x ~ N(0, 1) bf16 [T, K], W ~ N(0, 1/K) bf16 [NH * 192, K], YaRN cos, sin,
    tf: a time in ms worded as TFLOP/s)."""
    for T, NH in ((16384, 128), (4096, 128), (16384, 16)):
        flop = 2.0 * T * NH * 192 * K
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(NH * 192, K, device=dev) / K ** 0.5).to(torch.bfloat16)
        c, s = mxmla.rope_tables(torch.arange(T, device=dev), yarn="deepseek_v3")
        yield T, NH, x, w, c, s, (lambda ms, flop=flop: f"{flop / ms / 1e9:.0f} TFLOP/s")


def bench_qproj(iters, flush, dev, add, compile_peer: bool):
    """Fused Q up-projection vs cuBLAS (torch.matmul) alone and with separate RoPE + quantize."""
    peer = torch.compile(lambda q, c, s: torch_quant_both(torch_rope_iho(q, c, s).flatten(1))) if compile_peer else None
    for T, NH, x, w, c, s, tf in qproj_cases(dev):
        case = f"qproj {T}x{NH}"
        t_f = timer(lambda: mxmla.fused_q_uproj_rope_quant(x, w, c, s), iters, flush)
        t_g = timer(lambda: torch.matmul(x, w.t()), iters, flush)

        def unfused():
            q = torch.matmul(x, w.t()).view(T, 1, NH, 192)
            mxmla.apply_rope(q, c, s, out=q)
            mxmla.quantize_attention(q, bhsd_scales=False)

        t_u = timer(unfused, iters, flush)
        add(case, "mxmla fused", t_f, 0.0, f"{tf(t_f)}; {t_f / t_g:.3f}x the GEMM alone (target <= 1.00)")
        add(case, "cuBLAS GEMM alone", t_g, 0.0, tf(t_g))
        w8 = mxmla.quantize(w, columnwise=False)  # the MXFP8-weight op: x quantized inside, bf16 copies, the fused kernel
        t_m = timer(lambda: mxmla.fused_q_uproj_rope_quant(x, w8, c, s), iters, flush)
        add(case, "mxmla, MXFP8 W", t_m, 0.0, f"{tf(t_m)}; {t_m / t_g:.3f}x the bf16 GEMM alone (target <= 1.15)")
        add(case, "GEMM + mxmla RoPE + quant", t_u, 0.0, f"{tf(t_u)}; fused {t_u / t_f:.2f}x faster (mxmla's own kernels)")
        if peer is not None:  # the users' peer of PEERS.md, the one the >= 1.7x target is set against
            t_c = timer(lambda: peer(torch.matmul(x, w.t()).view(T, NH, 192), c, s), iters, flush)
            add(case, "GEMM + torch.compile epilogue", t_c, 0.0, f"{tf(t_c)}; fused {t_c / t_f:.2f}x faster (target >= 1.7)")
        del x, w, w8


def _scaled_mm_block(xb, wb):
    """cuBLAS's block-scaled FP8 GEMM on Hopper (torch.nn.functional.scaled_mm, 1 x 128 x blocks and
    128 x 128 or 1 x 128 W blocks; the scales' layouts it asks for vary between torch versions: the
    first that runs)."""
    F = torch.nn.functional
    sx, sw = xb.scale_inv, wb.scale_inv
    kind = F.ScalingType.BlockWise128x128 if wb.block_rows == 128 else F.ScalingType.BlockWise1x128
    tries = (("sx outer-major, sw^T", sx.t().contiguous().t(), sw.t()),
             ("sx outer-major, sw", sx.t().contiguous().t(), sw),
             ("sx outer-major, sw outer-major", sx.t().contiguous().t(), sw.t().contiguous().t()),
             ("sx contiguous, sw^T", sx, sw.t()))
    errs = []
    for name, a, b in tries:
        def call(a=a, b=b):
            return F.scaled_mm(xb.data, wb.data.t(), a, F.ScalingType.BlockWise1x128, b, kind,
                               output_dtype=torch.bfloat16)
        try:
            call()
            return call, name
        except Exception as e:  # noqa: BLE001 (the peer is optional: report why it did not run)
            errs.append(f"{name}: {str(e).splitlines()[0][:160]}")
    return None, "; ".join(errs)


def _add_fp8_peers(add, case, ab, bb, t_ours, tf, iters, flush, dev, label, speed):
    """cuBLAS's block-scaled FP8 GEMM on ab's and bb's codes and factors and its per-tensor FP8 GEMM on
    the codes (the ceiling), timed and added beside ours (t_ours ms): ours as a share of their speed
    (speed) or a multiple of their time."""
    def vs(t):
        return f"ours {t / t_ours:.3f}x its speed" if speed else f"ours {t_ours / t:.3f}x its time"

    peer, how = _scaled_mm_block(ab, bb)
    if peer is not None:
        t_p = timer(peer, iters, flush)
        add(case, f"cuBLAS block-scaled FP8{label}", t_p, 0.0, f"{tf(t_p)}; {vs(t_p)} ({how})")
    else:
        add(case, f"cuBLAS block-scaled FP8{label}", float("nan"), 0.0, f"did not run: {how}")
    one = torch.ones((), device=dev)
    a8, b8 = ab.data, bb.data
    t_t = timer(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), iters, flush)
    add(case, f"cuBLAS FP8 per-tensor{label} (ceiling)", t_t, 0.0, f"{tf(t_t)}; {vs(t_t)}")


def bench_qproj_block(iters, flush, dev, add):
    """The fused Q up-projection with a block-FP8 weight (DeepSeek-V3 recipe: 128 x 128 W blocks,
    1 x 128 x blocks; FP8 wgmma) against cuBLAS's bf16 GEMM alone, the bf16-weight fused op, cuBLAS's
    block-scaled FP8 GEMM alone and cuBLAS FP8 with per-tensor scales (the ceiling), same run."""
    for T, NH, x, w, c, s, tf in qproj_cases(dev):
        wb = mxmla.quantize_blockwise(w, block_rows=128)
        xb = mxmla.quantize_blockwise(x)
        case = f"qproj-block {T}x{NH}"
        # check: the GEMM part of q (nope dims) against float64 math on the dequantized operands
        _, q = mxmla.fused_q_uproj_rope_quant(xb, wb, c, s, return_q=True)
        rows = slice(0, 512)
        ref = (xb.dequantize()[rows].double() @ wb.dequantize().double().t()).view(-1, NH, 192)[..., :128]
        got = q[rows].double().view(-1, NH, 192)[..., :128]
        rel = ((got - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        t_g = timer(lambda: torch.matmul(x, w.t()), iters, flush)
        t_f = timer(lambda: mxmla.fused_q_uproj_rope_quant(x, w, c, s), iters, flush)
        t_k = timer(lambda: mxmla.fused_q_uproj_rope_quant(xb, wb, c, s), iters, flush)
        t_x = timer(lambda: mxmla.fused_q_uproj_rope_quant(x, wb, c, s), iters, flush)
        add(case, "mxmla, block-FP8 x and W", t_k, 0.0,
            f"{tf(t_k)}; {t_k / t_g:.3f}x cuBLAS bf16 GEMM alone; {t_k / t_f:.3f}x the bf16-W op; q rel RMS err {rel:.1e}")
        add(case, "mxmla, block-FP8 W, bf16 x (quantized inside)", t_x, 0.0, f"{tf(t_x)}; {t_x / t_g:.3f}x cuBLAS bf16")
        add(case, "mxmla, bf16 W (fused op)", t_f, 0.0, f"{tf(t_f)}; {t_f / t_g:.3f}x cuBLAS bf16")
        add(case, "cuBLAS bf16 GEMM alone", t_g, 0.0, tf(t_g))
        _add_fp8_peers(add, case, xb, wb, t_k, tf, iters, flush, dev, " GEMM alone", speed=False)
        del x, w, wb, xb, q


def bench_block_gemm(iters, flush, dev, add):
    """mxmla.gemm on block-FP8 operands (the DeepSeek-V3 recipe's Linear GEMMs, K-major operands as
    quantize_blockwise makes them, transpose included) against cuBLAS's bf16 GEMM on bf16 operands of
    the same shape, cuBLAS's block-scaled FP8 GEMM on the same codes and factors, and cuBLAS FP8 with
    per-tensor scales (the ceiling), same run; each on pre-quantized operands (the GEMM alone)."""
    cases = []
    for T in (16384, 4096):
        cases += [(f"fprop T{T}", T, 24576, 1536, 128), (f"dgrad T{T}", T, 1536, 24576, 128),
                  (f"wgrad T{T}", 24576, 1536, T, 1)]
    cases.append(("8192^3", 8192, 8192, 8192, 128))
    for name, M, N, K, b_br in cases:
        a16 = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b16 = (torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
        ab, bb = mxmla.quantize_blockwise(a16), mxmla.quantize_blockwise(b16, b_br)
        tf = lambda t: f"{2.0 * M * N * K / t / 1e9:.0f} TFLOP/s"  # noqa: E731
        case = f"block-gemm {name} ({M}x{N}x{K}, B {'128x128' if b_br == 128 else '1x128'})"
        got = mxmla.gemm(ab, bb, out_dtype="float32")
        rows = slice(0, 256)
        ref = ab.dequantize()[rows].double() @ bb.dequantize().double().t()
        rel = ((got[rows].double() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
        del got
        t_m = timer(lambda: mxmla.gemm(ab, bb), iters, flush)
        t_g = timer(lambda: torch.matmul(a16, b16.t()), iters, flush)
        add(case, "mxmla block-FP8 GEMM", t_m, 0.0,
            f"{tf(t_m)}; {t_g / t_m:.2f}x faster than cuBLAS bf16; fp32 out rel RMS err {rel:.1e} vs float64")
        add(case, "cuBLAS bf16 GEMM", t_g, 0.0, tf(t_g))
        _add_fp8_peers(add, case, ab, bb, t_m, tf, iters, flush, dev, " GEMM", speed=True)
        del a16, b16, ab, bb


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--K", type=int, default=24576)
    ap.add_argument("--json", default="")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    ap.add_argument("--quant-only", action="store_true", help="only the quantize cases (MXFP8 without its torch.compile peers; block FP8 with)")
    ap.add_argument("--rope-only", action="store_true", help="only the copy ceiling and the RoPE cases")
    ap.add_argument("--qproj-only", action="store_true", help="only the fused Q up-projection cases")
    ap.add_argument("--qproj-block-only", action="store_true",
                    help="only the fused Q up-projection with a block-FP8 weight (and its peers)")
    ap.add_argument("--block-gemm-only", action="store_true",
                    help="only the block-FP8 GEMM (fprop, dgrad, wgrad of the Q up-projection; 8192^3) and its peers")
    ap.add_argument("--attn-only", action="store_true", help="only the copy ceiling and the attention hand-off cases")
    ap.add_argument("--attn-fwd-only", action="store_true",
                    help="only the copy ceiling and the attention forward (mxmla.attention vs cuDNN, FA4, dequantize + peer)")
    ap.add_argument("--no-attn-fwd", action="store_true", help="leave the attention forward out of the full run")
    ap.add_argument("--attn-seqs", default=",".join(map(str, attn_fwd.SEQS)),
                    help="attention forward: sequence lengths, comma-separated (default %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="attention forward: compare ours with cuDNN at s 2048 before ours is timed (max abs diff); a failure flags "
                         "ours' figures and makes the exit status 1")
    a = ap.parse_args()
    try:
        a.attn_seqs = [int(v) for v in a.attn_seqs.split(",") if v.strip()]
        assert a.attn_seqs and min(a.attn_seqs) > 0
    except (ValueError, AssertionError):
        ap.error(f"argument --attn-seqs: positive integers separated by commas, got {a.attn_seqs!r}")
    if not torch.cuda.is_available():
        print("bench: no CUDA device: nothing to measure")
        return 0
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    M, K = a.M, a.K
    torch.manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    rows = []
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "K": K}

    def add(case, what, ms, nbytes, note=""):
        gbps = nbytes / ms / 1e6
        res[f"{case}/{what}"] = {"ms": ms, "GBps": gbps}
        rows.append((case, what, ms, gbps, note))

    # --- copy ceiling (bytes read + written)
    y = torch.empty_like(x)
    t_copy = timer(lambda: y.copy_(x), a.iters, flush)
    add("ceiling", "d2d copy (torch)", t_copy, 4.0 * M * K)
    copy_bw = 4.0 * M * K / t_copy / 1e6

    # --- check ours against the torch formula once (same TE rule; torch saturates via clamp)
    q = mxmla.quantize(x, rowwise=True, columnwise=True)
    qr, er, qc, ec = torch_quant_both(x)
    agree = all(
        torch.equal(a_, b_.view(torch.uint8) if b_.dtype != torch.uint8 else b_)
        for a_, b_ in ((q.rowwise_data, qr), (q.rowwise_scale_inv, er), (q.columnwise_data, qc), (q.columnwise_scale_inv, ec))
    )
    res["torch_formula_bit_exact"] = agree
    del q, qr, er, qc, ec

    bytes_both = 2.0 * M * K + 2.0 * M * K + 2.0 * M * K / 32
    bytes_row = 2.0 * M * K + 1.0 * M * K + M * K / 32
    if a.qproj_only:
        del x, y
        bench_qproj(a.iters, flush, dev, add, not a.no_compile)
        bench_qproj_block(a.iters, flush, dev, add)
        return report(a, res, rows, agree)
    if a.qproj_block_only:
        del x, y
        bench_qproj_block(a.iters, flush, dev, add)
        return report(a, res, rows, agree)
    if a.block_gemm_only:
        del x, y
        bench_block_gemm(a.iters, flush, dev, add)
        return report(a, res, rows, agree)
    if a.attn_only:
        del x, y
        bench_attention(a.iters, flush, dev, add)
        return report(a, res, rows, agree)
    if a.rope_only:
        del x, y
        bench_rope(a.iters, flush, dev, add, not a.no_compile)
        return report(a, res, rows, agree)
    if a.attn_fwd_only:
        del x, y
        return bench_attn_fwd(a, flush, dev, add, res, rows, agree)
    t_both = timer(lambda: mxmla.quantize(x), a.iters, flush)
    add("quant_both", "mxmla", t_both, bytes_both, f"{100 * bytes_both / t_both / 1e6 / copy_bw:.0f}% of copy")
    t_swz = timer(lambda: mxmla.quantize(x, swizzle=True), a.iters, flush)
    add("quant_swz", "mxmla swizzled", t_swz, bytes_both, f"{100 * (t_swz / t_both - 1):+.1f}% vs compact")
    t_row = timer(lambda: mxmla.quantize(x, columnwise=False), a.iters, flush)
    add("quant_row", "mxmla", t_row, bytes_row, f"{100 * bytes_row / t_row / 1e6 / copy_bw:.0f}% of copy")
    t_row_swz = timer(lambda: mxmla.quantize(x, columnwise=False, swizzle=True), a.iters, flush)
    add("quant_row", "mxmla swizzled", t_row_swz, bytes_row, f"{100 * (t_row_swz / t_row - 1):+.1f}% vs compact")
    bench_block_quant(x, a.iters, flush, add, copy_bw, not a.no_compile)
    if not a.no_compile and not a.quant_only:
        c_row = torch.compile(torch_quant_rowwise)
        c_both = torch.compile(torch_quant_both)
        t = timer(lambda: c_both(x), a.iters, flush)
        add("quant_both", "torch.compile", t, bytes_both, f"mxmla {t / t_both:.2f}x faster")
        t = timer(lambda: c_row(x), a.iters, flush)
        add("quant_row", "torch.compile", t, bytes_row, f"mxmla {t / t_row:.2f}x faster")

    # --- attention hand-off: Q, K (192), V (128), b 2, h 16, s 4096, sbhd
    del x, y
    if not a.quant_only:
        bench_attention(a.iters, flush, dev, add)
        bench_rope(a.iters, flush, dev, add, not a.no_compile)
        bench_qproj(a.iters, flush, dev, add, not a.no_compile)
        bench_qproj_block(a.iters, flush, dev, add)
        if not a.no_attn_fwd:
            return bench_attn_fwd(a, flush, dev, add, res, rows, agree)
    return report(a, res, rows, agree)


def bench_attn_fwd(a, flush, dev, add, res, rows, agree) -> int:
    """The attention-forward section (bench/attn_fwd.py), then the report with its table last."""
    torch.cuda.empty_cache()
    section = attn_fwd.run(a.iters, flush, dev, add, seqs=a.attn_seqs, check=a.check)
    res["attn_fwd"] = section.results()
    return max(report(a, res, rows, agree, section.table()), section.status())


def report(a, res, rows, agree, extra=()) -> int:
    M, K = res["M"], res["K"]
    print(f"\nGPU: {res['gpu']}  torch {res['torch']}  shape [{M}, {K}] bf16 -> E4M3; medians of {a.iters}, L2 flushed")
    print(f"torch formula and mxmla bit-exact on this input: {agree}")
    print(f"{'case':<17} {'what':<29} {'ms':>9} {'GB/s':>8}  note")
    for case, what, ms, gbps, note in rows:
        print(f"{case:<17} {what:<29} {ms:9.4f} {gbps if gbps else float('nan'):8.0f}  {note}")
    for line in extra:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
