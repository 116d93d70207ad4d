"""Private: every public op as a torch.library custom op (namespace ``mxmla``), registered on
``import mxmla`` when torch is importable.

Each op has a fake (meta) implementation whose output shapes come from the same C++ shape
functions the real path allocates with (quantize_shapes, attention_shapes, qproj_shapes), so
``torch.compile(fullgraph=True)`` traces them and ``device="meta"`` tensors work. No op has an output
of data-dependent shape. The shape functions take concrete sizes: a symbolic size is specialised.

Ops returning an MXFP8 result return its four uint8 buffers (rowwise codes, rowwise scales,
columnwise codes, columnwise scales); a direction that is off comes back as an empty placeholder
(shape [0]); the Python functions turn them into MXFP8Tensor (None for an absent direction).

Autograd: apply_rope and rope_backward are each other's gradient (register_autograd); the ``*_out``
forms (mutating ``out``) and the ops without a gradient (attention's backward comes later, gemm is
itself the backward's GEMMs) raise when an input needs one.
(No ``from __future__ import annotations`` here: torch infers the op schemas from the annotations.)
"""
import math
from typing import List, Optional, Sequence, Tuple

import torch

from . import _dispatch
from . import _mxmla_core as _core
from . import blockfp8 as _bf
from . import mxfp8 as _mx
from . import qproj as _qp
from . import rope as _rope
from .attention import _NOT_DIFF as _ATT_NOT_DIFF
from .attention import _attention_impl, _out_shapes
from .attention_backward import _attention_backward_impl
from .attention_backward import _fake_shapes as _bwd_fake_shapes
from .gemm import _NOT_DIFF as _GEMM_NOT_DIFF
from .gemm import (_LIN_NOT_DIFF, _gemm_impl, _linear_backward_impl, _linear_forward_impl, _rope_linear_backward_impl,
                   _shape_of, _x_saved_shapes)
from .gemm import _out_shape as _gemm_out_shape

Tensor = torch.Tensor
_T4 = Tuple[Tensor, Tensor, Tensor, Tensor]
_T5 = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _op(name: str, mutates_args=()):
    """torch.library.custom_op("mxmla::<name>"), its function also registered for eager calls
    (``_dispatch.call``)."""

    def deco(fn):
        _dispatch.register(name, fn)
        return torch.library.custom_op(f"mxmla::{name}", mutates_args=mutates_args)(fn)

    return deco


def _ints(shape: Sequence) -> List[int]:
    return [int(d) for d in shape]  # a SymInt is specialised (the C++ shape functions take ints)


def _placeholder(like: Tensor, t: Optional[Tensor], dtype: torch.dtype = torch.uint8) -> Tensor:
    return like.new_empty((0,), dtype=dtype) if t is None else t


def _fake4(like: Tensor, shapes: Sequence, rowwise: bool, columnwise: bool) -> _T4:
    data, rs, cs = shapes
    e = lambda s, on: like.new_empty(tuple(_ints(s)) if on else (0,), dtype=torch.uint8)  # noqa: E731
    return e(data, rowwise), e(rs, rowwise), e(data, columnwise), e(cs, columnwise)


def _no_gradient(op_def, op: str, why: str, names: Sequence[str]) -> None:
    """Ops without a gradient: an input that requires grad (grad mode on) raises in the forward
    (the Python functions raise the same error before calling the op)."""

    def setup_context(ctx, inputs, output):
        for name, v in zip(names, inputs):
            if isinstance(v, Tensor) and v.requires_grad:
                raise RuntimeError(f"{op}: argument '{name}': requires grad, but {op.split('.')[-1]} has no gradient "
                                   f"({why}); call it on {name}.detach(), under torch.no_grad(), or inside a "
                                   f"torch.autograd.Function's forward")

    def backward(ctx, *grads):  # pragma: no cover - setup_context raised already
        raise RuntimeError(f"{op} has no gradient ({why})")

    op_def.register_autograd(backward, setup_context=setup_context)


# ----------------------------------------------------------------------------- MXFP8
@_op("quantize", mutates_args=())
def quantize(x: Tensor, rowwise: bool, columnwise: bool, fp8_format: str, swizzle: bool) -> _T4:
    return tuple(_placeholder(x, o) for o in _mx._quantize_impl(x, rowwise, columnwise, fp8_format, swizzle))


@quantize.register_fake
def _(x, rowwise, columnwise, fp8_format, swizzle):
    return _fake4(x, _core.quantize_shapes(_ints(x.shape), swizzle, "mxmla.quantize", "x"), rowwise, columnwise)


_no_gradient(quantize, "mxmla.quantize", _mx._NOT_DIFF, ["x"])


