"""Attention on MXFP8 (or bf16) Q, K, V (SPEC §5) and TransformerEngine's layout detection.

``attention(q, k, v)`` computes softmax(Q·Kᵀ·scale)·V the way the reference system's MXFP8 attention
does (Q and K dequantized exactly from their rowwise copies, V from its columnwise copy, fp32 scores
and softmax, fp32 accumulation; O in bf16, optionally the fp32 log-sum-exp). numpy inputs run the
CPU reference, torch tensors the reference (CPU) or the SM90 kernel (CUDA, on torch's current
stream) through the custom op ``torch.ops.mxmla.attention``.

``qkv_layout(q, k, v)`` names how Q, K and V lie in memory with TransformerEngine's layout strings
("sb3hd", "bshd_bsh2d", "thd_thd_thd", ...), read from the tensors themselves: their shapes, strides
and whether they are views into one buffer at the offsets a packed layout puts them. The kernels
take every operand with its own strides, so a layout name never changes what is computed; it is
what TransformerEngine would call the same memory, and ``attention(layout=...)`` checks a name the
caller gives against it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _dispatch
from . import _mxmla_core as _core
from ._backend import Backend, is_numpy, is_torch, kind_of, torch, type_name
from ._checks import FP8_FORMAT, QKV_LAYOUT, SCALE_LAYOUT, Choices, flag, integer, not_differentiable, one_of, real
from .mxfp8 import MXFP8Tensor, _options

if TYPE_CHECKING:
    import torch as _torch_t

    Array = Union[_torch_t.Tensor, np.ndarray]
    Operand = Union[_torch_t.Tensor, np.ndarray, MXFP8Tensor]
else:
    Array = Any
    Operand = Any

_OP = "mxmla.attention"
_LAYOUT_OP = "mxmla.qkv_layout"
_NOT_DIFF = "the op is forward only: mxmla.MXFP8Attention and mxmla.nn.DotProductAttention carry its gradient"

#: The tensor formats: [s, b, h, d], [b, s, h, d], [b, h, s, d], and [t, h, d] (packed sequences).
FORMATS = ("sbhd", "bshd", "bhsd", "thd")
#: A different format for q than for k and v, as TransformerEngine spells it ("sbhd_2bshd": q sbhd, k and
#: v bshd). TransformerEngine has sbhd_2bshd, bshd_2sbhd, thd_2bshd and thd_2sbhd; every pair is named
#: here (attention takes the pairs without thd).
MIXED_FORMATS = tuple(f"{a}_2{b}" for a in FORMATS for b in FORMATS if a != b)
_FORMAT_WORDS = "'sbhd', 'bshd', 'bhsd', 'thd' or '<q format>_2<k/v format>' (e.g. 'sbhd_2bshd')"
#: Every layout name qkv_layout can answer, with its (q format, k/v format).
LAYOUTS = {}
for _f in ("sbhd", "bshd", "thd"):
    _tok = _f[:-2]
    for _name in (_tok + "3hd", _tok + "h3d", f"{_f}_{_tok}2hd", f"{_f}_{_tok}h2d", f"{_f}_{_f}_{_f}"):
        LAYOUTS[_name] = (_f, _f)
LAYOUTS["bhsd_bhsd_bhsd"] = ("bhsd", "bhsd")
for _m in MIXED_FORMATS:
    _qf, _kvf = _m.split("_2")
    LAYOUTS[f"{_qf}_{_kvf}_{_kvf}"] = (_qf, _kvf)
del _f, _tok, _name, _m, _qf, _kvf

#: p_format spellings: "bfloat16" (also the bound enum's "bf16") and "e4m3".
P_FORMATS = ("bfloat16", "e4m3")
_P_ENUM_NAME = {"bfloat16": "bf16", "bf16": "bf16", "e4m3": "e4m3"}
ATTN_FORMAT = Choices(_core.AttnFormat)


# ----------------------------------------------------------------------------- one array's geometry
class _Mem:
    """Shape, strides (elements), address (bytes) and buffer identity of one torch tensor or numpy array."""

    __slots__ = ("shape", "strides", "ptr", "itemsize", "buffer", "array")

    def __init__(self, op: str, arg: str, a: Any, addresses: bool = True):
        self.array = a
        self.shape = tuple(int(d) for d in a.shape)
        self.ptr = self.buffer = None
        if is_torch(a):
            self.strides = tuple(int(s) for s in a.stride())
            self.itemsize = a.element_size()
            if addresses:
                self.ptr = a.data_ptr()
                self.buffer = (str(a.device), a.untyped_storage().data_ptr())
        else:
            self.itemsize = a.itemsize
            if any(s % a.itemsize for s in a.strides):
                raise ValueError(f"{op}: argument '{arg}': strides {a.strides} (bytes) are not whole elements")
            self.strides = tuple(s // a.itemsize for s in a.strides)
            self.ptr = a.__array_interface__["data"][0]
            root = a
            while isinstance(root.base, np.ndarray):
                root = root.base
            self.buffer = id(root if root.base is None else root.base)

    def same_buffer(self, other: "_Mem") -> bool:
        if self.buffer == other.buffer:
            return True
        # numpy arrays over one memory through different owners (np.frombuffer twice, __array_interface__)
        return is_numpy(self.array) and is_numpy(other.array) and np.may_share_memory(self.array, other.array)

    def offset_to(self, other: "_Mem") -> Optional[int]:
        """other's address minus this one's, in elements (None when not a whole number of elements)."""
        diff = other.ptr - self.ptr
        return diff // self.itemsize if diff % self.itemsize == 0 else None


def _dims(fmt: str, shape: Sequence[int]) -> Tuple[int, int, int, int]:
    """(b, s, h, d) of a shape in a format (thd: b = 1, s = t)."""
    if fmt == "thd":
        t, h, d = shape
        return 1, t, h, d
    i = {c: shape[j] for j, c in enumerate(fmt)}
    return i["b"], i["s"], i["h"], i["d"]


def _token_axes(fmt: str) -> List[int]:
    return [j for j, c in enumerate(fmt) if c in "sbt"]


_SHAPE_WORDS = {"sbhd": "[s, b, h, d]", "bshd": "[b, s, h, d]", "bhsd": "[b, h, s, d]", "thd": "[t, h, d]"}


def _parse_format(op: str, arg: str, fmt: Any) -> Tuple[str, str]:
    if isinstance(fmt, str):
        if fmt in FORMATS:
            return fmt, fmt
        if fmt in MIXED_FORMATS:
            qf, kvf = fmt.split("_2")
            return qf, kvf
    raise ValueError(f"{op}: argument '{arg}': must be {_FORMAT_WORDS}, got {fmt!r}")


def _check_geometry(op: str, q: _Mem, k: _Mem, v: _Mem, q_fmt: str, kv_fmt: str, names: Sequence[str]) -> None:
    """The shape rules every layout shares (rank per format, d_qk, h_kv, batch; head dim contiguous)."""
    for m, fmt, name in ((q, q_fmt, names[0]), (k, kv_fmt, names[1]), (v, kv_fmt, names[2])):
        if len(m.shape) != len(fmt):
            raise ValueError(f"{op}: argument '{name}': format '{fmt}' needs a {len(fmt)}-D tensor "
                             f"{_SHAPE_WORDS[fmt]}, got shape {list(m.shape)}")
        if m.shape[-1] > 1 and 0 not in m.shape and m.strides[-1] != 1:
            raise ValueError(f"{op}: argument '{name}': the head dim must be contiguous (stride 1), got strides "
                             f"{list(m.strides)}")
    qb, _, qh, qd = _dims(q_fmt, q.shape)
    kb, ks, kh, kd = _dims(kv_fmt, k.shape)
    vb, vs, vh, _ = _dims(kv_fmt, v.shape)
    if kd != qd:
        raise ValueError(f"{op}: argument '{names[1]}': head dim {kd} differs from q's {qd} (d_qk is shared)")
    if (vb, vs, vh) != (kb, ks, kh):
        what = "tokens" if kv_fmt == "thd" else "batch, sequence length"
        raise ValueError(f"{op}: argument '{names[2]}': shape {list(v.shape)} does not match k's {list(k.shape)} "
                         f"(the same {what} and heads; only the head dim may differ)")
    if q_fmt != "thd" and kv_fmt != "thd" and qb != kb:
        raise ValueError(f"{op}: argument '{names[1]}': batch {kb} differs from q's {qb}")
    if kh == 0 or qh % kh != 0:
        raise ValueError(f"{op}: argument '{names[1]}': q's {qh} heads are not a multiple of k's {kh} (grouped-query "
                         f"attention needs h % h_kv == 0)")


def _packed(first: _Mem, others: Sequence[_Mem], fmt: str, n: int, interleave_heads: bool) -> bool:
    """Whether `first` and `others` (n tensors in all, same shape) are the slices 0..n-1 of one buffer
    [tokens..., n, h, d] (interleave_heads False: "3hd" / "2hd") or [tokens..., h, n, d] (True: "h3d" /
    "h2d"): one buffer, equal shapes and strides, the head stride and the offsets of that
    buffer, and tokens n slices apart (no overlap)."""
    _, _, h, d = _dims(fmt, first.shape)
    step = d if interleave_heads else h * d        # offset from one slice to the next
    head_stride = n * d if interleave_heads else d
    if h > 1 and first.strides[-2] != head_stride:
        return False
    for j in _token_axes(fmt):
        if first.shape[j] > 1 and abs(first.strides[j]) < n * h * d:
            return False
    for i, m in enumerate(others, start=1):
        if not first.same_buffer(m) or m.shape != first.shape:
            return False
        if any(a != b for a, b, size in zip(m.strides, first.strides, m.shape) if size > 1):
            return False
        if first.offset_to(m) != i * step:
            return False
    return True


def _layout_of(q: _Mem, k: _Mem, v: _Mem, q_fmt: str, kv_fmt: str) -> str:
    if q_fmt != kv_fmt:
        return f"{q_fmt}_{kv_fmt}_{kv_fmt}"
    fmt = q_fmt
    if fmt == "bhsd":  # TransformerEngine names no packed bhsd layout
        return "bhsd_bhsd_bhsd"
    if 0 not in q.shape and 0 not in k.shape:  # an empty tensor has no place in memory to read
        tok = fmt[:-2]
        if _packed(q, (k, v), fmt, 3, False):
            return tok + "3hd"
        if _packed(q, (k, v), fmt, 3, True):
            return tok + "h3d"
        if _packed(k, (v,), fmt, 2, False):
            return f"{fmt}_{tok}2hd"
        if _packed(k, (v,), fmt, 2, True):
            return f"{fmt}_{tok}h2d"
    return f"{fmt}_{fmt}_{fmt}"


# ----------------------------------------------------------------------------- operands
def _operand_kind(op: str, q: Any, k: Any, v: Any) -> bool:
    """True for three MXFP8Tensors, False for three arrays; errors for a mix or another type."""
    mx = [isinstance(t, MXFP8Tensor) for t in (q, k, v)]
    if all(mx):
        return True
    if any(mx):
        i = mx.index(False)
        raise TypeError(f"{op}: argument '{'qkv'[i]}': q, k and v must all be MXFP8Tensors or all be bf16 tensors; "
                        f"got {type_name((q, k, v)[i])} next to an MXFP8Tensor")
    torch_kind = kind_of(op, "q", q) == "torch"
    for name, t in (("k", k), ("v", v)):
        if (kind_of(op, name, t) == "torch") != torch_kind:
            raise TypeError(f"{op}: argument '{name}': expected a {'torch.Tensor' if torch_kind else 'numpy.ndarray'} "
                            f"like argument 'q', got {type_name(t)}")
    return False


def _default_format(op: str, arg: str, q: Any, k: Any, v: Any, mx: bool) -> str:
    """The format when the caller names none: 3-D tensors (MXFP8: 3-D codes) are thd; MXFP8 tensors
    from quantize_attention say theirs; otherwise TransformerEngine's default, sbhd."""
    def ndim(t: Any) -> int:  # an MXFP8 tensor's codes, not its quantized shape ([t, h*d] for thd codes [t, h, d])
        if mx:
            for codes in (t.rowwise_data, t.columnwise_data):
                if codes is not None:
                    return len(codes.shape)
        return len(t.shape)

    def known(t: Any) -> Optional[str]:
        if ndim(t) == 3:
            return "thd"
        if mx and t.attention and len(t.shape) == 4:
            return t.layout
        return None

    fq, fk, fv = known(q), known(k), known(v)
    if fk and fv and fk != fv:
        raise ValueError(f"{op}: argument 'v': k is {fk} and v is {fv} (k and v share one format)")
    fkv = fk or fv
    if fq is None:
        fq = fkv if fkv in ("sbhd", "bshd") else "sbhd"
    if fkv is None:
        if fq == "thd":
            raise ValueError(f"{op}: argument '{arg}': q is 3-D (thd) and k / v are 4-D: name their format "
                             "('thd_2sbhd' or 'thd_2bshd')")
        fkv = fq
    return fq if fq == fkv else f"{fq}_2{fkv}"


