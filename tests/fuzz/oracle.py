"""Independent oracles: what every output of a config must be, bit for bit, computed with numpy and
ml_dtypes from SPEC §2-§6, include/mxmla/rope.h and README's "Semantics" (fp.py holds the
primitives). Returns {output name: (bits (numpy, logical shape), dtype name)}, or for the float
outputs of attention and gemm (float64 sums, not bit-exact across summation orders) a Tol: the
oracle's float64 value and a bound on how far another float64 evaluation can be from it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import data as D
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


# ----------------------------------------------------------------------------- attention and gemm
# These ops sum in float64 in the reference (and in fp32 on a GPU): the oracle is a float64
# computation of its own, in another summation order, so an output is checked against an interval:
# every value the output type can round x ± t to, x the oracle's float64 result and t a bound on
# the difference of two float64 evaluations (both rounding errors, scaled by the condition of the
# sum). Outside the rare elements within t of a rounding boundary that is exactly "x rounded once".
@dataclass
class Tol:
    dtype: str               # output type: bfloat16 / float32
    x: np.ndarray            # float64 values (the logical shape of the output)
    t: np.ndarray            # allowed |difference| before the output rounding (>= 0)
    exact: np.ndarray        # bool: these elements must be exactly x (bits: the bits of x)
    nan_bits: object = None  # the one NaN pattern the output must use (None: any NaN)
    what: str = ""

    def bounds(self) -> tuple:
        """(lo, hi) float64 values of the output type: the roundings of x - t and x + t."""
        t = np.where(np.isfinite(self.t), self.t, np.inf)
        with np.errstate(all="ignore"):
            t = np.where(np.isfinite(self.x), t, 0.0)
            return fp.round_f64(self.x - t, self.dtype), fp.round_f64(self.x + t, self.dtype)


ATTN_EPS = 2.0 ** -40  # float64 evaluation slack per unit of condition (d, keys <= 2^9: 2^-44 each, twice)


def _e4m3_round(y: np.ndarray) -> tuple:
    """(y rounded to E4M3, nearest even, as float64; the E4M3 quantum at y) for 0 <= y <= 448 (NaN
    kept): SPEC §5's P̃ before the / 2^8, with its own rounding (not ml_dtypes)."""
    with np.errstate(all="ignore"):
        _, E = np.frexp(y)
        q = np.ldexp(1.0, np.maximum(E - 1, -6) - 3)
        return np.minimum(np.rint(y / q) * q, 448.0), q


def _scores(Q: np.ndarray, K: np.ndarray, scale: float) -> tuple:
    """(scale·Q·Kᵀ with IEEE special values, scale·|Q|·|K|ᵀ over the finite entries): Q [G, Sq, D],
    K [Skv, D]. The products are summed by BLAS for finite rows; a row or key holding NaN / Inf is
    summed elementwise (IEEE: Inf·0, Inf - Inf are NaN, independent of the order)."""
    fq, fk = np.isfinite(Q), np.isfinite(K)
    Qf, Kf = np.where(fq, Q, 0.0), np.where(fk, K, 0.0)
    S = Qf @ Kf.T
    C = np.abs(Qf) @ np.abs(Kf).T
    for g_, i in zip(*np.nonzero(~fq.all(-1))):
        S[g_, i] = (Q[g_, i][None, :] * K).sum(-1)
    for j in np.nonzero(~fk.all(-1))[0]:
        S[:, :, j] = (Q * K[j]).sum(-1)
    return S * scale, C * scale


def _quiet(fn):
    """float64 special values are the point here: no warnings for them."""
    import functools

    @functools.wraps(fn)
    def wrap(*a, **k):
        with np.errstate(all="ignore"):
            return fn(*a, **k)

    return wrap


