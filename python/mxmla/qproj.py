"""The fused Q up-projection (SPEC §4): q = x W^T (bf16 GEMM, fp32 accumulation, rounded to bf16),
RoPE on the rope part of each head (fp32), MXFP8 quantization (rowwise along the head dim,
columnwise along 32 tokens of a sequence), in one pass that never writes q in bf16 (unless asked).

Three front ends: the functional ``fused_q_uproj_rope_quant`` (torch tensors or numpy arrays; numpy
runs the CPU reference), the class ``FusedMLAQUpProjRopeQuant`` in the reference system's shape, and
the torch custom op ``torch.ops.mxmla.fused_q_uproj_rope_quant`` (registered on ``import mxmla``,
with a fake implementation, so torch.compile traces it).

Not differentiable yet (its backward is rope_backward_quantize plus the two backward GEMMs, which
this library does not chain for you): with grad mode on, an input that requires grad is an error.
Call it inside a torch.autograd.Function's forward, under torch.no_grad(), or on detached inputs.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Tuple, Union

import numpy as np

from . import _dispatch
from . import _mxmla_core as _core
from ._backend import Backend, alloc_outputs, is_torch, kind_of, output_descs, torch, type_name
from ._checks import (
    FP8_FORMAT,
    QKV_LAYOUT,
    ROPE_STYLE,
    WEIGHT_LAYOUT,
    choice,
    directions,
    flag,
    integer,
    not_differentiable,
    same_kind,
)
from .mxfp8 import MXFP8Tensor, _options, _present
from .rope import _check_tables

if TYPE_CHECKING:
    import torch as _torch_t

    Array = Union[_torch_t.Tensor, np.ndarray]
else:
    Array = Any

_OP = "mxmla.fused_q_uproj_rope_quant"
_NOT_DIFF = "the op is forward only: mxmla.nn.MLAQUpProj carries its gradient (rope_backward_quantize and the " \
            "backward GEMMs)"


def _qproj_options(nope_dim: int, rope_dim: int, style: str, layout: str, batch: int, weight_layout: str,
                   rowwise: bool, columnwise: bool, fp8_format: str, bhsd_scales: bool, op: str = _OP) -> Any:
    return _options(_core.QProjOptions, nope_dim=int(nope_dim), rope_dim=int(rope_dim),
                    style=ROPE_STYLE.parse(op, "style", style), layout=QKV_LAYOUT.parse(op, "layout", layout),
                    batch=int(batch), weight_layout=WEIGHT_LAYOUT.parse(op, "weight_layout", weight_layout),
                    rowwise=rowwise, columnwise=columnwise, format=FP8_FORMAT.parse(op, "fp8_format", fp8_format),
                    bhsd_scales=bhsd_scales)


def _heads(x_shape: Any, w_shape: Any, nope_dim: int, rope_dim: int, weight_layout: str) -> Tuple[int, int]:
    """(tokens, heads) of x [T, K] and w (the C++ side checks the shapes; this only reads them)."""
    D = int(nope_dim) + int(rope_dim)
    N = int(w_shape[0] if weight_layout == "nk" else w_shape[1]) if len(w_shape) == 2 else 0
    return int(x_shape[0]) if len(x_shape) else 0, max(N // D, 1) if D > 0 else 1


def _qproj_shapes(tokens: int, heads: int, o: Any) -> tuple:
    return _core.qproj_shapes(tokens, heads, o, _OP)


def _fused_impl(x: Any, w: Any, cos: Any, sin: Any, nope_dim: int, rope_dim: int, style: str, layout: str,
                batch: int, weight_layout: str, rowwise: bool, columnwise: bool, fp8_format: str, bhsd_scales: bool,
                return_q: bool) -> tuple:
    be = Backend(_OP, "x", x)
    xd = be.desc("x", x, bf16=True)
    wd = be.desc("w", w, bf16=True)
    for arg, d in (("x", xd), ("w", wd)):
        if len(d[2]) != 2:
            raise ValueError(f"{_OP}: argument '{arg}': must be 2-D, got shape {d[2]}")
    o = _qproj_options(nope_dim, rope_dim, style, layout, batch, weight_layout, rowwise, columnwise, fp8_format,
                       bhsd_scales)
    tokens, heads = _heads(xd[2], wd[2], nope_dim, rope_dim, weight_layout)
    qshape, data, rs, cs = _qproj_shapes(tokens, heads, o)
    outs = alloc_outputs(be, (data, rs, cs), rowwise, columnwise)
    q = be.empty(qshape, "bfloat16") if return_q else None
    _core.fused_q_uproj_rope_quant(xd, wd, be.desc("cos", cos, bf16=True), be.desc("sin", sin, bf16=True),
                                   *output_descs(be, outs), be.opt_desc("q", q, bf16=True), o, be.stream())
    return (*outs, q, qshape)


def _fused_args(op: str, nope_dim: Any, rope_dim: Any, style: Any, layout: Any, batch: Any, weight_layout: Any,
                rowwise: Any, columnwise: Any, fp8_format: Any, bhsd_scales: Any) -> tuple:
    args = (integer(op, "nope_dim", nope_dim), integer(op, "rope_dim", rope_dim),
            choice(op, "style", style, ROPE_STYLE), choice(op, "layout", layout, QKV_LAYOUT),
            integer(op, "batch", batch), choice(op, "weight_layout", weight_layout, WEIGHT_LAYOUT),
            flag(op, "rowwise", rowwise), flag(op, "columnwise", columnwise),
            choice(op, "fp8_format", fp8_format, FP8_FORMAT), flag(op, "bhsd_scales", bhsd_scales))
    directions(op, args[6], args[7])
    return args


def _fused_mx_impl(xc: Any, xs: Any, wc: Any, ws: Any, x_mx: str, w_mx: str, cos: Any, sin: Any, nope_dim: int,
                   rope_dim: int, style: str, layout: str, batch: int, rowwise: bool, columnwise: bool,
                   fp8_format: str, bhsd_scales: bool, return_q: bool) -> tuple:
    """The compiled op on MXFP8 x and W: their rowwise codes and scales with their descriptions
    (attention._mx_spec). Returns (*outputs, q or None, q's shape)."""
    from .attention import _core_operand, _parse_spec
    be = Backend(_OP, "x", xc if xc is not None else cos)  # (no rowwise codes: the core names the missing copy)
    o = _qproj_options(nope_dim, rope_dim, style, layout, batch, "nk", rowwise, columnwise, fp8_format, bhsd_scales)
    xo = _core_operand(be, _OP, "x", xc, xs, x_mx, True)
    wo = _core_operand(be, _OP, "w", wc, ws, w_mx, True)
    tokens, heads = _heads(_parse_spec(x_mx)[3], _parse_spec(w_mx)[3], nope_dim, rope_dim, "nk")
    qshape, data, rs, cs = _qproj_shapes(tokens, heads, o)
    outs = alloc_outputs(be, (data, rs, cs), rowwise, columnwise)
    q = be.empty(qshape, "bfloat16") if return_q else None
    _core.fused_q_uproj_rope_quant_mx(xo, wo, be.desc("cos", cos, bf16=True), be.desc("sin", sin, bf16=True),
                                      *output_descs(be, outs), be.opt_desc("q", q, bf16=True), o, be.stream())
    return (*outs, q, qshape)


def fused_q_mxfp8_weight(x: Any, w8: MXFP8Tensor, cos: Any, sin: Any, nope_dim: int, rope_dim: int, style: str,
                         layout: str, batch: int, weight_layout: str, rowwise: bool, columnwise: bool,
                         fp8_format: str, bhsd_scales: bool, return_q: bool) -> Tuple[MXFP8Tensor, Any, MXFP8Tensor]:
    """The fused op with an MXFP8 weight (the reference system's MXFP8-weight path; arguments checked
    by the caller): x (bf16, quantized here rowwise + columnwise in one pass in W's FP8 format, or an
    MXFP8Tensor [T, K] with its rowwise copy) times W [N, K] (rowwise copy: blocks along K) with fp32
    accumulation on the exactly dequantized codes, rounded to bf16, then RoPE in fp32 on that bf16 q
    (not re-rounded) and the MXFP8 quantization of q for attention — the bf16-weight op's epilogue.
    CPU tensors, and CUDA ones with the kernel's head dims (nope 128, rope 64): the compiled op
    (torch.ops.mxmla.fused_q_uproj_rope_quant_mx; on CUDA the bf16 op's kernel on bf16 copies of x
    and W, with an exact fallback for scales that put values outside bf16's normal range); other head
    dims on CUDA: mxmla.gemm, then apply_rope and quantize_attention (the same result). Returns (q8,
    q in bf16 after RoPE or None, x8: x's MXFP8 copies, whose columnwise one the weight gradient
    reads)."""
    from .gemm import gemm
    from .mxfp8 import quantize, quantize_attention
    from .rope import apply_rope

    op = _OP
    if weight_layout != "nk":
        raise ValueError(f"{op}: argument 'weight_layout': an MXFP8 w is [N, K] with its blocks along K "
                         f"(weight_layout 'nk'), got {weight_layout!r}")
    if not (isinstance(x, MXFP8Tensor) or is_torch(x)):
        raise TypeError(f"{op}: argument 'x': with an MXFP8 w, x must be a torch tensor (bf16) or an MXFP8Tensor, "
                        f"got {type_name(x)}")
    for arg, t in (("x", x), ("w", w8)):
        if isinstance(t, MXFP8Tensor) and not is_torch(t.rowwise_data if t.rowwise_data is not None else t.columnwise_data):
            raise TypeError(f"{op}: argument '{arg}': the MXFP8-weight path takes MXFP8Tensors of torch tensors "
                            "(numpy: quantize torch tensors instead)")
    if len(w8.shape) != 2:
        raise ValueError(f"{op}: argument 'w': an MXFP8 w must be 2-D [N, K], got shape {tuple(w8.shape)}")
    if isinstance(x, MXFP8Tensor):
        x8 = x
    else:
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"{op}: argument 'x': must be a 2-D [T, K] bf16 tensor, got {x.dtype} {tuple(x.shape)}")
        x8 = quantize(x, fp8_format=w8.fp8_format)  # both copies, one pass
    T, N, D = x8.shape[0], w8.shape[0], nope_dim + rope_dim
    if N % D:
        raise ValueError(f"{op}: argument 'w': N = {N} rows is not a multiple of the head dim nope_dim + rope_dim "
                         f"= {D}")
    if T % batch:
        raise ValueError(f"{op}: argument 'batch': x's {T} tokens are not a multiple of batch = {batch}")
    if x8.rowwise_data is None or x8.rowwise_data.device.type == "cpu" or (nope_dim, rope_dim) == (128, 64):
        from .attention import _mx_spec
        _check_tables(op, style, cos, sin)
        res = _dispatch.call("fused_q_uproj_rope_quant_mx", x8.rowwise_data, x8.rowwise_scale_inv, w8.rowwise_data,
                             w8.rowwise_scale_inv, _mx_spec(x8), _mx_spec(w8), cos, sin, nope_dim, rope_dim, style,
                             layout, batch, fp8_format, bhsd_scales, rowwise, columnwise, return_q)
        outs = _present(res[:4], rowwise, columnwise)
        qshape = res[0].shape if rowwise else res[2].shape  # the codes have q's shape
        t = MXFP8Tensor(tuple(qshape), fp8_format, "bhsd" if bhsd_scales else "compact", *outs, layout=layout,
                        attention=True)
        return t, (res[4] if return_q else None), x8
    q = gemm(x8, w8)  # [T, N] bf16 (fp32 accumulation, rounded once)
    s, heads = T // batch, N // D
    qr = q.float().reshape((s, batch, heads, D) if layout == "sbhd" else (batch, s, heads, D))
    apply_rope(qr, cos, sin, style=style, layout=layout, rope_dim=rope_dim, out=qr)  # in place, fp32: not re-rounded
    t = quantize_attention(qr, layout, rowwise=rowwise, columnwise=columnwise, fp8_format=fp8_format,
                           bhsd_scales=bhsd_scales)
    return t, (qr.to(torch.bfloat16) if return_q else None), x8