@_op("quantize_attention", mutates_args=())
def quantize_attention(x: Tensor, layout: str, rowwise: bool, columnwise: bool, fp8_format: str,
                       bhsd_scales: bool) -> _T4:
    outs = _mx._quantize_attention_impl(x, layout, rowwise, columnwise, fp8_format, bhsd_scales)
    return tuple(_placeholder(x, o) for o in outs)


@quantize_attention.register_fake
def _(x, layout, rowwise, columnwise, fp8_format, bhsd_scales):
    op = "mxmla.quantize_attention"
    lay = _mx.QKV_LAYOUT.parse(op, "layout", layout)
    return _fake4(x, _core.attention_shapes(_ints(x.shape), lay, bhsd_scales, op, "x"), rowwise, columnwise)


_no_gradient(quantize_attention, "mxmla.quantize_attention", _mx._NOT_DIFF, ["x"])


@_op("quantize_attention_cat", mutates_args=())
def quantize_attention_cat(x0: Tensor, x1: Tensor, layout: str, rowwise: bool, columnwise: bool, fp8_format: str,
                           bhsd_scales: bool) -> _T4:
    outs = _mx._quantize_attention_impl(x0, layout, rowwise, columnwise, fp8_format, bhsd_scales, x1)
    return tuple(_placeholder(x0, o) for o in outs)


@quantize_attention_cat.register_fake
def _(x0, x1, layout, rowwise, columnwise, fp8_format, bhsd_scales):
    op = "mxmla.quantize_attention"
    lay = _mx.QKV_LAYOUT.parse(op, "layout", layout)
    shape = _mx._cat_shape(op, "x", x0, x1)
    return _fake4(x0, _core.attention_shapes(shape, lay, bhsd_scales, op, "x"), rowwise, columnwise)


_no_gradient(quantize_attention_cat, "mxmla.quantize_attention", _mx._NOT_DIFF, ["x[0]", "x[1]"])


@_op("dequantize", mutates_args=())
def dequantize(data: Tensor, scale: Tensor, shape: List[int], fp8_format: str, scale_layout: str, columnwise: bool,
               attention: bool, layout: str, dtype: torch.dtype) -> Tensor:
    name = str(dtype).replace("torch.", "")
    return _mx._dequantize_impl(data, scale, shape, fp8_format, scale_layout, columnwise, attention, layout, name)


@dequantize.register_fake
def _(data, scale, shape, fp8_format, scale_layout, columnwise, attention, layout, dtype):
    return data.new_empty(tuple(_ints(shape)), dtype=dtype)


@_op("swizzle_scales", mutates_args=())
def swizzle_scales(scales: Tensor, M: int, K: int, rowwise: bool) -> Tensor:
    return _mx._swizzle_impl(scales, M, K, rowwise, True)


@swizzle_scales.register_fake
def _(scales, M, K, rowwise):
    s = _core.quantize_shapes([int(M), int(K)], True, "mxmla.swizzle_scales", "K")
    return scales.new_empty(tuple(s[1] if rowwise else s[2]), dtype=torch.uint8)


@_op("unswizzle_scales", mutates_args=())
def unswizzle_scales(scales: Tensor, M: int, K: int, rowwise: bool) -> Tensor:
    return _mx._swizzle_impl(scales, M, K, rowwise, False)


@unswizzle_scales.register_fake
def _(scales, M, K, rowwise):
    s = _core.quantize_shapes([int(M), int(K)], False, "mxmla.unswizzle_scales", "K")
    return scales.new_empty(tuple(s[1] if rowwise else s[2]), dtype=torch.uint8)


def _bhsd_shape(op: str, shape: Sequence, layout: str, rowwise: bool, arg: str) -> List[int]:
    s = _core.attention_shapes(_ints(shape), _mx.QKV_LAYOUT.parse(op, "layout", layout), True, op, arg)
    return s[1] if rowwise else s[2]


@_op("attention_scales_to_bhsd", mutates_args=())
def attention_scales_to_bhsd(scales: Tensor, shape: List[int], layout: str, rowwise: bool) -> Tensor:
    return _mx._bhsd_impl("mxmla.attention_scales_to_bhsd", [scales], [shape], [layout], [rowwise], ["scales"],
                          ["shape"])[0]


@attention_scales_to_bhsd.register_fake
def _(scales, shape, layout, rowwise):
    return scales.new_empty(tuple(_bhsd_shape("mxmla.attention_scales_to_bhsd", shape, layout, rowwise, "shape")),
                            dtype=torch.uint8)