@_quiet
def attention_head(Q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float, n: np.ndarray, e4m3: bool,
                   flip_eps: float = None) -> tuple:
    """SPEC §5 for one kv head and the query heads that read it, in float64. Q [G, Sq, D], K [Skv, D],
    V [Skv, Dv]; n [Sq]: each row sees keys [0, n). Returns (O [G, Sq, Dv], its t, LSE [G, Sq], its t,
    rows without keys [Sq], and with flip_eps for E4M3 P the O difference that rounding P̃ the other
    way allows where 256·p is within flip_eps·(1 + E) relative of an E4M3 midpoint, else None).

    bf16 P: p_j = exp(s_j - m), m the largest visible score (NaN skipped), O = Σ p_j v_j / Σ p_j,
    LSE = m + ln Σ p_j. E4M3 P: blocks of 128 keys from key 0, running maxima m_t, P̃_j =
    e4m3(256·exp(s_j - m_t)) / 256; o and l rescaled by exp(m_{t-1} - m_t) from block to block, i.e.
    o = Σ_j P̃_j·exp(m_t(j) - m)·v_j and l = Σ_j exp(s_j - m). Masked keys never enter a sum."""
    G, Sq, _ = Q.shape
    Skv, Dv = V.shape
    ninf = -np.inf
    masked = n == 0
    if Skv == 0:
        z = np.zeros((G, Sq))
        return np.zeros((G, Sq, Dv)), np.zeros((G, Sq, Dv)), np.full((G, Sq), ninf), z, masked, None
    vis = np.arange(Skv)[None, :] < n[:, None]
    vis3 = np.broadcast_to(vis, (G, Sq, Skv))
    S, C = _scores(Q, K, scale)
    Sm = np.where(vis3, S, ninf)
    if e4m3:
        nb = fp.cdiv(Skv, 128)
        Sp = np.full((G, Sq, nb * 128), ninf)
        Sp[..., :Skv] = Sm
        bmax = np.fmax.reduce(Sp.reshape(G, Sq, nb, 128), axis=-1) if nb else np.full((G, Sq, 0), ninf)
        Mtb = np.fmax.accumulate(bmax, axis=-1) if nb else bmax  # running maximum after each block
        Mt = np.repeat(Mtb, 128, axis=-1)[..., :Skv]
        m = Mtb[..., -1] if nb else np.full((G, Sq), ninf)
    else:
        m = np.fmax.reduce(Sm, axis=-1) if Skv else np.full((G, Sq), ninf)
        Mt = m[..., None]
    P = np.where(vis3, np.exp(S - Mt), 0.0)
    if e4m3:
        F = np.exp(Mt - m[..., None])  # the product of the later blocks' rescalings
        y = P * 256.0
        yr, qy = _e4m3_round(y)
        W = np.where(vis3, yr / 256.0 * F, 0.0)
        PF = np.where(vis3, P * F, 0.0)
    else:
        F, W, PF = None, P, P
    l = PF.sum(-1)
    fv = np.isfinite(V)
    Vf = np.where(fv, V, 0.0)
    on = W @ Vf
    if not fv.all():  # NaN / Inf in V: the visible keys' terms in IEEE arithmetic
        if e4m3:  # an Inf term stays Inf through positive rescalings, turns NaN through a zero one
            alpha = np.exp(np.concatenate([np.zeros((G, Sq, 1)), Mtb[..., :-1] - Mtb[..., 1:]], axis=-1)) if nb else None
            zero_after = np.flip(np.logical_or.accumulate(np.flip(np.concatenate(
                [alpha[..., 1:] == 0, np.zeros((G, Sq, 1), bool)], axis=-1), -1), axis=-1), -1)
            zkey = np.repeat(zero_after, 128, axis=-1)[..., :Skv]
        for j, d in zip(*np.nonzero(~fv)):
            term = (yr[..., j] / 256.0 if e4m3 else P[..., j]) * V[j, d]
            if e4m3:
                term = np.where(zkey[..., j], term * 0.0, term)
            on[..., d] += np.where(vis[None, :, j], term, 0.0)
    x_o = on / l[..., None]
    x_l = m + np.log(l)
    # The bound. Two float64 evaluations of a score s_j differ by at most ATTN_EPS·C_j (C_j =
    # scale·Σ|q·k|, its condition); so s_j - m_t (p_j), m_t - m (the rescaling) and s_j - m (l) by
    # ATTN_EPS·E_j with E_j = C_j + 2·C(m_t) + C(m), C(·) the condition of the key that holds that
    # maximum; 0 for the key that is the row's maximum (p = 1 and no rescaling, exactly). Each sum
    # adds ATTN_EPS relative.
    Sn = np.where(np.isnan(Sm), ninf, Sm)  # NaN scores do not take part in the maxima
    if e4m3:
        Sp = np.full((G, Sq, nb * 128), ninf)
        Sp[..., :Skv] = Sn
        Cp = np.zeros((G, Sq, nb * 128))
        Cp[..., :Skv] = C
        bi = np.argmax(Sp.reshape(G, Sq, nb, 128), axis=-1)
        bv = np.take_along_axis(Sp.reshape(G, Sq, nb, 128), bi[..., None], -1)[..., 0]
        bc = np.take_along_axis(Cp.reshape(G, Sq, nb, 128), bi[..., None], -1)[..., 0]
        cur_v, cur_c, cur_j = np.full((G, Sq), ninf), np.zeros((G, Sq)), np.zeros((G, Sq), np.int64)
        run_c = np.zeros((G, Sq, nb))
        for t in range(nb):
            up = bv[..., t] > cur_v
            cur_v, cur_c = np.where(up, bv[..., t], cur_v), np.where(up, bc[..., t], cur_c)
            cur_j = np.where(up, 128 * t + bi[..., t], cur_j)
            run_c[..., t] = cur_c
        Cmt = np.repeat(run_c, 128, axis=-1)[..., :Skv]
        Cm, jm = cur_c, cur_j
    else:
        jm = np.argmax(Sn, axis=-1)
        Cm = np.take_along_axis(C, jm[..., None], -1)[..., 0]
        Cmt = Cm[..., None]
    E = np.where(vis3, C + 2.0 * Cmt + Cm[..., None], 0.0)
    np.put_along_axis(E, jm[..., None], 0.0, axis=-1)
    pin = PF / l[..., None]
    w_n = W / l[..., None]
    Vabs = np.abs(Vf)
    t_o = ATTN_EPS * (((pin + w_n) * (1.0 + E)) @ Vabs + np.abs(x_o) * (1.0 + (pin * E).sum(-1))[..., None])
    def flips(eps):  # P̃ can round the other way where 256·p is that close to an E4M3 midpoint: one quantum
        frac = y / qy - np.floor(y / qy)
        near = vis3 & (np.abs(frac - 0.5) * qy <= y * eps * (1.0 + E))
        return (np.where(near, qy / 256.0 * F, 0.0) / l[..., None]) @ Vabs if near.any() else 0.0

    if e4m3:
        t_o = t_o + flips(ATTN_EPS)
    t_l = ATTN_EPS * (1.0 + np.abs(x_l) + np.abs(m) + Cm + (pin * E).sum(-1))
    fl = flips(flip_eps) if e4m3 and flip_eps else None
    # rows without a visible key: O = 0, LSE = -inf, exactly
    x_o[:, masked], t_o[:, masked], x_l[:, masked], t_l[:, masked] = 0.0, 0.0, ninf, 0.0
    return x_o, t_o, x_l, t_l, masked, fl


