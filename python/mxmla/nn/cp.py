"""Context parallelism: attention over a sequence split across the ranks of a process group
(TransformerEngine's ``cp_comm_type="p2p"``, Megatron-Core's ``context_parallel_size``).

The split (Megatron's load balancing for causal attention): the sequence dim is cut into 2·cp equal
chunks and rank r holds chunks r and 2·cp−1−r, in that order (``cp_split`` makes this rank's part,
``cp_gather`` puts the parts back; ``mxmla.positions_context_parallel`` / ``cp_positions`` give the
RoPE positions of a rank's tokens). Every rank then does the same causal work. Packed sequences
(thd, cu_seqlens of the whole sequences, each a multiple of 2·cp long) are split the same way, each
sequence on its own.

``context_parallel_attention(q, k, v, cp_group)``: the keys and values travel around a ring of the
ranks (rank r sends to r+1 and receives from r−1) while each rank runs attention of its queries
against the block it holds; the partial outputs are merged in fp32 through their log-sum-exps. With
its two chunks written [q₀ | q₁] and the block of rank s as [k₀ | k₁], step i (s = r − i mod cp)
computes, causal:

    i = 0:            q₀·k₀ causal, q₁·k₀ full, q₁·k₁ causal   (the rank's own diagonal)
    s < r (i <= r):   q₀·k₀ full, q₁·k₀ full                    (k₁ lies after both query chunks)
    s > r (i > r):    q₁·k₀ full, q₁·k₁ full                    (q₀ lies before both key chunks)

and without a mask all four pairs. The backward runs the same ring: each pair's gradients come from
``attention_backward`` with the merged O and LSE (so P and D are the whole sequence's), dQ is summed
here in fp32, and dK, dV are summed in fp32 accumulators that travel around the ring with the block
and reach their owner after the last step.

MXFP8: each chunk of q, k and v is quantized on its own (with both copies, in one pass). When the
chunk length is a multiple of 32 its blocks are exactly the blocks of the unsplit sequence, so the
dequantized inputs are those of attention without context parallelism. Only FP8 codes and E8M0
scales travel in the forward's ring (K rowwise, V columnwise: half the bytes of bf16), the copies the
backward's GEMMs read in its ring. bf16 inputs (``fp8=False``) run the same ring on mxmla's attention
with bf16 operands.

Against attention on the whole sequence, O differs by its partial outputs' bf16 roundings (each
pair's O is rounded to bf16 before the fp32 merge, as in TransformerEngine's): at most a few units
of bf16 rounding of O's magnitude; the gradients likewise by each pair's bf16 rounding before the fp32
sums.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..attention import attention
from ..attention_autograd import quantize_for_attention
from ..attention_backward import attention_backward
from ..mxfp8 import MXFP8Tensor
from .tp import tp_size_rank

_OP = "mxmla.nn.context_parallel_attention"
_TAG_KV, _TAG_DKV = 11, 12


def cp_size_rank(group: Any) -> Tuple[int, int]:
    """(ranks, this rank) of a context-parallel group; (1, 0) for None."""
    return tp_size_rank(group, "cp_group")


def _seq_dim(what: str, layout: str) -> int:
    if layout == "bshd":
        return 1
    if layout == "sbhd":
        return 0
    raise ValueError(f"{what}: argument 'layout': context parallelism takes 'bshd' or 'sbhd' (the sequence dim is "
                     f"split into 2·cp chunks), got {layout!r}")


def _thd_chunks(cu: List[int], size: int) -> List[List[Tuple[int, int]]]:
    """Per rank, its (start, stop) token ranges of the whole packed sequences: chunks r and 2·cp−1−r of each."""
    out: List[List[Tuple[int, int]]] = [[] for _ in range(size)]
    for a, b in zip(cu, cu[1:]):
        n = (b - a) // (2 * size)
        for r in range(size):
            out[r] += [(a + r * n, a + (r + 1) * n), (a + (2 * size - 1 - r) * n, a + (2 * size - r) * n)]
    return out


def _split_ranges(what: str, n: int, dim: int, size: int, cu_seqlens: Any) -> List[List[Tuple[int, int]]]:
    """Per rank, its token ranges of the whole sequences (n tokens along dim): chunks r and 2·cp−1−r of
    2·cp equal chunks (n divisible by 2·cp), or of each packed sequence of cu_seqlens."""
    if cu_seqlens is not None:
        return _thd_chunks(whole_cu_seqlens(what, cu_seqlens, n, size), size)
    if n % (2 * size):
        raise ValueError(f"{what}: the sequence dim (dim {dim}, {n}) must be divisible by 2·cp ({2 * size}): each "
                         "rank holds two equal chunks")
    return _ranges("bshd", n // size, size, None)


def _take(x: torch.Tensor, ranges: Sequence[Tuple[int, int]], dim: int) -> torch.Tensor:
    """x's token ranges along dim, concatenated in order."""
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim)


