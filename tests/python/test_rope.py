"""RoPE (issue 3, CPU reference): against independent numpy float64 formulas, the DeepSeek
complex-multiply form, q.k invariance, the transpose and finite-difference checks of the
backward, YaRN tables against the published formula, thd / cu_seqlens, positions, errors."""
import math

import numpy as np
import pytest

import mxmla

STYLES = ["interleaved_in_halves_out", "interleaved", "rotate_half"]


def ref_rope(x, c, s, style):
    """SPEC §3, written out independently (float64)."""
    R = x.shape[-1]
    h = R // 2
    if style == "interleaved_in_halves_out":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return np.concatenate([x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]], axis=-1)
    if style == "interleaved":
        rot = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
        return x * c + rot * s
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * c + rot * s


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_forward_matches_spec_formula(style, layout):
    S, B, H, D, R = 9, 3, 2, 192, 64
    x = rand(S, B, H, D, seed=1) if layout == "sbhd" else rand(B, S, H, D, seed=1)
    c, s = rand(S, R, seed=2), rand(S, R, seed=3)  # arbitrary tables: the formula must hold for any
    y = mxmla.apply_rope(x, c, s, style=style, layout=layout)
    cb = c[:, None, None, :] if layout == "sbhd" else c[None, :, None, :]
    sb = s[:, None, None, :] if layout == "sbhd" else s[None, :, None, :]
    want = ref_rope(x[..., 128:].astype(np.float64), cb.astype(np.float64), sb.astype(np.float64), style)
    np.testing.assert_array_equal(y[..., :128], x[..., :128])
    # fp32 semantics (a rounded product, then an fma) against the float64 formula: within fp32 rounding
    np.testing.assert_allclose(y[..., 128:], want, rtol=1e-6, atol=1e-6)


def test_interleaved_is_deepseek_complex_multiply():
    T, H, R = 37, 4, 64
    pos = mxmla.positions_arange(T)
    c, s = mxmla.rope_tables(pos, R, style="interleaved", yarn="deepseek_v3")
    x = rand(T, H, R, seed=4)
    y = mxmla.apply_rope(x, c, s, style="interleaved", layout="thd", rope_dim=R)
    # DeepSeek-V3 model.py apply_rotary_emb: view as complex, multiply by polar(1, t * freqs)
    freqs = mxmla.rope_inv_freq(R, yarn="deepseek_v3")
    cis = np.exp(1j * np.outer(pos, freqs))[:, None, :]
    xc = x.astype(np.float64).reshape(T, H, R // 2, 2)
    want = (xc[..., 0] + 1j * xc[..., 1]) * cis
    want = np.stack([want.real, want.imag], axis=-1).reshape(T, H, R)
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-6)


