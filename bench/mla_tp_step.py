"""One MLA block's training step (forward + backward) tensor-parallel over the ranks of a
torch.distributed.run launch, against the same block on one device (tp 1, rank 0 alone), same
weights (the same seed gives the same model at any tp size), same input and output gradient.
GPU: DeepSeek-V3 dims (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, 128 / 64 / 128), b 1,
causal, bshd, NCCL, one GPU a rank; times are medians of CUDA-event-timed steps with L2 flushed
and the ranks lined up by a barrier before each step, the slowest rank's median reported.
Without a GPU (or with --small): small dims on the CPU with gloo (the CPU reference kernels), timed
by the wall clock; says so.
The communication: the collectives one tensor-parallel step issues (recorded by wrapping
torch.distributed's all_reduce, all_gather and reduce_scatter during a step), timed alone with the
same sizes and dtypes ("alone"), and, on GPUs, the NCCL kernels' time inside a profiled step ("in
step": includes waiting for the other rank); each with its share of the tp step's time.
--sp: the tp block with sequence parallelism (MLA(sequence_parallel=True)): each rank steps its
slice of the sequence (x and dy), the block all-gathers x and reduce-scatters wo's output.
Also printed: the tp step's forward output against tp 1's (relative RMS; with --sp rank 0's slice).
Usage: python -m torch.distributed.run --nproc-per-node 2 bench/mla_tp_step.py [T ...]
       [--recipe bf16,mxfp8] [--small] [--sp]   (default T 4096; --small: T 64)"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import flush_buffer  # noqa: E402

import mxmla.nn as mnn  # noqa: E402
from mxmla.nn.tp import tp_size_rank  # noqa: E402

DSV3 = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128)
SMALL = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32)
ITERS = 10


class Clock:
    """Median step time (ms) on this rank: CUDA events with L2 flushed (GPU) or the wall clock (CPU);
    with a group, a barrier before each step so that the ranks start it together."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.flush = flush_buffer(device) if self.cuda else None

    def __call__(self, fn, group=None):
        for _ in range(3):
            fn()
        times = []
        for i in range(ITERS):
            if self.cuda:
                self.flush.fill_(i & 0xFF)
            if group is not None:
                dist.barrier(group=group)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def step_fn(m, x, dy):
    def step():
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x).backward(dy)
    return step


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def record_collectives(step):
    """[(name, numel, dtype)] of the collectives one step makes (all_reduce: its tensor; all_gather:
    its input; reduce_scatter: its output)."""
    calls, origs = [], {n: getattr(dist, n) for n in COLLECTIVES}

    def wrap(name):
        def wrapped(*a, **k):
            t = a[1] if name == "all_gather" else a[0]
            calls.append((name, t.numel(), t.dtype))
            return origs[name](*a, **k)
        return wrapped

    for n in COLLECTIVES:
        setattr(dist, n, wrap(n))
    try:
        step()
    finally:
        for n, f in origs.items():
            setattr(dist, n, f)
    return calls


def replay(calls, group, world, device):
    """A function issuing the recorded collectives again on buffers of the same sizes and dtypes."""
    fns = []
    for name, n, dt in calls:
        t = torch.zeros(n, dtype=dt, device=device)
        if name == "all_reduce":
            fns.append(lambda t=t: dist.all_reduce(t, group=group))
        elif name == "all_gather":
            outs = [torch.empty_like(t) for _ in range(world)]
            fns.append(lambda t=t, o=outs: dist.all_gather(o, t, group=group))
        else:
            ins = [torch.zeros_like(t) for _ in range(world)]
            fns.append(lambda t=t, i=ins: dist.reduce_scatter(t, i, group=group))
    return lambda: [f() for f in fns]


