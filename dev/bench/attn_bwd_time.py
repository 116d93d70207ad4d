"""Timing of the attention backward's CUDA path (src/cuda/sm90_attention_bwd.cu at these head dims;
deterministic=True: the same kernel, its dQ sums in a fixed order; MXMLA_ATTN_BWD=simt: the
CUDA-core kernel) against cuDNN's bf16 SDPA backward (torch, cuDNN backend) and, when installed
(dev/scripts/fa4-install), FlashAttention-4's SM90 backward on the dequantized inputs, same run:
DeepSeek-V3 head dims (192 / 128), causal, bshd, b 1, H heads, s tokens. TFLOP/s on the causal
triangle, 2·(3·d_qk + 2·d_v) per causal element; medians, L2 flushed (bench/timing.py). A second
table times forward + backward: ours (mxmla.attention on the MXFP8 tensors, then the backward)
against each peer's forward and backward on the dequantized inputs (TFLOP/s with the forward's
2·(d_qk + d_v) per causal element added). A third table gives the floor of the design (a bf16
kernel on copies that one pass converts from the FP8 codes) against the faster peer: that peer's
time over itself plus a device copy of the bytes the conversions move (1 read and 2 written per
value: the backward's Q and K in both directions and V rowwise; with the forward, K and V once
more), timed in the same run. With --exp09=BINARY (dev/cuda/09_sm90_bwd_smem_floor, built for this GPU),
a fourth table gives the floor of the tiling: experiment 09's time a tile for the tile's GEMMs and
memory traffic overlapped freely (MXFP8 inputs, copies by bulk copies), times the tiles an SM walks,
plus the call's other kernels (the conversion pass, D, the accumulator's zeroing, dQ's rounding) as
torch.profiler times them in the same run, against the faster peer.
Usage: PYTHONPATH=<build>/python python3 dev/bench/attn_bwd_time.py [H] [s ...] [--exp09=BINARY]
       (default 16, 2048)"""
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from timing import flush_buffer, timer  # noqa: E402

import mxmla  # noqa: E402
from attn_fwd import load_fa4  # noqa: E402
from parts import conversion_copy_time as copy_time  # noqa: E402  (dev/bench, this script's folder)
from parts import kernel_times  # noqa: E402

EXP09_ROWS = {  # experiment 09's rows (the mix's name starts with these), its "ns a tile" column
    "mxfp8": "gemms + the tile's other traffic, MXFP8 inputs, copies by bulk copies (TMA)",
    "n96": "n96 gemms + the tile's other traffic, MXFP8 inputs, copies by bulk copies",
}


