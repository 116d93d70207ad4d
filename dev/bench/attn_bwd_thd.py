#!/usr/bin/env python3
"""The attention backward on packed sequences (thd): DeepSeek-V3 dims (h 128, d_qk 192, d_v 128),
causal, the sequences of dev/bench/attn_fwd_thd.py packed into one [t, h, d] tensor with cu_seqlens,
bf16 N(0, 1) inputs quantized token-major by mxmla.quantize on [t, h·d] (E4M3, compact scales),
codes viewed [t, h, d]; O and LSE from mxmla.attention on them. Per case: the call's time (CUDA
events, L2 flushed before each call, median; bench/timing.py) and the GPU time of its conversion
passes under torch.profiler (mean of 5 calls; dev/bench/parts.py); --parts prints every kernel (medians).
Cases: Q and K with both copies (the backward's default reads), and rowwise copies only (then they
serve every GEMM); the calls pass max_seqlen_q / max_seqlen_kv (cu_seqlens read on the device only),
and the first case is timed again without them (cu_seqlens copied to the host: a stream
synchronization inside the call). MXMLA_ATTN_BWD_GROUPS in the environment sets the backward's
groups of KV heads.
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_bwd_thd.py [--parts] [LEN ...]"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import flush_buffer, timer  # noqa: E402
from parts import kernel_times, packed_sequences, print_kernels  # noqa: E402

import mxmla  # noqa: E402

H, D_QK, D_V = 128, 192, 128


def main() -> int:
    dev = torch.device("cuda")
    lens, t, cu, q, k, v = packed_sequences(sys.argv[1:], dev, H, D_QK, D_V)

    def quant(x, both):  # token-major [t, h*d], codes viewed [t, h, d]
        m = mxmla.quantize(x.reshape(t, -1), rowwise=True, columnwise=both)
        col = m.columnwise_data.reshape(x.shape) if both else None
        return mxmla.MXFP8Tensor(m.shape, m.fp8_format, m.scale_layout, m.rowwise_data.reshape(x.shape),
                                 m.rowwise_scale_inv, col, m.columnwise_scale_inv if both else None)

    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens), causal=True)
    flush = flush_buffer(dev)
    print(f"thd backward: {len(lens)} sequences {lens}, {t} tokens, h {H}, d_qk {D_QK}, d_v {D_V}, causal")
    for both in (True, False):
        name = "Q, K both copies" if both else "Q, K rowwise only"
        q8, k8, v8 = quant(q, both), quant(k, both), quant(v, True)  # V: the forward reads its columnwise copy
        o, lse = mxmla.attention(q8, k8, v8, return_lse=True, **kw)
        do = torch.randn_like(o)
        fn = lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, **kw)  # noqa: E731
        per = kernel_times(fn, 5, flush)
        if "--parts" in sys.argv:
            print_kernels(f"  {name}:", per, 5)
        passes = sum(sum(ts) / 5 for n, ts in per.items() if "attn_stage" in n)  # mean per call
        print(f"{name:18s} call {timer(fn, 10, flush):8.3f} ms; conversion passes {passes:.3f} ms")
        if both:  # the same call without the bounds: the backward copies cu_seqlens to the host
            host = {x: y for x, y in kw.items() if not x.startswith("max_seqlen")}
            fn_host = lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, **host)  # noqa: E731
            print(f"{'  without bounds':18s} call {timer(fn_host, 10, flush):8.3f} ms (cu_seqlens copied to the host)")
        del q8, k8, v8, o, lse, do
    return 0


if __name__ == "__main__":
    sys.exit(main())
