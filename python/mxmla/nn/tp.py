"""Tensor parallelism for mxmla.nn (Megatron's scheme for attention): the communication operators.

- ``copy_to_tp``: identity forward, all-reduce of the gradient backward (Megatron's "f"): placed on a
  replicated activation that feeds column-parallel weights (each rank's gradient covers its heads only).
- ``reduce_from_tp``: all-reduce forward (the partial sums of a row-parallel Linear), identity backward
  (Megatron's "g").
- Sequence parallelism (Megatron's): ``gather_from_sp`` all-gathers this rank's slice of the sequence
  dim forward; backward it keeps this rank's slice of the gradient (``sum_grad=False``: the gradient
  reaching it is the same on every rank, as in MLA, which sums its heads' contributions through
  ``copy_to_tp`` on the replicated latents) or reduce-scatters it (``sum_grad=True``: each rank's
  gradient is a partial sum, as where the gathered input feeds column-parallel weights directly, the
  MLP's); ``reduce_scatter_to_sp`` sums a row-parallel Linear's partial outputs and keeps this
  rank's slice of the sequence dim forward (a reduce-scatter instead of ``reduce_from_tp``'s
  all-reduce), and all-gathers the gradient backward; ``scatter_to_sp`` keeps this rank's slice of a
  replicated tensor forward (the decoder's embedding output) and all-gathers the gradient backward.
- Sharded weights: a module lists them in ``_sharded()`` as (Linear name, features per unit, split
  along the input?); ``keep_shards`` keeps this rank's equal part of each, ``unsharded_state_dict``
  / ``load_unsharded_state_dict`` convert a model's state dict to and from tp 1's (methods of MLA,
  SwiGLU and Decoder through ``UnshardedStateDict``).

Sums run in fp32 (a bf16 tensor is summed as fp32 and rounded back once). ``group=None`` (or a group
of one rank) makes both the identity.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist


def tp_size_rank(group: Any, arg: str = "tp_group") -> Tuple[int, int]:
    """(ranks, this rank) of a process group (the argument `arg`); (1, 0) for None."""
    if group is None:
        return 1, 0
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"mxmla.nn: {arg} given, but torch.distributed is not initialized "
                           "(torch.distributed.init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    y = x.to(torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype).contiguous()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y.to(x.dtype)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The sum over the ranks of x, this rank's slice along dim (fp32 sums as _all_reduce; NCCL's
    reduce-scatter, or gloo, which has none, an all-reduce and the slice)."""
    n, r = tp_size_rank(group)
    y = x.to(torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype)
    if dist.get_backend(group) == "nccl":
        parts = [t.contiguous() for t in y.chunk(n, dim=dim)]
        out = torch.empty_like(parts[r])
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    else:
        out = y.contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        out = out.chunk(n, dim=dim)[r].contiguous()
    return out.to(x.dtype)