def _assemble(parts: Sequence[torch.Tensor], ranges: List[List[Tuple[int, int]]], dim: int) -> torch.Tensor:
    """The whole sequences from each rank's part (parts[r] holds ranges[r] in order): the inverse of _take."""
    pieces = []
    for part, rs in zip(parts, ranges):
        at = 0
        for a, b in rs:
            pieces.append((a, part.narrow(dim, at, b - a)))
            at += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim)


def cp_split(x: torch.Tensor, dim: int, group: Any, cu_seqlens: Any = None) -> torch.Tensor:
    """This rank's part of x along dim (the whole sequences): chunks r and 2·cp−1−r of 2·cp equal
    chunks, concatenated; x.shape[dim] divisible by 2·cp. With cu_seqlens (packed sequences, thd: the
    whole sequences' offsets along dim, each length a multiple of 2·cp) the same for every sequence,
    packed in order."""
    size, rank = cp_size_rank(group)
    if size == 1 and cu_seqlens is None:
        return x
    return _take(x, _split_ranges("mxmla.nn.cp_split", x.shape[dim], dim, size, cu_seqlens)[rank], dim)


def cp_gather(x: torch.Tensor, dim: int, group: Any, cu_seqlens: Any = None) -> torch.Tensor:
    """The whole sequences from every rank's part (the inverse of cp_split, with the same cu_seqlens;
    not differentiable)."""
    size, _ = cp_size_rank(group)
    if size == 1 and cu_seqlens is None:
        return x
    parts = [x.contiguous()]
    if size > 1:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
    return _assemble(parts, _split_ranges("mxmla.nn.cp_gather", size * x.shape[dim], dim, size, cu_seqlens), dim)


class _Ring:
    """Point-to-point exchange with the ring's neighbours: send to rank r+1, receive from r−1 (NCCL: on
    its own streams, overlapping the attention calls; gloo, which sends host memory only: CUDA tensors
    staged through host copies)."""

    def __init__(self, group: Any):
        size, rank = cp_size_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.group, self.next, self.prev = group, ranks[(rank + 1) % size], ranks[(rank - 1) % size]
        self.host = dist.get_backend(group) == "gloo"

    def start(self, send: Sequence[torch.Tensor], tag: int) -> Tuple[list, List[torch.Tensor], List[Any]]:
        devices = [t.device for t in send]
        if self.host:
            send = [t.cpu() for t in send]
        recv = [torch.empty_like(t) for t in send]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recv]
        return dist.batch_isend_irecv(ops), recv, devices

    @staticmethod
    def wait(pending: Tuple[list, List[torch.Tensor], List[Any]]) -> List[torch.Tensor]:
        reqs, recv, devices = pending
        for q in reqs:
            q.wait()
        return [t.to(d) for t, d in zip(recv, devices)]


_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _keep(t: Any, rowwise: bool, columnwise: bool) -> Any:
    """An MXFP8 tensor with only the copies asked for (a bf16 tensor as it is)."""
    if not isinstance(t, MXFP8Tensor):
        return t
    return MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, t.rowwise_data if rowwise else None,
                       t.rowwise_scale_inv if rowwise else None, t.columnwise_data if columnwise else None,
                       t.columnwise_scale_inv if columnwise else None, layout=t.layout, attention=t.attention)


def _buffers(ts: Sequence[Any]) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for t in ts:
        out += [getattr(t, f) for f in _FIELDS if getattr(t, f) is not None] if isinstance(t, MXFP8Tensor) else [t]
    return out


