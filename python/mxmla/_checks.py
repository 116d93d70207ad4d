"""Private: checks of the Python-level arguments (types of flags, integers, choices; gradients).

Every error names the op, the argument the user passed and the rule, the same way the C++ core
words its own errors ("mxmla.quantize: argument 'swizzle': must be True or False, got None").
The allowed spellings of each choice are the value names of the bound C++ enum, so the C++ side
stays the source of truth; the Python layer parses a user's string once, here.
"""
from __future__ import annotations

import numbers
from typing import Any, Tuple

import numpy as np

from . import _mxmla_core as _core
from ._backend import is_torch, torch, type_name


class Choices:
    """The spellings of one C++ enum (its bound value names)."""

    __slots__ = ("enum", "names")

    def __init__(self, enum: Any):
        self.enum = enum
        self.names: Tuple[str, ...] = tuple(enum.__members__)

    def parse(self, op: str, arg: str, value: Any) -> Any:
        """The enum member for a spelling (or a member); the error lists the spellings."""
        if isinstance(value, self.enum):
            return value
        m = self.enum.__members__.get(value) if isinstance(value, str) else None
        if m is None:
            raise ValueError(f"{op}: argument '{arg}': must be {one_of(self.names)}, got {value!r}")
        return m


FP8_FORMAT = Choices(_core.Fp8Format)
SCALE_LAYOUT = Choices(_core.ScaleLayout)
QKV_LAYOUT = Choices(_core.QKVLayout)
ROPE_STYLE = Choices(_core.RopeStyle)
ROPE_LAYOUT = Choices(_core.RopeLayout)
WEIGHT_LAYOUT = Choices(_core.WeightLayout)


def one_of(names: Tuple[str, ...]) -> str:
    q = [repr(n) for n in names]
    return q[0] if len(q) == 1 else ", ".join(q[:-1]) + " or " + q[-1]


def choice(op: str, arg: str, value: Any, choices: Choices) -> str:
    """The validated spelling of `value` (a string or a member of the bound enum)."""
    if isinstance(value, choices.enum):
        return value.name
    if isinstance(value, str) and value in choices.names:
        return value
    raise ValueError(f"{op}: argument '{arg}': must be {one_of(choices.names)}, got {value!r}")


def flag(op: str, arg: str, value: Any) -> bool:
    """A bool argument: True or False (numpy.bool_ too); nothing else is silently truthy."""
    if isinstance(value, bool):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise ValueError(f"{op}: argument '{arg}': must be True or False, got {value!r} ({type_name(value)})")


def optional_flag(op: str, arg: str, value: Any) -> Any:
    return None if value is None else flag(op, arg, value)


def integer(op: str, arg: str, value: Any, minimum: Any = None) -> int:
    """An int argument: a Python / numpy integer (not a bool, float or string)."""
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or _is_symint(value)):
        raise ValueError(f"{op}: argument '{arg}': must be an int, got {value!r} ({type_name(value)})")
    v = value if _is_symint(value) else int(value)
    if minimum is not None and not _is_symint(v) and v < minimum:
        raise ValueError(f"{op}: argument '{arg}': must be >= {minimum}, got {v}")
    return v


def real(op: str, arg: str, value: Any) -> float:
    """A float argument: an int or float (not a bool or string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{op}: argument '{arg}': must be a number, got {value!r} ({type_name(value)})")
    return float(value)


def int_list(op: str, arg: str, value: Any) -> list:
    if not isinstance(value, (list, tuple)) and not (torch is not None and isinstance(value, torch.Size)):
        raise ValueError(f"{op}: argument '{arg}': must be a list or tuple of ints, got {type_name(value)}")
    return [integer(op, f"{arg}[{i}]", v) for i, v in enumerate(value)]


def directions(op: str, rowwise: bool, columnwise: bool) -> None:
    if not rowwise and not columnwise:
        raise ValueError(f"{op}: argument 'rowwise'/'columnwise': at least one must be True")


def _is_symint(v: Any) -> bool:
    return torch is not None and isinstance(v, torch.SymInt)


def grad_needed(t: Any) -> bool:
    return is_torch(t) and t.requires_grad and torch.is_grad_enabled()


def not_differentiable(op: str, why: str, **tensors: Any) -> None:
    """Ops without a gradient: an input that requires grad (with grad mode on) is an error, never
    a silent cut of the graph."""
    for arg, t in tensors.items():
        if grad_needed(t):
            short = op.split(".")[-1]
            raise RuntimeError(
                f"{op}: argument '{arg}': requires grad, but {short} has no gradient ({why}); call it on "
                f"{arg}.detach(), under torch.no_grad(), or inside a torch.autograd.Function's forward")


def same_kind(op: str, main_arg: str, main: Any, **others: Any) -> None:
    """Every tensor argument is of the main input's kind (torch or numpy)."""
    main_torch = is_torch(main)
    for arg, t in others.items():
        if t is None:
            continue
        if is_torch(t) != main_torch:
            want = "torch.Tensor" if main_torch else "numpy.ndarray"
            raise TypeError(f"{op}: argument '{arg}': expected a {want} like argument '{main_arg}', got {type_name(t)}")
