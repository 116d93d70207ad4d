"""FlashAttention-4's SM90 forward / backward (flash_attn.cute 4.0.0b36) compiled for sm_90a on a
machine without a GPU, for SASS comparisons with our kernels (dev/scripts/fa4-sass runs this in a
Python 3.12 venv of the staged wheels; PTX and cubins land in CUTE_DSL_DUMP_DIR).

Usage: python fa4_compile.py [fwd|bwd|both]
FA4's interface has a "fake mode": under torch's FakeTensorMode it picks its configuration and runs
cute.compile but launches nothing. FLASH_ATTENTION_ARCH picks the kernel, CUTE_DSL_ARCH the
compile target, CUTE_DSL_KEEP=ptx,cubin + CUTE_DSL_DUMP_DIR keep what CuTe DSL's own ptxas made.
Shape: DeepSeek-V3's, bf16, b 1, s 4096, 128 heads, d 192 / 128, causal. The configuration FA4
chose is printed."""
import json
import os
import sys
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
os.environ.setdefault("CUTE_DSL_KEEP", "ptx,cubin")   # "sass" needs nvdisasm>=13.4, not present
os.environ.setdefault("CUTE_DSL_DUMP_DIR", "/tmp/fa4sass/dump")
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import cutlass.cute as cute
from flash_attn.cute import interface

# Record every kernel object passed to cute.compile, to report the config FA4 chose.
_orig_compile = cute.compile
compiled_objs = []
def _rec_compile(*args, **kw):
    r = _orig_compile(*args, **kw)
    compiled_objs.append(args[0])  # object is fully set up after compile (__call__ ran)
    return r
cute.compile = _rec_compile

KEYS = ["dtype", "tile_hdim", "tile_hdimv", "tile_m", "tile_n", "num_stages", "num_threads",
        "num_mma_threads", "num_wg_mma", "num_producer_threads", "num_mma_regs", "num_producer_regs",
        "intra_wg_overlap", "mma_pv_is_rs", "use_scheduler_barrier", "use_tma_Q", "use_tma_O",
        "use_tma_KV", "rescale_O_before_gemm", "Q_in_regs", "pack_gqa", "is_causal", "is_local",
        "qhead_per_kvhead", "q_subtile_factor",
        # bwd
        "num_stages_Q", "num_stages_dO", "num_stages_PdS", "SdP_swapAB", "dKV_swapAB", "dQ_swapAB",
        "AtomLayoutMSdP", "AtomLayoutNdKV", "AtomLayoutMdQ", "num_wg", "dQ_single_wg",
        "num_mma_warp_groups", "num_threads_per_warp_group", "Mma_dKV_is_RS", "Mma_dQ_is_RS", "is_persistent", "shuffle_LSE", "shuffle_dPsum",
        "ptxas_options", "cluster_shape_mn"]

def dump_cfg(tag):
    for o in compiled_objs:
        d = {k: str(getattr(o, k)) for k in KEYS if hasattr(o, k)}
        extra = {k: str(v) for k, v in vars(o).items()
                 if k not in d and isinstance(v, (int, bool, float, str, tuple)) and not k.startswith("_")}
        print(f"[{tag}] {type(o).__name__}:", json.dumps(d, indent=1))
        print(f"[{tag}] {type(o).__name__} other scalar attrs:", json.dumps(extra, indent=1))
    compiled_objs.clear()

what = sys.argv[1] if len(sys.argv) > 1 else "fwd"
B, S, H, HKV, D, DV = 1, 4096, 128, 128, 192, 128
dt = torch.bfloat16

with FakeTensorMode():
    q = torch.empty(B, S, H, D, dtype=dt, device="cuda")
    k = torch.empty(B, S, HKV, D, dtype=dt, device="cuda")
    v = torch.empty(B, S, HKV, DV, dtype=dt, device="cuda")
    if what in ("fwd", "both"):
        interface._flash_attn_fwd(q, k, v, causal=True, return_lse=True)
        dump_cfg("fwd")
    if what in ("bwd", "both"):
        out = torch.empty(B, S, H, DV, dtype=dt, device="cuda")
        dout = torch.empty(B, S, H, DV, dtype=dt, device="cuda")
        lse = torch.empty(B, H, S, dtype=torch.float32, device="cuda")
        interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=True)
        dump_cfg("bwd")
