"""Attention on MXFP8 / bf16 Q, K, V through Python (SPEC §5): qkv_layout on every packed and unpacked
layout (torch and numpy, MXFP8 codes in both directions), the numpy path (CPU reference) against an
independent float64 attention written here (formats, GQA, causal top-left and bottom-right, thd with
empty and length-1 sequences, E4M3 P, MXFP8 inputs decoded here from their codes and compact scales,
BHSD scales bit-identical to compact ones), the torch CPU path, errors, the custom op and
torch.compile, and the CUDA kernel against the CPU reference (skipped without a GPU)."""
import math

import numpy as np
import pytest

import mxmla

ml_dtypes = pytest.importorskip("ml_dtypes")

try:
    import torch
except ImportError:  # torch is optional: its tests skip
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
HAVE_GPU = torch is not None and torch.cuda.is_available() and bool(mxmla.info()["gpus"]) and \
    mxmla.info()["cuda_enabled"]
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU test skipped")

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


# ----------------------------------------------------------------------------- helpers
def randn(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(BF16)


def t_(a):
    """numpy (ml_dtypes bf16, uint8, int) -> torch CPU tensor (same bits)."""
    if a.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def n_(t):
    """torch tensor -> numpy (bf16 as ml_dtypes)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).view(BF16)
    return t.numpy()


def f64(a):
    """float64 values (uint16 arrays are bf16 bits)."""
    a = np.asarray(a)
    return (a.view(BF16) if a.dtype == np.uint16 else a).astype(np.float64)


def mx_map(t, fn):
    """An MXFP8Tensor whose buffers are fn(buffer) (a view, a copy, a device move); same metadata."""
    f = lambda b: None if b is None else fn(b)  # noqa: E731
    return mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, f(t.rowwise_data), f(t.rowwise_scale_inv),
                             f(t.columnwise_data), f(t.columnwise_scale_inv), layout=t.layout, attention=t.attention)


def mx_view(t, codes_fn, rowwise=True, columnwise=True):
    """A view of some codes of t (scales kept whole: they describe the quantized shape t.shape)."""
    return mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout,
                             codes_fn(t.rowwise_data) if rowwise and t.rowwise_data is not None else None,
                             t.rowwise_scale_inv if rowwise else None,
                             codes_fn(t.columnwise_data) if columnwise and t.columnwise_data is not None else None,
                             t.columnwise_scale_inv if columnwise else None, layout=t.layout, attention=t.attention)


# -- independent decoding of MXFP8 (codes · 2^(e - 127), compact scales)
def e8m0(e):
    return np.exp2(np.asarray(e).astype(np.float64) - 127.0)


def decode(codes):
    return np.asarray(codes).view(E4M3).astype(np.float64)


def deq_attention(t, direction):
    """Values of a quantize_attention tensor (compact scales) from one direction."""
    codes, sc = getattr(t, f"{direction}_data"), getattr(t, f"{direction}_scale_inv")
    shape = t.shape
    if direction == "rowwise":
        s = np.repeat(e8m0(sc).reshape(*shape[:-1], shape[-1] // 32), 32, axis=-1)
    elif t.layout == "sbhd":
        S, B, H, D = shape
        s = e8m0(sc).reshape(-1, B, H, D)[np.arange(S) // 32]
    else:
        B, S, H, D = shape
        s = e8m0(sc).reshape(B, -1, H, D)[:, np.arange(S) // 32]
    return decode(codes) * s


def deq_plain(t, direction, view_shape):
    """Values of a quantize() tensor ([M, K] flattened, compact scales), viewed as view_shape."""
    codes, sc = getattr(t, f"{direction}_data"), getattr(t, f"{direction}_scale_inv")
    K = t.shape[-1]
    c = decode(codes).reshape(-1, K)
    if direction == "rowwise":
        s = np.repeat(e8m0(sc), 32, axis=1)
    else:
        s = e8m0(sc)[np.arange(c.shape[0]) // 32]
    return (c * s).reshape(view_shape)


# -- the float64 attention
def e4m3_tilde(p):
    return (p * 256.0).astype(E4M3).astype(np.float64) / 256.0


def ref_bhsd(q, k, v, scale, causal=False, bottom_right=False, p_format="bfloat16"):
    """q [B, H, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] float64 -> (O float64, LSE float64).
    E4M3 P: online over blocks of 128 keys (running max m_t, P̃ = e4m3(p·2^8)/2^8, l from the unrounded p)."""
    B, H, Sq, _ = q.shape
    Hkv, Skv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    n = np.full(Sq, Skv)
    if causal:
        n = np.clip(np.arange(Sq) + 1 + (Skv - Sq if bottom_right else 0), 0, Skv)
    vis = np.arange(Skv)[None, :] < n[:, None]
    s = np.where(vis, s, -np.inf)
    o, l, m = np.zeros((B, H, Sq, Dv)), np.zeros((B, H, Sq)), np.full((B, H, Sq), -np.inf)
    blk = 128 if p_format == "e4m3" else max(Skv, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        for j0 in range(0, Skv, blk):
            sb = s[..., j0:j0 + blk]
            mb = np.maximum(m, sb.max(-1))
            alpha = np.where(np.isneginf(mb), 0.0, np.exp(m - mb))
            p = np.where(vis[:, j0:j0 + blk], np.exp(sb - np.where(np.isneginf(mb), 0.0, mb)[..., None]), 0.0)
            pt = e4m3_tilde(p) if p_format == "e4m3" else p
            o = o * alpha[..., None] + pt @ v[..., j0:j0 + blk, :]
            l = l * alpha + p.sum(-1)
            m = mb
        none = (n == 0)[None, None, :]
        O = np.where(none[..., None], 0.0, o / np.where(l == 0, 1.0, l)[..., None])
        lse = np.where(none, -np.inf, m + np.log(np.where(l == 0, 1.0, l)))
    return O, lse


def to_bhsd(a, fmt):
    return {"sbhd": lambda x: x.transpose(1, 2, 0, 3), "bshd": lambda x: x.transpose(0, 2, 1, 3),
            "bhsd": lambda x: x}[fmt](a)


def from_bhsd(a, fmt):
    return {"sbhd": lambda x: x.transpose(2, 0, 1, 3), "bshd": lambda x: x.transpose(0, 2, 1, 3),
            "bhsd": lambda x: x}[fmt](a)


def reference(q, k, v, fmt="sbhd", kv_fmt=None, scale=None, causal=False, bottom_right=False, p_format="bfloat16",
              cu_q=None, cu_kv=None):
    """float64 attention of float64 q, k, v in their formats -> (O in q's format, LSE [b, h, s_q] / [h, t])."""
    kv_fmt = kv_fmt or fmt
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kw = dict(scale=scale, causal=causal, bottom_right=bottom_right, p_format=p_format)
    if fmt != "thd":
        O, lse = ref_bhsd(to_bhsd(q, fmt), to_bhsd(k, kv_fmt), to_bhsd(v, kv_fmt), **kw)
        return from_bhsd(O, fmt), lse
    T, H = q.shape[:2]
    O, lse = np.zeros((T, H, v.shape[-1])), np.full((H, T), -np.inf)
    for i in range(len(cu_q) - 1):
        a, b, c, d = cu_q[i], cu_q[i + 1], cu_kv[i], cu_kv[i + 1]
        seq = lambda x, lo, hi: x[lo:hi].transpose(1, 0, 2)[None]  # noqa: E731
        o, ls = ref_bhsd(seq(q, a, b), seq(k, c, d), seq(v, c, d), **kw)
        O[a:b] = o[0].transpose(1, 0, 2)
        lse[:, a:b] = ls[0]
    return O, lse


def assert_close_bf16(o, ref):
    """O (bf16) against the float64 reference: O is ref rounded once to bf16 (one ulp allowed for
    summation-order ties)."""
    o = f64(o)
    assert o.shape == ref.shape
    bad = ~(np.abs(o - ref) <= np.abs(ref) * 2.0 ** -8 + 1e-30)
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements differ, first at {np.argwhere(bad)[0]}: " \
                          f"{o[tuple(np.argwhere(bad)[0])]} vs {ref[tuple(np.argwhere(bad)[0])]}"


def assert_close_lse(lse, ref):
    lse = f64(lse)
    assert lse.shape == ref.shape and lse.dtype == np.float64
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(lse[fin], ref[fin], rtol=1e-6, atol=1e-6)


def shape_in(fmt, b, s, h, d):
    return {"sbhd": (s, b, h, d), "bshd": (b, s, h, d), "bhsd": (b, h, s, d)}[fmt]


# ----------------------------------------------------------------------------- qkv_layout
def packed_views(fmt, pattern, lib, s=5, b=2, t=7, h=3, d=32, q_in_buffer=False):
    """q, k, v as the layout `pattern` lays them out, from numpy ("np") or torch ("torch") buffers."""
    tok = (t,) if fmt == "thd" else ((s, b) if fmt == "sbhd" else (b, s))
    mk = (lambda shape: torch.randn(shape, dtype=torch.bfloat16)) if lib == "torch" else \
        (lambda shape: randn(shape))
    nt = len(tok)
    sl = lambda buf, axis, i: buf[(slice(None),) * axis + (i,)]  # noqa: E731
    if pattern == "3hd":
        buf = mk(tok + (3, h, d))
        return [sl(buf, nt, i) for i in range(3)]
    if pattern == "h3d":
        buf = mk(tok + (h, 3, d))
        return [sl(buf, nt + 1, i) for i in range(3)]
    if pattern in ("2hd", "h2d"):
        if q_in_buffer:  # q and kv in one allocation, q first
            n = math.prod(tok) * h * d
            flat = mk((3 * n,))
            q = flat[:n].reshape(tok + (h, d))
            kv = flat[n:].reshape(tok + ((2, h, d) if pattern == "2hd" else (h, 2, d)))
        else:
            q, kv = mk(tok + (h, d)), mk(tok + ((2, h, d) if pattern == "2hd" else (h, 2, d)))
        axis = nt if pattern == "2hd" else nt + 1
        return [q, sl(kv, axis, 0), sl(kv, axis, 1)]
    return [mk(tok + (h, d)) for _ in range(3)]  # separate


def expected_name(fmt, pattern):
    tk = fmt[:-2]
    return {"3hd": tk + "3hd", "h3d": tk + "h3d", "2hd": f"{fmt}_{tk}2hd", "h2d": f"{fmt}_{tk}h2d",
            "separate": f"{fmt}_{fmt}_{fmt}"}[pattern]


LIBS = ["np", pytest.param("torch", marks=needs_torch)]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("pattern", ["3hd", "h3d", "2hd", "h2d", "separate"])
def test_qkv_layout_every_packed_and_unpacked_layout(lib, fmt, pattern):
    q, k, v = packed_views(fmt, pattern, lib)
    name = expected_name(fmt, pattern)
    assert mxmla.qkv_layout(q, k, v, fmt) == name
    if fmt == "thd":
        assert mxmla.qkv_layout(q, k, v) == name  # 3-D: thd without being told
    if pattern in ("2hd", "h2d"):  # q in the same allocation as k and v
        assert mxmla.qkv_layout(*packed_views(fmt, pattern, lib, q_in_buffer=True), fmt) == name


@pytest.mark.parametrize("lib", LIBS)
def test_qkv_layout_default_format_bhsd_and_mixed(lib):
    q, k, v = packed_views("sbhd", "3hd", lib)
    assert mxmla.qkv_layout(q, k, v) == "sb3hd"  # 4-D without a format: TransformerEngine's default sbhd
    q, k, v = packed_views("bshd", "h2d", lib)
    assert mxmla.qkv_layout(q, k, v) == "sbhd_sbh2d"  # the same memory named in sbhd
    # bhsd: TransformerEngine names no packed layout, views of one buffer included
    bh = [x.permute(1, 2, 0, 3) if lib == "torch" else x.transpose(1, 2, 0, 3)
          for x in packed_views("sbhd", "3hd", lib)]
    assert mxmla.qkv_layout(*bh, "bhsd") == "bhsd_bhsd_bhsd"
    # mixed formats: q sbhd, k / v bshd
    q = packed_views("sbhd", "separate", lib)[0]
    _, k, v = packed_views("bshd", "2hd", lib)
    assert mxmla.qkv_layout(q, k, v, "sbhd_2bshd") == "sbhd_bshd_bshd"
    assert mxmla.qkv_layout(q[:, 0], k[:1], v[:1], "thd_2bshd") == "thd_bshd_bshd"
    bh = [x.permute(0, 2, 1, 3) if lib == "torch" else x.transpose(0, 2, 1, 3) for x in (k, v)]
    assert mxmla.qkv_layout(q, *bh, "sbhd_2bhsd") == "sbhd_bhsd_bhsd"  # any pair of formats has a name


@pytest.mark.parametrize("lib", LIBS)
def test_qkv_layout_lookalikes_are_unpacked(lib):
    q, k, v = packed_views("sbhd", "3hd", lib)
    assert mxmla.qkv_layout(q, v, k) == "sbhd_sbhd_sbhd"  # slices out of order
    assert mxmla.qkv_layout(q, k, q) == "sbhd_sbhd_sbhd"
    # one head: 3hd and h3d offsets coincide; the 3hd name comes first, as in TransformerEngine
    q1, k1, v1 = packed_views("sbhd", "h3d", lib, h=1)
    assert mxmla.qkv_layout(q1, k1, v1) == "sb3hd"
    # three windows of one [N, h, d] buffer one token apart: tokens overlap, not a packed layout
    mk = (lambda shape: torch.randn(shape, dtype=torch.bfloat16)) if lib == "torch" else randn
    flat = mk((8, 3, 32))
    w = [flat[i:i + 5][:, None] for i in range(3)]  # [5, 1, 3, 32], k at q + 3*32
    assert mxmla.qkv_layout(*w) == "sbhd_sbhd_sbhd"


def test_qkv_layout_numpy_memory_through_two_owners():
    raw = np.zeros(5 * 2 * 3 * 4 * 32, np.uint16).tobytes()
    a = np.frombuffer(raw, dtype=BF16).reshape(5, 2, 3, 4, 32)
    b = np.frombuffer(raw, dtype=BF16).reshape(5, 2, 3, 4, 32)
    assert a.base is not None and mxmla.qkv_layout(a[:, :, 0], b[:, :, 1], a[:, :, 2]) == "sb3hd"


def test_qkv_layout_any_dtype_and_gqa():
    kv = np.zeros((4, 2, 2, 1, 64), np.float32)  # [s, b, 2, h_kv, d]
    q = np.zeros((4, 2, 8, 64), np.float32)
    assert mxmla.qkv_layout(q, kv[:, :, 0], kv[:, :, 1]) == "sbhd_sb2hd"
    v = np.zeros((4, 2, 1, 32), np.float32)  # d_v != d_qk: only unpacked
    assert mxmla.qkv_layout(q, kv[:, :, 0], v) == "sbhd_sbhd_sbhd"


def _mx_packed(lib, pattern="3hd", s=40, b=2, h=2, d=64):
    """quantize() of a packed [s, b, 3, h, d] buffer, q / k / v as views of its codes (both directions)."""
    x = randn((s, b, 3, h, d) if pattern == "3hd" else (s, b, h, 3, d), seed=3)
    x = t_(x) if lib == "torch" else x
    q8 = mxmla.quantize(x)
    ax = 2 if pattern == "3hd" else 3
    return [mx_view(q8, lambda c, i=i: c[(slice(None),) * ax + (i,)]) for i in range(3)], q8


@pytest.mark.parametrize("lib", LIBS)
def test_qkv_layout_mxfp8_reads_the_codes_of_both_directions(lib):
    (q, k, v), q8 = _mx_packed(lib)
    assert mxmla.qkv_layout(q, k, v) == "sb3hd"
    (q, k, v), _ = _mx_packed(lib, "h3d")
    assert mxmla.qkv_layout(q, k, v) == "sbh3d"
    # separate quantize_attention results: unpacked; the format comes from the tensors (bshd)
    xs = [randn((2, 40, 2, 64), seed=i) for i in range(3)]
    xs = [t_(x) for x in xs] if lib == "torch" else xs
    for bhsd in (False, True):
        qa, ka, va = (mxmla.quantize_attention(x, "bshd", bhsd_scales=bhsd) for x in xs)
        assert mxmla.qkv_layout(qa, ka, va) == "bshd_bshd_bshd"
        assert mxmla.qkv_layout(qa, ka, va, "sbhd") == "sbhd_sbhd_sbhd"  # told otherwise: the caller's format
    # only the directions attention reads (Q, K rowwise, V columnwise): decided from those codes
    (q, k, v), _ = _mx_packed(lib)
    q_r, k_r = (mx_view(t, lambda c: c, columnwise=False) for t in (q, k))
    v_c = mx_view(v, lambda c: c, rowwise=False)
    assert mxmla.qkv_layout(q_r, k_r, v_c) == "sbhd_sbhd_sbhd"
    assert mxmla.qkv_layout(q_r, k_r, mx_view(v, lambda c: c, columnwise=False)) == "sb3hd"


@pytest.mark.parametrize("lib", LIBS)
def test_qkv_layout_mxfp8_directions_that_disagree_raise(lib):
    (q, k, v), q8 = _mx_packed(lib)
    # columnwise codes of the same tensors copied apart: rowwise says sb3hd, columnwise does not
    copy = (lambda c: c.clone()) if lib == "torch" else (lambda c: c.copy())
    apart = [mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, t.rowwise_data, t.rowwise_scale_inv,
                               copy(t.columnwise_data), t.columnwise_scale_inv) for t in (q, k, v)]
    with pytest.raises(ValueError, match=r"mxmla.qkv_layout: .*rowwise codes are laid out as 'sb3hd' but the "
                                         r"columnwise codes as 'sbhd_sbhd_sbhd'"):
        mxmla.qkv_layout(*apart)
    with pytest.raises(ValueError, match="rowwise codes are laid out as 'sb3hd'"):
        mxmla.attention(*apart)  # attention detects the same way
    # the scales play no part: swapping them changes nothing
    swapped = [mx_view(t, lambda c: c) for t in (q, k, v)]
    swapped[0].rowwise_scale_inv = q8.columnwise_scale_inv
    assert mxmla.qkv_layout(*swapped) == "sb3hd"


def test_qkv_layout_errors():
    q, k, v = randn((5, 2, 4, 64)), randn((5, 2, 2, 64)), randn((5, 2, 2, 32))
    assert mxmla.qkv_layout(q, k, v) == "sbhd_sbhd_sbhd"
    with pytest.raises(ValueError, match=r"mxmla.qkv_layout: argument 'q': format 'thd' needs a 3-D tensor"):
        mxmla.qkv_layout(q, k, v, "thd")
    with pytest.raises(ValueError, match=r"argument 'qkv_format': must be 'sbhd', 'bshd', 'bhsd', 'thd' or "
                                         r"'<q format>_2<k/v format>' \(e.g. 'sbhd_2bshd'\), got 'sb3hd'"):
        mxmla.qkv_layout(q, k, v, "sb3hd")
    with pytest.raises(ValueError, match=r"argument 'k': head dim 32 differs from q's 64"):
        mxmla.qkv_layout(q, randn((5, 2, 2, 32)), v)
    with pytest.raises(ValueError, match=r"argument 'v': shape \[6, 2, 2, 32\] does not match k's"):
        mxmla.qkv_layout(q, k, randn((6, 2, 2, 32)))
    with pytest.raises(ValueError, match=r"argument 'k': batch 3 differs from q's 2"):
        mxmla.qkv_layout(q, randn((5, 3, 2, 64)), randn((5, 3, 2, 32)))
    with pytest.raises(ValueError, match=r"argument 'k': q's 4 heads are not a multiple of k's 3"):
        mxmla.qkv_layout(q, randn((5, 2, 3, 64)), randn((5, 2, 3, 32)))
    with pytest.raises(ValueError, match=r"argument 'q': the head dim must be contiguous"):
        mxmla.qkv_layout(randn((5, 2, 64, 4)).transpose(0, 1, 3, 2), k, v)
    with pytest.raises(ValueError, match=r"argument 'qkv_format': q is 3-D \(thd\) and k / v are 4-D"):
        mxmla.qkv_layout(q[:, 0], k, v)
    with pytest.raises(TypeError, match=r"argument 'k': expected a torch.Tensor or numpy.ndarray, got list"):
        mxmla.qkv_layout(q, [1, 2], v)
    with pytest.raises(TypeError, match=r"argument 'v': q, k and v must all be MXFP8Tensors or all be bf16"):
        mxmla.qkv_layout(*[mxmla.quantize(x.astype(np.float32)) for x in (q, k)], v)
    if torch is not None:
        with pytest.raises(TypeError, match=r"argument 'v': expected a numpy.ndarray like argument 'q'"):
            mxmla.qkv_layout(q, k, t_(v))


# ----------------------------------------------------------------------------- attention: numpy path vs float64
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "bhsd"])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
def test_numpy_bf16_matches_float64(fmt, causal, bottom_right):
    b, sq, skv, h, hkv, d, dv = 2, 37, 45, 4, 2, 64, 32  # GQA 2:1, s_q != s_kv
    q, k, v = (randn(shape_in(fmt, b, s, hh, dd), seed=i)
               for i, (s, hh, dd) in enumerate([(sq, h, d), (skv, hkv, d), (skv, hkv, dv)]))
    o, lse = mxmla.attention(q, k, v, causal=causal, bottom_right=bottom_right, layout=fmt, return_lse=True)
    assert o.dtype == BF16 and o.shape == shape_in(fmt, b, sq, h, dv)
    assert lse.dtype == np.float32 and lse.shape == (b, h, sq)
    ro, rl = reference(f64(q), f64(k), f64(v), fmt, causal=causal, bottom_right=bottom_right)
    assert_close_bf16(o, ro)
    assert_close_lse(lse, rl)


