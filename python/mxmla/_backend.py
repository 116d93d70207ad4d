"""Private: array kinds (torch / numpy), allocation and the plain descriptors the compiled core reads.

Nothing here imports the package ``__init__``; the op modules import this one.

dtype handling (the one place it is decided):
- torch: float32, float16, bfloat16, uint8, int32, int64, float8_e4m3fn, float8_e5m2, float8_e8m0fnu.
- numpy: float32, float16, uint8, int32, int64, and with ml_dtypes bfloat16, float8_e4m3fn,
  float8_e5m2, float8_e8m0fnu. A ``uint16`` array is read as bfloat16 bits only where the op takes
  bfloat16 (``bf16=True`` below); elsewhere (scales, cu_seqlens) it is rejected.
- numpy bfloat16 outputs: ``ml_dtypes.bfloat16`` arrays when the op's input was an ml_dtypes
  bfloat16 array (or the caller asked for ``ml_dtypes.bfloat16``), else uint16 bit patterns.
Zero-size arrays are described with contiguous strides (numpy reports strides of 0 for them, and
no element is ever read).
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

try:  # torch is optional
    import torch as _torch
except ImportError:  # pragma: no cover - exercised only without torch
    _torch = None

torch = _torch

# numpy dtype name -> core dtype name (ml_dtypes types are named like this once registered)
_NP_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3",
    "float8_e5m2": "float8_e5m2",
    "float8_e8m0fnu": "e8m0",
}
_TORCH_NAMES = {}
if torch is not None:
    _TORCH_NAMES = {
        torch.float32: "float32",
        torch.float16: "float16",
        torch.bfloat16: "bfloat16",
        torch.uint8: "uint8",
        torch.int32: "int32",
        torch.int64: "int64",
        torch.float8_e4m3fn: "float8_e4m3",
        torch.float8_e5m2: "float8_e5m2",
    }
    if hasattr(torch, "float8_e8m0fnu"):
        _TORCH_NAMES[torch.float8_e8m0fnu] = "e8m0"

Desc = Tuple[int, str, list, list, int, int]


def is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def type_name(x: Any) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def ml_dtypes_module() -> Any:
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover
        raise ImportError("mxmla: numpy bfloat16 / float8 views need the ml_dtypes package (pip install ml_dtypes)") from e
    return ml_dtypes


def is_ml_bf16(a: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.name == "bfloat16" and a.dtype != np.uint16


def kind_of(op: str, arg: str, x: Any) -> str:
    """'torch' or 'numpy'; a TypeError naming op and argument otherwise."""
    if is_torch(x):
        return "torch"
    if is_numpy(x):
        return "numpy"
    raise TypeError(f"{op}: argument '{arg}': expected a torch.Tensor or numpy.ndarray, got {type_name(x)}")


def _contiguous_strides(shape: Sequence[int]) -> list:
    st, s = [], 1
    for d in reversed(shape):
        st.append(s)
        s *= d
    return st[::-1]


class Backend:
    """Allocation and descriptors for one array kind (torch or numpy) on one device; `like` is the
    op's main input (its kind, device and, for numpy, bfloat16 flavour decide the outputs')."""

    __slots__ = ("op", "arg", "torch", "device", "cuda", "ml_bf16")

    def __init__(self, op: str, arg: str, like: Any, ml_bf16: bool = False):
        self.op, self.arg = op, arg
        self.torch = kind_of(op, arg, like) == "torch"
        if self.torch:
            self.device = like.device
            self.cuda = like.device.type == "cuda"
            self.ml_bf16 = False
            if like.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{op}: argument '{arg}': device {like.device} is not supported (cpu or cuda)")
        else:
            self.device = None
            self.cuda = False
            self.ml_bf16 = ml_bf16 or is_ml_bf16(like)

    def stream(self) -> int:
        if self.cuda:
            return torch.cuda.current_stream(self.device).cuda_stream
        return 0

    def empty(self, shape: Sequence[int], dtype: str) -> Any:
        """dtype: 'uint8', 'float32', 'float16' or 'bfloat16'."""
        shape = tuple(int(s) for s in shape)
        if self.torch:
            tdt = {"uint8": torch.uint8, "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
            return torch.empty(shape, dtype=tdt, device=self.device)
        if dtype == "bfloat16":
            a = np.empty(shape, dtype=np.uint16)
            return a.view(ml_dtypes_module().bfloat16) if self.ml_bf16 else a
        return np.empty(shape, dtype={"uint8": np.uint8, "float32": np.float32, "float16": np.float16}[dtype])

    def desc(self, arg: str, a: Any, bf16: bool = False, allowed: Optional[str] = None) -> Desc:
        """(ptr, dtype, shape, strides, DLPack device type, device index) of `a`, which must be of
        this backend's kind. bf16: a numpy uint16 array is bfloat16 bits here. `allowed` words
        the dtype rule for a dtype the core has no name for."""
        op = self.op
        if self.torch:
            if not is_torch(a):
                raise TypeError(f"{op}: argument '{arg}': expected a torch.Tensor (argument '{self.arg}' is one), "
                                f"got {type_name(a)}")
            if a.layout != torch.strided:
                raise ValueError(f"{op}: argument '{arg}': layout {a.layout} is not supported (strided tensors only)")
            name = _TORCH_NAMES.get(a.dtype)
            if name is None:
                raise ValueError(f"{op}: argument '{arg}': dtype {str(a.dtype).replace('torch.', '')} "
                                 f"is not supported{' (' + allowed + ')' if allowed else ''}")
            shape = list(a.shape)
            strides = list(a.stride()) if a.numel() > 0 else _contiguous_strides(shape)
            dev = a.device
            dev_type = {"cpu": 1, "cuda": 2}.get(dev.type, 0)
            return (a.data_ptr(), name, shape, strides, dev_type, dev.index or 0)
        if not is_numpy(a):
            raise TypeError(f"{op}: argument '{arg}': expected a numpy.ndarray (argument '{self.arg}' is one), "
                            f"got {type_name(a)}")
        if a.dtype == np.uint16:
            if not bf16:
                raise ValueError(f"{op}: argument '{arg}': dtype uint16 is not supported here "
                                 f"({allowed or 'uint16 is read as bfloat16 bits only where the op takes bfloat16'})")
            name = "bfloat16"
        else:
            name = _NP_NAMES.get(a.dtype.name)
            if name == "bfloat16" and not bf16:
                name = None
            if name is None:
                hint = allowed or ("float32, float16, or bfloat16 as ml_dtypes.bfloat16 or uint16 bits" if bf16 else None)
                raise ValueError(f"{op}: argument '{arg}': dtype {a.dtype} is not supported{' (' + hint + ')' if hint else ''}")
        shape = list(a.shape)
        if a.size == 0:
            strides = _contiguous_strides(shape)
        else:
            if any(s % a.itemsize for s in a.strides):
                raise ValueError(f"{op}: argument '{arg}': strides {a.strides} are not whole elements")
            strides = [s // a.itemsize for s in a.strides]
        return (a.ctypes.data, name, shape, strides, 1, 0)

    def opt_desc(self, arg: str, a: Any, bf16: bool = False) -> Optional[Desc]:
        return None if a is None else self.desc(arg, a, bf16)


OUTPUT_NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def alloc_outputs(be: Backend, shapes: tuple, rowwise: bool, columnwise: bool) -> tuple:
    """The four uint8 buffers of an MXFP8 result (None for a direction that is off)."""
    data_shape, rs_shape, cs_shape = shapes
    rd = be.empty(data_shape, "uint8") if rowwise else None
    rs = be.empty(rs_shape, "uint8") if rowwise else None
    cd = be.empty(data_shape, "uint8") if columnwise else None
    cs = be.empty(cs_shape, "uint8") if columnwise else None
    return rd, rs, cd, cs


def output_descs(be: Backend, outs: tuple) -> list:
    return [None if o is None else be.desc(n, o) for o, n in zip(outs, OUTPUT_NAMES)]


def torch_available() -> bool:
    return torch is not None


def numpy_bf16_requested(dtype: Any) -> bool:
    """True when `dtype` is ml_dtypes.bfloat16 (the caller wants ml_dtypes arrays back)."""
    if "ml_dtypes" not in sys.modules:
        return False
    try:
        return np.dtype(dtype).name == "bfloat16" and np.dtype(dtype) != np.uint16
    except TypeError:
        return False
