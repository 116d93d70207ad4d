#!/usr/bin/env python3
"""The training run's parity against the bf16 recipe's own run-to-run noise, from train_mla.py logs.

    python3 dev/bench/parity_table.py [--windows N] [--adjust FIRST-LAST] LOG [LOG ...]

Each LOG is the output of one `examples/train_mla.py` run (its "training:" line names the seed and the
peak learning rate, its "[recipe] done in ..." lines the final training loss — the mean of the last 10 %
of the steps — and the held-out loss). Logs of the same seed and learning rate are grouped. Each
recipe's gap is taken against the bf16 run of its own log; a second log of the same seed ("replica")
also gives each recipe's gap against its own run in the first log ("bf16 again", "mxfp8 again"): how
far a recipe lands from itself, same weights, same batches (the kernels are not bitwise reproducible
run to run, and training amplifies such differences). Gaps are
relative, in per cent. The summary gives, per kind of gap and learning rate, the number of gaps, their
mean, standard deviation and standard error, and their root mean square; the "again" rows' spread is the
resolution of a parity claim made with this setup.

--windows N adds, per recipe, the gap of the mean training loss over each N-step window of the run, from
the loss curves that train_mla.py wrote beside each log (LOG without ".log" as its --out folder:
loss_bf16.csv, loss_<recipe>.csv): how the gap and its seed-to-seed spread grow along the run.
--adjust FIRST-LAST regresses each run's final gaps (training, held-out) on its gap in steps FIRST..LAST
(least squares over the runs): the correlation says how much of the final gap that early divergence of the
trajectories sets, the intercept what a run without it would end with (with its standard error).
"""
from __future__ import annotations

import csv
import math
import os
import re
import sys
from collections import OrderedDict, defaultdict

TRAINING = re.compile(r"^training: .* peak lr (\S+), seed (\d+);")
DONE = re.compile(r"^\[(\S+)\] done in [0-9.]+ s: final loss ([0-9.]+) .*held-out loss ([0-9.]+)")


def parse(path):
    lr = seed = None
    runs = []
    with open(path, errors="replace") as f:
        for line in f:
            m = TRAINING.match(line)
            if m:
                lr, seed = m.group(1), int(m.group(2))
            m = DONE.match(line)
            if m:
                runs.append((m.group(1), float(m.group(2)), float(m.group(3))))
    if lr is None:
        raise SystemExit(f"parity_table.py: {path}: no 'training:' line (not a train_mla.py log?)")
    return lr, seed, runs


def stats(xs):
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else float("nan")
    return mean, sd, sd / math.sqrt(n) if n > 1 else float("nan")


