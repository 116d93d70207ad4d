"""Block FP8: the DeepSeek-V3 recipe (TransformerEngine's Float8BlockScaling) — E4M3 codes with one
fp32 scale per block of 1 x 128 values (activations) or 128 x 128 values (weights), the format of
DeepSeek-V3's released checkpoints (``weight`` + ``weight_scale_inv``).

``quantize_blockwise`` makes one from a bf16 / fp32 matrix (TransformerEngine's rule: scale = 448 /
amax, rounded down to a power of two by default; the stored factor is ``scale_inv = 1 / scale``);
``BlockFP8Tensor.dequantize`` gives back ``code * scale_inv``. ``fused_q_uproj_rope_quant`` accepts a
BlockFP8Tensor weight (128 x 128 blocks): the Q up-projection then runs on Hopper's FP8 tensor cores
(see ``mxmla.qproj``). torch tensors (CPU or CUDA) and numpy arrays (CPU reference) alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _dispatch
from . import _mxmla_core as _core
from ._backend import Backend, is_torch, kind_of, torch, type_name
from ._checks import flag, integer, not_differentiable

_OP = "mxmla.quantize_blockwise"


def _e4m3_table() -> np.ndarray:
    """The 256 E4M3 (OCP "fn") values: exponent bias 7, no Inf, 0x7F / 0xFF NaN."""
    v = np.empty(256, dtype=np.float64)
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
        mag = np.nan if (e == 15 and m == 7) else (m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
        v[c] = -mag if s else mag
    return v


_E4M3 = _e4m3_table()
_E4M3_TORCH: dict = {}  # the table as a float32 tensor per device, made once (no host copy per call)


def _e4m3_torch(device: Any) -> Any:
    t = _E4M3_TORCH.get(device)
    if t is None:
        t = _E4M3_TORCH[device] = torch.from_numpy(_E4M3.astype(np.float32)).to(device)
    return t


@dataclass(frozen=True)
class BlockFP8Tensor:
    """E4M3 codes ``data`` [rows, cols] (torch float8_e4m3fn, or uint8; numpy uint8) and fp32
    ``scale_inv``: [rows, ceil(cols / 128)] for block_rows 1, [ceil(rows / 128), ceil(cols / 128)]
    for block_rows 128. A value is ``code * scale_inv`` of its block."""

    data: Any
    scale_inv: Any
    block_rows: int = 128

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    def dequantize(self) -> Any:
        """float32 values [rows, cols]: code · scale_inv rounded once to fp32 (exact with power-of-two
        scales, which quantize_blockwise makes by default), in the data's kind and device."""
        rows, cols = self.shape
        br = self.block_rows
        if is_torch(self.data):
            codes = self.data.view(torch.uint8) if self.data.dtype != torch.uint8 else self.data
            vals = _e4m3_torch(codes.device)[codes.long()]
            s = self.scale_inv.float().repeat_interleave(br, 0).repeat_interleave(128, 1)[:rows, :cols]
            return vals * s
        codes = np.asarray(self.data).view(np.uint8)
        s = np.asarray(self.scale_inv, dtype=np.float32).repeat(br, 0).repeat(128, 1)[:rows, :cols]
        return (_E4M3[codes] * s.astype(np.float64)).astype(np.float32)


_NOT_DIFF = "quantization has no gradient"


def _quantize_blockwise_impl(x: Any, block_rows: int, pow2_scales: bool, transpose: bool = False) -> tuple:
    """The compiled op: (codes as uint8, scale_inv) of x's kind (of xᵀ with transpose)."""
    be = Backend(_OP, "input", x)
    xd = be.desc("input", x, bf16=True)
    if len(xd[2]) != 2:
        raise ValueError(f"{_OP}: argument 'input': must be 2-D [rows, cols], got shape {tuple(xd[2])}")
    shape = [xd[2][1], xd[2][0]] if transpose else list(xd[2])
    ss = _core.block_scale_shape(shape[0], shape[1], block_rows)
    codes = be.empty(shape, "uint8")
    scale_inv = be.empty(ss, "float32")
    o = _core.BlockQuantizeOptions()
    o.block_rows, o.pow2_scales, o.transpose = block_rows, pow2_scales, transpose
    _core.quantize_blockwise(xd, be.desc("data", codes), be.desc("scale_inv", scale_inv), o, be.stream())
    return codes, scale_inv


def _quantize_blockwise_both_impl(x: Any, block_rows: int, pow2_scales: bool) -> tuple:
    """The compiled op, both directions: (codes, scale_inv) of x and of xᵀ, one pass over x."""
    be = Backend(_OP, "input", x)
    xd = be.desc("input", x, bf16=True)
    if len(xd[2]) != 2:
        raise ValueError(f"{_OP}: argument 'input': must be 2-D [rows, cols], got shape {tuple(xd[2])}")
    rows, cols = xd[2]
    codes, codes_t = be.empty([rows, cols], "uint8"), be.empty([cols, rows], "uint8")
    s = be.empty(_core.block_scale_shape(rows, cols, block_rows), "float32")
    s_t = be.empty(_core.block_scale_shape(cols, rows, block_rows), "float32")
    o = _core.BlockQuantizeOptions()
    o.block_rows, o.pow2_scales = block_rows, pow2_scales
    _core.quantize_blockwise_both(xd, be.desc("data", codes), be.desc("scale_inv", s), be.desc("data_t", codes_t),
                                  be.desc("scale_inv_t", s_t), o, be.stream())
    return codes, s, codes_t, s_t