def test_qk_scores_agree_between_interleaved_styles():
    T, H, R = 50, 3, 64
    pos = mxmla.positions_arange(T, offset=100)
    q, k = rand(T, H, 192, seed=5), rand(T, H, 192, seed=6)
    scores = {}
    for style in ("interleaved", "interleaved_in_halves_out"):
        c, s = mxmla.rope_tables(pos, R, style=style)
        qr = mxmla.apply_rope(q, c, s, style=style, layout="thd").astype(np.float64)
        kr = mxmla.apply_rope(k, c, s, style=style, layout="thd").astype(np.float64)
        scores[style] = np.einsum("thd,uhd->htu", qr, kr)
    np.testing.assert_allclose(scores["interleaved"], scores["interleaved_in_halves_out"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("style", STYLES)
def test_backward_is_the_transpose_and_matches_finite_differences(style):
    S, B, H, D = 7, 2, 3, 96
    R = 32
    x, g = rand(S, B, H, D, seed=7), rand(S, B, H, D, seed=8)
    c, s = rand(S, R, seed=9), rand(S, R, seed=10)
    rx = mxmla.apply_rope(x, c, s, style=style, rope_dim=R).astype(np.float64)
    rtg = mxmla.rope_backward(g, c, s, style=style, rope_dim=R).astype(np.float64)
    lhs, rhs = (rx * g).sum(), (x.astype(np.float64) * rtg).sum()
    assert abs(lhs - rhs) <= 1e-5 * abs(lhs) + 1e-4
    v = rand(S, B, H, D, seed=11)
    eps = 1e-2
    fd = (mxmla.apply_rope(x + eps * v, c, s, style=style, rope_dim=R).astype(np.float64)
          - mxmla.apply_rope(x - eps * v, c, s, style=style, rope_dim=R).astype(np.float64)) / (2 * eps)
    assert abs((fd * g).sum() - (v.astype(np.float64) * rtg).sum()) <= 1e-3 * np.abs(fd * g).sum()


def test_thd_with_uneven_sequences_equals_per_sequence():
    cu = np.array([0, 5, 5, 17, 20], np.int32)  # includes an empty sequence
    T, H, D = 20, 2, 192
    x = rand(T, H, D, seed=12)
    c, s = mxmla.rope_tables(mxmla.positions_arange(17), yarn="deepseek_v3")
    y = mxmla.apply_rope(x, c, s, layout="thd", cu_seqlens=cu)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            seq = mxmla.apply_rope(np.ascontiguousarray(x[a:b, None]), c, s, layout="sbhd")[:, 0]
            np.testing.assert_array_equal(y[a:b], seq)
    # the same through per-token tables built from the cu_seqlens positions
    pc, ps = mxmla.rope_tables(mxmla.positions_from_cu_seqlens(cu), yarn="deepseek_v3")
    np.testing.assert_array_equal(mxmla.apply_rope(x, pc, ps, layout="thd", tables_per_token=True), y)
    dx = mxmla.rope_backward(y, c, s, layout="thd", cu_seqlens=cu.astype(np.int64))
    np.testing.assert_allclose(dx, x, rtol=1e-5, atol=1e-5)  # rotations are orthogonal: R^T R x = x


def test_strided_in_place_and_bf16():
    S, B, H, D = 6, 2, 4, 192
    xb = rand(B, S, H, D, seed=13)
    view = xb.transpose(1, 0, 2, 3)  # sbhd view of bshd memory: non-contiguous
    c, s = mxmla.rope_tables(mxmla.positions_arange(S))
    want = mxmla.apply_rope(np.ascontiguousarray(view), c, s)
    got = mxmla.apply_rope(view, c, s)
    np.testing.assert_array_equal(got, want)
    buf = view.copy(order="K")  # same strides, own memory
    mxmla.apply_rope(buf, c, s, out=buf)
    np.testing.assert_array_equal(buf, want)
    bits = (np.ascontiguousarray(view).view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation
    yb = mxmla.apply_rope(bits, c, s)
    assert yb.dtype == np.uint16
    exact = (bits.astype(np.uint32) << 16).view(np.float32)
    ref = mxmla.apply_rope(exact, c, s)
    np.testing.assert_allclose((yb.astype(np.uint32) << 16).view(np.float32), ref, rtol=2 ** -8, atol=1e-30)


# ----------------------------------------------------------------------------- tables
def deepseek_freqs(dim=64, base=10000.0, factor=40.0, orig=4096, beta_fast=32, beta_slow=1):
    """DeepSeek-V3 inference/model.py precompute_freqs_cis, in float64."""
    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low if high != low else 0.001), 0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth, (low, high)


def test_yarn_tables_match_the_published_formula():
    freqs, (low, high) = deepseek_freqs()
    assert (low, high) == (10, 23)  # SPEC §3: ramp over dims 10..23
    np.testing.assert_allclose(mxmla.rope_inv_freq(64, yarn="deepseek_v3"), freqs, rtol=1e-15)
    pos = np.array([0, 1, 2, 4095, 4096, 16383, 163839], np.float64)
    for style in STYLES:
        c, s = mxmla.rope_tables(pos, 64, yarn="deepseek_v3", style=style)
        ang = np.outer(pos, freqs)
        full = np.repeat(ang, 2, axis=1) if style == "interleaved" else np.concatenate([ang, ang], axis=1)
        np.testing.assert_allclose(c, np.cos(full), atol=1e-7, rtol=0)
        np.testing.assert_allclose(s, np.sin(full), atol=1e-7, rtol=0)
    plain = mxmla.rope_inv_freq(64)
    np.testing.assert_allclose(plain, 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64), rtol=1e-15)


def test_softmax_scale_and_bf16_tables():
    assert abs(mxmla.yarn_softmax_scale(192, "deepseek_v3") - 0.135234) < 1e-6
    assert abs(mxmla.yarn_softmax_scale(192, None) - 192 ** -0.5) < 1e-15
    c32, _ = mxmla.rope_tables(mxmla.positions_arange(8))
    c16, _ = mxmla.rope_tables(mxmla.positions_arange(8), dtype="bfloat16")
    np.testing.assert_allclose((c16.astype(np.uint32) << 16).view(np.float32), c32, atol=2 ** -8)


def test_positions():
    np.testing.assert_array_equal(mxmla.positions_from_cu_seqlens([0, 3, 3, 5]), [0, 1, 2, 0, 1])
    L, cp = 8, 4
    allpos = np.concatenate([mxmla.positions_context_parallel(L, cp, r) for r in range(cp)])
    np.testing.assert_array_equal(np.sort(allpos), np.arange(L * cp))  # every global position once
    np.testing.assert_array_equal(mxmla.positions_context_parallel(L, cp, 1), [4, 5, 6, 7, 24, 25, 26, 27])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, c: mxmla.apply_rope(x, c, c, rope_dim=63), "rope_dim.*even"),
        (lambda x, c: mxmla.apply_rope(x[..., :32].copy(), c, c), "exceeds the head dimension"),
        (lambda x, c: mxmla.apply_rope(x, c[:, :32].copy(), c[:, :32].copy()), "must be \\[T, rope_dim = 64\\]"),
        (lambda x, c: mxmla.apply_rope(x, c[:2].copy(), c[:2].copy()), "positions are needed"),
        (lambda x, c: mxmla.apply_rope(x[:, 0], c, c, layout="thd", cu_seqlens=np.array([0, 2, 5], np.int64)),
         "out of range"),
        (lambda x, c: mxmla.apply_rope(x[:, 0], c, c, layout="thd", cu_seqlens=np.array([0, 3, 1, 4], np.int64)),
         "non-decreasing"),
        (lambda x, c: mxmla.apply_rope(x[:, 0], c, c, layout="thd", cu_seqlens=np.array([1, 4], np.int64)),
         "must start at 0"),
        (lambda x, c: mxmla.apply_rope(x, c, c, style="neox"), "argument 'style'"),
        (lambda x, c: mxmla.apply_rope(x, c, c, layout="thd"), "must be 3-D"),
    ],
)
def test_rope_errors(call, match):
    x = rand(4, 2, 3, 192, seed=14)
    c, _ = mxmla.rope_tables(mxmla.positions_arange(4))
    with pytest.raises(ValueError, match=match):
        call(x, c)


