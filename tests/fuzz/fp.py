"""Numeric primitives of the oracles, written from SPEC §2 / include/mxmla/rope.h with numpy and
ml_dtypes (no code shared with the library): bit views of the float types, round-to-nearest-even
conversions with the library's canonical NaN patterns, an exact fp32 fused multiply-add, the
MXFP8 block rule and the scale layouts (compact, F8_128x4 swizzle, BHSD).

Storage convention used everywhere in the fuzz package: a tensor's raw data is a numpy array of
its bits — uint16 for bfloat16 and float16, uint32 for float32, uint8 for codes and scales.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "uint8": np.uint8,
        "int32": np.int32, "int64": np.int64}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int32": 4, "int64": 8}
CANON_NAN = {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000}

# fp8 format: (ml_dtypes type, max normal, max code (positive), fp32 bits of 1/max, mantissa bits, emin)
FMT = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 0x7E, 0x3B124925, 3, -6),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 0x7B, 0x37924925, 2, -14),
}


# ----------------------------------------------------------------------------- bits <-> values
def to_f64(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Exact float64 values of raw bits (NaN payloads are lost; use the bits for those)."""
    bits = np.asarray(bits)
    with np.errstate(all="ignore"):
        return _to_f64(bits, dtype)


def _to_f64(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "float16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    if dtype == "float32":
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    raise ValueError(dtype)


def to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return to_f64(bits, dtype).astype(np.float32)


def from_f64(v: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values -> bits of `dtype`, round-to-nearest-even (overflow -> Inf), NaN -> the
    canonical pattern (bf16 0x7FC0, fp16 0x7E00, fp32 0x7FC00000). bfloat16 goes through float32
    (ml_dtypes): a double rounding, exact for values that fit float32 (inputs, fp32 results);
    bits_f64 rounds a float64 result once."""
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(all="ignore"):
        if dtype == "bfloat16":
            out = v.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
        elif dtype == "float16":
            out = v.astype(np.float16).view(np.uint16).copy()
        elif dtype == "float32":
            out = v.astype(np.float32).view(np.uint32).copy()
        else:
            raise ValueError(dtype)
    out[np.isnan(v)] = CANON_NAN[dtype]
    return out


def from_f32(v: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> bits of `dtype` (one rounding from the fp32 value; NaN canonical)."""
    v = np.asarray(v, dtype=np.float32)
    if dtype == "float32":
        out = v.view(np.uint32).copy()
        out[np.isnan(v)] = CANON_NAN["float32"]
        return out
    with np.errstate(all="ignore"):
        if dtype == "bfloat16":
            out = v.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
        else:
            out = v.astype(np.float16).view(np.uint16).copy()
    out[np.isnan(v)] = CANON_NAN[dtype]
    return out


def convert_bits(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """An element converted from one float dtype to another: the same bits when the dtype does not
    change (NaN payloads included), else one rounding of the exact value (NaN canonical)."""
    if src == dst:
        return np.asarray(bits).astype(BITS[dst]).copy()
    return from_f64(to_f64(bits, src), dst)


# ----------------------------------------------------------------------------- exact fp32 arithmetic
def mul_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fp32 product rounded once (the float64 product of two fp32 values is exact)."""
    with np.errstate(all="ignore"):
        return (np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32).astype(np.float64)).astype(np.float32)


_F32_MAX = float(np.finfo(np.float32).max)
_F32_OVF_TIE = 2.0 ** 128 - 2.0 ** 103  # halfway between the largest fp32 and 2^128


def fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) of fp32 arrays, exactly rounded once (IEEE fused multiply-add).

    p = a*b is exact in float64; s + e = p + c exactly (TwoSum). fp32(s) is the correctly rounded
    result unless s sits exactly halfway between two fp32 neighbours and e != 0 (a double rounding):
    then the neighbour on e's side is taken. Non-finite sums are IEEE's (Inf - Inf = NaN)."""
    a = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32).astype(np.float64)
    c = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        e = (p - (s - bb)) + (c - bb)
        r = s.astype(np.float32)
        fin = np.isfinite(s) & np.isfinite(e)
        r64 = r.astype(np.float64)
        # the other fp32 neighbour of s
        toward = np.where(s > r64, np.inf, -np.inf).astype(np.float32)
        other = np.nextafter(r, toward)
        o64 = other.astype(np.float64)
        # r overflowed to Inf while s is finite: only the exact tie 2^128 - 2^103 is in doubt
        ovf = fin & np.isinf(r) & (np.abs(s) == _F32_OVF_TIE)
        normal = fin & np.isfinite(r) & np.isfinite(other) & (r64 != s)
        tie = normal & ((s - r64) == (o64 - s)) & (e != 0)
        # e's side: e > 0 takes the larger neighbour
        larger = np.where(r64 > o64, r, other)
        smaller = np.where(r64 > o64, other, r)
        r = np.where(tie, np.where(e > 0, larger, smaller), r)
        # at the overflow tie: toward zero when e points toward zero
        back = ovf & (np.sign(e) == -np.sign(s))
        r = np.where(back, np.copysign(np.float32(_F32_MAX), s).astype(np.float32), r)
    return r.astype(np.float32)


# ----------------------------------------------------------------------------- MXFP8 (SPEC §2)
def e8m0_from_amax(amax: np.ndarray, fmt: str) -> np.ndarray:
    """float_to_e8m0(fp32(amax * fp32(1/max))) for finite non-negative fp32 amax (SPEC §2's bit rule)."""
    rcp = np.array([FMT[fmt][3]], np.uint32).view(np.float32)[0]
    with np.errstate(all="ignore"):
        v = (np.asarray(amax, np.float32) * rcp).astype(np.float32)
    bits = v.view(np.uint32)
    e = (bits >> 23).astype(np.int64)
    m = (bits & 0x7FFFFF).astype(np.int64)
    up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    return (e + up).astype(np.uint8)


def quant_multiplier(e: np.ndarray) -> np.ndarray:
    """2^(127 - e) as fp32; e = 0 -> 1 (TransformerEngine), e = 254 -> 2^-127 (fp32 subnormal)."""
    e = np.asarray(e).astype(np.int64)
    m = np.ldexp(np.float32(1.0), (127 - np.clip(e, 1, 254)).astype(np.int32)).astype(np.float32)
    return np.where(e == 0, np.float32(1.0), m).astype(np.float32)


def quantize_blocks(x: np.ndarray, fmt: str) -> tuple:
    """MXFP8 of fp32 blocks along the last axis (x [..., n], n <= 32; tail blocks padded with +0 by
    the caller). Returns (codes uint8 [..., n], scales uint8 [...]), with the (beyond TE) rules: a
    block holding NaN -> scale 0xFF, every code 0x7F; holding ±Inf (no NaN) -> 0xFE, multiplier
    2^-127, codes saturate."""
    f8, maxn, maxcode = FMT[fmt][0], FMT[fmt][1], FMT[fmt][2]
    x = np.asarray(x, np.float32)
    nan = np.isnan(x).any(-1)
    inf = np.isinf(x).any(-1) & ~nan
    with np.errstate(all="ignore"):
        amax = np.where(np.isfinite(x), np.abs(x), np.float32(0)).max(-1) if x.shape[-1] else np.zeros(x.shape[:-1], np.float32)
        e = e8m0_from_amax(amax, fmt)
        e = np.where(nan, 0xFF, np.where(inf, 0xFE, e)).astype(np.uint8)
        mult = quant_multiplier(np.where(nan, 1, e))
        y = (x * mult[..., None]).astype(np.float32)  # fp32 multiply (exact: mult is a power of two, or rounds to ±0 later)
        codes = y.astype(f8).view(np.uint8).copy()
        sat = np.abs(y) > maxn  # cvt.rn.satfinite: ±max for anything past max (Inf included)
    codes[sat] = np.where(np.signbit(y[sat]), 0x80, 0x00).astype(np.uint8) | maxcode
    codes[np.broadcast_to(nan[..., None], codes.shape)] = 0x7F
    return codes, e


def quantize_2d(x: np.ndarray, fmt: str, rowwise: bool) -> tuple:
    """x fp32 [M, K] (K % 32 == 0) -> (codes [M, K], compact scales) of one direction:
    rowwise [M, K/32]; columnwise [ceil(M/32), K] (tail blocks over the rows present)."""
    M, K = x.shape
    if rowwise:
        codes, sc = quantize_blocks(x.reshape(M, K // 32, 32), fmt)
        return codes.reshape(M, K), sc.reshape(M, K // 32)
    Mb = -(-M // 32)
    xp = np.zeros((Mb * 32, K), np.float32)
    xp[:M] = x
    blocks = xp.reshape(Mb, 32, K).transpose(0, 2, 1)  # [Mb, K, 32]
    codes, sc = quantize_blocks(blocks, fmt)
    return codes.transpose(0, 2, 1).reshape(Mb * 32, K)[:M].copy(), sc.reshape(Mb, K)


def fp8_to_f64(codes: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(codes, np.uint8).view(FMT[fmt][0]).astype(np.float64)


def e8m0_to_f64(e: np.ndarray) -> np.ndarray:
    e = np.asarray(e, np.uint8)
    v = np.ldexp(1.0, e.astype(np.int32) - 127)
    return np.where(e == 255, np.nan, v)


def dequant_values(codes: np.ndarray, elem_scales: np.ndarray, fmt: str, out_dtype: str) -> np.ndarray:
    """codes * 2^(e - 127) (exact in float64; e = 255 -> NaN) -> bits of fp32 / bf16 (via the fp32
    value; one NaN pattern)."""
    with np.errstate(all="ignore"):
        v = fp8_to_f64(codes, fmt) * e8m0_to_f64(elem_scales)
        f = v.astype(np.float32)
    return from_f32(f, out_dtype)


# ----------------------------------------------------------------------------- scale layouts (SPEC §2.1, §2.2)
def rup(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def swizzle_view(S: np.ndarray, rows_pad: int, cols_pad: int) -> np.ndarray:
    """SPEC §2.1's torch-view formula on the trailing two axes (leading axes are batches): pad with
    zeros, then S.view(rows/128, 4, 32, cols/4, 4).permute(0, 3, 2, 1, 4)."""
    lead = S.shape[:-2]
    P = np.zeros(lead + (rows_pad, cols_pad), np.uint8)
    P[..., : S.shape[-2], : S.shape[-1]] = S
    n = len(lead)
    v = P.reshape(lead + (rows_pad // 128, 4, 32, cols_pad // 4, 4))
    perm = tuple(range(n)) + tuple(n + i for i in (0, 3, 2, 1, 4))
    return v.transpose(perm).reshape(lead + (rows_pad, cols_pad))


def unswizzle_index(buf: np.ndarray, rows: int, cols: int, rows_pad: int, cols_pad: int) -> np.ndarray:
    """The inverse, through SPEC §2.1's index formula: element (i, j) of the [rows, cols] matrix
    sits at ((i/128)·tiles_x + j/4)·512 + (i%32)·16 + ((i%128)/32)·4 + (j%4) of the flat buffer
    (leading axes of `buf` are batches of rows_pad·cols_pad bytes)."""
    lead = buf.shape[:-2] if buf.ndim >= 2 else ()
    flat = buf.reshape(lead + (rows_pad * cols_pad,))
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    tiles_x = cols_pad // 4
    idx = ((i // 128) * tiles_x + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)
    return flat[..., idx]


def padding_mask_swizzled(rows: int, cols: int, rows_pad: int, cols_pad: int) -> np.ndarray:
    """True at the bytes of a swizzled [rows_pad, cols_pad] buffer that hold no real entry."""
    return swizzle_view(np.ones((rows, cols), np.uint8), rows_pad, cols_pad) == 0


def swizzled_shape(M: int, K: int, rowwise: bool) -> tuple:
    return (rup(M, 128), rup(K // 32, 4)) if rowwise else (rup(cdiv(M, 32), 4), rup(K, 128))


def swizzle(compact: np.ndarray, M: int, K: int, rowwise: bool) -> np.ndarray:
    """Compact scales of an [M, K] tensor -> swizzled buffer (shape of quantize_shapes(swizzle=True))."""
    if rowwise:
        return swizzle_view(compact, rup(M, 128), rup(K // 32, 4))
    Mb = cdiv(M, 32)
    return swizzle_view(compact.T, rup(K, 128), rup(Mb, 4)).reshape(rup(Mb, 4), rup(K, 128))


def unswizzle(buf: np.ndarray, M: int, K: int, rowwise: bool) -> np.ndarray:
    if rowwise:
        return unswizzle_index(buf, M, K // 32, rup(M, 128), rup(K // 32, 4))
    Mb = cdiv(M, 32)
    return unswizzle_index(buf, K, Mb, rup(K, 128), rup(Mb, 4)).T.copy()


def swizzle_padding(M: int, K: int, rowwise: bool) -> np.ndarray:
    if rowwise:
        return padding_mask_swizzled(M, K // 32, rup(M, 128), rup(K // 32, 4))
    Mb = cdiv(M, 32)
    return padding_mask_swizzled(K, Mb, rup(K, 128), rup(Mb, 4)).reshape(rup(Mb, 4), rup(K, 128))


# Attention geometry: shape [s, b, h, d] (sbhd) or [b, s, h, d] (bshd).
def attn_dims(shape, layout: str) -> tuple:
    if layout == "sbhd":
        S, B, H, D = shape
    else:
        B, S, H, D = shape
    return S, B, H, D


def attention_compact_shapes(shape, layout: str) -> tuple:
    S, B, H, D = attn_dims(shape, layout)
    Sb = cdiv(S, 32)
    col = (Sb, B * H * D) if layout == "sbhd" else (B * Sb, H * D)
    return (S * B * H, D // 32), col


def bhsd_shapes(shape, layout: str) -> tuple:
    S, B, H, D = attn_dims(shape, layout)
    return (B, H, rup(S, 128), rup(D // 32, 4)), (B, H, rup(cdiv(S, 32), 4), rup(D, 128))


def compact_to_bhs(compact: np.ndarray, shape, layout: str, rowwise: bool) -> np.ndarray:
    """Compact attention scales -> per-(b, h) compact matrices [B, H, rows, cols]:
    rowwise [S, D/32], columnwise [ceil(S/32), D]."""
    S, B, H, D = attn_dims(shape, layout)
    Sb = cdiv(S, 32)
    if rowwise:
        r = compact.reshape((S, B, H, D // 32) if layout == "sbhd" else (B, S, H, D // 32))
        return (r.transpose(1, 2, 0, 3) if layout == "sbhd" else r.transpose(0, 2, 1, 3)).copy()
    c = compact.reshape((Sb, B, H, D) if layout == "sbhd" else (B, Sb, H, D))
    return (c.transpose(1, 2, 0, 3) if layout == "sbhd" else c.transpose(0, 2, 1, 3)).copy()


def bhs_to_compact(m: np.ndarray, shape, layout: str, rowwise: bool) -> np.ndarray:
    S, B, H, D = attn_dims(shape, layout)
    rs, cs = attention_compact_shapes(shape, layout)
    t = m.transpose(2, 0, 1, 3) if layout == "sbhd" else m.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(t).reshape(rs if rowwise else cs)


def to_bhsd(compact: np.ndarray, shape, layout: str, rowwise: bool) -> np.ndarray:
    """Compact attention scales -> BHSD: each (b, h) matrix swizzled (SPEC §2.2), padding zero."""
    S, B, H, D = attn_dims(shape, layout)
    m = compact_to_bhs(compact, shape, layout, rowwise)
    if rowwise:
        return swizzle_view(m, rup(S, 128), rup(D // 32, 4))
    Sb = cdiv(S, 32)
    sw = swizzle_view(m.transpose(0, 1, 3, 2), rup(D, 128), rup(Sb, 4))
    return sw.reshape(B, H, rup(Sb, 4), rup(D, 128))


def from_bhsd(buf: np.ndarray, shape, layout: str, rowwise: bool) -> np.ndarray:
    """BHSD scales -> compact attention scales (the inverse, through the index formula)."""
    S, B, H, D = attn_dims(shape, layout)
    Sb = cdiv(S, 32)
    if rowwise:
        m = unswizzle_index(buf, S, D // 32, rup(S, 128), rup(D // 32, 4))
    else:
        m = unswizzle_index(buf.reshape(B, H, rup(D, 128), rup(Sb, 4)), D, Sb, rup(D, 128), rup(Sb, 4)).transpose(0, 1, 3, 2)
    return bhs_to_compact(m, shape, layout, rowwise)


def bhsd_padding(shape, layout: str, rowwise: bool) -> np.ndarray:
    S, B, H, D = attn_dims(shape, layout)
    rs, cs = attention_compact_shapes(shape, layout)
    ones = np.ones(rs if rowwise else cs, np.uint8)
    return to_bhsd(ones, shape, layout, rowwise) == 0


# ----------------------------------------------------------------------------- one rounding of float64 values
# (mantissa bits, smallest normal exponent, largest finite) of the output types
_ROUND = {"bfloat16": (7, -126, 3.3895313892515355e38), "float16": (10, -14, 65504.0),
          "float32": (23, -126, float(np.finfo(np.float32).max))}


def round_f64(v: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded once to `dtype` (nearest even; overflow -> ±Inf; NaN kept), returned as
    float64 values. (ml_dtypes converts float64 -> bfloat16 through float32, a double rounding, so
    from_f64 is not used where a float64 result is rounded.)"""
    mant, emin, maxf = _ROUND[dtype]
    v = np.asarray(v, np.float64)
    with np.errstate(all="ignore"):
        _, E = np.frexp(v)  # |v| = f·2^E, f in [0.5, 1)
        q = np.ldexp(1.0, np.maximum(E - 1, emin) - mant)
        r = np.rint(v / q) * q  # v / q is exact (q a power of two) and small: rint is the rounding
        r = np.where(np.abs(r) > maxf, np.copysign(np.inf, v), r)
        return np.where(np.isfinite(v), r, v)


def bits_f64(v: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values -> bits of `dtype`, one rounding (round_f64), NaN canonical."""
    r = round_f64(v, dtype)
    if dtype == "float32":
        return from_f64(r, "float32")
    with np.errstate(all="ignore"):  # r is representable: this conversion is exact
        out = r.astype(np.float32).view(np.uint32) >> 16 if dtype == "bfloat16" else r.astype(np.float16).view(np.uint16)
    out = out.astype(np.uint16)
    out[np.isnan(r)] = CANON_NAN[dtype]
    return out
