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
from ._checks import flag, grad_needed, not_differentiable, real
from .attention import _core_operand, _mx_spec, _parse_spec
from .mxfp8 import MXFP8Tensor, _dtype_name, _options

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

    numpy runs the CPU reference (bf16 results as ml_dtypes.bfloat16 for ml_dtypes operands or
    out_dtype=ml_dtypes.bfloat16, else uint16 bits); torch CPU tensors the reference through
    ``torch.ops.mxmla.gemm`` / ``gemm_out`` (traceable by torch.compile); torch CUDA tensors the
    SM90 kernels through the same ops. Not differentiable: an input that requires grad (grad mode on) is an error."""
    op = _OP
    trans_a, trans_b = flag(op, "trans_a", trans_a), flag(op, "trans_b", trans_b)
    accumulate = flag(op, "accumulate", accumulate)
    alpha = real(op, "alpha", alpha)
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