def _own_slice(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n, r = tp_size_rank(group)
    return x.chunk(n, dim=dim)[r].contiguous()


class _SequenceParallel(torch.autograd.Function):
    """Forward / backward by mode: "gather" all-gather / this rank's slice; "gather_sum" all-gather /
    reduce-scatter (gather_from_sp); "reduce_scatter" reduce-scatter / all-gather
    (reduce_scatter_to_sp); "scatter" this rank's slice / all-gather (scatter_to_sp)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any, mode: str) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.mode = dim, group, mode
        if mode in ("gather", "gather_sum"):
            return all_gather_cat(x, dim, group)
        return _reduce_scatter(x, dim, group) if mode == "reduce_scatter" else _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.mode == "gather":
            return _own_slice(g, ctx.dim, ctx.group), None, None, None
        if ctx.mode == "gather_sum":
            return _reduce_scatter(g, ctx.dim, ctx.group), None, None, None
        return all_gather_cat(g, ctx.dim, ctx.group), None, None, None


def check_sp_split(what: str, x: torch.Tensor, dim: int, group: Any, name: str = "x") -> None:
    """A clear error where the sequence dim of a tensor that sequence parallelism splits (the whole
    sequence) is not a multiple of the tensor-parallel size."""
    n, _ = tp_size_rank(group)
    if n > 1 and x.shape[dim] % n:
        raise ValueError(f"{what}: with sequence_parallel the sequence dim (dim {dim} of {name}, "
                         f"{x.shape[dim]}) must be a multiple of the tensor-parallel size ({n}): "
                         f"every rank holds an equal slice")


def gather_from_sp(x: torch.Tensor, dim: int, group: Any, sum_grad: bool = False) -> torch.Tensor:
    if tp_size_rank(group)[0] == 1:
        return x
    return _SequenceParallel.apply(x, dim, group, "gather_sum" if sum_grad else "gather")


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    return x if tp_size_rank(group)[0] == 1 else _SequenceParallel.apply(x, dim, group, "reduce_scatter")


def scatter_to_sp(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    return x if tp_size_rank(group)[0] == 1 else _SequenceParallel.apply(x, dim, group, "scatter")


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if tp_size_rank(group)[0] == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if tp_size_rank(group)[0] == 1 else _ReduceFromTP.apply(x, group)


def all_gather_cat(x: torch.Tensor, dim: int, group: Optional[Any]) -> torch.Tensor:
    """The shards of every rank concatenated along dim, in rank order (no gradient)."""
    n, _ = tp_size_rank(group)
    if n == 1:
        return x.detach().clone()
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _shards(model: torch.nn.Module):
    """(state-dict key, split dim, owning module, its Linear's name) of every sharded weight in model
    (modules with ``_sharded()`` at a tp size above 1)."""
    out = []
    for prefix, m in model.named_modules():
        if hasattr(m, "_sharded") and getattr(m, "tp_size", 1) > 1:
            for name, _, col in m._sharded():
                out.append((f"{prefix}.{name}.weight" if prefix else f"{name}.weight", 1 if col else 0, m, name))
    return out


def keep_shards(module: torch.nn.Module) -> None:
    """Replaces each weight that ``module._sharded()`` lists by this rank's equal part of it (rows of
    a column-parallel Linear, columns of a row-parallel one) and sets the Linear's feature count."""
    n, r = module.tp_size, module.tp_rank
    for name, _, col in module._sharded():
        lin = getattr(module, name)
        w = lin.weight.data.chunk(n, dim=1 if col else 0)[r]
        lin.weight = torch.nn.Parameter(w.clone())
        if col:
            lin.in_features = w.shape[1]
        else:
            lin.out_features = w.shape[0]


def unsharded_state_dict(model: torch.nn.Module) -> dict:
    """model's state dict with every sharded weight gathered from the ranks (the same on every rank):
    what a tp size of 1 holds, e.g. to save a checkpoint."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, dim, owner, _ in _shards(model):
        sd[key] = all_gather_cat(sd[key], dim, owner.tp_group)
    return sd


def load_unsharded_state_dict(model: torch.nn.Module, sd: dict) -> None:
    """Loads a tp size of 1's state dict into model, keeping this rank's part of each sharded weight."""
    sd = dict(sd)
    for key, dim, owner, _ in _shards(model):
        sd[key] = sd[key].chunk(owner.tp_size, dim=dim)[owner.tp_rank]
    model.load_state_dict(sd)


class UnshardedStateDict:
    """The two state-dict conversions as methods of a tensor-parallel module (MLA, SwiGLU, Decoder)."""

    def unsharded_state_dict(self) -> dict:
        """The whole module's state dict (every rank's shards gathered; the same on every rank): what a
        tp size of 1 holds, e.g. to save a checkpoint."""
        return unsharded_state_dict(self)

    def load_unsharded_state_dict(self, sd: dict) -> None:
        """Loads a tp size of 1's state dict, keeping this rank's shards."""
        load_unsharded_state_dict(self, sd)


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, group: Any) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a tensor-parallel model: the norm over the whole model (the
    sharded weights' squares summed over the ranks, the replicated ones counted once), the same clip
    coefficient on every rank. Sharded weights are those listed by the modules' ``_sharded()``."""
    n, _ = tp_size_rank(group)
    if n == 1:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    sharded = {id(getattr(owner, name).weight) for _, _, owner, name in _shards(model)}
    params = [p for p in model.parameters() if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    sq_rep = torch.zeros((), dtype=torch.float32, device=dev)
    sq_sh = torch.zeros((), dtype=torch.float32, device=dev)
    for p in params:
        s = p.grad.detach().float().square().sum()
        if id(p) in sharded:
            sq_sh += s
        else:
            sq_rep += s
    dist.all_reduce(sq_sh, op=dist.ReduceOp.SUM, group=group)
    total = (sq_rep + sq_sh).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total