def _mx_values(cfg: dict, ins: dict, name: str, op: dict, read_rowwise: bool, layout) -> tuple:
    """(float64 values, codes uint8) of an MXFP8 operand's read direction in its quantized shape:
    the oracle's own quantization of the source values, the config's scale and code edits, then
    code · 2^(e - 127) (e = 255: NaN)."""
    src = ins[f"{name}.src"]
    qshape = tuple(op["qshape"] if "qshape" in op else op["shape"])
    x32 = fp.to_f32(src.logical(), src.dtype).reshape(qshape)
    fmt, sl = cfg["fp8_format"], op["scale_layout"]
    if layout is not None:
        q = quantize_attention(x32, qshape, layout, fmt, read_rowwise, not read_rowwise, sl == "bhsd")
    else:
        q = quantize_plain(x32, qshape, fmt, read_rowwise, not read_rowwise, sl == "swizzled")
    d = "rowwise" if read_rowwise else "columnwise"
    sc = q[f"{d}_scale_inv"].copy()
    codes = q[f"{d}_data"].reshape(-1).copy()
    for dd, flat, byte in ins[f"{name}.sedits"]:
        if dd == (0 if read_rowwise else 1):
            sc.reshape(-1)[flat] = byte
    for flat, byte in ins[f"{name}.cedits"]:
        codes[flat] = byte
    e = element_scales(sc, qshape, layout, sl, read_rowwise).reshape(-1)
    with np.errstate(all="ignore"):
        vals = fp.fp8_to_f64(codes, fmt) * fp.e8m0_to_f64(e.astype(np.uint8))
    return vals.reshape(qshape), codes.reshape(qshape)