def exp09_ns(binary):
    """{row key: ns a tile} from one run of experiment 09."""
    out = subprocess.run([binary], check=True, capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for key, name in EXP09_ROWS.items():
            if len(cells) >= 3 and cells[0].startswith(name):
                got[key] = float(cells[2])
    missing = set(EXP09_ROWS) - set(got)
    if missing:
        raise SystemExit(f"attn_bwd_time.py: experiment 09 printed no row for {sorted(missing)}:\n{out}")
    return got


def causal_tiles(s, H):
    """Tiles (64 query rows x 96 keys) the SM90 kernel walks: causal, s_q = s_kv, every head."""
    n = 0
    for j in range((s + 95) // 96):
        i_begin = j * 96 // 64 * 64
        n += (s - i_begin + 63) // 64
    return n * H


def main():
    exp09 = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--exp09=")), None)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    H = int(args[0]) if args else 16
    seqs = [int(x) for x in args[1:]] or [2048]
    floors = []  # the tiling's floor rows
    flush = flush_buffer(torch.device("cuda"))
    scale = mxmla.yarn_softmax_scale()
    fa4, fa4_error = load_fa4()
    print(f"{'s':>6s} {'H':>4s} {'ours ms':>9s} {'TFLOP/s':>8s} {'det. ms':>9s} {'TFLOP/s':>8s} {'cuDNN ms':>9s} "
          f"{'TFLOP/s':>8s} {'ours/cuDNN':>10s} {'det./cuDNN':>10s} {'bf16-in ms':>10s} {'TFLOP/s':>8s} "
          f"{'FA4 ms':>8s} {'TFLOP/s':>8s} {'ours/FA4':>8s} {'FA4 det.':>8s} {'det./FA4det.':>12s}")
    both = []  # forward + backward rows
    copies = []  # the floor's rows
    for s in seqs:
        q, k = (torch.randn(1, s, H, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, s, H, 128, device="cuda", dtype=torch.bfloat16)
        q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
        o, lse = mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale, return_lse=True)
        do = torch.randn_like(o)
        t_ours = timer(lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale), 5,
                       flush)
        qb, kb, vb = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape) for t in (q8, k8, v8))
        t_bf16 = timer(lambda: mxmla.attention_backward(do, qb, kb, vb, o, lse, causal=True, softmax_scale=scale,
                                                        layout="bshd"), 5,
                       flush)
        t_det = timer(lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True, softmax_scale=scale,
                                                       deterministic=True), 5, flush)
        qd, kd, vd = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape).transpose(1, 2).detach()
                      .requires_grad_() for t in (q8, k8, v8))
        try:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                od = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            dod = do.transpose(1, 2)
            t_cudnn = timer(lambda: torch.autograd.grad(od, (qd, kd, vd), dod, retain_graph=True), 20, flush)
        except RuntimeError as e:  # no cuDNN SDPA for these dims in this torch
            print(f"cuDNN SDPA backward not available: {str(e).splitlines()[0]}")
            t_cudnn = float("nan")
        # forward + backward: each forward builds its graph; the backward of it, in the same timed call
        def ours_both():
            o_, lse_ = mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale, return_lse=True)
            return mxmla.attention_backward(do, q8, k8, v8, o_, lse_, causal=True, softmax_scale=scale)

        def cudnn_both():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                o_ = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            return torch.autograd.grad(o_, (qd, kd, vd), do.transpose(1, 2))

        t_ours_both = timer(ours_both, 5, flush)
        t_cudnn_both = timer(cudnn_both, 5, flush) if t_cudnn == t_cudnn else float("nan")
        t_fa4 = t_fa4_both = t_fa4_det = float("nan")
        if fa4 is not None:  # bshd views of the same dequantized values
            qf, kf, vf = (t.detach().transpose(1, 2).requires_grad_() for t in (qd, kd, vd))

            def fa4_fwd(det=False):
                r = fa4(qf, kf, vf, softmax_scale=scale, causal=True, deterministic=det)
                return r[0] if isinstance(r, (tuple, list)) else r

            of = fa4_fwd()
            t_fa4 = timer(lambda: torch.autograd.grad(of, (qf, kf, vf), do, retain_graph=True), 20, flush)
            of_det = fa4_fwd(True)
            t_fa4_det = timer(lambda: torch.autograd.grad(of_det, (qf, kf, vf), do, retain_graph=True), 20, flush)
            t_fa4_both = timer(lambda: torch.autograd.grad(fa4_fwd(), (qf, kf, vf), do), 5, flush)
        flops = 2.0 * (3 * 192 + 2 * 128) * H * s * s / 2
        tf = lambda t: flops / t * 1e-9  # noqa: E731
        print(f"{s:6d} {H:4d} {t_ours:9.3f} {tf(t_ours):8.1f} {t_det:9.3f} {tf(t_det):8.1f} {t_cudnn:9.3f} "
              f"{tf(t_cudnn):8.1f} {t_cudnn / t_ours:10.3f} {t_cudnn / t_det:10.3f} {t_bf16:10.3f} {tf(t_bf16):8.1f} "
              f"{t_fa4:8.3f} {tf(t_fa4):8.1f} {t_fa4 / t_ours:8.3f} {t_fa4_det:8.3f} {t_fa4_det / t_det:12.3f}")
        both.append((s, t_ours_both, t_cudnn_both, t_fa4_both, 2.0 * (4 * 192 + 3 * 128) * H * s * s / 2))
        copies.append((s, copy_time(s * H * (4 * 192 + 128), flush), copy_time(s * H * (192 + 128), flush),
                       t_ours, t_cudnn, t_fa4, t_ours_both, t_cudnn_both, t_fa4_both))
        if exp09:  # the call's kernels other than the main one, by torch.profiler (medians, per call)
            per = kernel_times(lambda: mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True,
                                                                softmax_scale=scale), 10, flush)
            main_ms = sum(statistics.median(ts) * len(ts) / 10 for n, ts in per.items() if "bwd_sm90" in n)
            other_ms = sum(statistics.median(ts) * len(ts) / 10 for n, ts in per.items() if "bwd_sm90" not in n)
            floors.append((s, main_ms, other_ms, t_ours, min((t for t in (t_cudnn, t_fa4) if t == t),
                                                             default=float("nan"))))
    print("forward + backward (ours: MXFP8 Q, K, V; peers: bf16 on the dequantized inputs)")
    print(f"{'s':>6s} {'ours ms':>9s} {'TFLOP/s':>8s} {'cuDNN ms':>9s} {'TFLOP/s':>8s} {'FA4 ms':>8s} {'TFLOP/s':>8s} "
          f"{'ours/best peer':>14s}")
    for s, t_o, t_c, t_f, fl in both:
        best = min(t for t in (t_c, t_f) if t == t) if (t_c == t_c or t_f == t_f) else float("nan")
        print(f"{s:6d} {t_o:9.3f} {fl / t_o * 1e-9:8.1f} {t_c:9.3f} {fl / t_c * 1e-9:8.1f} {t_f:8.3f} "
              f"{fl / t_f * 1e-9:8.1f} {best / t_o:14.3f}")
    print("floor of the design: faster peer / (faster peer + copy of the conversions' bytes); measured: ours / faster peer")
    print(f"{'s':>6s} {'bwd copy ms':>11s} {'fwd copy ms':>11s} {'bwd floor':>9s} {'bwd ours':>8s} {'f+b floor':>9s} "
          f"{'f+b ours':>8s}")
    for s, c_b, c_f, t_o, t_c, t_f, t_ob, t_cb, t_fb in copies:
        best = min((t for t in (t_c, t_f) if t == t), default=float("nan"))
        best_b = min((t for t in (t_cb, t_fb) if t == t), default=float("nan"))
        print(f"{s:6d} {c_b:11.3f} {c_f:11.3f} {best / (best + c_b):9.3f} {best / t_o:8.3f} "
              f"{best_b / (best_b + c_b + c_f):9.3f} {best_b / t_ob:8.3f}")
    if floors:
        ns = exp09_ns(exp09)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print("floor of the tiling (experiment 09: a tile's GEMMs and memory traffic overlapped freely, MXFP8 inputs, "
              f"{ns['mxfp8']:.1f} ns a tile; A tiles read once (n96): {ns['n96']:.1f} ns), tiles / {sms} SMs, "
              "plus the call's other kernels; against the faster peer")
        print(f"{'s':>6s} {'tiles/SM':>9s} {'main ms':>8s} {'floor':>7s} {'other ms':>8s} {'call ms':>8s} "
              f"{'floor':>7s} {'n96 fl.':>7s} {'peer ms':>8s} {'ours/peer':>9s} {'floor/peer':>10s} {'n96/peer':>8s}")
        for s, main_ms, other_ms, t_o, best in floors:
            per_sm = causal_tiles(s, H) / sms
            fl, fl96 = per_sm * ns["mxfp8"] * 1e-6, per_sm * ns["n96"] * 1e-6
            print(f"{s:6d} {per_sm:9.1f} {main_ms:8.3f} {fl:7.3f} {other_ms:8.3f} {t_o:8.3f} {fl + other_ms:7.3f} "
                  f"{fl96 + other_ms:7.3f} {best:8.3f} {best / t_o:9.3f} {best / (fl + other_ms):10.3f} "
                  f"{best / (fl96 + other_ms):8.3f}")
    if fa4 is None:
        print(f"FA4: skipped: {fa4_error}")


if __name__ == "__main__":
    main()