def nccl_ms_in_step(step, device):
    """GPU: the NCCL kernels' time inside one profiled step (ms)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    # the kernels themselves (not the host-side ranges named after them, which would count them twice)
    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type == DeviceType.CUDA and "nccl" in e.name.lower()) / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seqs", nargs="*", type=int)
    ap.add_argument("--recipe", default="bf16,mxfp8")
    ap.add_argument("--small", action="store_true", help="small dims on the CPU with gloo")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism: each rank steps its slice of the sequence")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("mla_tp_step.py: launch with python -m torch.distributed.run --nproc-per-node N "
                         "bench/mla_tp_step.py (N ranks of tensor parallelism)")
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    group = dist.group.WORLD
    world, rank = tp_size_rank(group)
    dims = DSV3 if cuda else SMALL
    seqs = args.seqs or ([4096] if cuda else [64])
    clock = Clock(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    where = "GPUs, NCCL" if cuda else "CPU processes, gloo: the CPU reference at small dims, not a performance figure"
    say(f"MLA block, tensor parallel over {world} ranks{' with sequence parallelism' if args.sp else ''} ({where}); "
        + ", ".join(f"{k} {v}" for k, v in dims.items()) + ", b 1, causal, bshd")
    say(f"{'T':>6s} {'recipe':>7s} {'tp1 ms':>9s} {f'tp{world} ms':>9s} {'ratio':>6s} {'comm alone':>10s} "
        f"{'share':>6s} {'in step':>8s} {'share':>6s} {'out rel':>8s}")
    for T in seqs:
        for recipe in args.recipe.split(","):
            kw = dict(dims, recipe=recipe, max_seq_len=T, layout="bshd", seed=11, device=device)
            g = torch.Generator().manual_seed(5)
            x = torch.randn(1, T, dims["hidden"], generator=g).to(torch.bfloat16).to(device).requires_grad_()
            dy = torch.randn(1, T, dims["hidden"], generator=g).to(torch.bfloat16).to(device)
            # tp 1 on rank 0 alone (the others wait)
            t1, out1 = float("nan"), None
            if rank == 0:
                full = mnn.MLA(**kw)
                t1 = clock(step_fn(full, x, dy))
                with torch.no_grad():
                    out1 = full(x).float()
                del full
            dist.barrier()
            # tp over all ranks
            tp = mnn.MLA(**kw, tp_group=group, sequence_parallel=args.sp)
            if args.sp:  # this rank's slice of the sequence, in and out
                if T % world:
                    raise SystemExit(f"mla_tp_step.py: --sp needs T ({T}) divisible by the ranks ({world})")
                lo, hi = rank * T // world, (rank + 1) * T // world
                xs, dys = x.detach()[:, lo:hi].clone().requires_grad_(), dy[:, lo:hi].contiguous()
            else:
                xs, dys = x, dy
            step = step_fn(tp, xs, dys)
            tn = clock(step, group)
            calls = record_collectives(step)
            comm = clock(replay(calls, group, world, device), group)
            in_step = nccl_ms_in_step(step, device) if cuda else 0.0
            with torch.no_grad():
                outn = tp(xs).float()
            # the slowest rank's figures
            figs = torch.tensor([tn, comm, in_step], dtype=torch.float64, device=device)
            dist.all_reduce(figs, op=dist.ReduceOp.MAX, group=group)
            tn, comm, in_step = (float(v) for v in figs)
            if not cuda:  # (no kernels to profile)
                in_step = float("nan")
            if rank == 0:
                ref = out1[:, :T // world] if args.sp else out1
                rel = float((outn - ref).norm() / (ref.norm() + 1e-30))
                print(f"{T:6d} {recipe:>7s} {t1:9.3f} {tn:9.3f} {tn / t1:6.3f} {comm:10.3f} {comm / tn:6.3f} "
                      f"{in_step:8.3f} {in_step / tn:6.3f} {rel:8.1e}"
                      + ("  (target tp step <= 0.55 x tp 1)" if cuda and world == 2 else ""))
                print(f"{'':6s} {'':7s} collectives in a tp step: " + ", ".join(
                    f"{name} {n} {str(dt).replace('torch.', '')}" for name, n, dt in calls))
            del tp, x, dy, xs, dys
            if cuda:
                torch.cuda.empty_cache()
            dist.barrier()
    dist.destroy_process_group()
    if not cuda:  # gloo's transport threads can race the C++ static destructors at exit (tests/python/test_tp.py's
        # workers leave the same way)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
