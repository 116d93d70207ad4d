"""Independent oracles: what every output of a config must be, bit for bit, computed with numpy and
ml_dtypes from SPEC §2-§4, include/mxmla/rope.h and README's "Semantics" (fp.py holds the
primitives). Returns {output name: bits (numpy, logical shape), dtype name}."""
from __future__ import annotations

import numpy as np

from . import fp

STYLE_TERMS = {}


def rope_terms(style: str, R: int) -> tuple:
    """a(j), b(j), sign(j) of out[j] = c[j]·x[a(j)] + sign(j)·s[j]·x[b(j)] (include/mxmla/rope.h)."""
    key = (style, R)
    if key not in STYLE_TERMS:
        h = R // 2
        j = np.arange(R)
        if style == "interleaved_in_halves_out":
            a = np.where(j < h, 2 * j, 2 * (j - h) + 1)
            b = np.where(j < h, 2 * j + 1, 2 * (j - h))
            sign = np.where(j < h, -1.0, 1.0)
        elif style == "interleaved":
            a, b, sign = j, j ^ 1, np.where(j % 2 == 0, -1.0, 1.0)
        else:
            a, b = j, np.where(j < h, j + h, j - h)
            sign = np.where(j < h, -1.0, 1.0)
        STYLE_TERMS[key] = (a, b, sign.astype(np.float32))
    return STYLE_TERMS[key]


def rope_f32(x: np.ndarray, c: np.ndarray, s: np.ndarray, style: str, backward: bool) -> np.ndarray:
    """The fp32 semantics of include/mxmla/rope.h on the rope part x [..., R] with tables c, s
    broadcast to it: forward out[j] = fmaf(sign(j)·s[j], x[b(j)], fp32(c[j]·x[a(j)])); backward
    dx[k] = fmaf(sign(j2)·s[j2], g[j2], fp32(c[j1]·g[j1])) with a(j1) = k, b(j2) = k."""
    R = x.shape[-1]
    a, b, sign = rope_terms(style, R)
    if not backward:
        prod = fp.mul_f32(c, x[..., a])
        return fp.fmaf(sign * s, x[..., b], prod)
    j1 = np.argsort(a)  # a(j1[k]) = k
    j2 = np.argsort(b)
    prod = fp.mul_f32(c[..., j1], x[..., j1])
    return fp.fmaf(sign[j2] * s[..., j2], x[..., j2], prod)


# ----------------------------------------------------------------------------- MXFP8
def quantize_plain(x32: np.ndarray, shape, fmt: str, rowwise: bool, columnwise: bool, swizzle: bool) -> dict:
    K = shape[-1]
    M = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    x2 = x32.reshape(M, K)
    out = {}
    for on, rw, name in ((rowwise, True, "rowwise"), (columnwise, False, "columnwise")):
        if not on:
            continue
        codes, sc = fp.quantize_2d(x2, fmt, rw)
        out[f"{name}_data"] = codes.reshape(shape)
        out[f"{name}_scale_inv"] = fp.swizzle(sc, M, K, rw) if swizzle else sc
    return out


def quantize_attention(x32: np.ndarray, shape, layout: str, fmt: str, rowwise: bool, columnwise: bool,
                       bhsd: bool) -> dict:
    """README "Attention": codes keep x's layout; rowwise blocks along d; columnwise blocks of 32
    consecutive tokens of one sequence (for every b); compact or BHSD scales."""
    S, B, H, Dh = fp.attn_dims(shape, layout)
    out = {}
    if rowwise:
        codes, sc = fp.quantize_2d(x32.reshape(-1, Dh), fmt, True)
        out["rowwise_data"] = codes.reshape(shape)
        out["rowwise_scale_inv"] = fp.to_bhsd(sc, shape, layout, True) if bhsd else sc
    if columnwise:
        if layout == "sbhd":
            codes, sc = fp.quantize_2d(x32.reshape(S, B * H * Dh), fmt, False)
            codes = codes.reshape(shape)
        else:
            parts = [fp.quantize_2d(x32[b].reshape(S, H * Dh), fmt, False) for b in range(B)]
            codes = np.stack([p[0] for p in parts]).reshape(shape) if B else np.zeros(shape, np.uint8)
            sc = np.concatenate([p[1] for p in parts]) if B else np.zeros((0, H * Dh), np.uint8)
        out["columnwise_data"] = codes
        out["columnwise_scale_inv"] = fp.to_bhsd(sc, shape, layout, False) if bhsd else sc
    return out