def _fused_block_impl(xc: Any, xs: Any, wc: Any, ws: Any, cos: Any, sin: Any, nope_dim: int, rope_dim: int,
                      style: str, layout: str, batch: int, rowwise: bool, columnwise: bool, fp8_format: str,
                      bhsd_scales: bool, return_q: bool) -> tuple:
    """The compiled op on block-FP8 x (codes xc, scale_inv xs: 1 x 128 blocks) and W (wc, ws: 128 x 128
    blocks). Returns (*outputs, q or None, q's shape)."""
    be = Backend(_OP, "x", xc)
    o = _qproj_options(nope_dim, rope_dim, style, layout, batch, "nk", rowwise, columnwise, fp8_format, bhsd_scales)
    tokens, heads = _heads(tuple(xc.shape), tuple(wc.shape), nope_dim, rope_dim, "nk")
    qshape, data, rs, cs = _qproj_shapes(tokens, heads, o)
    outs = alloc_outputs(be, (data, rs, cs), rowwise, columnwise)
    q = be.empty(qshape, "bfloat16") if return_q else None
    _core.fused_q_uproj_rope_quant_block(
        be.desc("x.data", xc), be.desc("x.scale_inv", xs), be.desc("w.data", wc), be.desc("w.scale_inv", ws),
        be.desc("cos", cos, bf16=True), be.desc("sin", sin, bf16=True), *output_descs(be, outs),
        be.opt_desc("q", q, bf16=True), o, be.stream())
    return (*outs, q, qshape)


