"""Config generators: one per public op, each a pure function of (op, seed, profile) -> a JSON-able
dict. `profile` is "cuda" (every draw obeys the CUDA path's rules: alignment, rope_dim % 16,
nope 128 + rope 64 for the fused op, K % 8, same-dtype RoPE outputs, head dim <= 256, ...) or
"any" (the CPU reference's wider domain as well). The data themselves come from the config's
data seed: `materialize(cfg)` rebuilds every input from the config alone.
"""
from __future__ import annotations

import hashlib
import json
import math
import random

import numpy as np

from . import data as D
from . import fp

OPS = (
    "quantize",
    "dequantize",
    "swizzle_scales",
    "unswizzle_scales",
    "quantize_attention",
    "attention_scales_to_bhsd",
    "to_bhsd",
    "apply_rope",
    "rope_backward",
    "rope_backward_quantize",
    "fused_q_uproj_rope_quant",
    "attention",
    "attention_backward",
    "gemm",
)
PROFILES = ("cuda", "any")
DTYPES = ("bfloat16", "float16", "float32")
FMTS = ("e4m3", "e5m2")
STYLES = ("interleaved_in_halves_out", "interleaved", "rotate_half")
DIRS = ((True, False), (False, True), (True, True))


def _rng(op: str, seed: int, profile: str) -> random.Random:
    return random.Random(f"mxmla-fuzz:{op}:{seed}:{profile}")


def _np_rng(r: random.Random) -> np.random.Generator:
    return np.random.default_rng(r.getrandbits(63))


