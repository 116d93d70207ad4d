"""Where one MLA block's training step goes (bench/mla_step.py's step: forward + backward, DeepSeek-V3
dims, b 1, T tokens, causal, bshd, both recipes from the same weights): every GPU kernel of a step
under torch.profiler, L2 flushed and a GPU sleep before each step (as bench/timing.py does), grouped
by kernel name, summed over its launches in a step, medians over the steps; then the sum of the
kernels against the step's time by CUDA events (the difference: the GPU idle between kernels,
waiting for the host to launch them). --thd: the T tokens as bench/mla_step.py --thd's four packed
sequences; --recipes: which recipes (default both); --forward: the forward alone (bench/mla_step.py's
"fwd ms": the block's forward with autograd recording, its output dropped).
Usage: PYTHONPATH=<build>/python python3 dev/bench/mla_step_parts.py [T] [--top N] [--thd] [--forward] [--recipes mxfp8]"""
import argparse
import os
import statistics
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_step import packed, setup  # noqa: E402
from parts import profiled_calls  # noqa: E402
from timing import flush_buffer, timer  # noqa: E402


def short(name):
    base = name.replace("(anonymous namespace)::", "").split("(")[0].replace("void ", "")
    head = base.split("<")[0].split("::")[-1]
    if "elementwise" in head or "reduce_kernel" in head:  # torch's generic kernels: name their functor
        for part in base.split("<")[1:]:
            if "Functor" in part or "func" in part.lower() or "Op" in part:
                return head + "<" + part.split("::")[-1].split(",")[0].split(">")[0][:28] + ">"
    return head[:60]


def step_kernels(step, iters, flush):
    """{short kernel name: [summed GPU ms of its launches in each step]}, and launches per step."""
    per, launches, k = defaultdict(lambda: [0.0] * iters), defaultdict(int), -1
    for ev in profiled_calls(step, iters, flush):
        if "spin_kernel" in ev.name or "sleep" in ev.name.lower():
            k += 1
            continue
        if k < 0 or "FillFunctor<unsigned char>" in ev.name:  # the L2 flush (a uint8 fill; the step has none)
            continue
        t = ev.device_time / 1000.0 if hasattr(ev, "device_time") else ev.cuda_time / 1000.0
        per[short(ev.name)][k] += t
        launches[short(ev.name)] += 1
    return per, {n: c / iters for n, c in launches.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("T", type=int, nargs="?", default=4096)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thd", action="store_true")
    ap.add_argument("--forward", action="store_true")
    ap.add_argument("--recipes", default="bf16,mxfp8")
    a = ap.parse_args()
    T, top = a.T, a.top
    cu = packed(T) if a.thd else None
    flush = flush_buffer(torch.device("cuda"))
    ref = None
    for recipe in a.recipes.split(","):
        m, x, dy = setup(T, recipe, ref, a.thd)
        ref = ref if ref is not None else m.state_dict()

        def step():
            x.grad = None
            m.zero_grad(set_to_none=True)
            y = m(x, cu_seqlens=cu)
            if not a.forward:
                y.backward(dy)

        iters = 10
        per, launches = step_kernels(step, iters, flush)
        t_step = timer(step, iters, flush)
        rows = sorted(((statistics.median(ts), n) for n, ts in per.items()), reverse=True)
        total = sum(statistics.median(ts) for ts in per.values())
        print(f"== {recipe}, T {T}{' thd' if a.thd else ''}: {'forward' if a.forward else 'step'} {t_step:.3f} ms (events), kernels {total:.3f} ms, "
              f"{sum(launches.values()):.0f} launches a step; GPU idle between kernels {t_step - total:.3f} ms")
        for ms, n in rows[:top]:
            print(f"  {n:64s} {ms:8.4f} ms  x{launches[n]:g}")
        rest = sum(ms for ms, _ in rows[top:])
        print(f"  {'(the other ' + str(max(0, len(rows) - top)) + ' kernels)':64s} {rest:8.4f} ms")
        del m, x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