def _codes(op: str, name: str, t: MXFP8Tensor, direction: str) -> Any:
    """One direction's codes (None when absent). Their shape is the operand's shape in its format; the
    tensor's own ``shape`` is the shape it was quantized as, which may merge adjacent dimensions
    (e.g. [t, h*d] for codes viewed as [t, h, d])."""
    data = getattr(t, f"{direction}_data")
    if data is not None:
        kind_of(op, f"{name}.{direction}_data", data)
    return data


def _mxfp8_layout(op: str, q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, q_fmt: str, kv_fmt: str) -> str:
    """The layout of the codes: each direction that all three tensors hold gives one answer, and the
    answers must agree; when neither direction is complete, the codes attention reads (Q and K
    rowwise, V columnwise, else the one each has)."""
    answers = {}
    for direction in ("rowwise", "columnwise"):
        codes = [_codes(op, n, t, direction) for n, t in zip("qkv", (q, k, v))]
        if all(c is not None for c in codes):
            answers[direction] = _arrays_layout(op, *codes, q_fmt, kv_fmt,
                                                names=[f"{n}.{direction}_data" for n in "qkv"])
    if len(set(answers.values())) > 1:
        raise ValueError(f"{op}: argument 'q'/'k'/'v': the rowwise codes are laid out as '{answers['rowwise']}' but "
                         f"the columnwise codes as '{answers['columnwise']}' (both directions must describe one "
                         "layout)")
    if answers:
        return next(iter(answers.values()))
    picks, names = [], []
    for n, t, want in (("q", q, "rowwise"), ("k", k, "rowwise"), ("v", v, "columnwise")):
        other = "columnwise" if want == "rowwise" else "rowwise"
        c = _codes(op, n, t, want)
        d = want
        if c is None:
            c, d = _codes(op, n, t, other), other
        if c is None:
            raise ValueError(f"{op}: argument '{n}': holds no codes (neither rowwise nor columnwise data)")
        picks.append(c), names.append(f"{n}.{d}_data")
    return _arrays_layout(op, *picks, q_fmt, kv_fmt, names=names)


