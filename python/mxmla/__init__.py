"""mxmla: MXFP8 quantization for MLA training (TransformerEngine-compatible semantics).

Every op accepts torch tensors (CPU or CUDA; CUDA work runs on torch's current stream) and numpy
arrays (float32, float16, and bfloat16 given as uint16 bit patterns), and returns the same kind.
CPU data runs the CPU reference, CUDA data the sm_90a kernels. This layer only checks,
allocates and calls the compiled core; the rules live in C++ and their errors are ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from . import _mxmla_core as _core

__all__ = [
    "MXFP8Tensor",
    "quantize",
    "dequantize",
    "swizzle_scales",
    "unswizzle_scales",
    "quantize_attention",
    "attention_scales_to_bhsd",
    "to_bhsd",
    "info",
    "apply_rope",
    "rope_backward",
    "rope_backward_quantize",
    "rope_tables",
    "rope_inv_freq",
    "yarn_softmax_scale",
    "positions_arange",
    "positions_from_cu_seqlens",
    "positions_context_parallel",
    "DEEPSEEK_V3_YARN",
    "fused_q_uproj_rope_quant",
    "FusedMLAQUpProjRopeQuant",
    "register_torch_op",
]

__version__ = _core.build_info()[0]

_FORMATS = ("e4m3", "e5m2")


# ----------------------------------------------------------------------------- backends
def _is_torch(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch")


class _Backend:
    """Allocation and descriptors for one array kind (torch or numpy) on one device."""

    def __init__(self, like: Any):
        self.torch = _is_torch(like)
        if self.torch:
            import torch

            self._t = torch
            self.device = like.device
            self.cuda = like.device.type == "cuda"
            if like.device.type not in ("cpu", "cuda"):
                raise ValueError(f"mxmla: argument 'x': device {like.device} is not supported (cpu or cuda)")
        else:
            import numpy as np

            self._np = np
            if not isinstance(like, np.ndarray):
                raise TypeError(f"mxmla: argument 'x': expected a torch.Tensor or numpy.ndarray, got {type(like).__name__}")
            self.cuda = False

    def stream(self) -> int:
        if self.torch and self.cuda:
            return self._t.cuda.current_stream(self.device).cuda_stream
        return 0

    def empty(self, shape: Sequence[int], dtype: str) -> Any:
        if self.torch:
            tdt = {"uint8": self._t.uint8, "float32": self._t.float32, "bfloat16": self._t.bfloat16,
                   "float16": self._t.float16}[dtype]
            return self._t.empty(tuple(shape), dtype=tdt, device=self.device)
        ndt = {"uint8": self._np.uint8, "float32": self._np.float32, "bfloat16": self._np.uint16,
               "float16": self._np.float16}[dtype]
        return self._np.empty(tuple(shape), dtype=ndt)

    def desc(self, a: Any, arg: str, bf16_from_uint16: bool = False) -> tuple:
        """(ptr, dtype, shape, strides, DLPack device type, device index) of `a`."""
        if self.torch:
            t = self._t
            if not isinstance(a, t.Tensor):
                raise TypeError(f"mxmla: argument '{arg}': expected a torch.Tensor, got {type(a).__name__}")
            names = {t.float32: "float32", t.float16: "float16", t.bfloat16: "bfloat16", t.uint8: "uint8",
                     t.int32: "int32", t.int64: "int64"}
            if a.dtype not in names:
                raise ValueError(f"mxmla: argument '{arg}': dtype {a.dtype} is not supported")
            dev = a.device
            dev_type = {"cpu": 1, "cuda": 2}.get(dev.type, 0)
            return (a.data_ptr(), names[a.dtype], list(a.shape), list(a.stride()), dev_type, dev.index or 0)
        np = self._np
        if not isinstance(a, np.ndarray):
            raise TypeError(f"mxmla: argument '{arg}': expected a numpy.ndarray, got {type(a).__name__}")
        if a.dtype == np.uint16 and bf16_from_uint16:
            name = "bfloat16"
        else:
            names = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.uint8): "uint8",
                     np.dtype(np.int32): "int32", np.dtype(np.int64): "int64"}
            if a.dtype not in names:
                raise ValueError(
                    f"mxmla: argument '{arg}': dtype {a.dtype} is not supported "
                    "(float32, float16, or uint16 holding bfloat16 bits)"
                )
            name = names[a.dtype]
        if any(s % a.itemsize for s in a.strides):
            raise ValueError(f"mxmla: argument '{arg}': strides {a.strides} are not whole elements")
        return (a.ctypes.data, name, list(a.shape), [s // a.itemsize for s in a.strides], 1, 0)


def _check_format(fp8_format: str) -> str:
    if fp8_format not in _FORMATS:
        raise ValueError(f"mxmla: argument 'fp8_format': must be 'e4m3' or 'e5m2', got {fp8_format!r}")
    return fp8_format


# ----------------------------------------------------------------------------- MXFP8Tensor
@dataclass
class MXFP8Tensor:
    """Quantized codes (uint8, the input's shape) and E8M0 scales (uint8), per direction.

    Compact scales: rowwise [M, K/32], columnwise [ceil(M/32), K] (M = product of leading dims).
    Swizzled scales (swizzle=True): the cuBLAS F8_128x4 layout, padded with zeros to
    [round_up(M,128), round_up(K/32,4)] and [round_up(ceil(M/32),4), round_up(K,128)].
    BHSD scales (quantize_attention): [b, h, round_up(s,128), round_up(d/32,4)] and
    [b, h, round_up(ceil(s/32),4), round_up(d,128)], swizzled per (b, h).
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
    _backend: Any = field(default=None, repr=False)

    def dequantize(self, dtype: Any = "float32", columnwise: Optional[bool] = None) -> Any:
        """Dequantize one direction (rowwise when present, unless columnwise=True)."""
        return dequantize(self, dtype=dtype, columnwise=columnwise)


# ----------------------------------------------------------------------------- ops
def _alloc_outputs(be: _Backend, shapes: tuple, rowwise: bool, columnwise: bool) -> tuple:
    data_shape, rs_shape, cs_shape = shapes
    rd = be.empty(data_shape, "uint8") if rowwise else None
    rs = be.empty(rs_shape, "uint8") if rowwise else None
    cd = be.empty(data_shape, "uint8") if columnwise else None
    cs = be.empty(cs_shape, "uint8") if columnwise else None
    return rd, rs, cd, cs


def _descs(be: _Backend, outs: tuple) -> list:
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    return [None if o is None else be.desc(o, n) for o, n in zip(outs, names)]


def quantize(x: Any, rowwise: bool = True, columnwise: bool = True, fp8_format: str = "e4m3",
             swizzle: bool = False) -> MXFP8Tensor:
    """MXFP8-quantize x ([..., K], K a multiple of 32) rowwise and/or columnwise in one pass."""
    _check_format(fp8_format)
    if not rowwise and not columnwise:
        raise ValueError("mxmla.quantize: argument 'rowwise'/'columnwise': at least one must be True")
    be = _Backend(x)
    xd = be.desc(x, "x", bf16_from_uint16=True)
    outs = _alloc_outputs(be, _core.quantize_shapes(xd[2], swizzle, "mxmla.quantize", "x"), rowwise, columnwise)
    _core.quantize(xd, *_descs(be, outs), fp8_format, swizzle, be.stream())
    return MXFP8Tensor(tuple(xd[2]), fp8_format, "swizzled" if swizzle else "compact", *outs, _backend=be)


def quantize_attention(x: Any, layout: str = "sbhd", rowwise: bool = True, columnwise: bool = True,
                       fp8_format: str = "e4m3", bhsd_scales: bool = True) -> MXFP8Tensor:
    """Quantize Q/K/V given as [s, b, h, d] (sbhd) or [b, s, h, d] (bshd) for attention.

    Codes keep x's layout; columnwise blocks run along s inside each sequence. With
    bhsd_scales=True the scales come out in BHSD order, swizzled and zero-padded, in one call (on
    the GPU: compact scales to scratch, then the BHSD re-layout kernel); with False they are
    compact (phase one of two; see attention_scales_to_bhsd).
    """
    _check_format(fp8_format)
    if layout not in ("sbhd", "bshd"):
        raise ValueError(f"mxmla.quantize_attention: argument 'layout': must be 'sbhd' or 'bshd', got {layout!r}")
    be = _Backend(x)
    xd = be.desc(x, "x", bf16_from_uint16=True)
    outs = _alloc_outputs(be, _core.attention_shapes(xd[2], layout, bhsd_scales, "mxmla.quantize_attention", "x"), rowwise, columnwise)
    _core.quantize_attention(xd, *_descs(be, outs), layout, fp8_format, bhsd_scales, be.stream())
    return MXFP8Tensor(tuple(xd[2]), fp8_format, "bhsd" if bhsd_scales else "compact", *outs,
                       layout=layout, attention=True, _backend=be)


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype).replace("torch.", "")
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"mxmla.dequantize: argument 'dtype': must be float32 or bfloat16, got {dtype!r}")
    return name


