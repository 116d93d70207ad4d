"""The MLA query path with autograd: ``MLAQUpProj`` (the fused Q up-projection + RoPE + MXFP8 as a
module) and ``attention_from_mxfp8_q`` (attention that consumes its MXFP8 Q).

How the MXFP8 Q carries autograd: ``MLAQUpProj.forward`` returns the MXFP8 Q (an MXFP8Tensor, not
differentiable: codes and scales) *and* an anchor, a bf16 tensor of q's shape without memory of its
own (a zero expanded to the shape) that is the autograd edge of the projection. The attention
function takes both: its forward reads the MXFP8 Q, its backward returns the bf16 dQ as the anchor's
gradient, which reaches ``MLAQUpProj``'s backward: RoPE backward of dQ, then dgrad dX = dQ'·W and
wgrad dW = dQ'ᵀ·x (bf16 operands, fp32 accumulation; the weight gradient in fp32, or added into the
weight's ``main_grad`` when it has one, as Megatron accumulates gradients). No bf16 copy of
q is ever stored. Saved for the backward: x (bf16) and W's bf16 copy, as the reference system keeps
them for bf16 weights.

Weights: ``weights="bf16"`` (bf16 copies of fp32 master weights). ``"mxfp8"``: the fused op's
MXFP8-weight path, as the reference system runs it (TransformerEngine's MXFP8 recipe): W quantized
once per version of the weight (both copies; micro-batches between optimizer steps reuse them), x
quantized rowwise + columnwise in one pass, fprop X_row·W_rowᵀ on mxmla.gemm, then RoPE and the MXFP8
quantization of q; saved: x's and W's columnwise copies only. Backward (``rope_linear_backward``):
RoPE backward and the MXFP8 quantization of dQ' in one pass (``rope_backward_quantize``'s), dgrad
dX = dQ'_row·W_col and wgrad dW = dQ'_colᵀ·X_col on mxmla.gemm's kernels (SPEC §6).
``"block-fp8"``: the DeepSeek-V3 recipe (docs/spec.md §4.1): W quantized once per version of the
weight in 128 x 128 blocks (power-of-two scales), x in 1 x 128 blocks, the forward on the FP8 tensor
cores. Backward (as ``mxmla.nn.BlockFP8LinearFunction``'s): RoPE backward of dQ in bf16, dQ'
quantized in 1 x 128 blocks along N and along T, then dgrad dX = dQ'·W (on Wᵀ's 128 x 128 copy) and
wgrad dW = dQ'ᵀ·x (on xᵀ's 1 x 128 copy) on the block-FP8 GEMM. Saved: xᵀ's codes and scales (W's
two block-FP8 copies are kept with the weight, once per version).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import nn

from .layers import _quantized_weight, block_linear_grads, block_weights, check_bool, generator, init_normal_, \
    linear_grads, linear_saved, linear_saved_frozen

_OP = "mxmla.nn.MLAQUpProj"


def refuse_thd_capture() -> None:
    """A clear error while a CUDA graph is being captured: the modules make packed sequences' RoPE
    positions and cu_seqlens on the host at each call, and a replay would copy the capture's host
    buffers (freed by then), not another call's values."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("mxmla.nn: packed sequences (layout 'thd') cannot be captured in a CUDA graph: their "
                           "RoPE positions and cu_seqlens are made on the host at each call (capture the "
                           "bshd / sbhd layouts, or run thd eagerly)")


def packed_positions(cu, device: Any = None) -> torch.Tensor:
    """Each packed token's position inside its own sequence (thd: positions restart at 0 at every
    sequence of cu_seqlens ``cu``, a host list), int64 [t] on ``device``; not under CUDA graph capture
    (refuse_thd_capture)."""
    refuse_thd_capture()
    c = np.asarray(cu, dtype=np.int64)  # (numpy: a fraction of torch's CPU repeat_interleave's host time)
    pos = torch.from_numpy(np.arange(c[-1], dtype=np.int64) - np.repeat(c[:-1], np.diff(c)))
    dev = torch.device(device) if device is not None else pos.device
    if dev.type == "cuda":  # from pinned memory without waiting: a pageable copy would synchronize the stream
        return pos.pin_memory().to(dev, non_blocking=True)
    return pos.to(dev)


