"""mxmla.nn.MLAQUpProj + attention_from_mxfp8_q: the query path with autograd (CPU references).
Forward: the fused op's MXFP8 Q; backward: dQ from the attention backward through the anchor, RoPE
backward, dgrad and wgrad -- each piece against its definition, and the whole path against float64
autograd of the unquantized math (within the MXFP8 quantization noise)."""
import math

import pytest

torch = pytest.importorskip("torch")
import mxmla  # noqa: E402
import mxmla.nn as mnn  # noqa: E402
from mxmla.nn.mla import rope_torch  # noqa: E402

F64 = torch.float64


def _setup(layout="sbhd", seed=0, weights="bf16"):
    g = torch.Generator().manual_seed(seed)
    s, b, K, H = 40, 2, 64, 2
    qp = mnn.MLAQUpProj(K, H, 32, 32, weights=weights, layout=layout, max_seq_len=64, seed=3, init_std=0.1)
    lead = (s, b) if layout == "sbhd" else (b, s)
    x = torch.randn(*lead, K, generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(*lead, H, 64, generator=g).to(torch.bfloat16).requires_grad_()
    v = torch.randn(*lead, H, 32, generator=g).to(torch.bfloat16).requires_grad_()
    return qp, x, k, v, g


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_forward_is_the_fused_op_and_backward_is_rope_backward_then_the_gemms(layout):
    qp, x, _, _, g = _setup(layout)
    q8, anchor = qp(x)
    w = qp.weight.detach().to(torch.bfloat16)
    want = mxmla.fused_q_uproj_rope_quant(x.detach().reshape(-1, 64), w, qp.rope_cos, qp.rope_sin, 32, 32,
                                          style="interleaved", layout=layout, batch=2, bhsd_scales=True)
    for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(q8, f), getattr(want, f)), f
    assert anchor.shape == q8.rowwise_data.shape and anchor.dtype == torch.bfloat16 and anchor.requires_grad
    dq = torch.randn(anchor.shape, generator=g).to(torch.bfloat16)
    dx, dw = torch.autograd.grad(anchor, (x, qp.weight), dq)
    gq = mxmla.rope_backward(dq, qp.rope_cos, qp.rope_sin, style="interleaved", layout=layout, rope_dim=32)
    gq = gq.reshape(-1, w.shape[0])
    assert torch.equal(dx.reshape(-1, 64), gq @ w)
    assert dw.dtype == torch.float32 and torch.equal(dw, gq.t().float() @ x.detach().reshape(-1, 64).float())


@pytest.mark.parametrize("weights", ["bf16", "mxfp8", "block-fp8"])
def test_the_query_path_with_attention_against_float64_autograd(weights):
    qp, x, k, v, g = _setup("sbhd", seed=1, weights=weights)
    q8, anchor = qp(x)
    o = mnn.attention_from_mxfp8_q(q8, anchor, k, v, causal=True)
    G = torch.randn(o.shape, generator=g, dtype=F64)
    (o.to(F64) * G).sum().backward()
    # float64: q = x·Wᵀ, RoPE ("interleaved"), causal attention on the unquantized values
    xd = x.detach().to(F64).requires_grad_()
    wd = qp.weight.detach().to(torch.bfloat16).to(F64).requires_grad_()
    kd, vd = (t.detach().to(F64).requires_grad_() for t in (k, v))
    q = (xd @ wd.t()).unflatten(-1, (2, 64))
    q = rope_torch(q, qp.rope_cos.to(F64), qp.rope_sin.to(F64), "sbhd", 32, None)
    S = torch.einsum("sbhd,tbhd->bhst", q, kd) * 64 ** -0.5
    S = S.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), -math.inf)
    O = torch.einsum("bhst,tbhd->sbhd", torch.softmax(S, -1), vd)
    (O * G).sum().backward()
    rel = lambda a, b: float((a.to(F64) - b).norm() / b.norm())  # noqa: E731
    assert rel(o.detach(), O.detach()) < 0.1
    for name, got, want in (("dx", x.grad, xd.grad), ("dW", qp.weight.grad, wd.grad), ("dk", k.grad, kd.grad),
                            ("dv", v.grad, vd.grad)):
        # measured 2.4-4.7 % (bf16 weights: MXFP8 Q, K, V), 3.2-6.5 % (mxfp8: x, W and dQ' quantized too)
        assert rel(got, want) < 0.15, (name, rel(got, want))


