#!/usr/bin/env python3
"""Where one training step of examples/train_mla.py's model goes, per recipe: the GPU defaults
(4 blocks, hidden 512, 8 heads, 32 x 512 bytes a step, seed 0; MXFP8-friendly MLA dims shared by
the recipes), AdamW. 10 warm-up steps; the wall time of the next 10 (host and GPU together); then 5
steps under torch.profiler: kernels a step, their GPU time a step, the CUDA runtime calls a step and
their host time, and the ops with the most host time. A step whose wall time is well above its
kernels' time is host-bound.
Usage: PYTHONPATH=<build>/python python3 dev/bench/train_step_profile.py [--text-file FILE] [RECIPE ...]
(default recipes: mxfp8 bf16; the corpus: train_mla.py's, Debian's python3-doc unless --text-file)"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_mla as t  # noqa: E402

RUNTIME_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMallocAsync", "cudaFreeAsync",
                 "cudaMemsetAsync", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                 "cudaFuncSetAttribute", "cudaDeviceGetAttribute", "cudaPointerGetAttributes")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text-file", default=None)
    ap.add_argument("recipes", nargs="*", default=["mxfp8", "bf16"])
    a = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        print("train_step_profile.py: no CUDA device visible; nothing to profile")
        return 0
    cfg = dict(t.GPU_CONFIG)
    data, desc, _ = t.load_corpus(a.text_file)
    train, _ = t.split_corpus(data, cfg["seq"])
    print(f"corpus: {desc}")
    for recipe in a.recipes:
        dims = t.mla_dims(cfg, ["bf16", "mxfp8"], "cuda")
        model = t.build_model(recipe, cfg, 0, "cuda", dims)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        offs = t.batch_offsets(len(train), cfg["seq"], cfg["batch"], 25, 0)

        def step(i: int) -> None:
            x, y = t.windows(train, offs[i], cfg["seq"])
            loss = model.loss(x.to("cuda"), y.to("cuda"))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for i in range(10):
            step(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(10, 20):
            step(i)
        torch.cuda.synchronize()
        print(f"{recipe}: {(time.perf_counter() - t0) / 10 * 1e3:.2f} ms per step (wall)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(20, 25):
                step(i)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        gpu = [e for e in ka if e.device_type.name == "CUDA"]
        print(f"{recipe}: kernels per step {sum(e.count for e in gpu) / 5:.0f}, "
              f"GPU time per step {sum(e.self_device_time_total for e in gpu) / 5 / 1e3:.2f} ms")
        for name in RUNTIME_CALLS:
            for e in ka:
                if e.key == name:
                    print(f"  {name:28s} calls/step {e.count / 5:7.1f}  host ms/step {e.cpu_time_total / 5 / 1e3:7.2f}")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
