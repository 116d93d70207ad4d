#!/usr/bin/env python3
"""The table of a same-run A/B (dev/scripts/ab-trees, dev/scripts/env-ab): AB_TXT holds one line per
case, build (or setting) and round, 'KEY ROUND {json of dev/bench/ab_kernels.py}'; per case, the
median over rounds of each KEY, its ratio to the first KEY's and whether all outputs agree bit for bit.
Usage: ab_summary.py AB_TXT KEY=TITLE ... [--legend TEXT]"""
import argparse
import json
import statistics
from collections import defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("path")
ap.add_argument("columns", nargs="+", help="KEY=TITLE, in the table's order (the first is the reference)")
ap.add_argument("--legend", default="")
a = ap.parse_args()
keys = [c.split("=", 1)[0] for c in a.columns]
titles = [c.split("=", 1)[1] if "=" in c else c for c in a.columns]
ms, sums, order = defaultdict(list), defaultdict(set), []
for line in open(a.path):
    k, _, js = line.split(" ", 2)
    d = json.loads(js)
    ms[(d["case"], k)].append(d["ms"])
    sums[d["case"]].add(d["sum"])
    if d["case"] not in order:
        order.append(d["case"])
print(f"{'case':28s}" + "".join(f"{t:>12s}" for t in titles) + f"   ratio to {titles[0]}   outputs")
for c in order:
    # (a build without the case, e.g. an older tree without the op: nan)
    med = [statistics.median(ms[(c, k)]) if ms[(c, k)] else float("nan") for k in keys]
    ratios = " ".join(f"{m / med[0]:.4f}" for m in med[1:])
    print(f"{c:28s}" + "".join(f"{m:12.4f}" for m in med) + f"   {ratios:16s}   {'identical' if len(sums[c]) == 1 else 'DIFFER'}")
print((a.legend + "; " if a.legend else "") + "medians over rounds of the bench's medians (ms)")