def _align(r: random.Random, cuda: bool, itemsize: int) -> int:
    """Elements per alignment unit of offsets and padded strides: 16 bytes on the CUDA path,
    sometimes a single element otherwise."""
    a16 = max(1, 16 // itemsize)
    return a16 if cuda or r.random() < 0.5 else 1


def _data_opts(r: random.Random, fmt: str, special_hi: float = 0.3) -> dict:
    return dict(
        dist=r.choice(["normal", "normal", "uniform", "int", "pow2"]),
        exp=r.choice(["narrow", "narrow", "wide", "none"]),
        special_rate=r.choice([0.0, 0.02, 0.1, special_hi]),
        orient=r.choice(["row", "col", "mixed"]),
        fmt=fmt,
    )


def _split_leading(r: random.Random, M: int, ndim: int) -> list:
    """M as a product of ndim - 1 leading sizes (some of them 1)."""
    dims = [M]
    while len(dims) < ndim - 1:
        i = r.randrange(len(dims))
        n = dims[i]
        divs = [d for d in range(2, min(n, 64) + 1) if n % d == 0]
        if divs and r.random() < 0.7:
            d = r.choice(divs)
            dims[i:i + 1] = [n // d, d]
        else:
            dims.insert(r.randrange(len(dims) + 1), 1)
    return dims


def _view_json(v: D.View) -> dict:
    return v.to_json()


# ----------------------------------------------------------------------------- quantize
def _plain_shape(r: random.Random, sizes=None) -> tuple:
    size = r.choices(["one", "tail", "medium", "huge", "empty"], sizes or [12, 52, 25, 8, 3])[0]
    if size == "one":
        M, K = 1, 32 * r.randint(1, 40)
    elif size == "tail":
        M, K = r.randint(1, 300), 32 * r.choice([1, 2, 3, 4, 5, 6, 8, 12, 16, 24])
    elif size == "medium":
        M, K = r.randint(300, 2100), 32 * r.randint(1, 12)
    elif size == "huge":
        M, K = r.randint(2 ** 14, 2 ** 17), r.choice([32, 64])
    else:
        M, K = 0, 32 * r.randint(1, 4)
    return size, M, K


def gen_quantize(r: random.Random, cuda: bool) -> dict:
    dtype, fmt = r.choice(DTYPES), r.choice(FMTS)
    rowwise, columnwise = r.choice(DIRS)
    size, M, K = _plain_shape(r)
    ndim = 1 if (M == 1 and r.random() < 0.3) else r.choice([2, 2, 3, 4])
    shape = [K] if ndim == 1 else _split_leading(r, M, ndim) + [K]
    align = _align(r, cuda, fp.ITEMSIZE[dtype])
    g = _np_rng(r)
    pad = r.choice([0, 0, 1, 2, 5])
    view = D.make_view(g, shape, align, pads=[pad] + [0] * (len(shape) - 2), offset_max=r.choice([0, 8]))
    return dict(dtype=dtype, fmt=fmt, rowwise=rowwise, columnwise=columnwise, swizzle=r.random() < 0.5,
                size=size, x_view=_view_json(view), data=_data_opts(r, fmt))


# ----------------------------------------------------------------------------- attention shapes
def _attn_shape(r: random.Random, max_elems: int = 1 << 20) -> tuple:
    size = r.choices(["one", "tail", "long"], [12, 70, 18])[0]
    S = 1 if size == "one" else r.randint(1, 300) if size == "tail" else r.randint(300, 2000)
    B = r.choice([1, 1, 2, 3, 4])
    H = r.choice([1, 1, 2, 3, 4, 5, 8])
    Dh = 32 * r.choice([1, 2, 3, 4, 6, 8])
    while S * B * H * Dh > max_elems:
        if H > 1:
            H //= 2
        elif B > 1:
            B -= 1
        elif Dh % 64 == 0:
            Dh //= 2
        else:
            S //= 2
    return size, S, B, H, Dh


def _attn_view(r: random.Random, g, shape, layout: str, align: int) -> D.View:
    # leading dims (0, 1, 2) from the innermost out; h (2) always innermost with d contiguous
    if layout == "sbhd":  # dims after s contiguous: pad only at s's level
        return D.make_view(g, shape, align, order=[2, 1, 0], pads=[0, 0, r.choice([0, 0, 1, 4])],
                           offset_max=r.choice([0, 8]))
    if r.random() < 0.3:  # bshd view of s-major memory: batches interleaved
        return D.make_view(g, shape, align, order=[2, 0, 1], pads=[0, r.choice([0, 1]), r.choice([0, 1, 3])],
                           offset_max=r.choice([0, 8]))
    return D.make_view(g, shape, align, order=[2, 1, 0], pads=[0, r.choice([0, 0, 2]), r.choice([0, 0, 3])],
                       offset_max=r.choice([0, 8]))


def _attn_tensor(r: random.Random, cuda: bool, max_elems: int = 1 << 20) -> dict:
    layout = r.choice(["sbhd", "bshd"])
    size, S, B, H, Dh = _attn_shape(r, max_elems)
    shape = [S, B, H, Dh] if layout == "sbhd" else [B, S, H, Dh]
    dtype, fmt = r.choice(DTYPES), r.choice(FMTS)
    rowwise, columnwise = r.choice(DIRS)
    align = _align(r, cuda, fp.ITEMSIZE[dtype])
    view = _attn_view(r, _np_rng(r), shape, layout, align)
    return dict(layout=layout, size=size, dtype=dtype, fmt=fmt, rowwise=rowwise, columnwise=columnwise,
                x_view=_view_json(view), data=_data_opts(r, fmt))


def gen_quantize_attention(r: random.Random, cuda: bool) -> dict:
    t = _attn_tensor(r, cuda)
    t["bhsd_scales"] = r.random() < 0.5
    return t


# ----------------------------------------------------------------------------- dequantize
def gen_dequantize(r: random.Random, cuda: bool) -> dict:
    source = r.choice(["plain", "plain", "attention"])
    if source == "plain":
        cfg = gen_quantize(r, cuda)
        # smaller: dequantize is checked per element
        if cfg["size"] == "huge" and r.random() < 0.5:
            return gen_dequantize(r, cuda)
        cfg["scale_layout"] = "swizzled" if cfg.pop("swizzle") else "compact"
    else:
        cfg = _attn_tensor(r, cuda, max_elems=1 << 18)
        cfg["scale_layout"] = r.choice(["compact", "bhsd"])
    cfg["source"] = source
    cfg["bytes"] = r.choice(["quantized", "quantized", "random", "random_scales"])
    cfg["out_dtype"] = r.choice(["float32", "bfloat16"])
    return cfg


# ----------------------------------------------------------------------------- scale re-layouts
def gen_swizzle(r: random.Random, cuda: bool) -> dict:
    size = r.choices(["one", "tail", "medium", "huge"], [10, 55, 27, 8])[0]
    if size == "one":
        M, K = 1, 32 * r.randint(1, 200)
    elif size == "tail":
        M, K = r.randint(1, 700), 32 * r.randint(1, 64)
    elif size == "medium":
        M, K = r.randint(700, 5000), 32 * r.randint(1, 16)
    else:
        M, K = r.randint(2 ** 15, 2 ** 18), 32 * r.randint(1, 4)
    return dict(M=M, K=K, rowwise=r.random() < 0.5, size=size)


def gen_attention_scales_to_bhsd(r: random.Random, cuda: bool) -> dict:
    layout = r.choice(["sbhd", "bshd"])
    size = r.choices(["one", "tail", "long"], [10, 70, 20])[0]
    S = 1 if size == "one" else r.randint(1, 700) if size == "tail" else r.randint(700, 20000)
    B, H = r.choice([1, 1, 2, 3, 4]), r.choice([1, 2, 3, 4, 7, 8, 16])
    Dh = 32 * r.choice([1, 2, 3, 4, 5, 6, 8, 12, 16])
    while S * B * H * Dh > (1 << 22):
        S //= 2
    shape = [S, B, H, Dh] if layout == "sbhd" else [B, S, H, Dh]
    return dict(layout=layout, shape=shape, rowwise=r.random() < 0.5, size=size)


def gen_to_bhsd(r: random.Random, cuda: bool) -> dict:
    n = r.choice([1, 1, 2, 3, 3, 4])
    ts = []
    for _ in range(n):
        t = _attn_tensor(r, cuda, max_elems=1 << 17)
        t["random_scales"] = r.random() < 0.5
        ts.append(t)
    return dict(tensors=ts)


# ----------------------------------------------------------------------------- RoPE
def _rope_dims(r: random.Random, cuda: bool, quant: bool, fast: bool) -> tuple:
    """(head dim, rope_dim)."""
    if fast or r.random() < 0.35:
        return 192, 64
    if quant:  # head dim a multiple of 32 (<= 256 on CUDA)
        Dh = 32 * r.randint(1, 8 if cuda else 10)
        Rs = [x for x in range(16, Dh + 1, 16)] if cuda else [x for x in range(2, Dh + 1, 2)]
        return Dh, r.choice(Rs)
    if cuda:
        R = 16 * r.randint(1, 8)
        return R + 8 * r.choice([0, 0, 1, 2, 3, 4, 8, 16]), R
    R = 2 * r.randint(1, 64)
    return R + r.choice([0, 0, 1, 2, 3, 5, 8, 16, 64, 128]), R


def _rope_common(r: random.Random, cuda: bool, quant: bool) -> dict:
    fast = quant and r.random() < 0.45  # rope_backward_quantize: DeepSeek-V3 bf16 heads of 192 / 64 at one token stride
    layout = r.choice(["sbhd", "bshd", "thd"])
    dtype = "bfloat16" if fast else r.choice(DTYPES)
    Dh, R = _rope_dims(r, cuda, quant, fast)
    if fast or r.random() < 0.4:
        H = r.choice([8, 16, 24, 32, 40, 48, 64]) if r.random() < 0.5 else r.randint(1, 40)
    else:
        H = r.choice([1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 20])
    big = quant and fast and r.random() < 0.2
    if layout == "thd":
        T = r.choice([1, r.randint(1, 64), r.randint(1, 400)]) if not big else r.randint(256, 1100)
        S, B = T, 1
        shape = [T, H, Dh]
    else:
        B = r.choice([1, 1, 2, 3, 4])
        S = r.choice([1, r.randint(1, 64), r.randint(1, 200)]) if not big else r.randint(256, 1100) // B
        shape = [S, B, H, Dh] if layout == "sbhd" else [B, S, H, Dh]
    # keep the CPU side cheap: ~1M elements at most (3M for the fast path's multi-run tiles)
    while np.prod(shape) > ((3 << 20) if big else (1 << 20)) and shape[-2] > 1:
        shape[-2] = max(1, shape[-2] // 2)
    H = shape[-2]
    tokens = S * B
    # table rows
    cu = None
    per_token = False
    if layout == "thd":
        mode = r.choice(["cu", "cu", "none", "per_token"])
        if mode == "cu":
            cu = dict(nseq=r.choice([1, 2, 3, 5, 9, 17]), dtype=r.choice(["int32", "int64"]),
                      device=r.choice(["cpu", "same"]), empty_rate=r.choice([0.0, 0.3, 0.6]))
        per_token = mode == "per_token"
    else:
        per_token = r.random() < 0.25
    style = r.choice(STYLES)
    tab_dtype = r.choice(["float32", "bfloat16"])
    tab_align = _align(r, cuda, fp.ITEMSIZE[tab_dtype])
    g = _np_rng(r)
    # x / dq view: any nesting order of the leading dims, padding anywhere, sometimes a broadcast dim
    ls = [i for i in range(len(shape) - 1)]
    align = _align(r, cuda, fp.ITEMSIZE[dtype])
    view_kind = r.choice(["contiguous", "contiguous", "padded", "permuted", "permuted", "broadcast"])
    if fast and r.random() < 0.6:  # uniform token stride (head / token padding, no permutation): the fast path
        view_kind = r.choice(["contiguous", "padded", "headpad"])
    order = list(reversed(ls))
    pads = [0] * len(ls)
    bcast = ()
    if view_kind == "padded":
        pads = [r.choice([0, 1, 2]) for _ in ls]
    elif view_kind == "headpad":
        pads = [r.choice([1, 2, 4])] + [0] * (len(ls) - 1)
    elif view_kind == "permuted":
        r.shuffle(order)
        pads = [r.choice([0, 0, 1, 3]) for _ in ls]
    elif view_kind == "broadcast":
        cand = [i for i in ls if shape[i] > 1]
        if cand:
            bcast = (r.choice(cand),)
        r.shuffle(order)
    view = D.make_view(g, shape, align, order=order, pads=pads, broadcast=bcast, offset_max=r.choice([0, 4]))
    rows_needed = tokens if per_token else S if cu is None else None  # cu: the longest sequence (materialize)
    extra = 0 if per_token else r.choice([0, 0, 1, 5])
    tab_pad = r.choice([0, 0, 1, 3])
    return dict(layout=layout, dtype=dtype, shape=shape, rope_dim=R, style=style, tables_per_token=per_token,
                cu_seqlens=cu, tab_dtype=tab_dtype, tab_kind=r.choice(["angles", "random", "random"]),
                tab_special=r.choice([0.0, 0.0, 0.0, 0.01]), tab_rows=rows_needed, tab_extra=extra,
                tab_align=tab_align, tab_pad=tab_pad, tab_offset=tab_align * r.choice([0, 0, 1, 3]),
                x_view=_view_json(view), view_kind=view_kind, broadcast=list(bcast),
                data=dict(_data_opts(r, "e4m3", special_hi=0.2), orient="row"), fast_hint=fast,
                size="big" if big else "small")


def gen_rope(r: random.Random, cuda: bool) -> dict:
    cfg = _rope_common(r, cuda, quant=False)
    out = r.choice(["alloc", "alloc", "inplace", "view"])
    if out == "inplace" and cfg["broadcast"]:
        out = "alloc"
    cfg["out"] = out
    cfg["out_dtype"] = cfg["dtype"]
    if out == "view":
        if not cuda and r.random() < 0.4:
            cfg["out_dtype"] = r.choice(DTYPES)
        g = _np_rng(r)
        shape = cfg["shape"]
        order = list(reversed(range(len(shape) - 1)))
        if r.random() < 0.5:
            r.shuffle(order)
        align = _align(r, cuda, fp.ITEMSIZE[cfg["out_dtype"]])
        v = D.make_view(g, shape, align, order=order, pads=[r.choice([0, 1, 2]) for _ in order], offset_max=4)
        cfg["out_view"] = _view_json(v)
    return cfg


def gen_rope_backward_quantize(r: random.Random, cuda: bool) -> dict:
    cfg = _rope_common(r, cuda, quant=True)
    cfg["fmt"] = r.choice(FMTS)
    cfg["data"]["fmt"] = cfg["fmt"]
    cfg["rowwise"], cfg["columnwise"] = r.choice(DIRS)
    cfg["swizzle"] = r.random() < 0.5
    cfg["dx_copy"] = r.choice([None, "bfloat16", "float32"])
    cfg["fast_path"] = fast_path_expected(cfg)
    return cfg


def fast_path_expected(cfg: dict) -> bool:
    """Whether the CUDA launcher takes rope_backward_quantize's DeepSeek-V3 fast path (bf16, D 192,
    R 64, one uniform token stride, heads and tokens not overlapping): src/cuda/sm90_rope_quantize.cu."""
    v = D.View.from_json(cfg["x_view"])
    shape, st = v.shape, v.strides
    if cfg["dtype"] != "bfloat16" or shape[-1] != 192 or cfg["rope_dim"] != 64:
        return False
    if cfg["layout"] == "thd":
        S, B, ss, bs, hs, H = shape[0], 1, st[0], 0, st[1], shape[1]
    elif cfg["layout"] == "sbhd":
        S, B, ss, bs, hs, H = shape[0], shape[1], st[0], st[1], st[2], shape[2]
    else:
        B, S, bs, ss, hs, H = shape[0], shape[1], st[0], st[1], st[2], shape[2]
    sbhd = cfg["layout"] != "bshd"
    ok, stride = False, 0
    if sbhd:
        if B == 1 or ss == B * bs:
            stride, ok = (ss if B == 1 else bs), True
    else:
        if S == 1 or bs == S * ss:
            stride, ok = (bs if S == 1 else ss), True
    hs = hs if H > 1 else 192
    return ok and hs >= 192 and (S * B == 1 or stride >= hs * H)


# ----------------------------------------------------------------------------- fused Q up-projection
def gen_fused(r: random.Random, cuda: bool) -> dict:
    layout = r.choice(["sbhd", "bshd"])
    B = r.choice([1, 1, 1, 2, 3, 4])
    # "big": enough 64-token x head tiles that the persistent kernel's CTAs take several each
    big = r.random() < 0.08
    S = r.randint(2048, 4096) // B if big else r.choice([1, r.randint(1, 40), r.randint(1, 140), r.randint(100, 300)])
    if cuda:
        nope, rope = 128, 64
        K = 8 * r.randint(1, 8 if big else r.choice([8, 16, 40, 192]))  # up to DeepSeek-V3's 1536
    else:
        nope, rope = r.choice([(128, 64), (128, 64), (0, 32), (16, 16), (30, 2), (64, 64), (96, 64), (2, 30)])
        K = r.randint(1, 64 if big else r.choice([16, 64, 320]))
    NH = r.randint(2, 5) if big else r.choice([1, 1, 2, 3, 4, 5, 8, r.randint(1, 20)])
    Dh = nope + rope
    while S * B * NH * Dh * K > (2.5e8 if big else 4e7) and (S > 1 or NH > 1):
        if NH > 1:
            NH = max(1, NH // 2)
        else:
            S = max(1, S // 2)
    fmt = r.choice(FMTS)
    rowwise, columnwise = r.choice(DIRS)
    wl = r.choice(["nk", "kn"])
    a8 = 8 if cuda or r.random() < 0.5 else 1
    return dict(layout=layout, batch=B, S=S, NH=NH, nope=nope, rope=rope, K=K, weight_layout=wl, size="big" if big else "small",
                style=r.choice(STYLES), fmt=fmt, rowwise=rowwise, columnwise=columnwise,
                bhsd_scales=r.random() < 0.5, return_q=r.random() < 0.5,
                tab_dtype=r.choice(["float32", "bfloat16"]), tab_kind=r.choice(["angles", "random"]),
                tab_special=r.choice([0.0, 0.0, 0.0, 0.005]), tab_extra=r.choice([0, 0, 3]),
                tab_pad=r.choice([0, 0, 1]), x_pad=a8 * r.choice([0, 0, 1, 3]), w_pad=a8 * r.choice([0, 0, 1, 2]),
                x_offset=a8 * r.choice([0, 0, 2]), align=a8,
                xint=r.choice([1, 2, 4]), x_exp=r.choice(["none", "narrow", "wide"]),
                w_exp=r.choice(["none", "narrow", "wide"]), zero_rows=r.choice([0.0, 0.0, 0.1]),
                x_nonfinite=r.random() < 0.03)


# ----------------------------------------------------------------------------- attention
ATTN_FORMATS = ("sbhd", "bshd", "bhsd", "thd")
ATTN_CUDA_DIMS = ((192, 128), (128, 128))  # (d_qk, d_v) the SM90 kernel is built for (src/cuda/sm90_attention_fwd.cu)
ATTN_WORK = 1.2e8  # at most B·H·s_q·s_kv·(d_qk + d_v) per config: the float64 reference and oracle take < ~0.5 s
YARN_MSCALE2 = (0.1 * math.log(40.0) + 1.0) ** 2  # SPEC §1: DeepSeek-V3's softmax scale with YaRN is d^-0.5 times this


def attn_shape(fmt: str, B: int, S: int, H: int, D: int) -> list:
    """An operand's shape in its format (thd: S is the packed token count)."""
    return {"sbhd": [S, B, H, D], "bshd": [B, S, H, D], "bhsd": [B, H, S, D], "thd": [S, H, D]}[fmt]


def _seq_len(r: random.Random) -> int:
    """1..300, with tails around multiples of 32 and 128 (the kernel's key blocks, the E4M3 P blocks)."""
    k = r.choices(["one", "small", "t32", "t128", "any"], [8, 14, 26, 24, 28])[0]
    if k == "one":
        return 1
    if k == "small":
        return r.randint(2, 31)
    if k == "t32":
        n = 32 * r.randint(1, 9) + r.choice([-2, -1, 0, 0, 1, 2])
    elif k == "t128":
        n = 128 * r.randint(1, 2) + r.choice([-3, -1, 0, 0, 1, 3])
    else:
        n = r.randint(1, 300)
    return max(1, min(300, n))


def v_blocks_along_keys(fmt: str, kind: str, B: int, H: int) -> bool:
    """Whether V's columnwise scale blocks run along the keys of one (sequence, head) in the core's
    scale geometry (src/attention.cpp: row_s == 1), which the CUDA kernel needs for V."""
    if kind == "attn":
        return True
    if kind == "tokens" and H > 1:  # token-major [tokens, h*d]
        return {"sbhd": B, "bshd": 1, "thd": 1}[fmt] == 1
    return {"sbhd": B * H, "bshd": H, "bhsd": 1, "thd": H}[fmt] == 1


def _attn_events(r: random.Random, cuda: bool, role: str, prec: str, fmt: str, src: dict) -> list:
    """Special values of one operand, as kinds (positions and magnitudes come from the data seed):
    value-level (before bf16 rounding / quantization) and, for MXFP8, edits of the scale bytes and
    codes after quantization."""
    n = r.choice([0, 0, 0, 1, 1, 2, 4, 8])
    kinds = ["zero_row", "big_row", "small_row", "nan"]
    if role == "v":
        kinds += ["zero_key", "big_key"]
    if not cuda:
        kinds += ["inf"]
    if prec == "mxfp8":
        kinds += ["scale_nan", "scale_zero", "scale_one", "scale_big", "codes"] + ([] if cuda else ["scale_max"])
        if src["scale_layout"] != "compact":
            kinds += ["pad"]
        if src["dirs"] == "both":
            kinds += ["unread"]
    return [r.choice(kinds) for _ in range(n)]


def _attn_mx_source(r: random.Random, cuda: bool, role: str, fmt: str, shape: list, B: int) -> dict:
    """How an MXFP8 operand is quantized: quantize_attention (sbhd / bshd; compact or BHSD scales),
    quantize of its own shape or of [leading, d] ("plain"), or of [tokens, h*d] ("tokens", token
    major: sbhd / bshd / thd); compact or swizzled scales; from bf16 / fp16 / fp32 values."""
    H, Dh = shape[-2], shape[-1]
    kinds = (["attn"] * 3 if fmt in ("sbhd", "bshd") else []) + ["plain"] * 2 + (["tokens"] * 2 if fmt != "bhsd" else [])
    if cuda and role == "v":
        kinds = [k for k in kinds if v_blocks_along_keys(fmt, k, B, H)]
    kind = r.choice(kinds)
    if kind == "attn":
        sl, qshape = r.choice(["compact", "bhsd"]), list(shape)
    elif kind == "plain":
        sl = r.choice(["compact", "swizzled"])
        qshape = list(shape) if r.random() < 0.6 else [int(np.prod(shape[:-1])), Dh]
    else:
        sl = r.choice(["compact", "swizzled"])
        qshape = [int(np.prod(shape[:-2])), H * Dh]
    place = r.choice(["as_is", "view"])
    return dict(kind=kind, scale_layout=sl, qshape=qshape, src_dtype=r.choice(DTYPES), place=place,
                dirs="read" if place == "view" or r.random() < 0.5 else "both")


def _attn_sep_view(r: random.Random, g, shape: list, align: int) -> D.View:
    lead = list(range(len(shape) - 1))
    order = list(reversed(lead))
    if r.random() < 0.35:  # e.g. a bhsd view of sbhd memory (q.transpose), a bshd view of s-major memory
        r.shuffle(order)
    pads = [r.choice([0, 0, 1, 3]) for _ in lead]
    return D.make_view(g, shape, align, order=order, pads=pads, offset_max=r.choice([0, 0, 4]))


def _attn_pack_views(r: random.Random, g, shape: list, n: int, heads_inner: bool, align: int) -> list:
    """n views of one buffer [tokens..., n, h, d] ("3hd" / "2hd") or [tokens..., h, n, d] ("h3d" /
    "h2d"): the buffer's inner [n, h, d] dense, padding only between tokens."""
    tok, (H, Dh) = list(shape[:-2]), shape[-2:]
    nt = len(tok)
    pshape = tok + ([H, n, Dh] if heads_inner else [n, H, Dh])
    order = [nt + 1, nt]
    tord = list(reversed(range(nt)))
    if r.random() < 0.3:
        r.shuffle(tord)
    buf = D.make_view(g, pshape, align, order=order + tord, pads=[0, 0] + [r.choice([0, 0, 1, 2]) for _ in tok],
                      offset_max=r.choice([0, 0, 4]))
    n_ax, h_ax = (nt + 1, nt) if heads_inner else (nt, nt + 1)
    st = buf.strides
    views = []
    for i in range(n):
        strides = tuple(st[:nt]) + (st[h_ax], 1)
        views.append(D.View(buf.base_numel, buf.offset + i * st[n_ax], tuple(shape), strides))
    return views


def expected_qkv_layout(cfg: dict) -> str:
    """The name qkv_layout must give for the memory the generator lays out (SPEC §5 layout rules):
    mixed formats <q>_<kv>_<kv>; bhsd unpacked; packed views by their pattern (one head: h3d /
    h2d offsets coincide with 3hd / 2hd, which come first); anything else (separate buffers) unpacked."""
    qf, kvf = cfg["q_format"], cfg["kv_format"]
    if qf != kvf:
        return f"{qf}_{kvf}_{kvf}"
    if qf == "bhsd":
        return "bhsd_bhsd_bhsd"
    tok = qf[:-2]
    pat = cfg["pack"]
    if 0 in cfg["q"]["shape"] or 0 in cfg["k"]["shape"]:
        pat = "separate"
    if pat in ("3hd", "h3d"):
        return tok + ("h3d" if pat == "h3d" and cfg["H"] > 1 else "3hd")
    if pat in ("2hd", "h2d"):
        return f"{qf}_{tok}" + ("h2d" if pat == "h2d" and cfg["H_kv"] > 1 else "2hd")
    return f"{qf}_{qf}_{qf}"


def _attn_default_format(cfg: dict):
    """(q format, kv format) mxmla.attention resolves when layout=None (python/mxmla/attention.py)."""
    def known(op):
        if len(op["shape"]) == 3:
            return "thd"
        if op["prec"] == "mxfp8" and op["kind"] == "attn":
            return op["fmt"]
        return None

    fq, fk, fv = known(cfg["q"]), known(cfg["k"]), known(cfg["v"])
    fkv = fk or fv
    if fq is None:
        fq = fkv if fkv in ("sbhd", "bshd") else "sbhd"
    if fkv is None:
        fkv = fq if fq != "thd" else None
    return fq, fkv


def gen_attention(r: random.Random, cuda: bool, work_max: float = ATTN_WORK) -> dict:
    if r.random() < 0.2:
        qf, kvf = r.sample(["sbhd", "bshd", "bhsd"], 2)
    else:
        qf = kvf = r.choices(ATTN_FORMATS, [25, 25, 20, 30])[0]
    thd = qf == "thd"
    H = r.choice([1, 1, 2, 3, 4, 5, 6, 8])
    Hkv = H if r.random() < 0.5 else r.choice([x for x in range(1, H + 1) if H % x == 0])
    if cuda:
        Dqk, Dv = r.choice(ATTN_CUDA_DIMS)
    else:
        Dqk = 32 * r.randint(1, 8)
        Dv = Dqk if r.random() < 0.3 else 32 * r.randint(1, 8)
    prec = r.choice(["bf16", "mxfp8"])
    fmt8 = r.choice(FMTS)
    pats = ["separate"] * 4
    if qf == kvf and qf != "bhsd":
        if H == Hkv and Dqk == Dv:
            pats += ["3hd", "h3d"]
        if Dqk == Dv:
            pats += ["2hd", "h2d"]
    pack = r.choice(pats)
    three = pack in ("3hd", "h3d")
    # sequences
    if thd:
        nseq = r.choice([1, 1, 2, 3, 4, 5])
        lq, lkv = [], []
        for _ in range(nseq):
            kind = r.choices(["same", "empty_q", "empty_kv", "empty", "one", "diff"], [30, 8, 8, 6, 10, 38])[0]
            a = _seq_len(r)
            b = a if kind == "same" else 1 if kind == "one" else _seq_len(r)
            if kind == "empty_q":
                a = 0
            elif kind == "empty_kv":
                b = 0
            elif kind == "empty":
                a = b = 0
            elif kind == "one":
                a = 1
            lq.append(a), lkv.append(b)
        tail_q, tail_kv = r.choice([0, 0, 0, 1, 5]), r.choice([0, 0, 0, 2, 3])
        if three:
            lkv, tail_kv = list(lq), tail_q
        B = nseq
    else:
        B = r.choice([1, 1, 2, 3])
        Sq = _seq_len(r)
        Skv = Sq if three or r.random() < 0.4 else _seq_len(r)
        if not three and r.random() < 0.02:
            Skv = 0  # no key anywhere: every row O = 0, LSE = -inf (SPEC §5)
    # bound the work (the float64 reference and oracle are O(s_q·s_kv·d))

    def work():
        pairs = sum(a * b for a, b in zip(lq, lkv)) if thd else B * Sq * Skv
        return pairs * H * (Dqk + Dv)

    while work() > work_max:
        if H // Hkv > 1:  # fewer query heads per kv head
            H = Hkv * ((H // Hkv) // 2)
        elif Hkv > 1:  # (H == Hkv here)
            H = Hkv = Hkv // 2
        elif not thd and B > 1:
            B -= 1
        elif thd:
            lq = [x // 2 for x in lq]
            lkv = list(lq) if three else [x // 2 for x in lkv]
        else:
            Sq, Skv = max(1, Sq // 2), (max(1, Skv // 2) if Skv else 0)
            if three:
                Skv = Sq
    Sq_, Skv_ = (sum(lq) + tail_q, sum(lkv) + tail_kv) if thd else (Sq, Skv)
    causal = r.choice(["none", "none", "top_left", "bottom_right"])
    cfg = dict(q_format=qf, kv_format=kvf, B=B, H=H, H_kv=Hkv, d_qk=Dqk, d_v=Dv, prec=prec, fp8_format=fmt8,
               pack=pack, causal=causal)
    if thd:
        cfg.update(seqlens_q=lq, seqlens_kv=lkv, tail_q=tail_q, tail_kv=tail_kv,
                   cu=dict(dtype=r.choice(["int32", "int64"]), where=r.choice(["same", "same", "cpu", "list"])),
                   max_seqlen=r.choice(["none", "none", "exact", "bound"]), max_extra=r.randint(0, 40))
    else:
        cfg.update(s_q=Sq, s_kv=Skv)
    g = _np_rng(r)
    itemsize = 2 if prec == "bf16" else 1
    align = max(1, 16 // itemsize) if cuda or r.random() < 0.5 else 1
    # packed views of one buffer: these operands' codes (MXFP8) go into it, only the direction read
    members = ["q", "k", "v"] if three else ["k", "v"] if pack in ("2hd", "h2d") else []
    for role, S, Hr, Dr, fmt in (("q", Sq_, H, Dqk, qf), ("k", Skv_, Hkv, Dqk, kvf), ("v", Skv_, Hkv, Dv, kvf)):
        shape = attn_shape(fmt, B, S, Hr, Dr)
        op = dict(fmt=fmt, shape=shape, prec=prec)
        if prec == "mxfp8":
            op.update(_attn_mx_source(r, cuda, role, fmt, shape, B))
            if role in members:
                op["place"], op["dirs"] = "view", "read"
        mult = 2.0 ** r.choice([-1, 0, 0, 0, 1, 2, 3]) if role == "q" else 2.0 ** r.choice([-2, 0, 0, 0, 1, 4])
        op["data"] = dict(dist=r.choice(["normal", "normal", "uniform", "int", "pow2"]), mult=mult,
                          row_exp=r.choice([0, 1, 1, 3]))
        op["events"] = _attn_events(r, cuda, role, prec, fmt, op)
        cfg[role] = op
    # memory: packed views of one buffer, or separate (padded, permuted) views; MXFP8 codes "as_is"
    # (the quantize result) or copied into such views (only the direction attention reads)
    if members:
        views = _attn_pack_views(r, g, cfg[members[0]]["shape"], len(members), pack.startswith("h"), align)
        for m, v in zip(members, views):
            cfg[m]["view"], cfg[m]["packed"] = _view_json(v), True
    for role in ("q", "k", "v"):
        op = cfg[role]
        if "view" not in op and (prec == "bf16" or op["place"] == "view"):
            op["view"], op["packed"] = _view_json(_attn_sep_view(r, g, op["shape"], align)), False
    cfg["align"] = align
    # the call
    sk = r.choice(["default", "default", "explicit", "yarn", "random", "sharp"])
    cfg["softmax_scale"] = None if sk == "default" else float(Dqk ** -0.5) if sk == "explicit" else \
        float(Dqk ** -0.5 * YARN_MSCALE2) if sk == "yarn" else r.uniform(0.02, 0.5) if sk == "random" else \
        r.choice([1.0, 2.0, 4.0])
    cfg["p_format"] = r.choice(["bfloat16", "bfloat16", "e4m3"])
    cfg["return_lse"] = r.random() < 0.85
    la = r.choice(["none", "format", "name"])
    if la == "none" and _attn_default_format(cfg) != (qf, kvf):
        la = "format"
    cfg["layout_arg"] = la
    cfg["expected_layout"] = expected_qkv_layout(cfg)
    return cfg


# ----------------------------------------------------------------------------- attention backward
ATTN_BWD_WORK = 4e7  # the backward reference costs about three forwards
# Value events the backward's configs keep. The kernels' gradients are compared with the float64
# reference within fp32 bounds (check.attention_backward_pair), which hold while the scores stay
# moderate: no NaN / Inf (SPEC §5 leaves the gradients of non-finite inputs open), no huge rows,
# keys, scale bytes or random codes (fp32 scores far from float64's), softmax_scale at most 0.5. No
# edits of the copy the forward does not read either: the backward reads both copies.
ATTN_BWD_EVENTS = ("zero_row", "small_row", "zero_key", "scale_zero", "scale_one", "pad")


def gen_attention_backward(r: random.Random, cuda: bool) -> dict:
    """attention's configs (formats, packing, views, thd sequences, GQA, MXFP8 sources, causal
    alignments) with moderate scores, plus dO (bf16 in q's format with d_v; MXFP8 from
    quantize_attention for sbhd / bshd sometimes) and the deterministic flag. O and LSE come from the
    oracle's forward of the same operands (oracle.backward_inputs), the same inputs everywhere."""
    cfg = gen_attention(r, cuda, ATTN_BWD_WORK)
    for role in ("q", "k", "v"):
        op = cfg[role]
        op["events"] = [e for e in op["events"] if e in ATTN_BWD_EVENTS]
        if role != "v":
            op["data"]["mult"] = min(op["data"]["mult"], 1.0)
            op["data"]["row_exp"] = min(op["data"]["row_exp"], 1)
    if cfg["softmax_scale"] is not None and cfg["softmax_scale"] > 0.5:
        cfg["softmax_scale"] = 0.5
    cfg["p_format"] = "bfloat16"  # (the forward that makes O; the backward has no P format)
    cfg["return_lse"] = True
    qs = cfg["q"]["shape"]
    do = dict(shape=qs[:-1] + [cfg["d_v"]], data=dict(dist=r.choice(["normal", "uniform", "int", "pow2"]),
                                                      mult=2.0 ** r.choice([-2, 0, 0, 1, 3]),
                                                      row_exp=r.choice([0, 1, 2])),
              events=[r.choice(["zero_row", "small_row"]) for _ in range(r.choice([0, 0, 1, 2]))])
    do["mx"] = cfg["prec"] == "mxfp8" and cfg["q_format"] in ("sbhd", "bshd") and r.random() < 0.4
    if not do["mx"]:
        do["view"] = _view_json(_attn_sep_view(r, _np_rng(r), do["shape"], 8 if cuda else r.choice([1, 8])))
    cfg["do"] = do
    cfg["deterministic"] = r.random() < 0.4
    return cfg


# ----------------------------------------------------------------------------- gemm
GEMM_WORK = 1.5e7  # at most M·N·K per config
GEMM_DIRECTIONS = {"fprop": (False, True), "dgrad": (False, False), "wgrad": (True, False), "tt": (True, True)}


def _gemm_dim(r: random.Random, mult32: bool, cuda: bool) -> int:
    k = r.choices(["one", "small", "t32", "t128", "any", "big", "zero"], [8, 12, 22, 18, 28, 10, 0 if cuda else 2])[0]
    n = {"one": 1, "small": r.randint(2, 31), "t32": 32 * r.randint(1, 12) + r.choice([-3, -1, 0, 0, 1, 2]),
         "t128": 128 * r.randint(1, 4) + r.choice([-3, -1, 0, 0, 1, 5]), "any": r.randint(1, 300),
         "big": r.randint(300, 2100), "zero": 0}[k]
    if mult32:  # an MXFP8 operand's last dim: a positive multiple of 32
        n = 32 * max(1, round(n / 32))
    return max(0, n)


def gen_gemm(r: random.Random, cuda: bool) -> dict:
    direction = r.choices(list(GEMM_DIRECTIONS), [30, 30, 30, 10])[0]
    ta, tb = GEMM_DIRECTIONS[direction]
    prec = "mxfp8" if r.random() < 0.8 else "bf16"
    fmt = r.choice(FMTS)
    int_data = r.random() < 0.2
    # stored shapes: a [M, K] or [K, M] (trans_a); b [N, K] (trans_b) or [K, N]. An MXFP8 operand's
    # last dim is a multiple of 32 (its rowwise blocks); the contraction along rows takes any length.
    m32 = prec == "mxfp8"
    M = _gemm_dim(r, m32 and ta, cuda)
    N = _gemm_dim(r, m32 and not tb, cuda)
    K = _gemm_dim(r, m32 and (not ta or tb), cuda)
    while M * N * K > GEMM_WORK:
        big = max(("M", M, m32 and ta), ("N", N, m32 and not tb), ("K", K, m32 and (not ta or tb)), key=lambda t: t[1])
        name, val, need = big
        val = max(32, (val // 2) // 32 * 32) if need else max(1, val // 2)
        M, N, K = (val if name == "M" else M), (val if name == "N" else N), (val if name == "K" else K)
    if int_data:  # fp32 partial sums stay exact (|products| <= 256): what the kernel must match bit for bit
        K = min(K, 2048)
    g = _np_rng(r)
    shapes = {"a": [K, M] if ta else [M, K], "b": [N, K] if tb else [K, N]}
    reads = {"a": "columnwise" if ta else "rowwise", "b": "rowwise" if tb else "columnwise"}
    cfg = dict(direction=direction, trans_a=ta, trans_b=tb, prec=prec, fp8_format=fmt, M=M, N=N, K=K,
               int_data=int_data)
    for name in ("a", "b"):
        rows, cols = shapes[name]
        op = dict(shape=[rows, cols], read=reads[name])
        if int_data:
            op["data"] = dict(dist="int", exp="none", special_rate=0.0, orient="row", fmt=fmt,
                              imax=16 if fmt == "e4m3" or prec == "bf16" else 8)
        else:
            op["data"] = _data_opts(r, fmt, special_hi=0.1 if cuda else 0.2)
            if cuda and op["data"]["exp"] == "wide":  # products within fp32's range (the kernel's accumulator)
                op["data"]["exp"] = "narrow"
        if prec == "mxfp8":
            op["src_dtype"] = r.choice(DTYPES)
            op["scale_layout"] = r.choice(["compact", "swizzled"])
            op["dirs"] = r.choice(["read", "both"])
            op["place"] = r.choice(["as_is", "as_is", "view"])
            kinds = ["scale_nan", "scale_one", "scale_zero", "scale_big", "codes"] + ([] if cuda else ["scale_max"])
            if op["scale_layout"] == "swizzled":
                kinds.append("pad")
            if op["dirs"] == "both":
                kinds.append("unread")
            op["events"] = [] if int_data else [r.choice(kinds) for _ in range(r.choice([0, 0, 0, 1, 2, 4]))]
            if op["place"] == "view":
                a16 = 16 if cuda or r.random() < 0.5 else 1
                op["view"] = _view_json(D.make_view(g, [rows, cols], a16, pads=[r.choice([0, 1, 3])],
                                                    offset_max=r.choice([0, 4])))
        else:
            a8 = 8 if cuda or r.random() < 0.5 else 1
            op["view"] = _view_json(D.make_view(g, [rows, cols], a8, pads=[r.choice([0, 0, 1, 3])],
                                                offset_max=r.choice([0, 0, 4])))
        cfg[name] = op
    out = r.choice(["alloc", "alloc", "view"])
    cfg["out"] = out
    if out == "alloc":
        cfg["out_dtype"] = r.choice([None, "bfloat16", "float32"])
        cfg["accumulate"] = False
    else:
        cfg["out_dtype"] = r.choice(["bfloat16", "float32"])
        cfg["accumulate"] = cfg["out_dtype"] == "float32" and r.random() < 0.6
        es = fp.ITEMSIZE[cfg["out_dtype"]]
        a = max(1, 16 // es) if cuda or r.random() < 0.5 else 1
        cfg["out_view"] = _view_json(D.make_view(g, [M, N], a, pads=[r.choice([0, 0, 1, 3])],
                                                 offset_max=r.choice([0, 4])))
        cfg["d_init"] = r.choice(["normal", "int"]) if not int_data else "int"
        cfg["d_special"] = not cuda and not int_data and r.random() < 0.1
    if int_data:
        cfg["alpha"] = r.choice([1.0, 1.0, 2.0, 0.5, -1.0, 4.0])
    else:
        cfg["alpha"] = r.choice([1.0, 1.0, 1.0, 0.5, -2.0, 0.1, 3.7, 2.0 ** -20, 1000.0, 0.0])
    return cfg


GENERATORS = {
    "quantize": gen_quantize,
    "dequantize": gen_dequantize,
    "swizzle_scales": gen_swizzle,
    "unswizzle_scales": gen_swizzle,
    "quantize_attention": gen_quantize_attention,
    "attention_scales_to_bhsd": gen_attention_scales_to_bhsd,
    "to_bhsd": gen_to_bhsd,
    "apply_rope": gen_rope,
    "rope_backward": gen_rope,
    "rope_backward_quantize": gen_rope_backward_quantize,
    "fused_q_uproj_rope_quant": gen_fused,
    "attention": gen_attention,
    "attention_backward": gen_attention_backward,
    "gemm": gen_gemm,
}


def generate(op: str, seed: int, profile: str = "any") -> dict:
    """The config of (op, seed, profile): a JSON-able dict (same arguments, same dict)."""
    if op not in GENERATORS:
        raise ValueError(f"unknown op {op!r} (one of {', '.join(OPS)})")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r} (cuda or any)")
    r = _rng(op, seed, profile)
    cfg = GENERATORS[op](r, profile == "cuda")
    out = dict(op=op, seed=int(seed), profile=profile, data_seed=r.getrandbits(63))
    out.update(cfg)
    # CUDA: the op runs on torch's current stream; sometimes a side stream (ordered after the
    # inputs' copies) instead of the default one
    out["stream"] = r.choice(["default", "default", "side"])
    out["tags"] = tags(out)
    return out


def config_json(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=False, separators=(",", ":"))


def config_digest(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- coverage tags
def _view_tags(v: dict) -> list:
    out = []
    vv = D.View.from_json(v)
    c = D.contiguous_view(vv.shape)
    if vv.offset:
        out.append("offset")
    if tuple(s for s, n in zip(vv.strides, vv.shape) if n > 1) != tuple(s for s, n in zip(c.strides, c.shape) if n > 1):
        out.append("strided")
    if any(s == 0 and n > 1 for s, n in zip(vv.strides, vv.shape)):
        out.append("broadcast")
    return out


def tags(cfg: dict) -> list:
    """Coverage features of a config (counted by the driver, listed in docs/testing.md)."""
    t = []
    op = cfg["op"]
    for k in ("dtype", "fmt", "layout", "style", "out_dtype", "scale_layout", "source", "bytes", "weight_layout",
              "tab_dtype", "dx_copy", "out", "size", "view_kind", "stream"):
        if k in cfg and cfg[k] is not None:
            t.append(f"{k}={cfg[k]}")
    if "rowwise" in cfg and "columnwise" in cfg:
        t.append("dir=" + ("both" if cfg["rowwise"] and cfg["columnwise"] else "row" if cfg["rowwise"] else "col"))
    elif "rowwise" in cfg:
        t.append("dir=" + ("row" if cfg["rowwise"] else "col"))
    for k in ("swizzle", "bhsd_scales", "return_q", "tables_per_token", "fast_path", "x_nonfinite"):
        if cfg.get(k):
            t.append(k)
    if cfg.get("cu_seqlens"):
        t.append("cu_seqlens")
        if cfg["cu_seqlens"]["empty_rate"] > 0 or cfg["cu_seqlens"]["nseq"] > 1:
            t.append("cu_seqlens_multi")
    if "x_view" in cfg:
        t += _view_tags(cfg["x_view"])
        shp = cfg["x_view"]["shape"]
        lead = int(np.prod(shp[:-1])) if len(shp) > 1 else 1
        if lead == 1:
            t.append("one_row")
        if lead >= 2 ** 14:
            t.append("huge_leading")
    d = cfg.get("data")
    if d:
        if d["special_rate"] > 0:
            t.append("specials")
        t.append(f"exp={d['exp']}")
    if op in ("apply_rope", "rope_backward", "rope_backward_quantize"):
        H = cfg["shape"][-2]
        t.append("heads%8==0" if H % 8 == 0 else "heads%8!=0")
        if cfg["shape"][-1] == 192 and cfg["rope_dim"] == 64:
            t.append("deepseek_head")
    if op == "fused_q_uproj_rope_quant":
        if cfg["batch"] > 1:
            t.append("batch>1")
        if cfg["K"] % 64:
            t.append("K_tail")
        if cfg["S"] * cfg["batch"] % 128:
            t.append("T_tail")
    if op == "to_bhsd":
        t.append(f"tensors={len(cfg['tensors'])}")
    if op == "attention_backward":
        t += ["deterministic"] if cfg["deterministic"] else []
        t += ["do_mxfp8"] if cfg["do"]["mx"] else []
        t += [f"do_event={e}" for e in cfg["do"]["events"]]
    if op in ("attention", "attention_backward"):
        t += [f"format={cfg['q_format']}" if cfg["q_format"] == cfg["kv_format"] else "format=mixed",
              f"prec={cfg['prec']}", f"pack={cfg['pack']}", f"causal={cfg['causal']}", f"p_format={cfg['p_format']}",
              f"dims={cfg['d_qk']}/{cfg['d_v']}", f"layout_arg={cfg['layout_arg']}"]
        if cfg["H"] != cfg["H_kv"]:
            t.append("gqa")
        if cfg["softmax_scale"] is not None:
            t.append("softmax_scale")
        lens = (cfg["seqlens_q"] + cfg["seqlens_kv"]) if cfg["q_format"] == "thd" else [cfg["s_q"], cfg["s_kv"]]
        if any(n % 32 and n > 32 for n in lens):
            t.append("s_tail")
        if any(n > 128 for n in lens):
            t.append("s>128")
        if cfg["q_format"] == "thd":
            if 0 in cfg["seqlens_q"] or 0 in cfg["seqlens_kv"]:
                t.append("thd_empty_seq")
            if 1 in cfg["seqlens_q"] or 1 in cfg["seqlens_kv"]:
                t.append("thd_one_token_seq")
            if cfg["tail_q"] or cfg["tail_kv"]:
                t.append("thd_tail")
        for role in ("q", "k", "v"):
            o = cfg[role]
            if o["prec"] == "mxfp8":
                t += [f"src={o['kind']}/{o['scale_layout']}", f"place={o['place']}", f"dirs={o['dirs']}"]
            if o.get("view") and "strided" in _view_tags(o["view"]):
                t.append("strided")
            t += [f"event={e}" for e in o["events"]]
            if role == "v" and cfg["causal"] != "none" and any(e in ("nan", "inf", "scale_nan", "codes") for e in o["events"]):
                t.append("v_nonfinite_causal")
        t.append(f"fp8={cfg['fp8_format']}" if cfg["prec"] == "mxfp8" else "fp8=none")
    if op == "gemm":
        t += [f"direction={cfg['direction']}", f"prec={cfg['prec']}", f"fp8={cfg['fp8_format']}"]
        if cfg["int_data"]:
            t.append("int_data")
        if cfg["accumulate"]:
            t.append("accumulate")
        if cfg["alpha"] != 1.0:
            t.append("alpha")
        for n in ("M", "N", "K"):
            if cfg[n] % 32:
                t.append(f"{n}_tail")
        for name in ("a", "b"):
            o = cfg[name]
            if cfg["prec"] == "mxfp8":
                t += [f"scale_layout={o['scale_layout']}", f"place={o['place']}", f"dirs={o['dirs']}"]
                t += [f"event={e}" for e in o["events"]]
            if o.get("view") and "strided" in _view_tags(o["view"]):
                t.append("strided")
        if cfg["out"] == "view" and "strided" in _view_tags(cfg["out_view"]):
            t.append("out_strided")
    return sorted(set(t))


# ----------------------------------------------------------------------------- materialize
class Arr:
    """A strided input: base bits (flat), its dtype and the view into it."""

    def __init__(self, base: np.ndarray, dtype: str, view: D.View):
        self.base, self.dtype, self.view = base, dtype, view

    def logical(self) -> np.ndarray:
        return D.gather(self.base, self.view)

    @staticmethod
    def contiguous(bits: np.ndarray, dtype: str) -> "Arr":
        bits = np.ascontiguousarray(bits)
        return Arr(bits.reshape(-1).copy(), dtype, D.contiguous_view(bits.shape))


def _float_arr(g, vj: dict, dtype: str, opts: dict, broadcast=()) -> Arr:
    view = D.View.from_json(vj)
    shape = list(view.shape)
    gshape = [1 if i in broadcast else n for i, n in enumerate(shape)]
    bits = D.float_bits(g, tuple(gshape), dtype, fmt=opts.get("fmt", "e4m3"), dist=opts["dist"], exp=opts["exp"],
                        special_rate=opts["special_rate"], orient=opts["orient"])
    bits = np.broadcast_to(bits, tuple(shape))
    return Arr(D.fill_base(g, view, dtype, bits), dtype, view)


def _attn_input(g, t: dict) -> Arr:
    return _float_arr(g, t["x_view"], t["dtype"], t["data"])


def _table_arrs(g, cfg: dict, rows: int) -> tuple:
    R = cfg["rope_dim"] if "rope_dim" in cfg else cfg["rope"]
    dt = cfg["tab_dtype"]
    c, s = D.rope_table_bits(g, rows, R, dt, cfg["tab_kind"], cfg["style"], cfg["tab_special"])
    align = cfg.get("tab_align", max(1, 16 // fp.ITEMSIZE[dt]))
    st = fp.rup(R, align) + align * cfg["tab_pad"]
    off = cfg.get("tab_offset", 0)
    view = D.View(off + (rows - 1) * st + R if rows else off, off, (rows, R), (st, 1))
    return Arr(D.fill_base(g, view, dt, c), dt, view), Arr(D.fill_base(g, view, dt, s), dt, view)


def scale_shapes(shape, layout, scale_layout: str) -> tuple:
    """(rowwise, columnwise) scale buffer shapes: plain tensors (layout None) compact / swizzled,
    attention tensors compact / bhsd (SPEC §2.1, §2.2; README "Semantics")."""
    if layout is None:
        K = shape[-1]
        M = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        if scale_layout == "swizzled":
            return fp.swizzled_shape(M, K, True), fp.swizzled_shape(M, K, False)
        return (M, K // 32), (fp.cdiv(M, 32), K)
    if scale_layout == "bhsd":
        return fp.bhsd_shapes(shape, layout)
    return fp.attention_compact_shapes(shape, layout)


# ----------------------------------------------------------------------------- attention / gemm inputs
def scale_buffer(qshape, layout, scale_layout: str, rowwise: bool) -> tuple:
    """(shape, padding mask or None) of one direction's scale buffer of a tensor quantized as
    `qshape` (layout None: quantize, compact / swizzled; else quantize_attention, compact / bhsd)."""
    rs, cs = scale_shapes(qshape, layout, scale_layout)
    shape = tuple(rs if rowwise else cs)
    if scale_layout == "swizzled":
        K = qshape[-1]
        M = int(np.prod(qshape[:-1])) if len(qshape) > 1 else 1
        return shape, fp.swizzle_padding(M, K, rowwise)
    if scale_layout == "bhsd":
        return shape, fp.bhsd_padding(qshape, layout, rowwise)
    return shape, None


def _pick(g, mask: np.ndarray) -> int:
    idx = np.flatnonzero(mask)
    return int(idx[int(g.integers(idx.size))]) if idx.size else -1


def _mx_edits(g, events, qshape, layout, scale_layout: str, read_rowwise: bool, dirs: str, fmt: str,
              big_max: int, cuda: bool) -> tuple:
    """Scale-byte and code edits of an MXFP8 operand after quantization: (scale edits int64 [n, 3]:
    direction (0 rowwise, 1 columnwise), flat index in that scale buffer, byte; code edits int64
    [n, 2]: flat index in the codes (logical order), byte)."""
    se, ce = [], []
    d_read = 0 if read_rowwise else 1
    shape, pad = scale_buffer(qshape, layout, scale_layout, read_rowwise)
    n_sc = int(np.prod(shape))
    real = np.ones(n_sc, bool) if pad is None else ~pad.reshape(-1)
    n_codes = int(np.prod(qshape))
    for ev in events:
        if ev.startswith("scale_") and real.any():
            byte = {"scale_nan": 0xFF, "scale_zero": 0, "scale_one": 1, "scale_max": 254}.get(ev)
            if byte is None:  # scale_big
                byte = 127 + int(g.integers(1, big_max + 1))
            se.append((d_read, _pick(g, real), byte))
        elif ev == "pad" and pad is not None and pad.any():
            se.append((d_read, _pick(g, pad.reshape(-1)), int(g.integers(1, 256))))
        elif ev == "unread" and dirs == "both":
            s2, _ = scale_buffer(qshape, layout, scale_layout, not read_rowwise)
            if int(np.prod(s2)):
                se.append((1 - d_read, int(g.integers(int(np.prod(s2)))), int(g.integers(0, 256))))
        elif ev == "codes" and n_codes:
            for _ in range(int(g.integers(1, 9))):
                b = int(g.integers(0, 256))
                if cuda and fmt == "e5m2" and (b & 0x7F) == 0x7C:
                    b ^= 1  # no Inf codes in the cuda profile (a NaN code stays)
                ce.append((int(g.integers(n_codes)), b))
    return np.array(se, np.int64).reshape(-1, 3), np.array(ce, np.int64).reshape(-1, 2)


def _attn_values(g, op: dict, role: str, cuda: bool) -> np.ndarray:
    """float64 values of one operand (q, k, v, or a backward's do) in its format's shape: a base
    distribution times a power of two per (token, head) row, then the operand's value-level events
    (zero / scaled blocks of 32 along d, for V also along the keys; NaN, Inf)."""
    shape, fmt, d = op["shape"], op["fmt"], op["data"]
    n = int(np.prod(shape))
    Dh = shape[-1]
    rows = n // Dh if Dh else 0
    v = D.base_values(g, d["dist"], (rows, Dh), imax=8, pow2=(-4, 2))
    v = v * d["mult"] * np.exp2(g.integers(-d["row_exp"], d["row_exp"] + 1, (rows, 1)))
    v = v.reshape(shape)
    s_ax = {"sbhd": 0, "bshd": 1, "bhsd": 2, "thd": 0}[fmt]
    big = (20 if role != "v" else 36) if cuda else 90
    for ev in op["events"]:
        if not n:
            break
        if ev in ("zero_row", "big_row", "small_row"):
            lead = np.unravel_index(int(g.integers(rows)), shape[:-1])
            c = int(g.integers(Dh // 32)) * 32
            blk = v[lead][c:c + 32]
            if ev == "zero_row":
                blk[:] = np.where(g.random(blk.size) < 0.3, -0.0, 0.0)
            else:
                blk *= 2.0 ** (int(g.integers(4, big + 1)) if ev == "big_row" else -int(g.integers(8, 131)))
        elif ev in ("zero_key", "big_key"):
            S = shape[s_ax]
            idx = [int(g.integers(k)) for k in shape]
            s0 = int(g.integers(fp.cdiv(S, 32))) * 32
            sl = [slice(i, i + 1) for i in idx]
            sl[s_ax] = slice(s0, min(S, s0 + 32))
            if ev == "zero_key":
                v[tuple(sl)] = 0.0
            else:
                v[tuple(sl)] *= 2.0 ** int(g.integers(4, big + 1))
        elif ev in ("nan", "inf"):
            i = np.unravel_index(int(g.integers(n)), shape)
            v[i] = np.nan if ev == "nan" else (np.inf if g.random() < 0.5 else -np.inf)
    return v


def _bits_of(g, v: np.ndarray, dtype: str) -> np.ndarray:
    """Bits of `dtype` for float64 values: finite values clipped to the dtype's range (an fp16 source
    of large values stays finite), NaN with assorted payloads and signs."""
    with np.errstate(all="ignore"):
        fin = np.isfinite(v)
        w = np.where(fin, np.clip(v, -D.DT[dtype]["maxf"], D.DT[dtype]["maxf"]), v)
        bits = fp.from_f64(w, dtype)
        nan = np.isnan(v)
        if nan.any():
            bits[nan] = g.choice(np.array(D.NAN_BITS[dtype], np.int64), int(nan.sum())).astype(fp.BITS[dtype])
    return bits


def _attn_inputs(g, cfg: dict, ins: dict) -> None:
    cuda = cfg["profile"] == "cuda"
    packed_base = None
    for role in ("q", "k", "v"):
        op = cfg[role]
        vals = _attn_values(g, op, role, cuda)
        if op["prec"] == "bf16":
            bits = _bits_of(g, vals, "bfloat16")
            view = D.View.from_json(op["view"])
            if op["packed"]:
                if packed_base is None:
                    packed_base = D.fill_base(g, view, "bfloat16", bits)
                elif bits.size:
                    packed_base[view.positions()] = bits
                ins[f"{role}.x"] = Arr(packed_base, "bfloat16", view)
            else:
                ins[f"{role}.x"] = Arr(D.fill_base(g, view, "bfloat16", bits), "bfloat16", view)
            continue
        bits = _bits_of(g, vals, op["src_dtype"]).reshape(op["qshape"])
        ins[f"{role}.src"] = Arr.contiguous(bits, op["src_dtype"])
        layout = op["fmt"] if op["kind"] == "attn" else None
        big = (20 if role != "v" else 36) if cuda else 126
        ins[f"{role}.sedits"], ins[f"{role}.cedits"] = _mx_edits(
            g, op["events"], op["qshape"], layout, op["scale_layout"], role != "v", op["dirs"], cfg["fp8_format"], big,
            cuda)
        if op["place"] == "view":
            view = D.View.from_json(op["view"])
            if op["packed"]:
                if packed_base is None:
                    packed_base = D.random_bits(g, (view.base_numel,), "uint8")
                ins[f"{role}.codes_base"] = packed_base
            else:
                ins[f"{role}.codes_base"] = D.random_bits(g, (view.base_numel,), "uint8")
    if cfg["q_format"] == "thd":
        ins["cu_q"] = np.concatenate([[0], np.cumsum(cfg["seqlens_q"])]).astype(np.int64)
        ins["cu_kv"] = np.concatenate([[0], np.cumsum(cfg["seqlens_kv"])]).astype(np.int64)


def _attn_do(g, cfg: dict, ins: dict) -> None:
    """dO of a backward config (values as an operand's, in q's format): bf16 bits in its view, or
    (MXFP8) contiguous bf16 source values."""
    do = cfg["do"]
    v = _attn_values(g, dict(do, fmt=cfg["q_format"]), "do", cfg["profile"] == "cuda")
    bits = _bits_of(g, v, "bfloat16")
    if do["mx"]:
        ins["do.src"] = Arr.contiguous(bits, "bfloat16")
    else:
        view = D.View.from_json(do["view"])
        ins["do.x"] = Arr(D.fill_base(g, view, "bfloat16", bits), "bfloat16", view)


def _gemm_inputs(g, cfg: dict, ins: dict) -> None:
    cuda = cfg["profile"] == "cuda"
    for name in ("a", "b"):
        op = cfg[name]
        rows, cols = op["shape"]
        d = op["data"]
        dt = "bfloat16" if cfg["prec"] == "bf16" else op["src_dtype"]
        if cfg["int_data"]:
            bits = fp.from_f64(g.integers(-d["imax"], d["imax"] + 1, (rows, cols)).astype(np.float64), dt)
        else:
            specials = ("zero", "denorm", "e0_edge", "nan", "exp_lo") if cuda else D.SPECIALS
            bits = D.float_bits(g, (rows, cols), dt, fmt=cfg["fp8_format"], dist=d["dist"], exp=d["exp"],
                                special_rate=d["special_rate"], orient=d["orient"], specials=specials)
        if cfg["prec"] == "bf16":
            view = D.View.from_json(op["view"])
            ins[f"{name}.x"] = Arr(D.fill_base(g, view, "bfloat16", bits), "bfloat16", view)
            continue
        ins[f"{name}.src"] = Arr.contiguous(bits, dt)
        ins[f"{name}.sedits"], ins[f"{name}.cedits"] = _mx_edits(
            g, op["events"], [rows, cols], None, op["scale_layout"], op["read"] == "rowwise", op["dirs"],
            cfg["fp8_format"], 20 if cuda else 126, cuda)
        if op["place"] == "view":
            ins[f"{name}.codes_base"] = D.random_bits(g, (D.View.from_json(op["view"]).base_numel,), "uint8")
    if cfg["out"] == "view":
        v = D.View.from_json(cfg["out_view"])
        dt = cfg["out_dtype"]
        M, N = cfg["M"], cfg["N"]
        if cfg["d_init"] == "int":
            d0 = g.integers(-1000, 1001, (M, N)).astype(np.float64)
        else:
            d0 = g.standard_normal((M, N)) * 2.0 ** int(g.integers(-4, 12))
        if cfg.get("d_special") and M * N:
            for _ in range(int(g.integers(1, 4))):
                d0[int(g.integers(M)), int(g.integers(N))] = g.choice([np.nan, np.inf, -np.inf])
        ins["out"] = Arr(D.fill_base(g, v, dt, _bits_of(g, d0, dt)), dt, v)


def materialize(cfg: dict) -> dict:
    """Every input of a config, rebuilt from the config alone."""
    g = np.random.default_rng(cfg["data_seed"])
    op = cfg["op"]
    ins = {}
    if op in ("quantize", "quantize_attention", "dequantize"):
        ins["x"] = _float_arr(g, cfg["x_view"], cfg["dtype"], cfg["data"])
        if op == "dequantize" and cfg["bytes"] != "quantized":
            shape = ins["x"].view.shape
            rs, cs = scale_shapes(shape, cfg.get("layout") if cfg["source"] == "attention" else None, cfg["scale_layout"])
            ins["random_codes"] = D.random_bits(g, tuple(shape), "uint8")
            ins["random_rs"] = D.random_bits(g, rs, "uint8")
            ins["random_cs"] = D.random_bits(g, cs, "uint8")
    elif op in ("swizzle_scales", "unswizzle_scales"):
        M, K, rw = cfg["M"], cfg["K"], cfg["rowwise"]
        if op == "swizzle_scales":
            shape = (M, K // 32) if rw else (fp.cdiv(M, 32), K)
        else:
            shape = fp.swizzled_shape(M, K, rw)
        ins["scales"] = Arr.contiguous(D.random_bits(g, shape, "uint8"), "uint8")
    elif op == "attention_scales_to_bhsd":
        rs, cs = fp.attention_compact_shapes(cfg["shape"], cfg["layout"])
        ins["scales"] = Arr.contiguous(D.random_bits(g, rs if cfg["rowwise"] else cs, "uint8"), "uint8")
    elif op == "to_bhsd":
        for i, t in enumerate(cfg["tensors"]):
            ins[f"x{i}"] = _attn_input(g, t)
            rs, cs = fp.attention_compact_shapes(t["x_view"]["shape"], t["layout"])
            ins[f"rs{i}"] = D.random_bits(g, rs, "uint8")
            ins[f"cs{i}"] = D.random_bits(g, cs, "uint8")
    elif op in ("apply_rope", "rope_backward", "rope_backward_quantize"):
        ins["x"] = _float_arr(g, cfg["x_view"], cfg["dtype"], cfg["data"], broadcast=tuple(cfg["broadcast"]))
        rows = cfg["tab_rows"]
        if cfg["cu_seqlens"] is not None:
            cu = D.cu_seqlens(g, cfg["shape"][0], cfg["cu_seqlens"]["nseq"], cfg["cu_seqlens"]["empty_rate"])
            ins["cu_seqlens"] = cu.astype(np.int32 if cfg["cu_seqlens"]["dtype"] == "int32" else np.int64)
            rows = int(np.max(np.diff(cu))) if len(cu) > 1 else 0
        ins["cos"], ins["sin"] = _table_arrs(g, cfg, rows + cfg["tab_extra"])
        if cfg.get("out") == "view":
            v = D.View.from_json(cfg["out_view"])
            ins["out"] = Arr(D.fill_base(g, v, cfg["out_dtype"], np.zeros(0, fp.BITS[cfg["out_dtype"]])),
                             cfg["out_dtype"], v)
    elif op == "fused_q_uproj_rope_quant":
        S, B, NH, K = cfg["S"], cfg["batch"], cfg["NH"], cfg["K"]
        T, N = S * B, NH * (cfg["nope"] + cfg["rope"])
        xv = g.integers(-cfg["xint"], cfg["xint"] + 1, (T, K)).astype(np.float64)
        wv = g.integers(-4, 5, (N, K)).astype(np.float64)
        if cfg["zero_rows"]:
            xv[g.random(T) < cfg["zero_rows"]] = 0.0
        # powers of two per token and per output column keep every fp32 partial sum exact
        ex = {"none": (0, 0), "narrow": (-6, 6), "wide": (-50, 50)}
        lo, hi = ex[cfg["x_exp"]]
        xv *= np.exp2(g.integers(lo, hi + 1, (T, 1)))
        lo, hi = ex[cfg["w_exp"]]
        wv *= np.exp2(g.integers(lo, hi + 1, (N, 1)))
        xb, wb = fp.from_f64(xv, "bfloat16"), fp.from_f64(wv, "bfloat16")
        if cfg["x_nonfinite"] and T:
            for _ in range(int(g.integers(1, 4))):
                xb[int(g.integers(T)), int(g.integers(K))] = int(g.choice(D.NAN_BITS["bfloat16"][:2] + list(D.INF_BITS["bfloat16"])))
        a = cfg["align"]
        xs = fp.rup(K, a) + cfg["x_pad"]
        xview = D.View(cfg["x_offset"] + (T - 1) * xs + K if T else cfg["x_offset"], cfg["x_offset"], (T, K), (xs, 1))
        ins["x"] = Arr(D.fill_base(g, xview, "bfloat16", xb), "bfloat16", xview)
        wshape = (N, K) if cfg["weight_layout"] == "nk" else (K, N)
        wlog = wb if cfg["weight_layout"] == "nk" else np.ascontiguousarray(wb.T)
        ws = fp.rup(wshape[1], a) + cfg["w_pad"]
        wview = D.View((wshape[0] - 1) * ws + wshape[1], 0, wshape, (ws, 1))
        ins["w"] = Arr(D.fill_base(g, wview, "bfloat16", wlog), "bfloat16", wview)
        cfg_t = dict(cfg, tab_align=max(1, 16 // fp.ITEMSIZE[cfg["tab_dtype"]]))
        ins["cos"], ins["sin"] = _table_arrs(g, cfg_t, S + cfg["tab_extra"])
    elif op == "attention":
        _attn_inputs(g, cfg, ins)
    elif op == "attention_backward":
        _attn_inputs(g, cfg, ins)
        _attn_do(g, cfg, ins)
    elif op == "gemm":
        _gemm_inputs(g, cfg, ins)
    return ins
