#!/usr/bin/env python3
"""Where a work tile's time goes in the attention forward's SM90 kernel, outside and inside its
key-block loop: needs the probe build (dev/patches/attn_fwd_tile_probe.patch applied: clock64 stamps
by each consumer warpgroup's first thread at a tile's start, when its Q has landed, when its first S
has landed, when its last P·V has landed and when its O and LSE stores are issued, on the first CTAs;
written to the file that MXMLA_FWD_PROBE names). Runs one forward call (after a warm-up) on bf16
inputs and one on MXFP8 inputs (the default staged path), DeepSeek-V3 dims, causal, bshd, b 1, h 128,
and prints per consumer the mean cycles a tile of each phase, the loop's cycles per key block, and
the share of the consumers' time outside the loop (the tile boundary: the next tile's claim, Q's
load, the first S GEMM before any overlap, the epilogue) — what a TMA-stored epilogue or an earlier
first S GEMM could take back at most.
Usage: PYTHONPATH=<probe build>/python python3 dev/bench/attn_fwd_tiles.py [S ...]   (default 4096)"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import attention_inputs, probe_stamps  # noqa: E402

import mxmla  # noqa: E402

CTAS, CONSUMERS, T, SLOTS = 16, 2, 64, 6  # the patch's kProbeCtas, 2 consumers, kProbeT, kProbeS
PHASES = ["tile start -> Q landed", "Q landed -> first S landed", "first S -> last P.V landed (the loop)",
          "last P.V -> O, LSE stores issued", "stores issued -> next tile's start"]


def stamps(fn):
    """fn run once to warm up, then once with MXMLA_FWD_PROBE set: [CTA][consumer][tile][slot] int64
    (slot 5: the tile's key blocks; 0 where nothing was written)."""
    return probe_stamps(fn, "MXMLA_FWD_PROBE", CTAS * CONSUMERS * T * SLOTS).reshape(CTAS, CONSUMERS, T, SLOTS)


def report(label, a):
    rows = {c: [] for c in range(CONSUMERS)}
    blocks = []
    for cta in range(CTAS):
        for c in range(CONSUMERS):
            st = a[cta, c]
            n = int(np.count_nonzero(st[:, 4]))
            for t in range(1, n - 1):  # each CTA's first and last tiles left out
                s = st[t]
                if s[5] <= 0 or not all(s[:5]):
                    continue
                rows[c].append([s[1] - s[0], s[2] - s[1], s[3] - s[2], s[4] - s[3], st[t + 1, 0] - s[4]])
                if c == 0:
                    blocks.append(s[5])
    if not rows[0]:
        print(f"== {label}: no tiles sampled")
        return
    m = [np.mean(rows[c], axis=0) for c in range(CONSUMERS)]
    nb = float(np.mean(blocks))
    print(f"== {label}: {len(rows[0])} tiles sampled (consumer 0), mean {nb:.1f} key blocks a tile; "
          "mean cycles a tile (consumer 0 / consumer 1)")
    for i, name in enumerate(PHASES):
        print(f"  {name:40s} {m[0][i]:9.0f} {m[1][i]:9.0f}")
    for c in range(CONSUMERS):
        total = float(np.sum(m[c]))
        loop = float(m[c][2])
        per_block = loop / max(nb - 1, 1)
        print(f"  consumer {c}: tile {total:.0f} cycles, the loop {per_block:.0f} a key block after the first; "
              f"outside the loop {100 * (total - loop) / total:.1f} % of the tile")


def main() -> int:
    sizes = [int(a) for a in sys.argv[1:]] or [4096]
    dev = torch.device("cuda")
    scale = mxmla.yarn_softmax_scale()
    for S in sizes:
        torch.manual_seed(0)
        t = attention_inputs(S, dev)
        q8, k8, v8, qb, kb, vb = (t[n] for n in ("q8", "k8", "v8", "qb", "kb", "vb"))
        del t
        report(f"s {S}, bf16 inputs",
               stamps(lambda: mxmla.attention(qb, kb, vb, causal=True, softmax_scale=scale, layout="bshd")))
        report(f"s {S}, MXFP8 inputs (staged)",
               stamps(lambda: mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale)))
        del q8, k8, v8, qb, kb, vb
    return 0


if __name__ == "__main__":
    sys.exit(main())
