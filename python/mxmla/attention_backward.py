"""The attention backward (SPEC §5): dQ, dK, dV in bf16 from dO and the forward's inputs, O and LSE.

numpy inputs and CPU torch tensors run the CPU reference (float64); torch tensors go through the
custom op ``torch.ops.mxmla.attention_backward`` (a fake implementation for torch.compile). The CUDA
kernel is not written yet: CUDA tensors raise an error saying so.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _dispatch
from . import _mxmla_core as _core
from ._backend import Backend, is_torch, kind_of, torch, type_name
from ._checks import FP8_FORMAT, QKV_LAYOUT, SCALE_LAYOUT, flag
from .attention import (ATTN_FORMAT, _check_bf16, _layout_arg, _mx_spec, _operand_kind, _parse_spec,
                        _scale_and_sequences)
from .mxfp8 import MXFP8Tensor, _options

_OP = "mxmla.attention_backward"
Array = Any


def _parts(t: Any) -> List[Any]:
    """An operand's four buffers (rowwise codes, rowwise scales, columnwise codes, columnwise scales);
    a bf16 array is its first, the rest None."""
    if isinstance(t, MXFP8Tensor):
        return [t.rowwise_data, t.rowwise_scale_inv, t.columnwise_data, t.columnwise_scale_inv]
    return [t, None, None, None]


def _core_operand(be: Backend, op: str, name: str, parts: Sequence[Any], spec: str) -> Any:
    """A bf16 descriptor (spec ""), or the MXFP8 tuple with every copy the tensor holds (the core
    picks the copy each GEMM reads)."""
    if not spec:
        return be.desc(name, parts[0], bf16=True)
    fmt, sl, lay, shape = _parse_spec(spec)
    descs = []
    for direction, data, scale in (("rowwise", parts[0], parts[1]), ("columnwise", parts[2], parts[3])):
        descs.append(None if data is None else be.desc(f"{name}.{direction}_data", data))
        descs.append(None if scale is None else be.desc(f"{name}.{direction}_scale_inv", scale,
                                                        allowed="uint8 or float8_e8m0fnu scale bytes"))
    return (*descs, shape, FP8_FORMAT.parse(op, f"{name}.fp8_format", fmt),
            SCALE_LAYOUT.parse(op, f"{name}.scale_layout", sl),
            QKV_LAYOUT.parse(op, f"{name}.layout", lay or "sbhd"), lay is not None)


def _shape_of(parts: Sequence[Any]) -> List[int]:
    """The operand's shape in its format: the bf16 data's, else its codes' (either copy)."""
    for x in (parts[0], parts[2]):
        if x is not None:
            return [int(d) for d in x.shape]
    return []


def _first(parts: Sequence[Any]) -> Any:
    return next(x for x in parts if x is not None)


def _attention_backward_impl(bufs: Sequence[Any], specs: Sequence[str], q_fmt: str, kv_fmt: str, causal: bool,
                             bottom_right: bool, softmax_scale: float, o: Any, lse: Any, cu_q: Any, cu_kv: Any,
                             max_seqlen_q: int, max_seqlen_kv: int, deterministic: bool,
                             ml_bf16: bool = False) -> Tuple[Any, Any, Any]:
    """Allocates dQ, dK, dV and calls the compiled core. bufs: 16 entries, the four buffers of dout,
    q, k, v in turn (_parts); specs: their _mx_spec ("" for bf16)."""
    op = _OP
    groups = [list(bufs[4 * i:4 * i + 4]) for i in range(4)]
    be = Backend(op, "q", _first(groups[1]), ml_bf16=ml_bf16)
    dq = be.empty(_shape_of(groups[1]), "bfloat16")
    dk = be.empty(_shape_of(groups[2]), "bfloat16")
    dv = be.empty(_shape_of(groups[3]), "bfloat16")
    operands = [_core_operand(be, op, name, g, spec) for name, g, spec in zip(("dout", "q", "k", "v"), groups, specs)]
    opts = _options(_core.AttentionOptions, q_format=ATTN_FORMAT.parse(op, "layout", q_fmt),
                    kv_format=ATTN_FORMAT.parse(op, "layout", kv_fmt), causal=causal, bottom_right=bottom_right,
                    softmax_scale=float(softmax_scale), max_seqlen_q=int(max_seqlen_q),
                    max_seqlen_kv=int(max_seqlen_kv))
    _core.attention_backward(*operands, be.desc("o", o, bf16=True), be.desc("lse", lse), be.desc("dq", dq, bf16=True),
                             be.desc("dk", dk, bf16=True), be.desc("dv", dv, bf16=True), opts, bool(deterministic),
                             be.opt_desc("cu_seqlens_q", cu_q), be.opt_desc("cu_seqlens_kv", cu_kv), be.stream())
    return dq, dk, dv


