#!/usr/bin/env python3
"""One call of each quantize variant on bf16 [16384, 24576], for Nsight Compute:
   ncu --clock-control none -k regex:sm90_mxfp8 python3 dev/bench/profile_quantize.py"""
import torch

import mxmla

x = torch.randn(16384, 24576, device="cuda", dtype=torch.bfloat16)
mxmla.quantize(x)  # both
mxmla.quantize(x, columnwise=False)  # rowwise only
torch.cuda.synchronize()
