"""Where a tile's time goes inside the attention backward's SM90 kernel, by phase: needs the probe
build (dev/patches/attn_bwd_phase_probe.patch applied: clock64 stamps at the phase boundaries of
each tile, one thread per role, the CTAs of the first two KV heads, written to the file that
MXMLA_BWD_PROBE names). Runs one backward call (after warm-up) with MXFP8 inputs and one with bf16
inputs, DeepSeek-V3 head dims, causal, bshd, b 1, H heads, s tokens, and prints the mean cycles of
each phase per tile for both consumers, the tile period, and the producer's lead (how long before a
consumer asks for a stage its copies had landed; negative: the consumer waited).
Usage: PYTHONPATH=<probe build>/python python3 dev/bench/attn_bwd_phases.py [H s]   (default 128 4096)"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import probe_stamps  # noqa: E402

import mxmla  # noqa: E402

HEADS, KB, ROLES, T, S = 2, 128, 3, 64, 24  # the patch's kProbe* constants (slots 16-23: sub-phases)
PHASES = ["wait stage (loads)", "issue S, dP", "wait S", "P math, store P^T", "WG barrier, issue dV", "wait dP",
          "dS math", "issuer: prev. reads, release", "store dS^T, pair barrier", "issue dQ, dK", "wait dV, dQ",
          "pair barrier", "stage dQ, issue reductions", "wait dK", "end barrier", "loop to next tile"]
SUB = [(3, 21), (21, 22), (22, 4), (12, 16), (16, 17), (17, 18), (18, 19), (19, 20), (20, 13)]
SUB_NAMES = ["P math", "store P^T (stmatrix)", "fence", "row index", "dq_stage stores", "fence", "WG barrier",
             "issue 3 reductions", "wait first read"]


def stamps(fn):
    """fn run once to warm up, then once with MXMLA_BWD_PROBE set: the probe build's stamps,
    [head][key block][role][tile][slot] (int64 cycles, 0 where none was written)."""
    return probe_stamps(fn, "MXMLA_BWD_PROBE", HEADS * KB * ROLES * T * S).reshape(HEADS, KB, ROLES, T, S)


def run(label, fn):
    a = stamps(fn)
    rows = {c: [] for c in (1, 2)}
    periods, leads = [], []
    for h in range(HEADS):
        for kb in range(KB):
            for c in (1, 2):
                st = a[h, kb, c]
                n = int(np.count_nonzero(st[:, 0]))
                if n < 4:
                    continue
                for t in range(1, n - 1):  # the first and last tiles of a CTA left out
                    d = np.diff(st[t][:16])
                    d = np.append(d, st[t + 1, 0] - st[t, 15])
                    d = np.append(d, [st[t][j] - st[t][i] for i, j in SUB])
                    rows[c].append(d)
                    if c == 1:
                        periods.append(st[t + 1, 0] - st[t, 0])
                        landed = a[h, kb, 0, t, 2]
                        if landed:
                            leads.append(st[t, 0] - landed)
    print(f"== {label}: {len(periods)} tiles sampled; mean cycles per tile and phase (consumer 0 / consumer 1)")
    m1, m2 = np.mean(rows[1], axis=0), np.mean(rows[2], axis=0)
    for i, name in enumerate(PHASES):
        print(f"  {i:2d} {name:34s} {m1[i]:8.0f} {m2[i]:8.0f}")
    print(f"  tile period (consumer 0): mean {np.mean(periods):.0f}, median {np.median(periods):.0f}")
    for n, (i, j) in enumerate(SUB):
        print(f"     sub: slot {i:2d} -> {j:2d} {SUB_NAMES[n]:26s} {m1[16 + n]:8.0f} {m2[16 + n]:8.0f}")
    if leads:
        lv = np.array(leads)
        print(f"  stage landed before consumer 0 asked: median {np.median(lv):.0f} cycles, "
              f"{np.mean(lv < 0) * 100:.1f} % of tiles late")


def backward_calls(H, s):
    """The two timed calls, (label, fn): the backward on MXFP8 inputs and on their dequantized bf16."""
    scale = mxmla.yarn_softmax_scale()
    torch.manual_seed(0)
    q, k = (torch.randn(1, s, H, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, s, H, 128, device="cuda", dtype=torch.bfloat16)
    q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
    o, lse = mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale, return_lse=True)
    do = torch.randn_like(o)
    qb, kb, vb = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape) for t in (q8, k8, v8))
    return [("MXFP8 in", lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale)),
            ("bf16 in", lambda: mxmla.attention_backward(do, qb, kb, vb, o, lse, causal=True, softmax_scale=scale,
                                                         layout="bshd"))]


def main(report=None):
    """report(label, fn) for both calls at the command line's [H s] (default: this script's run)."""
    H = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    for label, fn in backward_calls(H, s):
        (report or run)(label, fn)


if __name__ == "__main__":
    main()