def _arrays_layout(op: str, q: Any, k: Any, v: Any, q_fmt: str, kv_fmt: str,
                   names: Sequence[str] = ("q", "k", "v")) -> str:
    torch_kind = is_torch(q)
    for name, t in zip(names, (q, k, v)):
        if is_torch(t) != torch_kind or not (is_torch(t) or is_numpy(t)):
            raise TypeError(f"{op}: argument '{name}': expected a {'torch.Tensor' if torch_kind else 'numpy.ndarray'} "
                            f"like argument '{names[0]}', got {type_name(t)}")
    if torch_kind:
        for name, t in zip(names[1:], (k, v)):
            if t.device != q.device:
                raise ValueError(f"{op}: argument '{name}': on {t.device}, but {names[0]} is on {q.device}")
    addresses = not (torch_kind and _compiling())  # no addresses while torch.compile traces (as in TransformerEngine)
    mems = [_Mem(op, n, t, addresses) for n, t in zip(names, (q, k, v))]
    _check_geometry(op, *mems, q_fmt, kv_fmt, names)
    if not addresses:
        return f"{q_fmt}_{kv_fmt}_{kv_fmt}"
    return _layout_of(*mems, q_fmt, kv_fmt)


def _compiling() -> bool:
    return torch is not None and hasattr(torch, "compiler") and torch.compiler.is_compiling()


