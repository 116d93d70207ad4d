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


class Launch:
    """What a torch.distributed.run launch of one of these scripts sets up: the arguments (T ..., --recipe,
    --small and `extra` flags), the device of this rank (a GPU a rank with NCCL; the CPU with gloo without
    a GPU or with --small), the world group, its size and this rank, the dims (DeepSeek-V3's, or small),
    the sequence lengths, the clock, and `say` (rank 0 prints); the header lines are printed."""

    def __init__(self, name, doc, what, default_t, small_t, extra=()):
        ap = argparse.ArgumentParser(description=doc.splitlines()[0])
        ap.add_argument("seqs", nargs="*", type=int)
        ap.add_argument("--recipe", default="bf16,mxfp8")
        ap.add_argument("--small", action="store_true", help="small dims on the CPU with gloo")
        for flag, help_ in extra:
            ap.add_argument(flag, action="store_true", help=help_)
        self.args = ap.parse_args()
        self.cuda = torch.cuda.is_available() and not self.args.small
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if "WORLD_SIZE" not in os.environ:
            raise SystemExit(f"{name}: launch with python -m torch.distributed.run --nproc-per-node N "
                             f"bench/{name} (N ranks of {what})")
        if self.cuda:
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group("nccl" if self.cuda else "gloo")
        self.group = dist.group.WORLD
        self.world, self.rank = tp_size_rank(self.group)
        self.dims = DSV3 if self.cuda else SMALL
        self.seqs = self.args.seqs or ([default_t] if self.cuda else [small_t])
        self.clock = Clock(self.device)
        self.say = print if self.rank == 0 else (lambda *a, **k: None)

    def header(self, title, short):
        where = "GPUs, NCCL" if self.cuda else \
            "CPU processes, gloo: the CPU reference at small dims, not a performance figure"
        self.say(f"MLA block, {title} ({where}); " + ", ".join(f"{k} {v}" for k, v in self.dims.items())
                 + ", b 1, causal, bshd")
        self.say(f"{'T':>6s} {'recipe':>7s} {f'{short}1 ms':>9s} {f'{short}{self.world} ms':>9s} {'ratio':>6s} "
                 f"{'comm alone':>10s} {'share':>6s} {'in step':>8s} {'share':>6s} {'out rel':>8s}")

    def row(self, T, recipe, build, split, record, replay_, out_of=lambda m, xs: m(xs).float(),
            ref_of=lambda o: o, note=""):
        """One (T, recipe) row: the block's step on rank 0 alone on the whole input (x [1, T, hidden],
        dy), against the parallel block build(kw) on every rank stepping split(x), split(dy); the
        exchanges record(step) lists, replayed alone by replay_(calls); out_of(block, x part) the parallel
        output comparable with ref_of(the whole output). Rank 0 prints the row (the slowest rank's
        times) and gets the recorded calls (other ranks: None)."""
        kw = dict(self.dims, recipe=recipe, max_seq_len=T, layout="bshd", seed=11, device=self.device)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(1, T, self.dims["hidden"], generator=g).to(torch.bfloat16).to(self.device).requires_grad_()
        dy = torch.randn(1, T, self.dims["hidden"], generator=g).to(torch.bfloat16).to(self.device)
        t1, out1 = float("nan"), None
        if self.rank == 0:  # one device: rank 0 alone (the others wait)
            whole = mnn.MLA(**kw)
            t1 = self.clock(step_fn(whole, x, dy))
            with torch.no_grad():
                out1 = whole(x).float()
            del whole
        dist.barrier()
        par = build(kw)
        xs, dys = split(x.detach()).requires_grad_(), split(dy)
        step = step_fn(par, xs, dys)
        tn = self.clock(step, self.group)
        calls = record(step)
        comm = self.clock(replay_(calls), self.group)
        in_step = nccl_ms_in_step(step, self.device) if self.cuda else 0.0
        with torch.no_grad():
            outn = out_of(par, xs)
        # the slowest rank's figures
        figs = torch.tensor([tn, comm, in_step], dtype=torch.float64, device=self.device)
        dist.all_reduce(figs, op=dist.ReduceOp.MAX, group=self.group)
        tn, comm, in_step = (float(v) for v in figs)
        if not self.cuda:  # (no kernels to profile)
            in_step = float("nan")
        if self.rank == 0:
            ref = ref_of(out1)
            rel = float((outn - ref).norm() / (ref.norm() + 1e-30))
            print(f"{T:6d} {recipe:>7s} {t1:9.3f} {tn:9.3f} {tn / t1:6.3f} {comm:10.3f} {comm / tn:6.3f} "
                  f"{in_step:8.3f} {in_step / tn:6.3f} {rel:8.1e}{note}")
        del par, x, dy, xs, dys
        if self.cuda:
            torch.cuda.empty_cache()
        dist.barrier()
        return calls if self.rank == 0 else None

    def finish(self):
        dist.destroy_process_group()
        if not self.cuda:  # leave without the interpreter's teardown: a gloo worker thread can still be
            # releasing a completed collective's tensors, which needs the GIL, and a thread that asks for it
            # while the interpreter finalizes aborts the process (tests/python/test_tp.py's workers leave
            # the same way)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def main():
    run = Launch("mla_tp_step.py", __doc__, "tensor parallelism", 4096, 64,
                 [("--sp", "sequence parallelism: each rank steps its slice of the sequence")])
    args, cuda, device, group, world, rank = run.args, run.cuda, run.device, run.group, run.world, run.rank
    seqs = run.seqs
    run.header(f"tensor parallel over {world} ranks{' with sequence parallelism' if args.sp else ''}", "tp")
    for T in seqs:
        if args.sp and T % world:
            raise SystemExit(f"mla_tp_step.py: --sp needs T ({T}) divisible by the ranks ({world})")
        # --sp: this rank's slice of the sequence, in and out
        part = (lambda t: t[:, rank * T // world:(rank + 1) * T // world].contiguous()) if args.sp else \
            (lambda t: t)
        for recipe in args.recipe.split(","):
            calls = run.row(T, recipe, lambda kw: mnn.MLA(**kw, tp_group=group, sequence_parallel=args.sp), part,
                            record_collectives, lambda c: replay(c, group, world, device),
                            ref_of=(lambda o: o[:, :T // world]) if args.sp else (lambda o: o),
                            note="  (target tp step <= 0.55 x tp 1)" if cuda and world == 2 else "")
            if calls is not None:
                print(f"{'':6s} {'':7s} collectives in a tp step: " + ", ".join(
                    f"{name} {n} {str(dt).replace('torch.', '')}" for name, n, dt in calls))
    run.finish()


if __name__ == "__main__":
    main()