@_op("to_bhsd", mutates_args=())
def to_bhsd(scales: List[Tensor], shapes: List[int], bshd: List[bool], rowwise: List[bool],
            index: List[int]) -> List[Tensor]:
    """Phase two for len(scales) compact attention scale tensors in one launch; shapes: 4 per tensor;
    index: the position of each one's MXFP8Tensor in to_bhsd's arguments (for errors)."""
    sh = [shapes[4 * i: 4 * i + 4] for i in range(len(scales))]
    names, shape_names = _mx._to_bhsd_names(index, rowwise)
    return _mx._bhsd_impl("mxmla.to_bhsd", scales, sh, ["bshd" if b else "sbhd" for b in bshd], rowwise, names,
                          shape_names)


@to_bhsd.register_fake
def _(scales, shapes, bshd, rowwise, index):
    return [s.new_empty(tuple(_bhsd_shape("mxmla.to_bhsd", shapes[4 * i: 4 * i + 4], "bshd" if bshd[i] else "sbhd",
                                          rowwise[i], f"tensors[{index[i]}].shape")), dtype=torch.uint8)
            for i, s in enumerate(scales)]


# ----------------------------------------------------------------------------- RoPE
@_op("apply_rope", mutates_args=())
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str, layout: str, rope_dim: int,
               cu_seqlens: Optional[Tensor], tables_per_token: bool) -> Tensor:
    return _rope._rope_impl(False, x, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token)


@apply_rope.register_fake
def _(x, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token):
    return x.new_empty(x.shape)


@_op("rope_backward", mutates_args=())
def rope_backward(grad: Tensor, cos: Tensor, sin: Tensor, style: str, layout: str, rope_dim: int,
                  cu_seqlens: Optional[Tensor], tables_per_token: bool) -> Tensor:
    return _rope._rope_impl(True, grad, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token)


@rope_backward.register_fake
def _(grad, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token):
    return grad.new_empty(grad.shape)


def _kernel_ready(g: Tensor) -> Tensor:
    """An incoming gradient as the CUDA kernels take it: unit innermost stride, 16-byte aligned
    strides and offset (an expanded or oddly strided grad is copied; the CPU reference takes any)."""
    if not g.is_cuda or g.numel() == 0:
        return g
    es = g.element_size()
    ok = g.stride(-1) == 1 and all((s * es) % 16 == 0 for s in g.stride()[:-1]) and \
        (g.storage_offset() * es) % 16 == 0
    return g if ok else g.contiguous()


def _rope_autograd(op_def, op: str, other) -> None:
    """The gradient of apply_rope is rope_backward and vice versa (R and R^T), same options."""

    def setup_context(ctx, inputs, output):
        x, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token = inputs
        for name, t in (("cos", cos), ("sin", sin)):
            if t.requires_grad:
                raise RuntimeError(f"{op}: argument '{name}': requires grad, but {op.split('.')[-1]} has no gradient "
                                   f"for the tables; pass {name}.detach()")
        ctx.save_for_backward(cos, sin, cu_seqlens)
        ctx.options = (style, layout, rope_dim, tables_per_token)

    def backward(ctx, grad):
        cos, sin, cu_seqlens = ctx.saved_tensors
        style, layout, rope_dim, per_token = ctx.options
        dx = other()(_kernel_ready(grad), cos, sin, style, layout, rope_dim, cu_seqlens, per_token)
        return dx, None, None, None, None, None, None, None

    op_def.register_autograd(backward, setup_context=setup_context)


_rope_autograd(apply_rope, "mxmla.apply_rope", lambda: torch.ops.mxmla.rope_backward)
_rope_autograd(rope_backward, "mxmla.rope_backward", lambda: torch.ops.mxmla.apply_rope)


@_op("apply_rope_out", mutates_args=("out",))
def apply_rope_out(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, style: str, layout: str, rope_dim: int,
                   cu_seqlens: Optional[Tensor], tables_per_token: bool) -> None:
    _rope._rope_impl(False, x, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, out)


@apply_rope_out.register_fake
def _(x, cos, sin, out, style, layout, rope_dim, cu_seqlens, tables_per_token):
    return None


@_op("rope_backward_out", mutates_args=("out",))
def rope_backward_out(grad: Tensor, cos: Tensor, sin: Tensor, out: Tensor, style: str, layout: str, rope_dim: int,
                      cu_seqlens: Optional[Tensor], tables_per_token: bool) -> None:
    _rope._rope_impl(True, grad, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, out)


@rope_backward_out.register_fake
def _(grad, cos, sin, out, style, layout, rope_dim, cu_seqlens, tables_per_token):
    return None


@_op("rope_backward_quantize", mutates_args=())
def rope_backward_quantize(dq: Tensor, cos: Tensor, sin: Tensor, rowwise: bool, columnwise: bool, fp8_format: str,
                           swizzle: bool, dx_copy: Optional[torch.dtype], style: str, layout: str, rope_dim: int,
                           cu_seqlens: Optional[Tensor], tables_per_token: bool) -> _T5:
    name = None if dx_copy is None else str(dx_copy).replace("torch.", "")
    res = _rope._rope_backward_quantize_impl(dq, cos, sin, rowwise, columnwise, fp8_format, swizzle, name, style,
                                             layout, rope_dim, cu_seqlens, tables_per_token)
    return (*(_placeholder(dq, o) for o in res[:4]), _placeholder(dq, res[4], dx_copy or torch.float32))