def thd_tensor(fmt: str, rd: torch.Tensor, rs: torch.Tensor, cd: torch.Tensor, cs: torch.Tensor) -> Any:
    """Codes [.., h, d] of t tokens run as one sequence with compact scales (the fused op's q as one
    sbhd sequence [t, 1, h, d], quantize_attention's bshd [1, t, h, d]) as the thd tensor attention
    reads: the bytes of quantize([t, h·d]), as quantize_for_attention makes them for thd (columnwise
    blocks along the packed tokens)."""
    import mxmla

    h, d = rd.shape[-2], rd.shape[-1]
    t = rd.numel() // (h * d)
    return mxmla.MXFP8Tensor((t, h * d), fmt, "compact", rd.view(t, h, d), rs.view(t, h * d // 32), cd.view(t, h, d),
                             cs)


def _anchored(ctx, x: torch.Tensor, q8: Any) -> tuple:
    """(anchor, q8's four buffers) as a forward returns them: the anchor a zero expanded to q's shape
    (the autograd edge, no memory of its own), the buffers marked non-differentiable."""
    anchor = torch.zeros((), dtype=torch.bfloat16, device=x.device).expand(q8.rowwise_data.shape)
    bufs = (q8.rowwise_data, q8.rowwise_scale_inv, q8.columnwise_data, q8.columnwise_scale_inv)
    ctx.mark_non_differentiable(*bufs)
    return (anchor, *bufs)


def _bf16_grads(ctx, dq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(dx in x's shape, dW in the weight's dtype or None) of q = RoPE(xs · wᵀ) from dq: RoPE backward,
    then dgrad and wgrad in bf16 with fp32 accumulation; the wgrad added into the weight's
    ``main_grad`` (Megatron's fp32 buffer; then no dW) when it has one."""
    import mxmla

    cfg = ctx.cfg
    dqr = mxmla.rope_backward(dq.to(torch.bfloat16).contiguous(), cos, sin, style=cfg["style"],
                              layout=cfg["layout"], rope_dim=cfg["rope_dim"])
    g = dqr.reshape(-1, w.shape[0])                                            # dQ' [T, N] bf16
    dx = torch.matmul(g, w)                                                    # [T, K] bf16, fp32 accumulation
    dw = torch.matmul(g.t().to(torch.float32), xs.to(torch.float32))          # [N, K] fp32
    main_grad = getattr(ctx.weight, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(dw)
        return dx.reshape(ctx.x_shape), None
    return dx.reshape(ctx.x_shape), dw.to(ctx.w_dtype)


class _QUpProjFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: dict):
        import mxmla

        K = x.shape[-1]
        xs = x.detach().reshape(-1, K).to(torch.bfloat16).contiguous()
        w = weight.detach().to(torch.bfloat16).contiguous()
        q8 = mxmla.fused_q_uproj_rope_quant(xs, w, cos, sin, cfg["nope_dim"], cfg["rope_dim"], style=cfg["style"],
                                           layout=cfg["layout"], batch=cfg["batch"], bhsd_scales=cfg["bhsd_scales"])
        ctx.save_for_backward(xs, w, cos, sin)
        ctx.cfg, ctx.x_shape, ctx.w_dtype, ctx.weight = cfg, x.shape, weight.dtype, weight
        return _anchored(ctx, x, q8)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, *_unused):
        return (*_bf16_grads(ctx, dq, *ctx.saved_tensors), None, None, None)


class _QUpProjMXFP8Function(torch.autograd.Function):
    """The query path with an MXFP8 weight (the module docstring's ``weights="mxfp8"``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: dict):
        from ..qproj import fused_q_mxfp8_weight

        K = x.shape[-1]
        xs = x.detach().reshape(-1, K).to(torch.bfloat16).contiguous()
        w8 = _quantized_weight(weight)
        q8, _, x8 = fused_q_mxfp8_weight(xs, w8, cos, sin, cfg["nope_dim"], cfg["rope_dim"], cfg["style"],
                                         cfg["layout"], cfg["batch"], "nk", True, True, "e4m3", cfg["bhsd_scales"],
                                         False)
        # only the copies the backward reads: x's and W's columnwise ones (a frozen weight: W's alone)
        ctx.save_for_backward(*(linear_saved(x8, w8) if ctx.needs_input_grad[1] else linear_saved_frozen(w8)), cos, sin)
        ctx.cfg, ctx.x_shape, ctx.w_dtype, ctx.weight = cfg, x.shape, weight.dtype, weight
        ctx.shapes, ctx.x_dtype = (x8.shape, w8.shape), x.dtype
        return _anchored(ctx, x, q8)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, *_unused):
        import mxmla

        xc, xsc, wc, wsc, cos, sin = ctx.saved_tensors
        cfg = ctx.cfg
        w8 = mxmla.MXFP8Tensor(ctx.shapes[1], "e4m3", "compact", None, None, wc, wsc)
        if not ctx.needs_input_grad[1]:  # a frozen weight: dQ' rowwise and the dgrad alone (the same bits)
            dq8 = mxmla.rope_backward_quantize(dq.to(torch.bfloat16).contiguous(), cos, sin, columnwise=False,
                                               style=cfg["style"], layout=cfg["layout"], rope_dim=cfg["rope_dim"])
            dx = mxmla.gemm(dq8, w8, trans_b=False)
            return dx.reshape(ctx.x_shape).to(ctx.x_dtype), None, None, None, None
        x8 = mxmla.MXFP8Tensor(ctx.shapes[0], "e4m3", "compact", None, None, xc, xsc)
        # dQ' = RoPE backward of dq quantized (both copies, [T, N]); dx = dQ'·W [T, K] bf16, dW = dQ'ᵀ·x
        # [N, K] fp32 (or added into Megatron's fp32 main_grad; no .grad): one call, which on CUDA
        # writes the GEMMs' bf16 copies of dQ' instead of its codes
        main_grad = getattr(ctx.weight, "main_grad", None)
        dx, dw = mxmla.rope_linear_backward(dq.to(torch.bfloat16).contiguous(), cos, sin, w8, x8, style=cfg["style"],
                                            layout=cfg["layout"], rope_dim=cfg["rope_dim"], main_grad=main_grad)
        if main_grad is not None:
            return dx.reshape(ctx.x_shape).to(ctx.x_dtype), None, None, None, None
        return dx.reshape(ctx.x_shape).to(ctx.x_dtype), dw.to(ctx.w_dtype), None, None, None


class _QUpProjBlockFP8Function(torch.autograd.Function):
    """The query path with a block-FP8 weight (the module docstring's ``weights="block-fp8"``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: dict):
        import mxmla
        from ..qproj import fused_q_block_fp8_weight

        K = x.shape[-1]
        xs = x.detach().reshape(-1, K).to(torch.bfloat16).contiguous()
        wq, wt = block_weights(weight)
        # one pass over x: the fused op's x (1 x 128 blocks along K) and wgrad's xᵀ [K, T] (along the tokens);
        # a frozen weight: x along K only, nothing of it kept
        if ctx.needs_input_grad[1]:
            xq, xt = mxmla.quantize_blockwise_both(xs)
        else:
            xq, xt = mxmla.quantize_blockwise(xs), None
        q8, _, _ = fused_q_block_fp8_weight(xq, wq, cos, sin, cfg["nope_dim"], cfg["rope_dim"], cfg["style"],
                                            cfg["layout"], cfg["batch"], "nk", True, True, "e4m3",
                                            cfg["bhsd_scales"], False)
        ctx.save_for_backward(*((xt.data, xt.scale_inv) if xt is not None else (None, None)), cos, sin)
        ctx.cfg, ctx.x_shape, ctx.weight, ctx.x_dtype, ctx.wt = cfg, x.shape, weight, x.dtype, wt
        return _anchored(ctx, x, q8)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, *_unused):
        import mxmla

        xc, xsc, cos, sin = ctx.saved_tensors
        cfg, wt = ctx.cfg, ctx.wt
        dqr = mxmla.rope_backward(dq.to(torch.bfloat16).contiguous(), cos, sin, style=cfg["style"],
                                  layout=cfg["layout"], rope_dim=cfg["rope_dim"])
        frozen = not ctx.needs_input_grad[1]
        xt = None if frozen else mxmla.BlockFP8Tensor(xc, xsc, 1)
        dx, dw = block_linear_grads(dqr.reshape(-1, wt.shape[1]), wt, xt, ctx.weight, ctx.needs_input_grad[0],
                                    need_dw=not frozen)
        return (None if dx is None else dx.reshape(ctx.x_shape).to(ctx.x_dtype)), dw, None, None, None


def q_up(fn: Any, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope_dim: int,
         rope_dim: int, style: str, layout: str, cu: Optional[list] = None) -> Tuple[Any, torch.Tensor]:
    """(q8, anchor): the fused op with autograd (fn: _QUpProjFunction or _QUpProjMXFP8Function) on x in
    ``layout``. sbhd / bshd: q8 with BHSD scales. thd (cu: the checked host cu_seqlens): the t tokens
    run as one sbhd sequence on the tables' rows gathered by each token's position in its own sequence,
    compact scales; q8 the thd tensor (``thd_tensor``), the anchor [t, 1, h, d]."""
    import mxmla

    if layout == "thd":
        pos = packed_positions(cu, cos.device)
        cos, sin, op_layout, batch = cos[pos], sin[pos], "sbhd", 1
    else:
        op_layout, batch = layout, x.shape[1] if layout == "sbhd" else x.shape[0]
    cfg = dict(nope_dim=nope_dim, rope_dim=rope_dim, style=style, layout=op_layout, batch=int(batch),
               bhsd_scales=layout != "thd")
    anchor, rd, rs, cd, cs = fn.apply(x, weight, cos, sin, cfg)
    if layout == "thd":
        return thd_tensor("e4m3", rd, rs, cd, cs), anchor
    return mxmla.MXFP8Tensor(tuple(rd.shape), "e4m3", "bhsd", rd, rs, cd, cs, layout=layout, attention=True), anchor


class MLAQUpProj(nn.Module):
    """DeepSeek-V3's Q up-projection as a module: q = RoPE(x · Wᵀ) quantized to MXFP8 for attention
    (the fused op, ``mxmla.fused_q_uproj_rope_quant``), with autograd through an anchor (see the
    module docstring).

    in_features (DeepSeek-V3: q_lora_rank 1536), heads, nope_dim, rope_dim (128, 64), style (RoPE
    style, default DeepSeek's "interleaved"), layout ("sbhd" [s, b, in_features], "bshd" or "thd"
    [t, in_features]: packed sequences, whose RoPE positions restart at 0 at each sequence of
    forward's cu_seqlens), tables for positions 0 .. max_seq_len - 1 (rope_base, yarn as for
    mxmla.rope_tables), weights "bf16", "mxfp8" or "block-fp8" (the module docstring), init_std, seed (the weight
    is drawn from it on the CPU, as mxmla.nn's other modules).

    forward(x, cu_seqlens=None) -> (q8, anchor): q8 the MXFP8Tensor of q ([s, b, heads, D] or
    [b, s, heads, D], both copies, BHSD scales; thd: [t, heads·D] with codes viewed [t, heads, D] and
    compact scales, columnwise blocks along the packed tokens, as quantize makes them); anchor the
    bf16 autograd edge to pass to ``attention_from_mxfp8_q``. cu_seqlens: thd only (None: one
    sequence)."""

    def __init__(self, in_features: int = 1536, heads: int = 128, nope_dim: int = 128, rope_dim: int = 64,
                 weights: str = "bf16", *, style: str = "interleaved", layout: str = "sbhd", max_seq_len: int = 4096,
                 rope_base: float = 10000.0, yarn: Any = None, init_std: float = 0.02, seed: int = 0,
                 device: Any = None):
        super().__init__()
        import mxmla

        if weights not in ("bf16", "mxfp8", "block-fp8"):
            raise ValueError(f"{_OP}: weights must be 'bf16', 'mxfp8' or 'block-fp8', got {weights!r}")
        if layout not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"{_OP}: layout must be 'sbhd', 'bshd' or 'thd', got {layout!r}")
        self.in_features, self.heads, self.nope_dim, self.rope_dim = in_features, heads, nope_dim, rope_dim
        self.style, self.layout, self.weights = style, layout, weights
        self.weight = nn.Parameter(torch.empty(heads * (nope_dim + rope_dim), in_features, dtype=torch.float32))
        init_normal_(self.weight, init_std, generator(seed))
        cos, sin = mxmla.rope_tables(torch.arange(max_seq_len), rope_dim, base=rope_base, yarn=yarn, style=style)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if device is not None:
            self.to(device)

    def forward(self, x: torch.Tensor, cu_seqlens: Any = None) -> Tuple[Any, torch.Tensor]:
        from .mla import sequences

        if x.dim() != (2 if self.layout == "thd" else 3) or x.shape[-1] != self.in_features:
            dims = {"sbhd": "[s, b, in_features]", "bshd": "[b, s, in_features]", "thd": "[t, in_features]"}[self.layout]
            raise ValueError(f"{_OP}: x must be {dims} with in_features={self.in_features}, got {tuple(x.shape)}")
        cu, _ = sequences(_OP, x, self.layout, cu_seqlens, self.rope_cos.shape[0])
        fn = {"mxfp8": _QUpProjMXFP8Function, "block-fp8": _QUpProjBlockFP8Function}.get(self.weights, _QUpProjFunction)
        return q_up(fn, x, self.weight, self.rope_cos, self.rope_sin, self.nope_dim, self.rope_dim, self.style,
                    self.layout, cu)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, heads={self.heads}, nope_dim={self.nope_dim}, "
                f"rope_dim={self.rope_dim}, weights={self.weights!r}, style={self.style!r}, layout={self.layout!r}")


