"""Runs configs and reports: one seed (replay) or a range per op, on the CPU (reference against
the oracle) or on a CUDA device (kernels against the reference, bit for bit, and the reference
against the oracle), with the CPU side in a pool of spawned worker processes. Command line:
`python3 -m tests.fuzz --help`."""
from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from . import check, gen, oracle, runner

MODULE = __package__ or "tests.fuzz"
SHOW_PER_OP = 5  # failures printed in full per op (all with --verbose)


@dataclass
class Result:
    op: str
    seed: int
    profile: str
    device: str
    mismatches: list = field(default_factory=list)
    seconds: float = 0.0
    tags: list = field(default_factory=list)
    known: str = ""  # ids of known library issues, when every mismatch is one of them
    pair: bool = False  # device-vs-reference mode on the CPU (dry run of a GPU check)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def status(self) -> str:
        return "pass" if not self.mismatches else "known" if self.known else "fail"

    def classify(self, cfg: dict) -> "Result":
        ids = [check.known_issue(cfg, m) for m in self.mismatches]
        self.known = ",".join(sorted(set(ids))) if ids and all(ids) else ""
        return self


def _err(op: str, what: str, msg: str) -> check.Mismatch:
    return check.Mismatch(op, what, "<call>", None, (), "", "", 0, 0, f"raised {msg}")


def _run_outs(cfg, ins, device):
    try:
        return runner.run(cfg, ins, device), None
    except runner.OpError as e:
        return None, str(e)


def oracle_check(cfg, ins, outs, what: str) -> list:
    try:
        exp = check.expected_outs(oracle.expected(cfg, ins))
    except Exception as e:  # noqa: BLE001 — an oracle failure is a fuzzer bug: report it, loudly
        return [_err(cfg["op"], "oracle", f"{type(e).__name__} in the oracle: {e}")]
    return check.compare_sets(cfg["op"], what, outs, exp)


def _guarded(fn):
    """A fuzzer bug (an exception outside the library call) becomes a failed result of its seed
    instead of ending the run."""
    import functools
    import traceback

    @functools.wraps(fn)
    def wrap(op, seed, profile, *args, **kw):
        try:
            return fn(op, seed, profile, *args, **kw)
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc().strip().splitlines()[-3:]
            res = Result(op, seed, profile, args[0] if fn.__name__ == "check_pair" else "cpu")
            res.mismatches.append(_err(op, "fuzzer", f"{type(e).__name__} in the fuzzer: {e} | {' | '.join(tb)}"))
            return res

    return wrap


def _invariants(cfg, ins, outs) -> list:
    try:
        return check.invariants(cfg, ins, outs)
    except Exception as e:  # noqa: BLE001
        return [_err(cfg["op"], "invariant", f"{type(e).__name__} while checking the invariants: {e}")]


@_guarded
def check_cpu(op: str, seed: int, profile: str, use_oracle: bool = True) -> Result:
    """The CPU reference (torch CPU tensors) against the oracle, and the invariants."""
    t0 = time.perf_counter()
    cfg = gen.generate(op, seed, profile)
    ins = gen.materialize(cfg)
    res = Result(op, seed, profile, "cpu", tags=cfg["tags"])
    outs, err = _run_outs(cfg, ins, "cpu")
    if err is not None:
        res.mismatches.append(_err(op, "cpu", err))
    else:
        if use_oracle:
            res.mismatches += oracle_check(cfg, ins, outs, "cpu vs oracle")
        res.mismatches += _invariants(cfg, ins, outs)
    res.seconds = time.perf_counter() - t0
    return res.classify(cfg)


def seed_timeout() -> float:
    """Seconds a device run may take before the run counts it as a hang (MXMLA_FUZZ_SEED_TIMEOUT,
    default 300: a config takes well under 10 s on the H200)."""
    return float(os.environ.get("MXMLA_FUZZ_SEED_TIMEOUT", "300"))


