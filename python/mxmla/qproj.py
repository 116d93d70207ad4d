"""The fused Q up-projection (SPEC §4): q = x W^T (bf16 GEMM, fp32 accumulation, rounded to bf16),
RoPE on the rope part of each head (fp32), MXFP8 quantization (rowwise along the head dim,
columnwise along 32 tokens of a sequence), in one pass that never writes q in bf16 (unless asked).

Three front ends: the functional ``fused_q_uproj_rope_quant`` (torch tensors or numpy arrays; numpy
runs the CPU reference), the class ``FusedMLAQUpProjRopeQuant`` in the reference system's shape, and
the torch custom op ``torch.ops.mxmla.fused_q_uproj_rope_quant`` (with a fake implementation, so
torch.compile traces it), registered by ``register_torch_op()``.
"""
from typing import Any, Optional

from . import _mxmla_core as _core

_STYLES = ("interleaved_in_halves_out", "interleaved", "rotate_half")


def fused_q_uproj_rope_quant(x: Any, w: Any, cos: Any, sin: Any, nope_dim: int = 128, rope_dim: int = 64,
                             style: str = "interleaved_in_halves_out", layout: str = "sbhd", batch: int = 1,
                             weight_layout: str = "nk", rowwise: bool = True, columnwise: bool = True,
                             fp8_format: str = "e4m3", bhsd_scales: bool = False, return_q: bool = False) -> Any:
    """x [T, K] bf16, w [N, K] (weight_layout "nk", nn.Linear's weight) or [K, N] ("kn") bf16 with
    N = heads * (nope_dim + rope_dim), cos/sin [>= s, rope_dim] float32/bfloat16 (rope_tables builds
    them for a style) -> MXFP8Tensor of q [s, b, heads, D] (layout "sbhd", T = s*b tokens, s-major) or
    [b, s, heads, D] ("bshd"); with return_q also q itself in bf16 (after RoPE).

    With batch 1 and compact scales the buffers are the reference system's: codes [T, heads, D]
    (viewed as [T, 1, heads, D]), rowwise scales [T*heads, D/32], columnwise [ceil(T/32), heads*D].
    bhsd_scales=True writes the swizzled BHSD scales attention reads (SPEC §2.2)."""
    from . import MXFP8Tensor, _Backend, _alloc_outputs, _check_format, _descs

    _check_format(fp8_format)
    if style not in _STYLES:
        raise ValueError(f"mxmla: argument 'style': must be one of {_STYLES}, got {style!r}")
    if layout not in ("sbhd", "bshd"):
        raise ValueError(f"mxmla.fused_q_uproj_rope_quant: argument 'layout': must be 'sbhd' or 'bshd', got {layout!r}")
    if not rowwise and not columnwise:
        raise ValueError("mxmla.fused_q_uproj_rope_quant: argument 'rowwise'/'columnwise': at least one must be True")
    be = _Backend(x)
    xd = be.desc(x, "x", bf16_from_uint16=True)
    wd = be.desc(w, "w", bf16_from_uint16=True)
    if len(xd[2]) != 2 or len(wd[2]) != 2:
        raise ValueError(f"mxmla.fused_q_uproj_rope_quant: argument '{'x' if len(xd[2]) != 2 else 'w'}': must be 2-D")
    D = int(nope_dim) + int(rope_dim)
    N = wd[2][0] if weight_layout == "nk" else wd[2][1]
    heads = N // D if D > 0 else 0
    qshape, data, rs, cs = _core.qproj_shapes(xd[2][0], max(heads, 1), int(nope_dim), int(rope_dim), layout,
                                              int(batch), bool(bhsd_scales))
    outs = _alloc_outputs(be, (data, rs, cs), rowwise, columnwise)
    q = be.empty(qshape, "bfloat16") if return_q else None
    _core.fused_q_uproj_rope_quant(xd, wd, be.desc(cos, "cos", bf16_from_uint16=True),
                                   be.desc(sin, "sin", bf16_from_uint16=True), *_descs(be, outs),
                                   None if q is None else be.desc(q, "q", bf16_from_uint16=True), int(nope_dim),
                                   int(rope_dim), style, layout, int(batch), weight_layout, fp8_format,
                                   bool(bhsd_scales), be.stream())
    t = MXFP8Tensor(tuple(qshape), fp8_format, "bhsd" if bhsd_scales else "compact", *outs, layout=layout,
                    attention=True, _backend=be)
    return (t, q) if return_q else t