def quantize_blockwise_both(x: Any, block_rows: int = 1, pow2_scales: bool = True) -> tuple:
    """(quantize_blockwise(x), quantize_blockwise(x, transpose=True)) in one pass over x, the same bits
    as the two calls: what a block-FP8 Linear needs of its input in the forward (fprop reads x, wgrad
    xᵀ) and of dY in the backward (dgrad dY, wgrad dYᵀ). torch: also the custom op
    torch.ops.mxmla.quantize_blockwise_both."""
    op = _OP
    block_rows = integer(op, "block_rows", block_rows)
    pow2_scales = flag(op, "pow2_scales", pow2_scales)
    if kind_of(op, "input", x) == "torch":
        not_differentiable(op, _NOT_DIFF, input=x)
        c, s, ct, st = _dispatch.call("quantize_blockwise_both", x, block_rows, pow2_scales)
        c, ct = c.view(torch.float8_e4m3fn), ct.view(torch.float8_e4m3fn)
    else:
        c, s, ct, st = _quantize_blockwise_both_impl(x, block_rows, pow2_scales)
    return BlockFP8Tensor(c, s, block_rows), BlockFP8Tensor(ct, st, block_rows)


def quantize_blockwise(x: Any, block_rows: int = 1, pow2_scales: bool = True,
                       transpose: bool = False) -> BlockFP8Tensor:
    """x [rows, cols] bf16 or float32 (torch, or numpy: float32, ml_dtypes.bfloat16 or uint16 bf16
    bits) -> BlockFP8Tensor with blocks of 1 x 128 (block_rows 1, activations) or 128 x 128
    (block_rows 128, weights). With ``transpose`` the result is that of xᵀ ([cols, rows], the same
    bits as quantizing ``x.t().contiguous()``), made in one pass: the K-major operands of a
    Linear's backward GEMMs (wgrad's dyᵀ and xᵀ with 1 x 128 blocks along the tokens, dgrad's Wᵀ
    with the weight's own 128 x 128 blocks). Per block: amax = max |v| (NaN ignored); scale = 448 / amax in fp32
    (1 when amax is 0 or Inf, the largest finite fp32 on overflow), with pow2_scales rounded down to
    a power of two; code = E4M3(fp32(v · scale)), nearest even, saturating, NaN → 0x7F;
    scale_inv = fp32(1 / scale). Partial blocks at the edges take the values they hold. torch: also
    the custom op torch.ops.mxmla.quantize_blockwise (codes as uint8; here viewed as float8_e4m3fn)."""
    op = _OP
    block_rows = integer(op, "block_rows", block_rows)
    pow2_scales = flag(op, "pow2_scales", pow2_scales)
    transpose = flag(op, "transpose", transpose)
    if kind_of(op, "input", x) == "torch":  # (the argument is named as the C++ API names it)
        not_differentiable(op, _NOT_DIFF, input=x)
        codes, scale_inv = _dispatch.call("quantize_blockwise", x, block_rows, pow2_scales, transpose)
        return BlockFP8Tensor(codes.view(torch.float8_e4m3fn), scale_inv, block_rows)
    codes, scale_inv = _quantize_blockwise_impl(x, block_rows, pow2_scales, transpose)
    return BlockFP8Tensor(codes, scale_inv, block_rows)


def _gemm_blockwise_impl(a: Any, a_scale: Any, a_br: int, b: Any, b_scale: Any, b_br: int, trans_a: bool,
                         trans_b: bool, alpha: float, accumulate: bool, out: Any, out_dtype: str) -> Any:
    """The compiled block-FP8 GEMM: allocates D [M, N] of out_dtype unless `out` is given."""
    op = "mxmla.gemm"
    be = Backend(op, "a.data", a)
    if out is None:
        m = int(a.shape[0]) if len(a.shape) == 2 else 0
        n = int(b.shape[0]) if len(b.shape) == 2 else 0
        out = be.empty([m, n], out_dtype)
    o = _core.GemmOptions()
    o.trans_a, o.trans_b, o.accumulate, o.alpha = trans_a, trans_b, accumulate, float(alpha)
    _core.gemm_blockwise(be.desc("a.data", a), be.desc("a.scale_inv", a_scale), a_br, be.desc("b.data", b),
                         be.desc("b.scale_inv", b_scale), b_br, be.desc("out", out, bf16=True), o, be.stream())
    return out


def _codes(t: Any) -> Any:
    """A torch float8_e4m3fn code tensor as uint8 (the custom ops' type); anything else as it is."""
    return t.view(torch.uint8) if is_torch(t) and t.dtype == torch.float8_e4m3fn else t


def _check_block(op: str, arg: str, t: Any, block_rows: int) -> None:
    if not isinstance(t, BlockFP8Tensor):
        raise TypeError(f"{op}: argument '{arg}': expected a BlockFP8Tensor, got {type_name(t)}")
    if t.block_rows != block_rows:
        raise ValueError(f"{op}: argument '{arg}': needs {'1 x 128' if block_rows == 1 else '128 x 128'} blocks "
                         f"(block_rows {block_rows}), got block_rows {t.block_rows}")
