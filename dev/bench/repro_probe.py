#!/usr/bin/env python3
"""Which part of a training step is not bitwise reproducible.

    PYTHONPATH=<build>/python python3 dev/bench/repro_probe.py [--recipe mxfp8] [--deterministic]
        [--torch-deterministic] [--torch-strict] [--repeats 4] [--batches 2] [--steps-before N]
        [--save FILE | --against FILE] [--layers N --hidden N --heads N --seq N --batch N] [--device cuda]

One Decoder as examples/train_mla.py builds it (its GPU configuration unless told otherwise), one
batch of random bytes at a time: REPEATS times, from the same weights, the script's training step
(its train_step: forward, backward, gradient clipping, one AdamW step of a fresh optimizer; with
--steps-before N, N steps on other batches first). Every
module's outputs, the gradient that reaches each of them (a tensor hook on each output), every
parameter's gradient (as clipped), the loss and the updated weights are compared bit for bit with
the first repeat's (with --against, with the first repeats another process saved with --save). Printed: per
module in backward order, what differed; then where the step stops being reproducible: the first
module whose output differs (forward), the first gradient (in the order they arrive) that differs
between repeats, and any module whose own parameters' gradients differ while the gradient reaching
its output does not. Exit status 0 in every case (a probe, not a test); 2 on bad arguments, 1 when
--against's file does not fit the run.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="mxfp8", help="bf16, mxfp8 or block-fp8 (default mxfp8)")
    p.add_argument("--deterministic", action="store_true", help="the model's deterministic=True")
    p.add_argument("--torch-deterministic", action="store_true",
                   help="also torch.use_deterministic_algorithms(True, warn_only=True) and CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                        "(torch's own kernels in their deterministic forms)")
    p.add_argument("--torch-strict", action="store_true",
                   help="--torch-deterministic with warn_only=False: torch raises at an op without a fixed-order form "
                        "(and some backends, e.g. cuDNN attention's backward, take their fixed order only so)")
    p.add_argument("--repeats", type=int, default=4, help="steps from the same state per batch (default 4)")
    p.add_argument("--batches", type=int, default=2, help="batches, each probed on its own (default 2)")
    for k in ("layers", "hidden", "heads", "seq", "batch"):
        p.add_argument(f"--{k}", type=int, help=f"default: train_mla.py's GPU configuration (CPU's on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-before", type=int, default=0, metavar="N",
                   help="N training steps (the same optimizer, N more random batches) before each probed step, "
                        "so that the probed step is step N + 1 of a run (default 0)")
    p.add_argument("--self-check", metavar="MODULE", default=None,
                   help="the probe's own check: in every repeat but the first, scale the gradient that reaches "
                        "MODULE's output by 1 + 2^-7 once it is recorded (the probe must name MODULE)")
    p.add_argument("--save", metavar="FILE", default=None,
                   help="write each batch's first repeat (outputs, gradients, weights after the step) to FILE")
    p.add_argument("--against", metavar="FILE", default=None,
                   help="compare every repeat with the first repeats that another process saved with --save "
                        "(same arguments otherwise): is the step reproducible across processes")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when usable)")
    a = p.parse_args(argv)
    if a.repeats < 2 or a.batches < 1 or a.steps_before < 0:
        p.error("--repeats must be at least 2, --batches at least 1 and --steps-before at least 0")
    return a


def tensors(x):
    """The plain tensors in a module's output (tuples and lists walked; tensor subclasses left out)."""
    import torch

    if type(x) is torch.Tensor:
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in tensors(y)]
    return []


def same(a, b) -> bool:
    import torch

    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def max_diff(a, b) -> float:
    if a is None or b is None or a.shape != b.shape:
        return float("nan")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