def attention_operands(cfg: dict, ins: dict) -> dict:
    """{role: (float64 values in the operand's format shape, codes or None)}."""
    out = {}
    for role in ("q", "k", "v"):
        op = cfg[role]
        if op["prec"] == "bf16":
            out[role] = (fp.to_f64(ins[f"{role}.x"].logical(), "bfloat16"), None)
        else:
            vals, codes = _mx_values(cfg, ins, role, op, role != "v", op["fmt"] if op["kind"] == "attn" else None)
            out[role] = (vals.reshape(op["shape"]), codes.reshape(op["shape"]))
    return out


def _to_bshd(a: np.ndarray, fmt: str) -> np.ndarray:
    """[B, S, H, D] view of an operand in its format (thd: [1, T, H, D])."""
    return {"sbhd": lambda x: x.transpose(1, 0, 2, 3), "bshd": lambda x: x, "bhsd": lambda x: x.transpose(0, 2, 1, 3),
            "thd": lambda x: x[None]}[fmt](a)


def _from_bshd(a: np.ndarray, fmt: str) -> np.ndarray:
    return {"sbhd": lambda x: x.transpose(1, 0, 2, 3), "bshd": lambda x: x, "bhsd": lambda x: x.transpose(0, 2, 1, 3),
            "thd": lambda x: x[0]}[fmt](a)


def attention_seqs(cfg: dict, ins: dict, B: int, Tq: int, Tkv: int) -> list:
    """The sequences of a config as (batch index, first query, end, first key, end) in the bshd order
    of the operands ([B, Tq, ...] queries, [B, Tkv, ...] keys; thd: batch 0, cu_seqlens' spans)."""
    if cfg["q_format"] == "thd":
        cq, ckv = ins["cu_q"], ins["cu_kv"]
        return [(0, int(cq[b]), int(cq[b + 1]), int(ckv[b]), int(ckv[b + 1])) for b in range(len(cq) - 1)]
    return [(b, 0, Tq, 0, Tkv) for b in range(B)]


def attention_softmax_scale(cfg: dict) -> float:
    """The scale the op uses: the argument (None: d_qk^-0.5) as fp32 (AttentionProblem::softmax_scale)."""
    s = cfg["softmax_scale"]
    return float(np.float32(cfg["d_qk"] ** -0.5 if s is None else s))