@pytest.mark.parametrize("q_fmt,kv_fmt", [("sbhd", "bshd"), ("bshd", "bhsd")])
def test_numpy_mixed_formats(q_fmt, kv_fmt):
    b, sq, skv, h, d, dv = 2, 9, 13, 2, 64, 32
    q = randn(shape_in(q_fmt, b, sq, h, d), 1)
    k, v = randn(shape_in(kv_fmt, b, skv, h, d), 2), randn(shape_in(kv_fmt, b, skv, h, dv), 3)
    o, lse = mxmla.attention(q, k, v, layout=f"{q_fmt}_2{kv_fmt}", causal=True, return_lse=True)
    assert o.shape == shape_in(q_fmt, b, sq, h, dv)
    ro, rl = reference(f64(q), f64(k), f64(v), q_fmt, kv_fmt, causal=True)
    assert_close_bf16(o, ro)
    assert_close_lse(lse, rl)
    o2 = mxmla.attention(q, k, v, layout=f"{q_fmt}_{kv_fmt}_{kv_fmt}", causal=True)
    np.testing.assert_array_equal(o2.view(np.uint16), o.view(np.uint16))


@pytest.mark.parametrize("p_format", ["bfloat16", "e4m3"])
def test_numpy_p_format_and_softmax_scale(p_format):
    b, s, h, d = 1, 300, 2, 64  # three key blocks of 128 for E4M3 P
    q, k, v = (randn((s, b, h, d), seed=i) for i in range(3))
    scale = mxmla.yarn_softmax_scale(d)  # DeepSeek-V3's YaRN softmax scale at this head dim
    o, lse = mxmla.attention(q, k, v, causal=True, p_format=p_format, softmax_scale=scale, return_lse=True)
    ro, rl = reference(f64(q), f64(k), f64(v), scale=scale, causal=True, p_format=p_format)
    assert_close_bf16(o, ro)
    assert_close_lse(lse, rl)
    if p_format == "e4m3":  # E4M3 P is a different (coarser) result than the exact softmax
        exact, _ = reference(f64(q), f64(k), f64(v), scale=scale, causal=True)
        assert np.abs(f64(o) - exact).max() > 1e-3
    # softmax_scale None is d_qk^-0.5
    np.testing.assert_array_equal(mxmla.attention(q, k, v, p_format=p_format).view(np.uint16),
                                  mxmla.attention(q, k, v, p_format=p_format, softmax_scale=d ** -0.5).view(np.uint16))


