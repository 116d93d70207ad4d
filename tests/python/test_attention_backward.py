"""The attention backward (SPEC §5): mxmla.attention_backward's CPU reference against an independent
float64 emulation of the defined semantics (each GEMM's copy, P and dS rounded to bf16), against
float64 autograd of the forward, MXFP8Attention / nn.DotProductAttention, and the argument checks;
on a GPU the CUDA kernels against the reference; and a seeded sweep of random configurations (both
the reference against the emulation and, on a GPU, CUDA against the reference)."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import mxmla  # noqa: E402
import mxmla.nn  # noqa: E402

F64 = torch.float64


def bf16(x):
    """float64 -> nearest-even bf16 value, rounded once (torch's float64 -> bfloat16 conversion goes
    through float32 and can round twice); normal range (the test data's)."""
    m, e = torch.frexp(x)  # x = m * 2^e, |m| in [0.5, 1)
    return torch.ldexp(torch.round(m * 256.0), (e - 8).to(F64))  # torch.round: half to even


def tokens_axis(fmt):
    return {"sbhd": 0, "bshd": 1, "bhsd": 2}[fmt]


def to_bshd(x, fmt):
    """[b, s, h, d] float64 view of a 4-D operand in fmt."""
    return {"sbhd": lambda t: t.permute(1, 0, 2, 3), "bshd": lambda t: t, "bhsd": lambda t: t.permute(0, 2, 1, 3)}[fmt](x)


def from_bshd(x, fmt):
    return {"sbhd": lambda t: t.permute(1, 0, 2, 3), "bshd": lambda t: t, "bhsd": lambda t: t.permute(0, 2, 1, 3)}[fmt](x)


def values(t, copy):
    """float64 values of an operand read through one copy ("row" / "col"; a missing copy: the other),
    or of a bf16 tensor."""
    if not isinstance(t, mxmla.MXFP8Tensor):
        return t.to(F64)
    col = copy == "col" and t.columnwise_data is not None or t.rowwise_data is None
    shape = (t.columnwise_data if col else t.rowwise_data).shape
    flat = mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout,  # codes in the quantized shape
                             *[None if x is None else (x.reshape(t.shape) if i % 2 == 0 else x)
                               for i, x in enumerate((t.rowwise_data, t.rowwise_scale_inv, t.columnwise_data,
                                                      t.columnwise_scale_inv))],
                             layout=t.layout, attention=t.attention)
    return mxmla.dequantize(flat, "float32", columnwise=col).to(F64).reshape(shape)


def emulate(do, q, k, v, o, lse, causal, bottom_right, scale):
    """The defined backward in float64 on [b, s, h, d] values (each argument: dict copy -> tensor;
    o, lse: tensors), P and dS rounded to bf16. Returns dq, dk, dv (float64, unrounded)."""
    qs, qg, ks, kg, vs, dos, dog = q["row"], q["col"], k["row"], k["col"], v["row"], do["row"], do["col"]
    b, sq, h, _ = qs.shape
    skv, hkv = ks.shape[1], ks.shape[2]
    g = h // hkv
    rep = lambda t: t.repeat_interleave(g, dim=2)  # noqa: E731
    S = torch.einsum("bihd,bjhd->bhij", qs, rep(ks)) * scale
    P = torch.exp(S - lse.to(F64)[..., None])
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(skv)[None, :]
        P = torch.where(j <= i + (skv - sq if bottom_right else 0), P, torch.zeros(()))
    dP = torch.einsum("bihd,bjhd->bhij", dos, rep(vs))
    D = (o.to(F64) * dos).sum(-1).permute(0, 2, 1)[..., None]  # [b, h, s, 1]
    dS = bf16(P * (dP - D) * scale)
    Pb = bf16(P)
    dv = torch.einsum("bhij,bihd->bjhd", Pb, dog).reshape(b, skv, hkv, g, -1).sum(3)
    dk = torch.einsum("bhij,bihd->bjhd", dS, qg).reshape(b, skv, hkv, g, -1).sum(3)
    dq = torch.einsum("bhij,bjhd->bihd", dS, rep(kg))
    return dq, dk, dv


def close_to(got, want, what):
    """bf16 rounding of a float64 sum: within one bf16 ulp (2^-8 relative) plus a sliver for sums whose
    bf16 P / dS rounding could flip at float64 precision."""
    got = got.to(F64)
    tol = 2.0 ** -8 * want.abs() + 1e-6 * (want.abs().max() + 1e-30)
    bad = (got - want).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off, max {float((got - want).abs().max())}"


def make(fmt, b, sq, skv, h, hkv, dqk, dv, prec, seed=0, dirs="both", do_mx=False):
    g = torch.Generator().manual_seed(seed)

    def rnd(s, d, hh):
        shape = {"sbhd": (s, b, hh, d), "bshd": (b, s, hh, d), "bhsd": (b, hh, s, d)}[fmt]
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    q, k, v = rnd(sq, dqk, h), rnd(skv, dqk, hkv), rnd(skv, dv, hkv)
    if prec == "mxfp8":
        def qz(x):
            return mxmla.quantize_attention(x, fmt) if fmt in ("sbhd", "bshd") else mxmla.quantize(x)
        q, k, v = qz(q), qz(k), qz(v)
    o, lse = mxmla.attention(q, k, v, layout=fmt, causal=CASE["causal"], bottom_right=CASE["br"], return_lse=True)
    if prec == "mxfp8" and dirs == "row":  # the backward's operands without their columnwise copies
        q, k, v = (mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, t.rowwise_data, t.rowwise_scale_inv,
                                     None, None, layout=t.layout, attention=t.attention) for t in (q, k, v))
    do = rnd(sq, dv, h)
    if do_mx:
        do = mxmla.quantize_attention(do, fmt) if fmt in ("sbhd", "bshd") else mxmla.quantize(do)
    return do, q, k, v, o, lse


CASE = {}

