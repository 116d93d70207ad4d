"""Config generators: one per public op, each a pure function of (op, seed, profile) -> a JSON-able
dict. `profile` is "cuda" (every draw obeys the CUDA path's rules: alignment, rope_dim % 16,
nope 128 + rope 64 for the fused op, K % 8, same-dtype RoPE outputs, head dim <= 256, ...) or
"any" (the CPU reference's wider domain as well). The data themselves come from the config's
data seed: `materialize(cfg)` rebuilds every input from the config alone.
"""
from __future__ import annotations

import hashlib
import json
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
    return ins