@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
def test_numpy_thd_with_empty_and_length_one_sequences(causal, bottom_right):
    # q lengths 5, 0, 1, 0, 14 and 2 padding tokens after the end; kv lengths 7, 0, 1, 3, 19: an empty
    # sequence, length-1 sequences, one with keys and no queries; then one with queries and no keys
    cu_kv = [0, 7, 7, 8, 11, 30]
    h, hkv, d, dv = 4, 1, 64, 32  # multi-query
    for cu_q in ([0, 5, 5, 6, 6, 20], [0, 5, 7, 8, 8, 20]):
        q, k, v = randn((22, h, d), 1), randn((31, hkv, d), 2), randn((31, hkv, dv), 3)
        o, lse = mxmla.attention(q, k, v, causal=causal, bottom_right=bottom_right, cu_seqlens_q=cu_q,
                                 cu_seqlens_kv=np.array(cu_kv, np.int32), return_lse=True)
        assert o.shape == (22, h, dv) and lse.shape == (h, 22)
        ro, rl = reference(f64(q), f64(k), f64(v), "thd", causal=causal, bottom_right=bottom_right, cu_q=cu_q,
                           cu_kv=cu_kv)
        assert_close_bf16(o, ro)
        assert_close_lse(lse, rl)
        assert (f64(o[20:]) == 0).all() and np.isneginf(lse[:, 20:]).all()  # padding: O = 0, LSE = -inf
        # max_seqlen bounds (at least the longest sequences) give the same result
        o2 = mxmla.attention(q, k, v, causal=causal, bottom_right=bottom_right, cu_seqlens_q=cu_q,
                             cu_seqlens_kv=cu_kv, max_seqlen_q=14, max_seqlen_kv=19)
        np.testing.assert_array_equal(o2.view(np.uint16), o.view(np.uint16))