def dequantize(q: MXFP8Tensor, dtype: Any = "float32", columnwise: Optional[bool] = None) -> Any:
    """codes * 2^(scale-127) of one direction, as float32 or bfloat16 (numpy: uint16 bits)."""
    if not isinstance(q, MXFP8Tensor):
        raise TypeError(f"mxmla.dequantize: argument 'q': expected MXFP8Tensor, got {type(q).__name__}")
    if columnwise is None:
        columnwise = q.rowwise_data is None
    data = q.columnwise_data if columnwise else q.rowwise_data
    scale = q.columnwise_scale_inv if columnwise else q.rowwise_scale_inv
    which = "columnwise" if columnwise else "rowwise"
    if data is None or scale is None:
        raise ValueError(f"mxmla.dequantize: argument 'q': has no {which} data")
    be = q._backend or _Backend(data)
    name = _dtype_name(dtype)
    out = be.empty(q.shape, name)
    _core.dequantize(be.desc(data, f"{which}_data"), be.desc(scale, f"{which}_scale_inv"),
                     be.desc(out, "out", bf16_from_uint16=True), list(q.shape), q.fp8_format, q.scale_layout,
                     columnwise, q.attention, q.layout, be.stream())
    return out


def swizzle_scales(scales: Any, M: int, K: int, rowwise: bool = True) -> Any:
    """Compact scales of an [M, K] tensor -> F8_128x4 swizzled, zero-padded."""
    be = _Backend(scales)
    shapes = _core.quantize_shapes([M, K], True, "mxmla.swizzle_scales", "K")
    out = be.empty(shapes[1] if rowwise else shapes[2], "uint8")
    _core.swizzle_scales(be.desc(scales, "scales"), be.desc(out, "out"), M, K, rowwise, be.stream())
    return out


