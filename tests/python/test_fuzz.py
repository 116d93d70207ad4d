"""The property tests (fuzzers, tests/fuzz) in CI: their arithmetic primitives against exact
rational arithmetic, the checker's sensitivity, the generators' determinism and CUDA-rule
compliance, a bounded seeded subset per op on the CPU (the reference against the independent
oracle, in both config profiles), a dry run of the GPU check's code path with the CPU standing in
for the GPU, the command line, and — where a CUDA device is visible — a GPU subset.

The >= 1000-configs-per-op GPU run is a separate command (docs/testing.md):
    python3 -m tests.fuzz --device cuda --count 1000 --all --sanitize-sample 20
"""
import math
import os
import pathlib
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")
import mxmla  # noqa: E402

from tests.fuzz import check, data, driver, fp, gen, oracle, runner  # noqa: E402

HAVE_GPU = torch.cuda.is_available() and mxmla.info()["cuda_enabled"] and bool(mxmla.info()["gpus"])

CI_COUNTS = {  # configs per op in CI, half from each profile (seeds 0 .. n/2 - 1)
    "quantize": 120,
    "dequantize": 200,
    "swizzle_scales": 400,
    "unswizzle_scales": 400,
    "quantize_attention": 160,
    "attention_scales_to_bhsd": 400,
    "to_bhsd": 120,
    "apply_rope": 200,
    "rope_backward": 200,
    "rope_backward_quantize": 100,
    "fused_q_uproj_rope_quant": 200,
    "attention": 600,
    "attention_backward": 120,
    "gemm": 400,
}
GPU_COUNT = 100  # per op, when a GPU is visible (about 50 s in all at the H200's rates; the full run: the command above)


# ----------------------------------------------------------------------------- exact references
def round_exact(v: Fraction, mant: int, emin: int, max_finite: float) -> float:
    """Round-to-nearest-even of an exact rational to a binary format (overflow -> inf)."""
    if v == 0:
        return 0.0
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = Fraction(2) ** (max(e, emin) - mant)
    r = round(a / q) * q  # Fraction.__round__ is half to even
    f = math.inf if math.isfinite(max_finite) and r > Fraction(max_finite) else float(r)
    return f if v > 0 else -f


F32 = dict(mant=23, emin=-126, max_finite=float(np.finfo(np.float32).max))


def f32_bits(x):
    return np.array([x], np.float32).view(np.uint32)[0]


def test_fmaf_is_exactly_rounded():
    rng = np.random.default_rng(0)
    n = 3000
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0 ** -rng.integers(1, 30, n))).astype(np.float32)
    c[::3] = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 100, n))).astype(np.float32)[::3]  # any exponents
    # double-rounding traps: p + c within 2^-40 of an fp32 midpoint, on both sides, odd and even neighbours
    traps = []
    for R in (1.0 + 2 ** -23, 1.0 + 2 ** -22, 3.0 + 2 ** -22, 1.5, 2.0 ** 100 * (1 + 2 ** -23), 2.0 ** -120 * (1 + 2 ** -23)):
        h = R * 0 + 2.0 ** (math.frexp(R)[1] - 1 - 24)  # half an fp32 ulp of R
        Rn = float(np.nextafter(np.float32(R), np.float32(np.inf)))
        traps.append((h * (1 + 2 ** -20), 1 - 2 ** -20, R))      # just below the midpoint above R
        traps.append((-h * (1 + 2 ** -20), 1 - 2 ** -20, Rn))    # just above the midpoint below Rn
        traps.append((h, 1.0, R))                                 # exactly the midpoint (ties to even)
    for s in (1, -1):  # the overflow tie 2^128 - 2^103
        traps.append((s * 2.0 ** 103 * (1 + 2 ** -20), 1 - 2 ** -20, s * float(np.finfo(np.float32).max)))
        traps.append((s * 2.0 ** 103, 1.0, s * float(np.finfo(np.float32).max)))
    ta, tb, tc = (np.array(v, np.float32) for v in zip(*traps))
    a, b, c = np.concatenate([a, ta]), np.concatenate([b, tb]), np.concatenate([c, tc])
    got = fp.fmaf(a, b, c)
    for i in range(a.size):
        want = round_exact(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])), **F32)
        assert f32_bits(got[i]) == f32_bits(np.float32(want)), (i, a[i], b[i], c[i], got[i], want)
    # and the traps do catch an unfused (double-rounded) fma
    with np.errstate(all="ignore"):
        naive = (ta.astype(np.float64) * tb + tc).astype(np.float32)
    assert (naive.view(np.uint32) != fp.fmaf(ta, tb, tc).view(np.uint32)).sum() >= 4


def test_fmaf_special_values():
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    a = np.array([inf, 0, inf, 1, nan, 2], np.float32)
    b = np.array([0, inf, 1, 1, 1, 3], np.float32)
    c = np.array([1, 1, -inf, inf, 0, -6], np.float32)
    r = fp.fmaf(a, b, c)
    assert np.isnan(r[:3]).all() and r[3] == np.inf and np.isnan(r[4]) and r[5] == 0 and not np.signbit(r[5])


@pytest.mark.parametrize("dtype,mant,emin,maxf", [("bfloat16", 7, -126, 3.3895313892515355e38),
                                                  ("float16", 10, -14, 65504.0)])
