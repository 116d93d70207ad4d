"""Input data of the fuzzers: float values with special patterns per 32-element block, strided
views over poisoned base buffers, tables and cu_seqlens. Everything is a function of a numpy
Generator, so a config's inputs are reproduced from its data seed alone."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import fp

# exponent of the smallest normal / subnormal, the largest exponent, explicit mantissa bits
DT = {
    "bfloat16": dict(emin=-126, esub=-133, emax=127, mant=7, maxf=float(np.finfo(np.float32).max) * (1 - 2 ** -9)),
    "float16": dict(emin=-14, esub=-24, emax=15, mant=10, maxf=65504.0),
    "float32": dict(emin=-126, esub=-149, emax=127, mant=23, maxf=float(np.finfo(np.float32).max)),
}
# NaN patterns with payloads and both signs (the library writes one canonical NaN; inputs may hold any)
NAN_BITS = {
    "bfloat16": [0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFFA5, 0x7FD3],
    "float16": [0x7E00, 0xFE00, 0x7C01, 0x7FFF, 0xFD55, 0x7E3C],
    "float32": [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFA5A5A5, 0x7FC0BEEF],
}
INF_BITS = {"bfloat16": (0x7F80, 0xFF80), "float16": (0x7C00, 0xFC00), "float32": (0x7F800000, 0xFF800000)}

MAX_SPECIAL_BLOCKS = 192  # per tensor (a huge tensor gets that many, at random places)
SPECIALS = ("zero", "denorm", "e0_edge", "halfway", "satur", "maxfinite", "nan", "inf", "naninf", "exp_hi", "exp_lo")


# ----------------------------------------------------------------------------- float values
def _fp8_midpoints(fmt: str) -> np.ndarray:
    f8 = fp.FMT[fmt][0]
    v = np.arange(0, fp.FMT[fmt][2] + 1, dtype=np.uint8).view(f8).astype(np.float64)
    return (v[:-1] + v[1:]) / 2


def _ulp(v: np.ndarray, dtype: str) -> np.ndarray:
    d = DT[dtype]
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** d["emin"])))
    return np.ldexp(1.0, (e - d["mant"]).astype(np.int64))


def _special_block(rng: np.random.Generator, n: int, dtype: str, fmt: str, kind: str) -> tuple:
    """Values (float64) of one block of n and, for NaN / Inf kinds, (positions, bit patterns) to
    write over them."""
    d = DT[dtype]
    maxn = fp.FMT[fmt][1]
    over = []
    if kind == "zero":
        v = np.where(rng.random(n) < 0.3, -0.0, 0.0)
    elif kind == "denorm":
        # random subnormals of the dtype
        k = rng.integers(1, 2 ** min(d["mant"], 20), n)
        v = np.ldexp(k.astype(np.float64), d["emin"] - d["mant"]) * rng.choice([-1.0, 1.0], n)
    elif kind == "e0_edge":
        # amax * (1/max) around 2^-127: the e = 0 / e = 1 boundary (TE: up only when m > 0x400000)
        base = maxn * 2.0 ** -127 * rng.choice([0.5, 0.75, 1.0, 1.5, 2.0, 0.9999, 1.0001])
        v = rng.standard_normal(n) * base / 4
        v[rng.integers(n)] = base
    elif kind == "halfway":
        # amax = max * 2^k fixes the scale; the others at fp8 midpoints (or one ulp off) times 2^k
        k = int(rng.integers(max(-120, d["emin"] + 12), min(100, d["emax"] - 17) + 1))
        mids = _fp8_midpoints(fmt)
        v = rng.choice(mids, n) * rng.choice([-1.0, 1.0], n) * 2.0 ** k
        v = v + rng.integers(-1, 2, n) * (rng.random(n) < 0.3) * _ulp(v, dtype)
        v[rng.integers(n)] = maxn * 2.0 ** k * rng.choice([-1.0, 1.0])
    elif kind == "satur":
        # amax at max * 2^k give or take a few ulps: the scale's rounding up (448 -> 127, 449 -> 128)
        # and codes just past max that saturate
        k = int(rng.integers(max(-120, d["emin"] + 12), min(100, d["emax"] - 17) + 1))
        A = maxn * 2.0 ** k
        A = A + int(rng.integers(-2, 3)) * _ulp(np.array(A), dtype)
        v = rng.standard_normal(n) * A / 3
        pos = rng.choice(n, size=min(n, int(rng.integers(1, 4))), replace=False)
        v[pos] = A * rng.choice([-1.0, 1.0], len(pos))
        if n > 4:
            v[pos[0] - 1] = (A - _ulp(np.array(A), dtype)) * rng.choice([-1.0, 1.0])
            v[(pos[0] + 2) % n] = A * 464.0 / 448.0 * 0.5 * rng.choice([-1.0, 1.0])
    elif kind == "maxfinite":
        v = rng.choice([-1.0, 1.0], n) * d["maxf"] * rng.choice([1.0, 0.5, 0.75], n)
    elif kind in ("nan", "inf", "naninf"):
        v = rng.standard_normal(n) * 2.0 ** int(rng.integers(-20, 20))
        npos = int(rng.integers(1, 4))
        pos = rng.choice(n, size=min(n, npos), replace=False)
        for i, p in enumerate(pos):
            want_nan = kind == "nan" or (kind == "naninf" and i == 0)
            over.append((int(p), int(rng.choice(NAN_BITS[dtype])) if want_nan else int(rng.choice(INF_BITS[dtype]))))
    elif kind == "exp_hi":
        v = rng.standard_normal(n) * 2.0 ** (d["emax"] - 3)
    else:  # exp_lo: just above the subnormal range
        v = rng.standard_normal(n) * 2.0 ** (d["emin"] + int(rng.integers(0, 8)))
    return v, over


def base_values(rng: np.random.Generator, dist: str, shape: tuple, imax: int = 16, pow2=(-6, 6)) -> np.ndarray:
    """float64 values: standard normal, uniform in [-1, 1], integers in [-imax, imax], or exact powers
    of two 2^pow2[0] .. 2^pow2[1] with random signs (many exact ties in amax)."""
    if dist == "normal":
        return rng.standard_normal(shape)
    if dist == "uniform":
        return rng.uniform(-1, 1, shape)
    if dist == "int":
        return rng.integers(-imax, imax + 1, shape).astype(np.float64)
    return np.ldexp(rng.choice([-1.0, 1.0], shape), rng.integers(pow2[0], pow2[1] + 1, shape))


def float_bits(rng: np.random.Generator, shape: tuple, dtype: str, fmt: str = "e4m3", dist: str = "normal",
               exp: str = "narrow", special_rate: float = 0.0, orient: str = "row",
               specials: tuple = SPECIALS) -> np.ndarray:
    """Bits [*shape] of `dtype`: a base distribution, a power-of-two exponent per 32-element block
    (blocks along the last axis for orient 'row', along the flattened leading axis for 'col'), and
    special patterns on a fraction of the blocks."""
    shape = tuple(int(s) for s in shape)
    n_el = int(np.prod(shape)) if shape else 1
    d = DT[dtype]
    K = shape[-1] if shape else 1
    M = n_el // K if K else 0
    v = base_values(rng, dist, (M, K))
    if M and K:
        col = orient == "col" or (orient == "mixed" and rng.random() < 0.5)
        nb_m, nb_k = (fp.cdiv(M, 32), K) if col else (M, fp.cdiv(K, 32))
        if exp != "none":
            lo, hi = (-8, 8) if exp == "narrow" else (d["esub"] + 2, d["emax"] - 4)
            k = rng.integers(lo, hi + 1, (nb_m, nb_k)).astype(np.float64)
            if col:
                v = v * np.exp2(np.repeat(k, 32, axis=0)[:M])
            else:
                v = v * np.exp2(np.repeat(k, 32, axis=1)[:, :K])
        v = np.clip(v, -d["maxf"], d["maxf"])
        over = []
        if special_rate > 0:
            nspecial = min(int(rng.binomial(nb_m * nb_k, special_rate)), MAX_SPECIAL_BLOCKS)
            for _ in range(nspecial):
                bm, bk = int(rng.integers(nb_m)), int(rng.integers(nb_k))
                kind = str(rng.choice(specials))
                if col:
                    r0, r1 = bm * 32, min(M, bm * 32 + 32)
                    vals, ov = _special_block(rng, r1 - r0, dtype, fmt, kind)
                    v[r0:r1, bk] = vals
                    over += [((r0 + p, bk), b) for p, b in ov]
                else:
                    c0, c1 = bk * 32, min(K, bk * 32 + 32)
                    vals, ov = _special_block(rng, c1 - c0, dtype, fmt, kind)
                    v[bm, c0:c1] = vals
                    over += [((bm, c0 + p), b) for p, b in ov]
        bits = fp.from_f64(np.clip(v, -d["maxf"], d["maxf"]), dtype)
        for (i, j), b in over:
            bits[i, j] = b
    else:
        bits = np.zeros((M, K), fp.BITS[dtype])
    return bits.reshape(shape)


def random_bits(rng: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
    """Arbitrary bit patterns (NaNs, Infs, subnormals and all)."""
    info = np.iinfo(fp.BITS[dtype])
    return rng.integers(info.min, int(info.max) + 1, size=shape, dtype=fp.BITS[dtype])


# ----------------------------------------------------------------------------- strided views
@dataclass
class View:
    """A view into a flat base buffer (strides and offset in elements)."""
    base_numel: int
    offset: int
    shape: tuple
    strides: tuple

    def positions(self) -> np.ndarray:
        """Flat base indices of every logical element ([*shape])."""
        idx = np.full(self.shape, self.offset, np.int64)
        for d, (n, s) in enumerate(zip(self.shape, self.strides)):
            sh = [1] * len(self.shape)
            sh[d] = n
            idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(sh)
        return idx

    def covered(self) -> np.ndarray:
        m = np.zeros(self.base_numel, bool)
        m[self.positions().reshape(-1)] = True
        return m

    def to_json(self) -> dict:
        return dict(base_numel=self.base_numel, offset=self.offset, shape=list(self.shape), strides=list(self.strides))

    @staticmethod
    def from_json(d: dict) -> "View":
        return View(int(d["base_numel"]), int(d["offset"]), tuple(d["shape"]), tuple(d["strides"]))


def make_view(rng, shape: tuple, align: int, order: list = None, pads: list = None, broadcast: tuple = (),
              offset_max: int = 8, wild_size1: bool = True, tail_max: int = 4) -> View:
    """Strides for `shape` with a unit innermost stride. `order`: the leading logical dims from the
    innermost outwards (default row-major); `pads[i]`: how many `align`-element units of padding
    the i-th level of `order` may add after itself (0: nested exactly); dims in `broadcast` get
    stride 0; dims of size 1 may get any stride (a multiple of `align`)."""
    shape = tuple(int(s) for s in shape)
    nd = len(shape)
    order = list(reversed(range(nd - 1))) if order is None else list(order)
    pads = [0] * len(order) if pads is None else list(pads)
    strides = [0] * nd
    if nd:
        strides[-1] = 1
    cur = fp.rup(shape[-1], align) if nd else 1
    for lvl, dd in enumerate(order):
        if lvl == 0:
            cur += align * int(rng.integers(0, pads[0] + 1)) if pads[0] else 0
        if dd in broadcast:
            strides[dd] = 0
            continue
        strides[dd] = cur
        cur = cur * shape[dd]
        if lvl + 1 < len(order) and pads[lvl + 1]:
            cur += align * int(rng.integers(0, pads[lvl + 1] + 1))
    if wild_size1:
        for dd in range(nd - 1):
            if shape[dd] == 1 and rng.random() < 0.5:
                strides[dd] = align * int(rng.integers(0, 1000))
    offset = align * int(rng.integers(0, offset_max + 1)) if offset_max else 0
    if any(s == 0 for s in shape):
        extent = 0
    else:
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    base = offset + extent + align * int(rng.integers(0, tail_max + 1))
    return View(base, offset, shape, tuple(strides))


def contiguous_view(shape: tuple) -> View:
    shape = tuple(int(s) for s in shape)
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return View(int(np.prod(shape)) if shape else 1, 0, shape, tuple(reversed(strides)))


def fill_base(rng, view: View, dtype: str, logical_bits: np.ndarray) -> np.ndarray:
    """A base buffer holding `logical_bits` at the view's positions and poison elsewhere: random bit
    patterns with many NaNs and huge values, so that a read outside the view shows."""
    pattern = random_bits(rng, (61,), dtype)
    if dtype in NAN_BITS:
        poison = np.array(NAN_BITS[dtype] + list(INF_BITS[dtype]), fp.BITS[dtype])
        m = rng.random(61) < 0.5
        pattern[m] = rng.choice(poison, int(m.sum()))
    base = np.resize(pattern, view.base_numel)
    if logical_bits.size:
        base[view.positions()] = np.broadcast_to(logical_bits, view.shape)
    return base


def gather(base: np.ndarray, view: View) -> np.ndarray:
    if not all(view.shape):
        return np.zeros(view.shape, base.dtype)
    return base[view.positions()]


# ----------------------------------------------------------------------------- rope helpers
def rope_table_bits(rng, rows: int, R: int, dtype: str, kind: str, style: str, special_rate: float = 0.0) -> tuple:
    """cos / sin [rows, R] bits: 'angles' (positions x inverse frequencies laid out for the style,
    as rope_tables builds them), or 'random' (any values: the fp32 formula holds for any table),
    with a few special values (NaN, Inf, subnormals, zeros) at `special_rate`."""
    if kind == "angles":
        inv = 1.0 / (10000.0 ** (np.arange(0, R, 2) / R)) * rng.choice([1.0, 1 / 40.0])
        pos = np.arange(rows, dtype=np.float64) + float(rng.integers(0, 5000))
        ang = np.outer(pos, inv)
        full = np.repeat(ang, 2, axis=1) if style == "interleaved" else np.concatenate([ang, ang], axis=1)
        c, s = np.cos(full), np.sin(full)
    else:
        c = rng.standard_normal((rows, R)) * rng.choice([1.0, 4.0, 2.0 ** -10])
        s = rng.standard_normal((rows, R)) * rng.choice([1.0, 4.0, 2.0 ** -10])
    cb, sb = fp.from_f64(c, dtype), fp.from_f64(s, dtype)
    if special_rate > 0 and rows * R:
        for arr in (cb, sb):
            m = rng.random((rows, R)) < special_rate
            k = int(m.sum())
            pool = NAN_BITS[dtype] + list(INF_BITS[dtype]) + [0, 1, 0x8000 if dtype != "float32" else 0x80000000]
            arr[m] = rng.choice(np.array(pool, np.int64), k).astype(fp.BITS[dtype])
    return cb, sb


def cu_seqlens(rng, tokens: int, nseq: int, empty_rate: float = 0.25) -> np.ndarray:
    """nseq sequences summing to `tokens`; some empty (also the first and last)."""
    cuts = np.sort(rng.integers(0, tokens + 1, nseq - 1)) if nseq > 1 else np.zeros(0, np.int64)
    cu = np.concatenate([[0], cuts, [tokens]]).astype(np.int64)
    # make some sequences empty on purpose
    for i in range(1, nseq):
        if rng.random() < empty_rate:
            cu[i] = cu[i - 1]
    cu[1:-1] = np.maximum.accumulate(cu[1:-1]) if nseq > 1 else cu[1:-1]
    cu[-1] = tokens
    return cu
