"""mxmla.nn: DeepSeek-V3's attention block (MLA) and a small decoder around it, as torch modules.

- ``MLA``: Multi-head Latent Attention with DeepSeek-V3's structure (q_a projection, RMSNorm, Q
  up-projection; kv_a projection with the shared k_pe and its RoPE, RMSNorm, kv_b projection to
  k_nope and v; causal attention; output projection), on sbhd / bshd hidden states or thd packed
  sequences with cu_seqlens. RoPE is mxmla.apply_rope (DeepSeek's "interleaved" style, plain or
  YaRN tables from mxmla.rope_tables).
- ``MLAQUpProj`` and ``attention_from_mxfp8_q``: the fused Q up-projection + RoPE + MXFP8 as a module
  whose MXFP8 Q feeds attention directly, with autograd (an anchor tensor carries dQ back);
  ``attention_from_latent``: the same attention with K and V made from the KV latent by the kv_b
  projection and quantized from their views of its output (no concatenation passes either way).
- ``DotProductAttention``: MXFP8 attention with autograd (bf16 q, k, v quantized to MXFP8 with both
  copies; saved: the MXFP8 tensors, O and LSE; the backward returns bf16 gradients).
- ``context_parallel_attention``, ``cp_split``, ``cp_gather``: context parallelism (a sequence split
  over a process group's ranks, keys and values passed around a ring; mxmla.nn.cp), also through
  ``cp_group=`` of DotProductAttention, MLA, Block and Decoder.
- ``RMSNorm``, ``SwiGLU`` (DeepSeek-V3's dense MLP), ``Linear`` (the one place a recipe's GEMM runs),
  ``Block`` and ``Decoder`` (256 byte tokens, N blocks, final norm, LM head).
- ``config_kwargs``, ``load_pretrained``, ``read_checkpoint``, ``pretrained_state_dict``: DeepSeek-V2 / V3 checkpoints
  (Hugging Face's names, FP8 weights with their block scales), Megatron-Core's and DeepSeek's
  names in and out of MLA, SwiGLU and Block (mxmla.nn.pretrained).

Recipes: ``"bf16"`` (the baseline: every Linear and the attention in bf16 with fp32 accumulation,
parameters in fp32) and ``"mxfp8"`` (every Linear on mxmla's MXFP8 GEMM with its three directions,
``MXFP8LinearFunction``; attention on MXFP8 Q, K, V with mxmla's forward and backward,
``MXFP8Attention``; ``MLA`` with a q_lora rank on sbhd / bshd: the fused Q up-projection and
``attention_from_latent``) and ``"block-fp8"`` (DeepSeek-V3's recipe: every Linear on mxmla's
block-FP8 GEMM, ``BlockFP8LinearFunction``; the attention in bf16 as in "bf16"). ``fp8_attention=False``
of MLA, Block and Decoder keeps "mxfp8"'s Linears and runs the attention in bf16 (TransformerEngine's
``fp8_dpa`` off). On a GPU the FP8 recipes run mxmla's CUDA kernels; the README says how fast against
the bf16 recipe.

Needs torch (``import mxmla`` does not import this subpackage, and works without torch).
"""
from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("mxmla.nn needs torch (pip install torch); the rest of mxmla works without it") from e

from ..attention_autograd import DotProductAttention
from .cp import context_parallel_attention, cp_gather, cp_split
from .decoder import Block, Decoder, byte_tokens
from .layers import RECIPES, BlockFP8LinearFunction, Linear, MXFP8LinearFunction, RMSNorm, SwiGLU, check_recipe, \
    invalidate_weight_caches
from .mla import MLA
from .pretrained import config_kwargs, load_pretrained, pretrained_state_dict, read_checkpoint
from .qproj import MLAQUpProj, attention_from_latent, attention_from_mxfp8_q

__all__ = ["MLA", "MLAQUpProj", "attention_from_mxfp8_q", "attention_from_latent", "DotProductAttention", "MXFP8LinearFunction", "BlockFP8LinearFunction", "RMSNorm", "SwiGLU", "Linear", "Block", "Decoder", "RECIPES", "check_recipe", "byte_tokens",
           "config_kwargs", "load_pretrained", "pretrained_state_dict", "read_checkpoint",
           "invalidate_weight_caches", "context_parallel_attention", "cp_split", "cp_gather"]
