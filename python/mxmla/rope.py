"""RoPE for MLA (SPEC §3): apply_rope / rope_backward, rope_backward_quantize, tables (plain and
YaRN), positions.

Styles: "interleaved_in_halves_out" (default; Megatron MLA), "interleaved" (DeepSeek reference,
complex multiply), "rotate_half" (TE default). Layouts: "sbhd", "bshd", "thd" (with cu_seqlens).
Only the trailing `rope_dim` of each head rotates. CPU data runs the reference; CUDA tensors run
the sm90 kernels (bit-identical results). cu_seqlens (a list / tuple of ints, or an int32 / int64
array or tensor) is read on the host: a CUDA tensor is copied to the CPU, which synchronizes.

torch: apply_rope and rope_backward are differentiable (each is the other's gradient); the
``out=`` forms and rope_backward_quantize are not (an input that requires grad is an error).

Tables know their style: rope_tables tags cos / sin with the style they were built for (torch
tensors carry it as an attribute, numpy tables are a small ndarray subclass), and the ops refuse
tables of another style. Plain user tables (untagged) are taken as they are.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import _dispatch
from . import _mxmla_core as _core
from ._backend import Backend, alloc_outputs, is_numpy, is_torch, kind_of, numpy_bf16_requested, output_descs, torch, type_name
from ._checks import (
    FP8_FORMAT,
    ROPE_LAYOUT,
    ROPE_STYLE,
    choice,
    directions,
    flag,
    grad_needed,
    integer,
    not_differentiable,
    real,
    same_kind,
)
from .mxfp8 import MXFP8Tensor, _options, _present

if TYPE_CHECKING:
    import torch as _torch_t

    Array = Union[_torch_t.Tensor, np.ndarray]
else:
    Array = Any

STYLES = ROPE_STYLE.names
DEEPSEEK_V3_YARN = dict(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                        mscale_all_dim=1.0)
YarnLike = Union[None, str, Dict[str, float], "_core.YarnParams"]

_STYLE_ATTR = "_mxmla_rope_style"


# ----------------------------------------------------------------------------- tables that know their style
class RopeTableArray(np.ndarray):
    """A numpy cos / sin table that remembers the rope style rope_tables built it for (views and
    copies keep it; np.asarray gives a plain array, which is taken as it is)."""

    _mxmla_rope_style: Optional[str] = None

    def __array_finalize__(self, obj: Any) -> None:
        self._mxmla_rope_style = getattr(obj, _STYLE_ATTR, None)

    @property
    def rope_style(self) -> Optional[str]:
        return self._mxmla_rope_style


class RopeTables(tuple):
    """``(cos, sin)`` as rope_tables returns them (unpacks as a pair), with ``.style`` (the style they
    were built for), ``.cos`` and ``.sin``."""

    style: str

    def __new__(cls, cos: Any, sin: Any, style: str) -> "RopeTables":
        t = super().__new__(cls, (cos, sin))
        t.style = style
        return t

    @property
    def cos(self) -> Any:
        return self[0]

    @property
    def sin(self) -> Any:
        return self[1]

    def __repr__(self) -> str:
        c = self[0]
        kind = f"torch {c.dtype} on {c.device}" if is_torch(c) else f"numpy {c.dtype}"
        return f"RopeTables(style='{self.style}', shape={tuple(c.shape)}, {kind})"


def table_style(t: Any) -> Optional[str]:
    """The style rope_tables built `t` for, or None for a plain table."""
    return getattr(t, _STYLE_ATTR, None)


def _check_tables(op: str, style: str, cos: Any, sin: Any) -> None:
    for arg, t in (("cos", cos), ("sin", sin)):
        tag = getattr(t, _STYLE_ATTR, None)
        if tag is not None and tag != style:
            raise ValueError(f"{op}: argument '{arg}': was built by rope_tables for style '{tag}', but style='{style}' "
                             f"was passed (each style lays the angles out differently); build the tables with "
                             f"rope_tables(..., style='{style}') or pass style='{tag}'")


# ----------------------------------------------------------------------------- argument helpers
_YARN_KEYS = tuple(DEEPSEEK_V3_YARN)


def _yarn(op: str, yarn: YarnLike) -> Any:
    """None, "deepseek_v3", a dict of DEEPSEEK_V3_YARN's keys (the others keep DeepSeek-V3's
    values) or a YarnParams -> YarnParams."""
    if isinstance(yarn, _core.YarnParams):
        return yarn
    if yarn is None:
        return _core.YarnParams()
    if isinstance(yarn, str):
        if yarn != "deepseek_v3":
            raise ValueError(f"{op}: argument 'yarn': unknown preset {yarn!r} (use 'deepseek_v3', a dict or None)")
        return _core.YarnParams.deepseek_v3()
    if not isinstance(yarn, dict):
        raise TypeError(f"{op}: argument 'yarn': must be None, 'deepseek_v3', a dict or a YarnParams, got {type_name(yarn)}")
    for k in yarn:
        if k not in _YARN_KEYS:
            raise ValueError(f"{op}: argument 'yarn': unknown key {k!r} (valid keys: {', '.join(_YARN_KEYS)})")
    y = _core.YarnParams.deepseek_v3()
    for k, v in yarn.items():
        if k == "original_max_position":
            setattr(y, k, integer(op, f"yarn['{k}']", v))
        else:
            setattr(y, k, real(op, f"yarn['{k}']", v))
    return y


def _cu_arg(op: str, cu_seqlens: Any, torch_kind: bool) -> Any:
    """cu_seqlens as the op takes it: None, or an array / tensor (a list or tuple of ints becomes an
    int64 one of the caller's kind)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, (list, tuple)):
        vals = [integer(op, f"cu_seqlens[{i}]", v) for i, v in enumerate(cu_seqlens)]
        return torch.tensor(vals, dtype=torch.int64) if torch_kind else np.asarray(vals, dtype=np.int64)
    if is_torch(cu_seqlens) or is_numpy(cu_seqlens):
        return cu_seqlens
    raise TypeError(f"{op}: argument 'cu_seqlens': must be a list / tuple of ints or an int32 / int64 array or tensor, "
                    f"got {type_name(cu_seqlens)}")


def _cu_desc(be: Backend, cu_seqlens: Any) -> Tuple[Any, Any]:
    """(descriptor, owner): cu_seqlens on the CPU (the library validates it on the host); keep
    `owner` alive until the call returns (a CUDA tensor's host copy is a new tensor)."""
    if cu_seqlens is None:
        return None, None
    if is_torch(cu_seqlens) and cu_seqlens.is_cuda:
        cu_seqlens = cu_seqlens.cpu()
    if is_torch(cu_seqlens) != be.torch:  # the ops convert lists to the caller's kind; arrays must match
        raise TypeError(f"{be.op}: argument 'cu_seqlens': expected a {'torch.Tensor' if be.torch else 'numpy.ndarray'} "
                        f"like argument '{be.arg}', got {type_name(cu_seqlens)}")
    return be.desc("cu_seqlens", cu_seqlens, allowed="int32 or int64"), cu_seqlens


def _rope_options(op: str, style: str, layout: str, rope_dim: int, tables_per_token: bool) -> Any:
    return _options(_core.RopeOptions, style=ROPE_STYLE.parse(op, "style", style),
                    layout=ROPE_LAYOUT.parse(op, "layout", layout),
                    rope_dim=int(rope_dim), tables_per_token=tables_per_token)


# ----------------------------------------------------------------------------- implementations (numpy or torch)
def _rope_impl(backward: bool, x: Any, cos: Any, sin: Any, style: str, layout: str, rope_dim: int, cu_seqlens: Any,
               tables_per_token: bool, out: Any = None) -> Any:
    op = "mxmla.rope_backward" if backward else "mxmla.apply_rope"
    xn = "grad" if backward else "x"
    be = Backend(op, xn, x)
    xd = be.desc(xn, x, bf16=True)
    if out is None:
        out = be.empty(xd[2], xd[1])
    cu, _cu_owner = _cu_desc(be, cu_seqlens)
    fn = _core.rope_backward if backward else _core.apply_rope
    fn(xd, be.desc("cos", cos, bf16=True), be.desc("sin", sin, bf16=True), be.desc("out", out, bf16=True),
       _rope_options(op, style, layout, rope_dim, tables_per_token), cu, be.stream())
    return out


def _rope_backward_quantize_impl(dq: Any, cos: Any, sin: Any, rowwise: bool, columnwise: bool, fp8_format: str,
                                 swizzle: bool, dx_copy: Optional[str], style: str, layout: str, rope_dim: int,
                                 cu_seqlens: Any, tables_per_token: bool, ml_bf16: bool = False) -> tuple:
    op = "mxmla.rope_backward_quantize"
    be = Backend(op, "dq", dq, ml_bf16=ml_bf16)
    dd = be.desc("dq", dq, bf16=True)
    shape = dd[2]
    if len(shape) < 3:
        raise ValueError(f"{op}: argument 'dq': must be [s,b,h,d], [b,s,h,d] or [t,h,d], got {shape}")
    tokens = int(np.prod(shape[:-2], dtype=np.int64))
    hd = shape[-2] * shape[-1]
    outs = alloc_outputs(be, _core.quantize_shapes([tokens, hd], swizzle, op, "dq"), rowwise, columnwise)
    dx = be.empty(shape, dx_copy) if dx_copy else None
    cu, _cu_owner = _cu_desc(be, cu_seqlens)
    o = _options(_core.RopeBackwardQuantizeOptions, rope=_rope_options(op, style, layout, rope_dim, tables_per_token),
                 rowwise=rowwise, columnwise=columnwise, format=FP8_FORMAT.parse(op, "fp8_format", fp8_format), swizzle=swizzle)
    _core.rope_backward_quantize(dd, be.desc("cos", cos, bf16=True), be.desc("sin", sin, bf16=True),
                                 *output_descs(be, outs), be.opt_desc("dx_copy", dx, bf16=True), o, cu, be.stream())
    return (*outs, dx)


# ----------------------------------------------------------------------------- public ops
def _rope_args(op: str, x: Any, cos: Any, sin: Any, style: Any, layout: Any, rope_dim: Any, cu_seqlens: Any,
               tables_per_token: Any, xn: str) -> tuple:
    style = choice(op, "style", style, ROPE_STYLE)
    layout = choice(op, "layout", layout, ROPE_LAYOUT)
    rope_dim = integer(op, "rope_dim", rope_dim)
    tables_per_token = flag(op, "tables_per_token", tables_per_token)
    torch_kind = kind_of(op, xn, x) == "torch"
    same_kind(op, xn, x, cos=cos, sin=sin)
    cu = _cu_arg(op, cu_seqlens, torch_kind)
    same_kind(op, xn, x, cu_seqlens=cu)
    _check_tables(op, style, cos, sin)
    return torch_kind, style, layout, rope_dim, cu, tables_per_token


def _rope(backward: bool, x: Any, cos: Any, sin: Any, style: Any, layout: Any, rope_dim: Any, cu_seqlens: Any,
          tables_per_token: Any, out: Any) -> Any:
    op = "mxmla.rope_backward" if backward else "mxmla.apply_rope"
    xn = "grad" if backward else "x"
    torch_kind, style, layout, rope_dim, cu, per_token = _rope_args(op, x, cos, sin, style, layout, rope_dim,
                                                                    cu_seqlens, tables_per_token, xn)
    if out is not None:
        same_kind(op, xn, x, out=out)
    if not torch_kind:
        return _rope_impl(backward, x, cos, sin, style, layout, rope_dim, cu, per_token, out)
    for arg, t in (("cos", cos), ("sin", sin)):
        if grad_needed(t):
            raise RuntimeError(f"{op}: argument '{arg}': requires grad, but {op.split('.')[-1]} has no gradient for the "
                               f"tables; pass {arg}.detach()")
    if out is None:
        return _dispatch.call("rope_backward" if backward else "apply_rope", x, cos, sin, style, layout, rope_dim, cu,
                              per_token)
    for arg, t in ((xn, x), ("out", out)):
        if grad_needed(t):
            raise RuntimeError(f"{op}: argument 'out': the out= form is not differentiable ('{arg}' requires grad); "
                               f"call {op.split('.')[-1]} without out=, or under torch.no_grad()")
    _dispatch.call("rope_backward_out" if backward else "apply_rope_out", x, cos, sin, out, style, layout, rope_dim, cu,
                   per_token)
    return out


def apply_rope(x: Array, cos: Array, sin: Array, style: str = "interleaved_in_halves_out", layout: str = "sbhd",
               rope_dim: int = 64, cu_seqlens: Union[None, Sequence[int], Array] = None,
               tables_per_token: bool = False, out: Optional[Array] = None) -> Array:
    """RoPE on the trailing rope_dim of each head of x ([s,b,h,d], [b,s,h,d] or [t,h,d]).

    cos/sin: [T, rope_dim] float32/bfloat16 (rope_tables builds them). Table row of a token: its
    position s (sbhd/bshd), its position inside its sequence (thd with cu_seqlens), its index t
    (thd without), or its token index when tables_per_token. out may be x (in place).
    torch: differentiable in x (the gradient is rope_backward); out= is not differentiable."""
    return _rope(False, x, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, out)


def rope_backward(grad: Array, cos: Array, sin: Array, style: str = "interleaved_in_halves_out",
                  layout: str = "sbhd", rope_dim: int = 64, cu_seqlens: Union[None, Sequence[int], Array] = None,
                  tables_per_token: bool = False, out: Optional[Array] = None) -> Array:
    """The gradient of apply_rope: dx = R^T grad (same conventions). torch: differentiable in grad
    (the gradient is apply_rope)."""
    return _rope(True, grad, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, out)


def _dx_copy_name(op: str, dx_copy: Any) -> Tuple[Optional[str], bool]:
    """(None | 'bfloat16' | 'float32', numpy result as ml_dtypes.bfloat16?)."""
    if dx_copy is None:
        return None, False
    if isinstance(dx_copy, str):
        name = dx_copy
    elif torch is not None and isinstance(dx_copy, torch.dtype):
        name = str(dx_copy).replace("torch.", "")
    elif numpy_bf16_requested(dx_copy):
        return "bfloat16", True
    else:
        try:
            name = np.dtype(dx_copy).name
        except TypeError:
            name = None
    if name not in ("bfloat16", "float32"):
        raise ValueError(f"{op}: argument 'dx_copy': must be None, 'bfloat16' or 'float32' (or the torch / numpy "
                         f"dtype), got {dx_copy!r}")
    return name, False


def rope_backward_quantize(dq: Array, cos: Array, sin: Array, rowwise: bool = True, columnwise: bool = True,
                           fp8_format: str = "e4m3", swizzle: bool = False, dx_copy: Any = None,
                           style: str = "interleaved_in_halves_out", layout: str = "sbhd", rope_dim: int = 64,
                           cu_seqlens: Union[None, Sequence[int], Array] = None,
                           tables_per_token: bool = False) -> Union[MXFP8Tensor, Tuple[MXFP8Tensor, Array]]:
    """dQ -> RoPE backward (fp32) -> MXFP8 of dx viewed as [tokens, h*d] in one pass.

    Returns an MXFP8Tensor of shape (tokens, h*d) (codes: reshape to dq's shape), or
    (MXFP8Tensor, dx) with dx_copy="bfloat16" (or "float32": the exact fp32 values quantized).
    Not differentiable."""
    op = "mxmla.rope_backward_quantize"
    rowwise, columnwise = flag(op, "rowwise", rowwise), flag(op, "columnwise", columnwise)
    fmt = choice(op, "fp8_format", fp8_format, FP8_FORMAT)
    swizzle = flag(op, "swizzle", swizzle)
    dx_name, ml_bf16 = _dx_copy_name(op, dx_copy)
    directions(op, rowwise, columnwise)
    torch_kind, style, layout, rope_dim, cu, per_token = _rope_args(op, dq, cos, sin, style, layout, rope_dim,
                                                                    cu_seqlens, tables_per_token, "dq")
    if torch_kind:
        not_differentiable(op, "MXFP8 codes are not differentiable", dq=dq, cos=cos, sin=sin)
        res = _dispatch.call("rope_backward_quantize", dq, cos, sin, rowwise, columnwise, fmt, swizzle,
                             None if dx_name is None else getattr(torch, dx_name), style,
                             layout, rope_dim, cu, per_token)
        outs, dx = _present(res[:4], rowwise, columnwise), res[4]
    else:
        res = _rope_backward_quantize_impl(dq, cos, sin, rowwise, columnwise, fmt, swizzle, dx_name, style, layout,
                                           rope_dim, cu, per_token, ml_bf16)
        outs, dx = res[:4], res[4]
    shape = tuple(dq.shape)
    tokens = math.prod(shape[:-2]) if len(shape) >= 3 else 0
    q = MXFP8Tensor((tokens, shape[-2] * shape[-1]) if len(shape) >= 3 else shape, fmt,
                    "swizzled" if swizzle else "compact", *outs)
    return (q, dx) if dx_name else q


# ----------------------------------------------------------------------------- tables and positions
def rope_inv_freq(rope_dim: int = 64, base: float = 10000.0, yarn: YarnLike = None) -> np.ndarray:
    """Inverse frequencies (rope_dim/2), YaRN-corrected as in DeepSeek-V3's precompute_freqs_cis."""
    op = "mxmla.rope_inv_freq"
    return np.asarray(_core.rope_inv_freq(integer(op, "rope_dim", rope_dim), real(op, "base", base), _yarn(op, yarn)),
                      dtype=np.float64)


def _positions(op: str, positions: Any) -> Tuple[np.ndarray, bool]:
    torch_in = is_torch(positions)
    if torch_in:
        pos = positions.detach().cpu().double().numpy()
    else:
        if isinstance(positions, (str, bytes)) or positions is None:
            raise TypeError(f"{op}: argument 'positions': must be a list, numpy array or torch tensor of numbers, "
                            f"got {type_name(positions)}")
        try:
            pos = np.asarray(positions, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{op}: argument 'positions': must be a list, numpy array or torch tensor of numbers ({e})") \
                from None
    if pos.ndim != 1:
        raise ValueError(f"{op}: argument 'positions': must be 1-D, got shape {pos.shape}")
    return pos, torch_in


def _table_dtype(op: str, dtype: Any) -> Tuple[str, bool]:
    """('float32' | 'bfloat16', numpy bf16 tables as ml_dtypes.bfloat16?)."""
    if isinstance(dtype, str):
        name = dtype
    elif torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    elif numpy_bf16_requested(dtype):
        return "bfloat16", True
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"{op}: argument 'dtype': must be float32 or bfloat16, got {dtype!r}")
    return name, False


def rope_tables(positions: Union[Sequence[float], Array], rope_dim: int = 64, base: float = 10000.0,
                yarn: YarnLike = None, style: str = "interleaved_in_halves_out", dtype: Any = "float32") -> RopeTables:
    """cos, sin [len(positions), rope_dim] for `style` (angles in float64, rounded once).

    positions: a list, numpy array or torch tensor; torch in -> torch out on the same device.
    Returns a RopeTables (unpacks as ``cos, sin``) whose tables remember `style`: the ops refuse them
    for another style. numpy bfloat16 tables are uint16 bits (dtype="bfloat16") or ml_dtypes
    arrays (dtype=ml_dtypes.bfloat16)."""
    op = "mxmla.rope_tables"
    style = choice(op, "style", style, ROPE_STYLE)
    name, ml_bf16 = _table_dtype(op, dtype)
    rope_dim = integer(op, "rope_dim", rope_dim)
    base = real(op, "base", base)
    y = _yarn(op, yarn)
    pos, torch_in = _positions(op, positions)
    ndt = np.float32 if name == "float32" else np.uint16
    cos = np.empty((pos.shape[0], max(rope_dim, 0)), ndt)
    sin = np.empty_like(cos)
    desc = lambda a: (a.ctypes.data, name, list(a.shape), [a.shape[1], 1], 1, 0)  # noqa: E731
    _core.rope_tables(pos.tolist(), rope_dim, base, y, ROPE_STYLE.parse(op, "style", style), desc(cos), desc(sin))
    if not torch_in:
        def tag(a: np.ndarray) -> np.ndarray:
            if ml_bf16:
                a = a.view(np.dtype("bfloat16"))
            t = a.view(RopeTableArray)
            t._mxmla_rope_style = style
            return t

        return RopeTables(tag(cos), tag(sin), style)

    def to_torch(a: np.ndarray) -> Any:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if name == "bfloat16" else torch.from_numpy(a)
        t = t.to(positions.device)
        setattr(t, _STYLE_ATTR, style)
        return t

    return RopeTables(to_torch(cos), to_torch(sin), style)


def yarn_softmax_scale(head_dim: int = 192, yarn: YarnLike = "deepseek_v3") -> float:
    """head_dim^-0.5 times yarn_get_mscale(factor, mscale_all_dim)^2 (0.135234 for DeepSeek-V3)."""
    op = "mxmla.yarn_softmax_scale"
    return _core.yarn_softmax_scale(integer(op, "head_dim", head_dim), _yarn(op, yarn))


def positions_arange(n: int, offset: int = 0) -> np.ndarray:
    """offset, offset + 1, ..., offset + n - 1 (float64)."""
    op = "mxmla.positions_arange"
    return np.asarray(_core.positions_arange(integer(op, "n", n), integer(op, "offset", offset)))


def positions_from_cu_seqlens(cu_seqlens: Union[Sequence[int], Array]) -> np.ndarray:
    """thd: each token's position inside its sequence."""
    op = "mxmla.positions_from_cu_seqlens"
    if is_torch(cu_seqlens):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    if is_numpy(cu_seqlens):
        if cu_seqlens.dtype.kind not in "iu":
            raise ValueError(f"{op}: argument 'cu_seqlens': dtype {cu_seqlens.dtype} must be an integer type (int32 or int64)")
        cu_seqlens = cu_seqlens.tolist()
    if not isinstance(cu_seqlens, (list, tuple)):
        raise TypeError(f"{op}: argument 'cu_seqlens': must be a list / tuple of ints or an integer array / tensor, "
                        f"got {type_name(cu_seqlens)}")
    vals = [integer(op, f"cu_seqlens[{i}]", v) for i, v in enumerate(cu_seqlens)]
    return np.asarray(_core.positions_from_cu_seqlens(vals))


def positions_context_parallel(local_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Dual-chunk context parallelism: rank r holds global chunks r and 2*cp-1-r (of local_len/2 each)."""
    op = "mxmla.positions_context_parallel"
    return np.asarray(_core.positions_context_parallel(integer(op, "local_len", local_len),
                                                       integer(op, "cp_size", cp_size), integer(op, "cp_rank", cp_rank)))