def _formats(op: str, q: Any, k: Any, v: Any, mx: bool, qkv_format: Any, arg: str = "qkv_format") -> Tuple[str, str]:
    if qkv_format is None:
        qkv_format = _default_format(op, arg, q, k, v, mx)
    return _parse_format(op, arg, qkv_format)


def qkv_layout(q: Operand, k: Operand, v: Operand, qkv_format: Optional[str] = None) -> str:
    """TransformerEngine's name for how q, k and v lie in memory (its ``get_qkv_layout`` rules).

    q, k, v: torch tensors or numpy arrays (bf16 or any dtype), or MXFP8Tensors (then their codes
    are read, never their scales). ``qkv_format``: "sbhd", "bshd", "bhsd", "thd", or q's and k/v's
    formats as TransformerEngine spells a mix ("sbhd_2bshd": q sbhd, k and v bshd; any pair); None:
    "thd" for 3-D tensors, the ``layout`` of MXFP8Tensors from quantize_attention, else "sbhd"
    (TransformerEngine's default; sbhd and bshd cannot be told apart from a shape).

    The answer, for format f = "sbhd" (bshd and thd alike: "bs3hd", "t3hd", ...):
    - "sb3hd": q, k, v are slices 0, 1, 2 of one buffer [s, b, 3, h, d] (same shapes and strides, head
      stride d, k at q + h·d, v at q + 2·h·d elements, tokens at least 3·h·d apart); "sbh3d": of one
      buffer [s, b, h, 3, d] (head stride 3·d, k at q + d, v at q + 2·d);
    - "sbhd_sb2hd" / "sbhd_sbh2d": k and v are slices of one buffer [s, b, 2, h, d] / [s, b, h, 2, d]
      (q anywhere, also in the same buffer; d_v = d_qk);
    - "sbhd_sbhd_sbhd": anything else (three separate strided tensors);
    - "bhsd_bhsd_bhsd" for bhsd (TransformerEngine names no packed bhsd layout) and
      "<q>_<kv>_<kv>" for mixed formats.
    Offsets are relative (the buffer itself may start anywhere in its storage). "One buffer": the
    same torch storage (``untyped_storage().data_ptr()``) or, for numpy, the same base object or
    overlapping memory (``np.may_share_memory``). MXFP8Tensors: each direction whose codes all three
    hold gives a layout and the two must agree; with neither complete, the codes attention reads
    (Q, K rowwise, V columnwise) decide. The codes' shapes are the operands' shapes (a tensor's own
    ``shape`` is the shape it was quantized as). Under torch.compile addresses are not read and the
    answer is the unpacked name, as in TransformerEngine. The kernels read every operand through its
    own strides, so the name never changes what attention computes.

    Errors (ValueError): a rank that does not fit the format, a head dim that is not contiguous,
    d_qk differing between q and k, k and v with different tokens or heads, batch sizes that
    differ, h not a multiple of h_kv, rowwise and columnwise codes that describe different layouts;
    TypeError for a mix of torch and numpy, or of MXFP8Tensors and arrays."""
    op = _LAYOUT_OP
    mx = _operand_kind(op, q, k, v)
    q_fmt, kv_fmt = _formats(op, q, k, v, mx, qkv_format)
    if mx:
        return _mxfp8_layout(op, q, k, v, q_fmt, kv_fmt)
    return _arrays_layout(op, q, k, v, q_fmt, kv_fmt)