def _template(t: Any) -> Any:
    """t's description without its memory (empty buffers where t has buffers): what _rebuild needs."""
    if isinstance(t, MXFP8Tensor):
        return MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout,
                           *[None if getattr(t, f) is None else torch.empty(0) for f in _FIELDS],
                           layout=t.layout, attention=t.attention)
    return torch.empty(0)


def _rebuild(like: Sequence[Any], bufs: Sequence[torch.Tensor]) -> List[Any]:
    """Tensors shaped as `like` from the received buffers (the order of _buffers)."""
    it, out = iter(bufs), []
    for t in like:
        if isinstance(t, MXFP8Tensor):
            parts = [next(it) if getattr(t, f) is not None else None for f in _FIELDS]
            out.append(MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, *parts, layout=t.layout,
                                   attention=t.attention))
        else:
            out.append(next(it))
    return out


def _pairs(step: int, rank: int, size: int, causal: bool) -> List[Tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) of the attention calls at ring step `step` (module docstring)."""
    if not causal:
        return [(0, 0, False), (0, 1, False), (1, 0, False), (1, 1, False)]
    if step == 0:
        return [(0, 0, True), (1, 0, False), (1, 1, True)]
    if step <= rank:
        return [(0, 0, False), (1, 0, False)]
    return [(1, 0, False), (1, 1, False)]


class _Chunks:
    """A rank's local tensor as its two chunks and back. sbhd / bshd: the halves of the sequence dim.
    thd: chunk i packs the i-th half of every sequence's local part (sequence j: cu[j+1]−cu[j] tokens
    of the whole, cu the whole sequences' cu_seqlens, each length a multiple of 2·cp; locally
    (cu[j+1]−cu[j])/cp tokens from cu[j]/cp), with cu_seqlens cu/(2·cp) for both chunks."""

    def __init__(self, layout: str, local: int, cp: int, cu: Optional[List[int]], device: Any):
        self.layout = layout
        if layout == "thd":
            assert cu is not None
            half = [(b - a) // (2 * cp) for a, b in zip(cu, cu[1:])]
            starts = [a // cp for a in cu[:-1]]
            self.idx = [torch.cat([torch.arange(st + c * n, st + (c + 1) * n, dtype=torch.long)
                                   for st, n in zip(starts, half)] or [torch.zeros(0, dtype=torch.long)]).to(device)
                        for c in range(2)]
            self.cu = [0]
            for n in half:
                self.cu.append(self.cu[-1] + n)
            cu_t = torch.tensor(self.cu, dtype=torch.int32, device=device)  # one copy for every call; with the
            # bounds, no call copies it back to the host
            self.kw = dict(cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=max(half, default=0),
                           max_seqlen_kv=max(half, default=0))
            self.dim = 0
        else:
            self.dim = _seq_dim(_OP, layout)
            self.c, self.kw = local // 2, {}

    def take(self, x: torch.Tensor, i: int, contiguous: bool = True) -> torch.Tensor:
        """Chunk i of x along its token dim: contiguous, or (contiguous=False, sbhd / bshd) a view."""
        if self.layout == "thd":
            return x.index_select(self.dim, self.idx[i])
        c = x.narrow(self.dim, i * self.c, self.c)
        return c.contiguous() if contiguous else c

    def put(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The local tensor from its two chunks."""
        if self.layout != "thd":
            return torch.cat(list(parts), self.dim)
        shape = list(parts[0].shape)
        shape[0] = parts[0].shape[0] + parts[1].shape[0]
        out = parts[0].new_empty(shape)
        for i in range(2):
            out.index_copy_(0, self.idx[i], parts[i])
        return out

    def rows(self, w: torch.Tensor) -> torch.Tensor:
        """Per-row factors in LSE's layout ([b, h, s]; thd [h, t]) broadcast to O's ([.., h, 1])."""
        if self.layout == "thd":
            return w.transpose(0, 1).unsqueeze(-1)
        return (w.transpose(1, 2) if self.dim == 1 else w.permute(2, 0, 1)).unsqueeze(-1)


