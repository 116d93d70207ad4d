"""RoPE for MLA (SPEC §3): apply_rope / rope_backward, tables (plain and YaRN), positions.

Styles: "interleaved_in_halves_out" (default; Megatron MLA), "interleaved" (DeepSeek reference,
complex multiply), "rotate_half" (TE default). Layouts: "sbhd", "bshd", "thd" (with cu_seqlens).
Only the trailing `rope_dim` of each head rotates. CPU data runs the reference; CUDA tensors run
the sm90 kernels (bit-identical results). cu_seqlens is read on the host (a CUDA tensor is copied
to the CPU, which synchronizes).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _mxmla_core as _core

STYLES = ("interleaved_in_halves_out", "interleaved", "rotate_half")
DEEPSEEK_V3_YARN = dict(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                        mscale_all_dim=1.0)


def _yarn(yarn: Union[None, str, dict]) -> Optional[tuple]:
    if yarn is None:
        return None
    if isinstance(yarn, str):
        if yarn != "deepseek_v3":
            raise ValueError(f"mxmla: argument 'yarn': unknown preset {yarn!r} (use 'deepseek_v3' or a dict)")
        yarn = DEEPSEEK_V3_YARN
    p = dict(DEEPSEEK_V3_YARN, **yarn)
    return (float(p["factor"]), int(p["original_max_position"]), float(p["beta_fast"]), float(p["beta_slow"]),
            float(p["mscale"]), float(p["mscale_all_dim"]))


def _cu_desc(cu_seqlens: Any) -> tuple:
    """(descriptor, owner): cu_seqlens on the CPU (the library validates it on the host); keep
    `owner` alive until the call returns (a CUDA tensor's host copy is a new tensor)."""
    from . import _Backend

    if cu_seqlens is None:
        return None, None
    if type(cu_seqlens).__module__.startswith("torch") and cu_seqlens.is_cuda:
        cu_seqlens = cu_seqlens.cpu()
    return _Backend(cu_seqlens).desc(cu_seqlens, "cu_seqlens"), cu_seqlens


def _rope(x: Any, cos: Any, sin: Any, style: str, layout: str, rope_dim: int, cu_seqlens: Any,
          tables_per_token: bool, out: Any, backward: bool) -> Any:
    from . import _Backend

    if style not in STYLES:
        raise ValueError(f"mxmla: argument 'style': must be one of {STYLES}, got {style!r}")
    be = _Backend(x)
    xd = be.desc(x, "grad" if backward else "x", bf16_from_uint16=True)
    if out is None:
        out = be.empty(xd[2], xd[1])
    cu, _cu_owner = _cu_desc(cu_seqlens)
    _core.rope(xd, be.desc(cos, "cos", bf16_from_uint16=True), be.desc(sin, "sin", bf16_from_uint16=True),
               be.desc(out, "dx" if backward else "out", bf16_from_uint16=True), style, layout, int(rope_dim),
               bool(tables_per_token), cu, backward, be.stream())
    return out


def apply_rope(x: Any, cos: Any, sin: Any, style: str = "interleaved_in_halves_out", layout: str = "sbhd",
               rope_dim: int = 64, cu_seqlens: Any = None, tables_per_token: bool = False, out: Any = None) -> Any:
    """RoPE on the trailing rope_dim of each head of x ([s,b,h,d], [b,s,h,d] or [t,h,d]).

    cos/sin: [T, rope_dim] float32/bfloat16 (rope_tables builds them). Table row of a token: its
    position s (sbhd/bshd), its position inside its sequence (thd with cu_seqlens), its index t
    (thd without), or its token index when tables_per_token. out may be x (in place)."""
    return _rope(x, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, out, False)


def rope_backward(grad: Any, cos: Any, sin: Any, style: str = "interleaved_in_halves_out", layout: str = "sbhd",
                  rope_dim: int = 64, cu_seqlens: Any = None, tables_per_token: bool = False, out: Any = None) -> Any:
    """The gradient of apply_rope: dx = R^T grad (same conventions)."""
    return _rope(grad, cos, sin, style, layout, rope_dim, cu_seqlens, tables_per_token, out, True)


def rope_backward_quantize(dq: Any, cos: Any, sin: Any, rowwise: bool = True, columnwise: bool = True,
                           fp8_format: str = "e4m3", swizzle: bool = False, dx_copy: Optional[str] = None,
                           style: str = "interleaved_in_halves_out", layout: str = "sbhd", rope_dim: int = 64,
                           cu_seqlens: Any = None, tables_per_token: bool = False) -> Any:
    """dQ -> RoPE backward (fp32) -> MXFP8 of dx viewed as [tokens, h*d] in one pass.

    Returns an MXFP8Tensor of shape (tokens, h*d) (codes: reshape to dq's shape), or
    (MXFP8Tensor, dx) with dx_copy="bfloat16" (or "float32": the exact fp32 values quantized)."""
    from . import MXFP8Tensor, _Backend, _alloc_outputs, _check_format, _descs

    _check_format(fp8_format)
    if style not in STYLES:
        raise ValueError(f"mxmla: argument 'style': must be one of {STYLES}, got {style!r}")
    if not rowwise and not columnwise:
        raise ValueError("mxmla.rope_backward_quantize: argument 'rowwise'/'columnwise': at least one must be True")
    be = _Backend(dq)
    dd = be.desc(dq, "dq", bf16_from_uint16=True)
    shape = dd[2]
    if len(shape) < 3:
        raise ValueError(f"mxmla.rope_backward_quantize: argument 'dq': must be [s,b,h,d], [b,s,h,d] or [t,h,d], got {shape}")
    tokens = int(np.prod(shape[:-2]))
    hd = shape[-2] * shape[-1]
    outs = _alloc_outputs(be, _core.quantize_shapes([tokens, hd], swizzle, "mxmla.rope_backward_quantize", "dq"),
                          rowwise, columnwise)
    if dx_copy not in (None, "bfloat16", "float32"):
        raise ValueError(f"mxmla.rope_backward_quantize: argument 'dx_copy': must be None, 'bfloat16' or 'float32', got {dx_copy!r}")
    dx = be.empty(shape, dx_copy) if dx_copy else None
    cu, _cu_owner = _cu_desc(cu_seqlens)
    _core.rope_backward_quantize(dd, be.desc(cos, "cos", bf16_from_uint16=True), be.desc(sin, "sin", bf16_from_uint16=True),
                                 *_descs(be, outs), None if dx is None else be.desc(dx, "dx", bf16_from_uint16=True),
                                 style, layout, int(rope_dim), bool(tables_per_token), cu, fp8_format, swizzle,
                                 be.stream())
    q = MXFP8Tensor((tokens, hd), fp8_format, "swizzled" if swizzle else "compact", *outs, _backend=be)
    return (q, dx) if dx_copy else q


def rope_inv_freq(rope_dim: int = 64, base: float = 10000.0, yarn: Union[None, str, dict] = None) -> np.ndarray:
    """Inverse frequencies (rope_dim/2), YaRN-corrected as in DeepSeek-V3's precompute_freqs_cis."""
    return np.asarray(_core.rope_inv_freq(int(rope_dim), float(base), _yarn(yarn)), dtype=np.float64)


def rope_tables(positions: Any, rope_dim: int = 64, base: float = 10000.0, yarn: Union[None, str, dict] = None,
                style: str = "interleaved_in_halves_out", dtype: str = "float32") -> tuple:
    """cos, sin [len(positions), rope_dim] for `style` (angles in float64, rounded once).

    positions: a list, numpy array or torch tensor; torch in -> torch out on the same device."""
    if style not in STYLES:
        raise ValueError(f"mxmla.rope_tables: argument 'style': must be one of {STYLES}, got {style!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"mxmla.rope_tables: argument 'dtype': must be float32 or bfloat16, got {dtype!r}")
    torch_in = type(positions).__module__.startswith("torch")
    pos = positions.detach().cpu().double().numpy() if torch_in else np.asarray(positions, dtype=np.float64)
    if pos.ndim != 1:
        raise ValueError(f"mxmla.rope_tables: argument 'positions': must be 1-D, got shape {pos.shape}")
    ndt = np.float32 if dtype == "float32" else np.uint16
    cos = np.empty((pos.shape[0], int(rope_dim)), ndt)
    sin = np.empty_like(cos)
    desc = lambda a: (a.ctypes.data, dtype, list(a.shape), [a.shape[1], 1], 1, 0)  # noqa: E731
    _core.rope_tables(pos.tolist(), int(rope_dim), float(base), _yarn(yarn), style, desc(cos), desc(sin))
    if not torch_in:
        return cos, sin
    import torch

    def to_torch(a):
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(a)
        return t.to(positions.device)

    return to_torch(cos), to_torch(sin)


def yarn_softmax_scale(head_dim: int = 192, yarn: Union[None, str, dict] = "deepseek_v3") -> float:
    """head_dim^-0.5 times yarn_get_mscale(factor, mscale_all_dim)^2 (0.135234 for DeepSeek-V3)."""
    return _core.yarn_softmax_scale(int(head_dim), _yarn(yarn))


def positions_arange(n: int, offset: int = 0) -> np.ndarray:
    return np.asarray(_core.positions_arange(int(n), int(offset)))


def positions_from_cu_seqlens(cu_seqlens: Sequence[int]) -> np.ndarray:
    """thd: each token's position inside its sequence."""
    return np.asarray(_core.positions_from_cu_seqlens([int(v) for v in cu_seqlens]))


def positions_context_parallel(local_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Dual-chunk context parallelism: rank r holds global chunks r and 2*cp-1-r (of local_len/2 each)."""
    return np.asarray(_core.positions_context_parallel(int(local_len), int(cp_size), int(cp_rank)))