def attention_backward(do: Any, q: Any, k: Any, v: Any, o: Array, lse: Array, *, causal: bool = False,
                       softmax_scale: Optional[float] = None, layout: Optional[str] = None,
                       cu_seqlens_q: Union[None, Sequence[int], Array] = None,
                       cu_seqlens_kv: Union[None, Sequence[int], Array] = None, max_seqlen_q: Optional[int] = None,
                       max_seqlen_kv: Optional[int] = None, deterministic: bool = False,
                       bottom_right: bool = False) -> Tuple[Array, Array, Array]:
    """The attention backward (SPEC §5): (dq, dk, dv) in bf16, in the shapes and formats of q, k, v.

    With S = Q·Kᵀ·softmax_scale and P = exp(S − LSE) on the visible keys (the forward's masks):
    dP = dO·Vᵀ, D = rowsum(O ⊙ dO), dS = P ⊙ (dP − D) · softmax_scale; dV = Pᵀ·dO, dQ = dS·K,
    dK = dSᵀ·Q with P and dS rounded to bf16 before their GEMMs, sums in float64 (the CPU reference),
    each gradient rounded once to bf16. GQA: dK, dV sum over the query heads of a kv head.

    q, k, v: as for ``attention`` (three MXFP8Tensors of one fp8 format, or three bf16 arrays). Each
    GEMM reads an MXFP8 operand through the copy quantized along its contraction axis: S = Q_row·K_rowᵀ,
    dP = dO_row·V_rowᵀ, dV = Pᵀ·dO_col, dQ = dS·K_col, dK = dSᵀ·Q_col; a missing copy falls back to
    the other one (rowwise-only Q, K and dO give the exact gradient of the forward on the dequantized
    inputs). do: bf16 in q's format with o's shape, or an MXFP8Tensor of it (D then uses its rowwise
    copy). o: the forward's bf16 output; lse: its float32 LSE ([b, h, s_q]; thd [h, t]).
    causal, bottom_right, softmax_scale, layout, cu_seqlens_*, max_seqlen_*: as for ``attention``
    (layout is detected from q, k, v). deterministic: a fixed summation order (the reference always
    has one); torch tensors take it also while ``torch.use_deterministic_algorithms(True)`` is on, as
    torch's own kernels do. A row without visible keys gets dQ = 0; thd tokens outside every sequence
    get 0.

    CUDA tensors run the GPU kernels (the README's "Backward and autograd" section: on SM90 a
    warp-specialized tensor-core kernel with dQ summed in fp32, elsewhere slower kernels)."""
    op = _OP
    causal = flag(op, "causal", causal)
    bottom_right = flag(op, "bottom_right", bottom_right)
    deterministic = flag(op, "deterministic", deterministic)
    if bottom_right and not causal:
        raise ValueError(f"{op}: argument 'bottom_right': aligns the causal mask; it needs causal=True")
    mx = _operand_kind(op, q, k, v)
    if mx:
        for name, t in (("k", k), ("v", v)):
            if t.fp8_format != q.fp8_format:
                raise ValueError(f"{op}: argument '{name}': fp8_format '{t.fp8_format}' differs from q's "
                                 f"'{q.fp8_format}' (Q, K and V share one FP8 format)")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.rowwise_data is None and t.columnwise_data is None:
                raise ValueError(f"{op}: argument '{name}': holds no codes (neither rowwise nor columnwise data)")
        arrays = []
    else:
        for name, t in zip("qkv", (q, k, v)):
            _check_bf16(op, name, t)
        arrays = [q, k, v]
    if isinstance(do, MXFP8Tensor):
        if do.rowwise_data is None and do.columnwise_data is None:
            raise ValueError(f"{op}: argument 'do': holds no codes (neither rowwise nor columnwise data)")
    else:
        kind_of(op, "do", do)
        _check_bf16(op, "do", do)
    for name, t in (("o", o),):
        kind_of(op, name, t)
        _check_bf16(op, name, t)
    kind_of(op, "lse", lse)
    groups = [_parts(t) for t in (do, q, k, v)]
    torch_kind = is_torch(_first(groups[1]))
    for name, g in zip(("do", "q", "k", "v"), groups):
        for x in g:
            if x is not None and is_torch(x) != torch_kind:
                raise TypeError(f"{op}: argument '{name}': mixes torch and numpy buffers with q's")
    for name, t in (("o", o), ("lse", lse)):
        if is_torch(t) != torch_kind:
            raise TypeError(f"{op}: argument '{name}': expected a {'torch.Tensor' if torch_kind else 'numpy.ndarray'} "
                            f"like q, got {type_name(t)}")
    _, q_fmt, kv_fmt = _layout_arg(op, layout, q, k, v, mx, arrays)
    if (q_fmt == "thd") != (kv_fmt == "thd"):
        raise ValueError(f"{op}: argument 'layout': q in {q_fmt} and k / v in {kv_fmt}: packed sequences (thd) are "
                         "supported for q, k and v together only")
    like = _first(groups[1])
    scale, seqlens, cu_q, cu_kv = _scale_and_sequences(op, _shape_of(groups[1])[-1], softmax_scale, q_fmt,
                                                       cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, like)
    specs = [_mx_spec(t) if isinstance(t, MXFP8Tensor) else "" for t in (do, q, k, v)]
    bufs = [x for g in groups for x in g]
    if torch_kind:
        deterministic = deterministic or torch.are_deterministic_algorithms_enabled()  # torch's switch, as its ops
        return _dispatch.call("attention_backward", bufs, specs[0], specs[1], specs[2], specs[3], q_fmt, kv_fmt, causal,
                              bottom_right, scale, o, lse, cu_q, cu_kv, seqlens[0], seqlens[1],
                              deterministic)
    ml_bf16 = not mx and q.dtype.name == "bfloat16" and q.dtype != np.uint16
    return _attention_backward_impl(bufs, specs, q_fmt, kv_fmt, causal, bottom_right, scale, o, lse, cu_q, cu_kv,
                                    seqlens[0], seqlens[1], deterministic, ml_bf16=ml_bf16)


def _fake_shapes(bufs: Sequence[Any]) -> List[List[int]]:
    return [_shape_of(list(bufs[4 * i:4 * i + 4])) for i in (1, 2, 3)]


__all__ = ["attention_backward"]