def _merge(ch: _Chunks, acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """acc ← the softmax-weighted union of acc and (o, lse), in place, fp32: LSE = log(e^a + e^b),
    O = O_a·e^(a−LSE) + O_b·e^(b−LSE). Rows that neither saw (both −inf) stay O = 0, LSE = −inf; a NaN
    stays NaN."""
    new = torch.logaddexp(acc_lse, lse)
    gone = torch.isneginf(new)
    w_old = torch.where(gone, 0.0, torch.exp(acc_lse - new))
    w_new = torch.where(gone, 0.0, torch.exp(lse - new))
    acc_o.mul_(ch.rows(w_old)).add_(o.float() * ch.rows(w_new))
    acc_lse.copy_(new)


class ContextParallelAttention(torch.autograd.Function):
    """O = attention of this rank's queries against the whole sequence's keys (module docstring).

    ``ContextParallelAttention.apply(q, k, v, cp_group, causal, softmax_scale, layout, fp8, fp8_format,
    deterministic, cu_seqlens)`` → O (bf16)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                softmax_scale: Optional[float], layout: str, fp8: bool, fp8_format: str,
                deterministic: bool, cu: Optional[List[int]] = None) -> torch.Tensor:
        size, rank = cp_size_rank(group)
        ch = _Chunks(layout, q.shape[0 if layout == "thd" else _seq_dim(_OP, layout)], size, cu, q.device)

        def chunks(x: torch.Tensor) -> List[Any]:
            # MXFP8: quantize_attention reads a chunk's view in place (no copy first); bf16: contiguous
            # chunks, which the ring sends as they are
            cs = [ch.take(x.detach(), i, contiguous=not fp8) for i in range(2)]
            return [quantize_for_attention(c, layout, fp8_format) if fp8 else c for c in cs]

        qs, ks, vs = chunks(q), chunks(k), chunks(v)
        # the forward's ring carries K rowwise and V columnwise (what its GEMMs read)
        kv = [_keep(t, True, False) for t in ks] + [_keep(t, False, True) for t in vs]
        # the merged O (fp32) and LSE of each query chunk: its first pair's, as they come (step 0 has a pair
        # for each chunk; merging into O = 0, LSE = −inf would give the same bits)
        acc_o: List[Any] = [None, None]
        acc_lse: List[Any] = [None, None]
        ring = _Ring(group) if size > 1 else None
        for step in range(size):
            pending = ring.start(_buffers(kv), _TAG_KV) if ring is not None and step + 1 < size else None
            for qa, kb, blk_causal in _pairs(step, rank, size, causal):
                o_b, lse_b = attention(qs[qa], kv[kb], kv[2 + kb], causal=blk_causal, softmax_scale=softmax_scale,
                                       layout=layout, return_lse=True, **ch.kw)
                if acc_o[qa] is None:
                    acc_o[qa], acc_lse[qa] = o_b.float(), lse_b
                else:
                    _merge(ch, acc_o[qa], acc_lse[qa], o_b, lse_b)
            if pending is not None:
                kv = _rebuild(kv, _Ring.wait(pending))
        o = ch.put([a.to(torch.bfloat16) for a in acc_o])
        # saved: q's and k's chunks with both copies, v's rowwise (the backward's dP = dO·Vᵀ), O, LSE's chunks
        saved = qs + ks + [_keep(t, True, False) for t in vs]
        ctx.like = [_template(t) for t in saved]
        ctx.save_for_backward(*_buffers(saved), o, *acc_lse)
        ctx.cfg = (group, causal, softmax_scale, layout, deterministic, ch)
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        group, causal, softmax_scale, layout, deterministic, ch = ctx.cfg
        size, rank = cp_size_rank(group)
        *bufs, o, lse0, lse1 = ctx.saved_tensors
        saved = _rebuild(ctx.like, bufs)
        qs, kv = saved[:2], saved[2:]
        do = do.to(torch.bfloat16)
        dos, os_, lses = [ch.take(do, i) for i in range(2)], [ch.take(o, i) for i in range(2)], [lse0, lse1]
        dq = [torch.zeros(_shape(t), dtype=torch.float32, device=do.device) for t in qs]
        # dK, dV of the block held: fp32 sums that travel with it (k₀, k₁, v₀, v₁)
        dkv = [torch.zeros(_shape(t), dtype=torch.float32, device=do.device) for t in kv]
        ring = _Ring(group) if size > 1 else None
        pending_dkv = None
        for step in range(size):
            pending = ring.start(_buffers(kv), _TAG_KV) if ring is not None and step + 1 < size else None
            grads = [(qa, kb, attention_backward(dos[qa], qs[qa], kv[kb], kv[2 + kb], os_[qa], lses[qa],
                                                 causal=blk_causal, softmax_scale=softmax_scale, layout=layout,
                                                 deterministic=deterministic, **ch.kw))
                     for qa, kb, blk_causal in _pairs(step, rank, size, causal)]
            if pending_dkv is not None:  # the sums arrive while this step's pairs ran
                dkv = _Ring.wait(pending_dkv)
            for qa, kb, (g_q, g_k, g_v) in grads:
                dq[qa].add_(g_q.float())
                dkv[kb].add_(g_k.float())
                dkv[2 + kb].add_(g_v.float())
            if ring is not None:  # the sums go on with the block; after the last step they reach its owner
                pending_dkv = ring.start(dkv, _TAG_DKV)
            if pending is not None:
                kv = _rebuild(kv, _Ring.wait(pending))
        if pending_dkv is not None:
            dkv = _Ring.wait(pending_dkv)
        grads = [ch.put([a.to(torch.bfloat16), b.to(torch.bfloat16)]) for a, b in (dq, dkv[:2], dkv[2:])]
        return tuple(grads) + (None,) * 8


def _shape(t: Any) -> Tuple[int, ...]:
    """A chunk's shape in its format (an MXFP8 tensor's codes, either copy)."""
    if isinstance(t, MXFP8Tensor):
        return tuple(int(s) for s in (t.rowwise_data if t.rowwise_data is not None else t.columnwise_data).shape)
    return tuple(t.shape)


def _last(t: Any) -> int:
    return _shape(t)[-1]


# ----------------------------------------------------------------------------- all-to-all ("a2a")
def _ranges(layout: str, local: int, size: int, cu: Optional[List[int]]) -> List[List[Tuple[int, int]]]:
    """Per rank, its (start, stop) token ranges of the whole sequences, in the order it holds them."""
    if layout == "thd":
        assert cu is not None
        return _thd_chunks(cu, size)
    c = local // 2
    return [[(r * c, (r + 1) * c), ((2 * size - 1 - r) * c, (2 * size - r) * c)] for r in range(size)]


def _all_to_all(parts: Sequence[torch.Tensor], group: Any) -> List[torch.Tensor]:
    """parts[i] (all of one shape) goes to rank i; returns what rank i sent this one at [i] (gloo, which
    sends host memory only: CUDA tensors staged through host copies)."""
    device, shape = parts[0].device, parts[0].shape
    flat = torch.cat([p.reshape(-1) for p in parts])
    if dist.get_backend(group) == "gloo":
        flat = flat.cpu()
    out = torch.empty_like(flat)
    dist.all_to_all_single(out, flat, group=group)
    return [o.view(shape) for o in out.to(device).chunk(len(parts))]


def _seq_to_heads(x: torch.Tensor, dim: int, group: Any, ranges: List[List[Tuple[int, int]]]) -> torch.Tensor:
    """This rank's tokens of every head [.., s_local, h, d] → the whole sequences of its head group
    [.., S, h/cp, d] (group i of h/cp heads to rank i; the ranks' token ranges put back in order)."""
    return _assemble(_all_to_all([p.contiguous() for p in x.chunk(len(ranges), dim=-2)], group), ranges, dim)


def _heads_to_seq(y: torch.Tensor, dim: int, group: Any, ranges: List[List[Tuple[int, int]]]) -> torch.Tensor:
    """The inverse of _seq_to_heads: the whole sequences of this rank's head group → its tokens of every head."""
    return torch.cat(_all_to_all([_take(y, rs, dim) for rs in ranges], group), dim=-2)


class _Reshard(torch.autograd.Function):
    """_seq_to_heads (to_heads) or _heads_to_seq, the other one its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, ranges: Any, to_heads: bool) -> torch.Tensor:
        ctx.cfg = (dim, group, ranges, to_heads)
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, dim, group, ranges)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        dim, group, ranges, to_heads = ctx.cfg
        back = _heads_to_seq if to_heads else _seq_to_heads
        return back(g.contiguous(), dim, group, ranges), None, None, None, None


class _BF16Attention(torch.autograd.Function):
    """mxmla's attention on bf16 q, k, v with its gradient (saved: q, k, v, O, LSE)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict,
                deterministic: bool) -> torch.Tensor:
        q, k, v = (t.detach().contiguous() for t in (q, k, v))
        o, lse = attention(q, k, v, return_lse=True, **kw)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cfg = (kw, deterministic)
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, o, lse = ctx.saved_tensors
        kw, deterministic = ctx.cfg
        return attention_backward(do.to(torch.bfloat16).contiguous(), q, k, v, o, lse, deterministic=deterministic,
                                  **kw) + (None, None)


