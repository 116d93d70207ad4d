#!/usr/bin/env python3
"""One call of each RoPE kernel on bf16 [16384, 128, 192] (thd, fp32 tables), for Nsight Compute:
   ncu --clock-control none -k regex:sm90_rope python3 dev/bench/profile_rope.py"""
import torch

import mxmla

T, H, D = 16384, 128, 192
x = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
c, s = mxmla.rope_tables(torch.arange(T, device="cuda"), yarn="deepseek_v3")
y = torch.empty_like(x)
mxmla.apply_rope(x, c, s, layout="thd", out=y)
mxmla.rope_backward(x, c, s, layout="thd", out=y)
mxmla.rope_backward_quantize(x, c, s, layout="thd")
torch.cuda.synchronize()