class FusedMLAQUpProjRopeQuant:
    """The fused Q up-projection in the reference system's shape (TransformerEngine's fused
    "Q Up-Proj GEMM/RoPE/Quant"): ``run(x, w, cos, sin, s, b)`` -> (query MXFP8Tensor, saved activation).

    The saved activation is what the backward needs from the forward: x itself (bf16 weights; the
    weight gradient is dW = dQ'^T x). x may be [s*b, K] or [s, b, K] / [b, s, K] (flattened)."""

    def __init__(self, nope_dim: int = 128, rope_dim: int = 64, style: str = "interleaved_in_halves_out",
                 layout: str = "sbhd", fp8_format: str = "e4m3", bhsd_scales: bool = False):
        self.nope_dim, self.rope_dim, self.style, self.layout = nope_dim, rope_dim, style, layout
        self.fp8_format, self.bhsd_scales = fp8_format, bhsd_scales

    @staticmethod
    def is_supported(device: Any = None) -> bool:
        """True when the SM90 kernel can run: a CUDA build and a compute-capability 9.0 device (H100/H200).
        (The CPU reference runs everywhere.)"""
        from . import info

        i = info()
        if not i["cuda_enabled"] or not i["gpus"]:
            return False
        idx = 0 if device is None else (device.index or 0) if hasattr(device, "index") else int(device)
        return idx < len(i["gpus"]) and "sm_90" in i["gpus"][idx]

    def run(self, x: Any, w: Any, cos: Any, sin: Any, s: int, b: int = 1) -> tuple:
        if len(x.shape) == 3:
            x = x.reshape(x.shape[0] * x.shape[1], x.shape[2])
        if x.shape[0] != s * b:
            raise ValueError(f"mxmla.FusedMLAQUpProjRopeQuant.run: argument 'x': {x.shape[0]} tokens, expected s*b = {s * b}")
        q = fused_q_uproj_rope_quant(x, w, cos, sin, self.nope_dim, self.rope_dim, self.style, self.layout, b,
                                     fp8_format=self.fp8_format, bhsd_scales=self.bhsd_scales)
        return q, x


_torch_op = None


def register_torch_op() -> Any:
    """Register ``torch.ops.mxmla.fused_q_uproj_rope_quant`` (a torch.library custom op returning the
    four uint8 buffers: rowwise codes, rowwise scales, columnwise codes, columnwise scales) and its
    fake (meta) implementation for torch.compile. Returns the op; idempotent."""
    global _torch_op
    if _torch_op is not None:
        return _torch_op
    import torch

    @torch.library.custom_op("mxmla::fused_q_uproj_rope_quant", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope_dim: int, rope_dim: int,
           style: str, layout: str, batch: int, fp8_format: str,
           bhsd_scales: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t = fused_q_uproj_rope_quant(x, w, cos, sin, nope_dim, rope_dim, style, layout, batch,
                                     fp8_format=fp8_format, bhsd_scales=bhsd_scales)
        return t.rowwise_data, t.rowwise_scale_inv, t.columnwise_data, t.columnwise_scale_inv

    @op.register_fake
    def _(x, w, cos, sin, nope_dim, rope_dim, style, layout, batch, fp8_format, bhsd_scales):
        heads = w.shape[0] // (nope_dim + rope_dim)
        _, data, rs, cs = _core.qproj_shapes(x.shape[0], heads, nope_dim, rope_dim, layout, batch, bhsd_scales)
        e = lambda shape: x.new_empty(tuple(shape), dtype=torch.uint8)  # noqa: E731
        return e(data), e(rs), e(data), e(cs)

    _torch_op = op
    return op