@rope_backward_quantize.register_fake
def _(dq, cos, sin, rowwise, columnwise, fp8_format, swizzle, dx_copy, style, layout, rope_dim, cu_seqlens,
      tables_per_token):
    op = "mxmla.rope_backward_quantize"
    shape = _ints(dq.shape)
    if len(shape) < 3:
        raise ValueError(f"{op}: argument 'dq': must be [s,b,h,d], [b,s,h,d] or [t,h,d], got {shape}")
    tokens, hd = math.prod(shape[:-2]), shape[-2] * shape[-1]
    outs = _fake4(dq, _core.quantize_shapes([tokens, hd], swizzle, op, "dq"), rowwise, columnwise)
    dx = dq.new_empty(tuple(shape) if dx_copy is not None else (0,), dtype=dx_copy or torch.float32)
    return (*outs, dx)


_no_gradient(rope_backward_quantize, "mxmla.rope_backward_quantize", _mx._NOT_DIFF, ["dq", "cos", "sin"])


# ----------------------------------------------------------------------------- fused Q up-projection
@_op("fused_q_uproj_rope_quant", mutates_args=())
def fused_q_uproj_rope_quant(x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, nope_dim: int, rope_dim: int,
                             style: str, layout: str, batch: int, fp8_format: str, bhsd_scales: bool,
                             weight_layout: str = "nk", rowwise: bool = True, columnwise: bool = True,
                             return_q: bool = False) -> _T5:
    """(rowwise codes, rowwise scales, columnwise codes, columnwise scales, q); the argument order of
    the op register_torch_op() returned before (new arguments at the end, with defaults)."""
    res = _qp._fused_impl(x, w, cos, sin, nope_dim, rope_dim, style, layout, batch, weight_layout, rowwise,
                          columnwise, fp8_format, bhsd_scales, return_q)
    return (*(_placeholder(x, o) for o in res[:4]), _placeholder(x, res[4], torch.bfloat16))


@fused_q_uproj_rope_quant.register_fake
def _(x, w, cos, sin, nope_dim, rope_dim, style, layout, batch, fp8_format, bhsd_scales, weight_layout="nk",
      rowwise=True, columnwise=True, return_q=False):
    for arg, t in (("x", x), ("w", w)):
        if t.dim() != 2:
            raise ValueError(f"{_qp._OP}: argument '{arg}': must be 2-D, got shape {list(t.shape)}")
    o = _qp._qproj_options(nope_dim, rope_dim, style, layout, batch, weight_layout, rowwise, columnwise, fp8_format,
                           bhsd_scales)
    tokens, heads = _qp._heads(_ints(x.shape), _ints(w.shape), nope_dim, rope_dim, weight_layout)
    qshape, data, rs, cs = _qp._qproj_shapes(tokens, heads, o)
    q = x.new_empty(tuple(qshape) if return_q else (0,), dtype=torch.bfloat16)
    return (*_fake4(x, (data, rs, cs), rowwise, columnwise), q)


_no_gradient(fused_q_uproj_rope_quant, "mxmla.fused_q_uproj_rope_quant", _qp._NOT_DIFF, ["x", "w", "cos", "sin"])


@_op("fused_q_uproj_rope_quant_mx", mutates_args=())
def fused_q_uproj_rope_quant_mx(x_codes: Optional[Tensor], x_scales: Optional[Tensor], w_codes: Optional[Tensor],
                                w_scales: Optional[Tensor], x_mx: str, w_mx: str, cos: Tensor, sin: Tensor,
                                nope_dim: int, rope_dim: int, style: str, layout: str, batch: int, fp8_format: str,
                                bhsd_scales: bool, rowwise: bool = True, columnwise: bool = True,
                                return_q: bool = False) -> _T5:
    """The MXFP8-weight op: x's and W's rowwise codes and scales (None where absent: the core names the
    missing copy) with their descriptions (attention's "<fp8 format>:<scale layout>:-:<shape>") ->
    (rowwise codes, rowwise scales, columnwise codes, columnwise scales, q) as fused_q_uproj_rope_quant."""
    res = _qp._fused_mx_impl(x_codes, x_scales, w_codes, w_scales, x_mx, w_mx, cos, sin, nope_dim, rope_dim, style,
                             layout, batch, rowwise, columnwise, fp8_format, bhsd_scales, return_q)
    return (*(_placeholder(cos, o) for o in res[:4]), _placeholder(cos, res[4], torch.bfloat16))


