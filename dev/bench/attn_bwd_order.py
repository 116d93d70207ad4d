#!/usr/bin/env python3
"""The attention backward's dispatch order (heuristics::attn_bwd_order_heads): mxmla.attention_backward
at DeepSeek-V3 dims (b 1, h 128, 192 / 128, causal, bshd, MXFP8 Q, K, V from quantize_attention, the
KV-head groups as the launcher makes them) at each length S, with the SM90 kernel's CTAs started in
chunks of G heads (MXMLA_ATTN_BWD_ORDER_G, read at every call; "def" the default, 1 the heads one after
another), the settings alternating ROUNDS times in one process (bench/timing.py's timer: L2 flushed,
median of 20 calls each). Prints per S each setting's median over the rounds, its ratio to G 1 and its
range. dK and dV do not depend on the order (dQ's sums run in scheduling order).
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_bwd_order.py 2048,4096,8192 1,def,3 [ROUNDS (3)]"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import flush_buffer, timer  # noqa: E402  (bench/timing.py, the harness's timer)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import attention_inputs  # noqa: E402

import mxmla  # noqa: E402


def main() -> None:
    lengths = [int(x) for x in sys.argv[1].split(",")]
    settings = sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    if "1" not in settings:
        sys.exit("attn_bwd_order.py: the settings must include 1 (the ratios are to it)")
    dev = torch.device("cuda")
    flush = flush_buffer(dev)
    scale = mxmla.yarn_softmax_scale()
    for S in lengths:
        t = attention_inputs(S, dev, backward=True, scale=scale)
        q8, k8, v8, o, lse, do = (t[n] for n in ("q8", "k8", "v8", "o", "lse", "do"))
        del t
        res: dict[str, list[float]] = {}
        for _ in range(rounds):
            for g in settings:
                os.environ["MXMLA_ATTN_BWD_ORDER_G"] = "" if g == "def" else g
                res.setdefault(g, []).append(timer(
                    lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale), 20,
                    flush))
        os.environ.pop("MXMLA_ATTN_BWD_ORDER_G", None)
        med = {g: statistics.median(v) for g, v in res.items()}
        print(S, " ".join(f"G{g}: {m:.4f} ({m / med['1']:.4f}; {min(res[g]):.4f}-{max(res[g]):.4f})"
                          for g, m in med.items()), flush=True)
        del q8, k8, v8, o, lse, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
