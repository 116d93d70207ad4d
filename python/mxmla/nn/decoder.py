"""A small DeepSeek-V3-shaped decoder on byte tokens: embedding of 256 byte values, N blocks of
[RMSNorm -> MLA -> residual, RMSNorm -> SwiGLU -> residual], final RMSNorm, LM head.

The residual stream is kept in the parameters' dtype (fp32; float64 for a float64 model); the
blocks compute in the recipe's dtype. Dense SwiGLU blocks only (DeepSeek-V3's first layers; no MoE).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear, RMSNorm, SwiGLU, check_bool, check_recipe, child_seed, default_inter_dim, \
    fp8_attention_of, generator, init_normal_, resolve_dtypes
from .mla import MLA, CuSeqlens
from .tp import UnshardedStateDict, check_sp_split, gather_from_sp, scatter_to_sp, tp_size_rank


def byte_tokens(text: Union[str, bytes, bytearray], device: Any = None) -> torch.Tensor:
    """The UTF-8 bytes of `text` (or the bytes themselves) as int64 token ids 0..255."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.int64)


class Block(nn.Module):
    """x + MLA(attn_norm(x)), then + SwiGLU(ffn_norm(x)) (DeepSeek-V3's Block, dense MLP).

    tp_group: both MLA and the MLP tensor parallel (see there). sequence_parallel: with tp_group, x
    and the output are this rank's slice of the sequence; the norms normalize the slice (their weight
    gradients summed over the ranks), MLA and the MLP gather it and reduce-scatter their outputs.
    cp_group: MLA context parallel (see there): x is this rank's two chunks of each sequence; the
    norms and the MLP work on them as they are. fp8_attention: MLA's (see there)."""

    def __init__(self, hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int, nope_dim: int, rope_dim: int,
                 v_dim: int, inter_dim: int, recipe: str = "bf16", yarn: Any = None, *, max_seq_len: int = 4096,
                 rope_base: float = 10000.0, norm_eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16,
                 params_dtype: Optional[torch.dtype] = None, init_std: float = 0.02,
                 out_init_std: Optional[float] = None, seed: int = 0, tp_group: Any = None,
                 deterministic: bool = False, sequence_parallel: bool = False, cp_group: Any = None,
                 cp_comm_type: str = "p2p", fp8_attention: Optional[bool] = None):
        super().__init__()
        check_recipe(recipe, "mxmla.nn.Block")
        sequence_parallel = check_bool("mxmla.nn.Block", "sequence_parallel", sequence_parallel)
        dtype, params_dtype = resolve_dtypes("mxmla.nn.Block", dtype, params_dtype)
        g = generator(seed)
        self.attn_norm = RMSNorm(hidden, norm_eps, params_dtype)
        self.attn = MLA(hidden, heads, q_lora_rank, kv_lora_rank, nope_dim, rope_dim, v_dim, recipe, yarn,
                        rope_base=rope_base, max_seq_len=max_seq_len, norm_eps=norm_eps, dtype=dtype,
                        params_dtype=params_dtype, init_std=init_std, out_init_std=out_init_std, seed=child_seed(g),
                        tp_group=tp_group, deterministic=deterministic, sequence_parallel=sequence_parallel,
                        cp_group=cp_group, cp_comm_type=cp_comm_type, fp8_attention=fp8_attention)
        self.ffn_norm = RMSNorm(hidden, norm_eps, params_dtype)
        self.ffn = SwiGLU(hidden, inter_dim, recipe, dtype, params_dtype, init_std, out_init_std, seed=child_seed(g),
                          tp_group=tp_group, sequence_parallel=sequence_parallel)
        if sequence_parallel and tp_size_rank(tp_group)[0] > 1:
            self.attn_norm.sequence_parallel_group = self.ffn_norm.sequence_parallel_group = tp_group

    @classmethod
    def from_pretrained(cls, path: Any, layer: int, prefix: Optional[str] = None, **kwargs: Any) -> "Block":
        """Layer `layer` (a dense one) of a Hugging Face DeepSeek-V2 / V3 checkpoint folder, with kwargs
        added to its config's arguments: mxmla.nn.pretrained.from_pretrained."""
        from .pretrained import from_pretrained

        return from_pretrained(cls, path, layer, prefix, **kwargs)

    def forward(self, x: torch.Tensor, cu_seqlens: CuSeqlens = None, layout: str = "bshd") -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cu_seqlens, layout).to(x.dtype)
        return x + self.ffn(self.ffn_norm(x), seq_dim=1 if layout == "bshd" else 0).to(x.dtype)