@fused_q_uproj_rope_quant_mx.register_fake
def _(x_codes, x_scales, w_codes, w_scales, x_mx, w_mx, cos, sin, nope_dim, rope_dim, style, layout, batch,
      fp8_format, bhsd_scales, rowwise=True, columnwise=True, return_q=False):
    from .attention import _parse_spec
    o = _qp._qproj_options(nope_dim, rope_dim, style, layout, batch, "nk", rowwise, columnwise, fp8_format,
                           bhsd_scales)
    tokens, heads = _qp._heads(_parse_spec(x_mx)[3], _parse_spec(w_mx)[3], nope_dim, rope_dim, "nk")
    qshape, data, rs, cs = _qp._qproj_shapes(tokens, heads, o)
    q = cos.new_empty(tuple(qshape) if return_q else (0,), dtype=torch.bfloat16)
    return (*_fake4(cos, (data, rs, cs), rowwise, columnwise), q)


@_op("fused_q_uproj_rope_quant_block", mutates_args=())
def fused_q_uproj_rope_quant_block(x_codes: Tensor, x_scale_inv: Tensor, w_codes: Tensor, w_scale_inv: Tensor,
                                   cos: Tensor, sin: Tensor, nope_dim: int, rope_dim: int, style: str, layout: str,
                                   batch: int, fp8_format: str, bhsd_scales: bool, rowwise: bool = True,
                                   columnwise: bool = True, return_q: bool = False) -> _T5:
    """The block-FP8-weight op: x's E4M3 codes and fp32 scale_inv (1 x 128 blocks), W's (128 x 128
    blocks) -> (rowwise codes, rowwise scales, columnwise codes, columnwise scales, q) as
    fused_q_uproj_rope_quant."""
    res = _qp._fused_block_impl(x_codes, x_scale_inv, w_codes, w_scale_inv, cos, sin, nope_dim, rope_dim, style,
                                layout, batch, rowwise, columnwise, fp8_format, bhsd_scales, return_q)
    return (*(_placeholder(cos, o) for o in res[:4]), _placeholder(cos, res[4], torch.bfloat16))


@fused_q_uproj_rope_quant_block.register_fake
def _(x_codes, x_scale_inv, w_codes, w_scale_inv, cos, sin, nope_dim, rope_dim, style, layout, batch, fp8_format,
      bhsd_scales, rowwise=True, columnwise=True, return_q=False):
    o = _qp._qproj_options(nope_dim, rope_dim, style, layout, batch, "nk", rowwise, columnwise, fp8_format,
                           bhsd_scales)
    tokens, heads = _qp._heads(_ints(x_codes.shape), _ints(w_codes.shape), nope_dim, rope_dim, "nk")
    qshape, data, rs, cs = _qp._qproj_shapes(tokens, heads, o)
    q = cos.new_empty(tuple(qshape) if return_q else (0,), dtype=torch.bfloat16)
    return (*_fake4(cos, (data, rs, cs), rowwise, columnwise), q)


_no_gradient(fused_q_uproj_rope_quant_block, "mxmla.fused_q_uproj_rope_quant", _qp._NOT_DIFF,
             ["x_codes", "x_scale_inv", "w_codes", "w_scale_inv", "cos", "sin"])


@_op("quantize_blockwise", mutates_args=())
def quantize_blockwise(x: Tensor, block_rows: int, pow2_scales: bool, transpose: bool = False) -> Tuple[Tensor, Tensor]:
    """(E4M3 codes as uint8, fp32 scale_inv) of x's 1 x 128 (block_rows 1) or 128 x 128 blocks (of
    xᵀ's with transpose)."""
    return _bf._quantize_blockwise_impl(x, block_rows, pow2_scales, transpose)


@quantize_blockwise.register_fake
def _(x, block_rows, pow2_scales, transpose=False):
    if x.dim() != 2:
        raise ValueError(f"{_bf._OP}: argument 'input': must be 2-D [rows, cols], got shape {list(x.shape)}")
    shape = _ints(x.shape)[::-1] if transpose else _ints(x.shape)
    ss = _core.block_scale_shape(shape[0], shape[1], block_rows)
    return x.new_empty(tuple(shape), dtype=torch.uint8), x.new_empty(tuple(ss), dtype=torch.float32)


_no_gradient(quantize_blockwise, "mxmla.quantize_blockwise", _bf._NOT_DIFF, ["input"])