def unswizzle_scales(scales: Any, M: int, K: int, rowwise: bool = True) -> Any:
    """F8_128x4 swizzled scales of an [M, K] tensor -> compact."""
    be = _Backend(scales)
    shapes = _core.quantize_shapes([M, K], False, "mxmla.unswizzle_scales", "K")
    out = be.empty(shapes[1] if rowwise else shapes[2], "uint8")
    _core.unswizzle_scales(be.desc(scales, "scales"), be.desc(out, "out"), M, K, rowwise, be.stream())
    return out


def attention_scales_to_bhsd(scales: Any, shape: Sequence[int], layout: str = "sbhd", rowwise: bool = True) -> Any:
    """Phase two: compact attention scales (quantize_attention(..., bhsd_scales=False)) -> BHSD swizzled."""
    be = _Backend(scales)
    shapes = _core.attention_shapes(list(shape), layout, True, "mxmla.attention_scales_to_bhsd", "shape")
    out = be.empty(shapes[1] if rowwise else shapes[2], "uint8")
    _core.attention_scales_to_bhsd(be.desc(scales, "scales"), be.desc(out, "out"), list(shape), layout, rowwise,
                                   be.stream())
    return out


def to_bhsd(*tensors: MXFP8Tensor) -> list:
    """Phase two for several tensors at once (e.g. Q, K, V): compact attention scales -> BHSD,
    both directions, in one launch. Returns new MXFP8Tensors sharing the codes."""
    jobs, outs = [], []
    for i, q in enumerate(tensors):
        if not isinstance(q, MXFP8Tensor) or not q.attention or q.scale_layout != "compact":
            raise ValueError(f"mxmla.to_bhsd: argument 'tensors[{i}]': must come from quantize_attention(..., bhsd_scales=False)")
        be = q._backend
        shapes = _core.attention_shapes(list(q.shape), q.layout, True, "mxmla.to_bhsd", f"tensors[{i}]")
        rs = be.empty(shapes[1], "uint8") if q.rowwise_scale_inv is not None else None
        cs = be.empty(shapes[2], "uint8") if q.columnwise_scale_inv is not None else None
        for src, dst, rowwise in ((q.rowwise_scale_inv, rs, True), (q.columnwise_scale_inv, cs, False)):
            if src is not None:
                jobs.append((be.desc(src, "scales"), be.desc(dst, "out"), list(q.shape), q.layout, rowwise))
        outs.append(MXFP8Tensor(q.shape, q.fp8_format, "bhsd", q.rowwise_data, rs, q.columnwise_data, cs,
                                layout=q.layout, attention=True, _backend=be))
    if jobs:
        _core.attention_scales_to_bhsd_batch(jobs, tensors[0]._backend.stream())
    return outs


def info() -> dict:
    """Build and device information."""
    version, cuda, archs, cuda_rope = _core.build_info()
    n = _core.cuda_device_count()
    return {
        "version": version,
        "cuda_enabled": cuda,
        "cuda_archs": archs,
        "cuda_rope": cuda_rope,
        "gpus": [_core.cuda_device_description(i) for i in range(n)],
    }


from .rope import (  # noqa: E402  (uses _Backend above)
    DEEPSEEK_V3_YARN,
    apply_rope,
    positions_arange,
    positions_context_parallel,
    positions_from_cu_seqlens,
    rope_backward,
    rope_backward_quantize,
    rope_inv_freq,
    rope_tables,
    yarn_softmax_scale,
)
from .qproj import FusedMLAQUpProjRopeQuant, fused_q_uproj_rope_quant, register_torch_op  # noqa: E402