def test_what_is_not_there_says_so():
    with pytest.raises(ValueError, match="weights must be 'bf16', 'mxfp8' or 'block-fp8'"):
        mnn.MLAQUpProj(64, 2, 32, 32, weights="fp8")
    with pytest.raises(ValueError, match="layout must be 'sbhd', 'bshd' or 'thd', got 'bhsd'"):
        mnn.MLAQUpProj(64, 2, 32, 32, layout="bhsd")
    qp = mnn.MLAQUpProj(64, 2, 32, 32, max_seq_len=64)
    with pytest.raises(ValueError, match=r"x must be \[s, b, in_features\] with in_features=64"):
        qp(torch.zeros(4, 2, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("weights", ["bf16", "mxfp8", "block-fp8"])
def test_thd_packs_sequences_as_bshd_rows(weights):
    """layout "thd" (packed sequences; RoPE positions restart at 0 in each): with sequences of 32·n
    tokens no columnwise block straddles two sequences, so q's codes and values (both copies) and the
    gradients equal bshd's with one sequence a batch row; thd's scales are compact, [t, h·d]'s."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, 64, generator=g).to(torch.bfloat16)
    dq = torch.randn(2, 64, 2, 64, generator=g).to(torch.bfloat16)
    res = {}
    for lay in ("bshd", "thd"):
        qp = mnn.MLAQUpProj(64, 2, 32, 32, weights=weights, layout=lay, max_seq_len=64, seed=3, init_std=0.1)
        xi = (x if lay == "bshd" else x.reshape(128, 64)).clone().requires_grad_()
        q8, anchor = qp(xi, cu_seqlens=[0, 64, 128]) if lay == "thd" else qp(xi)
        anchor.backward(dq.reshape(anchor.shape))
        res[lay] = (q8, xi.grad.reshape(2, 64, 64), qp.weight.grad)
    b, t = res["bshd"], res["thd"]
    assert t[0].shape == (128, 128) and t[0].rowwise_data.shape == (128, 2, 64) and t[0].scale_layout == "compact"
    assert tuple(t[0].rowwise_scale_inv.shape) == (128, 4) and tuple(t[0].columnwise_scale_inv.shape) == (4, 128)
    for cw in (False, True):
        f = "columnwise_data" if cw else "rowwise_data"
        assert torch.equal(getattr(t[0], f).reshape(2, 64, 2, 64), getattr(b[0], f)), f
        q = t[0]  # (its codes viewed [t, h, d], as attention reads them; dequantize takes them as [t, h·d])
        flat = mxmla.MXFP8Tensor(q.shape, "e4m3", "compact", q.rowwise_data.reshape(128, 128), q.rowwise_scale_inv,
                                 q.columnwise_data.reshape(128, 128), q.columnwise_scale_inv)
        dt, db = (mxmla.dequantize(q, "float32", columnwise=cw) for q in (flat, b[0]))
        assert torch.equal(dt.reshape(2, 64, 2, 64), db.reshape(2, 64, 2, 64)), cw
    assert torch.equal(t[1], b[1]) and torch.equal(t[2], b[2])


@pytest.mark.parametrize("weights", ["bf16", "mxfp8", "block-fp8"])
def test_wgrad_goes_into_main_grad_when_the_weight_has_one(weights):
    qp, x, k, v, g = _setup("sbhd", seed=2, weights=weights)
    q8, anchor = qp(x)
    dq = torch.randn(anchor.shape, generator=g).to(torch.bfloat16)
    (dw,) = torch.autograd.grad(anchor, (qp.weight,), dq)
    qp.weight.main_grad = torch.ones_like(qp.weight)
    q8, anchor = qp(x)
    anchor.backward(dq)
    assert qp.weight.grad is None
    # bf16 weights add dW into the buffer; mxfp8 accumulates inside the GEMM (D + product, rounded once)
    torch.testing.assert_close(qp.weight.main_grad, dw + 1, rtol=2.0 ** -20, atol=1e-6)


# ----------------------------------------------------------------------------- weights="mxfp8"
def _deq64(t, columnwise):
    return mxmla.dequantize(t, "float32", columnwise=columnwise).to(F64)


def _bf16_exact(x):
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 256.0), (e - 8).to(F64))


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_mxfp8_weights_forward_is_the_fused_op_on_the_dequantized_copies(layout):
    """The MXFP8-weight fused op equals the bf16-weight fused op run on the dequantized rowwise copies of
    x and W bit for bit (every fp32 partial sum of these small products is exact in float64 too; both
    round the product once to bf16, then the same RoPE and quantization)."""
    qp, x, _, _, _ = _setup(layout, weights="mxfp8")
    q8, anchor = qp(x)
    xs = x.detach().reshape(-1, 64)
    x8, w8 = mxmla.quantize(xs), mxmla.quantize(qp.weight.detach().to(torch.bfloat16))
    xd, wd = (mxmla.dequantize(t, "bfloat16") for t in (x8, w8))
    want = mxmla.fused_q_uproj_rope_quant(xd, wd, qp.rope_cos, qp.rope_sin, 32, 32, style="interleaved", layout=layout,
                                          batch=2, bhsd_scales=True)
    for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(q8, f), getattr(want, f)), f
    direct = mxmla.fused_q_uproj_rope_quant(xs, w8, qp.rope_cos, qp.rope_sin, 32, 32, style="interleaved",
                                            layout=layout, batch=2, bhsd_scales=True)
    assert torch.equal(direct.rowwise_data, want.rowwise_data)
    q8b, saved = mxmla.FusedMLAQUpProjRopeQuant(32, 32, "interleaved", layout, bhsd_scales=True).run(
        xs, w8, qp.rope_cos, qp.rope_sin, 40, 2)
    assert torch.equal(q8b.columnwise_data, want.columnwise_data)
    assert saved.rowwise_data is None and torch.equal(saved.columnwise_data, x8.columnwise_data)  # x's columnwise copy


def test_mxfp8_weights_backward_is_rope_backward_quantize_then_the_mxfp8_gemms():
    """dQ -> RoPE backward + MXFP8 of dQ' (one pass) -> dgrad dQ'_row·W_col (bf16) and wgrad
    dQ'_colᵀ·X_col (fp32), each on the exactly dequantized copies (SPEC §6), T = 80 tokens."""
    qp, x, _, _, g = _setup("sbhd", seed=4, weights="mxfp8")
    q8, anchor = qp(x)
    dq = torch.randn(anchor.shape, generator=g).to(torch.bfloat16)
    dx, dw = torch.autograd.grad(anchor, (x, qp.weight), dq)
    dq8 = mxmla.rope_backward_quantize(dq, qp.rope_cos, qp.rope_sin, style="interleaved", layout="sbhd", rope_dim=32)
    x8 = mxmla.quantize(x.detach().reshape(-1, 64))
    w8 = mxmla.quantize(qp.weight.detach().to(torch.bfloat16))
    want_dx = _bf16_exact(_deq64(dq8, False) @ _deq64(w8, True))
    want_dw = (_deq64(dq8, True).T @ _deq64(x8, True)).to(torch.float32)
    assert dx.shape == x.shape and torch.equal(dx.reshape(-1, 64).to(F64), want_dx)
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw, want_dw, rtol=2.0 ** -22, atol=1e-30)


def test_mxfp8_weight_errors_name_the_argument():
    x = torch.randn(64, 64).to(torch.bfloat16)
    w8 = mxmla.quantize(torch.randn(2 * 64, 64).to(torch.bfloat16))
    cos, sin = mxmla.rope_tables(torch.arange(64), 32, style="interleaved")
    with pytest.raises(ValueError, match="argument 'weight_layout': an MXFP8 w is \\[N, K\\]"):
        mxmla.fused_q_uproj_rope_quant(x, w8, cos, sin, 32, 32, style="interleaved", weight_layout="kn")
    with pytest.raises(TypeError, match="argument 'x': with an MXFP8 w, x must be a torch tensor"):
        mxmla.fused_q_uproj_rope_quant(x.float().numpy(), w8, cos, sin, 32, 32, style="interleaved")
    with pytest.raises(ValueError, match="argument 'w': N = 128 rows is not a multiple of the head dim"):
        mxmla.fused_q_uproj_rope_quant(x, w8, cos, sin, 16, 32, style="interleaved")
    with pytest.raises(ValueError, match="argument 'batch': x's 64 tokens are not a multiple of batch = 3"):
        mxmla.fused_q_uproj_rope_quant(x, w8, cos, sin, 32, 32, style="interleaved", batch=3)
    with pytest.raises(ValueError, match="argument 'x.rowwise_data': is absent: mxmla.fused_q_uproj_rope_quant reads "
                                         "its rowwise copy"):
        mxmla.fused_q_uproj_rope_quant(mxmla.quantize(x, rowwise=False), w8, cos, sin, 32, 32, style="interleaved")
    w8e5 = mxmla.quantize(torch.randn(2 * 64, 64).to(torch.bfloat16), fp8_format="e5m2")
    with pytest.raises(ValueError, match="argument 'w': FP8 format e5m2 differs from x's e4m3"):
        mxmla.fused_q_uproj_rope_quant(mxmla.quantize(x), w8e5, cos, sin, 32, 32, style="interleaved")


# ----------------------------------------------------------------------------- weights="block-fp8"
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_block_fp8_weights_forward_is_the_fused_op_and_backward_the_gemms_on_the_quantized_operands(layout):
    """Forward: the fused op on x and W quantized block-wise (1 x 128, 128 x 128, power-of-two scales);
    backward: RoPE backward, dQ' quantized in 1 x 128 blocks along N (dgrad) and along T (wgrad),
    dgrad dQ'·W and wgrad dQ'ᵀ·x on the block-quantized operands (float64 math on their exact values:
    the CPU GEMM's, rounded once to bf16 / fp32)."""
    qp, x, _, _, g = _setup(layout, seed=6, weights="block-fp8")
    q8, anchor = qp(x)
    xs = x.detach().reshape(-1, 64)
    wb = mxmla.quantize_blockwise(qp.weight.detach(), block_rows=128)
    want = mxmla.fused_q_uproj_rope_quant(xs, wb, qp.rope_cos, qp.rope_sin, 32, 32, style="interleaved",
                                          layout=layout, batch=2, bhsd_scales=True)
    for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(q8, f), getattr(want, f)), f
    cached = qp.weight._mxmla_block_fp8  # W quantized once per version of the weight
    qp(x)
    assert qp.weight._mxmla_block_fp8 is cached
    with torch.no_grad():
        qp.weight.mul_(1.0)  # an optimizer's in-place update bumps the version: quantized again
    qp(x)
    assert qp.weight._mxmla_block_fp8 is not cached
    dq = torch.randn(anchor.shape, generator=g).to(torch.bfloat16)
    dx, dw = torch.autograd.grad(anchor, (x, qp.weight), dq)
    gq = mxmla.rope_backward(dq, qp.rope_cos, qp.rope_sin, style="interleaved", layout=layout, rope_dim=32)
    gq = gq.reshape(-1, qp.weight.shape[0])                               # dQ' [T, N] bf16
    d64 = lambda t: t.dequantize().to(F64)  # noqa: E731
    want_dx = d64(mxmla.quantize_blockwise(gq)) @ d64(wb)                  # [T, K]
    want_dw = d64(mxmla.quantize_blockwise(gq, transpose=True)) @ d64(mxmla.quantize_blockwise(xs, transpose=True)).T
    assert torch.equal(dx.reshape(-1, 64), want_dx.to(torch.bfloat16))
    assert dw.dtype == torch.float32 and torch.equal(dw, want_dw.to(torch.float32))
    qp.weight.main_grad = torch.ones(qp.weight.shape, dtype=torch.float32)  # Megatron's buffer: dW added into it
    q8, anchor = qp(x)
    dx2, = torch.autograd.grad(anchor, (x,), dq)
    assert torch.equal(dx2, dx) and qp.weight.grad is None
    assert torch.equal(qp.weight.main_grad, (want_dw + 1).to(torch.float32))