@_op("quantize_blockwise_both", mutates_args=())
def quantize_blockwise_both(x: Tensor, block_rows: int, pow2_scales: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(codes, scale_inv) of x's blocks and of xᵀ's, one pass over x."""
    return _bf._quantize_blockwise_both_impl(x, block_rows, pow2_scales)


@quantize_blockwise_both.register_fake
def _(x, block_rows, pow2_scales):
    if x.dim() != 2:
        raise ValueError(f"{_bf._OP}: argument 'input': must be 2-D [rows, cols], got shape {list(x.shape)}")
    rows, cols = _ints(x.shape)
    return (x.new_empty((rows, cols), dtype=torch.uint8),
            x.new_empty(tuple(_core.block_scale_shape(rows, cols, block_rows)), dtype=torch.float32),
            x.new_empty((cols, rows), dtype=torch.uint8),
            x.new_empty(tuple(_core.block_scale_shape(cols, rows, block_rows)), dtype=torch.float32))


_no_gradient(quantize_blockwise_both, "mxmla.quantize_blockwise", _bf._NOT_DIFF, ["input"])


# ----------------------------------------------------------------------------- attention
@_op("attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, q_scale: Optional[Tensor], k_scale: Optional[Tensor],
              v_scale: Optional[Tensor], q_mx: str, k_mx: str, v_mx: str, q_format: str, kv_format: str, causal: bool,
              bottom_right: bool, softmax_scale: float, p_format: str, cu_seqlens_q: Optional[Tensor],
              cu_seqlens_kv: Optional[Tensor], max_seqlen_q: int, max_seqlen_kv: int,
              return_lse: bool) -> Tuple[Tensor, Tensor]:
    """(O, LSE; an empty placeholder without return_lse). q, k, v: bf16 tensors, or MXFP8 operands as
    the codes attention reads (q, k rowwise, v columnwise) with their scales (q_scale, ...) and a
    description "<fp8 format>:<scale layout>:<attention layout or ->:<quantized shape>" in q_mx, ...
    ("" for bf16)."""
    o, lse = _attention_impl(q, k, v, q_scale, k_scale, v_scale, (q_mx, k_mx, v_mx), q_format, kv_format, causal,
                             bottom_right, softmax_scale, p_format, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                             max_seqlen_kv, return_lse)
    return o, _placeholder(q, lse, torch.float32)


@attention.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, q_mx, k_mx, v_mx, q_format, kv_format, causal, bottom_right, softmax_scale,
      p_format, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, return_lse):
    o_shape, lse_shape = _out_shapes(_ints(q.shape), q_format, int(v.shape[-1]))
    return (q.new_empty(tuple(o_shape), dtype=torch.bfloat16),
            q.new_empty(tuple(lse_shape) if return_lse else (0,), dtype=torch.float32))


_no_gradient(attention, "mxmla.attention", _ATT_NOT_DIFF, ["q", "k", "v"])


@_op("attention_backward", mutates_args=())
def attention_backward(bufs: List[Optional[Tensor]], do_mx: str, q_mx: str, k_mx: str, v_mx: str, q_format: str,
                       kv_format: str, causal: bool, bottom_right: bool, softmax_scale: float, o: Tensor, lse: Tensor,
                       cu_seqlens_q: Optional[Tensor], cu_seqlens_kv: Optional[Tensor], max_seqlen_q: int,
                       max_seqlen_kv: int, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV). bufs: the four buffers of dout, q, k, v in turn (bf16 data first, or rowwise codes,
    rowwise scales, columnwise codes, columnwise scales; None where absent); *_mx: their descriptions
    as attention's ("" for bf16)."""
    return _attention_backward_impl(bufs, (do_mx, q_mx, k_mx, v_mx), q_format, kv_format, causal, bottom_right,
                                    softmax_scale, o, lse, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                    deterministic)


@attention_backward.register_fake
def _(bufs, do_mx, q_mx, k_mx, v_mx, q_format, kv_format, causal, bottom_right, softmax_scale, o, lse, cu_seqlens_q,
      cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, deterministic):
    return tuple(o.new_empty(tuple(_ints(s)), dtype=torch.bfloat16) for s in _bwd_fake_shapes(bufs))


# ----------------------------------------------------------------------------- GEMM
@_op("gemm", mutates_args=())
def gemm(a: Tensor, b: Tensor, a_scale: Optional[Tensor], b_scale: Optional[Tensor], a_mx: str, b_mx: str,
         trans_a: bool, trans_b: bool, alpha: float, out_dtype: torch.dtype) -> Tensor:
    """D = alpha · op(A) · op(B) as a new [M, N] tensor of out_dtype. a, b: bf16 tensors, or MXFP8 operands as
    the codes the GEMM reads (a: rowwise, or columnwise with trans_a; b: rowwise with trans_b, else
    columnwise) with their scales (a_scale, b_scale) and a description in a_mx, b_mx (as attention's;
    "" for bf16)."""
    name = str(out_dtype).replace("torch.", "")
    return _gemm_impl(a, b, a_scale, b_scale, (a_mx, b_mx), trans_a, trans_b, alpha, False, None, name)


@gemm.register_fake
def _(a, b, a_scale, b_scale, a_mx, b_mx, trans_a, trans_b, alpha, out_dtype):
    shape = _gemm_out_shape(_shape_of(a, a_mx), _shape_of(b, b_mx), trans_a, trans_b)
    return a.new_empty(tuple(shape), dtype=out_dtype)


_no_gradient(gemm, "mxmla.gemm", _GEMM_NOT_DIFF, ["a", "b"])


@_op("gemm_out", mutates_args=("out",))
def gemm_out(a: Tensor, b: Tensor, a_scale: Optional[Tensor], b_scale: Optional[Tensor], a_mx: str, b_mx: str,
             out: Tensor, trans_a: bool, trans_b: bool, accumulate: bool, alpha: float) -> None:
    """D = alpha · op(A) · op(B) written into out (bfloat16 or float32 [M, N]), or added to it with
    accumulate (float32)."""
    _gemm_impl(a, b, a_scale, b_scale, (a_mx, b_mx), trans_a, trans_b, alpha, accumulate, out, "float32")


@gemm_out.register_fake
def _(a, b, a_scale, b_scale, a_mx, b_mx, out, trans_a, trans_b, accumulate, alpha):
    return None


@_op("gemm_blockwise", mutates_args=())
def gemm_blockwise(a: Tensor, a_scale_inv: Tensor, a_block_rows: int, b: Tensor, b_scale_inv: Tensor,
                   b_block_rows: int, trans_a: bool, trans_b: bool, alpha: float, out_dtype: torch.dtype) -> Tensor:
    """The block-FP8 GEMM D = alpha · A · Bᵀ as a new [M, N] tensor of out_dtype: a [M, K], b [N, K]
    E4M3 codes (uint8) with their fp32 scale_inv and block rows (1 or 128)."""
    name = str(out_dtype).replace("torch.", "")
    return _bf._gemm_blockwise_impl(a, a_scale_inv, a_block_rows, b, b_scale_inv, b_block_rows, trans_a, trans_b,
                                    alpha, False, None, name)


@gemm_blockwise.register_fake
def _(a, a_scale_inv, a_block_rows, b, b_scale_inv, b_block_rows, trans_a, trans_b, alpha, out_dtype):
    return a.new_empty((int(a.shape[0]), int(b.shape[0])), dtype=out_dtype)


_no_gradient(gemm_blockwise, "mxmla.gemm", _GEMM_NOT_DIFF, ["a", "a_scale_inv", "a_block_rows", "b", "b_scale_inv"])


@_op("gemm_blockwise_out", mutates_args=("out",))
def gemm_blockwise_out(a: Tensor, a_scale_inv: Tensor, a_block_rows: int, b: Tensor, b_scale_inv: Tensor,
                       b_block_rows: int, out: Tensor, trans_a: bool, trans_b: bool, accumulate: bool,
                       alpha: float) -> None:
    """The block-FP8 GEMM written into out (bfloat16 or float32 [M, N]), or added to it with accumulate."""
    _bf._gemm_blockwise_impl(a, a_scale_inv, a_block_rows, b, b_scale_inv, b_block_rows, trans_a, trans_b, alpha,
                             accumulate, out, "float32")


@gemm_blockwise_out.register_fake
def _(a, a_scale_inv, a_block_rows, b, b_scale_inv, b_block_rows, out, trans_a, trans_b, accumulate, alpha):
    return None


# ----------------------------------------------------------------------------- the MXFP8 Linear
@_op("linear_forward", mutates_args=())
def linear_forward(x: Tensor, w: Tensor, w_scale: Tensor, w_mx: str) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, x_saved's columnwise codes, its compact scales): the fprop GEMM of an MXFP8 Linear with x's
    quantization fused in; w, w_scale: W's rowwise codes and scales, w_mx their description."""
    return _linear_forward_impl(x, w, w_scale, w_mx)


@linear_forward.register_fake
def _(x, w, w_scale, w_mx):
    T, K = _ints(x.shape)
    cs, ss = _x_saved_shapes(T, K)
    return (x.new_empty((T, _shape_of(w, w_mx)[0]), dtype=torch.bfloat16), x.new_empty(tuple(cs), dtype=torch.uint8),
            x.new_empty(tuple(ss), dtype=torch.uint8))


_no_gradient(linear_forward, "mxmla.linear_forward", _LIN_NOT_DIFF, ["x", "w"])


@_op("linear_backward", mutates_args=())
def linear_backward(dy: Tensor, w: Tensor, w_scale: Tensor, w_mx: str, x: Tensor, x_scale: Tensor, x_mx: str,
                    need_dx: bool, dy2: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(dx, dw fp32): the dgrad and wgrad GEMMs of an MXFP8 Linear with dy's quantization fused in; w,
    x: the columnwise codes and scales of W and x_saved. Without need_dx, dx is an empty placeholder.
    dy2: dy is torch.cat([dy, dy2], -1).flatten(-2) (3-D parts), read in place."""
    dx, dw = _linear_backward_impl(dy, w, w_scale, w_mx, x, x_scale, x_mx, need_dx, None, False, dy2)
    return _placeholder(dy, dx, torch.bfloat16), dw


@linear_backward.register_fake
def _(dy, w, w_scale, w_mx, x, x_scale, x_mx, need_dx, dy2):
    N, K = _shape_of(w, w_mx)
    dx = dy.new_empty((int(dy.shape[0]), K) if need_dx else (0,), dtype=torch.bfloat16)
    return dx, dy.new_empty((N, K), dtype=torch.float32)


_no_gradient(linear_backward, "mxmla.linear_backward", _LIN_NOT_DIFF, ["dy", "w"])


@_op("linear_backward_acc", mutates_args=("main_grad",))
def linear_backward_acc(dy: Tensor, w: Tensor, w_scale: Tensor, w_mx: str, x: Tensor, x_scale: Tensor, x_mx: str,
                        main_grad: Tensor, need_dx: bool, dy2: Optional[Tensor]) -> Tensor:
    """dx; the wgrad added into main_grad (fp32 [N, K]). dy2 as for linear_backward."""
    dx, _ = _linear_backward_impl(dy, w, w_scale, w_mx, x, x_scale, x_mx, need_dx, main_grad, True, dy2)
    return _placeholder(dy, dx, torch.bfloat16)


@linear_backward_acc.register_fake
def _(dy, w, w_scale, w_mx, x, x_scale, x_mx, main_grad, need_dx, dy2):
    K = _shape_of(w, w_mx)[1]
    return dy.new_empty((int(dy.shape[0]), K) if need_dx else (0,), dtype=torch.bfloat16)


@_op("rope_linear_backward", mutates_args=())
def rope_linear_backward(dq: Tensor, cos: Tensor, sin: Tensor, style: str, layout: str, rope_dim: int,
                         cu_seqlens: Optional[Tensor], tables_per_token: bool, w: Tensor, w_scale: Tensor, w_mx: str,
                         x: Tensor, x_scale: Tensor, x_mx: str, need_dx: bool) -> Tuple[Tensor, Tensor]:
    """(dx, dw fp32): linear_backward's GEMMs with dy the RoPE backward of dq, quantized (E4M3); w, x:
    the columnwise codes and scales of W and x_saved. Without need_dx, dx is an empty placeholder."""
    dx, dw = _rope_linear_backward_impl(dq, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, w,
                                        w_scale, w_mx, x, x_scale, x_mx, need_dx, None, False)
    return _placeholder(dq, dx, torch.bfloat16), dw


def _rope_tokens(dq: Tensor) -> int:
    return math.prod(_ints(dq.shape)[:-2])


@rope_linear_backward.register_fake
def _(dq, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, w, w_scale, w_mx, x, x_scale, x_mx,
      need_dx):
    N, K = _shape_of(w, w_mx)
    dx = dq.new_empty((_rope_tokens(dq), K) if need_dx else (0,), dtype=torch.bfloat16)
    return dx, dq.new_empty((N, K), dtype=torch.float32)


_no_gradient(rope_linear_backward, "mxmla.rope_linear_backward", _LIN_NOT_DIFF, ["dq", "cos", "sin", "style", "layout",
                                                                                "rope_dim", "cu_seqlens",
                                                                                "tables_per_token", "w"])


@_op("rope_linear_backward_acc", mutates_args=("main_grad",))
def rope_linear_backward_acc(dq: Tensor, cos: Tensor, sin: Tensor, style: str, layout: str, rope_dim: int,
                             cu_seqlens: Optional[Tensor], tables_per_token: bool, w: Tensor, w_scale: Tensor,
                             w_mx: str, x: Tensor, x_scale: Tensor, x_mx: str, main_grad: Tensor,
                             need_dx: bool) -> Tensor:
    """dx; the wgrad added into main_grad (fp32 [N, K])."""
    dx, _ = _rope_linear_backward_impl(dq, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, w,
                                       w_scale, w_mx, x, x_scale, x_mx, need_dx, main_grad, True)
    return _placeholder(dq, dx, torch.bfloat16)


@rope_linear_backward_acc.register_fake
def _(dq, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, w, w_scale, w_mx, x, x_scale, x_mx,
      main_grad, need_dx):
    K = _shape_of(w, w_mx)[1]
    return dq.new_empty((_rope_tokens(dq), K) if need_dx else (0,), dtype=torch.bfloat16)