# ----------------------------------------------------------------------------- attention
def _mx_spec(t: MXFP8Tensor) -> str:
    """What the core needs to know about an MXFP8 operand besides its buffers, as one string (the
    custom op's schema has no list of strings): "<fp8 format>:<scale layout>:<attention layout or
    '-'>:<quantized shape, 'x'-separated>"."""
    shape = "x".join(str(int(d)) for d in t.shape)
    return f"{t.fp8_format}:{t.scale_layout}:{t.layout if t.attention else '-'}:{shape}"


def _parse_spec(spec: str) -> Tuple[str, str, Optional[str], List[int]]:
    fmt, sl, lay, shape = spec.split(":")
    return fmt, sl, None if lay == "-" else lay, [int(d) for d in shape.split("x")] if shape else []


def _core_operand(be: Backend, op: str, name: str, data: Any, scale: Any, spec: str, rowwise: bool) -> Any:
    """An operand as the core's attention and GEMM bindings take it: a bf16 descriptor (spec ""), or
    (rowwise codes, rowwise scales, columnwise codes, columnwise scales, quantized shape, fp8 format,
    scale layout, layout, attention) with `data` / `scale` as the direction read (None when absent: the
    core names the missing copy)."""
    if not spec:
        return be.desc(name, data, bf16=True)
    fmt, sl, lay, shape = _parse_spec(spec)
    direction = "rowwise" if rowwise else "columnwise"
    codes = None if data is None else be.desc(f"{name}.{direction}_data", data)
    scales = None if scale is None else be.desc(f"{name}.{direction}_scale_inv", scale,
                                                allowed="uint8 or float8_e8m0fnu scale bytes")
    pair = (codes, scales, None, None) if rowwise else (None, None, codes, scales)
    return (*pair, shape, FP8_FORMAT.parse(op, f"{name}.fp8_format", fmt),
            SCALE_LAYOUT.parse(op, f"{name}.scale_layout", sl),
            QKV_LAYOUT.parse(op, f"{name}.layout", lay or "sbhd"), lay is not None)


def _out_shapes(q_shape: Sequence[int], q_fmt: str, d_v: int) -> Tuple[List[int], List[int]]:
    """(O's shape, LSE's shape): O is q's shape with d_v columns; LSE [b, h, s_q] (thd: [h, t])."""
    o = [int(d) for d in q_shape[:-1]] + [int(d_v)]
    b, s, h, _ = _dims(q_fmt, [int(d) for d in q_shape])
    return o, ([h, s] if q_fmt == "thd" else [b, h, s])


def _attention_impl(q: Any, k: Any, v: Any, q_scale: Any, k_scale: Any, v_scale: Any, specs: Sequence[str],
                    q_fmt: str, kv_fmt: str, causal: bool, bottom_right: bool, softmax_scale: float, p_format: str,
                    cu_q: Any, cu_kv: Any, max_seqlen_q: int, max_seqlen_kv: int, return_lse: bool,
                    ml_bf16: bool = False) -> Tuple[Any, Any]:
    """Allocates O (and LSE) and calls the compiled core. q, k, v: bf16 arrays, or the codes attention
    reads (Q, K rowwise, V columnwise) with their scales and specs (_mx_spec; "" for bf16)."""
    op = _OP
    be = Backend(op, "q", q, ml_bf16=ml_bf16)
    o_shape, lse_shape = _out_shapes(q.shape, q_fmt, v.shape[-1])
    thd = q_fmt == "thd"
    o = be.empty(o_shape, "bfloat16")
    lse = be.empty(lse_shape, "float32") if return_lse else None
    if thd:  # tokens after cu_seqlens_q[-1] belong to no sequence: O = 0, LSE = -inf there
        o[...] = 0
        if lse is not None:
            lse[...] = -math.inf
    operands = [_core_operand(be, op, name, data, scale, spec, rowwise)
                for name, data, scale, spec, rowwise in (("q", q, q_scale, specs[0], True),
                                                         ("k", k, k_scale, specs[1], True),
                                                         ("v", v, v_scale, specs[2], False))]
    opts = _options(_core.AttentionOptions, q_format=ATTN_FORMAT.parse(op, "layout", q_fmt),
                    kv_format=ATTN_FORMAT.parse(op, "layout", kv_fmt), causal=causal, bottom_right=bottom_right,
                    softmax_scale=float(softmax_scale), p_format=_core.PFormat.__members__[_P_ENUM_NAME[p_format]],
                    max_seqlen_q=int(max_seqlen_q), max_seqlen_kv=int(max_seqlen_kv))
    _core.attention_forward(*operands, be.desc("o", o, bf16=True), be.opt_desc("lse", lse), opts,
                            be.opt_desc("cu_seqlens_q", cu_q), be.opt_desc("cu_seqlens_kv", cu_kv), be.stream())
    return o, lse