def test_rope_torch_cuda():
    """CUDA tensors: the kernels equal the CPU reference bit for bit (apply_rope, in-place
    rope_backward, thd with cu_seqlens given as a CUDA tensor, and the fused rope_backward_quantize)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not mxmla.info()["gpus"]:
        pytest.skip("no CUDA device visible: GPU test skipped")
    x = torch.randn(33, 2, 3, 192, dtype=torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(33), yarn="deepseek_v3")
    xt = x.reshape(66, 3, 192)
    cu = torch.tensor([0, 20, 20, 50, 66], dtype=torch.int32)  # the longest (30) fits the 33 table rows
    want = mxmla.apply_rope(xt, c, s, layout="thd", cu_seqlens=cu)
    got = mxmla.apply_rope(xt.cuda(), c.cuda(), s.cuda(), layout="thd", cu_seqlens=cu.cuda())
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    for style in STYLES:
        c, s = mxmla.rope_tables(torch.arange(33), yarn="deepseek_v3", style=style)  # tables know their style
        q_ref, dx_ref = mxmla.rope_backward_quantize(x, c, s, style=style, dx_copy="bfloat16")
        q, dx = mxmla.rope_backward_quantize(x.cuda(), c.cuda(), s.cuda(), style=style, dx_copy="bfloat16")
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            assert torch.equal(getattr(q, name).cpu(), getattr(q_ref, name)), (style, name)
        assert torch.equal(dx.cpu().view(torch.int16), dx_ref.view(torch.int16)), style
    for style in STYLES:
        c, s = mxmla.rope_tables(torch.arange(33), yarn="deepseek_v3", style=style)
        want = mxmla.apply_rope(x, c, s, style=style)
        got = mxmla.apply_rope(x.cuda(), c.cuda(), s.cuda(), style=style)
        assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), style
        xg = x.cuda().clone()
        mxmla.rope_backward(xg, c.cuda(), s.cuda(), style=style, out=xg)  # in place
        assert torch.equal(xg.cpu().view(torch.int16), mxmla.rope_backward(x, c, s, style=style).view(torch.int16))


def test_rope_thd_with_host_cu_seqlens_refuses_cuda_graph_capture():
    """cu_seqlens given on the host is copied to the device at each call: work on the host that a CUDA
    graph's replay could not redo with another call's values, so under capture the call is a clear
    error naming cu_seqlens (the same call outside the capture runs)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not mxmla.info()["gpus"]:
        pytest.skip("no CUDA device visible: GPU test skipped")
    x = torch.randn(66, 3, 192, dtype=torch.bfloat16, device="cuda")
    c, s = mxmla.rope_tables(torch.arange(33), yarn="deepseek_v3")
    c, s, cu = c.cuda(), s.cuda(), [0, 20, 20, 50, 66]
    from cuda_capture import refused_under_capture

    mxmla.apply_rope(x, c, s, layout="thd", cu_seqlens=cu)
    refused_under_capture(torch, lambda: mxmla.apply_rope(x, c, s, layout="thd", cu_seqlens=cu), ValueError,
                          r"mxmla.apply_rope: argument 'cu_seqlens': .*CUDA graph cannot capture")