def test_numpy_uint16_bits_and_no_keys():
    q, k, v = randn((3, 1, 2, 32)), randn((0, 1, 2, 32)), randn((0, 1, 2, 32))  # s_kv = 0: no key anywhere
    o, lse = mxmla.attention(q.view(np.uint16), k.view(np.uint16), v.view(np.uint16), return_lse=True)
    assert o.dtype == np.uint16 and (o == 0).all() and np.isneginf(lse).all()
    o = mxmla.attention(q, q, q, causal=True, bottom_right=True)  # s_q = s_kv: bottom-right is top-left
    np.testing.assert_array_equal(o.view(np.uint16), mxmla.attention(q, q, q, causal=True).view(np.uint16))


def _qkv_f32(fmt, b=2, sq=40, skv=70, h=4, hkv=2, d=64, dv=64):
    rng = np.random.default_rng(7)
    return [rng.standard_normal(shape_in(fmt, b, s, hh, dd)).astype(np.float32) * sc
            for s, hh, dd, sc in [(sq, h, d, 1.0), (skv, hkv, d, 1.0), (skv, hkv, dv, 3.0)]]


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_mxfp8_attention_quantized_compact_and_bhsd_scales(fmt, causal):
    q, k, v = _qkv_f32(fmt)
    compact = [mxmla.quantize_attention(x, fmt, bhsd_scales=False) for x in (q, k, v)]
    bhsd = [mxmla.quantize_attention(x, fmt) for x in (q, k, v)]
    o, lse = mxmla.attention(*compact, causal=causal, return_lse=True)
    ref_in = [deq_attention(compact[0], "rowwise"), deq_attention(compact[1], "rowwise"),
              deq_attention(compact[2], "columnwise")]
    ro, rl = reference(*ref_in, fmt, causal=causal)
    assert_close_bf16(o, ro)
    assert_close_lse(lse, rl)
    # the same codes through BHSD scales: bit for bit; to_bhsd's output too
    o2, lse2 = mxmla.attention(*bhsd, causal=causal, return_lse=True)
    np.testing.assert_array_equal(o2.view(np.uint16), o.view(np.uint16))
    np.testing.assert_array_equal(lse2, lse)
    o3 = mxmla.attention(*mxmla.to_bhsd(*compact), causal=causal, layout=f"{fmt}_{fmt}_{fmt}")
    np.testing.assert_array_equal(o3.view(np.uint16), o.view(np.uint16))
    # rowwise-only Q / K and columnwise-only V are enough
    ro_ = [mxmla.quantize_attention(q, fmt, columnwise=False), mxmla.quantize_attention(k, fmt, columnwise=False),
           mxmla.quantize_attention(v, fmt, rowwise=False)]
    np.testing.assert_array_equal(mxmla.attention(*ro_, causal=causal).view(np.uint16), o.view(np.uint16))


