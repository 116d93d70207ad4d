"""Times the attention backward of several builds of the Python module in turn (one subprocess per
build and round, 3 rounds; medians over rounds): DeepSeek-V3 head dims 192 / 128, causal, bshd,
b 1, h 128, MXFP8 Q, K, V (both copies of Q, K) and their dequantized bf16 tensors.
Usage: python3 dev/bench/attn_bwd_ablate.py BUILD_PYTHON_DIR ..."""
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from timing import flush_buffer, timer
import mxmla
flush = flush_buffer(torch.device("cuda"))
scale = mxmla.yarn_softmax_scale()
res = {}
for s in (4096, 8192):
    torch.manual_seed(0)
    q, k = (torch.randn(1, s, 128, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, s, 128, 128, device="cuda", dtype=torch.bfloat16)
    q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
    o, lse = mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale, return_lse=True)
    do = torch.randn_like(o)
    qb, kb, vb = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape) for t in (q8, k8, v8))
    res[f"mxfp8 {s}"] = timer(lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True,
                                                              softmax_scale=scale), 7, flush)
    res[f"bf16 {s}"] = timer(lambda: mxmla.attention_backward(do, qb, kb, vb, o, lse, causal=True,
                                                             softmax_scale=scale, layout="bshd"), 7, flush)
print(json.dumps(res))
"""


def main():
    builds = sys.argv[1:]
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
    times = {b: [] for b in builds}
    for _ in range(3):
        for b in builds:
            env = dict(os.environ, PYTHONPATH=b)
            out = subprocess.run([sys.executable, "-c", CHILD, b, bench], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(b, "failed:", out.stderr[-2000:])
                continue
            times[b].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = builds[0]
    for b in builds:
        if not times[b]:
            continue
        line = [os.path.basename(b)]
        for key in times[b][0]:
            s = int(key.split()[1])
            ms = statistics.median(t[key] for t in times[b])
            ref = statistics.median(t[key] for t in times[base]) if times[base] else float("nan")
            tf = 2.0 * (3 * 192 + 2 * 128) * 128 * s * s / 2 / ms * 1e-9
            line.append(f"{key}: {ms:.3f} ms {tf:.0f} TF/s ({ms / ref:.3f})")
        print(" | ".join(line))


if __name__ == "__main__":
    main()