def curve(path):
    with open(path, newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def rel_gap(run, ref):
    return 100 * (sum(run) / len(run) - sum(ref) / len(ref)) / (sum(ref) / len(ref))


def curves(paths):
    """Per log with its loss curves: (lr, recipe, the recipe's curve, bf16's curve, (training, held-out) gap)."""
    out = []
    for path in paths:
        lr, _, runs = parse(path)
        folder = path[:-4] if path.endswith(".log") else path
        ref = os.path.join(folder, "loss_bf16.csv")
        final = {r[0]: r[1:] for r in runs}
        if not os.path.exists(ref) or "bf16" not in final:
            print(f"{path}: no {ref} or no bf16 run, left out of the curve tables", file=sys.stderr)
            continue
        b = curve(ref)
        for recipe in final:
            other = os.path.join(folder, f"loss_{recipe}.csv")
            if recipe != "bf16" and os.path.exists(other):
                f, h = final[recipe], final["bf16"]
                out.append((lr, recipe, curve(other), b,
                            (100 * (f[0] - h[0]) / h[0], 100 * (f[1] - h[1]) / h[1])))
    return out


def window_table(data, n):
    """Per (lr, recipe, window): the gap of the window's mean loss against bf16's, over every log with curves."""
    table = OrderedDict()
    for lr, recipe, m, b, _ in data:
        for w0 in range(0, min(len(b), len(m)), n):
            table.setdefault((lr, recipe, w0), []).append(rel_gap(m[w0:w0 + n], b[w0:w0 + n]))
    print(f"{'lr':>8} {'recipe':>12} {'steps':>11} {'runs':>5} {'gap mean %':>11} {'sd':>6} {'se':>6} {'above bf16':>11}")
    for (lr, recipe, w0), gs in table.items():
        mean, sd, se = stats(gs)
        steps = f"{w0 + 1}-{w0 + n}"
        print(f"{lr:>8} {recipe:>12} {steps:>11} {len(gs):>5} {mean:+11.2f} {sd:6.2f} {se:6.2f}"
              f" {sum(g > 0 for g in gs):>7} / {len(gs)}")


def regress(x, y):
    """Least squares y = a + b x: a, se(a), b, se(b), the correlation, the residuals' sd."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((v - mx) ** 2 for v in x)
    syy = sum((v - my) ** 2 for v in y)
    sxy = sum((u - mx) * (v - my) for u, v in zip(x, y))
    b = sxy / sxx
    a = my - b * mx
    rsd = math.sqrt(sum((v - a - b * u) ** 2 for u, v in zip(x, y)) / (n - 2))
    return a, rsd * math.sqrt(1 / n + mx * mx / sxx), b, rsd / math.sqrt(sxx), sxy / math.sqrt(sxx * syy), rsd


def adjust_table(data, lo, hi):
    """Each recipe's final gaps regressed on its gap in steps lo..hi: how much of a run's final gap the early
    divergence of its trajectory sets, and the final gap that a run without that early gap would have."""
    by = OrderedDict()
    for lr, recipe, m, b, fin in data:
        if min(len(m), len(b)) >= hi:
            by.setdefault((lr, recipe), []).append((rel_gap(m[lo - 1:hi], b[lo - 1:hi]), fin))
    print(f"final gap = a + b x (gap in steps {lo}-{hi}), least squares over the runs:")
    print(f"{'lr':>8} {'recipe':>12} {'runs':>5} {'gap':>9} {'a %':>7} {'se':>5} {'b':>6} {'se':>5} {'corr':>5}"
          f" {'resid sd':>8} {'sd':>5}")
    for (lr, recipe), rows in by.items():
        if len(rows) < 3:
            continue
        x = [r[0] for r in rows]
        for k, name in ((0, "training"), (1, "held-out")):
            y = [r[1][k] for r in rows]
            a, sa, b, sb, c, rsd = regress(x, y)
            print(f"{lr:>8} {recipe:>12} {len(rows):>5} {name:>9} {a:+7.2f} {sa:5.2f} {b:6.2f} {sb:5.2f} {c:5.2f}"
                  f" {rsd:8.2f} {stats(y)[1]:5.2f}")


def main(argv):
    windows = adjust = None
    while argv[:1] in (["--windows"], ["--adjust"]):
        opt, val = argv[0], argv[1] if len(argv) > 1 else ""
        argv = argv[2:]
        if opt == "--windows":
            if not val.isdigit() or int(val) < 1:
                print("parity_table.py: --windows takes a positive number of steps", file=sys.stderr)
                return 2
            windows = int(val)
        else:
            m = re.fullmatch(r"(\d+)-(\d+)", val)
            if not m or not 1 <= int(m.group(1)) < int(m.group(2)):
                print("parity_table.py: --adjust takes a window of steps FIRST-LAST (1 <= FIRST < LAST)",
                      file=sys.stderr)
                return 2
            adjust = (int(m.group(1)), int(m.group(2)))
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    groups = OrderedDict()  # (lr, seed) -> one {recipe: (final, held)} per log (a replica)
    for path in argv:
        lr, seed, runs = parse(path)
        groups.setdefault((lr, seed), []).append({r[0]: (r[1], r[2]) for r in runs})
    rows = []
    gaps = defaultdict(list)  # (lr, name) -> [(training gap, held-out gap)]

    def gap(name, lr, seed, run, ref):
        g = (100 * (run[0] - ref[0]) / ref[0], 100 * (run[1] - ref[1]) / ref[1])
        gaps[(lr, name)].append(g)
        rows.append((lr, seed, name, *run, *ref, *g))

    for (lr, seed), replicas in groups.items():
        for i, rep in enumerate(replicas):
            if "bf16" not in rep:
                print(f"lr {lr} seed {seed}: a log without a bf16 run, skipped", file=sys.stderr)
                continue
            for recipe, run in rep.items():
                if recipe != "bf16":  # against the same log's bf16 run
                    gap(recipe, lr, seed, run, rep["bf16"])
            if i:  # a recipe against its own first run of this seed
                for recipe, run in rep.items():
                    if recipe in replicas[0]:
                        gap(f"{recipe} again", lr, seed, run, replicas[0][recipe])
    print(f"{'lr':>8} {'seed':>4} {'recipe':>12} {'training':>9} {'held-out':>9} {'bf16 tr.':>9} {'bf16 h-o':>9}"
          f" {'gap tr. %':>10} {'gap h-o %':>10}")
    for lr, seed, name, fin, held, rf, rh, gt, gh in rows:
        print(f"{lr:>8} {seed:>4} {name:>12} {fin:9.4f} {held:9.4f} {rf:9.4f} {rh:9.4f} {gt:+10.2f} {gh:+10.2f}")
    print()
    print(f"{'lr':>8} {'recipe':>12} {'runs':>5} {'training gap: mean, sd, se %':>30} {'held-out gap: mean, sd, se %':>30}"
          f" {'rms %':>14}")
    for (lr, name), gs in sorted(gaps.items()):
        tr = stats([g[0] for g in gs])
        ho = stats([g[1] for g in gs])
        rms = (math.sqrt(sum(g[0] ** 2 for g in gs) / len(gs)), math.sqrt(sum(g[1] ** 2 for g in gs) / len(gs)))
        print(f"{lr:>8} {name:>12} {len(gs):>5} {tr[0]:+10.2f} {tr[1]:8.2f} {tr[2]:8.2f}    {ho[0]:+10.2f} {ho[1]:8.2f}"
              f" {ho[2]:8.2f}    {rms[0]:5.2f} {rms[1]:5.2f}")
    if windows or adjust:
        data = curves(argv)
        if windows:
            print()
            window_table(data, windows)
        if adjust:
            print()
            adjust_table(data, *adjust)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