def _rowwise_only(t: Any) -> Any:
    """An MXFP8Tensor without its columnwise copy."""
    import mxmla

    return mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, t.rowwise_data, t.rowwise_scale_inv, None, None,
                             layout=t.layout, attention=t.attention)


def _q8_meta(q8: Any) -> tuple:
    return (q8.shape, q8.fp8_format, q8.scale_layout, q8.layout, q8.attention)


def _q8_of(meta: tuple, rd, rs, cd, cs) -> Any:
    import mxmla

    shape, fmt, sl, lay, att = meta
    return mxmla.MXFP8Tensor(shape, fmt, sl, rd, rs, cd, cs, layout=lay, attention=att)


def _attention_kw(what: str, q8: Any, causal: bool, softmax_scale: Optional[float], bottom_right: bool,
                  cu_seqlens: Any, max_seqlen: Optional[int]) -> dict:
    """attention's keywords for q8's tokens: its own layout, or thd when cu_seqlens is given."""
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError(f"{what}: max_seqlen is for packed sequences (with cu_seqlens)")
        return dict(causal=causal, softmax_scale=softmax_scale, bottom_right=bottom_right, layout=q8.layout)
    if q8.attention:
        raise ValueError(f"{what}: with cu_seqlens (packed sequences), q8 must be the thd tensor of MLAQUpProj(layout="
                         f"'thd'), got one in layout '{q8.layout}'")
    return dict(causal=causal, softmax_scale=softmax_scale, bottom_right=bottom_right, layout="thd",
                cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


class _AttentionFromQ8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, rd, rs, cd, cs, k, v, meta, kw, deterministic):
        import mxmla

        from ..attention_autograd import quantize_for_attention

        q8 = _q8_of(meta, rd, rs, cd, cs)
        k8, v8 = (quantize_for_attention(t, kw["layout"]) for t in (k, v))
        o, lse = mxmla.attention(q8, k8, v8, return_lse=True, **kw)
        v8 = _rowwise_only(v8)  # (V's columnwise copy served the forward only: the backward reads V rowwise)
        ctx.q8, ctx.k8, ctx.v8, ctx.kw = q8, k8, v8, dict(kw, deterministic=deterministic)
        ctx.anchor_shape = anchor.shape
        ctx.save_for_backward(o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        import mxmla

        o, lse = ctx.saved_tensors
        dq, dk, dv = mxmla.attention_backward(do.to(torch.bfloat16).contiguous(), ctx.q8, ctx.k8, ctx.v8, o, lse,
                                              **ctx.kw)
        return dq.view(ctx.anchor_shape), None, None, None, None, dk, dv, None, None, None


def attention_from_mxfp8_q(q8: Any, anchor: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                           softmax_scale: Optional[float] = None, bottom_right: bool = False,
                           deterministic: bool = False, cu_seqlens: Any = None,
                           max_seqlen: Optional[int] = None) -> torch.Tensor:
    """O = attention(q8, MXFP8(k), MXFP8(v)) with autograd: q8 and anchor from MLAQUpProj (dQ flows to
    the anchor), k and v bf16 tensors in q8's layout (quantized here with both copies). Returns bf16 O.
    deterministic: the backward's dQ sums in a fixed order (attention_backward's). Packed sequences:
    q8 from MLAQUpProj(layout="thd"), k and v [t, h, d], cu_seqlens as given to it; max_seqlen (the
    longest sequence, optional) spares both passes a copy of cu_seqlens to the host."""
    what = "mxmla.nn.attention_from_mxfp8_q"
    kw = _attention_kw(what, q8, causal, softmax_scale, bottom_right, cu_seqlens, max_seqlen)
    return _AttentionFromQ8.apply(anchor, q8.rowwise_data, q8.rowwise_scale_inv, q8.columnwise_data,
                                  q8.columnwise_scale_inv, k, v, _q8_meta(q8), kw,
                                  check_bool(what, "deterministic", deterministic))


class _AttentionFromLatent(torch.autograd.Function):
    """attention_from_latent's one autograd node: the kv_b Linear, K and V quantized from their views
    of its output, attention; backward: attention's, then the kv_b Linear's on [dK_nope | dV] in place.
    (One node: as two, with K and V handed over through anchors, the step measured 1.5 % slower.)"""

    @staticmethod
    def forward(ctx, anchor, rd, rs, cd, cs, lat, k_pe, weight, meta, kw, nope, deterministic):
        import mxmla

        q8 = _q8_of(meta, rd, rs, cd, cs)
        lead, K, H = lat.shape[:-1], lat.shape[-1], anchor.shape[-2]
        w8 = _quantized_weight(weight)
        kv, x8 = mxmla.linear_forward(lat.detach().reshape(-1, K).to(torch.bfloat16), w8)  # [T, H·(nope + v)]
        kv = kv.view(*lead, H, -1)
        pe = k_pe.detach().to(torch.bfloat16).expand(*lead, H, k_pe.shape[-1])
        # K = [k_nope | k_pe] and V, quantized from their views of kv (and k_pe over the heads) in place
        # (thd: as one bshd sequence of the t tokens with compact scales — quantize's bytes of [t, h·d])
        if kw["layout"] == "thd":
            k8, v8 = (mxmla.quantize_attention(x, "bshd", bhsd_scales=False)
                      for x in ((kv[None, ..., :nope], pe[None]), kv[None, ..., nope:]))
            k8, v8 = (thd_tensor(m.fp8_format, m.rowwise_data, m.rowwise_scale_inv, m.columnwise_data,
                                 m.columnwise_scale_inv) for m in (k8, v8))
        else:
            k8 = mxmla.quantize_attention((kv[..., :nope], pe), kw["layout"])
            v8 = mxmla.quantize_attention(kv[..., nope:], kw["layout"])
        del kv
        o, lse = mxmla.attention(q8, k8, v8, return_lse=True, **kw)
        v8 = _rowwise_only(v8)  # (V's columnwise copy served the forward only: the backward reads V rowwise)
        ctx.qkv8, ctx.kw, ctx.nope = (q8, k8, v8), dict(kw, deterministic=deterministic), nope
        ctx.anchor_shape = anchor.shape
        ctx.save_for_backward(o, lse, *(linear_saved(x8, w8) if ctx.needs_input_grad[7] else linear_saved_frozen(w8)))
        ctx.shapes, ctx.lead, ctx.lat_dtype, ctx.pe_dtype = (x8.shape, w8.shape), lead, lat.dtype, k_pe.dtype
        ctx.weight = weight  # for its main_grad (Megatron's fp32 gradient buffer), when it has one
        return o

    @staticmethod
    def backward(ctx, do):
        import mxmla

        o, lse, *saved = ctx.saved_tensors
        if ctx.qkv8 is None:  # as torch says of its own freed saved tensors
            raise RuntimeError("mxmla.nn.attention_from_latent: trying to backward through the graph a second time "
                               "(retain_graph=True is not supported: the saved MXFP8 Q, K, V are freed by the first "
                               "backward)")
        q8, k8, v8 = ctx.qkv8
        ctx.qkv8 = None  # (the MXFP8 Q, K, V leave memory before the kv_b GEMMs' scratch arrives)
        dq, dk, dv = mxmla.attention_backward(do.to(torch.bfloat16).contiguous(), q8, k8, v8, o, lse, **ctx.kw)
        del q8, k8, v8
        nope, H = ctx.nope, dk.shape[-2]
        dk_pe = dk[..., nope:].sum(dim=-2, keepdim=True).to(ctx.pe_dtype)  # k_pe's expansion over the heads
        # the kv_b Linear's dy = [dK_nope | dV] per head, read in place (no concatenation pass)
        dx, dw = linear_grads(saved, ctx.shapes, ctx.weight,
                              (dk[..., :nope].reshape(-1, H, nope), dv.reshape(-1, H, dv.shape[-1])),
                              need_dw=ctx.needs_input_grad[7])
        dlat = dx.reshape(*ctx.lead, dx.shape[-1]).to(ctx.lat_dtype)
        return dq.view(ctx.anchor_shape), None, None, None, None, dlat, dk_pe, dw, None, None, None, None


def attention_from_latent(q8: Any, anchor: torch.Tensor, lat: torch.Tensor, k_pe: torch.Tensor, weight: torch.Tensor,
                          nope_dim: int, *, causal: bool = True, softmax_scale: Optional[float] = None,
                          bottom_right: bool = False, deterministic: bool = False, cu_seqlens: Any = None,
                          max_seqlen: Optional[int] = None) -> torch.Tensor:
    """MLA's keys and values from the KV latent, and attention on them, with autograd (what
    ``mxmla.nn.MLA`` runs under the "mxfp8" recipe): kv = lat · Wᵀ on the MXFP8 Linear
    (``linear_forward``; W [h·(nope_dim + v_dim), kv_lora_rank], quantized once per version),
    K = [k_nope | k_pe] (k_pe [.., 1, rope_dim], one rope key shared by the heads) and V = kv's other
    part, both quantized with both copies straight from their views of kv (``quantize_attention`` of
    a pair, no torch.cat), then O = attention(q8, K, V). Backward: ``attention_backward``; the kv_b
    Linear's backward reads dK[..., :nope_dim] and dV in place (``linear_backward`` of a pair);
    dk_pe = dK[..., nope_dim:] summed over the heads. The same bits as that composition written with
    torch.cat, without its concatenation passes. q8, anchor from ``MLAQUpProj``; lat, k_pe in q8's
    layout (bshd / sbhd). Packed sequences: q8 from MLAQUpProj(layout="thd"), lat [t, r], k_pe
    [t, 1, rope_dim], cu_seqlens as given to it, max_seqlen (the longest sequence, optional: it spares
    both attention passes a copy of cu_seqlens to the host). deterministic: the attention backward's
    dQ sums in a fixed order (bitwise reproducible gradients). Returns bf16 O."""
    what = "mxmla.nn.attention_from_latent"
    kw = _attention_kw(what, q8, causal, softmax_scale, bottom_right, cu_seqlens, max_seqlen)
    return _AttentionFromLatent.apply(anchor, q8.rowwise_data, q8.rowwise_scale_inv, q8.columnwise_data,
                                      q8.columnwise_scale_inv, lat, k_pe, weight, _q8_meta(q8), kw, int(nope_dim),
                                      check_bool(what, "deterministic", deterministic))