@contextlib.contextmanager
def watchdog(op: str, seed: int, profile: str, device: str):
    """A device run that does not return (a kernel that never finishes) ends the process after
    seed_timeout() seconds, saying which seed hung and how to replay it, instead of stalling the
    run without a word (the backward's deterministic order once hung so). A timer thread reports
    it: it runs while the device call waits with the GIL released (torch's synchronize, a copy to the
    host); faulthandler's watchdog, 30 s later, ends a process whose GIL stays held (exit status 1,
    with every thread's traceback)."""
    limit = seed_timeout()

    def fire():
        print(f"HANG {op} seed {seed}: the {device} run did not return within {limit:g} s; stopping the run; "
              f"replay: {replay_command(op, seed, device, profile)}", flush=True)
        os._exit(3)

    timer = threading.Timer(limit, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(limit + 30, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def device_side(op: str, seed: int, profile: str, device: str) -> tuple:
    """The device half of a pair check (in the parent: the GPU's process): (outputs, error).
    MXMLA_FUZZ_STALL=op:seed makes that run stall (tests of the watchdog)."""
    if os.environ.get("MXMLA_FUZZ_STALL") == f"{op}:{seed}":
        time.sleep(seed_timeout() + 60)
    try:
        cfg = gen.generate(op, seed, profile)
        ins = gen.materialize(cfg)
    except Exception as e:  # noqa: BLE001 — reported by check_pair, which meets the same exception
        return None, f"fuzzer error before the device run: {type(e).__name__}: {e}"
    return _run_outs(cfg, ins, device)


CONTEXT_LOST = ("illegal memory access", "unspecified launch failure", "illegal instruction", "misaligned address",
                "device-side assert", "an illegal", "CUDA error: an")


def context_lost(dev: tuple) -> bool:
    """Whether a device error leaves the CUDA context unusable (every later call would fail too)."""
    return dev[1] is not None and any(k in dev[1] for k in CONTEXT_LOST)


@_guarded
def check_pair(op: str, seed: int, profile: str, device: str, dev: tuple, use_oracle: bool = True) -> Result:
    """A device run's outputs `dev` (from device_side) against the CPU reference run of the same
    config, byte for byte; the invariants on the device outputs; the reference against the oracle.
    Runs in a worker process (it rebuilds the inputs from the config)."""
    t0 = time.perf_counter()
    cfg = gen.generate(op, seed, profile)
    ins = gen.materialize(cfg)
    res = Result(op, seed, profile, device, tags=cfg["tags"])
    gout, gerr = dev
    cout, cerr = _run_outs(cfg, ins, "cpu")
    want_err = check.expected_error(cfg, device)
    if want_err is not None:  # the op must raise this on the device (e.g. gemm on CUDA: no kernel yet)
        if gerr is None:
            res.mismatches.append(_err(op, device, f"nothing, but the fuzzer expects an error matching {want_err!r} "
                                                   "(check.GEMM_CUDA_KERNEL: set it when the kernel lands)"))
        elif not re.search(want_err, gerr):
            res.mismatches.append(_err(op, device, f"{gerr} (expected an error matching {want_err!r})"))
        gout = gerr = None
    if gerr is not None:
        res.mismatches.append(_err(op, device, gerr))
    if cerr is not None:
        res.mismatches.append(_err(op, "cpu", cerr))
    if gout is not None and cout is not None:
        res.mismatches += check.compare_pair(cfg, ins, f"{device} vs cpu", gout, cout)
    if gout is not None:
        res.mismatches += _invariants(cfg, ins, gout)
    if cout is not None and use_oracle:
        res.mismatches += oracle_check(cfg, ins, cout, "cpu vs oracle")
    res.seconds = time.perf_counter() - t0
    return res.classify(cfg)


# ----------------------------------------------------------------------------- reporting
def build_pythonpath() -> str:
    try:
        import mxmla

        p = os.path.dirname(os.path.dirname(os.path.abspath(mxmla.__file__)))
        rel = os.path.relpath(p)
        return rel if not rel.startswith("..") else p
    except Exception:  # noqa: BLE001
        return "build/python"


def replay_command(op: str, seed: int, device: str, profile: str, pair: bool = False) -> str:
    dflt = "cuda" if device.startswith("cuda") else "any"
    cmd = f"PYTHONPATH={shlex.quote(build_pythonpath())} python3 -m {MODULE} --op {op} --seed {seed} --device {device}"
    return cmd + (f" --profile {profile}" if profile != dflt else "") + (" --pair" if pair else "")


def report_failure(res: Result, out=None) -> None:
    out = out or sys.stdout
    first = res.mismatches[0]
    head = f"KNOWN {res.known}:" if res.known else "FAIL"
    print(f"{head} {first.line()}", file=out)
    for m in res.mismatches[1:8]:
        print(f"     {m.line()}", file=out)
    if len(res.mismatches) > 8:
        print(f"     ... {len(res.mismatches) - 8} more", file=out)
    print(f"     replay: {replay_command(res.op, res.seed, res.device, res.profile, res.pair)}", file=out)


# ----------------------------------------------------------------------------- pools
def _worker_init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:  # noqa: BLE001
        pass


def _pool(jobs: int):
    if jobs <= 1:
        return None
    import concurrent.futures
    import multiprocessing

    return concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker_init)


def run_seeds(op: str, seeds: list, device: str, profile: str, pool=None, use_oracle: bool = True,
              verbose: bool = False, on_result=None, pair: bool = None) -> list:
    """Results of `seeds` for `op`. pair (default: device is not the CPU): run the config on
    `device` and on the CPU reference (in `pool`'s workers, a few configs ahead) and compare them;
    else the CPU reference against the oracle (in `pool` when given)."""
    pair = (device != "cpu") if pair is None else pair
    results = []
    shown = shown_known = 0
    window = max(4, 3 * (getattr(pool, "_max_workers", 1) or 1))

    def handle(r: Result):
        nonlocal shown, shown_known
        r.pair = pair and device == "cpu"
        results.append(r)
        if r.status == "fail" and (verbose or shown < SHOW_PER_OP):
            report_failure(r)
            shown += 1
        elif r.status == "known" and (verbose or shown_known < 2):
            report_failure(r)
            shown_known += 1
        if on_result:
            on_result(r)

    if not pair:
        if pool is None:
            for s in seeds:
                handle(check_cpu(op, s, profile, use_oracle))
        else:
            for r in pool.map(check_cpu, [op] * len(seeds), seeds, [profile] * len(seeds), [use_oracle] * len(seeds),
                              chunksize=4):
                handle(r)
        return results
    # pair: the device runs here, one config after another; each result goes to a worker that runs
    # the reference on the same inputs and compares (a bounded number in flight)
    pending = collections.deque()
    for s in seeds:
        with watchdog(op, s, profile, device):
            dev = device_side(op, s, profile, device)
        if context_lost(dev):
            print(f"FATAL {op} seed {s}: {dev[1]}\n      the CUDA context is lost: stopping here; replay: "
                  f"{replay_command(op, s, device, profile)}", flush=True)
            while pending:
                handle(pending.popleft().result())
            handle(check_pair(op, s, profile, device, dev, use_oracle))
            raise ContextLost(op, s, results)
        if pool is None:
            handle(check_pair(op, s, profile, device, dev, use_oracle))
            continue
        pending.append(pool.submit(check_pair, op, s, profile, device, dev, use_oracle))
        while len(pending) > window or (pending and pending[0].done()):
            handle(pending.popleft().result())
    while pending:
        handle(pending.popleft().result())
    return results


class ContextLost(RuntimeError):
    """A device error broke the CUDA context: the run stops at (op, seed); `results` so far."""

    def __init__(self, op, seed, results):
        super().__init__(f"CUDA context lost at {op} seed {seed}")
        self.op, self.seed, self.results = op, seed, results


# ----------------------------------------------------------------------------- command line
def _parse(argv):
    p = argparse.ArgumentParser(prog=f"python3 -m {MODULE}",
                                description="Property tests of mxmla's public ops: random configs per (op, seed), "
                                            "bit-exact against the CPU reference (CUDA) or an independent oracle (CPU).")
    p.add_argument("--op", nargs="+", choices=gen.OPS, metavar="OP", help=f"ops to run (of: {', '.join(gen.OPS)})")
    p.add_argument("--all", action="store_true", help="every op")
    p.add_argument("--seed", type=int, help="replay this one seed: print its config and its mismatches")
    p.add_argument("--seeds", help="a comma-separated list of seeds")
    p.add_argument("--count", type=int, help="run seeds start .. start + count - 1 per op")
    p.add_argument("--start", type=int, default=0, help="first seed of --count (default 0)")
    p.add_argument("--device", default="cpu", help="cpu (the reference against the oracle; default) or cuda[:i] "
                                                   "(the kernels against the reference, and the reference against "
                                                   "the oracle)")
    p.add_argument("--profile", choices=gen.PROFILES, help="config domain: cuda (the CUDA path's rules; default with "
                                                          "--device cuda) or any (the reference's wider domain; "
                                                          "default on the CPU)")
    p.add_argument("--pair", action="store_true", help="with --device cpu: the GPU check's code path with the CPU "
                                                      "standing in for the GPU (a dry run: device run vs reference run)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes for the CPU side (default: CPU cores, "
                                                          "at most 16; 0 or 1: in process)")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle (device runs: compare with the reference only)")
    p.add_argument("--strict", action="store_true", help="known library issues (check.KNOWN_ISSUES) fail the run too")
    p.add_argument("--sanitize-sample", type=int, default=0, metavar="K",
                   help="after the run, re-run K seeds per op (spread over the range) under compute-sanitizer")
    p.add_argument("--sanitizer-tool", default="memcheck", help="compute-sanitizer tool (default memcheck)")
    p.add_argument("--sanitizer-args", default="", help="more compute-sanitizer options, one string "
                                                        "(e.g. \"--report-api-errors no\")")
    p.add_argument("--sanitizer-log", default="fuzz-sanitizer.log", help="its log file (default ./fuzz-sanitizer.log)")
    p.add_argument("--json", help="write the per-op results to this JSON file")
    p.add_argument("--stats", action="store_true", help="print coverage tags per op (how many configs had each feature)")
    p.add_argument("--print-config", action="store_true", help="print each config (JSON) after running it")
    p.add_argument("--verbose", "-v", action="store_true", help="print every failure in full (default: 5 per op)")
    a = p.parse_args(argv)
    if a.all:
        a.op = list(gen.OPS)
    if not a.op:
        p.error("give --op OP [OP ...] or --all")
    if sum(x is not None for x in (a.seed, a.seeds, a.count)) != 1:
        p.error("give exactly one of --seed, --seeds, --count")
    if a.pair and a.device != "cpu":
        p.error("--pair is for --device cpu (a device run already compares with the reference)")
    if a.profile is None:
        a.profile = "cuda" if a.device.startswith("cuda") else "any"
    if a.jobs is None:
        a.jobs = min(16, os.cpu_count() or 1) if a.seed is None else 0
    return a


def _check_device(device: str) -> str:
    """Why `device` cannot run, or "". Imports mxmla and torch (where installed) in every case, before
    any seed's watchdog starts: the first import of a CUDA build of torch takes seconds on the GPU
    machine, which a short MXMLA_FUZZ_SEED_TIMEOUT counted as the first seed hanging."""
    if device == "cpu":
        for name in ("torch", "mxmla"):
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 — torch is optional; a broken mxmla fails each run, reported there
                pass
        return ""
    if not device.startswith("cuda"):
        return f"unknown device {device!r} (cpu or cuda[:i])"
    try:
        import torch

        import mxmla
    except Exception as e:  # noqa: BLE001
        return f"cannot import torch / mxmla: {e}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    if not mxmla.info()["cuda_enabled"]:
        return "this mxmla build has no CUDA kernels (configure with -DMXMLA_ENABLE_CUDA=ON)"
    return ""


def replay(a) -> int:
    rc = 0
    pair = a.pair or a.device != "cpu"
    for op in a.op:
        cfg = gen.generate(op, a.seed, a.profile)
        print(f"== {op} seed {a.seed} profile {a.profile} device {a.device}"
              + (" (pair: device run vs reference run)" if a.pair else ""))
        print("config: " + gen.config_json(cfg), flush=True)
        if not pair:
            res = check_cpu(op, a.seed, a.profile, not a.no_oracle)
        else:
            with watchdog(op, a.seed, a.profile, a.device):
                dev = device_side(op, a.seed, a.profile, a.device)
            res = check_pair(op, a.seed, a.profile, a.device, dev, not a.no_oracle)
        if res.ok:
            print(f"PASS ({res.seconds:.2f} s)")
            continue
        if not res.known or a.strict:
            rc = 1
        print(f"{'KNOWN ' + res.known + ': ' if res.known else 'FAIL: '}{len(res.mismatches)} mismatch(es), "
              "the first element of each:")
        for m in res.mismatches:
            k = check.known_issue(cfg, m)
            print("  " + m.line() + (f"  [{k}]" if k else ""))
        for k in sorted(set(filter(None, (check.known_issue(cfg, m) for m in res.mismatches)))):
            print(f"  {k}: {check.KNOWN_ISSUES[k][0]}")
        print(f"replay: {replay_command(op, a.seed, a.device, a.profile, a.pair)}")
    return rc


def _sample(seeds: list, k: int) -> list:
    if k >= len(seeds):
        return list(seeds)
    return [seeds[(i * len(seeds)) // k] for i in range(k)]


def sanitize(a, seeds: list) -> tuple:
    """Re-run a sample under compute-sanitizer (one process, the CPU reference in process, the
    caching allocator off so that every tensor is its own allocation and an access past one is
    seen). Returns (status line, seconds)."""
    t0 = time.perf_counter()
    sample = _sample(seeds, a.sanitize_sample)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = ["compute-sanitizer", "--tool", a.sanitizer_tool, "--error-exitcode", "9", "--print-limit", "20",
           *shlex.split(a.sanitizer_args), sys.executable, "-m", MODULE, "--device", a.device, "--profile", a.profile, "--jobs", "0", "--no-oracle",
           "--seeds", ",".join(map(str, sample)), "--op", *a.op] + (["--pair"] if a.pair else []) + \
          (["--strict"] if a.strict else [])
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.abspath(build_pythonpath())]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    print(f"== compute-sanitizer --tool {a.sanitizer_tool}: {len(sample)} seeds x {len(a.op)} ops "
          f"(log: {a.sanitizer_log})", flush=True)
    print("   " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        with open(a.sanitizer_log, "w") as log:
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        rc = r.returncode
    except FileNotFoundError:
        return "not run (compute-sanitizer not found)", time.perf_counter() - t0
    lines = open(a.sanitizer_log).read().splitlines()
    for line in lines[-6:]:
        print("   | " + line)
    summary = [l for l in lines if "ERROR SUMMARY" in l or "RACECHECK SUMMARY" in l]
    status = "ok" if rc == 0 else "FAILED (sanitizer errors)" if rc == 9 else f"FAILED (rc {rc})"
    extra = f"; {summary[-1].strip()}" if summary else ""
    return f"{status}, {len(sample)} seeds per op{extra}", time.perf_counter() - t0


def main(argv=None) -> int:
    a = _parse(argv)
    msg = _check_device(a.device)
    if msg:
        print(f"{MODULE}: --device {a.device}: {msg}", file=sys.stderr)
        return 2
    if a.seed is not None:
        return replay(a)
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else list(range(a.start, a.start + a.count))
    pair = a.pair or a.device != "cpu"
    pool = _pool(a.jobs)
    rows, all_res = [], {}
    aborted = ""
    t_all = time.perf_counter()
    mode = "device vs CPU reference" + (" and reference vs oracle" if not a.no_oracle else "") if pair else \
        "CPU reference vs oracle"
    print(f"== fuzz: {len(a.op)} op(s) x {len(seeds)} seeds, device {a.device}, profile {a.profile}, {mode}, "
          f"{max(a.jobs, 1)} CPU worker(s)", flush=True)
    try:
        for op in a.op:
            t0 = time.perf_counter()

            def show(r, _op=op):
                if a.print_config:
                    print(gen.config_json(gen.generate(_op, r.seed, a.profile)))

            try:
                res = run_seeds(op, seeds, a.device, a.profile, pool, not a.no_oracle, a.verbose, show, pair)
            except ContextLost as e:
                res, aborted = e.results, str(e)
            dt = time.perf_counter() - t0
            failed = [r for r in res if r.status == "fail" or (a.strict and r.status == "known")]
            known = [r for r in res if r.status == "known" and not a.strict]
            first = str(failed[0].seed) if failed else "-"
            rows.append((op, len(res), len(res) - len(failed) - len(known), len(failed), len(known), first, dt))
            all_res[op] = res
            print(f"{op}: {len(res)} configs run, {rows[-1][2]} passed, {len(failed)} failed"
                  + (f", {len(known)} known issue(s) ({', '.join(sorted({r.known for r in known}))})" if known else "")
                  + f", first failing seed {first} ({dt:.1f} s)", flush=True)
            if a.stats:
                cnt = collections.Counter(t for r in res for t in r.tags)
                print("   tags: " + ", ".join(f"{k} {v}" for k, v in sorted(cnt.items())))
            if aborted:
                break
    finally:
        if pool is not None:
            pool.shutdown()
    total = time.perf_counter() - t_all
    san = None
    if a.sanitize_sample > 0 and not aborted:
        san = ("not run (needs --device cuda, or --pair for a dry run)", 0.0) if not pair else sanitize(a, seeds)
    print()
    rng = f"seeds {seeds[0]}..{seeds[-1]}" if not a.seeds else f"seeds {a.seeds}"
    print(f"fuzz summary: device {a.device}, profile {a.profile}, {rng}, {mode}")
    print(f"{'op':<26} {'configs':>7} {'passed':>7} {'failed':>7} {'known':>6}  {'first failing seed':<18} {'time':>8}")
    for op, n, ok, bad, kn, first, dt in rows:
        print(f"{op:<26} {n:>7} {ok:>7} {bad:>7} {kn:>6}  {first:<18} {dt:>7.1f}s")
    n_all, ok_all = sum(r[1] for r in rows), sum(r[2] for r in rows)
    bad_all, kn_all = sum(r[3] for r in rows), sum(r[4] for r in rows)
    print(f"{'total':<26} {n_all:>7} {ok_all:>7} {bad_all:>7} {kn_all:>6}  {'':<18} {total:>7.1f}s")
    if kn_all:
        for k in sorted({k for op in all_res for r in all_res[op] if r.status == "known" for k in r.known.split(",")}):
            print(f"known issue {k}: {check.KNOWN_ISSUES[k][0]}")
    if aborted:
        print(f"ABORTED: {aborted} (later configs and ops not run)")
    if san is not None:
        print(f"sanitizer ({a.sanitizer_tool}): {san[0]} ({san[1]:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=a.device, profile=a.profile, seeds=[seeds[0], seeds[-1]], seconds=round(total, 1),
                           ops={op: dict(configs=n, passed=ok, failed=bad, known=kn,
                                         first_failing_seed=None if first == "-" else int(first),
                                         failing_seeds=[r.seed for r in all_res[op] if r.status == "fail"][:100],
                                         known_seeds=[r.seed for r in all_res[op] if r.status == "known"][:100],
                                         seconds=round(dt, 1))
                                for op, n, ok, bad, kn, first, dt in rows},
                           sanitizer=None if san is None else san[0], aborted=aborted or None), f, indent=1)
    return 1 if bad_all or aborted or (san is not None and "FAILED" in san[0]) else 0