def test_numpy_mxfp8_plain_quantize_bhsd_and_thd():
    # bhsd: quantize() of a contiguous [b, h, s, d]: columnwise blocks run along s
    q, k, v = _qkv_f32("bhsd", sq=64, skv=96)
    q8, k8, v8 = (mxmla.quantize(x) for x in (q, k, v))
    o = mxmla.attention(q8, k8, v8, layout="bhsd", causal=True)
    ro, _ = reference(deq_plain(q8, "rowwise", q.shape), deq_plain(k8, "rowwise", k.shape),
                      deq_plain(v8, "columnwise", v.shape), "bhsd", causal=True)
    assert_close_bf16(o, ro)
    # thd: V quantized token-major as [t, h*d] (its columnwise blocks run along tokens), codes viewed [t, h, d]
    cu = [0, 30, 31, 64]
    rng = np.random.default_rng(2)
    qt, kt, vt = (rng.standard_normal((64, hh, 64)).astype(np.float32) for hh in (4, 2, 2))
    qt8 = mxmla.quantize(qt, columnwise=False)
    kt8 = mxmla.quantize(kt, columnwise=False)
    v2 = mxmla.quantize(vt.reshape(64, 128), rowwise=False)
    vt8 = mx_view(v2, lambda c: c.reshape(64, 2, 64), rowwise=False)
    o, lse = mxmla.attention(qt8, kt8, vt8, cu_seqlens_q=cu, cu_seqlens_kv=cu, causal=True, return_lse=True)
    ro, rl = reference(deq_plain(qt8, "rowwise", qt.shape), deq_plain(kt8, "rowwise", kt.shape),
                       deq_plain(v2, "columnwise", vt.shape), "thd", causal=True, cu_q=cu, cu_kv=cu)
    assert_close_bf16(o, ro)
    assert_close_lse(lse, rl)
    assert o.dtype == np.uint16  # MXFP8 numpy inputs: bf16 bits, as the other numpy ops return them


def test_numpy_packed_views_equal_separate_copies():
    q, k, v = packed_views("bshd", "3hd", "np", s=33, b=2, h=2, d=64)
    assert mxmla.qkv_layout(q, k, v, "bshd") == "bs3hd"
    o = mxmla.attention(q, k, v, layout="bs3hd", causal=True)
    sep = mxmla.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), layout="bshd", causal=True)
    np.testing.assert_array_equal(o.view(np.uint16), sep.view(np.uint16))
    np.testing.assert_array_equal(mxmla.attention(q, k, v, layout="bshd", causal=True).view(np.uint16),
                                  sep.view(np.uint16))
    # MXFP8 views of one packed quantization: qkv_layout names them, but attention cannot map the scales
    # of a [s, b, 3, h, d] quantization to a [s, b, h, d] view (the C++ rule; quantize Q, K, V apart)
    (q8, k8, v8), _ = _mx_packed("np", s=64)
    assert mxmla.qkv_layout(q8, k8, v8) == "sb3hd"
    with pytest.raises(ValueError, match=r"argument 'q.shape': the MXFP8 tensor was quantized as \[64, 2, 3, 2, 64\], "
                                         r"which cannot be read as its codes \[64, 2, 2, 64\]"):
        mxmla.attention(q8, k8, v8)


# ----------------------------------------------------------------------------- torch CPU path
@needs_torch
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "bhsd"])
def test_torch_cpu_matches_numpy(fmt):
    b, sq, skv, h, hkv, d, dv = 2, 20, 33, 2, 1, 64, 32
    q, k, v = (randn(shape_in(fmt, b, s, hh, dd), seed=i)
               for i, (s, hh, dd) in enumerate([(sq, h, d), (skv, hkv, d), (skv, hkv, dv)]))
    o, lse = mxmla.attention(q, k, v, causal=True, bottom_right=True, layout=fmt, return_lse=True)
    ot, lt = mxmla.attention(t_(q), t_(k), t_(v), causal=True, bottom_right=True, layout=fmt, return_lse=True)
    assert ot.dtype == torch.bfloat16 and lt.dtype == torch.float32 and ot.is_contiguous()
    np.testing.assert_array_equal(n_(ot).view(np.uint16), o.view(np.uint16))
    np.testing.assert_array_equal(n_(lt), lse)
    assert mxmla.attention(t_(q), t_(k), t_(v), layout=fmt).shape == ot.shape  # without return_lse: O alone


@needs_torch
def test_torch_cpu_mxfp8_and_thd_match_numpy():
    q, k, v = _qkv_f32("sbhd", sq=45, skv=45)
    nq = [mxmla.quantize_attention(x, "sbhd") for x in (q, k, v)]
    tq = [mxmla.quantize_attention(torch.from_numpy(x), "sbhd") for x in (q, k, v)]
    o = mxmla.attention(*nq, causal=True, p_format="e4m3")
    ot = mxmla.attention(*tq, causal=True, p_format="e4m3")
    np.testing.assert_array_equal(n_(ot).view(np.uint16), o.view(np.uint16))
    cu = [0, 3, 3, 10]
    qt, kt, vt = randn((12, 2, 64), 1), randn((10, 2, 64), 2), randn((10, 2, 32), 3)
    o, lse = mxmla.attention(qt, kt, vt, cu_seqlens_q=cu, cu_seqlens_kv=cu, return_lse=True)
    for cu_t in (cu, torch.tensor(cu), torch.tensor(cu, dtype=torch.int32)):
        ot, lt = mxmla.attention(t_(qt), t_(kt), t_(vt), cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, return_lse=True)
        np.testing.assert_array_equal(n_(ot).view(np.uint16), o.view(np.uint16))
        np.testing.assert_array_equal(n_(lt), lse)


@needs_torch
def test_torch_packed_qkv_views():
    qkv = torch.randn(40, 2, 3, 2, 64, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert mxmla.qkv_layout(q, k, v) == "sb3hd"
    o = mxmla.attention(q, k, v, layout="sb3hd", causal=True)
    torch.testing.assert_close(o, mxmla.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True),
                               rtol=0, atol=0)


