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


def _setup(layout="sbhd", seed=0):
    g = torch.Generator().manual_seed(seed)
    s, b, K, H = 40, 2, 64, 2
    qp = mnn.MLAQUpProj(K, H, 32, 32, layout=layout, max_seq_len=64, seed=3, init_std=0.1)
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


def test_the_query_path_with_attention_against_float64_autograd():
    qp, x, k, v, g = _setup("sbhd", seed=1)
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
        assert rel(got, want) < 0.15, (name, rel(got, want))  # measured 2.4-4.7 %: MXFP8 Q, K, V


def test_what_is_not_there_says_so():
    with pytest.raises(NotImplementedError, match="MXFP8-weight path"):
        mnn.MLAQUpProj(64, 2, 32, 32, weights="mxfp8")
    with pytest.raises(ValueError, match="layout must be 'sbhd' or 'bshd'"):
        mnn.MLAQUpProj(64, 2, 32, 32, layout="thd")
    qp = mnn.MLAQUpProj(64, 2, 32, 32, max_seq_len=64)
    with pytest.raises(ValueError, match=r"x must be \[s, b, in_features\] with in_features=64"):
        qp(torch.zeros(4, 2, 32, dtype=torch.bfloat16))


def test_wgrad_goes_into_main_grad_when_the_weight_has_one():
    qp, x, k, v, g = _setup("sbhd", seed=2)
    q8, anchor = qp(x)
    dq = torch.randn(anchor.shape, generator=g).to(torch.bfloat16)
    (dw,) = torch.autograd.grad(anchor, (qp.weight,), dq)
    qp.weight.main_grad = torch.ones_like(qp.weight)
    q8, anchor = qp(x)
    anchor.backward(dq)
    assert qp.weight.grad is None and torch.equal(qp.weight.main_grad, dw + 1)