def attention_rows(cfg: dict, ins: dict, ops: dict = None, flip_eps: float = None) -> dict:
    """The float64 attention of a config: O, LSE (values and bounds, in the outputs' logical shapes,
    LSE as [b, h, s_q] / [h, t]), the rows without keys, and per row the largest |v| of its kv head
    and the largest scaled |q|·|k| (for the GPU bound); with flip_eps (E4M3 P) the O difference that
    P̃ rounded the other way near E4M3 midpoints allows (attention_head)."""
    ops = ops or attention_operands(cfg, ins)
    qf = cfg["q_format"]
    Q, K, V = (_to_bshd(ops[r][0], cfg[r]["fmt"]) for r in ("q", "k", "v"))
    H, Hkv, Dv = cfg["H"], cfg["H_kv"], cfg["d_v"]
    grp = H // Hkv
    scale = attention_softmax_scale(cfg)
    e4m3 = cfg["p_format"] == "e4m3"
    Bq, Tq = Q.shape[0], Q.shape[1]
    xo, to = np.zeros((Bq, Tq, H, Dv)), np.zeros((Bq, Tq, H, Dv))
    xl, tl = np.full((Bq, Tq, H), -np.inf), np.zeros((Bq, Tq, H))
    nokey = np.ones((Bq, Tq, H), bool)  # thd tokens after the last sequence: O = 0, LSE = -inf
    vmax, cmax = np.zeros((Bq, Tq, H)), np.zeros((Bq, Tq, H))
    flip = np.zeros((Bq, Tq, H, Dv))
    seqs = attention_seqs(cfg, ins, Q.shape[0], Q.shape[1], K.shape[1])
    causal, br = cfg["causal"] != "none", cfg["causal"] == "bottom_right"
    with np.errstate(all="ignore"):
        for bb, q0, q1, k0, k1 in seqs:
            sq, skv = q1 - q0, k1 - k0
            if sq == 0:
                continue
            i = np.arange(sq)
            n = np.clip(i + 1 + (skv - sq if br else 0), 0, skv) if causal else np.full(sq, skv)
            for hk in range(Hkv):
                hs = slice(hk * grp, (hk + 1) * grp)
                Qg = Q[bb, q0:q1, hs].transpose(1, 0, 2)
                Kh, Vh = K[bb, k0:k1, hk], V[bb, k0:k1, hk]
                x_o, t_o, x_l, t_l, masked, fl = attention_head(Qg, Kh, Vh, scale, n, e4m3, flip_eps)
                if fl is not None:
                    flip[bb, q0:q1, hs] = np.broadcast_to(fl, x_o.shape).transpose(1, 0, 2)
                xo[bb, q0:q1, hs] = x_o.transpose(1, 0, 2)
                to[bb, q0:q1, hs] = t_o.transpose(1, 0, 2)
                xl[bb, q0:q1, hs] = x_l.T
                tl[bb, q0:q1, hs] = t_l.T
                nokey[bb, q0:q1, hs] = masked[:, None]
                fin = np.isfinite(Vh)
                vmax[bb, q0:q1, hs] = np.abs(np.where(fin, Vh, 0.0)).max() if Vh.size else 0.0
                Qf, Kf = np.where(np.isfinite(Qg), Qg, 0.0), np.where(np.isfinite(Kh), Kh, 0.0)
                C = scale * (np.abs(Qf) @ np.abs(Kf).T)
                vis = np.arange(skv)[None, :] < n[:, None]
                cmax[bb, q0:q1, hs] = (np.where(vis[None], C, 0.0).max(-1) if skv else np.zeros((grp, sq))).T
    xo[nokey], to[nokey] = 0.0, 0.0
    xl[nokey], tl[nokey] = -np.inf, 0.0
    lse_shape = lambda a: a[0].T if qf == "thd" else a.transpose(0, 2, 1)  # noqa: E731  [h, t] / [b, h, s]
    rows = lambda a: _from_bshd(a[..., None], qf)[..., 0]  # noqa: E731  O's layout without d
    flip[nokey] = 0.0
    return dict(o=_from_bshd(xo, qf), t_o=_from_bshd(to, qf), nokey=rows(nokey), lse=lse_shape(xl),
                t_lse=lse_shape(tl), nokey_lse=lse_shape(nokey), vmax=rows(vmax), cmax_lse=lse_shape(cmax),
                flip_o=_from_bshd(flip, qf), ops=ops)


def _attention(cfg, ins):
    a = attention_rows(cfg, ins)
    ops = a["ops"]
    ex = np.broadcast_to(a["nokey"][..., None], a["o"].shape)
    res = {"o": Tol("bfloat16", a["o"], a["t_o"], ex.copy(), fp.CANON_NAN["bfloat16"], "O")}
    if cfg["return_lse"]:
        res["lse"] = Tol("float32", a["lse"], a["t_lse"], a["nokey_lse"].copy(), None, "LSE")
    res["layout"] = (np.frombuffer(cfg["expected_layout"].encode(), np.uint8).copy(), "uint8")
    res.update(_attention_bases(cfg, ins, ops))
    return res


