"""What the parts scripts (attn_fwd_parts.py, attn_bwd_parts.py, gemm_parts.py) and ab_kernels.py
share: per-kernel GPU times of a call under torch.profiler, their printout, and the DeepSeek-V3
attention inputs (b 1, h 128, d_qk 192, d_v 128, bshd, MXFP8 from quantize_attention and their
dequantized bf16 tensors); and (the phase scripts attn_bwd_phases.py, attn_fwd_tiles.py) a probe
build's clock64 stamps of one call."""
from __future__ import annotations

import os
import statistics
import tempfile
from collections import defaultdict

import torch

import mxmla
from timing import timer


def probe_stamps(fn, env: str, count: int):
    """fn run once to warm up, then once with the environment variable `env` naming a file: the first
    `count` uint64 stamps that a probe build's launcher appended to it, as int64 (a 1-D numpy array)."""
    import numpy as np

    with tempfile.NamedTemporaryFile(suffix=".probe", delete=False) as f:  # (the launcher appends to it)
        path = f.name
    fn()
    torch.cuda.synchronize()
    os.environ[env] = path
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        del os.environ[env]
    raw = np.fromfile(path, dtype=np.uint64)
    os.unlink(path)
    if raw.size < count:
        raise SystemExit(f"no stamps in {env}'s file (is this the probe build?)")
    return raw[:count].astype(np.int64)


def profiled_calls(fn, iters, flush):
    """The GPU events (kernels, memsets, copies) of `iters` calls of fn under torch.profiler, in start
    order, after two warm-up calls; before each call the L2 flush (a uint8 fill of `flush`) and a
    GPU sleep (a spin kernel), which mark where each call begins."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            flush.fill_(i & 0xFF)
            torch.cuda._sleep(2_000_000)
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def kernel_times(fn, iters, flush):
    """{kernel name, or "name #k" for its k-th launch in a call (k > 1): [GPU ms of each call]} over
    `iters` calls, L2 flushed before each (the flush's fill and the sleep kernels left out)."""
    per = defaultdict(list)
    seen = defaultdict(int)  # launches of each kernel since the call began (a spin kernel starts each)
    for ev in profiled_calls(fn, iters, flush):
        name = ev.name
        if "fill" in name or "elementwise_kernel" in name:
            continue
        if "spin_kernel" in name or "sleep" in name.lower():
            seen.clear()
            continue
        seen[name] += 1
        key = name if seen[name] == 1 else f"{name} #{seen[name]}"
        per[key].append(ev.device_time / 1000.0 if hasattr(ev, "device_time") else ev.cuda_time / 1000.0)
    return per


def print_kernels(label: str, per, iters: int) -> float:
    """One line per kernel (short name, launch number, median ms, launches per call), longest first;
    returns the sum of the medians weighted by launches per call."""
    total = 0.0
    for kname, ts in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
        m = statistics.median(ts)
        total += m * len(ts) / iters
        base = kname.replace("(anonymous namespace)::", "").split("(")[0].replace("void ", "")
        short = base.split("<")[0].split("::")[-1] + ("<" + base.split("<", 1)[1][:12] if "<" in base else "")
        tag = kname.rsplit(" #", 1)[1] if " #" in kname else "1"
        print(f"{label} {short[:40] + ' #' + tag:46s} {m:8.4f} x{len(ts) / iters:g}")
    return total


def attention_inputs(S: int, dev, backward: bool = False, scale=None):
    """MXFP8 q8, k8, v8 of bf16 N(0, 1) [1, S, 128, 192 / 128] and their dequantized bf16 tensors
    (qb, kb, vb); with backward, also o, lse of the causal MXFP8 forward and a random do."""
    q, k = (torch.randn(1, S, 128, 192, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, S, 128, 128, device=dev, dtype=torch.bfloat16)
    q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
    del q, k, v
    qb, kb, vb = (mxmla.dequantize(t, "bfloat16").view(t.rowwise_data.shape) for t in (q8, k8, v8))
    out = {"q8": q8, "k8": k8, "v8": v8, "qb": qb, "kb": kb, "vb": vb}
    if backward:
        o, lse = mxmla.attention(q8, k8, v8, causal=True, softmax_scale=scale, return_lse=True)
        out.update(o=o, lse=lse, do=torch.randn_like(o))
    return out


PACKED_LENS = [4096, 2048, 1024, 3000, 512, 4096, 1500, 200]  # attn_fwd_thd.py / attn_bwd_thd.py (16 476 tokens)


def packed_sequences(argv, dev, h=128, d_qk=192, d_v=128):
    """Packed (thd) attention inputs for the thd benches: sequence lengths from argv's numbers (default
    PACKED_LENS), their int32 cu_seqlens on dev, and bf16 N(0, 1) q, k [t, h, d_qk], v [t, h, d_v]
    (one generator, seed 7). Returns (lens, t, cu, q, k, v)."""
    lens = [int(a) for a in argv if not a.startswith("--")] or list(PACKED_LENS)
    t = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(7)
    q, k = (torch.randn(t, h, d_qk, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(t, h, d_v, device=dev, dtype=torch.bfloat16, generator=g)
    return lens, t, cu, q, k, v


def packed_fwd_mxfp8(x, rowwise, swizzle=False):
    """The attention forward's packed operand: x [t, h, d] bf16 quantized token-major by mxmla.quantize
    on [t, h·d] (rowwise: Q, K; columnwise, its blocks along the packed tokens: V), the codes viewed
    [t, h, d]. Returns (the MXFP8Tensor, a function that dequantizes it to bf16 [t, h, d])."""
    m = mxmla.quantize(x.reshape(x.shape[0], -1), rowwise=rowwise, columnwise=not rowwise, swizzle=swizzle)
    codes = (m.rowwise_data if rowwise else m.columnwise_data).reshape(x.shape)
    mx3 = mxmla.MXFP8Tensor(m.shape, m.fp8_format, m.scale_layout, codes if rowwise else None,
                            m.rowwise_scale_inv, None if rowwise else codes, m.columnwise_scale_inv)
    return mx3, lambda: mxmla.dequantize(m, torch.bfloat16, columnwise=not rowwise).reshape(x.shape)


def conversion_copy_time(values, flush, dev="cuda"):
    """Median ms of a device-to-device copy of the bytes a conversion of `values` FP8 codes to bf16
    moves (1 read and 2 written per value: 3·values bytes in all), L2 flushed (bench/timing.py)."""
    src = torch.empty(3 * values // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), 20, flush)
    del src, dst
    return t
