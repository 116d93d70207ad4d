"""MXFP8 (SPEC §2): the MXFP8Tensor result type, quantize / dequantize, scale re-layouts and the
attention hand-off (quantize_attention, attention_scales_to_bhsd, to_bhsd).

Each public op checks its Python arguments once (``_checks``), then either calls the torch custom
op ``torch.ops.mxmla.<op>`` (torch tensors: traceable by torch.compile, see ``_torch_ops``) or the
plain path below (numpy arrays). Both end in the same ``_*_impl`` function, which allocates the
outputs and calls the compiled core with one options struct.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _dispatch
from . import _mxmla_core as _core
from ._backend import (
    Backend,
    alloc_outputs,
    is_numpy,
    is_torch,
    kind_of,
    ml_dtypes_module,
    output_descs,
    torch,
    type_name,
)
from ._checks import (
    FP8_FORMAT,
    QKV_LAYOUT,
    SCALE_LAYOUT,
    choice,
    directions,
    flag,
    int_list,
    integer,
    not_differentiable,
    optional_flag,
    same_kind,
)

if TYPE_CHECKING:
    import torch as _torch_t

    Array = Union[_torch_t.Tensor, np.ndarray]
    DTypeLike = Union[str, _torch_t.dtype, np.dtype, type]
else:
    Array = Any
    DTypeLike = Any

_NOT_DIFF = "MXFP8 codes are not differentiable"


def _options(cls: Any, **fields: Any) -> Any:
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def _present(outs: Sequence[Any], rowwise: bool, columnwise: bool) -> tuple:
    """The custom ops return empty placeholders for a direction that is off: None here."""
    rd, rs, cd, cs = outs
    return (rd if rowwise else None, rs if rowwise else None, cd if columnwise else None, cs if columnwise else None)


# ----------------------------------------------------------------------------- MXFP8Tensor
@dataclass(repr=False)
class MXFP8Tensor:
    """Quantized codes (uint8, the input's shape) and E8M0 scales (uint8), per direction.

    Compact scales: rowwise [M, K/32], columnwise [ceil(M/32), K] (M = product of leading dims).
    Swizzled scales (swizzle=True): the cuBLAS F8_128x4 layout, padded with zeros to
    [round_up(M,128), round_up(K/32,4)] and [round_up(ceil(M/32),4), round_up(K,128)].
    BHSD scales (quantize_attention): [b, h, round_up(s,128), round_up(d/32,4)] and
    [b, h, round_up(ceil(s/32),4), round_up(d,128)], swizzled per (b, h).

    The buffers are stored as uint8, as TransformerEngine stores them; ``view_fp8()`` gives the same
    buffers typed (torch.float8_e4m3fn / float8_e5m2 codes and float8_e8m0fnu scales, or the
    ml_dtypes types for numpy), ``to_te_kwargs()`` hands them to TransformerEngine's MXFP8Tensor
    and ``scaled_mm_args()`` to ``torch._scaled_mm``.
    """

    shape: tuple
    fp8_format: str
    scale_layout: str  # "compact" | "swizzled" | "bhsd"
    rowwise_data: Any = None
    rowwise_scale_inv: Any = None
    columnwise_data: Any = None
    columnwise_scale_inv: Any = None
    layout: str = "sbhd"  # token layout of an attention tensor
    attention: bool = False

    # -- description
    def _buffers(self) -> List[Any]:
        return [b for b in (self.rowwise_data, self.rowwise_scale_inv, self.columnwise_data, self.columnwise_scale_inv)
                if b is not None]

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    @property
    def device(self) -> Any:
        """The buffers' torch.device ('cpu' for numpy buffers)."""
        bufs = self._buffers()
        if bufs and is_torch(bufs[0]):
            return bufs[0].device
        return torch.device("cpu") if torch is not None else "cpu"

    @property
    def fp8_dtype(self) -> Any:
        """The codes' dtype: torch.float8_e4m3fn / torch.float8_e5m2 (numpy buffers: the ml_dtypes types)."""
        bufs = self._buffers()
        if bufs and is_numpy(bufs[0]) or torch is None:
            m = ml_dtypes_module()
            return m.float8_e4m3fn if self.fp8_format == "e4m3" else m.float8_e5m2
        return torch.float8_e4m3fn if self.fp8_format == "e4m3" else torch.float8_e5m2

    @property
    def scale_dtype(self) -> Any:
        """The scales' dtype: torch.float8_e8m0fnu (numpy buffers: ml_dtypes.float8_e8m0fnu)."""
        bufs = self._buffers()
        if bufs and is_numpy(bufs[0]) or torch is None:
            return ml_dtypes_module().float8_e8m0fnu
        return torch.float8_e8m0fnu

    def __repr__(self) -> str:
        dirs = "+".join(d for d, b in (("rowwise", self.rowwise_data), ("columnwise", self.columnwise_data))
                        if b is not None) or "empty"
        bufs = self._buffers()
        if bufs and is_torch(bufs[0]):
            where = f"device='{bufs[0].device}'"
        else:
            where = "numpy"
        att = f", attention='{self.layout}'" if self.attention else ""
        return (f"MXFP8Tensor(shape={tuple(self.shape)}, fp8_format='{self.fp8_format}', "
                f"scale_layout='{self.scale_layout}'{att}, {dirs}, {where})")

    # -- conversions
    def dequantize(self, dtype: DTypeLike = "float32", columnwise: Optional[bool] = None) -> Array:
        """Dequantize one direction (rowwise when present, unless columnwise=True)."""
        return dequantize(self, dtype=dtype, columnwise=columnwise)

    def _view_all(self, codes: Any, scales: Any) -> "MXFP8Tensor":
        v = lambda b, dt: None if b is None else b.view(dt)  # noqa: E731
        return MXFP8Tensor(self.shape, self.fp8_format, self.scale_layout, v(self.rowwise_data, codes),
                           v(self.rowwise_scale_inv, scales), v(self.columnwise_data, codes),
                           v(self.columnwise_scale_inv, scales), layout=self.layout, attention=self.attention)

    def view_fp8(self) -> "MXFP8Tensor":
        """The same buffers (no copy) typed: codes as fp8_dtype, scales as scale_dtype."""
        return self._view_all(self.fp8_dtype, self.scale_dtype)

    def view_uint8(self) -> "MXFP8Tensor":
        """The same buffers (no copy) as raw bytes (uint8), the stored form."""
        u8 = torch.uint8 if self._buffers() and is_torch(self._buffers()[0]) else np.uint8
        return self._view_all(u8, u8)

    def to_te_kwargs(self, dtype: Any = None, attributes: bool = False) -> Dict[str, Any]:
        """TransformerEngine's MXFP8Tensor fields for these buffers (torch only), as keyword arguments of
        ``transformer_engine.pytorch.MXFP8Tensor(**q.to_te_kwargs())`` (``attributes=True``: TE's
        attribute names ``_rowwise_data``, ``_rowwise_scale_inv``, ``_columnwise_data``,
        ``_columnwise_scale_inv``, ``_fp8_dtype``, ``_with_gemm_swizzled_scales`` instead).

        Codes are handed over as they are (uint8, no copy). Scales, per scale layout:
        - "swizzled": as they are (already TE's padded shapes [round_up(M,128), round_up(K/32,4)] /
          [round_up(ceil(M/32),4), round_up(K,128)], F8_128x4), ``with_gemm_swizzled_scales=True``;
        - "compact" (quantize): copied into zero-padded buffers of those shapes, the layout TE's
          MXFP8Quantizer allocates (TE sizes the columnwise rows as floor(M/32); they agree for
          M % 32 == 0), ``with_gemm_swizzled_scales=False``;
        - attention "compact": 4-D views (no copy) as TE's fused Q up-projection and
          ``mxfp8_quantize_only`` wrap them: rowwise [..., d/32] in q's shape, columnwise
          [ceil(s/32), b, h, d] (sbhd) / [b, ceil(s/32), h, d] (bshd), ``with_gemm_swizzled_scales=False``;
        - "bhsd": 2-D views [-1, last] (no copy) as TE's ``mxfp8_transpose_swizzle`` leaves them,
          ``with_gemm_swizzled_scales=True``.
        ``fp8_dtype`` is TE's DType when transformer_engine is importable, else the torch fp8 dtype;
        ``dtype`` (the nominal dtype) defaults to torch.bfloat16; ``quantizer`` is None, ``device`` the
        buffers'."""
        attributes = flag("mxmla.MXFP8Tensor.to_te_kwargs", "attributes", attributes)
        bufs = self._buffers()
        if not bufs or not is_torch(bufs[0]):
            raise TypeError("mxmla.MXFP8Tensor.to_te_kwargs: TransformerEngine takes torch tensors; these buffers are "
                            f"{type_name(bufs[0]) if bufs else 'absent'}")
        rs, cs = self.rowwise_scale_inv, self.columnwise_scale_inv
        if self.scale_layout == "swizzled":
            swizzled = True
        elif self.scale_layout == "bhsd":
            swizzled = True
            rs = None if rs is None else rs.view(-1, rs.shape[-1])
            cs = None if cs is None else cs.view(-1, cs.shape[-1])
        elif self.attention:  # compact attention scales: TE's 4-D views
            swizzled = False
            if self.layout == "sbhd":
                s, b, h, d = self.shape
                cshape = (-(-s // 32), b, h, d)
            else:
                b, s, h, d = self.shape
                cshape = (b, -(-s // 32), h, d)
            rs = None if rs is None else rs.view(*self.shape[:-1], self.shape[-1] // 32)
            cs = None if cs is None else cs.view(cshape)
        else:  # compact: TE's padded allocation
            swizzled = False
            M = 1
            for d in self.shape[:-1]:
                M *= int(d)
            K = int(self.shape[-1])
            _, prs, pcs = _core.quantize_shapes([M, K], True, "mxmla.MXFP8Tensor.to_te_kwargs", "shape")

            def padded(src: Any, shape: Sequence[int]) -> Any:
                out = src.new_zeros(tuple(shape))
                out[: src.shape[0], : src.shape[1]].copy_(src)
                return out

            rs = None if rs is None else padded(rs, prs)
            cs = None if cs is None else padded(cs, pcs)
        fp8 = self.fp8_dtype
        try:  # TE's own enum when TE is installed
            from transformer_engine.pytorch.constants import TE_DType  # type: ignore

            fp8 = TE_DType[fp8]
        except Exception:
            pass
        fields = {"rowwise_data": self.rowwise_data, "rowwise_scale_inv": rs, "columnwise_data": self.columnwise_data,
                  "columnwise_scale_inv": cs, "fp8_dtype": fp8, "with_gemm_swizzled_scales": swizzled}
        if attributes:
            return {"_" + k: v for k, v in fields.items()}
        fields.update(shape=tuple(self.shape), dtype=torch.bfloat16 if dtype is None else dtype, quantizer=None,
                      requires_grad=False, device=bufs[0].device)
        return fields

    def scaled_mm_args(self, other: "MXFP8Tensor") -> Tuple[Any, Any, Any, Any]:
        """(a, b, scale_a, scale_b) for ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`` computing
        self @ other^T (a Linear: x [M, K] and a weight [N, K], both quantized rowwise, i.e. along K):
        a = self's rowwise codes as [M, K] float8 (row-major), b = other's rowwise codes transposed to
        [K, N] (column-major, no copy), scales float8_e8m0fnu in the F8_128x4 layout torch wants for MX
        block scaling ([round_up(M,128), round_up(K/32,4)] and [round_up(N,128), round_up(K/32,4)];
        compact scales are swizzled first, swizzled ones passed as they are). torch runs MX
        scaled_mm on SM100 only: on Hopper and on the CPU torch raises."""
        op = "mxmla.MXFP8Tensor.scaled_mm_args"
        if not isinstance(other, MXFP8Tensor):
            raise TypeError(f"{op}: argument 'other': expected an MXFP8Tensor, got {type_name(other)}")
        args = []
        for name, t in (("self", self), ("other", other)):
            if t.rowwise_data is None or not is_torch(t.rowwise_data):
                raise ValueError(f"{op}: argument '{name}': needs rowwise torch buffers (quantize(..., rowwise=True) "
                                 "of a torch tensor)")
            if t.attention or t.scale_layout not in ("compact", "swizzled"):
                raise ValueError(f"{op}: argument '{name}': scale layout '{t.scale_layout}'"
                                 f"{' (attention)' if t.attention else ''} is not a GEMM operand; use quantize()")
            K = int(t.shape[-1])
            M = t.rowwise_data.numel() // max(K, 1)
            codes = t.rowwise_data.view(M, K).view(t.fp8_dtype)
            sc = t.rowwise_scale_inv
            if t.scale_layout == "compact":
                sc = swizzle_scales(sc, M, K, rowwise=True)
            args.append((codes, sc.view(torch.float8_e8m0fnu), K))
        (a, sa, ka), (b, sb, kb) = args
        if ka != kb:
            raise ValueError(f"{op}: argument 'other': K = {kb} does not match K = {ka} of self")
        return a, b.t(), sa, sb


# ----------------------------------------------------------------------------- implementations (numpy or torch)
def _quantize_impl(x: Any, rowwise: bool, columnwise: bool, fp8_format: str, swizzle: bool) -> tuple:
    op = "mxmla.quantize"
    be = Backend(op, "x", x)
    xd = be.desc("x", x, bf16=True)
    outs = alloc_outputs(be, _core.quantize_shapes(xd[2], swizzle, op, "x"), rowwise, columnwise)
    o = _options(_core.QuantizeOptions, rowwise=rowwise, columnwise=columnwise, format=FP8_FORMAT.parse(op, "fp8_format", fp8_format),
                 swizzle=swizzle)
    _core.quantize(xd, *output_descs(be, outs), o, be.stream())
    return outs


def _cat_shape(op: str, arg: str, x: Any, x2: Any) -> list:
    """The shape of torch.cat([x, x2], -1) of two 4-D parts (the C++ API checks the parts' other rules)."""
    s0, s1 = [int(v) for v in x.shape], [int(v) for v in x2.shape]
    for i, s in enumerate((s0, s1)):
        if len(s) != 4:
            raise ValueError(f"{op}: argument '{arg}[{i}]': must be 4-D ([s, b, h, d] or [b, s, h, d]), got shape "
                             f"{tuple(s)}")
    if s0[:-1] != s1[:-1]:
        raise ValueError(f"{op}: argument '{arg}[1]': shape {tuple(s1)} must match {arg}[0]'s {tuple(s0)} but in the "
                         "last dimension")
    return s0[:-1] + [s0[-1] + s1[-1]]


def _quantize_attention_impl(x: Any, layout: str, rowwise: bool, columnwise: bool, fp8_format: str,
                             bhsd_scales: bool, x2: Any = None) -> tuple:
    op = "mxmla.quantize_attention"
    be = Backend(op, "x", x)
    xd = be.desc("x" if x2 is None else "x[0]", x, bf16=True)
    x2d = None if x2 is None else be.desc("x[1]", x2, bf16=True)
    shape = xd[2] if x2 is None else _cat_shape(op, "x", x, x2)
    lay = QKV_LAYOUT.parse(op, "layout", layout)
    outs = alloc_outputs(be, _core.attention_shapes(shape, lay, bhsd_scales, op, "x"), rowwise, columnwise)
    o = _options(_core.AttentionQuantizeOptions, layout=lay, rowwise=rowwise, columnwise=columnwise,
                 format=FP8_FORMAT.parse(op, "fp8_format", fp8_format), bhsd_scales=bhsd_scales)
    _core.quantize_attention(xd, *output_descs(be, outs), o, be.stream(), x2d)
    return outs


def _dequantize_impl(data: Any, scale: Any, shape: Sequence[int], fp8_format: str, scale_layout: str, columnwise: bool,
                     attention: bool, layout: str, dtype: str, ml_bf16: bool = False) -> Any:
    op = "mxmla.dequantize"
    which = "columnwise" if columnwise else "rowwise"
    be = Backend(op, f"q.{which}_data", data, ml_bf16=ml_bf16)
    out = be.empty(shape, dtype)
    o = _options(_core.DequantizeOptions, shape=[int(s) for s in shape], format=FP8_FORMAT.parse(op, "q.fp8_format", fp8_format),
                 scale_layout=SCALE_LAYOUT.parse(op, "q.scale_layout", scale_layout),
                 qkv_layout=QKV_LAYOUT.parse(op, "q.layout", layout),
                 attention=attention, columnwise=columnwise)
    _core.dequantize(be.desc(f"q.{which}_data", data), be.desc(f"q.{which}_scale_inv", scale),
                     be.desc("out", out, bf16=True), o, be.stream())
    return out


def _swizzle_impl(scales: Any, M: int, K: int, rowwise: bool, to_swizzled: bool) -> Any:
    op = "mxmla.swizzle_scales" if to_swizzled else "mxmla.unswizzle_scales"
    be = Backend(op, "scales", scales)
    shapes = _core.quantize_shapes([M, K], to_swizzled, op, "K")
    out = be.empty(shapes[1] if rowwise else shapes[2], "uint8")
    sd = be.desc("scales", scales, allowed="uint8 or float8_e8m0fnu scale bytes")
    fn = _core.swizzle_scales if to_swizzled else _core.unswizzle_scales
    fn(sd, be.desc("out", out), M, K, rowwise, be.stream())
    return out


def _bhsd_impl(op: str, scales: Sequence[Any], shapes: Sequence[Sequence[int]], layouts: Sequence[str],
               rowwise: Sequence[bool], names: Sequence[str], shape_names: Sequence[str]) -> list:
    """Phase two for several compact attention scale tensors in one launch; names / shape_names:
    the Python arguments the scales and shapes came from (for errors)."""
    if not scales:
        return []
    be = Backend(op, names[0], scales[0])
    jobs, outs = [], []
    for src, shape, lay, rw, name, shape_name in zip(scales, shapes, layouts, rowwise, names, shape_names):
        shape = [int(s) for s in shape]
        lay_e = QKV_LAYOUT.parse(op, "layout", lay)
        sh = _core.attention_shapes(shape, lay_e, True, op, shape_name)
        dst = be.empty(sh[1] if rw else sh[2], "uint8")
        jobs.append((be.desc(name, src, allowed="uint8 or float8_e8m0fnu scale bytes"), be.desc("out", dst), shape,
                     lay_e, rw, name))
        outs.append(dst)
    _core.attention_scales_to_bhsd(jobs, op, be.stream())
    return outs


def _to_bhsd_names(index: Sequence[int], rowwise: Sequence[bool]) -> Tuple[list, list]:
    names = [f"tensors[{i}].{'rowwise' if rw else 'columnwise'}_scale_inv" for i, rw in zip(index, rowwise)]
    return names, [f"tensors[{i}].shape" for i in index]


# ----------------------------------------------------------------------------- public ops
def quantize(x: Array, rowwise: bool = True, columnwise: bool = True, fp8_format: str = "e4m3",
             swizzle: bool = False) -> MXFP8Tensor:
    """MXFP8-quantize x ([..., K], K a multiple of 32) rowwise and/or columnwise in one pass.

    torch tensors (CPU or CUDA; CUDA work on torch's current stream) or numpy arrays (float32,
    float16, bfloat16 as ml_dtypes.bfloat16 or uint16 bits). Not differentiable: an x that requires
    grad (grad mode on) is an error."""
    op = "mxmla.quantize"
    rowwise, columnwise = flag(op, "rowwise", rowwise), flag(op, "columnwise", columnwise)
    fmt = choice(op, "fp8_format", fp8_format, FP8_FORMAT)
    swizzle = flag(op, "swizzle", swizzle)
    directions(op, rowwise, columnwise)
    if kind_of(op, "x", x) == "torch":
        not_differentiable(op, _NOT_DIFF, x=x)
        outs = _present(_dispatch.call("quantize", x, rowwise, columnwise, fmt, swizzle), rowwise, columnwise)
    else:
        outs = _quantize_impl(x, rowwise, columnwise, fmt, swizzle)
    return MXFP8Tensor(tuple(x.shape), fmt, "swizzled" if swizzle else "compact", *outs)


def quantize_attention(x: Array, layout: str = "sbhd", rowwise: bool = True, columnwise: bool = True,
                       fp8_format: str = "e4m3", bhsd_scales: bool = True) -> MXFP8Tensor:
    """Quantize Q/K/V given as [s, b, h, d] (sbhd) or [b, s, h, d] (bshd) for attention.

    Codes keep x's layout; columnwise blocks run along s inside each sequence. With
    bhsd_scales=True the scales come out in BHSD order, swizzled and zero-padded, in one call (on
    the GPU: compact scales to scratch, then the BHSD re-layout kernel); with False they are
    compact (phase one of two; see attention_scales_to_bhsd / to_bhsd). Not differentiable.

    x's last dimension must be contiguous; its other strides are free (V as a view of a fused K/V
    projection's output needs no copy). x may also be a pair (x0, x1): the tensor
    torch.cat([x0, x1], -1), read in place without being made — e.g. DeepSeek-V3's K from k_nope and
    the shared k_pe expanded over the heads (a stride of 0) — with the same codes and scales as
    quantizing the concatenation; x0's last dimension a multiple of 8 (bf16 / fp16) or 4 (fp32)."""
    op = "mxmla.quantize_attention"
    lay = choice(op, "layout", layout, QKV_LAYOUT)
    rowwise, columnwise = flag(op, "rowwise", rowwise), flag(op, "columnwise", columnwise)
    fmt = choice(op, "fp8_format", fp8_format, FP8_FORMAT)
    bhsd_scales = flag(op, "bhsd_scales", bhsd_scales)
    directions(op, rowwise, columnwise)
    x, x2 = _parts(op, "x", x)
    kind = kind_of(op, "x" if x2 is None else "x[0]", x)
    if x2 is not None:
        same_kind(op, "x[0]", x, **{"x[1]": x2})
    if kind == "torch":
        if x2 is None:
            not_differentiable(op, _NOT_DIFF, x=x)
            outs = _dispatch.call("quantize_attention", x, lay, rowwise, columnwise, fmt, bhsd_scales)
        else:
            not_differentiable(op, _NOT_DIFF, **{"x[0]": x, "x[1]": x2})
            outs = _dispatch.call("quantize_attention_cat", x, x2, lay, rowwise, columnwise, fmt, bhsd_scales)
        outs = _present(outs, rowwise, columnwise)
    else:
        outs = _quantize_attention_impl(x, lay, rowwise, columnwise, fmt, bhsd_scales, x2)
    shape = tuple(x.shape) if x2 is None else tuple(_cat_shape(op, "x", x, x2))
    return MXFP8Tensor(shape, fmt, "bhsd" if bhsd_scales else "compact", *outs, layout=lay, attention=True)


def _parts(op: str, arg: str, x: Any) -> Tuple[Any, Any]:
    """(x, None) for one tensor; (x0, x1) for a pair that stands for torch.cat([x0, x1], -1)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{op}: argument '{arg}': a sequence stands for torch.cat of two parts along the last "
                             f"dimension; got {len(x)} items")
        return x[0], x[1]
    return x, None


def _dtype_name(op: str, dtype: Any, arg: str = "dtype") -> Tuple[str, bool]:
    """('float32' | 'bfloat16', numpy result as ml_dtypes.bfloat16?) of a dtype given as a string,
    torch dtype, numpy dtype or ml_dtypes.bfloat16 (errors name argument `arg`)."""
    if isinstance(dtype, str):
        name = dtype
    elif torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            nd = np.dtype(dtype)
        except TypeError:
            nd = None
        name = None if nd is None else nd.name
        if name == "bfloat16":
            return "bfloat16", True
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"{op}: argument '{arg}': must be float32 or bfloat16 (a string, torch dtype, numpy dtype "
                         f"or ml_dtypes.bfloat16), got {dtype!r}")
    return name, False


def dequantize(q: MXFP8Tensor, dtype: DTypeLike = "float32", columnwise: Optional[bool] = None) -> Array:
    """codes * 2^(scale-127) of one direction (rowwise when present, unless columnwise=True), as
    float32 or bfloat16. numpy: dtype "bfloat16" gives uint16 bits, ml_dtypes.bfloat16 an
    ml_dtypes array."""
    op = "mxmla.dequantize"
    if not isinstance(q, MXFP8Tensor):
        hint = "; the dtype is the second argument: dequantize(q, dtype)" if isinstance(q, (str, type, np.dtype)) or (
            torch is not None and isinstance(q, torch.dtype)) else ""
        raise TypeError(f"{op}: argument 'q': expected an MXFP8Tensor (from quantize, quantize_attention, "
                        f"rope_backward_quantize or fused_q_uproj_rope_quant), got {type_name(q)} {q!r}{hint}")
    columnwise = optional_flag(op, "columnwise", columnwise)
    if columnwise is None:
        columnwise = q.rowwise_data is None
    name, ml_bf16 = _dtype_name(op, dtype)
    data = q.columnwise_data if columnwise else q.rowwise_data
    scale = q.columnwise_scale_inv if columnwise else q.rowwise_scale_inv
    which = "columnwise" if columnwise else "rowwise"
    if data is None or scale is None:
        raise ValueError(f"{op}: argument 'q': has no {which} data (quantized with {which}=False)")
    fmt = choice(op, "q.fp8_format", q.fp8_format, FP8_FORMAT)
    sl = choice(op, "q.scale_layout", q.scale_layout, SCALE_LAYOUT)
    lay = choice(op, "q.layout", q.layout, QKV_LAYOUT)
    shape = int_list(op, "q.shape", q.shape)
    if kind_of(op, f"q.{which}_data", data) == "torch":
        if not is_torch(scale):
            raise TypeError(f"{op}: argument 'q.{which}_scale_inv': expected a torch.Tensor like q.{which}_data, "
                            f"got {type_name(scale)}")
        return _dispatch.call("dequantize", data, scale, shape, fmt, sl, columnwise, bool(q.attention), lay,
                              getattr(torch, name))
    return _dequantize_impl(data, scale, shape, fmt, sl, columnwise, bool(q.attention), lay, name, ml_bf16)


def _scale_conversion(op: str, scales: Any, M: Any, K: Any, rowwise: Any, to_swizzled: bool) -> Any:
    M, K = integer(op, "M", M, minimum=0), integer(op, "K", K)
    rowwise = flag(op, "rowwise", rowwise)
    if kind_of(op, "scales", scales) == "torch":
        return _dispatch.call("swizzle_scales" if to_swizzled else "unswizzle_scales", scales, M, K, rowwise)
    return _swizzle_impl(scales, M, K, rowwise, to_swizzled)


def swizzle_scales(scales: Array, M: int, K: int, rowwise: bool = True) -> Array:
    """Compact scales of an [M, K] tensor -> F8_128x4 swizzled, zero-padded."""
    return _scale_conversion("mxmla.swizzle_scales", scales, M, K, rowwise, True)


def unswizzle_scales(scales: Array, M: int, K: int, rowwise: bool = True) -> Array:
    """F8_128x4 swizzled scales of an [M, K] tensor -> compact."""
    return _scale_conversion("mxmla.unswizzle_scales", scales, M, K, rowwise, False)


def attention_scales_to_bhsd(scales: Array, shape: Sequence[int], layout: str = "sbhd", rowwise: bool = True) -> Array:
    """Phase two: compact attention scales (quantize_attention(..., bhsd_scales=False)) of a Q/K/V of
    4-D `shape` -> BHSD swizzled."""
    op = "mxmla.attention_scales_to_bhsd"
    shape = int_list(op, "shape", shape)
    lay = choice(op, "layout", layout, QKV_LAYOUT)
    rowwise = flag(op, "rowwise", rowwise)
    if kind_of(op, "scales", scales) == "torch":
        return _dispatch.call("attention_scales_to_bhsd", scales, shape, lay, rowwise)
    return _bhsd_impl(op, [scales], [shape], [lay], [rowwise], ["scales"], ["shape"])[0]


def to_bhsd(*tensors: MXFP8Tensor) -> List[MXFP8Tensor]:
    """Phase two for several tensors at once (e.g. Q, K, V): compact attention scales -> BHSD,
    both directions, in one launch. Returns new MXFP8Tensors sharing the codes."""
    op = "mxmla.to_bhsd"
    scales, shapes, layouts, rowwise, index = [], [], [], [], []
    first = None
    for i, q in enumerate(tensors):
        if not isinstance(q, MXFP8Tensor) or not q.attention or q.scale_layout != "compact":
            got = type_name(q) if not isinstance(q, MXFP8Tensor) else repr(q)
            raise ValueError(f"{op}: argument 'tensors[{i}]': must come from quantize_attention(..., bhsd_scales=False) "
                             f"(compact attention scales), got {got}")
        lay = choice(op, f"tensors[{i}].layout", q.layout, QKV_LAYOUT)
        shape = int_list(op, f"tensors[{i}].shape", q.shape)
        for src, rw in ((q.rowwise_scale_inv, True), (q.columnwise_scale_inv, False)):
            if src is None:
                continue
            if first is None:
                first = src
            elif is_torch(src) != is_torch(first):
                raise TypeError(f"{op}: argument 'tensors[{i}]': mixes torch and numpy buffers with the other tensors")
            scales.append(src), shapes.append(shape), layouts.append(lay), rowwise.append(rw), index.append(i)
    if first is None:
        outs = []
    elif is_torch(first):
        flat = [int(d) for s in shapes for d in s]
        outs = _dispatch.call("to_bhsd", scales, flat, [lay == "bshd" for lay in layouts], rowwise, index)
    else:
        outs = _bhsd_impl(op, scales, shapes, layouts, rowwise, *_to_bhsd_names(index, rowwise))
    result, k = [], 0
    for q in tensors:
        rs = cs = None
        if q.rowwise_scale_inv is not None:
            rs, k = outs[k], k + 1
        if q.columnwise_scale_inv is not None:
            cs, k = outs[k], k + 1
        result.append(MXFP8Tensor(q.shape, q.fp8_format, "bhsd", q.rowwise_data, rs, q.columnwise_data, cs,
                                  layout=q.layout, attention=True))
    return result