CASES = [
    # fmt, b, sq, skv, h, hkv, dqk, dv, prec, causal, bottom_right, dirs, do_mx
    ("bshd", 2, 37, 45, 4, 2, 64, 32, "mxfp8", True, True, "both", False),
    ("sbhd", 1, 31, 31, 3, 3, 96, 64, "mxfp8", True, False, "both", True),
    ("bshd", 1, 129, 33, 1, 1, 32, 32, "mxfp8", False, False, "row", False),
    ("bhsd", 2, 40, 40, 2, 1, 64, 32, "mxfp8", True, False, "both", False),
    ("sbhd", 2, 1, 7, 2, 2, 64, 32, "bf16", True, True, "both", False),
    ("bshd", 1, 70, 70, 4, 1, 192, 128, "bf16", True, False, "both", False),
]
# The CUDA backward's tensor-core kernel takes (d_qk, d_v) = (192, 128), (128, 128), (64, 64); the
# other head dims above run its CUDA-core fallback. Both against the reference (GPU only).
CUDA_CASES = CASES + [
    ("bshd", 2, 37, 45, 4, 2, 64, 64, "mxfp8", True, True, "both", False),
    ("sbhd", 1, 100, 130, 2, 1, 128, 128, "mxfp8", True, False, "both", True),
    ("bhsd", 1, 65, 129, 2, 2, 192, 128, "mxfp8", False, False, "row", False),
    ("bshd", 2, 200, 200, 2, 1, 192, 128, "mxfp8", True, False, "both", True),
    ("sbhd", 1, 150, 90, 3, 3, 192, 128, "mxfp8", True, True, "both", False),
    # the SM90 kernel's pipelines over many tiles (several key blocks of 96, query tiles of 64, stages
    # reused many times, GQA heads walked in turn)
    ("bshd", 1, 700, 700, 4, 2, 192, 128, "mxfp8", True, False, "both", False),
    ("bhsd", 2, 333, 250, 2, 1, 128, 128, "bf16", False, False, "both", False),
    ("sbhd", 1, 260, 400, 2, 2, 192, 128, "mxfp8", True, True, "row", False),
    ("bshd", 2, 0, 40, 2, 1, 192, 128, "mxfp8", False, False, "both", False),  # no queries: dK = dV = 0
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_reference_matches_the_defined_semantics_and_autograd(case):
    fmt, b, sq, skv, h, hkv, dqk, dv, prec, causal, br, dirs, do_mx = case
    CASE.update(causal=causal, br=br)
    do, q, k, v, o, lse = make(fmt, b, sq, skv, h, hkv, dqk, dv, prec, dirs=dirs, do_mx=do_mx)
    dq, dk, dvv = mxmla.attention_backward(do, q, k, v, o, lse, causal=causal, bottom_right=br, layout=fmt)
    assert dq.dtype == dk.dtype == dvv.dtype == torch.bfloat16
    assert dq.shape == (q.rowwise_data if prec == "mxfp8" else q).shape
    assert dvv.shape == (v.rowwise_data if prec == "mxfp8" else v).shape
    scale = float(np.float32(dqk ** -0.5))  # the op takes the softmax scale as fp32 (as the forward)
    vals = {n: {c: to_bshd(values(t, c), fmt) for c in ("row", "col")} for n, t in (("do", do), ("q", q), ("k", k), ("v", v))}
    lse_b = lse.reshape(b, h, sq)
    want = emulate(vals["do"], vals["q"], vals["k"], vals["v"], to_bshd(o.to(F64), fmt), lse_b, causal, br, scale)
    for name, got, w in (("dq", dq, want[0]), ("dk", dk, want[1]), ("dv", dvv, want[2])):
        close_to(to_bshd(got.to(F64), fmt), w, name)

    # float64 autograd of the forward on the rowwise values (the S copies), when the gradient GEMMs read
    # the same values (bf16, or rowwise-only MXFP8): relative RMS <= 1 %, atol 0.02 + rtol 0.05
    if prec == "bf16" or dirs == "row":
        qd, kd, vd = (vals[n]["row"].clone().requires_grad_() for n in "qkv")
        g = h // hkv
        S = torch.einsum("bihd,bjhd->bhij", qd, kd.repeat_interleave(g, 2)) * scale
        if causal:
            i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
            S = S.masked_fill(~(j <= i + (skv - sq if br else 0)), -math.inf)
        O = torch.einsum("bhij,bjhd->bihd", torch.softmax(S, -1).nan_to_num(0.0), vd.repeat_interleave(g, 2))
        (O * vals["do"]["row"]).sum().backward()
        for name, got, w in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dvv, vd.grad)):
            got = to_bshd(got.to(F64), fmt)
            assert (got - w).norm() <= 0.01 * w.norm() + 1e-12, name
            assert ((got - w).abs() <= 0.02 + 0.05 * w.abs()).all(), name