class Recorder:
    """Forward outputs and the gradients reaching them, per module, in the order they were produced."""

    def __init__(self, model, perturb=None):
        self.perturb = perturb
        self.fwd = OrderedDict()  # name -> [output tensors]
        self.grad = OrderedDict()  # name -> {index: gradient}, filled in backward order
        self.handles = []
        for name, mod in model.named_modules():
            if name:
                self.handles.append(mod.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(mod, args, out):
            outs = tensors(out)
            self.fwd[name] = [t.detach().clone() for t in outs]
            for i, t in enumerate(outs):
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, i))
        return hook

    def _grad_hook(self, name, i):
        def hook(g):
            self.grad.setdefault(name, {})[i] = g.detach().clone()
            if name == self.perturb:  # --self-check: what the module's backward passes on differs
                return g * (1 + 2.0 ** -7 * (g.detach().float().abs() > 0).to(g.dtype))
            return None
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def main(argv=None) -> int:
    a = parse_args(argv)
    import copy

    import torch
    import train_mla

    if a.torch_deterministic or a.torch_strict:
        train_mla.torch_deterministic(a.torch_strict)  # what the script's --deterministic adds to the model's
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = dict(train_mla.GPU_CONFIG if device.startswith("cuda") else train_mla.CPU_CONFIG)
    for k in ("layers", "hidden", "heads", "seq", "batch"):
        if getattr(a, k) is not None:
            cfg[k] = getattr(a, k)
    dims = train_mla.mla_dims(cfg, [a.recipe], device)
    model = train_mla.build_model(a.recipe, cfg, a.seed, device, dims, None, a.deterministic)
    state0 = copy.deepcopy(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    print(f"repro_probe: {a.recipe}{', deterministic' if a.deterministic else ''}"
          f"{', torch deterministic' if a.torch_deterministic or a.torch_strict else ''}"
          f"{' (strict)' if a.torch_strict else ''}, {cfg['layers']} layers, hidden "
          f"{cfg['hidden']}, {cfg['heads']} heads, {cfg['batch']} x {cfg['seq']} bytes, {device}; "
          f"{a.repeats} repeats of a step on each of {a.batches} random batches"
          f"{f', each after {a.steps_before} steps' if a.steps_before else ''}", flush=True)
    g = torch.Generator().manual_seed(a.seed + 1)
    sources = OrderedDict()
    saved, other = [], None
    if a.against:
        other = torch.load(a.against, map_location=device)
        if len(other) != a.batches:
            raise SystemExit(f"repro_probe: --against {a.against} holds {len(other)} batches, this run has {a.batches}")
        print(f"repro_probe: every repeat compared with the first repeats of {a.against} (another process)")

    def batch():
        xy = torch.randint(0, 256, (cfg["batch"], cfg["seq"] + 1), generator=g).to(device)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()

    for bi in range(a.batches):
        before = [batch() for _ in range(a.steps_before)]
        x, y = batch()
        runs = []
        for rep in range(a.repeats):
            model.load_state_dict(state0)
            opt = train_mla.make_optimizer(model, cfg["lr"])
            for xb, yb in before:  # the run up to the probed step (compared only through its result)
                train_mla.train_step(model, opt, xb, yb)
            rec = Recorder(model, a.self_check if rep else None)
            loss = train_mla.train_step(model, opt, x, y)  # the script's step: gradients clipped, then AdamW
            grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            rec.close()
            runs.append(dict(loss=loss.detach().clone(), fwd=rec.fwd, grad=rec.grad, pgrad=grads,
                             weights={n: p.detach().clone() for n, p in model.named_parameters()}))
        saved.append(runs[0])
        if other is not None:  # the other process's first repeat is the reference; every repeat here is compared
            runs.insert(0, other[bi])
        first = runs[0]
        print(f"\nbatch {bi}: loss {first['loss'].item():.6f}, "
              f"{'the same bits' if all(same(r['loss'], first['loss']) for r in runs[1:]) else 'DIFFERS'} "
              f"in every repeat", flush=True)

        def differs(get):
            """(repeats that differ, largest |difference|) over the later repeats; get(run) -> tensor list."""
            n, worst = 0, 0.0
            for r in runs[1:]:
                bad = [max_diff(u, v) for u, v in zip(get(r), get(first)) if not same(u, v)]
                if bad or len(get(r)) != len(get(first)):
                    n += 1
                    worst = max([worst] + bad)
            return n, worst

        # modules in the order their output gradients arrived, then those without one (reverse forward order)
        order = list(first["grad"].keys()) + [n for n in reversed(first["fwd"]) if n not in first["grad"]]
        # and modules whose weights the step reads without calling them (e.g. the fused Q op's projection)
        # (the model's own, the byte embedding, under "")
        order += [n for n, m in model.named_modules()
                  if n not in order and any(True for _ in m.parameters(recurse=False))]
        print(f"{'module (backward order)':<34} {'output':>14} {'grad of output':>16} {'own param grads':>16}")
        rows = []
        for name in order:
            mod = model.get_submodule(name)
            own = [f"{name}.{pn}" if name else pn for pn, _ in mod.named_parameters(recurse=False)]
            fo = differs(lambda r: r["fwd"].get(name, [])) if first["fwd"].get(name) else None
            gi = sorted(first["grad"].get(name, {}))
            go = differs(lambda r: [r["grad"].get(name, {}).get(i) for i in gi]) if gi else None
            po = differs(lambda r: [r["pgrad"][n] for n in own]) if own else None
            rows.append((name, fo, go, po))
            fmt = lambda d: "-" if d is None else "same" if d[0] == 0 else f"{d[0]}x {d[1]:.2e}"  # noqa: E731
            print(f"{name or '(the model: embedding)':<34} {fmt(fo):>14} {fmt(go):>16} {fmt(po):>16}")
        # the forward: the first module (in forward order) whose output differs computed it differently
        fwd_bad = next((n for n in first["fwd"] if differs(lambda r: r["fwd"].get(n, []))[0]), None)
        if fwd_bad is not None:
            print(f"first differing output (forward): {fwd_bad}")
            sources.setdefault(f"forward, {fwd_bad}", []).append(bi)
        # where the backward stops being reproducible: the first gradient (in arrival order) that differs came
        # out of the backward run between its arrival and the previous one's; a module whose parameters'
        # gradients differ while the gradient reaching it does not computes them itself
        first_bad = next((k for k, r in enumerate(rows) if r[2] and r[2][0]), None)
        if first_bad is not None:
            before = rows[first_bad - 1][0] if first_bad else "the loss"
            print(f"first differing gradient: the one reaching {rows[first_bad][0]} (the backward ran from {before} "
                  f"to it)")
            sources.setdefault(f"between {before} and {rows[first_bad][0]}", []).append(bi)
        for name, fo, go, po in rows:
            if go and go[0] == 0 and po and po[0]:
                sources.setdefault(f"{name} ({type(model.get_submodule(name)).__name__}): its parameters' gradients",
                                   []).append(bi)
        pg = differs(lambda r: [r["pgrad"][n] for n in names])
        wt = differs(lambda r: [r["weights"][n] for n in names])
        print(f"all parameter gradients: {'the same bits' if pg[0] == 0 else f'differ in {pg[0]} repeats'}; "
              f"weights after the step: {'the same bits' if wt[0] == 0 else f'differ in {wt[0]} repeats'}")
        if pg[0] == 0 and wt[0]:
            print("the gradients are reproducible but the update is not: gradient clipping or the optimizer")
    if a.save:
        torch.save(saved, a.save)
        print(f"repro_probe: first repeats written to {a.save}")
    print()
    if sources:
        for where, bs in sources.items():
            print(f"not reproducible: {where} (batches {bs})")
    else:
        print("no module's own backward differed between repeats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