def fused_q_block_fp8_weight(x: Any, w8: Any, cos: Any, sin: Any, nope_dim: int, rope_dim: int, style: str,
                             layout: str, batch: int, weight_layout: str, rowwise: bool, columnwise: bool,
                             fp8_format: str, bhsd_scales: bool, return_q: bool) -> tuple:
    """The fused op with a block-FP8 weight (the DeepSeek-V3 recipe; arguments checked by the caller):
    w a BlockFP8Tensor [N, K] with 128 x 128 blocks, x a bf16 tensor [T, K] (quantized here with
    1 x 128 blocks and power-of-two scales, quantize_blockwise) or a BlockFP8Tensor with 1 x 128
    blocks. q_acc = Σ over 128-blocks of K of (Σ x_code · w_code) · x_scale_inv · w_scale_inv, fp32
    across blocks (on CUDA the FP8 tensor cores add a block's products, in their own precision),
    rounded to bf16, then the bf16 op's RoPE + MXFP8 epilogue. Returns (q8, q or None, x8)."""
    from .blockfp8 import BlockFP8Tensor, _check_block, quantize_blockwise

    op = _OP
    if weight_layout != "nk":
        raise ValueError(f"{op}: argument 'weight_layout': a block-FP8 w is [N, K] (weight_layout 'nk'), "
                         f"got {weight_layout!r}")
    _check_block(op, "w", w8, 128)
    if isinstance(x, BlockFP8Tensor):
        _check_block(op, "x", x, 1)
        x8 = x
    else:
        kind_of(op, "x", x)
        not_differentiable(op, _NOT_DIFF, x=x)
        x8 = quantize_blockwise(x, block_rows=1)
    same_kind(op, "x", x8.data, w=w8.data, cos=cos, sin=sin)
    _check_tables(op, style, cos, sin)
    if is_torch(x8.data):
        res = _dispatch.call("fused_q_uproj_rope_quant_block", x8.data, x8.scale_inv, w8.data, w8.scale_inv, cos, sin,
                             nope_dim, rope_dim, style, layout, batch, fp8_format, bhsd_scales, rowwise, columnwise,
                             return_q)
        outs = _present(res[:4], rowwise, columnwise)
        q = res[4] if return_q else None
        qshape = res[0].shape if rowwise else res[2].shape  # the codes have q's shape
    else:
        *outs, q, qshape = _fused_block_impl(x8.data, x8.scale_inv, w8.data, w8.scale_inv, cos, sin, nope_dim,
                                             rope_dim, style, layout, batch, rowwise, columnwise, fp8_format,
                                             bhsd_scales, return_q)
    t = MXFP8Tensor(tuple(qshape), fp8_format, "bhsd" if bhsd_scales else "compact", *outs, layout=layout,
                    attention=True)
    return t, q, x8