def test_thd_with_empty_and_one_token_sequences_matches_per_sequence_calls():
    g = torch.Generator().manual_seed(3)
    lens = [5, 0, 1, 40]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    t, h, d, dv = cu[-1] + 3, 2, 64, 32  # 3 tokens after the last sequence
    q, k = (torch.randn(t, h, d, generator=g).to(torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(t, h, dv, generator=g).to(torch.bfloat16) for _ in range(2))
    o, lse = mxmla.attention(q, k, v, layout="thd", causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu, return_lse=True)
    dq, dk, dvv = mxmla.attention_backward(do, q, k, v, o, lse, causal=True, layout="thd", cu_seqlens_q=cu,
                                           cu_seqlens_kv=cu)
    assert (dq[cu[-1]:] == 0).all() and (dk[cu[-1]:] == 0).all() and (dvv[cu[-1]:] == 0).all()
    for i, n in enumerate(lens):
        if n == 0:
            continue
        sl = slice(cu[i], cu[i + 1])
        one = lambda x: x[sl].unsqueeze(1)  # noqa: E731  [s, 1, h, d] (sbhd, b = 1)
        o1, l1 = mxmla.attention(one(q), one(k), one(v), layout="sbhd", causal=True, return_lse=True)
        assert torch.equal(o1[:, 0], o[sl]) and torch.equal(l1[0], lse[:, sl])
        r = mxmla.attention_backward(one(do), one(q), one(k), one(v), o1, l1, causal=True, layout="sbhd")
        for got, want in zip((dq, dk, dvv), r):
            assert torch.equal(got[sl], want[:, 0])


def test_numpy_inputs_and_deterministic_runs_are_identical():
    CASE.update(causal=True, br=False)
    do, q, k, v, o, lse = make("bshd", 1, 33, 33, 2, 2, 32, 32, "mxfp8", seed=5)
    a = mxmla.attention_backward(do, q, k, v, o, lse, causal=True, layout="bshd", deterministic=True)
    b = mxmla.attention_backward(do, q, k, v, o, lse, causal=True, layout="bshd", deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    npm = lambda t: mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, *[  # noqa: E731
        None if x is None else x.numpy() for x in (t.rowwise_data, t.rowwise_scale_inv, t.columnwise_data,
                                                  t.columnwise_scale_inv)], layout=t.layout, attention=t.attention)
    c = mxmla.attention_backward(do.view(torch.int16).numpy().view(np.uint16), npm(q), npm(k), npm(v),
                                 o.view(torch.int16).numpy().view(np.uint16), lse.numpy(), causal=True, layout="bshd")
    for x, y in zip(a, c):
        assert np.array_equal(x.view(torch.int16).numpy().view(np.uint16), y)


def test_torch_deterministic_algorithms_switch_the_fixed_order_on(monkeypatch):
    """torch.use_deterministic_algorithms(True) makes deterministic=False take the fixed order (torch
    tensors, as torch's own ops); deterministic=True always does."""
    from mxmla import _dispatch

    seen = []
    call = _dispatch.call

    def spy(name, *a):
        if name == "attention_backward":
            seen.append(a[-1])  # its last argument: deterministic
        return call(name, *a)

    monkeypatch.setattr(_dispatch, "call", spy)
    CASE.update(causal=True, br=False)
    do, q, k, v, o, lse = make("bshd", 1, 17, 17, 2, 2, 32, 32, "mxfp8", seed=3)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for on in (False, True):
            torch.use_deterministic_algorithms(on)
            for det in (False, True):
                dq, dk, dv = mxmla.attention_backward(do, q, k, v, o, lse, causal=True, layout="bshd",
                                                      deterministic=det)
                assert dq.shape == q.shape and dv.dtype == torch.bfloat16
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [False, True, True, True]


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_dot_product_attention_module_gradients(fmt):
    g = torch.Generator().manual_seed(11)
    b, s, h, d, dv = 2, 35, 2, 64, 32
    shape = {"sbhd": (s, b, h), "bshd": (b, s, h), "thd": (b * s, h)}[fmt]
    q, k = (torch.randn(*shape, d, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    v = torch.randn(*shape, dv, generator=g).to(torch.bfloat16).requires_grad_()
    dpa = mxmla.nn.DotProductAttention(causal=True, layout=fmt)
    kw = dict(cu_seqlens_q=[0, s, 2 * s]) if fmt == "thd" else {}
    o = dpa(q, k, v, **kw)
    do = torch.randn(o.shape, generator=g).to(torch.bfloat16)
    (o.to(F64) * do.to(F64)).sum().backward()
    # the same through the ops on the same MXFP8 tensors
    from mxmla.attention_autograd import quantize_for_attention
    mx = [quantize_for_attention(t, fmt) for t in (q, k, v)]
    cukw = dict(cu_seqlens_q=kw["cu_seqlens_q"], cu_seqlens_kv=kw["cu_seqlens_q"]) if kw else {}
    o2, lse = mxmla.attention(*mx, causal=True, layout=fmt, return_lse=True, **cukw)
    assert torch.equal(o.detach(), o2)
    want = mxmla.attention_backward(do, *mx, o2, lse, causal=True, layout=fmt, **cukw)
    for t, w in zip((q, k, v), want):
        assert t.grad.dtype == torch.bfloat16 and torch.equal(t.grad, w)
    # against float64 autograd of the forward on the rowwise (forward) values: the gradient GEMMs read
    # the columnwise copies, whose own quantization error (E4M3: up to 2^-4 per element) is most of the
    # gap; relative RMS <= 1 % (the bound of the backward's tests)
    g4 = (lambda t: t.unsqueeze(0)) if fmt == "thd" else (lambda t: to_bshd(t, fmt))
    qd, kd, vd = (g4(values(t, "row")).clone().requires_grad_() for t in mx)
    S = torch.einsum("bihd,bjhd->bhij", qd, kd) * float(np.float32(d ** -0.5))
    n = S.shape[-1] if fmt != "thd" else s
    i, j = torch.arange(S.shape[-2])[:, None], torch.arange(S.shape[-1])[None, :]
    mask = (j <= i) & ((i // n) == (j // n))  # causal inside each sequence (thd: two of length s)
    O = torch.einsum("bhij,bjhd->bihd", torch.softmax(S.masked_fill(~mask, -math.inf), -1), vd)
    (O * g4(do.to(F64))).sum().backward()
    for t, ref in ((q, qd), (k, kd), (v, vd)):
        rel = float((g4(t.grad.to(F64)) - ref.grad).norm() / ref.grad.norm())
        assert rel < 0.01, rel  # measured: 0.2-0.3 %


def test_autograd_saves_no_columnwise_copy_of_v():
    """The backward reads V rowwise (dP = dO·Vᵀ); its columnwise copy served the forward's P·V only:
    MXFP8Attention saves q's and k's two copies, v's rowwise one, O and LSE (the gradients equal the op's
    on the full tensors: test_dot_product_attention_module_gradients)."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 40, 2, 64, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    v = torch.randn(2, 40, 2, 32, generator=g).to(torch.bfloat16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        o = mxmla.nn.DotProductAttention(causal=True, layout="bshd")(q, k, v)
    from mxmla.attention_autograd import quantize_for_attention
    q8, k8, v8 = (quantize_for_attention(t, "bshd") for t in (q, k, v))
    want = [q8.rowwise_data, q8.rowwise_scale_inv, q8.columnwise_data, q8.columnwise_scale_inv, k8.rowwise_data,
            k8.rowwise_scale_inv, k8.columnwise_data, k8.columnwise_scale_inv, v8.rowwise_data, v8.rowwise_scale_inv]
    assert len(saved) == len(want) + 2  # + O, LSE
    for t, w in zip(saved, want):
        assert torch.equal(t, w)
    assert saved[-2].shape == o.shape and saved[-1].dtype == torch.float32
    # the query path's attention keeps the same set (q8's copies come from the fused op)
    from mxmla.nn.qproj import attention_from_mxfp8_q
    q8 = quantize_for_attention(q, "bshd")
    o2 = attention_from_mxfp8_q(q8, q.detach().clone().requires_grad_(), k, v, causal=True)
    assert o2.grad_fn.v8.columnwise_data is None and o2.grad_fn.v8.rowwise_data is not None
    assert o2.grad_fn.k8.columnwise_data is not None and o2.grad_fn.q8.columnwise_data is not None


def test_errors_name_the_argument():
    CASE.update(causal=False, br=False)
    do, q, k, v, o, lse = make("bshd", 1, 32, 32, 2, 2, 32, 32, "bf16")
    with pytest.raises(ValueError, match=r"argument 'lse': shape \[1, 2, 31\] must be \[1, 2, 32\]"):
        mxmla.attention_backward(do, q, k, v, o, lse[..., :31].contiguous(), layout="bshd")
    with pytest.raises(ValueError, match=r"argument 'dout': shape .* must be"):
        mxmla.attention_backward(do[:, :, :, :16].contiguous(), q, k, v, o, lse, layout="bshd")
    with pytest.raises(ValueError, match=r"argument 'o': shape"):
        mxmla.attention_backward(do, q, k, v, o[:, :16].contiguous(), lse, layout="bshd")
    with pytest.raises(ValueError, match=r"argument 'lse': dtype"):
        mxmla.attention_backward(do, q, k, v, o, lse.to(F64), layout="bshd")
    with pytest.raises(TypeError, match=r"argument 'q': q, k and v must all be MXFP8Tensors or all be bf16"):
        mxmla.attention_backward(do, q, k, mxmla.quantize(v.float()), o, lse, layout="bshd")
    with pytest.raises(ValueError, match=r"bottom_right"):
        mxmla.attention_backward(do, q, k, v, o, lse, layout="bshd", bottom_right=True)
    with pytest.raises(ValueError, match=r"DotProductAttention: layout must be"):
        mxmla.nn.DotProductAttention(layout="sb3hd")
    with pytest.raises(TypeError, match=r"MXFP8Attention: argument 'k': must be a torch.bfloat16 tensor"):
        mxmla.nn.DotProductAttention(layout="bshd")(q, k.float(), v)


# ----------------------------------------------------------------------------- random configurations
# A seeded sweep over the space the fixed cases sample (the backward's fuzzer): layouts, b, tails on
# both sides (s_q > s_kv included: with bottom-right alignment its first rows see no key), heads with
# GQA, head dims, bf16 / MXFP8 (both copies or rowwise only, dO bf16 or MXFP8), causal alignments.
RANDOM_DIMS = [(32, 32), (64, 32), (64, 64), (96, 64), (128, 128), (192, 128)]
RANDOM_LENS = [1, 2, 31, 32, 33, 63, 64, 65, 100, 129]


def random_case(seed):
    r = np.random.default_rng(1000 + seed)
    h = int(r.choice([1, 2, 3, 4, 6]))
    hkv = int(r.choice([d for d in (1, 2, 3, 4, 6) if h % d == 0]))
    dqk, dv = RANDOM_DIMS[int(r.integers(len(RANDOM_DIMS)))]
    prec = "mxfp8" if r.random() < 0.7 else "bf16"
    causal = bool(r.random() < 0.6)
    return (str(r.choice(["sbhd", "bshd", "bhsd"])), int(r.integers(1, 4)), int(r.choice(RANDOM_LENS)),
            int(r.choice(RANDOM_LENS)), h, hkv, dqk, dv, prec, causal, causal and bool(r.random() < 0.5),
            "row" if prec == "mxfp8" and r.random() < 0.3 else "both", prec == "mxfp8" and bool(r.random() < 0.3))


RANDOM_SEEDS = range(60)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_configs_reference_matches_the_emulation(seed):
    case = random_case(seed)
    fmt, b, sq, skv, h, hkv, dqk, dv, prec, causal, br, dirs, do_mx = case
    CASE.update(causal=causal, br=br)
    do, q, k, v, o, lse = make(fmt, b, sq, skv, h, hkv, dqk, dv, prec, seed=seed, dirs=dirs, do_mx=do_mx)
    got = mxmla.attention_backward(do, q, k, v, o, lse, causal=causal, bottom_right=br, layout=fmt)
    scale = float(np.float32(dqk ** -0.5))
    vals = {n: {c: to_bshd(values(t, c), fmt) for c in ("row", "col")} for n, t in (("do", do), ("q", q), ("k", k), ("v", v))}
    want = emulate(vals["do"], vals["q"], vals["k"], vals["v"], to_bshd(o.to(F64), fmt), lse.reshape(b, h, sq), causal,
                   br, scale)
    for name, g_, w in zip(("dq", "dk", "dv"), got, want):
        close_to(to_bshd(g_.to(F64), fmt), w, f"{name} {case}")


def _cuda(t):
    if isinstance(t, mxmla.MXFP8Tensor):
        return mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, *[
            None if x is None else x.cuda() for x in (t.rowwise_data, t.rowwise_scale_inv, t.columnwise_data,
                                                     t.columnwise_scale_inv)], layout=t.layout, attention=t.attention)
    return t.cuda()


def _near(got, ref, what, rms=3e-3):
    """A CUDA kernel (fp32) against the float64 reference: relative RMS <= 0.3 %, every element within
    0.02 + 0.05·|x| (the backward's bound against float64). A reference that is exactly zero (every
    row sees at most one key: P = 1, dP = D, dS = 0) has no relative error: then every element of the
    kernel's result must be within 1e-3 of zero (fp32 rounding of dP − D)."""
    got, ref = got.cpu().to(F64), ref.to(F64)
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    if got.numel() == 0:  # no rows (s_q = 0): nothing to compare
        return
    if ref.norm() == 0:
        assert got.abs().max() <= 1e-3, (what, "the reference is zero", float(got.abs().max()))
    else:
        assert (got - ref).norm() <= rms * ref.norm(), (what, float((got - ref).norm() / ref.norm()))
    assert ((got - ref).abs() <= 0.02 + 0.05 * ref.abs()).all(), what


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_cuda_matches_the_reference(case):
    fmt, b, sq, skv, h, hkv, dqk, dv, prec, causal, br, dirs, do_mx = case
    CASE.update(causal=causal, br=br)
    args = make(fmt, b, sq, skv, h, hkv, dqk, dv, prec, dirs=dirs, do_mx=do_mx)  # o, lse from the CPU forward
    kw = dict(causal=causal, bottom_right=br, layout=fmt)
    ref = mxmla.attention_backward(*args, **kw)
    # deterministic=False: the SM90 wgmma kernel where it applies (dQ by atomics), else the same
    # kernels as deterministic=True
    for det in (True, False):
        got = mxmla.attention_backward(*(_cuda(t) for t in args), **kw, deterministic=det)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            assert g.is_cuda and g.dtype == torch.bfloat16 and g.shape == r.shape
            _near(g, r, f"{name} deterministic={det}")
    got = mxmla.attention_backward(*(_cuda(t) for t in args), **kw, deterministic=True)
    again = mxmla.attention_backward(*(_cuda(t) for t in args), **kw, deterministic=True)
    for x, y in zip(got, again):
        assert torch.equal(x, y)  # no atomics: bitwise reproducible


DET_CASES = [
    # fmt, b, sq, skv, h, hkv, dqk, causal, bottom_right (bf16; the SM90 kernel's head dims)
    ("bshd", 1, 1000, 1000, 8, 2, 192, True, False),
    ("bshd", 1, 700, 1000, 4, 4, 192, True, True),
    ("bshd", 2, 300, 500, 4, 1, 128, False, False),
    ("thd", 1, 0, 0, 4, 2, 192, True, False),
    # top-left causal with s_kv > s_q: a key block starts past the last query row but within the last
    # (partial) query tile's 64 rows, so it has no tile and publishes no flag; the blocks below must
    # not wait for it (the GPU fuzzer's hang: s_q 65, s_kv 151)
    ("bshd", 1, 65, 151, 2, 2, 192, True, False),
    ("bshd", 2, 270, 400, 2, 1, 128, True, False),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("case", DET_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_cuda_deterministic_is_bitwise_reproducible_across_schedules(case, monkeypatch):
    """deterministic=True on the SM90 kernel adds every query tile's dQ parts in a fixed order: the
    same bits from runs whose CTAs are scheduled differently (one, two or four launches of KV-head
    groups, repeated), and within the backward's bound of the float64 reference."""
    fmt, b, sq, skv, h, hkv, dqk, causal, br = case
    g = torch.Generator().manual_seed(11)
    kw = dict(causal=causal, bottom_right=br)
    if fmt == "thd":
        cu = [0, 300, 301, 301, 900]
        kw.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        shape = lambda hh, d: (cu[-1], hh, d)  # noqa: E731
    else:
        kw.update(layout=fmt)
        shape = lambda hh, d, s_: (b, s_, hh, d)  # noqa: E731
    rnd = lambda *sh: torch.randn(sh, generator=g).to(torch.bfloat16)  # noqa: E731
    if fmt == "thd":
        q, k, v, do = rnd(*shape(h, dqk)), rnd(*shape(hkv, dqk)), rnd(*shape(hkv, 128)), rnd(*shape(h, 128))
    else:
        q, k, v, do = (rnd(*shape(h, dqk, sq)), rnd(*shape(hkv, dqk, skv)), rnd(*shape(hkv, 128, skv)),
                       rnd(*shape(h, 128, sq)))
    o, lse = mxmla.attention(q, k, v, return_lse=True, **kw)
    ref = mxmla.attention_backward(do, q, k, v, o, lse, **kw)
    args = [x.cuda() for x in (do, q, k, v, o, lse)]
    runs = []
    for groups in ("1", "1", "2", str(hkv), "1"):
        monkeypatch.setenv("MXMLA_ATTN_BWD_GROUPS", groups)
        runs.append(mxmla.attention_backward(*args, **kw, deterministic=True))
        torch.cuda.synchronize()
    for name, x, r in zip(("dq", "dk", "dv"), runs[0], ref):
        _near(x, r, f"{name} {case}")
    for i, run in enumerate(runs[1:], 1):
        for name, x, y in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(x, y), (name, case, "run", i)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_dispatch_order_changes_only_dq_rounding(causal, monkeypatch):
    """The SM90 kernel starts its CTAs in chunks of heads, key block by key block inside a chunk
    (MXMLA_ATTN_BWD_ORDER_G forces the chunk; 1 is the heads one after another). Each CTA computes its
    keys' dK, dV alone, so they are the same bits in every order (chunks that divide the heads and a
    chunk order that leaves a short last one; MXFP8 Q, K, V with both copies); dQ, added across CTAs
    in the order they run, stays within the backward's bound of the float64 reference."""
    g = torch.Generator().manual_seed(12)
    b, s, h, dqk = 1, 700, 12, 192  # 8 key blocks: by default chunks of 3 heads
    q, k = (torch.randn(b, s, h, dqk, generator=g).to(torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(b, s, h, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    q8, k8, v8 = (mxmla.quantize_attention(x, "bshd") for x in (q, k, v))
    kw = dict(causal=causal, layout="bshd")
    o, lse = mxmla.attention(q8, k8, v8, return_lse=True, **kw)
    ref = mxmla.attention_backward(do, q8, k8, v8, o, lse, **kw)
    args = [do.cuda(), _cuda(q8), _cuda(k8), _cuda(v8), o.cuda(), lse.cuda()]
    runs = {}
    for order in ("1", "5", "3", "12", ""):
        monkeypatch.setenv("MXMLA_ATTN_BWD_ORDER_G", order)
        runs[order] = mxmla.attention_backward(*args, **kw)
        torch.cuda.synchronize()
    for order, run in runs.items():
        for name, x, r in zip(("dq", "dk", "dv"), run, ref):
            _near(x, r, f"{name} order {order!r}")
        assert torch.equal(run[1], runs["1"][1]) and torch.equal(run[2], runs["1"][2]), order


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
def test_cuda_thd_and_deepseek_dims_and_the_module():
    g = torch.Generator().manual_seed(4)
    cu = [0, 5, 5, 6, 140]
    t, h, d, dv = cu[-1] + 2, 2, 192, 128
    q, k = (torch.randn(t, h, d, generator=g).to(torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(t, h, dv, generator=g).to(torch.bfloat16) for _ in range(2))
    kw = dict(causal=True, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    o, lse = mxmla.attention(q, k, v, return_lse=True, **kw)
    ref = mxmla.attention_backward(do, q, k, v, o, lse, **kw)
    got = mxmla.attention_backward(*(x.cuda() for x in (do, q, k, v, o, lse)), **kw)
    for name, x, r in zip(("dq", "dk", "dv"), got, ref):
        _near(x, r, name)
        assert (x[cu[-1]:] == 0).all()
    # MXFP8 with rowwise copies only (they serve every GEMM) on thd: the tensor-core path's bf16
    # copies of packed tokens (o, lse: the bf16 forward's; the backward is exact for any o, lse)
    q8, k8, v8 = (mxmla.quantize(x, columnwise=False) for x in (q, k, v))
    ref = mxmla.attention_backward(do, q8, k8, v8, o, lse, **kw)
    got = mxmla.attention_backward(do.cuda(), *(_cuda(x) for x in (q8, k8, v8)), o.cuda(), lse.cuda(), **kw)
    for name, x, r in zip(("dq", "dk", "dv"), got, ref):
        _near(x, r, f"mxfp8 {name}")
        assert (x[cu[-1]:] == 0).all()
    # DotProductAttention on the GPU: forward (the SM90 kernel) and backward (the CUDA-core kernel)
    qs, ks, vs = (x.view(1, t, h, -1)[:, :128].cuda().requires_grad_() for x in (q, k, v))
    dpa = mxmla.nn.DotProductAttention(causal=True, layout="bshd")
    dpa(qs, ks, vs).float().square().sum().backward()
    qc, kc, vc = (x.detach().cpu().requires_grad_() for x in (qs, ks, vs))
    dpa(qc, kc, vc).float().square().sum().backward()
    for name, a, c in (("dq", qs, qc), ("dk", ks, kc), ("dv", vs, vc)):
        _near(a.grad, c.grad, name, rms=1e-2)  # the forwards differ too (SM90 kernel vs float64 reference)


THD_CU = [0, 300, 301, 301, 900]  # 300, 1, 0 and 599 tokens, then three tokens in no sequence


def _thd_cuda_inputs(mx, seed):
    """q, k, v (bf16, or MXFP8 with both copies as MXFP8Attention quantizes them), do on the GPU in thd
    for THD_CU: 4 heads, 2 KV heads, DeepSeek-V3 head dims (the SM90 kernel)."""
    from mxmla.attention_autograd import quantize_for_attention
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = THD_CU[-1] + 3
    q, k = torch.randn(t, 4, 192, device="cuda", generator=g), torch.randn(t, 2, 192, device="cuda", generator=g)
    v, do = torch.randn(t, 2, 128, device="cuda", generator=g), torch.randn(t, 4, 128, device="cuda", generator=g)
    q, k, v, do = (x.to(torch.bfloat16) for x in (q, k, v, do))
    if mx:
        q, k, v = (quantize_for_attention(x, "thd") for x in (q, k, v))
    return q, k, v, do


MANY_SEQUENCES = 70000  # past a grid dimension's 65 535


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp8"])
def test_cuda_thd_with_more_sequences_than_a_grid_dimension(mx, monkeypatch):
    """thd with 70 000 sequences of 0-3 tokens (2 heads, 1 KV head, DeepSeek-V3 head dims, causal): the
    kernels that put the sequences on a grid dimension (at most 65 535: the MXFP8 forward's conversion
    pass, every backward kernel) run them in chunks. The forward, and the backward on each of its
    kernels (the SM90 one in both orders, the mma.sync and the CUDA-core ones), against the CPU reference
    on the same inputs. Before, every backward and the staged forward refused the call."""
    from mxmla.attention_autograd import quantize_for_attention
    g = torch.Generator().manual_seed(21)
    lens = torch.randint(0, 4, (MANY_SEQUENCES,), generator=g)
    cu = torch.zeros(MANY_SEQUENCES + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    t = int(cu[-1])
    q, k = torch.randn(t, 2, 192, generator=g).to(torch.bfloat16), torch.randn(t, 1, 192, generator=g).to(torch.bfloat16)
    v, do = torch.randn(t, 1, 128, generator=g).to(torch.bfloat16), torch.randn(t, 2, 128, generator=g).to(torch.bfloat16)
    if mx:
        q, k, v = (quantize_for_attention(x, "thd") for x in (q, k, v))
    kw = dict(causal=True, layout="thd")
    o_ref, lse_ref = mxmla.attention(q, k, v, return_lse=True, cu_seqlens_q=cu, cu_seqlens_kv=cu, **kw)
    ref = mxmla.attention_backward(do, q, k, v, o_ref, lse_ref, cu_seqlens_q=cu, cu_seqlens_kv=cu, **kw)
    cc = cu.cuda()
    kw.update(cu_seqlens_q=cc, cu_seqlens_kv=cc)
    qc, kc, vc, doc = (_cuda(x) for x in (q, k, v, do))
    o, lse = mxmla.attention(qc, kc, vc, return_lse=True, **kw)
    _near(o, o_ref, "o")
    assert (lse.cpu().double() - lse_ref.double()).abs().max() <= 1e-4, "lse"
    oc, lsec = o_ref.cuda(), lse_ref.cuda()  # the backward's O and LSE: the reference's, on both devices
    for kernel, det in ((None, False), (None, True), ("mma", True), ("simt", True)):
        if kernel is None:
            monkeypatch.delenv("MXMLA_ATTN_BWD", raising=False)
        else:
            monkeypatch.setenv("MXMLA_ATTN_BWD", kernel)
        got = mxmla.attention_backward(doc, qc, kc, vc, oc, lsec, deterministic=det, **kw)
        for name, x, y in zip(("dq", "dk", "dv"), got, ref):
            _near(x, y, f"{name} ({kernel or 'sm90'}, deterministic={det})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp8"])
def test_cuda_thd_with_max_seqlen_reads_cu_seqlens_on_the_device_only(mx):
    """thd with max_seqlen_q / max_seqlen_kv: the backward, as the forward, sizes its grids by the bounds
    and reads cu_seqlens on the device only. deterministic=True gives the same bits as the call that
    copies cu_seqlens to the host, with bounds above the longest sequences too; and a CUDA graph
    captures the forward and the backward (a stream synchronization inside a capture is an error) and
    replays them to the same bits."""
    q, k, v, do = _thd_cuda_inputs(mx, seed=5)
    cu = torch.tensor(THD_CU, device="cuda", dtype=torch.int32)
    kw = dict(causal=True, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    bound = dict(max_seqlen_q=599, max_seqlen_kv=599)
    o, lse = mxmla.attention(q, k, v, return_lse=True, **kw, **bound)
    ref = mxmla.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw)  # cu_seqlens read on the host
    for mq, mkv in ((599, 599), (700, 1000)):
        got = mxmla.attention_backward(do, q, k, v, o, lse, deterministic=True, max_seqlen_q=mq, max_seqlen_kv=mkv, **kw)
        for name, x, y in zip(("dq", "dk", "dv"), got, ref):
            assert torch.equal(x, y), (name, mq, mkv)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up outside the capture, as torch's CUDA graph docs ask
        mxmla.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw, **bound)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o2, lse2 = mxmla.attention(q, k, v, return_lse=True, **kw, **bound)
        grads = mxmla.attention_backward(do, q, k, v, o2, lse2, deterministic=True, **kw, **bound)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o2, o) and torch.equal(lse2, lse)
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert torch.equal(x, y), ("graph", name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp8"])
def test_cuda_thd_bounds_cut_longer_sequences_and_bad_cu_seqlens_stay_inside(mx):
    """Bounds are not checked against cu_seqlens on the GPU (that needs the host copy): the kernels
    read a copy clamped to the tensors and the bounds. A sequence longer than its bound is cut to it
    (the next one then starts where the cut one ends: undefined results there): causal rows below the
    bound see only keys below it, so the first and the last sequence's rows below it get the uncut
    call's dQ, bit for bit with deterministic=True, and the deterministic order's waits finish (they
    count the launched key blocks only). cu_seqlens that point outside the tensors (past the tokens,
    negative, decreasing) are clamped too: both passes finish inside the tensors (the GPU checks run
    this test under compute-sanitizer)."""
    q, k, v, do = _thd_cuda_inputs(mx, seed=6)
    cu = torch.tensor(THD_CU, device="cuda", dtype=torch.int32)
    kw = dict(causal=True, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    o, lse = mxmla.attention(q, k, v, return_lse=True, **kw)
    full = mxmla.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw)
    for det in (True, False):
        cut = mxmla.attention_backward(do, q, k, v, o, lse, deterministic=det, max_seqlen_q=256, max_seqlen_kv=256,
                                       **kw)
        torch.cuda.synchronize()
        for first, rows in ((0, 256), (301, 256)):  # clamped cu_seqlens [0, 256, 301, 301, 557]
            if det:
                assert torch.equal(cut[0][first:first + rows], full[0][first:first + rows]), (first, rows)
            else:
                _near(cut[0][first:first + rows], full[0][first:first + rows].cpu(), f"dq rows {first}+{rows}")
        assert (cut[0][557:] == 0).all() and (cut[1][557:] == 0).all()  # past the clamped last entry: no sequence
    bad = torch.tensor([0, 5000, 2, -7, 900], device="cuda", dtype=torch.int32)
    kb = dict(causal=True, layout="thd", cu_seqlens_q=bad, cu_seqlens_kv=bad, max_seqlen_q=599, max_seqlen_kv=599)
    o, lse = mxmla.attention(q, k, v, return_lse=True, **kb)
    for det in (True, False):
        mxmla.attention_backward(do, q, k, v, o, lse, deterministic=det, **kb)
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_configs_cuda_matches_the_reference(seed):
    case = random_case(seed)
    fmt, b, sq, skv, h, hkv, dqk, dv, prec, causal, br, dirs, do_mx = case
    CASE.update(causal=causal, br=br)
    args = make(fmt, b, sq, skv, h, hkv, dqk, dv, prec, seed=seed, dirs=dirs, do_mx=do_mx)
    kw = dict(causal=causal, bottom_right=br, layout=fmt)
    ref = mxmla.attention_backward(*args, **kw)
    for det in (False, True):
        got = mxmla.attention_backward(*(_cuda(t) for t in args), **kw, deterministic=det)
        for name, g_, r in zip(("dq", "dk", "dv"), got, ref):
            assert g_.is_cuda and g_.shape == r.shape
            _near(g_, r, f"{name} {case} deterministic={det}")
    again = mxmla.attention_backward(*(_cuda(t) for t in args), **kw, deterministic=True)
    for x, y in zip(got, again):
        assert torch.equal(x, y)


def test_torch_compile_traces_forward_and_backward():
    dpa = mxmla.nn.DotProductAttention(layout="bshd")

    def f(q, k, v):
        return dpa(q, k, v).float().square().sum()

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 33, 2, 64, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    torch.compile(f, fullgraph=True)(q, k, v).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    f(q, k, v).backward()
    for a, t in zip(got, (q, k, v)):
        assert torch.equal(a, t.grad)


def test_scratch_memory_without_a_gpu_and_bad_argument():
    if not torch.cuda.is_available():
        assert mxmla.scratch_memory() == {"in_use": 0, "peak": 0}
    with pytest.raises(TypeError, match="reset_peak"):
        mxmla.scratch_memory(reset_peak=1)


def test_release_scratch_without_a_gpu():
    if not torch.cuda.is_available():
        assert mxmla.release_scratch() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
def test_cuda_scratch_is_kept_across_synchronizations_until_released():
    """The scratch pool keeps its reserved memory through a device synchronization (without the
    raised release threshold the driver takes it back there), and release_scratch returns it."""
    t, h = 300, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(t, h, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q8, k8, v8 = (mxmla.quantize_attention(x, "bshd") for x in (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)))
    mxmla.release_scratch()
    o, lse = mxmla.attention(q8, k8, v8, causal=True, return_lse=True)  # staged copies: scratch
    torch.cuda.synchronize()
    assert mxmla.release_scratch() > 0  # the staged copies' memory, still reserved after the sync
    assert mxmla.release_scratch() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
def test_cuda_backward_scratch_follows_the_head_groups():
    """DeepSeek-V3 head dims, s 4096, 128 heads, MXFP8 Q, K (both copies) and V: the SM90 kernel
    converts K and V itself, the preprocess makes bf16 copies of Q's two FP8 copies (384 MiB), and
    with b = 1 each group of KV heads has its own fp32 dQ accumulator (384 MiB for all heads),
    rounded into dq after the group's kernel; together 768 MiB, so two groups of 64 KV heads, and the
    scratch peak is one group's copies (192 MiB) + one group's accumulator (192 MiB) + D (2 MiB)."""
    s, h = 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, s, h, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q8, k8, v8 = (mxmla.quantize_attention(t, "bshd") for t in (q, k, v))
    o, lse = mxmla.attention(q8, k8, v8, causal=True, return_lse=True)
    do = torch.randn_like(o)
    torch.cuda.synchronize()
    base = mxmla.scratch_memory(reset_peak=True)["in_use"]
    dq, dk, dv = mxmla.attention_backward(do, q8, k8, v8, o, lse, causal=True)
    torch.cuda.synchronize()
    peak = mxmla.scratch_memory()["peak"] - base
    MiB = 1 << 20
    want = 192 * MiB + 192 * MiB + 2 * MiB
    assert want - 8 * MiB <= peak <= want + 32 * MiB, peak / MiB
    assert bool(torch.isfinite(dq.float()).all()) and bool(torch.isfinite(dk.float()).all())


def _same_bits(x, y):
    return torch.equal(x.view(torch.int16), y.view(torch.int16))


KV_CONVERT_CASES = [
    # layout, b, s_q, s_kv, h, h_kv, d_qk, K / V copies, fp8 format, what it exercises
    ("bshd", 2, 200, 250, 4, 2, 192, "both", "e4m3"),  # BHSD scales, GQA, a tail key block (250 = 2·96 + 58)
    ("bhsd", 1, 129, 300, 2, 2, 128, "both", "e4m3"),  # compact scales (mxmla.quantize), d_qk 128
    ("bshd", 1, 150, 150, 2, 1, 192, "row", "e4m3"),   # rowwise-only K (the dQ GEMM's read too), columnwise-only V
    ("bshd", 1, 100, 200, 2, 2, 192, "special", "e4m3"),  # NaN codes and scales past the fast range: the exact path
    ("bshd", 1, 100, 200, 2, 2, 192, "special", "e5m2"),  # the same in E5M2 (Inf codes too)
    ("thd", 1, 0, 0, 4, 2, 192, "both", "e4m3"),       # packed sequences: key blocks and scale blocks not aligned
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("case", KV_CONVERT_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_cuda_kernel_converts_k_and_v_with_the_conversion_pass_bits(case, monkeypatch):
    """The SM90 kernel converts FP8 K and V itself (once per key block) instead of reading bf16 copies
    from the preprocess: the same dQ, dK, dV bits as with the preprocess's copies
    (MXMLA_ATTN_BWD_STAGE_KV=1), deterministic order, with less scratch; within the backward's bound
    of the float64 reference where the values are finite."""
    from mxmla.attention_autograd import quantize_for_attention
    fmt, b, sq, skv, h, hkv, dqk, kv_dirs, f8 = case
    g = torch.Generator(device="cuda").manual_seed(7)
    kw = dict(causal=True)
    if fmt == "thd":
        cu = THD_CU
        kw.update(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        shape = lambda hh, d, s_: (cu[-1] + 3, hh, d)  # noqa: E731
    else:
        kw.update(layout=fmt)
        shape = lambda hh, d, s_: {"bshd": (b, s_, hh, d), "bhsd": (b, hh, s_, d)}[fmt]  # noqa: E731
    rnd = lambda *sh: torch.randn(sh, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = rnd(*shape(h, dqk, sq)), rnd(*shape(hkv, dqk, skv)), rnd(*shape(hkv, 128, skv)), rnd(*shape(h, 128, sq))
    if kv_dirs == "special":  # E4M3: key 3's first block past the fast range (its scale byte above 134), keys
        # 64-95's second near bf16's smallest normals (subnormal values); NaN and Inf in V (NaN codes, E5M2 Inf)
        k[:, 3, :, :32] *= 2.0 ** 16
        k[:, 64:96, :, 32:48] *= 2.0 ** -125
        v[:, 10, 0, 5] = float("nan")
        v[:, 150, 1, 100] = float("inf")
    if fmt == "thd":
        q8, k8, v8 = (quantize_for_attention(x, "thd") for x in (q, k, v))
    elif fmt == "bhsd":
        q8, k8, v8 = (mxmla.quantize(x) for x in (q, k, v))
    else:
        q8, k8, v8 = (mxmla.quantize_attention(x, fmt, fp8_format=f8) for x in (q, k, v))
    o, lse = mxmla.attention(q8, k8, v8, return_lse=True, **kw)
    if kv_dirs == "row":  # K rowwise only; V columnwise only
        k8 = mxmla.MXFP8Tensor(k8.shape, k8.fp8_format, k8.scale_layout, k8.rowwise_data, k8.rowwise_scale_inv,
                               None, None, layout=k8.layout, attention=k8.attention)
        v8 = mxmla.MXFP8Tensor(v8.shape, v8.fp8_format, v8.scale_layout, None, None, v8.columnwise_data,
                               v8.columnwise_scale_inv, layout=v8.layout, attention=v8.attention)
    runs, peaks = [], []
    for stage_kv in ("1", None):
        if stage_kv is None:
            monkeypatch.delenv("MXMLA_ATTN_BWD_STAGE_KV", raising=False)
        else:
            monkeypatch.setenv("MXMLA_ATTN_BWD_STAGE_KV", stage_kv)
        torch.cuda.synchronize()
        base = mxmla.scratch_memory(reset_peak=True)["in_use"]
        runs.append(mxmla.attention_backward(do, q8, k8, v8, o, lse, deterministic=True, **kw))
        torch.cuda.synchronize()
        peaks.append(mxmla.scratch_memory()["peak"] - base)
    for name, x, y in zip(("dq", "dk", "dv"), *runs):
        assert _same_bits(x, y), (name, case)
    assert peaks[1] < peaks[0], ("K and V converted in the kernel need no copies", peaks)
    if kv_dirs != "special":
        cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else mxmla.MXFP8Tensor(  # noqa: E731
            t.shape, t.fp8_format, t.scale_layout, *[None if x is None else x.cpu() for x in (
                t.rowwise_data, t.rowwise_scale_inv, t.columnwise_data, t.columnwise_scale_inv)],
            layout=t.layout, attention=t.attention)
        ref = mxmla.attention_backward(*(cpu(t) for t in (do, q8, k8, v8, o, lse)), **kw)
        for name, x, r in zip(("dq", "dk", "dv"), runs[1], ref):
            _near(x, r, f"{name} {case}")
    else:  # V's NaN / Inf reach dQ and dK through dP and D, never dV (= Pᵀ·dO)
        assert bool(torch.isfinite(runs[1][2].float()).all()) and not bool(torch.isfinite(runs[1][0].float()).all())
