"""The benchmarks' single-call timer (bench.py, epilogue_peers.py): CUDA events around each call,
L2 flushed before each, median of the calls after warm-up."""
from __future__ import annotations

import statistics

import torch


def flush_buffer(dev: torch.device) -> torch.Tensor:
    """The buffer timer() fills before each call: 256 MiB, several times the H200's L2."""
    return torch.empty(256 << 20, dtype=torch.uint8, device=dev)


def timer(fn, iters: int, flush: torch.Tensor) -> float:
    """Median milliseconds of fn() with L2 flushed before each call."""
    for _ in range(3):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        flush.fill_(i & 0xFF)
        # keep the GPU busy (~1 ms) while Python enqueues fn(), so host overhead stays outside the events
        torch.cuda._sleep(2_000_000)
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))
