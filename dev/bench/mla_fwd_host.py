"""Where the host's time goes in one MLA block's forward (bench/mla_step.py's setup, DeepSeek-V3 dims,
T tokens, causal): cProfile over N forwards of one recipe, the GPU synchronized only after the last,
sorted by own time (--top 0: none); before it, N forwards' wall time against their GPU time by CUDA
events, and the forward's and the step's times as bench/mla_step.py takes them (bench/timing.py: L2
flushed, a GPU sleep before each call, medians). A forward whose host time exceeds its GPU time
leaves the GPU idle (bench/mla_step.py's "fwd ms" then times the host). --thd: bench/mla_step.py
--thd's four packed sequences. --step: the same for the whole training step (forward + backward with
fresh gradients, as bench/mla_step.py times it) instead of the forward.
Usage: PYTHONPATH=<build>/python python3 dev/bench/mla_fwd_host.py [T] [--thd] [--step] [--recipe mxfp8] [--n 10]
       [--top 30]"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from mla_step import measure, packed, setup  # noqa: E402
from timing import flush_buffer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("T", type=int, nargs="?", default=4096)
    ap.add_argument("--thd", action="store_true")
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--step", action="store_true")
    a = ap.parse_args()
    cu = packed(a.T) if a.thd else None
    m, x, dy = setup(a.T, a.recipe, None, a.thd)

    def call():
        if not a.step:
            return m(x, cu_seqlens=cu)
        x.grad = None
        m.zero_grad(set_to_none=True)
        m(x, cu_seqlens=cu).backward(dy)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(a.n):
        call()
    e1.record()
    t_host = (time.perf_counter() - t0) * 1e3 / a.n
    torch.cuda.synchronize()
    t_all = (time.perf_counter() - t0) * 1e3 / a.n
    what = "step" if a.step else "forward"
    print(f"{a.recipe}{' thd' if a.thd else ''} T {a.T}: host {t_host:.3f} ms a {what} until the last launch, "
          f"{t_all:.3f} ms with the GPU done, events {e0.elapsed_time(e1) / a.n:.3f} ms")
    t_step, t_fwd, _ = measure(m, x, dy, flush_buffer(torch.device("cuda")), cu)
    print(f"timed as bench/mla_step.py: forward {t_fwd:.3f} ms, step {t_step:.3f} ms")
    if a.top <= 0:
        return
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.n):
        call()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