class Decoder(UnshardedStateDict, nn.Module):
    """A causal language model on byte tokens built from MLA blocks.

    Args:
        hidden, layers, heads: the model's size.
        q_lora_rank (default hidden/2), kv_lora_rank (hidden/4), nope_dim (hidden/heads),
        rope_dim (nope_dim/2 rounded down to a multiple of 16, at least 16: the granularity of
            mxmla's CUDA RoPE kernel), v_dim (nope_dim), inter_dim (SwiGLU width, 8/3·hidden rounded
            up to 64): MLA's and the MLP's dimensions, in DeepSeek-V3's proportions by default.
        vocab_size: 256 (bytes). max_seq_len: the longest sequence (RoPE tables).
        recipe: "bf16" (the baseline) or "mxfp8" (every Linear of the blocks on the MXFP8 GEMM and
            the attention on MXFP8 Q, K, V; see mxmla.nn.MLA). The embedding and the output head stay
            bf16 under both recipes, as DeepSeek-V3 trains them and as Megatron's output layer is
            not a TransformerEngine FP8 layer.
        yarn, rope_base, norm_eps, dtype, params_dtype: as for MLA.
        init_std: N(0, init_std) for the embedding and every projection; the projections into the
            residual stream (wo, w2) use init_std / sqrt(2·layers).
        seed: every weight is drawn from this seed (the same weights on any device and dtype).
        tp_group: tensor parallelism of every block, Megatron's: MLA's heads (see mxmla.nn.MLA) and the
            MLP's inter_dim (see mxmla.nn.SwiGLU) split over the ranks; the embedding, the norms and
            the output head replicated. unsharded_state_dict() / load_unsharded_state_dict() convert
            to and from a tp size of 1's state dict.
        sequence_parallel: with tp_group, Megatron's sequence parallelism: between the blocks each
            rank holds its slice of the sequence (s of [b, s], the packed tokens of [t]; a multiple of
            the tp size), so the residual stream, the blocks' norms and the activations saved around
            them take 1/tp of the memory; the blocks gather the sequence for MLA and the MLP and
            reduce-scatter their outputs, the final norm and the head run on the gathered sequence.
        cp_group: context parallelism of every block's attention (see mxmla.nn.MLA): forward's tokens
            [b, s] are this rank's two chunks of each sequence (mxmla.nn.cp_split of the whole
            tokens along dim 1, the targets split the same way; packed tokens [t]: cp_split with the
            whole sequences' cu_seqlens, which forward then takes); the logits and loss are the rank's
            tokens'; the parameters' gradients are to be summed over the group. cp_comm_type: "p2p"
            or "a2a" (see MLA).
        deterministic: every MLA block's attention backward in a fixed summation order (see MLA).
        fp8_attention: every MLA block's (see MLA): False under "mxfp8" runs the attention in bf16.
        device: where the model lives.

    forward(tokens, cu_seqlens=None) -> logits (fp32; float64 for a float64 model):
    tokens [b, s] (bshd) -> [b, s, vocab]; tokens [t] (packed, with cu_seqlens) -> [t, vocab].
    loss(tokens, targets, cu_seqlens=None): mean next-token cross entropy (nats per token).
    """

    def __init__(self, hidden: int = 256, layers: int = 4, heads: int = 4, q_lora_rank: Optional[int] = None,
                 kv_lora_rank: Optional[int] = None, nope_dim: Optional[int] = None, rope_dim: Optional[int] = None,
                 v_dim: Optional[int] = None, inter_dim: Optional[int] = None, vocab_size: int = 256,
                 max_seq_len: int = 1024, recipe: str = "bf16", yarn: Any = None, *, rope_base: float = 10000.0,
                 norm_eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16, params_dtype: Optional[torch.dtype] = None,
                 init_std: float = 0.02, seed: int = 0, device: Any = None, tp_group: Any = None,
                 deterministic: bool = False, sequence_parallel: bool = False, cp_group: Any = None,
                 cp_comm_type: str = "p2p", fp8_attention: Optional[bool] = None):
        super().__init__()
        what = "mxmla.nn.Decoder"
        self.sequence_parallel = check_bool(what, "sequence_parallel", sequence_parallel)
        self.tp_group = tp_group
        self.tp_size, _ = tp_size_rank(tp_group)
        self.recipe = check_recipe(recipe, what)
        self.dtype, params_dtype = resolve_dtypes(what, dtype, params_dtype)
        for k, v in dict(hidden=hidden, layers=layers, heads=heads, vocab_size=vocab_size).items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what}: {k} must be a positive int, got {v!r}")
        nope_dim = nope_dim or max(2, hidden // heads)
        rope_dim = rope_dim or max(16, nope_dim // 2 // 16 * 16)
        cfg = dict(hidden=hidden, layers=layers, heads=heads, q_lora_rank=q_lora_rank if q_lora_rank is not None
                   else max(1, hidden // 2), kv_lora_rank=kv_lora_rank or max(1, hidden // 4), nope_dim=nope_dim,
                   rope_dim=rope_dim, v_dim=v_dim or nope_dim, inter_dim=inter_dim or default_inter_dim(hidden),
                   vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.config = dict(cfg, recipe=recipe, yarn=yarn)
        if fp8_attention is not None:  # only when given (the configurations saved before it stay loadable)
            self.config["fp8_attention"] = fp8_attention_of(what, self.recipe, fp8_attention)
        g = generator(seed)
        out_std = init_std / math.sqrt(2 * layers)
        self.embed = nn.Parameter(torch.empty(vocab_size, hidden, dtype=params_dtype))
        init_normal_(self.embed, init_std, g)
        self.layers = nn.ModuleList(
            Block(hidden, heads, cfg["q_lora_rank"], cfg["kv_lora_rank"], nope_dim, rope_dim, cfg["v_dim"],
                  cfg["inter_dim"], recipe, yarn, max_seq_len=max_seq_len, rope_base=rope_base, norm_eps=norm_eps,
                  dtype=dtype, params_dtype=params_dtype, init_std=init_std, out_init_std=out_std,
                  seed=child_seed(g), tp_group=tp_group, deterministic=deterministic,
                  sequence_parallel=sequence_parallel, cp_group=cp_group, cp_comm_type=cp_comm_type,
                  fp8_attention=fp8_attention)
            for _ in range(layers))
        self.norm = RMSNorm(hidden, norm_eps, params_dtype)
        # the output head in bf16 under every recipe (DeepSeek-V3 §3.3.1 keeps it in higher precision)
        self.head = Linear(hidden, vocab_size, "bf16", dtype, params_dtype, init_std, seed=child_seed(g))
        if device is not None:
            self.to(device)

    def forward(self, tokens: torch.Tensor, cu_seqlens: CuSeqlens = None) -> torch.Tensor:
        if tokens.dim() == 2:
            layout = "bshd"
        elif tokens.dim() == 1:
            layout = "thd"
        else:
            raise ValueError(f"mxmla.nn.Decoder: tokens must be [b, s] or packed [t], got {tuple(tokens.shape)}")
        h = F.embedding(tokens, self.embed)
        sp = self.sequence_parallel and self.tp_size > 1
        seq_dim = 1 if layout == "bshd" else 0
        if sp:  # this rank's slice of the sequence between the blocks
            check_sp_split("mxmla.nn.Decoder", tokens, seq_dim, self.tp_group, "tokens")
            h = scatter_to_sp(h, seq_dim, self.tp_group)
        for layer in self.layers:
            h = layer(h, cu_seqlens, layout)
        if sp:  # the final norm and the head on the whole sequence (replicated: the same gradient on every rank)
            h = gather_from_sp(h, seq_dim, self.tp_group)
        logits = self.head(self.norm(h))
        return logits.to(torch.float64 if self.dtype == torch.float64 else torch.float32)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, cu_seqlens: CuSeqlens = None) -> torch.Tensor:
        logits = self(tokens, cu_seqlens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items()) + \
            (", sequence_parallel=True" if self.sequence_parallel else "")