# ----------------------------------------------------------------------------- errors
def test_errors_arguments():
    q, k, v = randn((8, 1, 2, 64)), randn((8, 1, 2, 64)), randn((8, 1, 2, 32))
    att = mxmla.attention
    with pytest.raises(ValueError, match=r"mxmla.attention: argument 'q': dtype float32 is not supported \(bfloat16"):
        att(f64(q).astype(np.float32), k, v)
    with pytest.raises(ValueError, match=r"argument 'v': dtype float16 is not supported"):
        att(q, k, f64(v).astype(np.float16))
    with pytest.raises(ValueError, match=r"argument 'k': head dim 32 differs from q's 64"):
        att(q, randn((8, 1, 2, 32)), v)
    with pytest.raises(ValueError, match=r"argument 'k': q's 2 heads are not a multiple of k's 3"):
        att(q, randn((8, 1, 3, 64)), randn((8, 1, 3, 32)))
    with pytest.raises(ValueError, match=r"argument 'v': shape \[9, 1, 2, 32\] does not match k's \[8, 1, 2, 64\]"):
        att(q, k, randn((9, 1, 2, 32)))
    with pytest.raises(ValueError, match=r"argument 'q': head dim d_qk = 48 must be a positive multiple of 32"):
        att(randn((8, 1, 2, 48)), randn((8, 1, 2, 48)), v)
    with pytest.raises(ValueError, match=r"argument 'p_format': must be 'bfloat16' or 'e4m3', got 'e5m2'"):
        att(q, k, v, p_format="e5m2")
    assert att(q, k, v, p_format="bf16").shape == (8, 1, 2, 32)  # the bound enum's spelling
    assert att(q, k, v, p_format=mxmla.PFormat.e4m3).shape == (8, 1, 2, 32)
    with pytest.raises(ValueError, match=r"argument 'layout': 'sb3hd' does not describe these tensors: .*"
                                         r"'sbhd_sbhd_sbhd'"):
        att(q, k, v, layout="sb3hd")
    with pytest.raises(ValueError, match=r"argument 'layout': must be None, a format"):
        att(q, k, v, layout="hsbd")
    with pytest.raises(ValueError, match=r"argument 'q': format 'thd' needs a 3-D tensor"):
        att(q, k, v, layout="thd")
    with pytest.raises(ValueError, match=r"argument 'bottom_right': aligns the causal mask; it needs causal=True"):
        att(q, k, v, bottom_right=True)
    with pytest.raises(ValueError, match=r"argument 'causal': must be True or False"):
        att(q, k, v, causal=1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"argument 'softmax_scale': must be a finite number > 0"):
            att(q, k, v, softmax_scale=bad)
    with pytest.raises(ValueError, match=r"argument 'softmax_scale': must be a number"):
        att(q, k, v, softmax_scale="0.1")
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_q': is only for the thd format"):
        att(q, k, v, cu_seqlens_q=[0, 8])
    with pytest.raises(TypeError, match=r"argument 'k': expected a torch.Tensor or numpy.ndarray, got str"):
        att(q, "k", v)


def test_errors_thd():
    q, k, v = randn((8, 2, 64)), randn((8, 2, 64)), randn((8, 2, 32))
    att = mxmla.attention
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_q': is required for the thd format"):
        att(q, k, v)
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_kv': is required for the thd format"):
        att(q, k, v, cu_seqlens_q=[0, 8])
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_kv': has 3 entries but cu_seqlens_q has 2"):
        att(q, k, v, cu_seqlens_q=[0, 8], cu_seqlens_kv=[0, 4, 8])
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_q': must be non-decreasing"):
        att(q, k, v, cu_seqlens_q=[0, 5, 4], cu_seqlens_kv=[0, 4, 8])
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_q': last entry 9 exceeds the 8 tokens of q"):
        att(q, k, v, cu_seqlens_q=[0, 9], cu_seqlens_kv=[0, 8])
    with pytest.raises(ValueError, match=r"argument 'max_seqlen_q': 4 is smaller than the longest query sequence"):
        att(q, k, v, cu_seqlens_q=[0, 8], cu_seqlens_kv=[0, 8], max_seqlen_q=4)
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens_q': dtype float32 is not supported \(int32 or int64\)"):
        att(q, k, v, cu_seqlens_q=np.array([0, 8], np.float32), cu_seqlens_kv=[0, 8])
    with pytest.raises(ValueError, match=r"argument 'max_seqlen_kv': must be >= 0"):
        att(q, k, v, cu_seqlens_q=[0, 8], cu_seqlens_kv=[0, 8], max_seqlen_kv=-1)
    with pytest.raises(ValueError, match=r"argument 'layout': q in thd and k / v in bshd"):
        att(q, randn((1, 8, 2, 64)), randn((1, 8, 2, 32)), layout="thd_2bshd", cu_seqlens_q=[0, 8])


def test_errors_mxfp8():
    q, k, v = _qkv_f32("sbhd", sq=32, skv=32)
    q8, k8, v8 = (mxmla.quantize_attention(x) for x in (q, k, v))
    att = mxmla.attention
    no_row = mxmla.quantize_attention(q, rowwise=False)
    with pytest.raises(ValueError, match=r"mxmla.attention: argument 'q': has no rowwise data: attention reads Q and K "
                                         r"through the rowwise copy"):
        att(no_row, k8, v8)
    with pytest.raises(ValueError, match=r"argument 'v': has no columnwise data: attention reads V through the "
                                         r"columnwise copy \(blocks of 32 along the keys\)"):
        att(q8, k8, mxmla.quantize_attention(v, columnwise=False))
    with pytest.raises(ValueError, match=r"argument 'k': fp8_format 'e5m2' differs from q's 'e4m3'"):
        att(q8, mxmla.quantize_attention(k, fp8_format="e5m2"), v8)
    with pytest.raises(TypeError, match=r"argument 'v': q, k and v must all be MXFP8Tensors or all be bf16 tensors"):
        att(q8, k8, randn((32, 2, 2, 64)))
    with pytest.raises(TypeError, match=r"argument 'q': q, k and v must all be MXFP8Tensors"):
        att(randn((32, 2, 4, 64)), k8, v8)
    # an attention-quantized tensor read in another format (the C++ rule, through the binding)
    with pytest.raises(ValueError, match=r"argument 'q': is an attention-quantized MXFP8 tensor in layout sbhd"):
        att(q8, k8, v8, layout="bshd")
    # scales that do not belong to the codes
    bad = mx_map(q8, lambda b: b)
    bad.rowwise_scale_inv = bad.rowwise_scale_inv[:1]
    with pytest.raises(ValueError, match=r"argument 'q.rowwise_scale_inv': shape"):
        att(bad, k8, v8)


@needs_torch
def test_errors_torch():
    q = torch.randn(8, 1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"mxmla.attention: argument 'q': requires grad, but attention has no "
                                           r"gradient \(the op is forward only: mxmla.MXFP8Attention"):
        mxmla.attention(q.clone().requires_grad_(), q, q)
    with torch.no_grad():
        assert mxmla.attention(q.clone().requires_grad_(), q, q).shape == q.shape
    with pytest.raises(RuntimeError, match=r"argument 'v': requires grad"):  # the custom op checks as well
        torch.ops.mxmla.attention(q, q, q.clone().requires_grad_(), None, None, None, "", "", "", "sbhd", "sbhd",
                                  False, False, 0.125, "bfloat16", None, None, 0, 0, False)
    with pytest.raises(ValueError, match=r"argument 'q': dtype float32 is not supported"):
        mxmla.attention(q.float(), q, q)
    with pytest.raises(TypeError, match=r"argument 'cu_seqlens_q': must be a list of ints or an int32 / int64 "
                                        r"torch.Tensor like q, got numpy.ndarray"):
        mxmla.attention(q[:, 0], q[:, 0], q[:, 0], cu_seqlens_q=np.array([0, 8]), cu_seqlens_kv=[0, 8])


