"""Attention with autograd: ``MXFP8Attention`` (a torch.autograd.Function) over ``attention`` and
``attention_backward``.

Forward: bf16 q, k, v are quantized to MXFP8 with both copies, in one pass each (sbhd / bshd:
``quantize_attention``; thd: ``quantize`` of the [t, h·d] token-major view; bhsd: ``quantize`` of
[b, h, s, d]); the attention forward runs on the MXFP8 tensors and returns bf16 O. Saved for the
backward: the three MXFP8 tensors (both copies: the backward's GEMMs each read the copy along their
contraction), O and LSE -- no bf16 copy of q, k, v. Backward: ``attention_backward`` from the bf16
dO, returning bf16 dq, dk, dv (the gradient of the loss with respect to the dequantized inputs, passed
straight through the quantization to the bf16 ones, as TransformerEngine's MXFP8 attention does).

Needs torch. CPU tensors run the CPU reference both ways; CUDA tensors the GPU kernels both ways
(with thd, max_seqlen_q and max_seqlen_kv spare both passes a synchronizing copy of cu_seqlens).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from .attention import attention
from .attention_backward import attention_backward
from .mxfp8 import MXFP8Tensor, quantize, quantize_attention

_OP = "mxmla.MXFP8Attention"
_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _reads_in_place(x: torch.Tensor) -> bool:
    """quantize_attention reads x as it lies: last dim contiguous, no negative stride, and on CUDA
    16-byte aligned (pointer and strides). E.g. q, k, v as views of a packed [s, b, 3, h, d]."""
    if x.dim() != 4 or x.stride(-1) != 1 or any(st < 0 for st in x.stride()):
        return False
    if not x.is_cuda:
        return True
    es = x.element_size()
    return x.data_ptr() % 16 == 0 and all(n == 1 or (st * es) % 16 == 0 for n, st in zip(x.shape, x.stride()))


def quantize_for_attention(x: torch.Tensor, fmt: str, fp8_format: str = "e4m3") -> MXFP8Tensor:
    """x (bf16, format fmt) quantized with both copies in one pass, as MXFP8Attention does: sbhd /
    bshd through quantize_attention (BHSD scales; a strided x, e.g. a view of a packed QKV tensor,
    is read in place where the kernels can: no copy), thd through quantize of the [t, h·d] view
    (codes viewed [t, h, d]), bhsd through quantize of [b, h, s, d] (columnwise blocks along s)."""
    x = x.detach()
    if fmt in ("sbhd", "bshd"):
        return quantize_attention(x if _reads_in_place(x) else x.contiguous(), fmt, fp8_format=fp8_format)
    x = x.contiguous()
    if fmt == "thd":
        t, h, d = (int(s) for s in x.shape)
        m = quantize(x.reshape(t, h * d), fp8_format=fp8_format)
        return MXFP8Tensor(m.shape, m.fp8_format, m.scale_layout, m.rowwise_data.view(t, h, d), m.rowwise_scale_inv,
                           m.columnwise_data.view(t, h, d), m.columnwise_scale_inv)
    if fmt == "bhsd":
        return quantize(x.contiguous(), fp8_format=fp8_format)
    raise ValueError(f"{_OP}: argument 'layout': must be 'sbhd', 'bshd', 'bhsd' or 'thd', got {fmt!r}")


def _fmt_of(layout: Optional[str], q: torch.Tensor) -> str:
    if layout is None:
        return "thd" if q.dim() == 3 else "sbhd"
    if layout not in ("sbhd", "bshd", "bhsd", "thd"):
        raise ValueError(f"{_OP}: argument 'layout': must be None or one format for q, k and v ('sbhd', 'bshd', "
                         f"'bhsd', 'thd'), got {layout!r}")
    return layout


class MXFP8Attention(torch.autograd.Function):
    """O = attention(MXFP8(q), MXFP8(k), MXFP8(v)) with its gradient (SPEC §5). q, k, v: bf16 tensors in
    one format (``layout``: "sbhd", "bshd", "bhsd" or "thd"; None: 3-D is thd, else sbhd).

    ``MXFP8Attention.apply(q, k, v, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv,
    max_seqlen_q, max_seqlen_kv, fp8_format, bottom_right, deterministic)`` → O (bf16)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                softmax_scale: Optional[float] = None, layout: Optional[str] = None, cu_seqlens_q: Any = None,
                cu_seqlens_kv: Any = None, max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                fp8_format: str = "e4m3", bottom_right: bool = False, deterministic: bool = False) -> torch.Tensor:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
                raise TypeError(f"{_OP}: argument '{name}': must be a torch.bfloat16 tensor (it is quantized to MXFP8 "
                                f"here), got {type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
        fmt = _fmt_of(layout, q)
        mx = [quantize_for_attention(t, fmt, fp8_format) for t in (q, k, v)]
        kw = dict(causal=causal, softmax_scale=softmax_scale, layout=fmt, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                  bottom_right=bottom_right)
        o, lse = attention(*mx, return_lse=True, **kw)
        # V's columnwise copy served the forward's P·V only: the backward reads V rowwise (dP = dO·Vᵀ),
        # so it is not kept (T·h·d_v bytes and its scales less)
        bufs = [None if i == 2 and f.startswith("columnwise") else getattr(t, f)
                for i, t in enumerate(mx) for f in _FIELDS]
        ctx.save_for_backward(*bufs, o, lse)
        ctx.meta = [(t.shape, t.fp8_format, t.scale_layout, t.layout, t.attention) for t in mx]
        ctx.kw = dict(kw, deterministic=deterministic)
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        saved = ctx.saved_tensors
        bufs, o, lse = saved[:12], saved[12], saved[13]
        mx = [MXFP8Tensor(shape, fmt, sl, *bufs[4 * i:4 * i + 4], layout=lay, attention=att)
              for i, (shape, fmt, sl, lay, att) in enumerate(ctx.meta)]
        dq, dk, dv = attention_backward(do.to(torch.bfloat16).contiguous(), *mx, o, lse, **ctx.kw)
        return (dq, dk, dv) + (None,) * 10


class DotProductAttention(torch.nn.Module):
    """Attention as a module, TransformerEngine-style: forward(q, k, v) → O (bf16) with autograd
    (MXFP8Attention: bf16 inputs quantized to MXFP8 with both copies; saved: the MXFP8 tensors, of v
    its rowwise copy only, O, LSE).

    softmax_scale: None is d_qk^-0.5 (DeepSeek-V3 with YaRN: ``mxmla.yarn_softmax_scale()``); causal
    (top-left; bottom_right=True aligns it to the end for s_q != s_kv); layout: "sbhd" (default),
    "bshd", "bhsd" or "thd" (then forward takes cu_seqlens_q / cu_seqlens_kv); fp8_format "e4m3" or
    "e5m2"; deterministic: the backward sums in a fixed order. cp_group: context parallelism
    (TransformerEngine's cp_group with cp_comm_type "p2p"): q, k, v are this rank's two chunks of each
    sequence (mxmla.nn.cp_split; sbhd / bshd, or thd with forward's cu_seqlens_q the whole sequences')
    and the attention runs over the whole sequences through mxmla.nn.context_parallel_attention
    (cp_comm_type "p2p": the ring; "a2a": all-to-all over the heads)."""

    def __init__(self, softmax_scale: Optional[float] = None, causal: bool = True, layout: str = "sbhd",
                 bottom_right: bool = False, fp8_format: str = "e4m3", deterministic: bool = False,
                 cp_group: Any = None, cp_comm_type: str = "p2p"):
        super().__init__()
        what = "mxmla.nn.DotProductAttention"
        if layout not in ("sbhd", "bshd", "bhsd", "thd"):
            raise ValueError(f"{what}: layout must be 'sbhd', 'bshd', 'bhsd' or 'thd', got {layout!r}")
        if cp_group is not None and (layout == "bhsd" or bottom_right):
            raise ValueError(f"{what}: cp_group (context parallelism) takes layout 'sbhd', 'bshd' or 'thd' and the "
                             f"top-left causal mask, got layout={layout!r}, bottom_right={bottom_right}")
        self.softmax_scale, self.causal, self.layout = softmax_scale, causal, layout
        self.bottom_right, self.fp8_format, self.deterministic = bottom_right, fp8_format, deterministic
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any = None,
                cu_seqlens_kv: Any = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None) -> torch.Tensor:
        if self.cp_group is not None:
            if cu_seqlens_kv is not None and cu_seqlens_kv is not cu_seqlens_q:
                raise ValueError("mxmla.nn.DotProductAttention: with cp_group, q, k and v split the same sequences: "
                                 "give cu_seqlens_q only (the whole sequences')")
            from .nn.cp import context_parallel_attention

            return context_parallel_attention(q, k, v, self.cp_group, causal=self.causal,
                                              softmax_scale=self.softmax_scale, layout=self.layout,
                                              cu_seqlens=cu_seqlens_q, fp8_format=self.fp8_format,
                                              deterministic=self.deterministic, cp_comm_type=self.cp_comm_type)
        if cu_seqlens_kv is None:
            cu_seqlens_kv = cu_seqlens_q
        return MXFP8Attention.apply(q, k, v, self.causal, self.softmax_scale, self.layout, cu_seqlens_q,
                                    cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, self.fp8_format, self.bottom_right,
                                    self.deterministic)

    def extra_repr(self) -> str:
        return (f"layout={self.layout!r}, causal={self.causal}, softmax_scale={self.softmax_scale}, "
                f"fp8_format={self.fp8_format!r}")


__all__: Sequence[str] = ["MXFP8Attention", "DotProductAttention", "quantize_for_attention"]