# ----------------------------------------------------------------------------- rope_backward_quantize
def f32_round(v):
    """Fraction -> nearest-even float32 (exact; no double rounding)."""
    from fractions import Fraction

    if v == 0:
        return np.float32(0.0)
    a = abs(v)
    e = max(math.floor(math.log2(a)), -126)
    while Fraction(2) ** e > a:  # log2 of a Fraction can be off by one
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, -126)
    q = Fraction(2) ** (e - 23)
    r = round(a / q) * q  # Fraction.__round__: half to even
    return np.float32(float(r) if v > 0 else -float(r))


def emulate_dx_fp32(g, c, s, style, R):
    """dx[k] = fmaf(sign(j2) s[j2], g[j2], c[j1] g[j1]) on the rope part, in exact arithmetic."""
    from fractions import Fraction

    h = R // 2
    def term(j):
        if style == "interleaved_in_halves_out":
            return (2 * j, 2 * j + 1, -1) if j < h else (2 * (j - h) + 1, 2 * (j - h), 1)
        if style == "interleaved":
            return (j, j + 1, -1) if j % 2 == 0 else (j, j - 1, 1)
        return (j, j + h, -1) if j < h else (j, j - h, 1)
    out = g.astype(np.float32).copy()
    nope = g.shape[-1] - R
    for idx in np.ndindex(*g.shape[:-1]):
        row = idx[0]  # sbhd tables: row = s
        gr = g[idx][nope:]
        prod = {}
        for j in range(R):
            a, b, sg = term(j)
            prod[a] = f32_round(Fraction(float(c[row, j])) * Fraction(float(gr[j])))
        res = {}
        for j in range(R):
            a, b, sg = term(j)
            res[b] = f32_round(Fraction(sg * float(s[row, j])) * Fraction(float(gr[j])) + Fraction(float(prod[b])))
        out[idx][nope:] = [res[k] for k in range(R)]
    return out


def bf16_rne(x32):
    u = x32.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("style", STYLES)