def _attention_bases(cfg: dict, ins: dict, ops: dict) -> dict:
    """The inputs' buffers after the op: as they were given (bf16), or the poison with the codes
    (edited) copied into their views."""
    res = {}
    for role in ("q", "k", "v"):
        op = cfg[role]
        key = f"{'pack' if op.get('packed') else role}"
        if op["prec"] == "bf16":
            res[f"{key}.base"] = (ins[f"{role}.x"].base, "bfloat16")
        elif op["place"] == "view":
            prev = res.get(f"{key}.codes_base")
            base = prev[0] if prev is not None else ins[f"{role}.codes_base"].copy()
            v = D.View.from_json(op["view"])
            if v.base_numel and all(v.shape):
                base[v.positions()] = ops[role][1]
            res[f"{key}.codes_base"] = (base, "uint8")
    return res


def _bwd_copies(cfg: dict, ins: dict, ops: dict) -> dict:
    """{role: (values through the rowwise copy, values through the columnwise copy)} of q, k, v, do in
    their format shapes: an MXFP8 operand's second copy exists where it was quantized in both
    directions and kept as quantized; a missing copy falls back to the other (README: the backward)."""
    out = {}
    for role in ("q", "k", "v"):
        op = cfg[role]
        read = ops[role][0]
        if op["prec"] == "bf16":
            out[role] = (read, read)
            continue
        read_row = role != "v"
        other = read
        if op["dirs"] == "both" and op["place"] != "view":
            other = _mx_values(cfg, ins, role, op, not read_row, op["fmt"] if op["kind"] == "attn" else None)[0]
            other = other.reshape(op["shape"])
        out[role] = (read, other) if read_row else (other, read)
    do = cfg["do"]
    if do["mx"]:
        x32 = fp.to_f32(ins["do.src"].logical(), "bfloat16")
        shape, qf = tuple(do["shape"]), cfg["q_format"]
        q = quantize_attention(x32, shape, qf, cfg["fp8_format"], True, True, False)
        out["do"] = tuple(fp.fp8_to_f64(q[f"{d}_data"], cfg["fp8_format"]) * fp.e8m0_to_f64(
            element_scales(q[f"{d}_scale_inv"], shape, qf, "compact", d == "rowwise")) for d in ("rowwise", "columnwise"))
    else:
        v = fp.to_f64(ins["do.x"].logical(), "bfloat16")
        out["do"] = (v, v)
    return out


def backward_inputs(cfg: dict, ins: dict, ops: dict = None) -> tuple:
    """(O as bf16 bits in q's format shape, LSE float32 [b, h, s_q] / [h, t]) a backward config gets:
    this oracle's float64 forward rounded once (runner passes the same to every device)."""
    a = attention_rows(cfg, ins, ops)
    with np.errstate(all="ignore"):
        return fp.bits_f64(a["o"], "bfloat16"), np.float32(a["lse"])


