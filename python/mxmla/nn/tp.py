"""Tensor parallelism for mxmla.nn (Megatron's scheme for attention): the communication operators.

- ``copy_to_tp``: identity forward, all-reduce of the gradient backward (Megatron's "f"): placed on a
  replicated activation that feeds column-parallel weights (each rank's gradient covers its heads only).
- ``reduce_from_tp``: all-reduce forward (the partial sums of a row-parallel Linear), identity backward
  (Megatron's "g").
- Sequence parallelism (Megatron's): ``gather_from_sp`` all-gathers this rank's slice of the sequence
  dim forward and keeps this rank's slice of the gradient backward (the gradient reaching it is the
  same on every rank: the block sums its heads' contributions through ``copy_to_tp`` on the replicated
  latents); ``reduce_scatter_to_sp`` sums a row-parallel Linear's partial outputs and keeps this
  rank's slice of the sequence dim forward (a reduce-scatter instead of ``reduce_from_tp``'s
  all-reduce), and all-gathers the gradient backward.

Sums run in fp32 (a bf16 tensor is summed as fp32 and rounded back once). ``group=None`` (or a group
of one rank) makes both the identity.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist


def tp_size_rank(group: Any) -> Tuple[int, int]:
    """(ranks, this rank) of a process group; (1, 0) for None."""
    if group is None:
        return 1, 0
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("mxmla.nn: tp_group given, but torch.distributed is not initialized "
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


class _SequenceParallel(torch.autograd.Function):
    """gather: all-gather forward, this rank's slice of the gradient backward (gather_from_sp); else
    reduce-scatter forward, all-gather of the gradient backward (reduce_scatter_to_sp)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: Any, gather: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.gather = dim, group, gather
        return all_gather_cat(x, dim, group) if gather else _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.gather:
            n, r = tp_size_rank(ctx.group)
            return g.chunk(n, dim=ctx.dim)[r].contiguous(), None, None, None
        return all_gather_cat(g, ctx.dim, ctx.group), None, None, None


def gather_from_sp(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    return x if tp_size_rank(group)[0] == 1 else _SequenceParallel.apply(x, dim, group, True)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    return x if tp_size_rank(group)[0] == 1 else _SequenceParallel.apply(x, dim, group, False)


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


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, group: Any) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a tensor-parallel model: the norm over the whole model (the
    sharded weights' squares summed over the ranks, the replicated ones counted once), the same clip
    coefficient on every rank. Sharded weights are those listed by the modules' ``_sharded()``."""
    n, _ = tp_size_rank(group)
    if n == 1:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    sharded = set()
    for m in model.modules():
        if hasattr(m, "_sharded") and getattr(m, "tp_size", 1) > 1:
            sharded |= {id(getattr(m, name).weight) for name, _, _ in m._sharded()}
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