def _check_bf16(op: str, name: str, t: Any) -> None:
    if is_torch(t):
        ok = t.dtype == torch.bfloat16
        got = str(t.dtype).replace("torch.", "")
    else:
        ok = t.dtype == np.uint16 or t.dtype.name == "bfloat16"
        got = str(t.dtype)
    if not ok:
        raise ValueError(f"{op}: argument '{name}': dtype {got} is not supported (bfloat16: torch.bfloat16, "
                         f"ml_dtypes.bfloat16 or uint16 bits; or pass MXFP8Tensors)")


def _cu_arg(op: str, arg: str, cu: Any, like: Any) -> Any:
    """cu_seqlens as the core takes it: int32 [b + 1] of the data's kind, on the data's device (a list,
    an int64 array or a tensor on another device is converted; host values reach a CUDA device
    through pinned memory, without the stream synchronization of torch's copy from pageable memory)."""
    if isinstance(cu, (list, tuple)):
        vals = [integer(op, f"{arg}[{i}]", x) for i, x in enumerate(cu)]
        cu = np.asarray(vals, dtype=np.int64)
        if is_torch(like):
            cu = torch.from_numpy(cu)
    elif is_torch(cu) != is_torch(like) or not (is_torch(cu) or is_numpy(cu)):
        want = "torch.Tensor" if is_torch(like) else "numpy.ndarray"
        raise TypeError(f"{op}: argument '{arg}': must be a list of ints or an int32 / int64 {want} like q, got "
                        f"{type_name(cu)}")
    if is_torch(cu):
        if cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: argument '{arg}': dtype {str(cu.dtype).replace('torch.', '')} is not supported "
                             "(int32 or int64)")
        if cu.dtype == torch.int64 and cu.numel() and cu.device.type == "cpu" and not _compiling() and (
                int(cu.max()) > 2**31 - 1 or int(cu.min()) < -2**31):  # (a CUDA tensor is not read here)
            raise ValueError(f"{op}: argument '{arg}': values do not fit in int32")
        cu = cu.to(dtype=torch.int32).contiguous()
        if (cu.device.type == "cpu" and like.device.type == "cuda" and not _compiling()
                and not torch.cuda.is_current_stream_capturing()):
            return cu.pin_memory().to(like.device, non_blocking=True)  # (torch keeps the pinned block until the copy is done)
        return cu.to(device=like.device)
    if cu.dtype not in (np.int32, np.int64):
        raise ValueError(f"{op}: argument '{arg}': dtype {cu.dtype} is not supported (int32 or int64)")
    if cu.size and (cu.max() > 2**31 - 1 or cu.min() < -2**31):
        raise ValueError(f"{op}: argument '{arg}': values do not fit in int32")
    return np.ascontiguousarray(cu, dtype=np.int32)


def _scale_and_sequences(op: str, d_qk: int, softmax_scale: Any, q_fmt: str, cu_seqlens_q: Any, cu_seqlens_kv: Any,
                         max_seqlen_q: Any, max_seqlen_kv: Any, like: Any) -> Tuple[float, List[int], Any, Any]:
    """(softmax scale, [max_seqlen_q, max_seqlen_kv] (0: read cu_seqlens), cu_seqlens_q, cu_seqlens_kv as
    the core takes them) from the arguments attention and its backward share."""
    if softmax_scale is None:
        scale = d_qk ** -0.5 if d_qk > 0 else 1.0
    else:
        scale = real(op, "softmax_scale", softmax_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{op}: argument 'softmax_scale': must be a finite number > 0 (None: d_qk^-0.5), "
                             f"got {softmax_scale!r}")
    seqlens = [0 if val is None else integer(op, arg, val, minimum=0)
               for arg, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv))]
    if q_fmt == "thd":
        for arg, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is None:
                raise ValueError(f"{op}: argument '{arg}': is required for the thd format (int32 [b + 1], cumulative "
                                 "sequence lengths starting at 0)")
        cu_q = _cu_arg(op, "cu_seqlens_q", cu_seqlens_q, like)
        cu_kv = cu_q if cu_seqlens_kv is cu_seqlens_q else _cu_arg(op, "cu_seqlens_kv", cu_seqlens_kv, like)
        return scale, seqlens, cu_q, cu_kv
    for arg, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        if cu is not None:
            raise ValueError(f"{op}: argument '{arg}': is only for the thd format (layout {q_fmt!r} has a "
                             "sequence dimension; padding masks are not supported)")
    return scale, seqlens, None, None