def fused_q_uproj_rope_quant(x: Array, w: Array, cos: Array, sin: Array, nope_dim: int = 128, rope_dim: int = 64,
                             style: str = "interleaved_in_halves_out", layout: str = "sbhd", batch: int = 1,
                             weight_layout: str = "nk", rowwise: bool = True, columnwise: bool = True,
                             fp8_format: str = "e4m3", bhsd_scales: bool = False,
                             return_q: bool = False) -> Union[MXFP8Tensor, Tuple[MXFP8Tensor, Array]]:
    """x [T, K] bf16, w [N, K] (weight_layout "nk", nn.Linear's weight) or [K, N] ("kn") bf16 with
    N = heads * (nope_dim + rope_dim), cos/sin [>= s, rope_dim] float32/bfloat16 (rope_tables builds
    them for a style) -> MXFP8Tensor of q [s, b, heads, D] (layout "sbhd", T = s*b tokens, s-major) or
    [b, s, heads, D] ("bshd"); with return_q also q itself in bf16 (after RoPE).

    With batch 1 and compact scales the buffers are the reference system's: codes [T, heads, D]
    (viewed as [T, 1, heads, D]), rowwise scales [T*heads, D/32], columnwise [ceil(T/32), heads*D].
    bhsd_scales=True writes the swizzled BHSD scales attention reads (SPEC §2.2).
    numpy: bf16 as ml_dtypes.bfloat16 or uint16 bits; q comes back in x's flavour.

    MXFP8 weights: w an MXFP8Tensor [N, K] with its rowwise copy (quantize(w)), x a torch bf16 tensor
    (quantized here rowwise + columnwise in one pass) or an MXFP8Tensor [T, K]: the GEMM runs on the
    exactly dequantized MXFP8 copies (SPEC §6, fp32 accumulation), then the same RoPE + MXFP8
    epilogue (see fused_q_mxfp8_weight: on CUDA the fused kernel on bf16 copies of x and W).

    Block-FP8 weights (the DeepSeek-V3 recipe): w a BlockFP8Tensor [N, K] with 128 x 128 blocks
    (quantize_blockwise(w, block_rows=128), or a DeepSeek-V3 checkpoint's weight and
    weight_scale_inv), x bf16 (quantized here with 1 x 128 blocks) or a BlockFP8Tensor with 1 x 128
    blocks: on CUDA the kernel multiplies on the FP8 tensor cores (see fused_q_block_fp8_weight).
    Not differentiable (see the module docstring)."""
    op = _OP
    (nope_dim, rope_dim, style, layout, batch, weight_layout, rowwise, columnwise, fp8_format,
     bhsd_scales) = _fused_args(op, nope_dim, rope_dim, style, layout, batch, weight_layout, rowwise, columnwise,
                                fp8_format, bhsd_scales)
    return_q = flag(op, "return_q", return_q)
    from .blockfp8 import BlockFP8Tensor
    if isinstance(w, BlockFP8Tensor):
        t, q, _ = fused_q_block_fp8_weight(x, w, cos, sin, nope_dim, rope_dim, style, layout, batch, weight_layout,
                                           rowwise, columnwise, fp8_format, bhsd_scales, return_q)
        return (t, q) if return_q else t
    if isinstance(w, MXFP8Tensor):
        t, q, _ = fused_q_mxfp8_weight(x, w, cos, sin, nope_dim, rope_dim, style, layout, batch, weight_layout, rowwise,
                                       columnwise, fp8_format, bhsd_scales, return_q)
        return (t, q) if return_q else t
    torch_kind = kind_of(op, "x", x) == "torch"
    same_kind(op, "x", x, w=w, cos=cos, sin=sin)
    _check_tables(op, style, cos, sin)
    if torch_kind:
        not_differentiable(op, _NOT_DIFF, x=x, w=w, cos=cos, sin=sin)
        res = _dispatch.call("fused_q_uproj_rope_quant", x, w, cos, sin, nope_dim, rope_dim, style, layout, batch,
                             fp8_format, bhsd_scales, weight_layout, rowwise, columnwise,
                             return_q)
        outs, q = _present(res[:4], rowwise, columnwise), res[4]
        qshape = res[0].shape if rowwise else res[2].shape  # the codes have q's shape
    else:
        *outs, q, qshape = _fused_impl(x, w, cos, sin, nope_dim, rope_dim, style, layout, batch, weight_layout, rowwise,
                                       columnwise, fp8_format, bhsd_scales, return_q)
    t = MXFP8Tensor(tuple(qshape), fp8_format, "bhsd" if bhsd_scales else "compact", *outs, layout=layout,
                    attention=True)
    return (t, q) if return_q else t