# ----------------------------------------------------------------------------- custom op, torch.compile
@needs_torch
def test_custom_op_is_registered_with_a_fake():
    op = torch.ops.mxmla.attention
    assert isinstance(op.default, torch._ops.OpOverload)
    q = torch.empty(40, 2, 4, 192, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(40, 2, 2, 192, device="meta", dtype=torch.bfloat16)
    v = torch.empty(40, 2, 2, 128, device="meta", dtype=torch.bfloat16)
    o, lse = op(q, kv, v, None, None, None, "", "", "", "sbhd", "sbhd", True, False, 0.1, "bfloat16", None, None, 0,
                0, True)
    assert o.shape == (40, 2, 4, 128) and o.dtype == torch.bfloat16 and lse.shape == (2, 4, 40)
    o, lse = op(q[:, 0], kv[:, 0], v[:, 0], None, None, None, "", "", "", "thd", "thd", True, False, 0.1, "e4m3",
                None, None, 0, 0, False)
    assert o.shape == (40, 4, 128) and lse.shape == (0,)


def _compiled_equals_eager(fn, *args):
    eager = fn(*args)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(eager, compiled):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16)
                           if b.dtype == torch.bfloat16 else b)
    return eager, compiled


@needs_torch
def test_compile_bf16_and_thd_fullgraph():
    q, k, v = torch.randn(30, 2, 4, 64, dtype=torch.bfloat16), torch.randn(30, 2, 2, 64, dtype=torch.bfloat16), \
        torch.randn(30, 2, 2, 32, dtype=torch.bfloat16)

    def f(q, k, v, cu):
        o, lse = mxmla.attention(q, k, v, causal=True, return_lse=True, p_format="e4m3")
        o2 = mxmla.attention(q[:, 0], k[:, 0], v[:, 0], cu_seqlens_q=cu, cu_seqlens_kv=cu, causal=True)
        return o, lse, o2

    _compiled_equals_eager(f, q, k, v, torch.tensor([0, 12, 30], dtype=torch.int32))


@needs_torch
def test_compile_mxfp8_fullgraph():
    x = [torch.randn(2, 40, 2, 64) for _ in range(3)]

    def f(q, k, v):
        q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
        return mxmla.attention(q8, k8, v8, causal=True, return_lse=True)

    _compiled_equals_eager(f, *x)


# ----------------------------------------------------------------------------- CUDA against the CPU reference
def _gpu_check(o, lse, o_ref, lse_ref):
    o, o_ref = o.float().cpu().double(), o_ref.float().double()
    err = (o - o_ref).norm() / o_ref.norm().clamp_min(1e-30)
    assert err <= 0.005, f"relative RMS error of O {err:.2e}"
    far = (o - o_ref).abs() > 0.02 + 0.02 * o_ref.abs()
    assert not far.any(), f"{int(far.sum())} O elements outside atol 0.02 + rtol 0.02"
    lse, lse_ref = lse.cpu().double(), lse_ref.double()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert not ((lse[fin] - lse_ref[fin]).abs() > 1e-4).any(), "LSE outside 1e-4"


def _mx_cpu(t):
    return mx_map(t, lambda b: b.cpu())


@needs_gpu
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (128, 128)])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("p_format", ["bfloat16", "e4m3"])
def test_cuda_mxfp8_matches_cpu_reference(d_qk, d_v, fmt, p_format):
    torch.manual_seed(0)
    b, sq, skv, h, hkv = 2, 160, 257, 4, 2  # GQA, s_q != s_kv, tails after blocks of 128 keys
    dev = "cuda"
    q = torch.randn(shape_in(fmt, b, sq, h, d_qk), device=dev, dtype=torch.bfloat16)
    k = torch.randn(shape_in(fmt, b, skv, hkv, d_qk), device=dev, dtype=torch.bfloat16)
    v = torch.randn(shape_in(fmt, b, skv, hkv, d_v), device=dev, dtype=torch.bfloat16)
    compact = [mxmla.quantize_attention(x, fmt, bhsd_scales=False) for x in (q, k, v)]
    bhsd = [mxmla.quantize_attention(x, fmt) for x in (q, k, v)]
    for causal, br in ((False, False), (True, False), (True, True)):
        # the CPU reference once (compact and BHSD scales give it bit for bit the same, see the numpy tests)
        o_ref, lse_ref = mxmla.attention(*(_mx_cpu(t) for t in compact), causal=causal, bottom_right=br,
                                         p_format=p_format, return_lse=True)
        for ops in (compact, bhsd):
            o, lse = mxmla.attention(*ops, causal=causal, bottom_right=br, p_format=p_format, return_lse=True)
            torch.cuda.synchronize()
            assert o.device.type == "cuda" and o.shape == shape_in(fmt, b, sq, h, d_v)
            _gpu_check(o, lse, o_ref, lse_ref)