def _layout_arg(op: str, layout: Any, q: Any, k: Any, v: Any, mx: bool, arrays: Sequence[Any]) -> Tuple[str, str, str]:
    """(layout name, q format, kv format) from the `layout` argument: None (detected), a format, or a
    full layout name (checked against the detected one)."""
    if layout is None or layout in FORMATS or layout in MIXED_FORMATS:
        q_fmt, kv_fmt = _formats(op, q, k, v, mx, layout, arg="layout")
        given = None
    elif isinstance(layout, str) and layout in LAYOUTS:
        q_fmt, kv_fmt = LAYOUTS[layout]
        given = layout
    else:
        raise ValueError(f"{op}: argument 'layout': must be None, a format ({_FORMAT_WORDS}) or a layout name "
                         f"({', '.join(repr(n) for n in LAYOUTS)}), got {layout!r}")
    if mx:
        detected = _mxfp8_layout(op, q, k, v, q_fmt, kv_fmt)
    else:
        detected = _arrays_layout(op, *arrays, q_fmt, kv_fmt)
    if given is not None and given != detected and not _compiling():
        fmt = q_fmt if q_fmt == kv_fmt else f"{q_fmt}_2{kv_fmt}"
        raise ValueError(f"{op}: argument 'layout': '{given}' does not describe these tensors: their shapes, strides "
                         f"and storage are '{detected}' (pass None or the format '{fmt}' to use what is detected)")
    return given or detected, q_fmt, kv_fmt