def attention_backward_grads(cfg: dict, ins: dict) -> dict:
    """SPEC §5's backward in float64 (README: the backward), from the oracle's own operands and the
    inputs O, LSE of backward_inputs: per sequence and kv head,
    S = Q_row·K_rowᵀ·scale, P = exp(S − LSE) on the visible keys, dP = dO_row·V_rowᵀ,
    D = rowsum(O ⊙ dO_row), dS = bf16(P ⊙ (dP − D)·scale), dV = bf16(P)ᵀ·dO_col, dQ = dS·K_col,
    dK = dSᵀ·Q_col, the query heads of a kv head summed. Returns float64 dq, dk, dv (unrounded, in the
    operands' format shapes) and per gradient the largest |term|·count bound of its (batch, head)."""
    ops = attention_operands(cfg, ins)
    cp = {r: tuple(_to_bshd(x, cfg[r]["fmt"] if r != "do" else cfg["q_format"]) for x in v)
          for r, v in _bwd_copies(cfg, ins, ops).items()}
    qf = cfg["q_format"]
    o_bits, lse32 = backward_inputs(cfg, ins, ops)
    O = _to_bshd(fp.to_f64(o_bits, "bfloat16"), qf)
    lse32 = lse32.astype(np.float64)  # [b, h, s] / [h, t]
    L = lse32[None].transpose(0, 2, 1) if qf == "thd" else lse32.transpose(0, 2, 1)  # [B, T, H]
    H, Hkv = cfg["H"], cfg["H_kv"]
    grp = H // Hkv
    scale = attention_softmax_scale(cfg)
    (qr, qc), (kr, kc), (vr, _), (dor, doc) = cp["q"], cp["k"], cp["v"], cp["do"]
    dq, dk, dv = np.zeros(qr.shape), np.zeros(kr.shape), np.zeros((kr.shape[0], kr.shape[1], Hkv, cfg["d_v"]))
    aq, ak, av = np.zeros(dq.shape), np.zeros(dk.shape), np.zeros(dv.shape)  # the same sums of |terms|
    seqs = attention_seqs(cfg, ins, qr.shape[0], qr.shape[1], kr.shape[1])
    causal, br = cfg["causal"] != "none", cfg["causal"] == "bottom_right"
    bf = lambda x: fp.round_f64(x, "bfloat16")  # noqa: E731  (one rounding: not from_f64's, via fp32)
    with np.errstate(all="ignore"):
        for bb, q0, q1, k0, k1 in seqs:
            sq, skv = q1 - q0, k1 - k0
            if sq == 0 or skv == 0:
                continue
            i = np.arange(sq)
            n = np.clip(i + 1 + (skv - sq if br else 0), 0, skv) if causal else np.full(sq, skv)
            vis = np.arange(skv)[None, :] < n[:, None]  # [sq, skv]
            for hk in range(Hkv):
                for h in range(hk * grp, (hk + 1) * grp):
                    S = qr[bb, q0:q1, h] @ kr[bb, k0:k1, hk].T * scale
                    P = np.where(vis, np.exp(S - L[bb, q0:q1, h][:, None]), 0.0)
                    dP = dor[bb, q0:q1, h] @ vr[bb, k0:k1, hk].T
                    D = (O[bb, q0:q1, h] * dor[bb, q0:q1, h]).sum(-1)[:, None]
                    dS = bf(np.where(vis, P * (dP - D) * scale, 0.0))
                    dv[bb, k0:k1, hk] += bf(P).T @ doc[bb, q0:q1, h]
                    dk[bb, k0:k1, hk] += dS.T @ qc[bb, q0:q1, h]
                    dq[bb, q0:q1, h] = dS @ kc[bb, k0:k1, hk]
                    Da = (np.abs(O[bb, q0:q1, h]) * np.abs(dor[bb, q0:q1, h])).sum(-1)[:, None]
                    Sa = P * (np.abs(dor[bb, q0:q1, h]) @ np.abs(vr[bb, k0:k1, hk]).T + Da) * scale
                    av[bb, k0:k1, hk] += P.T @ np.abs(doc[bb, q0:q1, h])
                    ak[bb, k0:k1, hk] += Sa.T @ np.abs(qc[bb, q0:q1, h])
                    aq[bb, q0:q1, h] = Sa @ np.abs(kc[bb, k0:k1, hk])
    f = {n: cfg[r]["fmt"] for n, r in (("q", "q"), ("k", "k"), ("v", "v"))}
    return dict(dq=_from_bshd(dq, f["q"]), dk=_from_bshd(dk, f["k"]), dv=_from_bshd(dv, f["v"]),
                abs_dq=_from_bshd(aq, f["q"]), abs_dk=_from_bshd(ak, f["k"]), abs_dv=_from_bshd(av, f["v"]), ops=ops)


# float64 evaluation slack per unit of Σ|terms|: the reference's sequential sums and this
# emulation's BLAS ones (up to ~2^17 terms a gradient element, 2^-53 each, with margin)
BWD_EPS = 2.0 ** -32