@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_bf16_packed_and_thd_match_cpu_reference(causal):
    torch.manual_seed(1)
    qkv = torch.randn(300, 2, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    o, lse = mxmla.attention(q, k, v, layout="sb3hd", causal=causal, return_lse=True)
    o_ref, lse_ref = mxmla.attention(q.cpu(), k.cpu(), v.cpu(), causal=causal, return_lse=True)
    _gpu_check(o, lse, o_ref, lse_ref)
    # thd with an empty and a length-1 sequence, multi-query, d_qk 192 / d_v 128, padding tokens at the end
    cu = [0, 100, 100, 101, 290]
    cu_kv = [0, 80, 90, 91, 350]
    qt = torch.randn(300, 4, 192, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(360, 1, 192, device="cuda", dtype=torch.bfloat16)
    vt = torch.randn(360, 1, 128, device="cuda", dtype=torch.bfloat16)
    # NaN / Inf in keys that sequence 0's and the last sequence's last key tiles reach without seeing
    # them (sequence 1's tokens, which no query reads, and the padding): they must not reach O
    for t in (kt, vt):
        t[80:90, :, ::2] = float("nan")
        t[80:90, :, 1::2] = float("inf")
        t[350:] = float("nan")
    for mq, mkv in ((None, None), (189, 259)):
        o, lse = mxmla.attention(qt, kt, vt, cu_seqlens_q=torch.tensor(cu, device="cuda", dtype=torch.int32),
                                 cu_seqlens_kv=cu_kv, max_seqlen_q=mq, max_seqlen_kv=mkv, causal=causal,
                                 bottom_right=causal, return_lse=True)
        o_ref, lse_ref = mxmla.attention(qt.cpu(), kt.cpu(), vt.cpu(), cu_seqlens_q=cu, cu_seqlens_kv=cu_kv,
                                         causal=causal, bottom_right=causal, return_lse=True)
        _gpu_check(o, lse, o_ref, lse_ref)


@needs_gpu
@pytest.mark.parametrize("p_format", ["bfloat16", "e4m3"])
@pytest.mark.parametrize("log2_peak", [5, 20, 33])
def test_cuda_large_scores_keep_each_rows_maximum_at_p_one(p_format, log2_peak):
    """Scores whose row maxima of S·scale·log2 e reach about 2^log2_peak. The kernel's folded exponent
    fma(S, c, −max) leaves the maximum's exponent at max·c's rounding error: at 2^33 that is ±128 or
    more (every P 0 or Inf: O 0 or NaN, LSE ∓Inf), at 2^20 it moves the maximum's P off 1, which E4M3 P
    rounds to another code (O off by about 3 % in the fuzzer's failing cases). Past a limit the kernel
    rounds S·c first: the maximum's P is exactly 1 at every magnitude, as in the reference."""
    torch.manual_seed(7)
    b, sq, skv, h, d = 1, 130, 200, 2, 128
    scale = 1.0 / math.sqrt(d)
    # S ~ a²·√d·N(0, 1): choose a so that S·scale·log2 e is about 2^log2_peak at the row maxima (~3σ)
    a = math.sqrt(2.0 ** log2_peak / (3 * math.sqrt(d) * scale * 1.4426950408889634))
    q = (torch.randn(b, sq, h, d) * a).to(torch.bfloat16)
    k = (torch.randn(b, skv, h, d) * a).to(torch.bfloat16)
    v = torch.randn(b, skv, h, d).to(torch.bfloat16)
    o_ref, lse_ref = mxmla.attention(q, k, v, layout="bshd_bshd_bshd", softmax_scale=scale, p_format=p_format,
                                     return_lse=True)
    assert torch.isfinite(lse_ref).all() and lse_ref.abs().max() > 0.25 * 2.0 ** log2_peak
    for inputs in ((q, k, v), [mxmla.quantize_attention(x, "bshd") for x in (q, k, v)]):
        ops = [x.cuda() if isinstance(x, torch.Tensor) else mx_map(x, lambda t: t.cuda()) for x in inputs]
        if not isinstance(inputs[0], torch.Tensor):  # the MXFP8 operands' own reference
            o_ref, lse_ref = mxmla.attention(*inputs, layout="bshd_bshd_bshd", softmax_scale=scale,
                                             p_format=p_format, return_lse=True)
        o, lse = mxmla.attention(*ops, layout="bshd_bshd_bshd", softmax_scale=scale, p_format=p_format,
                                 return_lse=True)
        torch.cuda.synchronize()
        assert torch.isfinite(o.float()).all(), "O has NaN / Inf"
        assert torch.isfinite(lse).all(), "LSE has ±Inf"
        # S in fp32 against float64: the LSE's error grows with its magnitude (one fp32 rounding of
        # each product and sum, about 2^-20 of it); O within the usual bounds
        lse, ref = lse.cpu().double(), lse_ref.double()
        assert ((lse - ref).abs() <= 1e-4 + 2.0 ** -20 * ref.abs()).all(), (lse - ref).abs().max()
        o, o_r = o.float().cpu().double(), o_ref.float().double()
        assert (o - o_r).norm() / o_r.norm() <= 0.005
        assert not ((o - o_r).abs() > 0.02 + 0.02 * o_r.abs()).any()


@needs_gpu
@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_cuda_extent_one_dims_take_any_stride(fmt):
    """A one-token, one-head K and V (and, in bshd, one sequence) whose extent-1 dims carry stride 0 or
    strides that are not multiples of 16 bytes, as PyTorch views may: such a stride is never stepped
    over, so the CUDA path takes the view (the check ignores it, and the TMA map gets the packed
    value). The GPU fuzzer found the failure (attention seed 491: K [1, 1, 192] with strides
    [0, 192, 1] made cuTensorMapEncodeTiled fail)."""
    torch.manual_seed(11)
    store = torch.randn(3, 32768, dtype=torch.bfloat16)
    if fmt == "thd":  # (shape, strides, storage offset) of q, k, v over store[0], store[1], store[2]
        views = (((23, 5, 192), (960, 192, 1), 0), ((1, 1, 192), (0, 192, 1), 0), ((1, 1, 128), (3, 5, 1), 8))
        kw = dict(cu_seqlens_q=[0, 23], cu_seqlens_kv=[0, 1])
    else:
        views = (((1, 10, 3, 192), (7, 576, 192, 1), 0), ((1, 1, 1, 192), (5, 0, 3, 1), 0),
                 ((1, 1, 1, 128), (0, 1, 9, 1), 16))
        kw = dict(layout="bshd")
    for causal in (False, True):
        for dev in ("cpu", "cuda"):
            st = store.to(dev)
            q, k, v = (st[i].clone().as_strided(*views[i]) for i in range(3))
            o, lse = mxmla.attention(q, k, v, causal=causal, bottom_right=causal, return_lse=True, **kw)
            if dev == "cpu":
                o_ref, lse_ref = o, lse
        _gpu_check(o, lse, o_ref, lse_ref)


@needs_gpu
def test_cuda_sequences_past_the_kernels_32_bit_tile_indices_are_refused():
    """The kernels round a sequence's length up to whole 128-row tiles in 32-bit numbers: s_q or s_kv
    past 2^31 - 256 is refused, naming the operand, before anything runs (K and V here are stride-0 views
    over one token, so 2^31 keys take no memory; without the check, such a length makes the kernel's
    tile count negative: by the code, the forward's producer then waits forever)."""
    s = 2**31 - 200
    q = torch.randn(1, 1, 1, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, 1, 192, device="cuda", dtype=torch.bfloat16).expand(1, s, 1, 192)
    v = torch.randn(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16).expand(1, s, 1, 128)
    with pytest.raises(ValueError, match=r"argument 'k': has sequences of 2147483448 tokens: the CUDA kernels take "
                                         r"at most 2\^31 - 256"):
        mxmla.attention(q, k, v, layout="bshd")


@needs_gpu
@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp8"])
def test_cuda_batch_past_a_grid_dimension(mx):
    """bshd with b = 65 536 (one token, one head each): the forward's kernel is persistent (any b), and
    MXFP8 inputs take its fused path there (the staged path's conversion pass puts b on a grid
    dimension, at most 65 535); it matches the CPU reference. The backward's kernels put b on a grid
    dimension: it refuses such a batch, naming q, and says to pack the sequences as thd, which has no
    such limit."""
    b = 65536
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(b, 1, 1, 192, generator=g).to(torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(b, 1, 1, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    if mx:
        q, k, v = (mxmla.quantize_attention(x, "bshd") for x in (q, k, v))
    o_ref, lse_ref = mxmla.attention(q, k, v, layout="bshd", return_lse=True)
    qc, kc, vc = (mx_map(x, lambda t: t.cuda()) if mx else x.cuda() for x in (q, k, v))
    o, lse = mxmla.attention(qc, kc, vc, layout="bshd", return_lse=True)
    _gpu_check(o, lse, o_ref, lse_ref)
    with pytest.raises(ValueError, match=r"argument 'q': has a batch of 65536 sequences: .*pack them as thd"):
        mxmla.attention_backward(do.cuda(), qc, kc, vc, o, lse, layout="bshd")


def test_default_format_reads_mxfp8_codes_not_the_quantized_shape():
    """thd operands quantized token-major as [t, h*d] with codes viewed [t, h, d]: layout=None takes
    the format from the codes (3-D: thd), as layout="thd" does."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 2 * 64)).astype(np.float32)
    t = mxmla.quantize(x)
    op = mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, t.rowwise_data.reshape(64, 2, 64),
                           t.rowwise_scale_inv, t.columnwise_data.reshape(64, 2, 64), t.columnwise_scale_inv)
    cu = [0, 40, 64]
    got = mxmla.attention(op, op, op, cu_seqlens_q=cu, cu_seqlens_kv=cu, causal=True)
    want = mxmla.attention(op, op, op, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, causal=True)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    assert mxmla.qkv_layout(op, op, op).startswith("t")