def element_scales(buf: np.ndarray, shape, layout, scale_layout: str, rowwise: bool) -> np.ndarray:
    """The scale byte of every element ([*shape]) from a scale buffer of any layout (layout None:
    a plain tensor, compact or swizzled; else an attention tensor, compact or bhsd)."""
    if layout is None:  # plain tensor
        K = shape[-1]
        M = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        cs = fp.unswizzle(buf, M, K, rowwise) if scale_layout == "swizzled" else buf.reshape(
            (M, K // 32) if rowwise else (fp.cdiv(M, 32), K))
        e = np.repeat(cs, 32, axis=1) if rowwise else np.repeat(cs, 32, axis=0)[:M]
        return e.reshape(shape)
    S, B, H, Dh = fp.attn_dims(shape, layout)
    cs = fp.from_bhsd(buf, shape, layout, rowwise) if scale_layout == "bhsd" else buf.reshape(
        fp.attention_compact_shapes(shape, layout)[0 if rowwise else 1])
    if rowwise:
        return np.repeat(cs, 32, axis=1).reshape(shape)
    Sb = fp.cdiv(S, 32)
    if layout == "sbhd":
        return np.repeat(cs, 32, axis=0)[:S].reshape(shape)
    return np.repeat(cs.reshape(B, Sb, H * Dh), 32, axis=1)[:, :S].reshape(shape)


# ----------------------------------------------------------------------------- per op
def _x32(a) -> np.ndarray:
    return fp.to_f32(a.logical(), a.dtype)


def _quantize(cfg, ins):
    x = _x32(ins["x"])
    return {k: (v, "uint8") for k, v in quantize_plain(x, x.shape, cfg["fmt"], cfg["rowwise"], cfg["columnwise"],
                                                        cfg["swizzle"]).items()}


def _quantize_attention(cfg, ins):
    x = _x32(ins["x"])
    return {k: (v, "uint8") for k, v in quantize_attention(x, x.shape, cfg["layout"], cfg["fmt"], cfg["rowwise"],
                                                            cfg["columnwise"], cfg["bhsd_scales"]).items()}


def _dequantize(cfg, ins):
    x = _x32(ins["x"])
    shape = x.shape
    if cfg["source"] == "plain":
        q = quantize_plain(x, shape, cfg["fmt"], cfg["rowwise"], cfg["columnwise"], cfg["scale_layout"] == "swizzled")
        layout = None
    else:
        q = quantize_attention(x, shape, cfg["layout"], cfg["fmt"], cfg["rowwise"], cfg["columnwise"],
                               cfg["scale_layout"] == "bhsd")
        layout = cfg["layout"]
    for d, key in (("rowwise", "random_rs"), ("columnwise", "random_cs")):
        if f"{d}_data" not in q or cfg["bytes"] == "quantized":
            continue
        if cfg["bytes"] == "random":
            q[f"{d}_data"] = ins["random_codes"]
        q[f"{d}_scale_inv"] = ins[key]
    out = {f"q.{k}": (v, "uint8") for k, v in q.items()}
    for d in ("rowwise", "columnwise"):
        if f"{d}_data" in q:
            e = element_scales(q[f"{d}_scale_inv"], shape, layout, cfg["scale_layout"], d == "rowwise")
            out[f"deq_{d}"] = (fp.dequant_values(q[f"{d}_data"], e, cfg["fmt"], cfg["out_dtype"]), cfg["out_dtype"])
    return out


def _swizzle(cfg, ins):
    s = ins["scales"].logical()
    M, K, rw = cfg["M"], cfg["K"], cfg["rowwise"]
    if cfg["op"] == "swizzle_scales":
        y = fp.swizzle(s, M, K, rw)
        back = s
    else:
        y = fp.unswizzle(s, M, K, rw)
        back = fp.swizzle(y, M, K, rw)
    return {"out": (y, "uint8"), "roundtrip": (back, "uint8")}


def _attention_scales_to_bhsd(cfg, ins):
    return {"out": (fp.to_bhsd(ins["scales"].logical(), cfg["shape"], cfg["layout"], cfg["rowwise"]), "uint8")}


def _to_bhsd(cfg, ins):
    out = {}
    for i, t in enumerate(cfg["tensors"]):
        x = _x32(ins[f"x{i}"])
        q = quantize_attention(x, x.shape, t["layout"], t["fmt"], t["rowwise"], t["columnwise"], False)
        if t["random_scales"]:
            if "rowwise_scale_inv" in q:
                q["rowwise_scale_inv"] = ins[f"rs{i}"]
            if "columnwise_scale_inv" in q:
                q["columnwise_scale_inv"] = ins[f"cs{i}"]
        for k, v in q.items():
            out[f"t{i}.p1.{k}"] = (v, "uint8")
            if k.endswith("_data"):
                out[f"t{i}.{k}"] = (v, "uint8")
            else:
                out[f"t{i}.{k}"] = (fp.to_bhsd(v, x.shape, t["layout"], k.startswith("rowwise")), "uint8")
    return out


def _sbhd4(a: np.ndarray, layout: str) -> np.ndarray:
    """Logical x -> [S, B, H, D] (a view)."""
    if layout == "sbhd":
        return a
    if layout == "bshd":
        return a.transpose(1, 0, 2, 3)
    return a[:, None]


def _from_sbhd4(a: np.ndarray, layout: str) -> np.ndarray:
    if layout == "sbhd":
        return a
    if layout == "bshd":
        return a.transpose(1, 0, 2, 3)
    return a[:, 0]


def table_rows(cfg: dict, ins: dict, S: int, B: int) -> np.ndarray:
    """Table row of token (s, b): [S, B] (include/mxmla/rope.h)."""
    s = np.arange(S)[:, None]
    b = np.arange(B)[None, :]
    if cfg["tables_per_token"]:
        return (s * B + b) if cfg["layout"] != "bshd" else (b * S + s)
    if cfg["layout"] == "thd" and cfg["cu_seqlens"] is not None:
        cu = ins["cu_seqlens"].astype(np.int64)
        t = np.arange(S)
        seq = np.searchsorted(cu, t, side="right") - 1  # the last start <= t (empty sequences skipped)
        return (t - cu[seq])[:, None]
    return np.broadcast_to(s, (S, B))


def rope_dx32(cfg: dict, ins: dict, backward: bool) -> tuple:
    """(x bits [S,B,H,D], rope output fp32 [S,B,H,R]) of a RoPE config."""
    xb = _sbhd4(ins["x"].logical(), cfg["layout"])
    S, B, H, Dh = xb.shape
    R = cfg["rope_dim"]
    rows = table_rows(cfg, ins, S, B)
    c = fp.to_f32(ins["cos"].logical(), ins["cos"].dtype)[rows][:, :, None, :]
    s = fp.to_f32(ins["sin"].logical(), ins["sin"].dtype)[rows][:, :, None, :]
    xr = fp.to_f32(xb[..., Dh - R:], cfg["dtype"])
    return xb, rope_f32(xr, c, s, cfg["style"], backward)


def _rope(cfg, ins):
    backward = cfg["op"] == "rope_backward"
    xb, y = rope_dx32(cfg, ins, backward)
    Dh, R = xb.shape[-1], cfg["rope_dim"]
    od = cfg["out_dtype"]
    ob = np.empty(xb.shape, fp.BITS[od])
    ob[..., : Dh - R] = fp.convert_bits(xb[..., : Dh - R], cfg["dtype"], od)
    ob[..., Dh - R:] = fp.from_f32(y, od)
    out_logical = _from_sbhd4(ob, cfg["layout"])
    res = {"out": (out_logical, od)}
    xa = ins["x"]
    if cfg["out"] == "inplace":
        base = xa.base.copy()
        if out_logical.size:
            base[xa.view.positions()] = out_logical
        res["x_base"] = (base, xa.dtype)
    else:
        res["x_base"] = (xa.base.copy(), xa.dtype)
    if cfg["out"] == "view":
        oa = ins["out"]
        base = oa.base.copy()
        if out_logical.size:
            base[oa.view.positions()] = out_logical
        res["out_base"] = (base, od)
    return res


def _rope_backward_quantize(cfg, ins):
    xb, y = rope_dx32(cfg, ins, True)
    S, B, H, Dh = xb.shape
    R = cfg["rope_dim"]
    dt = cfg["dtype"]
    dx = np.empty(xb.shape, np.float32)
    dx[..., : Dh - R] = fp.to_f32(xb[..., : Dh - R], dt)
    dx[..., Dh - R:] = y
    dxl = _from_sbhd4(dx, cfg["layout"])  # logical order = the tokens' order of the [tokens, h*d] view
    tokens = S * B
    res = {k: (v, "uint8") for k, v in quantize_plain(dxl.reshape(tokens, H * Dh), (tokens, H * Dh), cfg["fmt"],
                                                      cfg["rowwise"], cfg["columnwise"], cfg["swizzle"]).items()}
    if cfg["dx_copy"]:
        od = cfg["dx_copy"]
        # dx in fp32: the nope part is dq's value (fp32 dq: its bits, NaN payloads included, as
        # apply_rope passes the nope part through; bf16 / fp16 dq: the exact value, NaN canonical),
        # the rope part the fp32 result (NaN canonical). An fp32 copy is dx itself; a bf16 copy
        # dx rounded once (NaN canonical).
        d32 = np.empty(xb.shape, np.uint32)
        d32[..., : Dh - R] = fp.convert_bits(xb[..., : Dh - R], dt, "float32")
        d32[..., Dh - R:] = fp.from_f32(y, "float32")
        d32 = _from_sbhd4(d32, cfg["layout"])
        res["dx"] = (d32, od) if od == "float32" else (fp.from_f32(d32.view(np.float32), od), od)
    res["x_base"] = (ins["x"].base.copy(), dt)
    return res


def fused_q(cfg: dict, ins: dict) -> tuple:
    """(q fp32 [logical q shape], q bf16 bits): float64 GEMM of the bf16 inputs (exact on the
    fuzzers' integer data) -> fp32 -> bf16 -> RoPE in fp32 on the rope part of each head."""
    S, B, NH = cfg["S"], cfg["batch"], cfg["NH"]
    nope, R = cfg["nope"], cfg["rope"]
    Dh = nope + R
    T, N = S * B, NH * Dh
    x = fp.to_f64(ins["x"].logical(), "bfloat16")  # [T, K], tokens in the layout's order
    w = fp.to_f64(ins["w"].logical(), "bfloat16")
    if cfg["weight_layout"] == "kn":
        w = w.T
    with np.errstate(all="ignore"):
        acc = x @ w.T if x.size and w.size else np.zeros((T, N))
        bad = ~np.isfinite(x).all(axis=1)
        for t in np.nonzero(bad)[0]:  # IEEE Inf / NaN products, independent of the summation order
            acc[t] = (x[t][None, :] * w).sum(axis=1)
    qb = fp.from_f64(acc.astype(np.float32).astype(np.float64), "bfloat16")  # fp32 accumulator -> bf16
    q4 = qb.reshape((S, B, NH, Dh) if cfg["layout"] == "sbhd" else (B, S, NH, Dh))
    q4s = q4 if cfg["layout"] == "sbhd" else q4.transpose(1, 0, 2, 3)  # [S, B, NH, D]
    c = fp.to_f32(ins["cos"].logical(), ins["cos"].dtype)[:S][:, None, None, :]
    s = fp.to_f32(ins["sin"].logical(), ins["sin"].dtype)[:S][:, None, None, :]
    qf = fp.to_f32(q4s, "bfloat16")
    qf[..., nope:] = rope_f32(qf[..., nope:], c, s, cfg["style"], False)
    qf = qf if cfg["layout"] == "sbhd" else qf.transpose(1, 0, 2, 3)
    return np.ascontiguousarray(qf), fp.from_f32(qf, "bfloat16")


def _fused(cfg, ins):
    qf, qb = fused_q(cfg, ins)
    res = {k: (v, "uint8") for k, v in quantize_attention(qf, qf.shape, cfg["layout"], cfg["fmt"], cfg["rowwise"],
                                                           cfg["columnwise"], cfg["bhsd_scales"]).items()}
    if cfg["return_q"]:
        res["q"] = (qb, "bfloat16")
    return res


ORACLES = {
    "quantize": _quantize,
    "dequantize": _dequantize,
    "swizzle_scales": _swizzle,
    "unswizzle_scales": _swizzle,
    "quantize_attention": _quantize_attention,
    "attention_scales_to_bhsd": _attention_scales_to_bhsd,
    "to_bhsd": _to_bhsd,
    "apply_rope": _rope,
    "rope_backward": _rope,
    "rope_backward_quantize": _rope_backward_quantize,
    "fused_q_uproj_rope_quant": _fused,
}


def expected(cfg: dict, ins: dict) -> dict:
    """{output name: (bits, dtype)} — every output the op must produce, bit for bit."""
    with np.errstate(all="ignore"):
        return ORACLES[cfg["op"]](cfg, ins)