def _a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, causal: bool,
                   softmax_scale: Optional[float], layout: str, fp8: bool, fp8_format: str, deterministic: bool,
                   cu: Optional[List[int]]) -> torch.Tensor:
    """cp_comm_type "a2a" (DeepSpeed-Ulysses, TransformerEngine's "a2a"): all-to-all q, k, v from this
    rank's tokens of every head to the whole sequences of h/cp heads, attention there (the unsplit
    op: per head the same bits as without context parallelism), all-to-all O back."""
    from ..attention_autograd import MXFP8Attention

    size, _ = cp_size_rank(group)
    dim = 0 if layout == "thd" else _seq_dim(_OP, layout)
    ranges = _ranges(layout, q.shape[dim], size, cu)
    qw, kw_, vw = (_Reshard.apply(t, dim, group, ranges, True) for t in (q, k, v))
    # thd: the whole sequences' cu_seqlens, the longest as the bound (no copy of cu_seqlens to the host)
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0) if cu is not None else None
    if fp8:
        o = MXFP8Attention.apply(qw, kw_, vw, causal, softmax_scale, layout, cu, cu, longest, longest, fp8_format,
                                 False, deterministic)
    else:
        kw = dict(causal=causal, softmax_scale=softmax_scale, layout=layout, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                  max_seqlen_q=longest, max_seqlen_kv=longest)
        o = _BF16Attention.apply(qw, kw_, vw, kw, deterministic)
    return _Reshard.apply(o, dim, group, ranges, False)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Any, *,
                               causal: bool = True, softmax_scale: Optional[float] = None, layout: str = "bshd",
                               cu_seqlens: Any = None, fp8: bool = True, fp8_format: str = "e4m3",
                               deterministic: bool = False, cp_comm_type: str = "p2p") -> torch.Tensor:
    """Attention with autograd over sequences split across cp_group's ranks (module docstring).

    q [b, s, h, d_qk], k [b, s, h_kv, d_qk], v [b, s, h_kv, d_v] (bshd; sbhd: [s, b, ...]; thd: [t, h, d]),
    bf16: this rank's part of the sequences as ``cp_split`` makes it (chunks r and 2·cp−1−r of each),
    for q, k and v alike: bshd / sbhd the same local length s (even) on every rank; thd the packed
    parts of the sequences of ``cu_seqlens`` (the whole sequences' offsets, a host list or an int
    tensor, each length a multiple of 2·cp; this rank holds cu_seqlens[-1] / cp tokens). causal:
    top-left within each whole sequence. softmax_scale: None is d_qk^-0.5. fp8: quantize each chunk
    to MXFP8 (both copies) and run the MXFP8 attention (default), or run the bf16 attention on the
    chunks as they are. deterministic: the attention backward's fixed order (the ring's sums have one
    order anyway). cp_group None (or one rank) is attention on the local sequences, through the same
    chunked path. cp_comm_type: "p2p" (the ring, module docstring) or "a2a" (DeepSpeed-Ulysses, as
    TransformerEngine's "a2a": q, k, v all-to-all'd from this rank's tokens of every head to the whole
    sequences of h/cp heads (h and h_kv divisible by cp), the attention of the whole sequences there —
    per head the same bits as without context parallelism — and O all-to-all'd back; the gradients
    take the same way back; no merge, four all-to-alls a step).

    Returns O (bf16, q's layout and shape with d_v columns): this rank's rows of the whole sequences'
    attention output."""
    if layout not in ("bshd", "sbhd", "thd"):
        raise ValueError(f"{_OP}: argument 'layout': context parallelism takes 'bshd', 'sbhd' or 'thd', got "
                         f"{layout!r}")
    ndim = 3 if layout == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != ndim:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{_OP}: argument '{name}': must be a {ndim}-D torch.bfloat16 tensor ({layout}), "
                            f"got {got}")
    if cp_group is not None and (not dist.is_available() or not dist.is_initialized()):
        raise RuntimeError(f"{_OP}: cp_group given, but torch.distributed is not initialized")
    size, _ = cp_size_rank(cp_group)
    dim = 0 if layout == "thd" else _seq_dim(_OP, layout)
    s = q.shape[dim]
    cu = None
    if layout == "thd":
        cu = whole_cu_seqlens(_OP, cu_seqlens, size * s, size)
    elif cu_seqlens is not None:
        raise ValueError(f"{_OP}: argument 'cu_seqlens': is for layout 'thd' (packed sequences), not '{layout}'")
    elif s % 2 or s == 0:
        raise ValueError(f"{_OP}: argument 'q': this rank's sequence length ({s}, dim {dim}) must be even and "
                         "positive (two equal chunks: cp_split)")
    for name, t in (("k", k), ("v", v)):
        if t.shape[dim] != s:
            raise ValueError(f"{_OP}: argument '{name}': {t.shape[dim]} tokens (dim {dim}) differ from q's {s} "
                             "(context parallelism splits the same sequences for q, k and v)")
    if not isinstance(fp8, bool):
        raise TypeError(f"{_OP}: argument 'fp8': must be a bool, got {type(fp8).__name__}")
    if cp_comm_type not in ("p2p", "a2a"):
        raise ValueError(f"{_OP}: argument 'cp_comm_type': must be 'p2p' or 'a2a', got {cp_comm_type!r}")
    if cp_comm_type == "a2a":
        for name, t in (("q", q), ("k", k)):
            if t.shape[-2] % size:
                raise ValueError(f"{_OP}: argument '{name}': cp_comm_type 'a2a' splits the heads over the ranks: "
                                 f"{t.shape[-2]} heads are not divisible by cp = {size}")
        if size > 1:
            return _a2a_attention(q, k, v, cp_group, bool(causal), softmax_scale, layout, fp8, fp8_format,
                                  bool(deterministic), cu)
    return ContextParallelAttention.apply(q, k, v, cp_group, bool(causal), softmax_scale, layout, fp8, fp8_format,
                                          bool(deterministic), cu)


