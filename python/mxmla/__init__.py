"""mxmla: MXFP8 quantization, attention and GEMMs for MLA training (TransformerEngine-compatible semantics).

Every op accepts torch tensors (CPU or CUDA; CUDA work runs on torch's current stream) and numpy
arrays (float32, float16, and bfloat16 as ``ml_dtypes.bfloat16`` or as uint16 bit patterns where
the op takes bfloat16), and returns the same kind. CPU data runs the CPU reference, CUDA data the
sm_90a kernels. This layer only checks, allocates and calls the compiled core; the rules live in
C++ and their errors are ValueError naming the op, the argument and the rule.

torch: every op is also a ``torch.library`` custom op, ``torch.ops.mxmla.<op>``, with a fake
implementation (``torch.compile(fullgraph=True)`` traces them), registered on ``import mxmla``
when torch is importable. apply_rope / rope_backward are differentiable; the other ops raise when
an input requires grad (grad mode on) instead of cutting the graph silently.
"""
from __future__ import annotations

from typing import Any, Dict

from . import _mxmla_core as _core
from ._backend import torch_available as _torch_available
from .attention import attention, qkv_layout
from .attention_backward import attention_backward
from .blockfp8 import BlockFP8Tensor, quantize_blockwise, quantize_blockwise_both
from .gemm import gemm, linear_backward, linear_forward, rope_linear_backward
from .mxfp8 import (
    MXFP8Tensor,
    attention_scales_to_bhsd,
    dequantize,
    quantize,
    quantize_attention,
    swizzle_scales,
    to_bhsd,
    unswizzle_scales,
)
from .qproj import FusedMLAQUpProjRopeQuant, fused_q_uproj_rope_quant, register_torch_op
from .rope import (
    DEEPSEEK_V3_YARN,
    STYLES,
    RopeTableArray,
    RopeTables,
    apply_rope,
    positions_arange,
    positions_context_parallel,
    positions_from_cu_seqlens,
    rope_backward,
    rope_backward_quantize,
    rope_inv_freq,
    rope_tables,
    table_style,
    yarn_softmax_scale,
)

# The bound C++ enums and YaRN parameters (the ops accept a member wherever they take its spelling).
Fp8Format = _core.Fp8Format
ScaleLayout = _core.ScaleLayout
QKVLayout = _core.QKVLayout
RopeStyle = _core.RopeStyle
RopeLayout = _core.RopeLayout
WeightLayout = _core.WeightLayout
AttnFormat = _core.AttnFormat
PFormat = _core.PFormat
YarnParams = _core.YarnParams

__all__ = [
    "MXFP8Tensor",
    "BlockFP8Tensor",
    "quantize_blockwise",
    "quantize_blockwise_both",
    "quantize",
    "dequantize",
    "swizzle_scales",
    "unswizzle_scales",
    "quantize_attention",
    "attention_scales_to_bhsd",
    "to_bhsd",
    "attention",
    "attention_backward",
    "qkv_layout",
    "gemm",
    "linear_backward",
    "rope_linear_backward",
    "linear_forward",
    "info",
    "scratch_memory",
    "release_scratch",
    "apply_rope",
    "rope_backward",
    "rope_backward_quantize",
    "rope_tables",
    "RopeTables",
    "RopeTableArray",
    "table_style",
    "rope_inv_freq",
    "yarn_softmax_scale",
    "positions_arange",
    "positions_from_cu_seqlens",
    "positions_context_parallel",
    "DEEPSEEK_V3_YARN",
    "STYLES",
    "fused_q_uproj_rope_quant",
    "FusedMLAQUpProjRopeQuant",
    "register_torch_op",
    "Fp8Format",
    "ScaleLayout",
    "QKVLayout",
    "RopeStyle",
    "RopeLayout",
    "WeightLayout",
    "AttnFormat",
    "PFormat",
    "YarnParams",
]

__version__ = _core.build_info()[0]


def info() -> Dict[str, Any]:
    """Build and device information."""
    version, cuda, archs, cuda_rope = _core.build_info()
    n = _core.cuda_device_count()
    return {
        "version": version,
        "cuda_enabled": cuda,
        "cuda_archs": archs,
        "cuda_rope": cuda_rope,
        "gpus": [_core.cuda_device_description(i) for i in range(n)],
        "torch_ops": _torch_available(),
    }


def scratch_memory(reset_peak: bool = False) -> Dict[str, int]:
    """The current CUDA device's default memory pool, where mxmla's kernels take their stream-ordered
    scratch (cudaMallocAsync: the bf16 copies and fp32 accumulators of the attention backward, the
    GEMM's converted operands, ...): {"in_use": bytes now, "peak": the most in use since the last
    reset}; reset_peak=True first resets the peak to what is in use now. torch's caching allocator
    does not see this memory (``torch.cuda.max_memory_allocated`` leaves it out) unless torch itself
    allocates from the same pool (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``): then both are
    counted here. Zeros without CUDA."""
    if not isinstance(reset_peak, bool):
        raise TypeError(f"mxmla.scratch_memory: argument 'reset_peak': must be a bool, got {type(reset_peak).__name__}")
    if _core.cuda_device_count() == 0:
        return {"in_use": 0, "peak": 0}
    cur, high = _core.cuda_pool_usage(reset_peak)
    return {"in_use": int(cur), "peak": int(max(cur, high))}


def release_scratch() -> int:
    """Returns the current CUDA device's unused scratch memory to the driver and gives the bytes
    released (0 without CUDA). mxmla's stream-ordered scratch comes from the device's default memory
    pool, which keeps what it has reserved across synchronizations (the first mxmla allocation on a
    device raises the pool's release threshold, as torch's cudaMallocAsync backend does), so that
    repeated calls do not map their scratch again after every synchronization; like
    ``torch.cuda.empty_cache()`` for torch's cache, this gives it back, after synchronizing the
    device."""
    if _core.cuda_device_count() == 0:
        return 0
    return int(_core.cuda_pool_release())


if _torch_available():
    import torch as _torch

    if not hasattr(_torch.library, "custom_op"):
        raise ImportError(f"mxmla: torch {_torch.__version__} is too old for mxmla's torch ops (torch.library.custom_op "
                          "needs torch >= 2.4); upgrade torch or uninstall it to use the numpy API")
    from . import _torch_ops  # noqa: F401,E402  (registers torch.ops.mxmla.*)
    from .attention_autograd import MXFP8Attention  # noqa: E402  (attention with autograd)

    __all__.append("MXFP8Attention")