def _attention_backward(cfg, ins):
    """dQ, dK, dV within float64 slack of the emulation above (BWD_EPS·Σ|terms|; a bf16 rounding of
    P or dS can flip only where the two float64 evaluations straddle its boundary, which the slack
    does not cover: far rarer than the configs run), and the inputs' buffers (dO's too)."""
    g = attention_backward_grads(cfg, ins)
    res = {}
    for name in ("dq", "dk", "dv"):
        x = g[name]
        res[name] = Tol("bfloat16", x, BWD_EPS * g["abs_" + name], np.zeros(x.shape, bool), fp.CANON_NAN["bfloat16"],
                        name)
    res.update(_attention_bases(cfg, ins, g["ops"]))
    if not cfg["do"]["mx"]:
        res["do.base"] = (ins["do.x"].base, "bfloat16")
    return res


def gemm_operands(cfg: dict, ins: dict) -> dict:
    """{name: (float64 values of the stored matrix through the copy read, codes or None)}."""
    out = {}
    for name in ("a", "b"):
        op = cfg[name]
        if cfg["prec"] == "bf16":
            out[name] = (fp.to_f64(ins[f"{name}.x"].logical(), "bfloat16"), None)
        else:
            out[name] = _mx_values(cfg, ins, name, op, op["read"] == "rowwise", None)
    return out


def gemm_sums(cfg: dict, ins: dict, ops: dict = None) -> tuple:
    """(op(A)·op(B) in float64 with IEEE special values, |op(A)|·|op(B)| over the finite entries)."""
    ops = ops or gemm_operands(cfg, ins)
    A, B = ops["a"][0], ops["b"][0]
    A = A.T if cfg["trans_a"] else A
    B = B.T if cfg["trans_b"] else B
    fa, fb = np.isfinite(A), np.isfinite(B)
    Af, Bf = np.where(fa, A, 0.0), np.where(fb, B, 0.0)
    with np.errstate(all="ignore"):
        S = Af @ Bf
        Sabs = np.abs(Af) @ np.abs(Bf)
        for i in np.nonzero(~fa.all(1))[0]:
            S[i] = (A[i][:, None] * B).sum(0)
        for j in np.nonzero(~fb.all(0))[0]:
            S[:, j] = (A * B[:, j][None, :]).sum(1)
    return S, Sabs


def _gemm(cfg, ins):
    ops = gemm_operands(cfg, ins)
    S, Sabs = gemm_sums(cfg, ins, ops)
    dt = cfg["out_dtype"] or "bfloat16"
    alpha = float(cfg["alpha"])
    with np.errstate(all="ignore"):
        x = S * alpha  # the reference's order: the sum, · alpha, + D
        if cfg["accumulate"]:
            x = x + fp.to_f64(ins["out"].logical(), dt)
        if cfg["int_data"]:  # every sum exact: the same float64 operations on the same values
            t = np.zeros_like(x)
        else:
            t = (cfg["K"] + 2) * 2.0 ** -52 * Sabs * abs(alpha) + np.abs(x) * 2.0 ** -51
    res = {"d": Tol(dt, x, t, np.zeros(x.shape, bool), fp.CANON_NAN[dt], "D")}
    if cfg["out"] == "view":
        o = ins["out"]
        raw = o.base.reshape(-1).view(np.uint8)
        res["out_outside"] = (raw[~np.repeat(o.view.covered(), fp.ITEMSIZE[dt])].copy(), "uint8")
    for name in ("a", "b"):
        op = cfg[name]
        if cfg["prec"] == "bf16":
            res[f"{name}.base"] = (ins[f"{name}.x"].base, "bfloat16")
        elif op["place"] == "view":
            base = ins[f"{name}.codes_base"].copy()
            v = D.View.from_json(op["view"])
            if all(v.shape):
                base[v.positions()] = ops[name][1]
            res[f"{name}.codes_base"] = (base, "uint8")
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
    "attention": _attention,
    "attention_backward": _attention_backward,
    "gemm": _gemm,
}


def expected(cfg: dict, ins: dict) -> dict:
    """{output name: (bits, dtype)} — every output the op must produce, bit for bit."""
    with np.errstate(all="ignore"):
        return ORACLES[cfg["op"]](cfg, ins)