def whole_cu_seqlens(what: str, cu_seqlens: Any, tokens: int, cp: int) -> List[int]:
    """The whole sequences' cu_seqlens as a host list, checked: it ends at `tokens` (the whole packed
    sequences' count: cp x a rank's), each length a multiple of 2·cp (the split)."""
    if cu_seqlens is None:
        raise ValueError(f"{what}: argument 'cu_seqlens': layout 'thd' needs the whole sequences' cu_seqlens")
    from .mla import cu_seqlens_list

    cu = cu_seqlens_list(what, cu_seqlens, tokens)
    bad = [b - a for a, b in zip(cu, cu[1:]) if (b - a) % (2 * cp)]
    if bad:
        raise ValueError(f"{what}: argument 'cu_seqlens': every sequence's length must be a multiple of 2·cp "
                         f"({2 * cp}): each rank holds two equal chunks of it; got lengths {bad}")
    return cu


def cp_positions(local: Any, group: Any) -> torch.Tensor:
    """RoPE positions (int64, CPU) of this rank's tokens: local = its sequence length (bshd / sbhd:
    mxmla.positions_context_parallel), or the whole sequences' cu_seqlens as a host list (thd: each
    token's position inside its own sequence)."""
    from ..rope import positions_context_parallel

    size, rank = cp_size_rank(group)
    if isinstance(local, int):
        return torch.as_tensor(positions_context_parallel(local, size, rank), dtype=torch.long)
    out = []
    for a, b in zip(local, local[1:]):
        n = (b - a) // (2 * size)
        out += [range(rank * n, (rank + 1) * n), range((2 * size - 1 - rank) * n, (2 * size - rank) * n)]
    return torch.tensor([p for r in out for p in r], dtype=torch.long)


__all__: Sequence[str] = ["context_parallel_attention", "ContextParallelAttention", "cp_split", "cp_gather",
                          "cp_size_rank", "cp_positions", "whole_cu_seqlens"]
