"""Where one MLA block step's memory peak comes from (bench/mla_step.py's block and step: DeepSeek-V3
dims, b 1, T tokens, causal, bshd, fresh gradients): torch's allocator history over one step after a
warm-up step, the peak of the bytes allocated above the state before the step, the operation that
reached it (the innermost Python frames of the allocation that made the peak), and the blocks alive
at that moment grouped by the Python line that allocated them (innermost frame inside mxmla or
bench/; "autograd engine" for a block allocated by C++ code with no Python frame, e.g. an autograd
node of a torch op in backward). torch's allocator only: mxmla's own scratch (the mxfp8 attention
backward's) does not appear here; bench/mla_step.py's pool peak counts both.
--pool nodes: instead, both counted (torch on the device's default pool, as bench/mla_step.py's peak):
the pool's peak above the state before the step during the forward and during each backward node of
the step (a hook before and after every node synchronizes and reads the pool's high-water mark), and
separately inside each mxmla.attention_backward call. --pool step: the same pool, the step's peak as it
runs (no synchronization inside it), as bench/mla_step.py measures it.
Usage: PYTHONPATH=<build>/python python3 dev/bench/mla_step_memory.py [T] [--recipes bf16,block-fp8] [--top N] [--pool nodes|step]"""
import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from mla_step import setup  # noqa: E402

MiB = 2**20


def _fmt(f):
    return f"{f['name']} {'/'.join(f['filename'].split('/')[-2:])}:{f['line']}"


def where(frames):
    """'op ← caller': the innermost frame of mxmla's public ops (skipping its allocation helpers) and
    the innermost frame in mxmla.nn or a bench script that led there."""
    ours = [f for f in frames if "/mxmla/" in f.get("filename", "") or "/bench/" in f.get("filename", "")]
    if not ours:
        return "autograd engine (no Python frame)" if not frames else _fmt(frames[0])
    ops = [f for f in ours if not f["filename"].endswith(("_backend.py", "_torch_ops.py", "_dispatch.py"))]
    op = ops[0] if ops else ours[0]
    caller = next((f for f in ours if "/nn/" in f["filename"] or "/bench/" in f["filename"]), None)
    return _fmt(op) if caller is None or caller is op else f"{_fmt(op)} <- {_fmt(caller)}"


def peak_of(trace):
    """(peak bytes above the start, index of the event, live blocks {addr: (size, frames)} at the peak)."""
    live, total, best, best_i, best_live = {}, 0, 0, -1, {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
            if total > best:
                best, best_i, best_live = total, i, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    return best, best_i, best_live


def graph_nodes(root):
    """Every autograd node reachable from root (once each)."""
    seen, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        todo.extend(f for f, _ in n.next_functions)
    return seen


def pool_phases(a):
    """The --pool mode: the pool's peak per phase of one step (forward, each backward node, each
    attention_backward call), in MiB above the state before the step."""
    import mxmla

    ref, attn_bwd = None, mxmla.attention_backward
    for recipe in a.recipes.split(","):
        m, x, dy = setup(a.T, recipe, ref)
        ref = ref or {k: v.detach().clone() for k, v in m.state_dict().items()}
        for _ in range(2):
            x.grad = None
            m.zero_grad(set_to_none=True)
            m(x).backward(dy)
        x.grad = None
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = mxmla.scratch_memory(reset_peak=True)["in_use"]
        rows = []

        def mark(what):
            torch.cuda.synchronize()
            st = mxmla.scratch_memory()  # (the peak since the last mark, then a new one from now)
            mxmla.scratch_memory(reset_peak=True)
            rows.append((what, (st["peak"] - base) / MiB, (st["in_use"] - base) / MiB))

        def attention_backward(*args, **kw):
            mark("(backward before attention_backward)")
            out = attn_bwd(*args, **kw)
            mark("  mxmla.attention_backward")
            return out

        if a.pool == "nodes":
            mxmla.attention_backward = attention_backward
        try:
            out = m(x)
            if a.pool == "nodes":
                mark("forward")
                for n in graph_nodes(out.grad_fn):
                    n.register_prehook(lambda g, n=n: mark(f"(before {n.name()})") or None)
                    n.register_hook(lambda gi, go, n=n: mark(n.name()) or None)
            out.backward(dy)
            mark("(after the backward)" if a.pool == "nodes" else "the whole step, no synchronization inside it")
        finally:
            mxmla.attention_backward = attn_bwd
        print(f"\n{recipe}: T {a.T}, the pool's peak in each phase and what is in use at its end (MiB above the "
              f"state before the step; phases with a peak below the step's peak - 512 MiB left out; '(before X)': "
              f"between the previous node and X)")
        top = max(r[1] for r in rows)
        for what, peak, use in rows:
            if peak >= top - 512:
                print(f"  {peak:8.0f} {use:8.0f}  {what}{'   <- the step peak' if peak == top else ''}")
        del m, x, dy, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("T", type=int, nargs="?", default=4096)
    ap.add_argument("--recipes", default="bf16,block-fp8,mxfp8")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--pool", choices=("nodes", "step"), default=None,
                    help="the pool's peak per backward node (synchronizing at each), or over the step as it runs")
    a = ap.parse_args()
    if a.pool:
        if "cudaMallocAsync" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
            os.execv(sys.executable, [sys.executable] + sys.argv)
        return pool_phases(a)
    ref = None
    for recipe in a.recipes.split(","):
        m, x, dy = setup(a.T, recipe, ref)
        ref = ref or {k: v.detach().clone() for k, v in m.state_dict().items()}

        def step():
            x.grad = None
            m.zero_grad(set_to_none=True)
            m(x).backward(dy)

        step()
        x.grad = None
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        best, i, live = peak_of(trace)
        groups = defaultdict(lambda: [0, 0])
        for size, frames in live.values():
            g = groups[where(frames)]
            g[0] += size
            g[1] += 1
        print(f"\n{recipe}: T {a.T}, peak {best / MiB:.0f} MiB above the state before the step, at event {i} of "
              f"{len(trace)}, reached by: {where(trace[i].get('frames', [])) if i >= 0 else '-'}")
        for name, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:a.top]:
            print(f"  {size / MiB:9.1f} MiB  {n:4d} blocks  {name}")
        del m, x, dy, snap, trace, live
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