class FusedMLAQUpProjRopeQuant:
    """The fused Q up-projection in the reference system's shape (TransformerEngine's fused
    "Q Up-Proj GEMM/RoPE/Quant"): ``run(x, w, cos, sin, s, b)`` -> (query MXFP8Tensor, saved activation).

    The saved activation is what the backward needs from the forward: x itself (bf16 weights; the
    weight gradient is dW = dQ'^T x), or with an MXFP8 w (an MXFP8Tensor) x's columnwise MXFP8 copy
    (x bf16 is quantized rowwise + columnwise in one pass; the rowwise copy feeds the GEMM). x may be [s*b, K] or [s, b, K] / [b, s, K] (flattened).
    The options are checked here, at construction (the C++ rules included)."""

    def __init__(self, nope_dim: int = 128, rope_dim: int = 64, style: str = "interleaved_in_halves_out",
                 layout: str = "sbhd", fp8_format: str = "e4m3", bhsd_scales: bool = False):
        op = "mxmla.FusedMLAQUpProjRopeQuant"
        (self.nope_dim, self.rope_dim, self.style, self.layout, _, _, _, _, self.fp8_format,
         self.bhsd_scales) = _fused_args(op, nope_dim, rope_dim, style, layout, 1, "nk", True, True, fp8_format,
                                         bhsd_scales)
        # the C++ rules on the head geometry (nope_dim >= 0, rope_dim positive and even, D % 32 == 0)
        _core.qproj_shapes(0, 1, _qproj_options(self.nope_dim, self.rope_dim, self.style, self.layout, 1, "nk", True,
                                                True, self.fp8_format, self.bhsd_scales), op)

    def __repr__(self) -> str:
        return (f"FusedMLAQUpProjRopeQuant(nope_dim={self.nope_dim}, rope_dim={self.rope_dim}, style='{self.style}', "
                f"layout='{self.layout}', fp8_format='{self.fp8_format}', bhsd_scales={self.bhsd_scales})")

    @staticmethod
    def is_supported(device: Any = None) -> bool:
        """True when the SM90 kernel can run: a CUDA build and a compute-capability 9.0 device (H100/H200).
        (The CPU reference runs everywhere.)"""
        version, cuda, archs, cuda_rope = _core.build_info()
        n = _core.cuda_device_count()
        if not cuda or n == 0:
            return False
        idx = 0 if device is None else (device.index or 0) if hasattr(device, "index") else int(device)
        return idx < n and "sm_90" in _core.cuda_device_description(idx)

    def run(self, x: Array, w: Array, cos: Array, sin: Array, s: int, b: int = 1) -> Tuple[MXFP8Tensor, Array]:
        op = "mxmla.FusedMLAQUpProjRopeQuant.run"
        s, b = integer(op, "s", s), integer(op, "b", b)
        kind_of(op, "x", x)
        if len(x.shape) == 3:
            x = x.reshape(x.shape[0] * x.shape[1], x.shape[2])
        if len(x.shape) != 2:
            raise ValueError(f"{op}: argument 'x': must be [s*b, K] or 3-D, got shape {tuple(x.shape)}")
        if x.shape[0] != s * b:
            raise ValueError(f"{op}: argument 'x': {x.shape[0]} tokens, expected s*b = {s * b}")
        if isinstance(w, MXFP8Tensor):  # the saved activation: x's columnwise copy only (for dW = dQ'ᵀ·x)
            q, _, x8 = fused_q_mxfp8_weight(x, w, cos, sin, self.nope_dim, self.rope_dim, self.style, self.layout, b,
                                            "nk", True, True, self.fp8_format, self.bhsd_scales, False)
            return q, MXFP8Tensor(x8.shape, x8.fp8_format, x8.scale_layout, None, None, x8.columnwise_data,
                                  x8.columnwise_scale_inv)
        q = fused_q_uproj_rope_quant(x, w, cos, sin, self.nope_dim, self.rope_dim, self.style, self.layout, b,
                                     fp8_format=self.fp8_format, bhsd_scales=self.bhsd_scales)
        return q, x


def register_torch_op() -> Any:
    """Deprecated: the ops are registered on ``import mxmla`` (when torch is importable). Returns
    ``torch.ops.mxmla.fused_q_uproj_rope_quant``: (x, w, cos, sin, nope_dim, rope_dim, style, layout,
    batch, fp8_format, bhsd_scales, weight_layout="nk", rowwise=True, columnwise=True, return_q=False)
    -> (rowwise codes, rowwise scales, columnwise codes, columnwise scales, q); a direction that is off,
    and q without return_q, come back as empty placeholders."""
    warnings.warn("mxmla.register_torch_op() is deprecated: the torch ops are registered on import mxmla; use "
                  "torch.ops.mxmla.fused_q_uproj_rope_quant (or mxmla.fused_q_uproj_rope_quant)", DeprecationWarning,
                  stacklevel=2)
    if torch is None:
        raise ImportError("mxmla.register_torch_op: torch is not installed")
    return torch.ops.mxmla.fused_q_uproj_rope_quant
