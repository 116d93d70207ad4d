#!/usr/bin/env python3
"""SM clock and power while one op runs back to back: the fused Q up-projection against cuBLAS's GEMM.

The bench (bench.py) times single calls after an L2 flush; this script asks a different question:
under sustained load, at what SM clock does each op run, at what power, and how many SM cycles
does one call take? If two ops take the same cycles but one runs at a lower clock, the gap between
them is power, not the kernel's schedule.

Each case runs for --seconds in batches of calls (CUDA events around each batch); a thread reads
NVML (SM clock, power, clock-event reasons) every --period-ms. The first --settle seconds of a case
are not counted (the clock moves while power settles). With --rounds 2 (the default) the cases run
A B A B, so that drift shows. Prints one table: ms per call, median / min / max SM MHz, median W, Mcycles per call
(ms x median MHz), mJ per call (ms x median W), TFLOP/s, TFLOP/s per GHz and the clock-event
reasons seen.

Usage (GPU machine): PYTHONPATH=build-gpu/python python3 bench/clocks.py [--tokens 16384 --heads 128]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time

import torch

import mxmla

# NVML clock-event reason bits (nvml.h, nvmlClocksEventReason*)
_REASONS = {0x1: "idle", 0x2: "app-clocks", 0x4: "SW-power-cap", 0x8: "HW-slowdown", 0x20: "SW-thermal",
            0x40: "HW-thermal", 0x80: "HW-power-brake", 0x100: "display-clocks"}


class Nvml:
    """The three NVML queries this script needs, through ctypes (no pynvml on the GPU machine)."""

    def __init__(self, index: int):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise RuntimeError(f"bench/clocks.py needs NVML (libnvidia-ml.so.1, part of the driver): {e}") from e
        self._ok(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.h = ctypes.c_void_p()
        self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.h)), "handle")
        self.reasons_fn = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML {what} failed (rc {rc})")

    def sample(self) -> tuple:
        mhz, mw, rs = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        self._ok(self.lib.nvmlDeviceGetClockInfo(self.h, ctypes.c_int(1), ctypes.byref(mhz)), "clock")  # NVML_CLOCK_SM
        self._ok(self.lib.nvmlDeviceGetPowerUsage(self.h, ctypes.byref(mw)), "power")
        self._ok(self.reasons_fn(self.h, ctypes.byref(rs)), "reasons")
        return mhz.value, mw.value / 1000.0, rs.value


def run_case(nvml: Nvml, fn, seconds: float, settle: float, period: float, batch: int) -> dict:
    samples, stop = [], threading.Event()
    t0 = time.monotonic()
    t_count = t0 + settle  # samples and batches from here on count

    def sampler():
        while not stop.is_set():
            s = nvml.sample()
            if time.monotonic() >= t_count:
                samples.append(s)
            time.sleep(period)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    ms_per_call = []
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while time.monotonic() - t0 < seconds:
        e0.record()
        for _ in range(batch):
            fn()
        e1.record()
        e1.synchronize()
        if time.monotonic() >= t_count:
            ms_per_call.append(e0.elapsed_time(e1) / batch)
    stop.set()
    th.join()
    if not samples or not ms_per_call:
        raise RuntimeError("no samples: raise --seconds above --settle")
    mhz = [s[0] for s in samples]
    reasons = 0
    for s in samples:
        reasons |= s[2]
    return {"ms": statistics.median(ms_per_call), "mhz": statistics.median(mhz), "mhz_min": min(mhz),
            "mhz_max": max(mhz), "w": statistics.median(s[1] for s in samples),
            "reasons": ",".join(v for k, v in _REASONS.items() if reasons & k) or "none"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--period-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default="fused,cublas", help="comma-separated: fused, cublas")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/clocks.py: no CUDA GPU here; nothing to measure", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    T, NH, K = a.tokens, a.heads, a.k
    N = NH * 192
    flop = 2.0 * T * N * K
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(T, device=dev), yarn="deepseek_v3")
    known = {"fused": ("mxmla fused", lambda: mxmla.fused_q_uproj_rope_quant(x, w, c, s)),
             "cublas": ("cuBLAS GEMM", lambda: torch.matmul(x, w.t()))}
    if any(k not in known for k in a.cases.split(",")):
        ap.error(f"argument --cases: each must be one of {sorted(known)}, got {a.cases!r}")
    cases = dict(known[k] for k in a.cases.split(","))
    nvml = Nvml(torch.cuda.current_device())
    batch = max(1, int(20e-3 / (flop / 700e12)))  # ~20 ms per batch
    print(f"GPU: {torch.cuda.get_device_name()}; T {T}, NH {NH}, K {K}; {a.seconds} s per case "
          f"({a.settle} s settle), NVML every {a.period_ms} ms, batches of {batch} calls")
    print(f"{'case':<14} {'ms/call':>8} {'MHz med':>8} {'min':>5} {'max':>5} {'W med':>6} {'Mcyc/call':>9} {'mJ/call':>8} "
          f"{'TFLOP/s':>8} {'TF/s/GHz':>8}  reasons")
    for r in range(a.rounds):
        for name, fn in cases.items():
            m = run_case(nvml, fn, a.seconds, a.settle, a.period_ms / 1000.0, batch)
            tfs = flop / m["ms"] / 1e9
            print(f"{name:<14} {m['ms']:8.4f} {m['mhz']:8.0f} {m['mhz_min']:5d} {m['mhz_max']:5d} {m['w']:6.0f} "
                  f"{m['ms'] * m['mhz'] / 1e3:9.3f} {m['ms'] * m['w']:8.1f} {tfs:8.0f} {tfs / (m['mhz'] / 1e3):8.0f}  {m['reasons']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
