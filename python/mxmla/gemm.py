"""The MXFP8 GEMM (SPEC §6): D = alpha · op(A) · op(B) (+ D), the three GEMMs of an MXFP8 Linear.

``gemm(a, b)`` reads each MXFP8 operand through the copy quantized along the contraction (A's
rowwise copy, or its columnwise copy with ``trans_a``; B's rowwise copy with ``trans_b``, the
default, or its columnwise copy), dequantizes it exactly and multiplies. numpy arrays run the CPU
reference (float64 sums, rounded once), torch tensors the reference too on the CPU, through the
custom ops ``torch.ops.mxmla.gemm`` / ``gemm_out``; CUDA tensors run the SM90 kernels (the README's
"MXFP8 GEMM" section: each operand dequantized once to bf16, then a bf16 tensor-core GEMM with fp32
sums; operands with scales bf16 cannot hold exactly take an FP8 tensor-core kernel instead).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _dispatch
from . import _mxmla_core as _core
from ._backend import Backend, is_ml_bf16, is_torch, kind_of, torch, type_name
from ._checks import FP8_FORMAT, QKV_LAYOUT, SCALE_LAYOUT, flag, grad_needed, not_differentiable, real, same_kind
from .attention import _core_operand, _mx_spec, _parse_spec
from .blockfp8 import BlockFP8Tensor, _codes, _gemm_blockwise_impl
from .mxfp8 import MXFP8Tensor, _dtype_name, _options, _parts

if TYPE_CHECKING:
    import torch as _torch_t

    Array = Union[_torch_t.Tensor, np.ndarray]
    Operand = Union[_torch_t.Tensor, np.ndarray, MXFP8Tensor]
    DTypeLike = Union[str, _torch_t.dtype, np.dtype, type]
else:
    Array = Any
    Operand = Any
    DTypeLike = Any

_OP = "mxmla.gemm"
_NOT_DIFF = "the GEMMs of a Linear's backward are gemm calls themselves: dgrad gemm(dy, W, trans_b=False), " \
            "wgrad gemm(dy, x, trans_a=True, trans_b=False)"


def _shape_of(data: Any, spec: str) -> List[int]:
    """The stored [rows, cols] of an operand: an MXFP8 operand's quantized shape (its spec), else the array's."""
    if spec:
        return _parse_spec(spec)[3]
    return [] if data is None else [int(d) for d in data.shape]


def _out_shape(a_shape: Sequence[int], b_shape: Sequence[int], trans_a: bool, trans_b: bool) -> List[int]:
    """[M, N]: M from a ([M, K], or [K, M] with trans_a), N from b ([N, K] with trans_b, or [K, N]). A
    shape that is not 2-D gives 0 here; the core then names it."""
    m = (int(a_shape[1]) if trans_a else int(a_shape[0])) if len(a_shape) == 2 else 0
    n = (int(b_shape[0]) if trans_b else int(b_shape[1])) if len(b_shape) == 2 else 0
    return [m, n]


def _operand(op: str, name: str, t: Any, rowwise: bool) -> Tuple[Any, Any, str]:
    """(data, scale, spec): a bf16 array as it is (scale None, spec ""); an MXFP8Tensor as the codes and
    scales of the copy the GEMM reads (None when the tensor lacks it: the core then says which copy the
    direction needs and why) and its description (attention._mx_spec)."""
    if not isinstance(t, MXFP8Tensor):
        kind_of(op, name, t)
        return t, None, ""
    d = "rowwise" if rowwise else "columnwise"
    data, scale = getattr(t, f"{d}_data"), getattr(t, f"{d}_scale_inv")
    if data is not None:
        kind_of(op, f"{name}.{d}_data", data)
        if scale is not None and is_torch(scale) != is_torch(data):
            raise TypeError(f"{op}: argument '{name}.{d}_scale_inv': expected a "
                            f"{'torch.Tensor' if is_torch(data) else 'numpy.ndarray'} like its codes, got "
                            f"{type_name(scale)}")
    return data, scale, _mx_spec(t)


def _array_dtype(t: Any) -> Optional[str]:
    """'bfloat16' / 'float32' for an out array of those dtypes (numpy uint16: bf16 bits), else None."""
    if is_torch(t):
        return {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(t.dtype)
    if t.dtype == np.uint16 or t.dtype.name == "bfloat16":
        return "bfloat16"
    return "float32" if t.dtype == np.float32 else None


def _gemm_impl(a: Any, b: Any, a_scale: Any, b_scale: Any, specs: Sequence[str], trans_a: bool, trans_b: bool,
               alpha: float, accumulate: bool, out: Any, out_dtype: str, ml_bf16: bool = False) -> Any:
    """Allocates D (unless `out` is given) and calls the compiled core. a, b: bf16 arrays, or the codes
    the GEMM reads (None when absent) with their scales and specs ("" for bf16)."""
    op = _OP
    like = next((t for t in (a, b, out) if t is not None), None)
    be = Backend(op, "a", like if like is not None else np.empty(0, np.uint8), ml_bf16=ml_bf16)
    if out is None:
        out = be.empty(_out_shape(_shape_of(a, specs[0]), _shape_of(b, specs[1]), trans_a, trans_b), out_dtype)
    operands = [_core_operand(be, op, "a", a, a_scale, specs[0], not trans_a),
                _core_operand(be, op, "b", b, b_scale, specs[1], trans_b)]
    opts = _options(_core.GemmOptions, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, alpha=float(alpha))
    _core.gemm(*operands, be.desc("out", out, bf16=True), opts, be.stream())
    return out


def gemm(a: Operand, b: Operand, *, trans_a: bool = False, trans_b: bool = True, out: Optional[Array] = None,
         out_dtype: Optional[DTypeLike] = None, accumulate: bool = False, alpha: float = 1.0) -> Array:
    """D = alpha · op(A) · op(B), or D += alpha · op(A) · op(B) with accumulate (SPEC §6).

    op(A) = A ([M, K]), or Aᵀ with trans_a (A given as [K, M]); op(B) = Bᵀ with trans_b, the default
    (B given as [N, K], like a Linear's weight), or B (given as [K, N]). The three GEMMs of a Linear
    y = x·Wᵀ (x [T, K], W [N, K], each quantized rowwise and columnwise):

    - fprop  y  = x · Wᵀ   ``gemm(x8, w8)``                                 x rowwise, W rowwise
    - dgrad  dx = dy · W   ``gemm(dy8, w8, trans_b=False)``                 dy rowwise, W columnwise
    - wgrad  dW = dyᵀ · x  ``gemm(dy8, x8, trans_a=True, trans_b=False)``  dy columnwise, x columnwise

    Operands: two MXFP8Tensors from ``quantize`` of a 2-D tensor (one fp8 format; compact or swizzled
    scales), each holding the copy quantized along the contraction (a rowwise copy needs the
    contraction length to be a multiple of 32; a columnwise copy takes any, its last block a tail
    block), or two bf16 2-D arrays (torch.bfloat16; numpy ml_dtypes.bfloat16 or uint16 bits), last
    dim contiguous. MXFP8 values are dequantized exactly (code · 2^(e−127)); the CPU reference sums
    the products in float64 and rounds once (the GPU kernel, to come, accumulates in fp32).

    out: None allocates D [M, N] of ``out_dtype`` ("bfloat16", the default, or "float32"; a string,
    torch dtype, numpy dtype or ml_dtypes.bfloat16); given, D is written into it (bfloat16 or float32
    [M, N], any row stride, last dim contiguous) and it is returned. accumulate adds into ``out``,
    which must then be float32 (a main_grad). alpha: a finite number.

    Block-FP8 operands (``BlockFP8Tensor``, the DeepSeek-V3 recipe): A [M, K] and B [N, K], both
    K-major (trans_a False, trans_b True; ``quantize_blockwise(..., transpose=True)`` makes dgrad's
    Wᵀ and wgrad's dyᵀ and xᵀ), 1 x 128 or 128 x 128 blocks each: D = alpha · Σ over 128-wide blocks
    of K of the block's sum of code products times both blocks' scale_inv. CUDA: FP8 tensor cores
    with fp32 sums across blocks; the CPU reference in float64.

    numpy runs the CPU reference (bf16 results as ml_dtypes.bfloat16 for ml_dtypes operands or
    out_dtype=ml_dtypes.bfloat16, else uint16 bits); torch CPU tensors the reference through
    ``torch.ops.mxmla.gemm`` / ``gemm_out`` (traceable by torch.compile; block-FP8:
    ``gemm_blockwise`` / ``gemm_blockwise_out``); torch CUDA tensors the SM90 kernels through the
    same ops. Not differentiable: an input that requires grad (grad mode on) is an error."""
    op = _OP
    trans_a, trans_b = flag(op, "trans_a", trans_a), flag(op, "trans_b", trans_b)
    accumulate = flag(op, "accumulate", accumulate)
    alpha = real(op, "alpha", alpha)
    block = isinstance(a, BlockFP8Tensor) or isinstance(b, BlockFP8Tensor)
    if block:
        for n, t in (("a", a), ("b", b)):
            if not isinstance(t, BlockFP8Tensor):
                raise TypeError(f"{op}: argument '{n}': expected a BlockFP8Tensor like the other operand (both "
                                f"block-FP8), got {type_name(t)}")
            kind_of(op, f"{n}.data", t.data)
        ad, asc, aspec, bd, bsc, bspec = _codes(a.data), a.scale_inv, "", _codes(b.data), b.scale_inv, ""
    else:
        ad, asc, aspec = _operand(op, "a", a, not trans_a)
        bd, bsc, bspec = _operand(op, "b", b, trans_b)
    ml_bf16 = is_ml_bf16(a) and not aspec
    if out_dtype is not None:
        name, ml_req = _dtype_name(op, out_dtype, "out_dtype")
        ml_bf16 = ml_bf16 or ml_req
    else:
        name = None
    if out is not None:
        kind_of(op, "out", out)
        have = _array_dtype(out)
        if name is not None and have is not None and have != name:
            raise ValueError(f"{op}: argument 'out_dtype': {name} does not match out's dtype {have} (D is written in "
                             "out's dtype; leave out_dtype None)")
    elif accumulate:
        raise ValueError(f"{op}: argument 'accumulate': adds into out (D += alpha · op(A) · op(B)): pass out, a "
                         "float32 [M, N] array")
    name = name or "bfloat16"
    arrays = [(n, t) for n, t in (("a", ad), ("b", bd), ("out", out)) if t is not None]
    for n, t in arrays[1:]:
        if is_torch(t) != is_torch(arrays[0][1]):
            raise TypeError(f"{op}: argument '{n}': expected a {'torch.Tensor' if is_torch(arrays[0][1]) else 'numpy.ndarray'}"
                            f" like argument '{arrays[0][0]}', got {type_name(t)}")
    if block:
        brs = (int(a.block_rows), int(b.block_rows))
        if is_torch(ad):
            not_differentiable(op, _NOT_DIFF, a=ad, b=bd)
            if out is not None and grad_needed(out):
                raise RuntimeError(f"{op}: argument 'out': requires grad, but gemm writes into it without a gradient; "
                                   "pass a tensor that does not require grad")
            if out is None:
                return _dispatch.call("gemm_blockwise", ad, asc, brs[0], bd, bsc, brs[1], trans_a, trans_b, alpha,
                                      getattr(torch, name))
            _dispatch.call("gemm_blockwise_out", ad, asc, brs[0], bd, bsc, brs[1], out, trans_a, trans_b, accumulate,
                           alpha)
            return out
        return _gemm_blockwise_impl(ad, asc, brs[0], bd, bsc, brs[1], trans_a, trans_b, alpha, accumulate, out, name)
    if arrays and is_torch(arrays[0][1]):
        not_differentiable(op, _NOT_DIFF, a=ad, b=bd)
        if out is not None and grad_needed(out):
            raise RuntimeError(f"{op}: argument 'out': requires grad, but gemm writes into it without a gradient; "
                               "pass a tensor that does not require grad")
        if ad is None or bd is None:  # a missing copy: the core names it (nothing is traced or written)
            return _gemm_impl(ad, bd, asc, bsc, (aspec, bspec), trans_a, trans_b, alpha, accumulate, out, name)
        if out is None:
            return _dispatch.call("gemm", ad, bd, asc, bsc, aspec, bspec, trans_a, trans_b, alpha, getattr(torch, name))
        _dispatch.call("gemm_out", ad, bd, asc, bsc, aspec, bspec, out, trans_a, trans_b, accumulate, alpha)
        return out
    return _gemm_impl(ad, bd, asc, bsc, (aspec, bspec), trans_a, trans_b, alpha, accumulate, out, name, ml_bf16)


# ----------------------------------------------------------------------------- the MXFP8 Linear
_LIN_NOT_DIFF = "linear_forward and linear_backward are the forward and the backward of an MXFP8 Linear " \
                "(mxmla.nn.MXFP8LinearFunction)"


def _x_saved_shapes(T: int, K: int) -> Tuple[List[int], List[int]]:
    """x_saved's columnwise codes and compact scales: [T, K], [ceil(T / 32), K]."""
    return [int(T), int(K)], [(int(T) + 31) // 32, int(K)]


def _linear_forward_impl(x: Any, w: Any, w_scale: Any, w_spec: str) -> Tuple[Any, Any, Any]:
    """(y, x_saved's columnwise codes, its scales), allocated here; w: W's rowwise codes and scales."""
    op = "mxmla.linear_forward"
    be = Backend(op, "x", x)
    xd = be.desc("x", x, bf16=True)
    T, K = (int(d) for d in x.shape) if len(x.shape) == 2 else (0, 0)
    N = _shape_of(w, w_spec)[0] if w_spec else 0
    y = be.empty([T, N], "bfloat16")
    cs, ss = _x_saved_shapes(T, K)
    xc, xs = be.empty(cs, "uint8"), be.empty(ss, "uint8")
    wo = _core_operand(be, op, "w", w, w_scale, w_spec, True)
    saved = (None, None, be.desc("x_saved.columnwise_data", xc), be.desc("x_saved.columnwise_scale_inv", xs),
             [T, K], FP8_FORMAT.parse(op, "fp8_format", "e4m3"), SCALE_LAYOUT.parse(op, "scale_layout", "compact"),
             QKV_LAYOUT.parse(op, "layout", "sbhd"), False)
    _core.linear_forward(xd, wo, be.desc("y", y, bf16=True), saved, be.stream())
    return y, xc, xs


def _backward_buffers(be: Backend, op: str, T: int, need_dx: bool, dw: Any, w: Any, w_scale: Any, w_spec: str,
                      xc: Any, xs: Any, x_spec: str) -> tuple:
    """A Linear's backward over T tokens: (dx [T, K] bf16 or None, dw: the given one or a new fp32
    [N, K], W's and x_saved's core operands)."""
    N, K = (_shape_of(w, w_spec) + [0, 0])[:2] if w_spec else (0, 0)
    dx = be.empty([T, K], "bfloat16") if need_dx else None
    if dw is None:
        dw = be.empty([N, K], "float32")
    wo = _core_operand(be, op, "w", w, w_scale, w_spec, False)
    xo = _core_operand(be, op, "x_saved", xc, xs, x_spec, False)
    return dx, dw, wo, xo


def _linear_backward_impl(dy: Any, w: Any, w_scale: Any, w_spec: str, xc: Any, xs: Any, x_spec: str, need_dx: bool,
                          dw: Any, accumulate: bool, dy2: Any = None) -> Tuple[Any, Any]:
    """(dx or None, dw); dw: None allocates an fp32 [N, K], else it is written (or added to). dy2: dy
    is torch.cat([dy, dy2], -1).flatten(-2), read in place."""
    op = "mxmla.linear_backward"
    be = Backend(op, "dy", dy)
    dyd = be.desc("dy" if dy2 is None else "dy[0]", dy, bf16=True)
    dy2d = None if dy2 is None else be.desc("dy[1]", dy2, bf16=True)
    T = int(dy.shape[0]) if len(dy.shape) == (2 if dy2 is None else 3) else 0
    dx, dw, wo, xo = _backward_buffers(be, op, T, need_dx, dw, w, w_scale, w_spec, xc, xs, x_spec)
    _core.linear_backward(dyd, wo, xo, None if dx is None else be.desc("dx", dx, bf16=True),
                          be.desc("dw", dw, bf16=True), accumulate, be.stream(), dy2d)
    return dx, dw


def _linear_w(op: str, name: str, w: Any, rowwise: bool) -> Tuple[Any, Any, str]:
    if not isinstance(w, MXFP8Tensor):
        raise TypeError(f"{op}: argument '{name}': expected an MXFP8Tensor (mxmla.quantize of the weight), got "
                        f"{type_name(w)}")
    return _operand(op, name, w, rowwise)


def linear_forward(x: Array, w: MXFP8Tensor) -> Tuple[Array, MXFP8Tensor]:
    """The forward GEMM of an MXFP8 Linear with x's quantization fused in: ``(y, x_saved)`` where
    y = ``gemm(quantize(x), w)`` (bf16 [T, N]) and x_saved is x's columnwise MXFP8 copy (E4M3,
    compact scales; the rowwise copy absent), what the backward's wgrad reads — the same bits as
    ``quantize`` + ``gemm``. x: bf16 [T, K] (last dim contiguous, K a multiple of 32); w: W [N, K]
    from ``quantize`` (E4M3) with its rowwise copy. On CUDA one pass over x writes the bf16 values
    of its rowwise copy that the GEMM reads (and x_saved), instead of codes the GEMM dequantizes in
    a pass of its own. torch tensors go through ``torch.ops.mxmla.linear_forward``; numpy and CPU
    tensors run the reference. Not differentiable (it is the forward of ``mxmla.nn``'s MXFP8 Linear)."""
    op = "mxmla.linear_forward"
    kind_of(op, "x", x)
    wd, wsc, wspec = _linear_w(op, "w", w, True)
    if is_torch(x):
        not_differentiable(op, _LIN_NOT_DIFF, x=x, w=wd)
        if wd is None:
            y, xc, xs = _linear_forward_impl(x, wd, wsc, wspec)
        else:
            y, xc, xs = _dispatch.call("linear_forward", x, wd, wsc, wspec)
    else:
        y, xc, xs = _linear_forward_impl(x, wd, wsc, wspec)
    return y, MXFP8Tensor(tuple(int(d) for d in x.shape), "e4m3", "compact", None, None, xc, xs)


def linear_backward(dy: Array, w: MXFP8Tensor, x_saved: MXFP8Tensor, *, need_dx: bool = True,
                    main_grad: Optional[Array] = None) -> Tuple[Optional[Array], Optional[Array]]:
    """The backward GEMMs of an MXFP8 Linear with dy's quantization fused in: ``(dx, dw)`` with
    dx = ``gemm(quantize(dy), w, trans_b=False)`` (bf16 [T, K]; None without need_dx) and
    dw = ``gemm(quantize(dy), x_saved, trans_a=True, trans_b=False)`` (fp32 [N, K]) — the same bits
    as ``quantize`` + ``gemm``. dy: bf16 [T, N] (N a multiple of 32); w: W [N, K] with its columnwise
    copy; x_saved: from ``linear_forward`` (or x quantized with a columnwise copy, E4M3). main_grad:
    an fp32 [N, K] buffer the wgrad is added into (Megatron's); dw is then None. On CUDA one pass over
    dy writes the bf16 values of both its copies, as the GEMMs read them.

    dy may also be a pair (dy0, dy1) of bf16 [T, h, d0] and [T, h, d1] tensors (any strides, last dim
    contiguous, d0 a multiple of 8): dy is then torch.cat([dy0, dy1], -1).flatten(-2) ([T, h·(d0 + d1)]),
    read in place — e.g. an MLA kv_b projection's gradient from attention's dK[..., :nope_dim] and dV."""
    op = "mxmla.linear_backward"
    dy, dy2 = _parts(op, "dy", dy)
    kind_of(op, "dy" if dy2 is None else "dy[0]", dy)
    if dy2 is not None:
        same_kind(op, "dy[0]", dy, **{"dy[1]": dy2})
    need_dx = flag(op, "need_dx", need_dx)
    wd, wsc, wspec = _linear_w(op, "w", w, False)
    xd, xsc, xspec = _linear_w(op, "x_saved", x_saved, False)
    if main_grad is not None:
        kind_of(op, "main_grad", main_grad)
    if is_torch(dy):
        not_differentiable(op, _LIN_NOT_DIFF, **{"dy" if dy2 is None else "dy[0]": dy, "dy[1]": dy2}, w=wd, x_saved=xd)
        if main_grad is not None and grad_needed(main_grad):
            raise RuntimeError(f"{op}: argument 'main_grad': requires grad, but linear_backward adds into it "
                               "without a gradient")
        if wd is None or xd is None:  # a missing copy: the core names it
            dx, dw = _linear_backward_impl(dy, wd, wsc, wspec, xd, xsc, xspec, need_dx, main_grad,
                                           main_grad is not None, dy2)
        elif main_grad is None:
            dx, dw = _dispatch.call("linear_backward", dy, wd, wsc, wspec, xd, xsc, xspec, need_dx, dy2)
        else:
            dx = _dispatch.call("linear_backward_acc", dy, wd, wsc, wspec, xd, xsc, xspec, main_grad, need_dx, dy2)
            dw = main_grad
    else:
        dx, dw = _linear_backward_impl(dy, wd, wsc, wspec, xd, xsc, xspec, need_dx, main_grad, main_grad is not None,
                                       dy2)
    if not need_dx:
        dx = None
    return dx, (None if main_grad is not None else dw)


# ----------------------------------------------------------------------------- RoPE + the Linear's backward
def _rope_linear_backward_impl(dq: Any, cos: Any, sin: Any, style: str, layout: str, rope_dim: int, cu_seqlens: Any,
                               tables_per_token: bool, w: Any, w_scale: Any, w_spec: str, xc: Any, xs: Any,
                               x_spec: str, need_dx: bool, dw: Any, accumulate: bool) -> Tuple[Any, Any]:
    """(dx or None, dw) of rope_linear_backward; dw: None allocates an fp32 [N, K], else it is written
    (or added to)."""
    from .rope import _cu_desc, _rope_options

    op = _ROPE_LIN_OP
    be = Backend(op, "dq", dq)
    dd = be.desc("dq", dq, bf16=True)
    shape = dd[2]
    T = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) >= 3 else 0
    dx, dw, wo, xo = _backward_buffers(be, op, T, need_dx, dw, w, w_scale, w_spec, xc, xs, x_spec)
    cu, _cu_owner = _cu_desc(be, cu_seqlens)
    _core.rope_linear_backward(dd, be.desc("cos", cos, bf16=True), be.desc("sin", sin, bf16=True),
                               _rope_options(op, style, layout, rope_dim, tables_per_token), cu, wo, xo,
                               None if dx is None else be.desc("dx", dx, bf16=True), be.desc("dw", dw, bf16=True),
                               accumulate, be.stream())
    return dx, dw


_ROPE_LIN_OP = "mxmla.rope_linear_backward"


def rope_linear_backward(dq: Array, cos: Array, sin: Array, w: MXFP8Tensor, x_saved: MXFP8Tensor, *,
                         style: str = "interleaved_in_halves_out", layout: str = "sbhd", rope_dim: int = 64,
                         cu_seqlens: Any = None, tables_per_token: bool = False, need_dx: bool = True,
                         main_grad: Optional[Array] = None) -> Tuple[Optional[Array], Optional[Array]]:
    """The backward GEMMs of a Linear whose output went through RoPE — the fused Q up-projection's,
    from attention's dQ: ``(dx, dw)`` = ``linear_backward``'s with dy = ``rope_backward_quantize(dq,
    cos, sin, style=, layout=, rope_dim=, cu_seqlens=, tables_per_token=)`` (E4M3, both copies; dy
    [T, h·d], T = dq's tokens in their memory order), the same bits as that composition:
    dx = ``gemm(dy, w, trans_b=False)`` (bf16 [T, K]; None without need_dx), dw = ``gemm(dy, x_saved,
    trans_a=True, trans_b=False)`` (fp32 [N, K], N = h·d), or added into main_grad (fp32 [N, K];
    dw is then None). dq: [s,b,h,d], [b,s,h,d] or [t,h,d] as ``rope_backward_quantize`` takes it;
    w: W [N, K] (E4M3) with its columnwise copy; x_saved: x [T, K] with its columnwise copy (E4M3).
    On CUDA, for bf16 DeepSeek-V3 query heads (d 192, rope_dim 64) at one token stride, the RoPE
    pass writes the bf16 values the GEMMs read instead of codes they would dequantize in passes of
    their own. numpy and CPU tensors run the reference. Not differentiable."""
    from .rope import _rope_args

    op = _ROPE_LIN_OP
    torch_kind, style, layout, rope_dim, cu, per_token = _rope_args(op, dq, cos, sin, style, layout, rope_dim,
                                                                    cu_seqlens, tables_per_token, "dq")
    need_dx = flag(op, "need_dx", need_dx)
    wd, wsc, wspec = _linear_w(op, "w", w, False)
    xd, xsc, xspec = _linear_w(op, "x_saved", x_saved, False)
    if main_grad is not None:
        kind_of(op, "main_grad", main_grad)
    if torch_kind:
        not_differentiable(op, _LIN_NOT_DIFF, dq=dq, cos=cos, sin=sin, w=wd, x_saved=xd)
        if main_grad is not None and grad_needed(main_grad):
            raise RuntimeError(f"{op}: argument 'main_grad': requires grad, but rope_linear_backward adds into it "
                               "without a gradient")
        if wd is None or xd is None:  # a missing copy: the core names it
            dx, dw = _rope_linear_backward_impl(dq, cos, sin, style, layout, rope_dim, cu, per_token, wd, wsc, wspec,
                                                xd, xsc, xspec, need_dx, main_grad, main_grad is not None)
        elif main_grad is None:
            dx, dw = _dispatch.call("rope_linear_backward", dq, cos, sin, style, layout, rope_dim, cu, per_token, wd,
                                    wsc, wspec, xd, xsc, xspec, need_dx)
        else:
            dx = _dispatch.call("rope_linear_backward_acc", dq, cos, sin, style, layout, rope_dim, cu, per_token, wd,
                                wsc, wspec, xd, xsc, xspec, main_grad, need_dx)
            dw = main_grad
    else:
        dx, dw = _rope_linear_backward_impl(dq, cos, sin, style, layout, rope_dim, cu, per_token, wd, wsc, wspec, xd,
                                            xsc, xspec, need_dx, main_grad, main_grad is not None)
    if not need_dx:
        dx = None
    return dx, (None if main_grad is not None else dw)