def test_float_conversions_round_once_to_nearest_even(dtype, mant, emin, maxf):
    rng = np.random.default_rng(1)
    u = rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)
    if dtype == "float16":  # concentrate on fp16's range (subnormals, ties, overflow)
        u = (u & 0x807FFFFF) | ((rng.integers(127 - 27, 127 + 17, u.size).astype(np.uint32)) << 23)
    u = np.concatenate([u, np.array([0x7F7FFFFF, 0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x3F808000,
                                     0x3F818000, 0x80000000], np.uint32)])
    f = u.view(np.float32)
    f = f[np.isfinite(f)]
    got = fp.from_f32(f, dtype)
    for v, g in zip(f, got):
        want = math.copysign(round_exact(Fraction(float(v)), mant, emin, maxf), float(v))
        assert g == fp.from_f64(np.array([want]), dtype)[0], (dtype, hex(f32_bits(v)), g, want)
        assert math.isinf(want) or fp.to_f64(np.array([g]), dtype)[0] == want
    assert fp.from_f32(np.array([np.nan], np.float32), dtype)[0] == fp.CANON_NAN[dtype]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_codes_are_rne_with_saturation(fmt):
    """fp.quantize_blocks' element rule against exact rounding (ml_dtypes' RNE), on every code, every
    midpoint and the fp32 neighbours of each midpoint. (Past max only Inf ever arrives: the scale
    is rounded up, so a finite block's scaled values stay <= max; Inf saturates, tested below.)"""
    f8, maxn, maxcode, _, mant, emin = fp.FMT[fmt]
    vals = np.arange(0, maxcode + 1, dtype=np.uint8).view(f8).astype(np.float64)
    mids = (vals[:-1] + vals[1:]) / 2
    m32 = mids.astype(np.float32)
    y = np.concatenate([vals.astype(np.float32), m32, np.nextafter(m32, np.float32(0)), np.nextafter(m32, np.float32(np.inf))])
    y = np.concatenate([y, -y]).astype(np.float32)
    # one block per value with amax 448·2^0 (scale 127, multiplier 1)
    blocks = np.zeros((y.size, 32), np.float32)
    blocks[:, 0] = y
    blocks[:, 1] = maxn
    codes, scales = fp.quantize_blocks(blocks, fmt)
    assert (scales == 127).all()
    for v, cde in zip(y, codes[:, 0]):
        r = round_exact(Fraction(float(v)), mant, emin, math.inf)
        r = math.copysign(min(abs(r), maxn), r) if r != 0 else math.copysign(0.0, float(v))
        got = float(np.array([cde], np.uint8).view(f8).astype(np.float64)[0])
        assert got == r and math.copysign(1, got) == math.copysign(1, r), (fmt, v, hex(cde), r)


def test_scale_rule_and_special_blocks():
    # README "Semantics": 448 -> 127, 449 -> 128; zero -> 0; NaN block 0xFF / 0x7F; Inf block 0xFE, ±max
    assert list(fp.e8m0_from_amax(np.array([448.0, 449.0, 0.0, 57344.0], np.float32), "e4m3")) == [127, 128, 0, 134]
    assert fp.e8m0_from_amax(np.array([57344.0], np.float32), "e5m2")[0] == 127
    x = np.ones((3, 32), np.float32)
    x[0, 5] = np.nan
    x[1, 7] = -np.inf
    x[2] = 0
    codes, sc = fp.quantize_blocks(x, "e4m3")
    assert list(sc) == [0xFF, 0xFE, 0] and (codes[0] == 0x7F).all() and codes[1, 7] == 0xFE
    assert codes[1, 0] == 0x00 and (codes[2] == 0).all()  # finite values of an Inf block flush to ±0


