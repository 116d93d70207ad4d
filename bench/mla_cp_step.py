"""One MLA block's training step (forward + backward) context-parallel over the ranks of a
torch.distributed.run launch, against the same block on one device (cp 1, rank 0 alone, the whole
sequence), same weights, same input and output gradient: each rank steps its two chunks of the
sequence (mxmla.nn.cp_split), the attention passes keys and values around the ring.
GPU: DeepSeek-V3 dims (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, 128 / 64 / 128), b 1,
causal, bshd, NCCL, one GPU a rank; times are medians of CUDA-event-timed steps with L2 flushed and
the ranks lined up by a barrier before each step, the slowest rank's median reported (bench/
mla_tp_step.py's clock). Without a GPU (or with --small): small dims on the CPU with gloo (the CPU
reference kernels), timed by the wall clock; says so.
--a2a: cp_comm_type "a2a" (all-to-all over the heads) instead of the ring.
The communication: the ring's point-to-point exchanges (or the all-to-alls) one step makes (recorded
by wrapping torch.distributed.batch_isend_irecv and all_to_all_single during a step), timed alone with
the same sizes ("alone"), and,
on GPUs, the NCCL kernels' time inside a profiled step ("in step": includes waiting for the other
ranks); each with its share of the cp step's time. Also printed: the cp step's output (gathered)
against the one-device block's (relative RMS).
Usage: python -m torch.distributed.run --nproc-per-node N bench/mla_cp_step.py [T ...]
       [--recipe bf16,mxfp8] [--small] [--a2a]   (default T 16384; --small: T 128)"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_tp_step import Launch  # noqa: E402

import mxmla.nn as mnn  # noqa: E402
from mxmla.nn.cp import cp_gather, cp_size_rank, cp_split  # noqa: E402


def record_exchanges(step):
    """[(kind, [(numel, dtype) of each tensor sent])] of every ring exchange ("p2p") and all-to-all
    ("a2a": its input) one step makes."""
    calls, p2p, a2a = [], dist.batch_isend_irecv, dist.all_to_all_single

    def wrapped_p2p(ops):
        calls.append(("p2p", [(op.tensor.numel(), op.tensor.dtype) for op in ops if op.op is dist.isend]))
        return p2p(ops)

    def wrapped_a2a(out, inp, *a, **k):
        calls.append(("a2a", [(inp.numel(), inp.dtype)]))
        return a2a(out, inp, *a, **k)

    dist.batch_isend_irecv, dist.all_to_all_single = wrapped_p2p, wrapped_a2a
    try:
        step()
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
    return calls


def replay(calls, group, device):
    """A function making the recorded exchanges again (send to the next rank, receive from the previous
    one) on buffers of the same sizes and dtypes, each exchange waited for before the next."""
    size, rank = cp_size_rank(group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(rank + 1) % size], ranks[(rank - 1) % size]
    bufs = [(kind, [(torch.zeros(n, dtype=dt, device=device), torch.empty(n, dtype=dt, device=device))
                    for n, dt in c]) for kind, c in calls]

    def run():
        for kind, pairs in bufs:
            if kind == "a2a":
                dist.all_to_all_single(pairs[0][1], pairs[0][0], group=group)
                continue
            ops = [dist.P2POp(dist.isend, s, nxt, group) for s, _ in pairs]
            ops += [dist.P2POp(dist.irecv, r, prv, group) for _, r in pairs]
            for q in dist.batch_isend_irecv(ops):
                q.wait()
    return run


def main():
    run = Launch("mla_cp_step.py", __doc__, "context parallelism", 16384, 128,
                 [("--a2a", "cp_comm_type a2a (all-to-all over the heads) instead of the ring")])
    args, device, group, world = run.args, run.device, run.group, run.world
    comm = "a2a" if args.a2a else "p2p"
    run.header(f"context parallel over {world} ranks ({comm})", "cp")
    for T in run.seqs:
        if T % (2 * world):
            raise SystemExit(f"mla_cp_step.py: T ({T}) must be a multiple of 2 x the ranks ({2 * world})")
        for recipe in args.recipe.split(","):
            calls = run.row(T, recipe, lambda kw: mnn.MLA(**kw, cp_group=group, cp_comm_type=comm),
                            lambda t: cp_split(t, 1, group),
                            record_exchanges, lambda c: replay(c, group, device),
                            out_of=lambda m, xs: cp_gather(m(xs).float(), 1, group))
            if calls is not None:
                sent = sum(n * torch.tensor([], dtype=dt).element_size() for _, c in calls for n, dt in c)
                what = "all-to-alls" if comm == "a2a" else "ring exchanges"
                print(f"{'':6s} {'':7s} {what} in a cp step: {len(calls)}, {sent / 2 ** 20:.2f} MiB sent by a rank")
    run.finish()


if __name__ == "__main__":
    main()