def attention(q: Operand, k: Operand, v: Operand, *, causal: bool = False, softmax_scale: Optional[float] = None,
              layout: Optional[str] = None, cu_seqlens_q: Union[None, Sequence[int], Array] = None,
              cu_seqlens_kv: Union[None, Sequence[int], Array] = None, max_seqlen_q: Optional[int] = None,
              max_seqlen_kv: Optional[int] = None, return_lse: bool = False, p_format: str = "bfloat16",
              bottom_right: bool = False) -> Union[Array, Tuple[Array, Array]]:
    """Attention forward on MXFP8 (or bf16) Q, K, V (SPEC §5): O = softmax(Q·Kᵀ·softmax_scale)·V.

    q [.., s_q, h, d_qk], k [.., s_kv, h_kv, d_qk], v [.., s_kv, h_kv, d_v] in one of the formats
    sbhd [s, b, h, d], bshd [b, s, h, d], bhsd [b, h, s, d] or thd [t, h, d] (packed sequences:
    cu_seqlens_q / cu_seqlens_kv, int32 [b + 1]); h a multiple of h_kv (grouped-query attention),
    d_qk and d_v multiples of 32 (the CUDA kernel: d_qk 128 or 192, d_v 128). Any strides with the
    head dim contiguous: views into one packed buffer (sb3hd, bshd_bsh2d, ...) are read in place.

    Operands: three MXFP8Tensors (Q and K with their rowwise copy, V with its columnwise copy, i.e.
    blocks of 32 along the keys; one fp8 format), or three bf16 arrays (torch.bfloat16; numpy
    ml_dtypes.bfloat16 or uint16 bits). MXFP8Tensors come from quantize_attention (sbhd / bshd,
    compact or BHSD scales) or from quantize (compact or swizzled scales) of the operand itself or
    of its [tokens, h*d] view; the codes must then have the operand's shape (e.g. a V quantized as
    [t, h*d] for thd, its codes viewed as [t, h, d]; ``shape`` stays the quantized one). The CUDA
    kernel needs V's columnwise blocks to run along the keys (quantize_attention; quantize of
    [tokens, h*d] for bshd / thd or of [b, h, s, d] for bhsd).
    MXFP8 values are dequantized exactly. numpy runs the CPU reference (float64), torch tensors the
    reference (CPU) or the SM90 kernel (CUDA, torch's current stream).

    layout: None (detected with qkv_layout: 3-D is thd, MXFP8 tensors from quantize_attention say
    their format, otherwise sbhd), a format ("sbhd", "bshd", "bhsd", "thd", or a mix of two
    without thd such as "sbhd_2bshd": q sbhd, k and v bshd), or a TransformerEngine layout name
    ("sb3hd", "bshd_bsh2d", "sbhd_bshd_bshd", ...), which must be what qkv_layout detects.
    softmax_scale: None is d_qk^-0.5; DeepSeek-V3 with YaRN uses ``yarn_softmax_scale()``
    (0.135234 for d_qk 192). causal: key j is visible to query i iff
    j <= i (top-left), or j <= i + s_kv - s_q with bottom_right=True (per sequence for thd).
    p_format: "bfloat16" (default: P enters the P·V GEMM in bf16) or "e4m3" (the reference
    system's E4M3 P, p·2^8 rounded to E4M3 then / 2^8, online over blocks of 128 keys).
    max_seqlen_q / max_seqlen_kv (thd): upper bounds of the sequence lengths; None reads
    cu_seqlens (on a GPU a synchronizing copy). On a GPU, given bounds are not checked against
    cu_seqlens (that would need the copy): a sequence longer than its bound gets undefined results,
    and the kernels still stay inside the tensors. With both bounds, a CUDA call does not
    synchronize the stream, also when cu_seqlens is a host list or a CPU tensor (it reaches the GPU
    through pinned memory).

    Returns O (bf16, q's format and shape with d_v columns, contiguous; numpy: ml_dtypes.bfloat16
    for ml_dtypes inputs, else uint16 bits), and with return_lse also LSE = max + ln(sum) (float32,
    natural log, [b, h, s_q]; thd [h, t]). A row with no visible key gets O = 0, LSE = -inf; thd
    tokens after cu_seqlens_q[-1] too. Not differentiable yet: an input that requires grad (grad
    mode on) is an error."""
    op = _OP
    causal = flag(op, "causal", causal)
    bottom_right = flag(op, "bottom_right", bottom_right)
    return_lse = flag(op, "return_lse", return_lse)
    p_format = _p_format(op, p_format)
    if bottom_right and not causal:
        raise ValueError(f"{op}: argument 'bottom_right': aligns the causal mask; it needs causal=True")
    mx = _operand_kind(op, q, k, v)
    if mx:
        arrays, scales = [], []
        for name, t, direction in (("q", q, "rowwise"), ("k", k, "rowwise"), ("v", v, "columnwise")):
            data, scale = getattr(t, f"{direction}_data"), getattr(t, f"{direction}_scale_inv")
            if data is None or scale is None:
                why = "blocks of 32 along the head dim" if direction == "rowwise" else "blocks of 32 along the keys"
                raise ValueError(f"{op}: argument '{name}': has no {direction} data: attention reads "
                                 f"{'Q and K' if name != 'v' else 'V'} through the {direction} copy ({why}); "
                                 f"quantize with {direction}=True")
            kind_of(op, f"{name}.{direction}_data", data)
            if is_torch(data) != is_torch(scale):
                raise TypeError(f"{op}: argument '{name}.{direction}_scale_inv': expected a "
                                f"{'torch.Tensor' if is_torch(data) else 'numpy.ndarray'} like its codes, got "
                                f"{type_name(scale)}")
            arrays.append(data), scales.append(scale)
        for name, t in (("k", k), ("v", v)):
            if t.fp8_format != q.fp8_format:
                raise ValueError(f"{op}: argument '{name}': fp8_format '{t.fp8_format}' differs from q's "
                                 f"'{q.fp8_format}' (Q, K and V share one FP8 format)")
        specs = [_mx_spec(t) for t in (q, k, v)]
    else:
        arrays, scales, specs = [q, k, v], [None, None, None], ["", "", ""]
        for name, t in zip("qkv", arrays):
            _check_bf16(op, name, t)
    torch_kind = is_torch(arrays[0])
    for name, a in zip("kv", arrays[1:]):
        if is_torch(a) != torch_kind:
            raise TypeError(f"{op}: argument '{name}': mixes torch and numpy buffers with q's")
    _, q_fmt, kv_fmt = _layout_arg(op, layout, q, k, v, mx, arrays)
    if (q_fmt == "thd") != (kv_fmt == "thd"):
        raise ValueError(f"{op}: argument 'layout': q in {q_fmt} and k / v in {kv_fmt}: packed sequences (thd) are "
                         "supported for q, k and v together only")
    scale, seqlens, cu_q, cu_kv = _scale_and_sequences(op, int(arrays[0].shape[-1]), softmax_scale, q_fmt,
                                                       cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                                       arrays[0])
    if torch_kind:
        if not mx:
            not_differentiable(op, _NOT_DIFF, q=q, k=k, v=v)
        o, lse = _dispatch.call("attention", arrays[0], arrays[1], arrays[2], scales[0], scales[1], scales[2], specs[0],
                                specs[1], specs[2], q_fmt, kv_fmt, causal, bottom_right, scale, p_format,
                                cu_q, cu_kv, seqlens[0], seqlens[1], return_lse)
    else:
        ml_bf16 = not mx and arrays[0].dtype.name == "bfloat16" and arrays[0].dtype != np.uint16
        o, lse = _attention_impl(arrays[0], arrays[1], arrays[2], *scales, specs, q_fmt, kv_fmt, causal, bottom_right,
                                 scale, p_format, cu_q, cu_kv, seqlens[0], seqlens[1], return_lse, ml_bf16=ml_bf16)
    return (o, lse) if return_lse else o


def _p_format(op: str, value: Any) -> str:
    """The p_format spelling ("bfloat16" or "e4m3") of a string or a bound PFormat member."""
    if isinstance(value, _core.PFormat):
        return "bfloat16" if value.name == "bf16" else value.name
    if isinstance(value, str) and value in _P_ENUM_NAME:
        return "bfloat16" if value == "bf16" else value
    raise ValueError(f"{op}: argument 'p_format': must be {one_of(P_FORMATS)}, got {value!r}")