def test_swizzle_view_equals_the_index_formula():
    rng = np.random.default_rng(2)
    for M, K in [(1, 32), (129, 96), (300, 544), (33, 4096)]:
        for rw in (True, False):
            shape = (M, K // 32) if rw else (fp.cdiv(M, 32), K)
            c = rng.integers(0, 256, shape, dtype=np.uint8)
            s = fp.swizzle(c, M, K, rw)
            assert s.shape == fp.swizzled_shape(M, K, rw)
            np.testing.assert_array_equal(fp.unswizzle(s, M, K, rw), c)
            assert (s[fp.swizzle_padding(M, K, rw)] == 0).all()
    # BHSD: per (b, h) matrix, inverse exact
    for shape, layout in [((45, 2, 3, 192), "sbhd"), ((2, 130, 3, 64), "bshd")]:
        for rw in (True, False):
            rs, cs = fp.attention_compact_shapes(shape, layout)
            c = rng.integers(0, 256, rs if rw else cs, dtype=np.uint8)
            b = fp.to_bhsd(c, shape, layout, rw)
            assert b.shape == fp.bhsd_shapes(shape, layout)[0 if rw else 1]
            np.testing.assert_array_equal(fp.from_bhsd(b, shape, layout, rw), c)


def test_rope_oracle_matches_float64_formula():
    """rope_f32 is RoPE (SPEC §3) to within fp32 rounding, and backward is its transpose."""
    rng = np.random.default_rng(3)
    for style in gen.STYLES:
        x = rng.standard_normal((5, 64)).astype(np.float32)
        c = rng.standard_normal((5, 64)).astype(np.float32)
        s = rng.standard_normal((5, 64)).astype(np.float32)
        a, b, sign = oracle.rope_terms(style, 64)
        want = c.astype(np.float64) * x[:, a] + sign * s.astype(np.float64) * x[:, b]
        np.testing.assert_allclose(oracle.rope_f32(x, c, s, style, False), want, rtol=1e-6, atol=1e-6)
        g = rng.standard_normal((5, 64)).astype(np.float32)
        lhs = (oracle.rope_f32(x, c, s, style, False).astype(np.float64) * g).sum()
        rhs = (x.astype(np.float64) * oracle.rope_f32(g, c, s, style, True)).sum()
        assert abs(lhs - rhs) < 1e-4 * (abs(lhs) + 1)


# ----------------------------------------------------------------------------- checker
def test_checker_sees_one_flipped_byte_and_shape_errors():
    cfg = gen.generate("quantize", 7, "any")
    ins = gen.materialize(cfg)
    outs = runner.run(cfg, ins, "cpu")
    exp = check.expected_outs(oracle.expected(cfg, ins))
    assert check.compare_sets("quantize", "t", outs, exp) == []
    name = next(iter(outs))
    o = outs[name]
    bad = runner.Out(o.raw.copy(), o.shape, o.dtype, o.itemsize)
    bad.raw[o.raw.size // 2] ^= 0x10
    mm = check.compare("quantize", "t", name, bad, exp[name])
    assert len(mm) == 1 and mm[0].index == o.raw.size // 2 and mm[0].count == 1
    assert "got 0x" in mm[0].line() and "expected 0x" in mm[0].line()
    wrong = runner.Out(o.raw, (o.raw.size,), o.dtype, o.itemsize)
    assert "shape" in check.compare("quantize", "t", name, wrong, exp[name])[0].note
    assert check.compare_sets("quantize", "t", {}, exp)[0].note == "missing output"


def _first_seed(op, pred, profile="any", limit=400):
    for s in range(limit):
        cfg = gen.generate(op, s, profile)
        if pred(cfg):
            return cfg
    raise AssertionError(f"no {op} config matches in {limit} seeds")


def test_invariants_see_padding_roundtrip_and_bound_violations():
    cfg = _first_seed("quantize", lambda c: c["swizzle"] and c["rowwise"] and 1 < np.prod(c["x_view"]["shape"][:-1]) < 100)
    ins = gen.materialize(cfg)
    outs = runner.run(cfg, ins, "cpu")
    assert check.invariants(cfg, ins, outs) == []
    s = outs["rowwise_scale_inv"]
    pad = np.nonzero(fp.swizzle_padding(int(np.prod(cfg["x_view"]["shape"][:-1])), cfg["x_view"]["shape"][-1], True).reshape(-1))[0]
    poisoned = dict(outs, rowwise_scale_inv=runner.Out(s.raw.copy(), s.shape, s.dtype, 1))
    poisoned["rowwise_scale_inv"].raw[pad[0]] = 0xA5
    assert any("padding" in m.note for m in check.invariants(cfg, ins, poisoned))
    # a code off by a lot breaks the MX bound (pick an element of a finite, non-zero block)
    x = fp.to_f32(ins["x"].logical(), cfg["dtype"]).reshape(-1)
    i = int(np.nonzero(np.isfinite(x) & (np.abs(x) > 0))[0][0])
    c = outs["rowwise_data"]
    broken = dict(outs, rowwise_data=runner.Out(c.raw.copy(), c.shape, c.dtype, 1))
    broken["rowwise_data"].raw[i] ^= 0x40
    assert any("MX bound" in m.note for m in check.invariants(cfg, ins, broken))
    # swizzle round trip
    cfg = gen.generate("swizzle_scales", 3, "any")
    ins = gen.materialize(cfg)
    outs = runner.run(cfg, ins, "cpu")
    rt = outs["roundtrip"]
    outs["roundtrip"] = runner.Out(rt.raw.copy(), rt.shape, rt.dtype, 1)
    outs["roundtrip"].raw[0] ^= 1
    assert any("roundtrip" in m.output for m in check.invariants(cfg, ins, outs))


def test_rope_invariants_see_writes_outside_the_view():
    cfg = _first_seed("apply_rope", lambda c: c["out"] == "inplace" and c["x_view"]["base_numel"] > np.prod(c["shape"]))
    ins = gen.materialize(cfg)
    outs = runner.run(cfg, ins, "cpu")
    assert check.invariants(cfg, ins, outs) == []
    xb = outs["x_base"]
    outside = np.nonzero(~np.repeat(ins["x"].view.covered(), xb.itemsize))[0]
    outs["x_base"] = runner.Out(xb.raw.copy(), xb.shape, xb.dtype, xb.itemsize)
    outs["x_base"].raw[outside[0]] ^= 1
    assert any("outside" in m.note for m in check.invariants(cfg, ins, outs))


# ----------------------------------------------------------------------------- generators
@pytest.mark.parametrize("op", gen.OPS)
def test_configs_and_inputs_are_determined_by_op_seed_profile(op):
    for seed in (0, 17):
        for profile in gen.PROFILES:
            a, b = gen.generate(op, seed, profile), gen.generate(op, seed, profile)
            assert gen.config_json(a) == gen.config_json(b)
            ia, ib = gen.materialize(a), gen.materialize(b)
            assert ia.keys() == ib.keys()
            for k in ia:
                x, y = ia[k], ib[k]
                if isinstance(x, gen.Arr):
                    assert np.array_equal(x.base, y.base) and x.view == y.view
                elif isinstance(x, np.ndarray):
                    assert np.array_equal(x, y)
    assert gen.config_json(gen.generate(op, 1, "any")) != gen.config_json(gen.generate(op, 2, "any"))


def _views(cfg):
    for k in ("x_view", "out_view"):
        if k in cfg:
            yield cfg[k], cfg.get("out_dtype" if k == "out_view" else "dtype", "bfloat16")
    for t in cfg.get("tensors", []):
        yield t["x_view"], t["dtype"]


def test_cuda_profile_obeys_the_cuda_rules():
    """Every config of the cuda profile is one the CUDA path accepts (README's CUDA-path rules)."""
    for op in gen.OPS:
        fast = 0
        heads8 = set()
        for seed in range(150):
            cfg = gen.generate(op, seed, "cuda")
            for vj, dt in _views(cfg):
                es = fp.ITEMSIZE[dt]
                v = data.View.from_json(vj)
                assert (v.offset * es) % 16 == 0, (op, seed)
                assert all((s * es) % 16 == 0 for s in v.strides[:-1]) and v.strides[-1] == 1, (op, seed, v)
            if op in ("apply_rope", "rope_backward", "rope_backward_quantize"):
                Dh, R = cfg["shape"][-1], cfg["rope_dim"]
                assert R % 16 == 0 and (Dh - R) % 8 == 0 and cfg.get("out_dtype", cfg["dtype"]) == cfg["dtype"]
                assert (cfg["tab_offset"] * fp.ITEMSIZE[cfg["tab_dtype"]]) % 16 == 0
                assert cfg["tab_align"] * fp.ITEMSIZE[cfg["tab_dtype"]] % 16 == 0
                if op == "rope_backward_quantize":
                    assert Dh % 32 == 0 and Dh <= 256
                    fast += cfg["fast_path"]
                    if cfg["fast_path"]:
                        heads8.add(cfg["shape"][-2] % 8 == 0)
            if op == "fused_q_uproj_rope_quant":
                assert (cfg["nope"], cfg["rope"]) == (128, 64) and cfg["K"] % 8 == 0
                assert cfg["x_pad"] % 8 == 0 and cfg["w_pad"] % 8 == 0 and cfg["x_offset"] % 8 == 0
        if op == "rope_backward_quantize":
            assert fast >= 40, f"only {fast} of 150 configs take the fast path"
            assert heads8 == {True, False}


def _tags(op, n=200, profile="any"):
    """The coverage tags of seeds 0 .. n - 1."""
    out = set()
    for s in range(n):
        out.update(gen.generate(op, s, profile)["tags"])
    return out


def test_generators_cover_the_axes():
    tags = _tags
    t = tags("quantize")
    for want in ("dtype=bfloat16", "dtype=float16", "dtype=float32", "fmt=e4m3", "fmt=e5m2", "dir=row", "dir=col",
                 "dir=both", "swizzle", "one_row", "huge_leading", "strided", "offset", "specials", "exp=wide"):
        assert want in t, want
    t = tags("dequantize")
    for want in ("source=attention", "scale_layout=bhsd", "scale_layout=swizzled", "bytes=random", "out_dtype=bfloat16"):
        assert want in t, want
    for op in ("apply_rope", "rope_backward"):
        t = tags(op)
        for want in ("layout=thd", "cu_seqlens_multi", "tables_per_token", "out=inplace", "out=view", "broadcast",
                     "deepseek_head", "heads%8==0", "heads%8!=0", "tab_dtype=bfloat16", "style=rotate_half", "strided"):
            assert want in t, (op, want)
    t = tags("fused_q_uproj_rope_quant", profile="cuda")
    for want in ("batch>1", "K_tail", "T_tail", "weight_layout=kn", "bhsd_scales", "return_q", "fmt=e5m2", "layout=bshd"):
        assert want in t, want


# ----------------------------------------------------------------------------- attention and gemm
ROUND = {"bfloat16": (7, -126, 3.3895313892515355e38), "float32": (23, -126, float(np.finfo(np.float32).max)),
         "float16": (10, -14, 65504.0)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_round_f64_rounds_once(dtype):
    """fp.round_f64 (the tolerance checks' rounding of float64 results) against exact rounding: random
    values, values one float64 ulp either side of every kind of tie, subnormals, the overflow edge."""
    mant, emin, maxf = ROUND[dtype]
    rng = np.random.default_rng(5)
    v = rng.standard_normal(2000) * np.exp2(rng.integers(emin - mant - 3, 40 if dtype != "float16" else 16, 2000))
    q = np.exp2(rng.integers(emin, 12, 300).astype(np.float64) - mant)  # ties: (k + 1/2)·q
    ties = (rng.integers(1 << mant, 1 << (mant + 1), 300) + 0.5) * q
    v = np.concatenate([v, ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf), -ties,
                        [maxf, maxf * (1 + 2.0 ** -(mant + 2)), maxf * (1 + 2.0 ** -(mant + 1)), 0.0, -0.0,
                         2.0 ** (emin - mant - 1), 2.0 ** (emin - mant - 1) * 1.5]])
    got = fp.round_f64(v, dtype)
    for x, g in zip(v, got):
        want = round_exact(Fraction(float(x)), mant, emin, maxf)
        assert g == want and math.copysign(1, g) == math.copysign(1, x), (dtype, x.hex(), g, want)
    # why it exists: ml_dtypes converts float64 -> bfloat16 through float32 (two roundings)
    x = 1 + 2.0 ** -8 + 2.0 ** -30
    assert fp.round_f64(np.array([x]), "bfloat16")[0] == 1 + 2.0 ** -7
    assert fp.bits_f64(np.array([x, np.nan]), "bfloat16").tolist() == [0x3F81, 0x7FC0]


def test_e4m3_rounding_of_p():
    """The attention oracle's E4M3 rounding of 256·p (SPEC §5's P̃) against exact rounding, on every
    E4M3 value, midpoint and its float64 neighbours in [0, 448]."""
    vals = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mids = (vals[:-1] + vals[1:]) / 2
    y = np.concatenate([vals, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), [1e-30, 2.0 ** -10]])
    got, _ = oracle._e4m3_round(y)
    for x, g in zip(y, got):
        assert g == round_exact(Fraction(float(x)), 3, -6, 448.0), (x, g)


def _naive_attention(Q, K, V, scale, n, e4m3):
    """SPEC §5 row by row, as written: scores summed in order, the maximum over the visible keys (NaN
    skipped), blocks of 128 keys with rescaling for E4M3 P (P̃ by exact rounding), O = o / l,
    LSE = m + ln l. Q [G, Sq, D], K [Skv, D], V [Skv, Dv] float64."""
    G, Sq, _ = Q.shape
    Dv = V.shape[1]
    O, L = np.zeros((G, Sq, Dv)), np.full((G, Sq), -np.inf)
    with np.errstate(all="ignore"):
        for g_ in range(G):
            for i in range(Sq):
                if n[i] == 0:
                    continue
                s = [sum(Q[g_, i, d] * K[j, d] for d in range(K.shape[1])) * scale for j in range(n[i])]
                m, o, l = -math.inf, np.zeros(Dv), 0.0
                blk = 128 if e4m3 else n[i]
                for j0 in range(0, n[i], blk):
                    mb = m
                    for j in range(j0, min(n[i], j0 + blk)):
                        mb = mb if not (mb < s[j]) else s[j]
                    if j0 > 0:
                        a = math.exp(m - mb) if not (math.isinf(m) and m == mb) else math.nan
                        o, l = o * a, l * a
                    for j in range(j0, min(n[i], j0 + blk)):
                        p = math.exp(s[j] - mb) if not (math.isinf(mb) and s[j] == mb) else math.nan
                        pt = round_exact(Fraction(p * 256), 3, -6, 448.0) / 256 if e4m3 and math.isfinite(p) else p
                        o, l = o + pt * V[j], l + p
                    m = mb
                O[g_, i] = o / l
                L[g_, i] = m + math.log(l) if l > 0 else (math.nan if math.isnan(l) else -math.inf)
    return O, L


@pytest.mark.parametrize("e4m3", [False, True])
def test_attention_oracle_equals_spec_row_by_row(e4m3):
    """oracle.attention_head (vectorized: per-key weights P̃·exp(m_t - m)) against SPEC §5 evaluated row by
    row, on causal rows of 0..300 keys (several E4M3 blocks), peaky and flat softmaxes, NaN in Q, in K,
    in V at a visible and at a masked key, and exact zeros."""
    rng = np.random.default_rng(11 + e4m3)
    G, Sq, Skv, D, Dv = 2, 6, 300, 32, 8
    Q = rng.standard_normal((G, Sq, D)) * np.array([0.3, 3.0])[:, None, None]
    K, V = rng.standard_normal((Skv, D)), rng.standard_normal((Skv, Dv)) * 4
    n = np.array([0, 1, 129, 130, 256, 300])
    Q[1, 5, 3] = np.nan           # a NaN query row
    K[200, 0] = np.nan            # a NaN key: rows that see it are NaN
    V[100, 2] = np.nan            # seen by rows with n > 100 (column 2 only)
    V[129, 5] = np.nan            # masked for the row with n = 129
    V[10:14] = 0.0
    want_o, want_l = _naive_attention(Q, K, V, 0.1, n, e4m3)
    x_o, t_o, x_l, t_l, masked, _ = oracle.attention_head(Q, K, V, 0.1, n, e4m3)
    np.testing.assert_array_equal(np.isnan(x_o), np.isnan(want_o))
    np.testing.assert_array_equal(np.isnan(x_l), np.isnan(want_l))
    assert masked.tolist() == [True] + [False] * 5 and np.isnan(x_o[:, 3:, 5]).all() and not np.isnan(x_o[0, 2, 5])
    f = np.isfinite(want_o)
    assert np.all(np.abs(x_o[f] - want_o[f]) <= t_o[f] + 1e-300)
    assert np.all(np.abs(x_o[f] - want_o[f]) <= 1e-12 * (np.abs(want_o[f]) + 4))
    f = np.isfinite(want_l)
    assert np.all(np.abs(x_l[f] - want_l[f]) <= t_l[f])


def test_tolerance_checks_see_one_ulp_nan_and_masked_rows():
    """attention / gemm outputs against the oracle's intervals: the reference passes; one bf16 / fp32 ulp
    off an element whose interval holds one value fails, so do a NaN where the oracle has none and a
    non-zero O in a row without keys."""
    cfg = _first_seed("attention", lambda c: c["prec"] == "bf16" and c["causal"] == "bottom_right" and c["return_lse"]
                      and c["q_format"] == "sbhd" and c["s_q"] > c["s_kv"] > 1 and not any(c[r]["events"] for r in "qkv"))
    ins = gen.materialize(cfg)
    outs = runner.run(cfg, ins, "cpu")
    exp = check.expected_outs(oracle.expected(cfg, ins))
    assert check.compare_sets("attention", "t", outs, exp) == []
    for name in ("o", "lse"):
        lo, hi = exp[name].bounds()
        i = int(np.flatnonzero((lo == hi) & ~exp[name].exact & np.isfinite(exp[name].x))[0])
        bad = dict(outs)
        o = outs[name]
        bad[name] = runner.Out(o.raw.copy(), o.shape, o.dtype, o.itemsize)
        bad[name].elements()[i] += 1
        mm = check.compare_sets("attention", "t", bad, exp)
        assert len(mm) == 1 and mm[0].index == i and "rounded to" in mm[0].expected, mm
        bad[name].elements()[i] = 0x7FC0 if name == "o" else 0x7FC00000
        assert "NaN exactly" in check.compare_sets("attention", "t", bad, exp)[0].expected
    o = outs["o"]
    nokey = np.flatnonzero(exp["o"].exact)  # bottom-right with s_q > s_kv: the first rows see no key
    assert nokey.size
    bad = dict(outs, o=runner.Out(o.raw.copy(), o.shape, o.dtype, o.itemsize))
    bad["o"].elements()[nokey[0]] = 0x3F80
    assert "without a visible key" in check.compare_sets("attention", "t", bad, exp)[0].expected
    # gemm: integer data bit for bit (the interval is the one value)
    cfg = _first_seed("gemm", lambda c: c["int_data"] and c["M"] * c["N"] > 0)
    ins = gen.materialize(cfg)
    outs = runner.run(cfg, ins, "cpu")
    exp = check.expected_outs(oracle.expected(cfg, ins))
    assert check.compare_sets("gemm", "t", outs, exp) == [] and not exp["d"].t.any()
    d = outs["d"]
    bad = dict(outs, d=runner.Out(d.raw.copy(), d.shape, d.dtype, d.itemsize))
    bad["d"].elements()[d.elements().size // 2] ^= 1
    assert len(check.compare_sets("gemm", "t", bad, exp)) == 1


def test_gemm_outputs_outside_the_view_and_inputs_are_checked():
    cfg = _first_seed("gemm", lambda c: c["out"] == "view" and c["prec"] == "bf16"
                      and c["out_view"]["base_numel"] > c["M"] * c["N"] > 0)
    ins = gen.materialize(cfg)
    outs = runner.run(cfg, ins, "cpu")
    assert check.invariants(cfg, ins, outs) == []
    for name in ("out_outside", "a.base"):
        o = outs[name]
        bad = dict(outs)
        bad[name] = runner.Out(o.raw.copy(), o.shape, o.dtype, o.itemsize)
        bad[name].raw[0] ^= 1
        assert any(m.output == name for m in check.invariants(cfg, ins, bad))
        assert any(m.output == name for m in check.compare_sets("gemm", "t", bad, check.expected_outs(
            oracle.expected(cfg, ins))))


def test_gpu_bounds_of_attention_and_the_gemm_error(monkeypatch):
    """The GPU comparisons on CPU stand-ins: attention within tests/cpp/test_attention.cpp's bounds (an
    O element 0.5 + 10 % off, a relative RMS of 1.5 % or an LSE 0.05 off fail; a relative 0.3 % change
    passes); gemm on CUDA must raise the "kernel not available" error (a result or another error fails)."""
    cfg = _first_seed("attention", lambda c: c["prec"] == "bf16" and c["return_lse"] and c["p_format"] == "bfloat16"
                      and not any(c[r]["events"] for r in "qkv") and c["causal"] == "none"
                      and c["q_format"] != "thd" and c["s_kv"] > 8, profile="cuda")
    ins = gen.materialize(cfg)
    ref = runner.run(cfg, ins, "cpu")
    assert check.compare_pair(cfg, ins, "cuda vs cpu", ref, ref) == []

    def changed(name, fn):
        o = ref[name]
        v = fp.to_f64(o.elements(), o.dtype)
        v = fn(v)
        got = dict(ref)
        got[name] = runner.Out(fp.from_f64(v, o.dtype).view(np.uint8).copy(), o.shape, o.dtype, o.itemsize)
        return check.compare_pair(cfg, ins, "cuda vs cpu", got, ref)

    assert changed("o", lambda v: v * 1.003) == []
    mm = changed("o", lambda v: np.where(np.arange(v.size) == 5, v + 0.5 + 0.1 * np.abs(v), v))
    assert len(mm) == 1 and "GPU bound" in mm[0].expected
    assert "relative RMS" in changed("o", lambda v: v * 1.015 + 0.01)[0].note
    assert "GPU bound" in changed("lse", lambda v: np.where(np.arange(v.size) == 0, v + 0.05, v))[0].expected
    # gemm on CUDA: bf16 operands expect the kernel's "not available" error; MXFP8 operands are compared
    gb = _first_seed("gemm", lambda c: c["prec"] == "bf16", profile="cuda")
    err = ("ValueError: mxmla.gemm: argument 'a': is on cuda:0, but the CUDA bf16 GEMM kernel is not available in "
           "this build yet (the SM90 kernel takes MXFP8 operands); ...")
    assert driver.check_pair("gemm", gb["seed"], "cuda", "cuda", (None, err)).ok
    assert not driver.check_pair("gemm", gb["seed"], "cuda", "cuda", (None, "ValueError: something else")).ok
    g = _first_seed("gemm", lambda c: c["prec"] == "mxfp8" and not c["int_data"], profile="cuda")
    gins = gen.materialize(g)
    gout = runner.run(g, gins, "cpu")
    assert driver.check_pair("gemm", g["seed"], "cuda", "cuda", (gout, None)).ok  # the kernel's result is compared
    d = gout["d"]
    v = fp.to_f64(d.elements(), d.dtype)
    far = dict(gout)
    far["d"] = runner.Out(fp.from_f64(np.where(np.arange(v.size) == 0, v + 1e3 * (1 + np.abs(v)), v), d.dtype)
                          .view(np.uint8).copy(), d.shape, d.dtype, d.itemsize)
    assert not check.gemm_pair(g, gins, "cuda vs cpu", far, gout) == []  # and a wrong element is caught
    monkeypatch.setattr(check, "GEMM_CUDA_KERNEL", False)  # a build without the kernel: every CUDA gemm raises
    assert "GEMM_CUDA_KERNEL" in driver.check_pair("gemm", g["seed"], "cuda", "cuda", (gout, None)).mismatches[0].note


def test_attention_and_gemm_cuda_profiles_obey_the_kernels_rules():
    """README "CUDA-path rules" and src/attention.cpp's check_cuda: head dims (192, 128) / (128, 128),
    V's columnwise scale blocks along the keys, 16-byte aligned views and strides; no values past
    bf16 / fp32 range (no Inf, no scale 254)."""
    seen = set()
    for seed in range(200):
        c = gen.generate("attention", seed, "cuda")
        assert (c["d_qk"], c["d_v"]) in gen.ATTN_CUDA_DIMS
        for role in "qkv":
            o = c[role]
            es = 2 if o["prec"] == "bf16" else 1
            if "view" in o:
                v = data.View.from_json(o["view"])
                assert (v.offset * es) % 16 == 0 and v.strides[-1] == 1
                assert all((s * es) % 16 == 0 for s, n in zip(v.strides[:-1], v.shape[:-1]) if n > 1), (seed, role, v)
            assert "inf" not in o["events"] and "scale_max" not in o["events"]
            if o["prec"] == "mxfp8" and role == "v":
                B, H = c["B"], c["H_kv"]
                assert gen.v_blocks_along_keys(o["fmt"], o["kind"], B, H), (seed, o["kind"])
            seen.add(o.get("kind", "bf16"))
    assert seen == {"bf16", "attn", "plain", "tokens"}
    for seed in range(200):
        c = gen.generate("gemm", seed, "cuda")
        for name in ("a", "b"):
            assert c[name]["data"]["exp"] != "wide" and "scale_max" not in c[name].get("events", [])


def test_attention_and_gemm_generators_cover_the_axes():
    def tags(op, profile="any"):
        return _tags(op, 300, profile)

    for profile in gen.PROFILES:
        t = tags("attention", profile=profile)
        for want in ("format=sbhd", "format=bshd", "format=bhsd", "format=thd", "format=mixed", "pack=3hd", "pack=h3d",
                     "pack=2hd", "pack=h2d", "gqa", "causal=top_left", "causal=bottom_right", "p_format=e4m3",
                     "prec=bf16", "fp8=e4m3", "fp8=e5m2", "src=attn/compact", "src=attn/bhsd", "src=plain/swizzled",
                     "src=tokens/compact", "place=view", "dirs=both", "thd_empty_seq", "thd_one_token_seq", "thd_tail",
                     "s_tail", "s>128", "strided", "event=scale_nan", "event=scale_zero", "event=pad", "event=nan",
                     "event=big_key", "event=codes", "layout_arg=none", "layout_arg=name", "softmax_scale"):
            assert want in t, (profile, want)
        t = tags("gemm", profile=profile)
        for want in ("direction=fprop", "direction=dgrad", "direction=wgrad", "direction=tt", "prec=bf16", "int_data",
                     "accumulate", "alpha", "K_tail", "M_tail", "N_tail", "scale_layout=swizzled", "place=view",
                     "out_strided", "out_dtype=float32", "out_dtype=bfloat16", "event=scale_nan", "event=scale_one",
                     "event=scale_zero", "event=pad", "event=unread"):
            assert want in t, (profile, want)
    assert "event=scale_max" in tags("gemm") and "event=inf" in tags("attention")


def test_attention_backward_bounds_see_wrong_gradients_and_keep_the_exact_zeros():
    """The backward's GPU comparison on CPU stand-ins: the reference against itself passes; its
    largest element 10 % off, a whole head of a gradient zeroed, or a nonzero where SPEC §5 makes the
    gradient exactly zero (dQ of a row without keys) each fail (the last also as an invariant)."""
    from tests.fuzz.oracle import _from_bshd, _to_bshd

    def vals(o):
        return fp.to_f64(o.elements(), "bfloat16").reshape(o.shape)

    def with_values(outs, name, v):
        got = dict(outs)
        o = outs[name]
        got[name] = runner.Out(fp.from_f64(v.reshape(-1), "bfloat16").view(np.uint8).copy(), o.shape, o.dtype, o.itemsize)
        return got

    n_checked = n_zero = 0
    for seed in range(24):
        cfg = gen.generate("attention_backward", seed, "cuda")
        ins = gen.materialize(cfg)
        ref = runner.run(cfg, ins, "cpu")
        assert check.compare_pair(cfg, ins, "cuda vs cpu", ref, ref) == [], seed
        for name, role in (("dq", "q"), ("dk", "k"), ("dv", "v")):
            v = vals(ref[name])
            if v.size == 0 or not np.abs(v).max():
                continue
            w = v.copy()
            w.reshape(-1)[np.argmax(np.abs(w))] *= 1.1
            assert check.compare_pair(cfg, ins, "cuda vs cpu", with_values(ref, name, w), ref), (seed, name)
            b = _to_bshd(v.copy(), cfg[role]["fmt"])
            h = np.argmax(np.abs(b).max(axis=(0, 1, 3)))
            b[:, :, h] = 0.0
            assert check.compare_pair(cfg, ins, "cuda vs cpu", with_values(ref, name, _from_bshd(b, cfg[role]["fmt"])),
                                      ref), (seed, name)
            n_checked += 1
        nokey, _ = check.attention_visibility(cfg, ins)
        if nokey.any() and ref["dq"].raw.size:
            b = _to_bshd(vals(ref["dq"]).copy(), cfg["q"]["fmt"])
            i = np.argwhere(nokey)[0]
            b[i[0], i[1], 0, 0] = 1e-3
            got = with_values(ref, "dq", _from_bshd(b, cfg["q"]["fmt"]).copy())
            assert any("0 exactly" in m.expected for m in check.compare_pair(cfg, ins, "cuda vs cpu", got, ref))
            assert any("not 0" in m.note for m in check.invariants(cfg, ins, got))
            n_zero += 1
    assert n_checked >= 40 and n_zero >= 2, (n_checked, n_zero)


def test_attention_backward_configs_keep_the_scores_moderate_and_cover_the_axes():
    t = _tags("attention_backward", 200, "cuda")
    for want in ("format=sbhd", "format=bshd", "format=bhsd", "format=thd", "format=mixed", "pack=3hd", "gqa",
                 "causal=top_left", "causal=bottom_right", "prec=mxfp8", "prec=bf16", "thd_empty_seq",
                 "thd_one_token_seq", "thd_tail", "s_tail", "strided", "deterministic", "do_mxfp8", "do_event=zero_row",
                 "event=scale_zero", "event=zero_key"):
        assert want in t, want
    for seed in range(200):
        c = gen.generate("attention_backward", seed, "cuda")
        assert all(set(c[r]["events"]) <= set(gen.ATTN_BWD_EVENTS) for r in "qkv")
        assert c["softmax_scale"] is None or c["softmax_scale"] <= 0.5
        assert c["return_lse"] and all(c[r]["data"]["mult"] <= 1 for r in "qk")
        if not c["do"]["mx"]:
            v = data.View.from_json(c["do"]["view"])
            assert v.offset % 8 == 0 and all(s % 8 == 0 for s, n in zip(v.strides[:-1], v.shape[:-1]) if n > 1)


# ----------------------------------------------------------------------------- the CI subset
@pytest.mark.parametrize("profile", gen.PROFILES)
@pytest.mark.parametrize("op", gen.OPS)
def test_fuzz_cpu_reference_against_oracle(op, profile):
    """Seeds 0 .. CI_COUNTS[op] - 1: the CPU reference bit for bit against the oracle, plus the
    invariants. Known library issues (tests/fuzz/check.py KNOWN_ISSUES) are reported, not failed."""
    res = driver.run_seeds(op, list(range(CI_COUNTS[op] // 2)), "cpu", profile)
    failed = [r for r in res if r.status == "fail"]
    msg = "\n".join(f"{r.mismatches[0].line()}\n  replay: {driver.replay_command(op, r.seed, 'cpu', profile)}"
                    for r in failed[:5])
    assert not failed, f"{len(failed)} of {len(res)} configs failed:\n{msg}"


def test_dry_run_of_the_gpu_check_path():
    """The GPU check's code path (device run vs reference run from a spawned worker pool, compared
    byte for byte, invariants on the device outputs) with the CPU standing in for the GPU."""
    pool = driver._pool(2)
    try:
        for op in ("quantize", "to_bhsd", "rope_backward_quantize", "fused_q_uproj_rope_quant", "attention",
                   "attention_backward", "gemm"):
            res = driver.run_seeds(op, list(range(3)), "cpu", "cuda", pool, pair=True)
            assert len(res) == 3 and all(r.status in ("pass", "known") for r in res), \
                [m.line() for r in res for m in r.mismatches]
    finally:
        pool.shutdown()
    # the pair comparison does see a difference between the two runs
    cfg = gen.generate("apply_rope", 2, "cuda")
    ins = gen.materialize(cfg)
    a, b = runner.run(cfg, ins, "cpu"), runner.run(cfg, ins, "cpu")
    b["out"].raw[0] ^= 1
    assert check.compare_sets("apply_rope", "cuda vs cpu", a, b)


def test_a_lost_cuda_context_stops_the_run(monkeypatch):
    """After an error that breaks the CUDA context (an illegal address ...), every later call would
    fail: the run stops at that seed and says so, the results so far kept."""
    real = driver.device_side

    def fake(op, seed, profile, device):
        if seed == 2:
            return None, "RuntimeError: CUDA error: an illegal memory access was encountered"
        return real(op, seed, profile, device)

    monkeypatch.setattr(driver, "device_side", fake)
    with pytest.raises(driver.ContextLost) as e:
        driver.run_seeds("swizzle_scales", list(range(5)), "cpu", "cuda", None, pair=True)
    assert [r.seed for r in e.value.results] == [0, 1, 2] and e.value.results[-1].status == "fail"
    assert "illegal memory access" in e.value.results[-1].mismatches[0].note


def _cli(*args, env_extra=None, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.path.dirname(os.path.dirname(mxmla.__file__))]))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tests.fuzz", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_command_line_replay_count_and_failures(tmp_path, monkeypatch, capsys):
    # the command itself (a subprocess): replay a passing seed, a failing one, a usage error
    r = _cli("--op", "quantize", "--seed", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"op":"quantize","seed":3' in r.stdout and "PASS" in r.stdout
    # a failure (an injected fault): the first mismatch with op, output, index and bytes, the replay
    # command, exit status 1
    r = _cli("--op", "apply_rope", "--seed", "4", env_extra={"MXMLA_FUZZ_INJECT": "apply_rope:out:cpu"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "apply_rope [cpu vs oracle] out[" in r.stdout and "got 0x" in r.stdout and "expected 0x" in r.stdout
    assert "replay: PYTHONPATH=" in r.stdout and "--op apply_rope --seed 4 --device cpu" in r.stdout
    assert _cli("--op", "nope", "--seed", "1").returncode == 2
    # ranges (in process): the per-op summary line, the table, the JSON; the first failing seed
    assert driver.main(["--op", "swizzle_scales", "unswizzle_scales", "--count", "5", "--start", "10", "--jobs", "0",
                        "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "swizzle_scales: 5 configs run, 5 passed, 0 failed" in out and "fuzz summary" in out
    assert '"configs": 5' in (tmp_path / "r.json").read_text()
    monkeypatch.setenv("MXMLA_FUZZ_INJECT", "apply_rope:out:cpu")
    assert driver.main(["--op", "apply_rope", "--count", "3", "--start", "7", "--jobs", "0"]) == 1
    out = capsys.readouterr().out
    assert "first failing seed 7" in out and "--op apply_rope --seed 7 --device cpu" in out


def test_a_hung_device_run_ends_the_run_with_its_seed():
    """A device run that never returns (a kernel that hangs) ends the process after
    MXMLA_FUZZ_SEED_TIMEOUT seconds with the seed and its replay command (exit status 3), in a range
    and in a replay; the seeds before it ran."""
    env = {"MXMLA_FUZZ_SEED_TIMEOUT": "2", "MXMLA_FUZZ_STALL": "swizzle_scales:2"}
    r = _cli("--op", "swizzle_scales", "--count", "4", "--jobs", "0", "--pair", env_extra=env)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "HANG swizzle_scales seed 2: the cpu run did not return within 2 s" in r.stdout
    assert "--op swizzle_scales --seed 2 --device cpu" in r.stdout
    r = _cli("--op", "swizzle_scales", "--seed", "2", "--pair", env_extra=env)
    assert r.returncode == 3 and '"seed":2' in r.stdout and "HANG swizzle_scales seed 2" in r.stdout, r.stdout
    r = _cli("--op", "swizzle_scales", "--count", "2", "--jobs", "0", "--pair", env_extra=env)  # seeds 0, 1: no stall
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr


def test_known_issues_are_reported_not_failed(monkeypatch, capsys):
    monkeypatch.setenv("MXMLA_FUZZ_INJECT", "swizzle_scales:out")
    monkeypatch.setitem(check.KNOWN_ISSUES, "KI-T", ("an injected fault", lambda cfg, m: m.output == "out"))
    assert driver.main(["--op", "swizzle_scales", "--count", "3", "--jobs", "0"]) == 0
    out = capsys.readouterr().out
    assert "KNOWN KI-T:" in out and "3 known issue(s) (KI-T)" in out and "known issue KI-T: an injected fault" in out
    assert driver.main(["--op", "swizzle_scales", "--count", "3", "--jobs", "0", "--strict"]) == 1
    assert driver.main(["--op", "swizzle_scales", "--seed", "1"]) == 0
    assert driver.main(["--op", "swizzle_scales", "--seed", "1", "--strict"]) == 1


def test_sanitizer_sample_command(tmp_path):
    """--sanitize-sample re-runs a sample under compute-sanitizer: a stand-in that runs the command
    it is given checks the plumbing (arguments, environment, log, summary line)."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\n# drop the sanitizer's own options, run the program\nwhile [ \"${1#-}\" != \"$1\" ]; "
                    "do case $1 in --tool|--error-exitcode|--print-limit) shift 2;; *) shift;; esac; done\n"
                    "echo \"PYTORCH_NO_CUDA_MEMORY_CACHING=$PYTORCH_NO_CUDA_MEMORY_CACHING\"\n\"$@\"; rc=$?\n"
                    "echo '========= ERROR SUMMARY: 0 errors'\nexit $rc\n")
    fake.chmod(0o755)
    log = tmp_path / "san.log"
    r = _cli("--op", "quantize", "attention_scales_to_bhsd", "--count", "4", "--jobs", "0", "--pair",
             "--sanitize-sample", "2", "--sanitizer-log", str(log),
             env_extra={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout + r.stderr
    text = log.read_text()
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in text and "--seeds 0,2" in r.stdout
    assert "attention_scales_to_bhsd: 2 configs run, 2 passed" in text
    assert "sanitizer (memcheck): ok, 2 seeds per op; ========= ERROR SUMMARY: 0 errors" in r.stdout


# ----------------------------------------------------------------------------- GPU subset
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU fuzz subset skipped")
@pytest.mark.parametrize("op", gen.OPS)
def test_fuzz_cuda_against_cpu_reference(op):
    res = driver.run_seeds(op, list(range(GPU_COUNT)), "cuda", "cuda", None)
    failed = [r for r in res if r.status == "fail"]
    msg = "\n".join(f"{r.mismatches[0].line()}\n  replay: {driver.replay_command(op, r.seed, 'cuda', 'cuda')}"
                    for r in failed[:5])
    assert not failed, f"{len(failed)} of {len(res)} configs failed:\n{msg}"
