"""Where a tile's time goes in the attention backward with attn_bwd_dq_buffer.patch's dQ path: needs
the probe build (dev/patches/attn_bwd_dq_buffer_probe.patch applied to the tree; clock64 stamps per
phase, the CTAs of the first two KV heads, written to the file MXMLA_BWD_PROBE names). One backward
call after warm-up with MXFP8 inputs and one with bf16 inputs, DeepSeek-V3 head dims, causal, bshd,
b 1, h 128, s 4096; prints the mean cycles a tile of each consumer phase (consumer 0 / 1) and of the
producer's thread 0 (the dQ adder and one of the loaders; MXFP8 inputs only: with bf16 ones its turn
skips Q_g's stamps). Tiles other than a CTA's first two and last.
With --tma, the stamps of dev/patches/attn_bwd_dq_buffer_tma_probe.patch (attn_bwd_dq_buffer_tma.patch's
kernel): the same consumer slots; the producer's slots are its adder thread's turn (0-4) and its TMA
issuer's waits (5-8: before and after the q_empty, do_empty and g_empty waits of the turn that loads
tile t + 1; MXFP8 inputs only).
Usage: PYTHONPATH=<probe build>/python python3 dev/bench/attn_bwd_dq_buffer_phases.py [--tma]"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_bwd_phases import HEADS, KB, backward_calls, stamps  # noqa: E402  (the same probe file layout)

CN = ["wait Q,dO", "S issue+wait", "P math", "wait p_free", "store P, fence, WG bar", "issue dV, wait dP",
      "dS math", "store dS, pair bar", "wait g_full", "issue dQ dK, wait dV dQ", "do_empty, pair bar",
      "wait dq_empty", "dq stage+fence+arrive", "wait dK", "loop"]
# producer: (name, first slot, last slot) of each phase; a phase ending at slot -1 ends at the next turn's first slot
PN = [("wait dq_full", 0, 1), ("add_tile issue", 1, 2), ("wait read P (p_free)", 2, 3),
      ("wait read rest (dq_empty)", 3, 4), ("wait q_empty", 4, 5), ("load Q landed", 5, 6), ("wait do_empty", 6, 7),
      ("load dO landed", 7, 8), ("wait g_empty", 8, 9), ("load Qg landed", 9, 10), ("rest/loop", 10, -1)]
PN_TMA = [("adder: wait dq_full", 0, 1), ("adder: add_tile issue", 1, 2), ("adder: wait read P (p_free)", 2, 3),
          ("adder: wait read rest (dq_empty)", 3, 4), ("adder: loop", 4, -1), ("issuer: wait q_empty", 5, 6),
          ("issuer: Q issue, wait do_empty", 6, 7), ("issuer: dO issue, wait g_empty", 7, 8)]


def run(label, fn, pn):
    a = stamps(fn)
    rows = {0: [], 1: [], 2: []}
    need = sorted({i for _, i, j in pn} | {j for _, i, j in pn if j >= 0})
    for h in range(HEADS):
        for kb in range(KB):
            for r in (0, 1, 2):
                st = a[h, kb, r]
                n = int(np.count_nonzero(st[:, 0]))
                if n < 4:
                    continue
                for t in range(2, n - 1):
                    if r == 0:
                        x = st[t]
                        if np.any(x[need] == 0):
                            continue
                        d = [(x[j] if j >= 0 else st[t + 1, 0]) - x[i] for _, i, j in pn]
                    else:
                        x = st[t][:15].copy()
                        if np.any(x == 0):
                            continue
                        d = np.append(np.diff(x), st[t + 1, 0] - x[-1])
                    rows[r].append(np.append(d, st[t + 1, 0] - st[t, 0]))
    print(f"== {label}")
    m1, m2 = np.mean(rows[1], axis=0), np.mean(rows[2], axis=0)
    for i, nm in enumerate(CN):
        print(f"  c {nm:32s} {m1[i]:8.0f} {m2[i]:8.0f}")
    print(f"  c period {m1[-1]:.0f} {m2[-1]:.0f}")
    if rows[0]:
        m0 = np.mean(rows[0], axis=0)
        for i, (nm, _, _) in enumerate(pn):
            print(f"  p {nm:32s} {m0[i]:8.0f}")
        print(f"  p period {m0[-1]:.0f} ({len(rows[0])} tiles)")


def main():
    pn = PN_TMA if "--tma" in sys.argv[1:] else PN
    for label, fn in backward_calls(128, 4096):
        run(label, fn, pn)


if __name__ == "__main__":
    main()