def test_rope_backward_quantize_is_bit_exact_to_fp32_semantics(style):
    S, B, H, D, R = 6, 2, 2, 96, 32
    g = rand(S, B, H, D, seed=20) * np.float32(3.0)
    c, s = rand(S, R, seed=21), rand(S, R, seed=22)
    dx32 = emulate_dx_fp32(g, c, s, style, R)
    q, dxb = mxmla.rope_backward_quantize(g, c, s, style=style, rope_dim=R, dx_copy="bfloat16")
    _, dxf = mxmla.rope_backward_quantize(g, c, s, style=style, rope_dim=R, dx_copy="float32")
    np.testing.assert_array_equal(dxf, dx32)  # the fp32 values, bit for bit
    ref = mxmla.quantize(dx32.reshape(S * B, H * D))
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(q, name), getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(dxb, bf16_rne(dx32))
    # the fp32 semantics is RoPE backward to within fp32 rounding (and not the float64 path's rounding)
    d64 = mxmla.rope_backward(g, c, s, style=style, rope_dim=R)
    np.testing.assert_allclose(dx32, d64, rtol=1e-6, atol=1e-6)


def test_rope_backward_quantize_layouts_and_swizzle():
    T, H, D = 45, 3, 192
    cu = np.array([0, 20, 45], np.int64)
    g = rand(T, H, D, seed=23)
    c, s = mxmla.rope_tables(mxmla.positions_arange(25), yarn="deepseek_v3")
    q = mxmla.rope_backward_quantize(g, c, s, layout="thd", cu_seqlens=cu, rowwise=False)
    assert q.rowwise_data is None and q.columnwise_scale_inv.shape == (2, H * D)
    dx = mxmla.rope_backward(g, c, s, layout="thd", cu_seqlens=cu)
    back = q.dequantize("float32", columnwise=True).reshape(T, H, D)
    assert np.abs(back - dx).max() <= np.abs(dx).max() * 2 ** -3
    qs = mxmla.rope_backward_quantize(g, c, s, layout="thd", cu_seqlens=cu, swizzle=True)
    qc = mxmla.rope_backward_quantize(g, c, s, layout="thd", cu_seqlens=cu)
    np.testing.assert_array_equal(qs.rowwise_scale_inv, mxmla.swizzle_scales(qc.rowwise_scale_inv, T, H * D))
    np.testing.assert_array_equal(qs.columnwise_data, qc.columnwise_data)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxmla.rope_backward_quantize(rand(4, 1, 2, 80), c, s, rope_dim=64)


def test_partial_overlap_is_rejected():
    a = rand(5, 2, 3, 192, seed=30)
    c, s = mxmla.rope_tables(mxmla.positions_arange(4))
    with pytest.raises(ValueError, match="overlaps the input"):
        mxmla.apply_rope(a[:4], c, s, out=a[1:])


# ----------------------------------------------------------------------------- tables know their style
@pytest.mark.parametrize("style", STYLES)
def test_tables_refuse_another_style_and_plain_tables_are_taken(style):
    x = rand(6, 2, 3, 192, seed=40)
    c, s = mxmla.rope_tables(mxmla.positions_arange(6), style=style)
    assert mxmla.table_style(c) == style and mxmla.table_style(s[2:]) == style  # views keep it
    y = mxmla.apply_rope(x, c, s, style=style)
    for other in STYLES:
        if other != style:
            with pytest.raises(ValueError, match=f"mxmla.apply_rope: argument 'cos': was built by rope_tables for style "
                                                 f"'{style}', but style='{other}' was passed"):
                mxmla.apply_rope(x, c, s, style=other)
            # plain user tables (not from rope_tables) are the caller's business
            mxmla.apply_rope(x, np.asarray(c), np.asarray(s), style=other)
    np.testing.assert_array_equal(mxmla.apply_rope(x, np.array(c), np.array(s), style=style), y)


def test_torch_tables_carry_their_style():
    torch = pytest.importorskip("torch")
    c, s = mxmla.rope_tables(torch.arange(6), style="interleaved", dtype=torch.bfloat16)
    assert c.dtype == torch.bfloat16 and mxmla.table_style(c) == "interleaved"
    x = torch.randn(6, 1, 2, 192, dtype=torch.bfloat16)
    mxmla.apply_rope(x, c, s, style="interleaved")
    with pytest.raises(ValueError, match="argument 'cos': was built by rope_tables for style 'interleaved'"):
        mxmla.apply_rope(x, c, s)
    mxmla.apply_rope(x, c.clone(), s.clone())  # a new tensor is a plain table
