"""DeepSeek-V3's Multi-head Latent Attention (MLA) as a torch module, for training.

The structure is DeepSeek-V3's (inference/model.py, class MLA, the "naive" attention that
materializes K and V; the parameter names are its names):

    q      = wq_b(q_norm(wq_a(x)))                  [.., heads, nope_dim + rope_dim]   (q_lora_rank > 0)
           = wq(x)                                                                      (q_lora_rank == 0)
    q      = RoPE on the trailing rope_dim of each head (q_pe); q_nope passes through
    kv, k_pe = split(wkv_a(x), [kv_lora_rank, rope_dim])   k_pe: one head, shared by all heads
    k_pe   = RoPE(k_pe)
    k_nope, v = split(wkv_b(kv_norm(kv)) as [.., heads, nope_dim + v_dim], [nope_dim, v_dim])
    k      = [k_nope | k_pe broadcast to every head]
    o      = causal softmax(q·kᵀ · softmax_scale) · v        per sequence
    out    = wo(o flattened over heads)

softmax_scale = (nope_dim + rope_dim)^-0.5, times YaRN's mscale² when `yarn` is given
(mxmla.yarn_softmax_scale). RoPE is mxmla.apply_rope with DeepSeek's "interleaved" style (pairs
(x[2i], x[2i+1]) rotated as complex numbers) on tables from mxmla.rope_tables (plain, or YaRN with
yarn="deepseek_v3" or a dict). apply_rope takes fp32 / bf16 / fp16; a float64 module (reference
checks) runs the same rotation in plain torch.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import rope as _rope
from .layers import Linear, RMSNorm, check_bool, check_recipe, child_seed, fp8_attention_of, generator, \
    resolve_dtypes
from .tp import UnshardedStateDict, copy_to_tp, gather_from_sp, keep_shards, reduce_from_tp, reduce_scatter_to_sp, \
    tp_size_rank

LAYOUTS = ("bshd", "sbhd", "thd")
ROPE_STYLE = "interleaved"  # DeepSeek-V3's apply_rotary_emb (complex pairs, output interleaved)

CuSeqlens = Union[None, Sequence[int], torch.Tensor]


def cu_seqlens_list(what: str, cu_seqlens: CuSeqlens, tokens: int) -> List[int]:
    """cu_seqlens as a host list of ints (0 = c_0 <= c_1 <= ... <= c_n = tokens); None: one sequence."""
    if cu_seqlens is None:
        return [0, tokens]
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise ValueError(f"{what}: cu_seqlens must be a 1-D int32 / int64 tensor, got {cu_seqlens.dtype} "
                             f"of shape {tuple(cu_seqlens.shape)}")
        cu = [int(v) for v in cu_seqlens.tolist()]
    elif isinstance(cu_seqlens, (list, tuple)):
        cu = [int(v) for v in cu_seqlens]
    else:
        raise TypeError(f"{what}: cu_seqlens must be a list / tuple of ints or an int tensor, "
                        f"got {type(cu_seqlens).__name__}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{what}: cu_seqlens must start at 0, never decrease and end at the token count {tokens}, "
                         f"got {cu}")
    return cu


def sequences(what: str, x: torch.Tensor, layout: str, cu_seqlens: CuSeqlens,
              max_seq_len: int) -> Tuple[Optional[List[int]], int]:
    """(cu_seqlens as a host list or None, the longest sequence) of x ([b, s, ..] bshd, [s, b, ..] sbhd,
    [t, ..] thd), checked: cu_seqlens only with thd, no sequence longer than max_seq_len."""
    cu = None
    if layout == "thd":
        from .qproj import refuse_thd_capture

        refuse_thd_capture()
        cu = cu_seqlens_list(what, cu_seqlens, x.shape[0])
        longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    else:
        if cu_seqlens is not None:
            raise ValueError(f"{what}: cu_seqlens is for layout 'thd' (packed sequences), not '{layout}'")
        longest = x.shape[1] if layout == "bshd" else x.shape[0]
    if longest > max_seq_len:
        raise ValueError(f"{what}: a sequence of {longest} tokens is longer than max_seq_len={max_seq_len}")
    return cu, longest


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str, rope_dim: int,
               cu: Optional[List[int]]) -> torch.Tensor:
    """The "interleaved" rotation of the trailing rope_dim of x in plain torch (any float dtype);
    cos / sin: interleaved tables (each angle twice), rows by position as apply_rope reads them."""
    if layout == "thd":
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])]).to(cos.device)
        c, s = cos[pos][:, None, 0::2], sin[pos][:, None, 0::2]
    else:
        n = x.shape[1] if layout == "bshd" else x.shape[0]
        c, s = cos[:n, 0::2], sin[:n, 0::2]
        shape = (1, n, 1, -1) if layout == "bshd" else (n, 1, 1, -1)
        c, s = c.reshape(shape), s.reshape(shape)
    c, s = c.to(x.dtype), s.to(x.dtype)
    xr = x[..., x.shape[-1] - rope_dim:]
    a, b = xr[..., 0::2], xr[..., 1::2]
    rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([x[..., :x.shape[-1] - rope_dim], rot], dim=-1)


def _words8(t: torch.Tensor) -> bool:
    """Whether t can be viewed as 8-byte words: its last dim contiguous and a whole number of words,
    its offset and every other stride whole words (torch's rule for Tensor.view(dtype))."""
    n = 8 // t.element_size() if t.element_size() <= 8 else 0
    return (n > 0 and t.dim() > 0 and t.stride(-1) == 1 and t.shape[-1] % n == 0 and t.storage_offset() % n == 0
            and all(st % n == 0 for st in t.stride()[:-1]))


def _copy_wide(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) (same dtype, src broadcastable), moved as 8-byte words where both views allow:
    torch's strided copy of 2-byte elements runs well below the memory's bandwidth."""
    if _words8(dst) and _words8(src):
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:  # a layout that 8-byte words do not tile (e.g. a transposed gradient)
        dst.copy_(src)


class _KVFromProjection(torch.autograd.Function):
    """(K, V) for a bf16 attention from the kv_b projection's output kv [.., heads, nope + v_dim] and
    the shared rope key k_pe [.., 1, rope]: K = [k_nope | k_pe broadcast] written by two strided copies
    (8-byte words where the views allow: torch.cat along the last dim of short rows is several times
    slower), V copied out the same way (so that attention's saved V does not hold kv's k_nope half
    until the backward). Backward:
    dkv = [dK_nope | dV] written the same way (autograd's split backward would concatenate too) and
    dk_pe = Σ over the heads of dK_pe. The "block-fp8" recipe's; "bf16" keeps the plain torch graph
    of what users run."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, k_pe: torch.Tensor, nope: int):
        k = kv.new_empty(*kv.shape[:-1], nope + k_pe.shape[-1])
        _copy_wide(k[..., :nope], kv[..., :nope])
        _copy_wide(k[..., nope:], k_pe.expand(*kv.shape[:-1], k_pe.shape[-1]))
        v = kv.new_empty(*kv.shape[:-1], kv.shape[-1] - nope)
        _copy_wide(v, kv[..., nope:])
        ctx.nope, ctx.v_dim = nope, v.shape[-1]
        return k, v

    @staticmethod
    def backward(ctx, dk: Optional[torch.Tensor], dv: Optional[torch.Tensor]):
        nope = ctx.nope
        ref = dk if dk is not None else dv
        dkv = ref.new_empty(*ref.shape[:-1], nope + ctx.v_dim)
        for part, g in ((dkv[..., :nope], None if dk is None else dk[..., :nope]), (dkv[..., nope:], dv)):
            _copy_wide(part, g) if g is not None else part.zero_()
        dk_pe = None if dk is None else dk[..., nope:].sum(-2, keepdim=True)
        return dkv, dk_pe, None


class MLA(UnshardedStateDict, nn.Module):
    """DeepSeek-V3 Multi-head Latent Attention (see the module docstring for the computation).

    Args:
        hidden, heads, q_lora_rank (0: a single wq projection, as DeepSeek's model.py does),
        kv_lora_rank, nope_dim, rope_dim, v_dim: the dimensions (DeepSeek-V3: 7168, 128, 1536, 512,
            128, 64, 128).
        recipe: "bf16" (the baseline: every Linear and the attention in bf16, fp32 accumulation,
            fp32 parameters) or "mxfp8" (every Linear on mxmla's MXFP8 GEMM, MXFP8LinearFunction;
            the attention on MXFP8 Q, K, V with mxmla's backward; RMSNorm and the rope key's RoPE
            in bf16 as in "bf16"). Under "mxfp8" the query's up-projection (wq_b; wq when
            q_lora_rank is 0) is the fused Q up-projection with an MXFP8 weight, as the reference
            system runs it (the MXFP8 GEMM, RoPE and the MXFP8 quantization of q in one op;
            attention reads that MXFP8 Q; mxmla.nn.MLAQUpProj's autograd), and K and V come from
            wkv_b through mxmla.nn.attention_from_latent (quantized from their views of its
            output, its backward reading dK and dV in place: no concatenation pass), in every
            layout (thd: q, K and V quantized as [t, h·d], columnwise blocks along the packed
            tokens, as TransformerEngine's thd). "mxfp8" needs dtype bf16, every Linear's
            dimensions and nope_dim + rope_dim multiples of 32. "block-fp8": DeepSeek-V3's own
            recipe (TransformerEngine's Float8BlockScaling; docs/spec.md §4.1): every Linear on the
            block-FP8 GEMM (BlockFP8LinearFunction: activations and gradients in 1 x 128 blocks,
            weights in 128 x 128 blocks, Hopper's FP8 tensor cores), the attention, RoPE and
            RMSNorm as in "bf16" (DeepSeek-V3 keeps its attention in bf16), K and V assembled
            from wkv_b's output without concatenation passes; dtype bf16, any dims.
        yarn: None (plain RoPE), "deepseek_v3" or a dict of YaRN parameters (mxmla.rope_tables);
            it also sets the softmax scale's mscale² (DeepSeek-V3 trains with YaRN only past 4K).
        rope_base: RoPE's base (10000). max_seq_len: the longest sequence (the tables' length).
            On CUDA, mxmla's RoPE kernel wants rope_dim a multiple of 16 and nope_dim + rope_dim
            a multiple of 8 (16-byte rows); it says so otherwise.
        softmax_scale: overrides the default (nope_dim + rope_dim)^-0.5 · mscale².
        layout: the default layout of forward's x: "bshd" [b, s, hidden], "sbhd" [s, b, hidden] or
            "thd" [t, hidden] (packed sequences, cu_seqlens).
        dtype: compute dtype (bf16 for the recipe; float32 / float64 for reference checks).
        params_dtype: parameters' dtype (default fp32; float64 when dtype is float64).
        init_std, out_init_std: N(0, std) initialization of the projections (wo: out_init_std).
        seed: the weights are drawn from this seed (CPU generator): the same seed gives the same
            weights on any device and at any dtype.
        device: where the module lives (built on the CPU, then moved).
        fp8_attention: whether the attention runs in MXFP8 (TransformerEngine's fp8_dpa). None (default):
            the recipe's own — MXFP8 under "mxfp8", bf16 under "bf16" and "block-fp8". False under
            "mxfp8": every Linear in MXFP8 as before, the attention in bf16 as "block-fp8" runs it (the
            query by wq_b's MXFP8 GEMM and mxmla's RoPE instead of the fused Q op, K and V assembled
            without concatenation passes, torch's SDPA saving bf16 q, K, V and O); the head dims need
            not be multiples of 32 then (the Linears' dims still must). True needs "mxfp8".
        deterministic: with MXFP8 attention, its backward adds dQ's parts in a fixed order
            (attention_backward's deterministic=True: bitwise reproducible gradients, at about 1.1x the
            backward's time; also while torch.use_deterministic_algorithms(True) is on); a bf16
            attention (torch's SDPA) follows torch.use_deterministic_algorithms.
        delay_wgrad: under the FP8 recipes, the output projection's weight gradient runs after the
            rest of the block's backward instead of first (mxmla.nn.layers.DeferredWgrad): its fp32
            gradient (4·hidden·heads·v_dim bytes, 448 MiB at DeepSeek-V3's dims) is then allocated
            after the attention backward's memory peak. The same gradient bits; default True.
            "bf16" (the plain torch baseline) ignores it.
        tp_group: a torch.distributed process group for tensor parallelism (None: no parallelism).
            Heads are split evenly over its ranks: wq / wq_b and wkv_b keep this rank's heads (column
            parallel), wo their columns (row parallel, its output all-reduced); wq_a, q_norm, wkv_a,
            kv_norm and the rope key are replicated (their gradients summed over the ranks). Every
            rank draws the full weights from `seed` and keeps its shards, so a seed gives the same
            model at any tp size; unsharded_state_dict() / load_unsharded_state_dict() convert.
        sequence_parallel: with tp_group, Megatron's sequence parallelism: forward's x and its
            output are this rank's slice of the sequence dim (s of bshd / sbhd, t of thd; rank r
            holds the r-th of tp equal slices), all-gathered at the block's start, and wo's partial
            sums are reduce-scattered into the output's slice instead of all-reduced. cu_seqlens then
            describe the whole (gathered) packed sequence. Without tp_group (or at tp 1) it changes
            nothing.
        cp_group: a torch.distributed process group for context parallelism (None: none). forward's
            x is then this rank's part of every sequence: chunks r and 2·cp−1−r of 2·cp equal chunks
            (mxmla.nn.cp_split; thd: of each sequence, packed, and cu_seqlens are the whole sequences',
            each a multiple of 2·cp long), its RoPE positions those chunks' positions
            (mxmla.positions_context_parallel), and the attention runs over the whole sequence with
            mxmla.nn.context_parallel_attention (keys and values around the ring of ranks; under
            "mxfp8" in MXFP8, each chunk quantized on its own; under "bf16" and "block-fp8" mxmla's
            bf16 attention). Every Linear works on the rank's tokens only; the parameters'
            gradients are the rank's parts, to be summed over the group (as data parallelism sums
            them: Megatron reduces over data x context parallel ranks). Under "mxfp8" the query's
            up-projection is then an MXFP8 Linear followed by RoPE (not the fused op). Needs dtype
            bf16, an even local length, and max_seq_len >= the whole sequence (cp x the local length).
        cp_comm_type: "p2p" (the ring, default) or "a2a" (all-to-all: each rank attends the whole
            sequences with heads/cp of its heads; the heads (per tensor-parallel rank) divisible by cp).

    forward(x, cu_seqlens=None, layout=None) -> [.., hidden] in the compute dtype, same layout as x.
    Attention is causal (top-left) within each sequence; with thd, each sequence of cu_seqlens
    attends only to itself and its RoPE positions restart at 0.
    """

    def __init__(self, hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int, nope_dim: int = 128,
                 rope_dim: int = 64, v_dim: int = 128, recipe: str = "bf16", yarn: Any = None, *,
                 rope_base: float = 10000.0, max_seq_len: int = 4096, softmax_scale: Optional[float] = None,
                 layout: str = "bshd", norm_eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16,
                 params_dtype: Optional[torch.dtype] = None, init_std: float = 0.02,
                 out_init_std: Optional[float] = None, seed: int = 0, device: Any = None, tp_group: Any = None,
                 deterministic: bool = False, delay_wgrad: bool = True, sequence_parallel: bool = False,
                 cp_group: Any = None, cp_comm_type: str = "p2p", fp8_attention: Optional[bool] = None):
        super().__init__()
        what = "mxmla.nn.MLA"
        self.deterministic = check_bool(what, "deterministic", deterministic)
        self.sequence_parallel = check_bool(what, "sequence_parallel", sequence_parallel)
        self.delay_wgrad = check_bool(what, "delay_wgrad", delay_wgrad)
        self.recipe = check_recipe(recipe, what)
        self.fp8_attention = fp8_attention_of(what, self.recipe, fp8_attention)
        self.dtype, params_dtype = resolve_dtypes(what, dtype, params_dtype)
        dims = dict(hidden=hidden, heads=heads, kv_lora_rank=kv_lora_rank, nope_dim=nope_dim, rope_dim=rope_dim,
                    v_dim=v_dim, max_seq_len=max_seq_len)
        for k, v in dims.items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what}: {k} must be a positive int, got {v!r}")
        if not isinstance(q_lora_rank, int) or q_lora_rank < 0:
            raise ValueError(f"{what}: q_lora_rank must be an int >= 0 (0: no q_a projection), got {q_lora_rank!r}")
        if rope_dim % 2:
            raise ValueError(f"{what}: rope_dim must be even (RoPE rotates pairs), got {rope_dim}")
        if layout not in LAYOUTS:
            raise ValueError(f"{what}: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if self.fp8_attention and ((nope_dim + rope_dim) % 32 or v_dim % 32):
            raise ValueError(f"{what}: recipe 'mxfp8' needs nope_dim + rope_dim ({nope_dim + rope_dim}) and v_dim "
                             f"({v_dim}) to be multiples of 32 (the MXFP8 blocks of q, k and v along the head dim; "
                             "fp8_attention=False runs the attention in bf16)")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_rank(tp_group)
        self.cp_group = cp_group
        self.cp_size, self.cp_rank = tp_size_rank(cp_group, "cp_group")
        if self.cp_size > 1 and self.dtype != torch.bfloat16:
            raise ValueError(f"{what}: cp_group (context parallelism) runs mxmla's attention, which takes bf16 or "
                             f"MXFP8 operands: dtype must be torch.bfloat16, got {self.dtype}")
        if self.cp_size > 1 and ((nope_dim + rope_dim) % 32 or v_dim % 32):
            raise ValueError(f"{what}: cp_group (context parallelism) runs mxmla's attention under every recipe: "
                             f"nope_dim + rope_dim ({nope_dim + rope_dim}) and v_dim ({v_dim}) must be multiples of "
                             "32 (on a GPU its kernel's head dims, 128 or 192 and 128)")
        if heads % self.tp_size:
            raise ValueError(f"{what}: heads ({heads}) must be divisible by the tensor-parallel size ({self.tp_size})")
        self.local_heads = heads // self.tp_size
        if cp_comm_type not in ("p2p", "a2a"):
            raise ValueError(f"{what}: cp_comm_type must be 'p2p' or 'a2a', got {cp_comm_type!r}")
        self.cp_comm_type = cp_comm_type
        if cp_comm_type == "a2a" and self.local_heads % self.cp_size:
            raise ValueError(f"{what}: cp_comm_type 'a2a' splits the heads over the context-parallel ranks: "
                             f"{self.local_heads} heads (per tensor-parallel rank) are not divisible by cp = "
                             f"{self.cp_size}")
        self.hidden, self.heads = hidden, heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        self.qk_dim = nope_dim + rope_dim
        self.max_seq_len, self.layout = max_seq_len, layout
        self.yarn = yarn
        self.softmax_scale = float(softmax_scale) if softmax_scale is not None else \
            float(_rope.yarn_softmax_scale(self.qk_dim, yarn))

        g = generator(seed)
        out_std = init_std if out_init_std is None else out_init_std
        lin = dict(recipe=recipe, dtype=self.dtype, params_dtype=params_dtype)
        if q_lora_rank == 0:
            self.wq = Linear(hidden, heads * self.qk_dim, init_std=init_std, seed=child_seed(g), **lin)
        else:
            self.wq_a = Linear(hidden, q_lora_rank, init_std=init_std, seed=child_seed(g), **lin)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps, params_dtype)
            self.wq_b = Linear(q_lora_rank, heads * self.qk_dim, init_std=init_std, seed=child_seed(g), **lin)
        self.wkv_a = Linear(hidden, kv_lora_rank + rope_dim, init_std=init_std, seed=child_seed(g), **lin)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps, params_dtype)
        self.wkv_b = Linear(kv_lora_rank, heads * (nope_dim + v_dim), init_std=init_std, seed=child_seed(g), **lin)
        self.wo = Linear(heads * v_dim, hidden, init_std=out_std, seed=child_seed(g), **lin)

        # tensor parallelism: every rank draws the full weights (the same seed gives the same model at
        # any tp size) and keeps its heads' rows of the column-parallel projections and columns of wo
        if self.tp_size > 1:
            keep_shards(self)

        # RoPE tables for positions 0 .. max_seq_len-1 (fp32, not part of the state dict)
        cos, sin = _rope.rope_tables(torch.arange(max_seq_len), rope_dim, base=rope_base, yarn=yarn, style=ROPE_STYLE)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if device is not None:
            self.to(device)

    @classmethod
    def from_pretrained(cls, path: Any, layer: int, prefix: Optional[str] = None, **kwargs: Any) -> "MLA":
        """Layer `layer`'s attention of a Hugging Face DeepSeek-V2 / V3 checkpoint folder (config.json
        and safetensors; FP8 weights included), with kwargs added to its config's arguments (recipe,
        max_seq_len, tp_group, ...): mxmla.nn.pretrained.from_pretrained."""
        from .pretrained import from_pretrained

        return from_pretrained(cls, path, layer, prefix, **kwargs)

    # ------------------------------------------------------------------ tensor parallelism
    def _sharded(self):
        """(Linear name, features per head, sharded along the input (columns)?) of the sharded weights."""
        q = "wq" if self.q_lora_rank == 0 else "wq_b"
        return [(q, self.qk_dim, False), ("wkv_b", self.nope_dim + self.v_dim, False), ("wo", self.v_dim, True)]

    # ------------------------------------------------------------------ pieces
    def _rope(self, x: torch.Tensor, layout: str, cu: Optional[List[int]],
              tables: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """RoPE with the tables' rows by token position (tables: other rows, e.g. context parallelism's)."""
        cos, sin = tables if tables is not None else (self.rope_cos, self.rope_sin)
        if x.dtype == torch.float64:
            return rope_torch(x, cos, sin, layout, self.rope_dim, cu)
        return _rope.apply_rope(x, cos, sin, style=ROPE_STYLE, layout=layout, rope_dim=self.rope_dim, cu_seqlens=cu)

    def _cp_sequences(self, x: torch.Tensor, layout: str, cu_seqlens: CuSeqlens):
        """Context parallelism: (the whole sequences' cu_seqlens or None, the longest whole sequence, the
        RoPE tables' rows at this rank's token positions: chunks r and 2·cp−1−r of each sequence)."""
        from .cp import cp_positions, whole_cu_seqlens

        what = "mxmla.nn.MLA"
        if layout == "thd":
            from .qproj import refuse_thd_capture

            refuse_thd_capture()
            tokens = self.cp_size * x.shape[0]  # None: one sequence, as without cp
            cu = whole_cu_seqlens(what, cu_seqlens if cu_seqlens is not None else [0, tokens], tokens, self.cp_size)
            longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
            pos = cp_positions(cu, self.cp_group)
        else:
            if cu_seqlens is not None:
                raise ValueError(f"{what}: cu_seqlens is for layout 'thd' (packed sequences), not '{layout}'")
            cu, local = None, x.shape[1] if layout == "bshd" else x.shape[0]
            if local % 2:
                raise ValueError(f"{what}: with cp_group, x's sequence dim ({local}) must be even: this rank's two "
                                 "equal chunks (mxmla.nn.cp_split)")
            longest, pos = local * self.cp_size, cp_positions(local, self.cp_group)
        if longest > self.max_seq_len:
            raise ValueError(f"{what}: with cp_group a whole sequence has {longest} tokens (cp = {self.cp_size}), "
                             f"more than max_seq_len={self.max_seq_len}")
        pos = pos.to(self.rope_cos.device)
        return cu, longest, (self.rope_cos.index_select(0, pos), self.rope_sin.index_select(0, pos))

    def _fused_q(self, lat: torch.Tensor, layout: str, cu: Optional[List[int]] = None):
        """(q8, anchor): the fused Q up-projection of the normalized latent (of x when q_lora_rank is 0)
        with wq_b's (wq's) MXFP8 weight, this rank's heads, RoPE'd and quantized for attention with
        both copies (mxmla.nn.qproj.q_up: BHSD scales; thd: compact, the tables' rows by position)."""
        from .qproj import _QUpProjMXFP8Function, q_up

        weight = (self.wq if self.q_lora_rank == 0 else self.wq_b).weight
        return q_up(_QUpProjMXFP8Function, lat, weight, self.rope_cos, self.rope_sin, self.nope_dim, self.rope_dim,
                    ROPE_STYLE, layout, cu)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[.., h, s, d] -> [.., h, s, v_dim]: causal (top-left), one sequence per leading index."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                   cu: Optional[List[int]]) -> torch.Tensor:
        """The "bf16" recipe's attention (torch SDPA)."""
        if layout == "bshd":  # [b, s, h, d] -> [b, h, s, d]
            return self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        if layout == "sbhd":  # [s, b, h, d] -> [b, h, s, d]
            p = (1, 2, 0, 3)
            return self._sdpa(q.permute(p), k.permute(p), v.permute(p)).permute(2, 0, 1, 3)
        outs = []  # thd: each sequence on its own (its own causal mask, no attention across sequences),
        # as [1, h, s, d]: torch's fused SDPA backends (cuDNN, flash) take 4-D inputs only; 3-D ones
        # fall back to the math backend, which materializes the s x s scores
        for a, b in zip(cu, cu[1:]):
            if b > a:
                qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                outs.append(self._sdpa(qs, ks, vs)[0].transpose(0, 1))
        return torch.cat(outs, dim=0) if outs else q.new_zeros(0, self.local_heads, self.v_dim)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, cu_seqlens: CuSeqlens = None, layout: Optional[str] = None) -> torch.Tensor:
        what = "mxmla.nn.MLA"
        layout = self.layout if layout is None else layout
        if layout not in LAYOUTS:
            raise ValueError(f"{what}: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        want = 2 if layout == "thd" else 3
        if x.dim() != want or x.shape[-1] != self.hidden:
            shape = {"bshd": "[b, s, hidden]", "sbhd": "[s, b, hidden]", "thd": "[t, hidden]"}[layout]
            raise ValueError(f"{what}: x must be {shape} with hidden={self.hidden} for layout '{layout}', "
                             f"got {tuple(x.shape)}")
        g = self.tp_group
        sp = self.sequence_parallel and self.tp_size > 1
        seq_dim = 1 if layout == "bshd" else 0
        if sp:  # this rank's slice of the sequence -> the whole sequence (Megatron's sequence parallelism)
            x = gather_from_sp(x, seq_dim, g)
        cp = self.cp_size > 1
        if cp:  # RoPE by token (the tables' rows at this rank's positions), cu: the whole sequences'
            cu, longest, tables = self._cp_sequences(x, layout, cu_seqlens)
            rope_cu = None
        else:
            cu, longest = sequences(what, x, layout, cu_seqlens, self.max_seq_len)
            tables, rope_cu = None, cu

        # query: low-rank projection, RMSNorm, up-projection; RoPE on the trailing rope_dim of each head
        # (tensor parallel: the latents are replicated, copy_to_tp sums their gradients over the ranks'
        # heads; wq / wq_b and wkv_b hold this rank's heads, wo's partial sums are all-reduced, or with
        # sequence parallelism reduce-scattered into this rank's slice of the sequence)
        # wo's weight gradient after the rest of the block's backward: its anchor is recorded first
        defer = self.wo.deferred_wgrad() if self.delay_wgrad else None
        fused_q = self.fp8_attention and not cp
        # the FP8 recipes: x quantized once for wq_a and wkv_a (one pass, one saved copy for their wgrads)
        xq = self.wkv_a.quantize_input(x) if (self.recipe != "bf16" and self.q_lora_rank
                                              and not torch.compiler.is_compiling()) else None
        if fused_q:  # the fused Q up-projection with an MXFP8 weight: MXFP8 q and its autograd anchor
            q_in = x if self.q_lora_rank == 0 else self.q_norm(self.wq_a(x, x_quantized=xq))
            q8, anchor = self._fused_q(copy_to_tp(q_in, g), layout, cu)
        else:
            if self.q_lora_rank == 0:
                q = self.wq(copy_to_tp(x, g))
            else:
                q = self.wq_b(copy_to_tp(self.q_norm(self.wq_a(x, x_quantized=xq)), g))
            q = self._rope(q.unflatten(-1, (self.local_heads, self.qk_dim)), layout, rope_cu, tables)
        # key / value: the compressed latent (kv) and the shared rope key (one head)
        kv, k_pe = self.wkv_a(x, x_quantized=xq).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = copy_to_tp(self._rope(k_pe.unsqueeze(-2).contiguous(), layout, rope_cu, tables), g)
        lat = copy_to_tp(self.kv_norm(kv), g)
        if fused_q:  # kv_b, K = [k_nope | k_pe] and V in MXFP8 without concatenation passes, then attention
            from .qproj import attention_from_latent
            thd = layout == "thd"  # packed: the longest sequence as the bound (no copy of cu_seqlens to the host)
            o = attention_from_latent(q8, anchor, lat, k_pe, self.wkv_b.weight, self.nope_dim, causal=True,
                                      softmax_scale=self.softmax_scale, deterministic=self.deterministic,
                                      cu_seqlens=cu if thd else None, max_seqlen=(longest or None) if thd else None)
        else:
            kv = self.wkv_b(lat).unflatten(-1, (self.local_heads, self.nope_dim + self.v_dim))
            if self.recipe != "bf16" and not self.fp8_attention:
                # K and V for a bf16 attention without torch.cat in either direction
                k, v = _KVFromProjection.apply(kv, k_pe, self.nope_dim)
            else:
                k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
                k = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], self.rope_dim)], dim=-1)
            if cp:
                from .cp import context_parallel_attention

                o = context_parallel_attention(q, k, v, self.cp_group, causal=True, softmax_scale=self.softmax_scale,
                                               layout=layout, cu_seqlens=cu, fp8=self.fp8_attention,
                                               deterministic=self.deterministic, cp_comm_type=self.cp_comm_type)
            else:
                o = self._attention(q, k, v, layout, cu)
        # the attention saves O (MXFP8 attention: attention_from_latent; bf16 attention under an FP8 recipe:
        # torch's SDPA in one call, not thd's per-sequence calls and their concatenation): wo's wgrad
        # quantizes O from it instead of wo saving an FP8 copy of its own
        o2 = o.flatten(-2)
        keep_o = self.fp8_attention or (self.recipe != "bf16" and layout != "thd")
        y = self.wo(o2, wgrad=defer, save_original_input=True) if keep_o else self.wo(o2, wgrad=defer)
        return reduce_scatter_to_sp(y, seq_dim, g) if sp else reduce_from_tp(y, g)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, heads={self.heads}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, nope_dim={self.nope_dim}, rope_dim={self.rope_dim}, "
                f"v_dim={self.v_dim}, recipe={self.recipe!r}, dtype={self.dtype}, layout={self.layout!r}, "
                f"softmax_scale={self.softmax_scale:.6g}, yarn={self.yarn!r}" +
                (", fp8_attention=False" if self.recipe == "mxfp8" and not self.fp8_attention else "") +
                (", deterministic=True" if self.deterministic else "") +
                ("" if self.delay_wgrad else ", delay_wgrad=False") +
                (f", cp={self.cp_size} ({self.cp_comm_type})" if self.cp_size > 1 else "") +
                (", sequence_parallel=True" if self.sequence_parallel else ""))
