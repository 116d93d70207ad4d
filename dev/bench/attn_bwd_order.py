"""The attention backward's dispatch order: MXMLA_ATTN_BWD_ORDER_G against the heads one after another,
alternating in one process, MXFP8 inputs (the groups of KV heads as the launcher makes them)."""
import os, statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path("bench").resolve())); sys.path.insert(0, str(Path("dev/bench").resolve()))
from timing import flush_buffer, timer
from parts import attention_inputs
import mxmla
dev = torch.device("cuda"); flush = flush_buffer(dev); scale = mxmla.yarn_softmax_scale()
for S in [int(x) for x in sys.argv[1].split(",")]:
    t = attention_inputs(S, dev, backward=True, scale=scale)
    q8, k8, v8, o, lse, do = (t[n] for n in ("q8", "k8", "v8", "o", "lse", "do")); del t
    res = {}
    for rnd in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
        for g in sys.argv[2].split(","):
            os.environ["MXMLA_ATTN_BWD_ORDER_G"] = g if g != "def" else ""
            ms = timer(lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale), 20, flush)
            res.setdefault(g, []).append(ms)
    med = {g: statistics.median(v) for g, v in res.items()}
    print(S, " ".join(f"G{g}: {m:.4f} ({m / med['1']:.4f}; {min(res[g]):.4f}-{max(res[g]):.4f})" for g, m in med.items()),
          flush=True)
    del q8, k8, v8, o, lse, do; torch.cuda.empty_cache()
