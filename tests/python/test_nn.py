"""mxmla.nn (MLA, RMSNorm, SwiGLU, Decoder) and examples/train_mla.py, on the CPU.

MLA: shapes in sbhd / bshd / thd, the layouts agree, thd packed equals each sequence run alone,
causality (within a sequence, and no attention across packed sequences), DeepSeek-V3's structure
(parameter names and shapes, the shared k_pe, the softmax scale with YaRN), gradients reach every
parameter, torch.autograd.gradcheck in float64 (the whole block, input and weights), the bf16 and
fp32 blocks against a float64 copy with the same weights (stated bounds), mxmla.apply_rope against
the plain-torch rotation the float64 path uses, torch.compile. RMSNorm and SwiGLU against their
formulas. Decoder: deterministic weights from a seed, the state_dict round trip, it learns. The
recipe "mxfp8": the MXFP8 Linear is the three defined GEMMs bit for bit, the MLA block tracks the bf16
block within the quantization noise, and the script trains it beside bf16. The training script runs end to
end on a small fixture text (CSV, PNG when matplotlib is importable), two recipes from the same
weights and data order give the same curve, and a missing corpus package says how to install it.
"""
import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest

import mxmla

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import mxmla.nn as mnn  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_mla.py"
TEXT = pathlib.Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"

# a small MLA with every DeepSeek-V3 piece: q_lora_rank > 0, kv_lora_rank, nope / rope / v dims
DIMS = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=16, nope_dim=16, rope_dim=8, v_dim=16)
TINY = dict(hidden=8, heads=2, q_lora_rank=6, kv_lora_rank=4, nope_dim=4, rope_dim=4, v_dim=3)  # gradcheck


def mla(dtype=torch.float32, seed=0, **kw):
    args = dict(DIMS, max_seq_len=64, init_std=0.1, dtype=dtype, seed=seed)
    args.update(kw)
    return mnn.MLA(**args)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def load_script():
    spec = importlib.util.spec_from_file_location("train_mla", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- MLA: layouts and shapes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_shapes_and_layouts_agree(dtype):
    m = mla(dtype)
    x = randn(2, 10, 64, dtype=dtype)
    y = m(x)                                                        # bshd [b, s, hidden]
    assert y.shape == (2, 10, 64) and y.dtype == dtype
    ys = m(x.transpose(0, 1).contiguous(), layout="sbhd")           # sbhd [s, b, hidden]
    assert ys.shape == (10, 2, 64)
    yt = m(x.reshape(20, 64), cu_seqlens=[0, 10, 20], layout="thd")  # thd [t, hidden], two sequences
    assert yt.shape == (20, 64)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ys.transpose(0, 1), y, **tol)
    torch.testing.assert_close(yt.reshape(2, 10, 64), y, **tol)
    # the module's default layout
    assert mla(dtype, layout="sbhd")(x.transpose(0, 1)).shape == (10, 2, 64)


def test_mla_thd_packed_equals_each_sequence_alone():
    m = mla()
    cu = [0, 5, 5, 12, 13, 21]  # an empty sequence and a one-token one among them
    x = randn(21, 64, seed=1)
    packed = m(x, cu_seqlens=torch.tensor(cu, dtype=torch.int32), layout="thd")
    for a, b in zip(cu, cu[1:]):
        if b > a:
            alone = m(x[a:b].unsqueeze(0))[0]  # bshd, b = 1: positions from 0, its own causal mask
            torch.testing.assert_close(packed[a:b], alone, atol=1e-6, rtol=1e-5)
    # the packed run also matches a thd run of one sequence at a time
    torch.testing.assert_close(m(x[12:21], layout="thd", cu_seqlens=[0, 1, 9])[1:], packed[13:21], atol=1e-6,
                               rtol=1e-5)
    # RoPE positions restart at 0 in every sequence (attention alone cannot tell: RoPE scores depend on
    # relative positions only), so look at the rotation itself
    q = randn(21, 4, 24, seed=2)
    rotated = m._rope(q, "thd", cu)
    for a, b in zip(cu, cu[1:]):
        torch.testing.assert_close(rotated[a:b], m._rope(q[a:b].unsqueeze(0), "bshd", None)[0], atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_mla_is_causal(layout):
    m = mla()
    x = randn(2, 12, 64, seed=2)
    j = 7
    x2 = x.clone()
    x2[:, j] += 1.0  # change token j of every sequence
    if layout == "sbhd":
        y, y2 = m(x.transpose(0, 1), layout="sbhd").transpose(0, 1), m(x2.transpose(0, 1), layout="sbhd").transpose(0, 1)
    else:
        y, y2 = m(x), m(x2)
    torch.testing.assert_close(y2[:, :j], y[:, :j], atol=1e-6, rtol=1e-6)   # earlier tokens: unchanged
    assert (y2[:, j:] - y[:, j:]).abs().amax(dim=-1).min() > 1e-4           # token j and later: changed


def test_mla_thd_sequences_do_not_see_each_other():
    m = mla()
    x = randn(16, 64, seed=3)
    cu = [0, 6, 16]
    y = m(x, cu_seqlens=cu, layout="thd")
    x2 = x.clone()
    x2[8] += 1.0  # a token of the second sequence
    y2 = m(x2, cu_seqlens=cu, layout="thd")
    torch.testing.assert_close(y2[:8], y[:8], atol=1e-6, rtol=1e-6)  # the first sequence, and its own past
    assert (y2[8:] - y[8:]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("recipe", ["bf16", "block-fp8"])
def test_mla_thd_attention_calls_sdpa_with_4d_inputs(recipe, monkeypatch):
    """Packed sequences under the torch-SDPA recipes: one SDPA call per non-empty sequence, on
    [1, h, s, d] inputs (torch's cuDNN and flash backends take 4-D inputs only; 3-D ones fall back to
    the math backend and its s x s scores: 4x the bf16 block's step time at DeepSeek-V3's dims)."""
    import torch.nn.functional as F

    shapes, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        shapes.append(tuple(q.shape))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    kw = dict(DIMS, max_seq_len=64, seed=0, recipe=recipe)
    mnn.MLA(**kw)(randn(16, 64, seed=3).to(torch.bfloat16), cu_seqlens=[0, 6, 6, 16], layout="thd")
    assert shapes == [(1, 4, 6, 24), (1, 4, 10, 24)]


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
def test_mla_mxfp8_linears_with_bf16_attention(layout, monkeypatch):
    """MLA(recipe="mxfp8", fp8_attention=False) (TransformerEngine's fp8_dpa off): every Linear on the
    MXFP8 GEMM, the attention in bf16 through torch's SDPA (no MXFP8 attention op, no fused Q op) on
    the same weights as the default mxfp8 block; every parameter gets a gradient, and the output
    differs from the bf16 block's (whose Linears do not quantize). How close it stays to the bf16
    block: test_mla_fp8_recipe_tracks_the_bf16_block."""
    import mxmla.nn.qproj as nq

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(tuple(q.shape))
        return real(q, k, v, **kw)

    def refuse(*a, **k):
        raise AssertionError("the MXFP8 attention ran")

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for name in ("attention_from_latent", "q_up"):
        monkeypatch.setattr(nq, name, refuse)
    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, layout=layout, seed=7)
    m = mnn.MLA(**kw, recipe="mxfp8", fp8_attention=False)
    assert "fp8_attention=False" in repr(m) and m.fp8_attention is False
    assert mnn.MLA(**kw, recipe="mxfp8").fp8_attention is True
    for (n, p), (n2, p2) in zip(m.state_dict().items(), mnn.MLA(**kw, recipe="mxfp8").state_dict().items()):
        assert n == n2 and torch.equal(p, p2)
    shape = {"bshd": (2, 20, 64), "sbhd": (20, 2, 64), "thd": (40, 64)}[layout]
    x = randn(*shape, seed=5).to(torch.bfloat16)
    cu = [0, 20, 40] if layout == "thd" else None
    xi = x.clone().requires_grad_()
    y = m(xi, cu_seqlens=cu)
    y.float().square().mean().backward()
    assert calls and all(len(c) == 4 for c in calls)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    assert not torch.equal(y, mnn.MLA(**kw)(x, cu_seqlens=cu))  # the bf16 block's Linears do not quantize


def test_mla_fp8_attention_checks_and_reaches_every_block():
    for recipe in ("bf16", "block-fp8"):
        with pytest.raises(ValueError, match=f"fp8_attention=True needs recipe 'mxfp8' \\(MXFP8 attention\\); "
                                             f"recipe '{recipe}' runs its attention in bf16"):
            mnn.MLA(64, 2, 32, 32, 32, 32, 32, recipe=recipe, fp8_attention=True)
        assert mnn.MLA(64, 2, 32, 32, 32, 32, 32, recipe=recipe, fp8_attention=False).fp8_attention is False
    with pytest.raises(TypeError, match="mxmla.nn.MLA: fp8_attention must be a bool, got int"):
        mnn.MLA(64, 2, 32, 32, 32, 32, 32, recipe="mxfp8", fp8_attention=1)
    # MXFP8 attention wants head dims in 32-blocks; a bf16 one does not (the Linears' dims still are)
    with pytest.raises(ValueError, match="recipe 'mxfp8' needs nope_dim \\+ rope_dim \\(56\\)"):
        mnn.MLA(64, 4, 32, 32, nope_dim=24, rope_dim=32, v_dim=32, recipe="mxfp8")
    m = mnn.MLA(64, 4, 32, 32, nope_dim=24, rope_dim=32, v_dim=32, recipe="mxfp8", fp8_attention=False,
                max_seq_len=16)
    assert m(randn(1, 8, 64, seed=2).to(torch.bfloat16)).shape == (1, 8, 64)
    d = mnn.Decoder(64, 2, 2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32, inter_dim=64,
                    max_seq_len=16, recipe="mxfp8", fp8_attention=False)
    assert all(b.attn.fp8_attention is False for b in d.layers) and d.config["fp8_attention"] is False
    assert "fp8_attention" not in mnn.Decoder(64, 2, 2, max_seq_len=16).config  # only when given
    with pytest.raises(ValueError, match="mxmla.nn.Decoder: fp8_attention=True needs recipe 'mxfp8'"):
        mnn.Decoder(64, 2, 2, max_seq_len=16, fp8_attention=True)


def test_mla_input_errors():
    m = mla()
    with pytest.raises(ValueError, match="hidden=64"):
        m(randn(2, 3, 32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(randn(6, 64), cu_seqlens=[0, 4, 5], layout="thd")  # does not end at the token count
    with pytest.raises(ValueError, match="cu_seqlens is for layout 'thd'"):
        m(randn(1, 6, 64), cu_seqlens=[0, 6])
    with pytest.raises(ValueError, match="max_seq_len"):
        m(randn(1, 65, 64))
    with pytest.raises(ValueError, match="layout"):
        m(randn(1, 6, 64), layout="bhsd")
    with pytest.raises(ValueError, match="rope_dim must be even"):
        mla(rope_dim=7)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        mla(deterministic=1)


# ----------------------------------------------------------------------------- MLA: DeepSeek-V3's structure
def test_mla_has_deepseek_v3_structure():
    m = mla()
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    h, H, qr, kr, dn, dr, dv = (DIMS[k] for k in ("hidden", "heads", "q_lora_rank", "kv_lora_rank", "nope_dim",
                                                  "rope_dim", "v_dim"))
    assert shapes == {"wq_a.weight": (qr, h), "q_norm.weight": (qr,), "wq_b.weight": (H * (dn + dr), qr),
                      "wkv_a.weight": (kr + dr, h), "kv_norm.weight": (kr,), "wkv_b.weight": (H * (dn + dv), kr),
                      "wo.weight": (h, H * dv)}
    assert set(m.state_dict()) == set(shapes)  # the RoPE tables are buffers outside the state dict
    # q_lora_rank = 0: one wq projection, as DeepSeek's model.py does then
    m0 = mla(q_lora_rank=0)
    assert {n for n, _ in m0.named_parameters()} == {"wq.weight", "wkv_a.weight", "kv_norm.weight", "wkv_b.weight",
                                                     "wo.weight"}
    assert m0(randn(1, 5, 64)).shape == (1, 5, 64)


def test_mla_softmax_scale_and_yarn():
    assert mla().softmax_scale == pytest.approx((16 + 8) ** -0.5)
    full = mnn.MLA(7168, 1, 1536, 512, yarn="deepseek_v3", max_seq_len=8, dtype=torch.float32)  # DeepSeek-V3's dims
    assert full.softmax_scale == pytest.approx(0.135234, abs=1e-6)  # 192^-0.5 · (0.1 ln 40 + 1)²
    y = mla(yarn="deepseek_v3")
    cos, _ = mxmla.rope_tables(torch.arange(64), 8, yarn="deepseek_v3", style="interleaved")
    assert torch.equal(y.rope_cos, cos)
    assert mla(softmax_scale=0.5).softmax_scale == 0.5


def reference_mla(m, x):
    """DeepSeek-V3's MLA written out in float64 with a complex-number RoPE (model.py's apply_rotary_emb)."""
    P = {n: p.detach().double() for n, p in m.named_parameters()}
    x = x.double()
    b, s, _ = x.shape
    H, dn, dr, dv, kr = m.heads, m.nope_dim, m.rope_dim, m.v_dim, m.kv_lora_rank

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rot(t):  # t [b, s, h, dr]: pairs as complex numbers times e^{i·pos·freq}
        freqs = 1.0 / (10000.0 ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr))
        cis = torch.polar(torch.ones(s, dr // 2, dtype=torch.float64), torch.outer(torch.arange(s).double(), freqs))
        c = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(c * cis.view(1, s, 1, -1)).flatten(3)

    q = (norm(x @ P["wq_a.weight"].T, P["q_norm.weight"]) @ P["wq_b.weight"].T).view(b, s, H, dn + dr)
    q = torch.cat([q[..., :dn], rot(q[..., dn:])], -1)
    kv = x @ P["wkv_a.weight"].T
    c, k_pe = kv[..., :kr], rot(kv[..., kr:].unsqueeze(2))
    kv = (norm(c, P["kv_norm.weight"]) @ P["wkv_b.weight"].T).view(b, s, H, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe.expand(b, s, H, dr)], -1)
    scores = torch.einsum("bshd,bthd->bsht", q, k) * m.softmax_scale
    scores = scores + torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)[None, :, None, :]
    o = torch.einsum("bsht,bthd->bshd", scores.softmax(-1), kv[..., dn:])
    return o.flatten(2) @ P["wo.weight"].T


def test_mla_matches_deepseek_v3_written_out():
    m = mla(torch.float64)
    x = randn(2, 9, 64, seed=4, dtype=torch.float64)
    # float64 throughout, except the module's RoPE tables: fp32 (cos / sin within 2^-24 absolute)
    torch.testing.assert_close(m(x), reference_mla(m, x), atol=1e-7, rtol=1e-6)
    m32 = mla(torch.float32)  # the same weights, mxmla.apply_rope on the rope parts
    assert rel(m32(x.float()), reference_mla(m, x)) < 1e-5


def test_apply_rope_matches_the_float64_rotation():
    """The float64 path's plain-torch rotation is mxmla.apply_rope's "interleaved" style."""
    from mxmla.nn.mla import rope_torch

    cos, sin = mxmla.rope_tables(torch.arange(32), 8, style="interleaved")
    for layout, shape, cu in (("bshd", (2, 11, 3, 20), None), ("sbhd", (11, 2, 3, 20), None),
                              ("thd", (17, 3, 20), [0, 6, 6, 17])):
        x = randn(*shape, seed=5)
        ours = mxmla.apply_rope(x, cos, sin, style="interleaved", layout=layout, rope_dim=8, cu_seqlens=cu)
        ref = rope_torch(x.double(), cos.double(), sin.double(), layout, 8, cu if cu else None)
        torch.testing.assert_close(ours.double(), ref, atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------- MLA: gradients
def test_mla_gradients_reach_every_parameter():
    for kw in ({}, {"q_lora_rank": 0}):
        m = mla(torch.bfloat16, **kw)
        x = randn(2, 8, 64, seed=6, dtype=torch.bfloat16).requires_grad_()
        m(x).float().square().sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
        for n, p in m.named_parameters():
            assert p.grad is not None, n
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mla_gradcheck_float64(layout):
    """torch.autograd.gradcheck of the whole block in float64 (tiny dims), in x and every weight."""
    m = mnn.MLA(**TINY, max_seq_len=8, dtype=torch.float64, init_std=0.3, seed=1)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in m.named_parameters()]
    if layout == "bshd":
        x = randn(2, 3, TINY["hidden"], seed=7, dtype=torch.float64).requires_grad_()
        call = lambda x: (x,)  # noqa: E731
    else:
        x = randn(5, TINY["hidden"], seed=7, dtype=torch.float64).requires_grad_()
        call = lambda x: (x, [0, 2, 5], "thd")  # noqa: E731

    def f(x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), call(x))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype,bound", [
    # bf16: every rounding is within 2^-9 relative; a path through the block meets at most ~16 of them
    # (projections, norms, RoPE, attention, casts), so the relative error is below 16 · 2^-9 = 1/32
    (torch.bfloat16, 16 * 2.0 ** -9),
    # fp32: the same count of 2^-24 roundings plus sums of at most 64 terms
    (torch.float32, 1e-5),
])
def test_mla_against_a_float64_copy(dtype, bound):
    """The bf16 (and fp32) block, mxmla.apply_rope on its rope parts, against a float64 copy with the
    same weights: output, dx and every weight's gradient within the stated relative (norm) bound."""
    runs = []
    for dt in (dtype, torch.float64):
        m = mla(dt, seed=3)
        x = randn(2, 24, 64, seed=8).to(torch.bfloat16).to(dt).requires_grad_()  # the same (bf16) values
        dy = randn(2, 24, 64, seed=9)
        y = m(x)
        (y.double() * dy.double()).sum().backward()
        runs.append((y, x.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y, dx, dw), (y64, dx64, dw64) = runs
    assert rel(y, y64) < bound
    assert rel(dx, dx64) < bound
    for n in dw64:
        assert rel(dw[n], dw64[n]) < bound, n


def test_mla_torch_compile():
    m = mla()
    x = randn(2, 6, 64, seed=10)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), m(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
def test_mla_fp8_recipes_under_torch_compile(recipe):
    """torch.compile (aot_eager) of the FP8 recipes' block: the same output and input gradient as eager
    (the custom ops trace through their fake implementations; the weights' once-per-version
    quantization check is a graph break, so fullgraph is not asked for)."""
    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, seed=7, recipe=recipe)
    m = mnn.MLA(**kw)
    x = randn(2, 40, 64, seed=3, dtype=torch.bfloat16)
    outs = []
    for f in (m, torch.compile(m, backend="aot_eager")):
        xi = x.clone().requires_grad_()
        y = f(xi)
        y.float().square().mean().backward()
        outs.append((y.detach(), xi.grad))
    torch._dynamo.reset()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ----------------------------------------------------------------------------- RMSNorm, SwiGLU
def test_rmsnorm_reference():
    n = mnn.RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        n.weight.copy_(randn(48, seed=11))
    x = randn(3, 5, 48, seed=12, dtype=torch.float64) * 3
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight.double()
    torch.testing.assert_close(n(x), ref, atol=0, rtol=1e-6)  # float32 weight, float64 math
    xb = x.to(torch.bfloat16)
    yb = n(xb)
    assert yb.dtype == torch.bfloat16
    refb = xb.double() * torch.rsqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight.double()
    torch.testing.assert_close(yb.double(), refb, atol=0, rtol=2.0 ** -8)  # one bf16 rounding of the fp32 result


def test_swiglu_reference():
    f = mnn.SwiGLU(16, 40, dtype=torch.float64, seed=2)
    x = randn(4, 16, seed=13, dtype=torch.float64)
    w1, w2, w3 = (getattr(f, k).weight for k in ("w1", "w2", "w3"))
    a = x @ w1.T
    torch.testing.assert_close(f(x), (a * torch.sigmoid(a) * (x @ w3.T)) @ w2.T, atol=1e-14, rtol=1e-12)
    assert w1.shape == (40, 16) and w2.shape == (16, 40) and w3.shape == (40, 16)
    assert f.w2.init_std == f.w1.init_std and mnn.SwiGLU(16, 40, out_init_std=0.001).w2.init_std == 0.001


# ----------------------------------------------------------------------------- recipes
def _bf16_exact(x):
    """float64 -> nearest-even bf16 value, rounded once (normal range)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 256.0), (e - 8).to(torch.float64))


def _deq(t, columnwise):
    return mxmla.dequantize(t, "float32", columnwise=columnwise).to(torch.float64)


def _linear_step(recipe, K, N):
    """A Linear of the recipe, x [5, 37, K] (185 tokens), its forward y and backward from dy: (lin, x, y, dy)."""
    g = torch.Generator().manual_seed(0)
    lin = mnn.Linear(K, N, recipe=recipe, seed=3)
    x = torch.randn(5, 37, K, generator=g).to(torch.bfloat16).requires_grad_()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 37, N)
    dy = torch.randn(y.shape, generator=g).to(torch.bfloat16)
    y.backward(dy)
    return lin, x, y, dy


def test_mxfp8_linear_runs_the_three_defined_gemms():
    """fprop X_row·W_rowᵀ (bf16), dgrad dY_row·W_col (bf16), wgrad dY_colᵀ·X_col (fp32), each on the
    exactly dequantized copies (SPEC §6); T = 185 tokens (a columnwise tail block)."""
    lin, x, y, dy = _linear_step("mxfp8", 64, 96)
    x8 = mxmla.quantize(x.detach().reshape(-1, 64))
    w8 = mxmla.quantize(lin.weight.detach().to(torch.bfloat16))
    dy8 = mxmla.quantize(dy.reshape(-1, 96))
    want_y = _bf16_exact(_deq(x8, False) @ _deq(w8, False).T)
    want_dx = _bf16_exact(_deq(dy8, False) @ _deq(w8, True))
    want_dw = (_deq(dy8, True).T @ _deq(x8, True)).to(torch.float32)
    assert torch.equal(y.reshape(-1, 96).to(torch.float64), want_y)
    assert torch.equal(x.grad.reshape(-1, 64).to(torch.float64), want_dx)
    assert lin.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.grad, want_dw, rtol=2.0 ** -22, atol=1e-30)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
def test_linear_accumulates_wgrad_into_main_grad(recipe):
    g = torch.Generator().manual_seed(2)
    lin = mnn.Linear(64, 32, recipe=recipe, seed=1)
    x = torch.randn(50, 64, generator=g).to(torch.bfloat16)
    dys = [torch.randn(50, 32, generator=g).to(torch.bfloat16) for _ in range(2)]
    want = torch.zeros(32, 64)
    for dy in dys:  # the .grad path, summed
        lin.weight.grad = None
        lin(x).backward(dy)
        want += lin.weight.grad
    lin.weight.grad = None
    lin.weight.main_grad = torch.full((32, 64), 0.5)
    for dy in dys:
        lin(x).backward(dy)
    assert lin.weight.grad is None
    torch.testing.assert_close(lin.weight.main_grad, want + 0.5, rtol=2.0 ** -20, atol=1e-6)


def test_mxfp8_linear_quantizes_the_weight_once_per_step(monkeypatch):
    calls = []
    real = mxmla.quantize

    def counting(x, *a, **k):
        calls.append(tuple(x.shape))
        return real(x, *a, **k)

    monkeypatch.setattr(mxmla, "quantize", counting)
    lin = mnn.Linear(64, 32, recipe="mxfp8", seed=1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(16, 64).to(torch.bfloat16)
    for step in range(2):
        for _ in range(3):  # micro-batches
            lin(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    w_quantizations = sum(1 for s in calls if s == (32, 64))
    assert w_quantizations == 2  # once per version of the weight
    y0 = lin(x)
    with torch.no_grad():
        lin.weight.add_(1.0)  # an in-place update: a new version, a new quantization
    assert not torch.equal(lin(x), y0)


def test_mxfp8_recipe_checks_its_dims_and_dtype():
    with pytest.raises(ValueError, match="recipe 'mxfp8' needs in_features to be a multiple of 32"):
        mnn.Linear(8, 64, recipe="mxfp8")
    with pytest.raises(ValueError, match="recipe 'mxfp8' needs out_features to be a multiple of 32"):
        mnn.Linear(64, 8, recipe="mxfp8")
    with pytest.raises(ValueError, match="computes in bf16"):
        mnn.Linear(64, 64, recipe="mxfp8", dtype=torch.float32)
    with pytest.raises(ValueError, match="recipe must be one of"):
        mnn.MLA(64, 4, 32, 16, recipe="fp8")
    assert mnn.RECIPES == ("bf16", "mxfp8", "block-fp8")


def _bdeq(t):
    return t.dequantize().to(torch.float64)


def test_block_fp8_linear_runs_the_three_defined_gemms():
    """DeepSeek-V3's recipe (SPEC §4.1): fprop X·Wᵀ with x in 1 x 128 blocks and W in 128 x 128 blocks
    (bf16 out), dgrad dY·W with dY in 1 x 128 blocks along N (bf16), wgrad dYᵀ·X with dY and x in
    1 x 128 blocks along the tokens (fp32): each the float64 product of the exactly dequantized
    operands rounded once (the CPU GEMM). T = 185, K = 200, N = 150: partial blocks everywhere."""
    lin, x, y, dy = _linear_step("block-fp8", 200, 150)
    x2, dy2, w = x.detach().reshape(-1, 200), dy.reshape(-1, 150), lin.weight.detach()
    wq = mxmla.quantize_blockwise(w, block_rows=128)
    want_y = _bdeq(mxmla.quantize_blockwise(x2)) @ _bdeq(wq).T
    want_dx = _bdeq(mxmla.quantize_blockwise(dy2)) @ _bdeq(wq)
    want_dw = _bdeq(mxmla.quantize_blockwise(dy2, transpose=True)) @ _bdeq(mxmla.quantize_blockwise(x2, transpose=True)).T
    assert torch.equal(y.reshape(-1, 150), want_y.to(torch.bfloat16))
    assert torch.equal(x.grad.reshape(-1, 200), want_dx.to(torch.bfloat16))
    assert lin.weight.grad.dtype == torch.float32 and torch.equal(lin.weight.grad, want_dw.to(torch.float32))
    # an input without a gradient: no dgrad, the same wgrad
    lin.weight.grad = None
    lin(x.detach()).backward(dy)
    assert torch.equal(lin.weight.grad, want_dw.to(torch.float32))


def test_block_fp8_linear_quantizes_the_weight_once_per_version():
    lin = mnn.Linear(64, 32, recipe="block-fp8", seed=1)
    x = torch.randn(50, 64).to(torch.bfloat16)
    y0 = lin(x)
    cached = lin.weight._mxmla_block_fp8  # W's two block-FP8 copies, made once per version of the weight
    lin(x).float().sum().backward()
    assert lin.weight._mxmla_block_fp8 is cached
    with torch.no_grad():
        lin.weight.add_(1.0)  # an optimizer's in-place update: a new version, quantized again
    assert not torch.equal(lin(x), y0) and lin.weight._mxmla_block_fp8 is not cached


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
def test_frozen_weights_skip_the_wgrad_and_keep_no_copy_of_x(recipe, monkeypatch):
    """A Linear whose weight takes no gradient (fine-tuning with frozen layers): the same output and
    the same dX bits as with a trained weight, no weight gradient, no wgrad GEMM, and nothing of x
    saved for the backward (W's copy only: under "mxfp8" its columnwise codes and scales, under
    "block-fp8" nothing, Wᵀ's copy being the weight cache's). An input without a gradient under a
    trained weight: no dgrad, the same dW bits."""
    import mxmla

    x0 = torch.randn(70, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    dy = torch.randn(70, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    trained, frozen = mnn.Linear(64, 96, recipe=recipe, seed=1), mnn.Linear(64, 96, recipe=recipe, seed=1)
    frozen.weight.requires_grad_(False)
    calls = []
    for name in ("gemm", "linear_backward"):
        real = getattr(mxmla, name)
        monkeypatch.setattr(mxmla, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    out = {}
    for key, lin in (("trained", trained), ("frozen", frozen)):
        x = x0.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            y = lin(x)
        calls.clear()
        y.backward(dy)
        out[key] = (y.detach(), x.grad, lin.weight.grad, sum(saved), list(calls))
    (y0, dx0, dw0, bytes0, calls0), (y1, dx1, dw1, bytes1, calls1) = out["trained"], out["frozen"]
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    assert dw0 is not None and dw1 is None
    assert calls1 == ["gemm"], calls1  # the dgrad alone
    # mxfp8: W's columnwise codes [96, 64] and scales [96 / 32, 64]; block-fp8: nothing (Wᵀ: the cache's)
    assert bytes1 == (96 * 64 + 3 * 64 if recipe == "mxfp8" else 0) < bytes0, (bytes1, bytes0)
    # an input without a gradient: no dgrad, the same wgrad bits (at once, and deferred)
    for deferred in (False, True):
        trained.weight.grad = None
        handle = trained.deferred_wgrad() if deferred else None
        trained(x0, wgrad=handle).backward(dy)
        assert torch.equal(trained.weight.grad, dw0), deferred


@pytest.mark.parametrize("recipe,q_lora,layout", [("mxfp8", 32, "bshd"), ("mxfp8", 0, "thd"),
                                                 ("block-fp8", 32, "bshd")])
def test_frozen_mla_block_gives_the_same_input_gradient(recipe, q_lora, layout):
    """An MLA block with every weight frozen (fine-tuning other layers through it): the output and dX
    bit for bit as the trained block's, no parameter gradient, and less saved for the backward (no
    copies of the Linears' inputs: the fused query path, the kv_b projection of attention_from_latent
    and the plain Linears all skip their wgrads)."""
    kw = dict(hidden=64, heads=2, q_lora_rank=q_lora, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, recipe=recipe, layout=layout, seed=6)
    trained, frozen = mnn.MLA(**kw), mnn.MLA(**kw)
    frozen.requires_grad_(False)
    shape = (2, 24, 64) if layout == "bshd" else (48, 64)
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    cu = [0, 20, 48] if layout == "thd" else None
    res = []
    for m in (trained, frozen):
        x = x0.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            y = m(x, cu_seqlens=cu)
        y.float().square().mean().backward()
        res.append((y.detach(), x.grad, sum(saved)))
    assert torch.equal(res[1][0], res[0][0]) and torch.equal(res[1][1], res[0][1])
    assert all(p.grad is None for p in frozen.parameters())
    assert all(p.grad is not None for p in trained.parameters())
    assert res[1][2] < res[0][2], (res[1][2], res[0][2])


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
def test_weight_cache_sees_writes_that_bypass_the_version_counter(recipe):
    """A weight's FP8 copies are cached per version of the weight and per generation: a write that
    leaves the version counter alone (through .data, as Megatron copies its main parameters into the
    model's; FSDP2's all-gather into its unsharded parameters, test_data_parallel.py) is seen after
    any torch optimizer's step, or after mnn.invalidate_weight_caches()."""
    lin = mnn.Linear(64, 32, recipe=recipe, seed=1)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def expected(w):  # a Linear that never cached anything, with weight w
        ref = mnn.Linear(64, 32, recipe=recipe, seed=9)
        ref.weight.data.copy_(w)
        return ref(x)

    y0 = lin(x)
    w1 = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    version = lin.weight._version
    lin.weight.data.copy_(w1)
    assert lin.weight._version == version  # the premise: the write bypassed the counter
    assert torch.equal(lin(x), y0)  # so between optimizer steps the cached copy is still read
    other = torch.nn.Parameter(torch.zeros(1))
    other.grad = torch.ones(1)
    torch.optim.SGD([other], lr=0.1).step()  # any optimizer's step, even on other parameters
    assert torch.equal(lin(x), expected(w1)) and not torch.equal(lin(x), y0)
    w2 = w1.flip(0)
    lin.weight.data.copy_(w2)
    mnn.invalidate_weight_caches()
    assert torch.equal(lin(x), expected(w2))


def test_block_fp8_recipe_checks_its_dtype():
    with pytest.raises(ValueError, match="recipe 'block-fp8' computes in bf16"):
        mnn.Linear(64, 64, recipe="block-fp8", dtype=torch.float32)
    with pytest.raises(ValueError, match="recipe 'block-fp8' computes in bf16"):
        mnn.MLA(64, 4, 32, 16, recipe="block-fp8", dtype=torch.float32)
    assert mnn.Linear(40, 24, recipe="block-fp8").weight.shape == (24, 40)  # any dims


@pytest.mark.parametrize("dtype,nope,dv,rope", [(torch.float64, 8, 6, 4), (torch.bfloat16, 8, 8, 4),
                                                (torch.bfloat16, 6, 5, 2)])  # 8-byte words; the plain copy
def test_kv_from_projection_is_the_split_and_concatenation(dtype, nope, dv, rope):
    """The block-fp8 recipe's K / V assembly (no torch.cat): K = [k_nope | k_pe broadcast], V the view,
    and their gradients (dkv = [dK_nope | dV], dk_pe summed over the heads) equal the torch graph's,
    also when only K reaches the loss (dV None)."""
    from mxmla.nn.mla import _KVFromProjection
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 5, 3, nope + dv, generator=g).to(dtype).requires_grad_()
    k_pe = torch.randn(2, 5, 1, rope, generator=g).to(dtype).requires_grad_()
    dk, dvv = torch.randn(2, 5, 3, nope + rope, generator=g).to(dtype), torch.randn(2, 5, 3, dv, generator=g).to(dtype)
    k, v = _KVFromProjection.apply(kv, k_pe, nope)
    k_nope, v_ref = kv.split([nope, dv], dim=-1)
    k_ref = torch.cat([k_nope, k_pe.expand(2, 5, 3, rope)], dim=-1)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    for outs, grads in (((k, v), (dk, dvv)), ((k,), (dk,))):
        refs = (k_ref, v_ref)[:len(outs)]
        got = torch.autograd.grad(outs, (kv, k_pe), grads, retain_graph=True)
        want = torch.autograd.grad(refs, (kv, k_pe), grads, retain_graph=True)
        assert torch.equal(got[0], want[0])  # copies
        torch.testing.assert_close(got[1], want[1], rtol=1e-15 if dtype == torch.float64 else 1e-2, atol=0)


def recipe_kw(recipe):
    """MLA / Decoder arguments of a recipe name; "mxfp8-linears": "mxfp8" with fp8_attention=False."""
    return dict(recipe="mxfp8", fp8_attention=False) if recipe == "mxfp8-linears" else dict(recipe=recipe)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8", "mxfp8-linears"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mla_fp8_recipe_tracks_the_bf16_block(recipe, layout):
    """Same weights, same input: the FP8 block's output, input gradient and every parameter's gradient
    stay within the quantization noise of the bf16 block: relative RMS of the output and dx < 10 %
    (measured 7 % for both recipes), of the parameter gradients < 25 % (measured 4-15 %: at
    initialization the attention is nearly uniform and the query path's gradient is a difference of
    nearly equal terms). "block-fp8": every Linear on the block-FP8 GEMM, attention in bf16;
    "mxfp8-linears": recipe "mxfp8" with fp8_attention=False."""
    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, layout=layout, seed=7)
    ref, fp8 = mnn.MLA(**kw), mnn.MLA(**kw, **recipe_kw(recipe))
    g = torch.Generator().manual_seed(1)
    x = torch.randn((2, 40, 64) if layout == "bshd" else (80, 64), generator=g).to(torch.bfloat16)
    cu = [0, 40, 80] if layout == "thd" else None
    outs = []
    for m in (ref, fp8):
        xi = x.clone().requires_grad_()
        o = m(xi, cu_seqlens=cu)
        o.float().square().mean().backward()
        outs.append((o.detach().double(), xi.grad.double(), {n: p.grad.double() for n, p in m.named_parameters()}))
    errs = {"out": rel(outs[1][0], outs[0][0]), "dx": rel(outs[1][1], outs[0][1])}
    errs.update({n: rel(outs[1][2][n], gr) for n, gr in outs[0][2].items()})
    print(f"relative RMS, {recipe} vs bf16 ({layout}):", {k: round(v, 4) for k, v in errs.items()})
    assert errs.pop("out") < 0.1 and errs.pop("dx") < 0.1, errs
    for n, e in errs.items():
        assert 0 < e < 0.25, (n, e)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mla_delayed_wgrad_runs_last_with_the_same_bits(recipe, layout):
    """delay_wgrad (the default under the FP8 recipes): wo's weight gradient is made after every other
    gradient of the block (its fp32 buffer then misses the attention backward's peak); without it,
    first (wo is the last Linear of the forward). Outputs and every gradient bit-identical, through
    .grad and through main_grad, and twice over one graph (retain_graph)."""
    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, layout=layout, seed=7, recipe=recipe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn((2, 40, 64) if layout == "bshd" else (80, 64), generator=g).to(torch.bfloat16)
    cu = [0, 40, 80] if layout == "thd" else None
    runs = {}
    for delay in (False, True):
        m = mnn.MLA(**kw, delay_wgrad=delay)
        order = []
        for n, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
        bits = mla_step_bits(m, x, cu)
        assert order[0 if not delay else -1] == "wo.weight", order
        assert sorted(order) == sorted(n for n, _ in m.named_parameters())
        m.zero_grad(set_to_none=True)
        o = m(x, cu_seqlens=cu).float().square().mean()
        o.backward(retain_graph=True)
        if recipe == "mxfp8":  # its attention frees the saved MXFP8 Q, K, V in the first backward
            with pytest.raises(RuntimeError, match="attention_from_latent: trying to backward through the graph a second"):
                o.backward()
            twice = []
        else:
            o.backward()
            twice = [p.grad.clone() for _, p in sorted(m.named_parameters())]
        m.zero_grad(set_to_none=True)
        for p in m.parameters():
            p.main_grad = torch.full_like(p, 0.25, dtype=torch.float32) if p.dim() == 2 else None
        m(x, cu_seqlens=cu).float().square().mean().backward()
        mains = [p.main_grad.clone() for _, p in sorted(m.named_parameters()) if p.dim() == 2]
        runs[delay] = (bits, twice, mains)
    for a, b in zip(*(sum(([*r[0]], r[1], r[2]), []) for r in (runs[False], runs[True]))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_mla_fp8_recipes_under_activation_checkpointing(recipe, use_reentrant):
    """torch.utils.checkpoint around the block (its forward recomputed in the backward; the deferred
    wgrad's anchor and the saved inputs come back with it): the same bits as without."""
    from torch.utils.checkpoint import checkpoint

    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, seed=7, recipe=recipe)
    m = mnn.MLA(**kw)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    runs = []
    for ckpt in (False, True):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        o = checkpoint(m, xi, use_reentrant=use_reentrant) if ckpt else m(xi)
        o.float().square().mean().backward()
        runs.append([o.detach(), xi.grad] + [p.grad for _, p in sorted(m.named_parameters())])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
def test_swiglu_fp8_shares_x_and_delays_w2_wgrad_with_the_same_bits(recipe):
    """The FP8 SwiGLU (x quantized once for w1 and w3 under block-fp8; w2's wgrad after w1's and
    w3's) against its three Linears called one by one: the same output and gradients, bit for bit;
    w2's gradient arrives last with delay_wgrad, first without."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 50, 64, generator=g).to(torch.bfloat16)
    dy = torch.randn(3, 50, 64, generator=g).to(torch.bfloat16)
    runs = []
    for delay in (True, False, None):  # None: the Linears one by one
        f = mnn.SwiGLU(64, 96, recipe=recipe, seed=3, delay_wgrad=bool(delay))
        order = []
        for n, p in f.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
        xi = x.clone().requires_grad_()
        y = f(xi) if delay is not None else f.w2(torch.nn.functional.silu(f.w1(xi)) * f.w3(xi))
        y.backward(dy)
        if delay is not None:
            assert order.index("w2.weight") == (2 if delay else 0), order
        runs.append([y.detach(), xi.grad] + [p.grad for _, p in sorted(f.named_parameters())])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8"])
def test_mla_delayed_wgrad_under_autograd_grad(recipe):
    """torch.autograd.grad with the deferral: the gradients asked for (wo's among them) equal the
    immediate wgrad's bit for bit, and nothing lands in .grad; asking for x alone works too."""
    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, seed=7, recipe=recipe)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = {}
    for delay in (False, True):
        m = mnn.MLA(**kw, delay_wgrad=delay)
        xi = x.clone().requires_grad_()
        got[delay] = torch.autograd.grad(m(xi).float().square().mean(), [m.wo.weight, m.wq_b.weight, xi])
        assert all(p.grad is None for p in m.parameters())
        (gx,) = torch.autograd.grad(m(xi).float().square().mean(), [xi])
        assert torch.equal(gx, got[delay][2])
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["block-fp8", "mxfp8"])
def test_linear_deferred_wgrad_and_shared_input_checks(recipe):
    lin = mnn.Linear(64, 32, recipe=recipe, seed=1)
    with pytest.raises(TypeError, match="wgrad must be a DeferredWgrad from deferred_wgrad"):
        lin(torch.zeros(4, 64), wgrad=object())
    with pytest.raises(ValueError, match=r"x_quantized is for the FP8 recipes \('mxfp8', 'block-fp8'\), not 'bf16'"):
        mnn.Linear(64, 32)(torch.zeros(4, 64), x_quantized=())
    with pytest.raises(ValueError, match=r"quantize_input: for the FP8 recipes \('mxfp8', 'block-fp8'\), not 'bf16'"):
        mnn.Linear(64, 32).quantize_input(torch.zeros(4, 64))
    assert mnn.Linear(64, 32).deferred_wgrad() is None  # bf16: plain torch
    with torch.no_grad():
        assert lin.deferred_wgrad() is None
    # x quantized once for two Linears: the same bits as each quantizing it
    other = mnn.Linear(64, 96, recipe=recipe, seed=2)
    x = torch.randn(50, 64).to(torch.bfloat16).requires_grad_()
    xq = lin.quantize_input(x)
    want = (r"the block-FP8 pair \(X \[49, 64\], Xᵀ \[64, 49\]\)" if recipe == "block-fp8" else
            r"an MXFP8Tensor \[49, 64\] with both copies")
    with pytest.raises(ValueError, match=r"x_quantized must be quantize_input\(x\) of this x: " + want):
        lin(x[:49], x_quantized=xq)
    wrong = xq[0] if recipe == "block-fp8" else mxmla.quantize(x.detach(), columnwise=False)
    with pytest.raises(ValueError, match="x_quantized must be quantize_input"):
        lin(x, x_quantized=wrong)
    y = lin(x, x_quantized=xq).float().sum() + other(x, x_quantized=xq).float().square().sum()
    y.backward()
    got = [x.grad, lin.weight.grad, other.weight.grad]
    x.grad = lin.weight.grad = other.weight.grad = None
    (lin(x).float().sum() + other(x).float().square().sum()).backward()
    for a, b in zip(got, [x.grad, lin.weight.grad, other.weight.grad]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"save_original_input is for the FP8 recipes \('mxfp8', 'block-fp8'\), "
                                         "not 'bf16'"):
        mnn.Linear(64, 32)(torch.zeros(4, 64), save_original_input=True)
    with pytest.raises(TypeError, match="save_original_input must be a bool, got int"):
        lin(x, save_original_input=1)


@pytest.mark.parametrize("recipe", ["block-fp8", "mxfp8"])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("main_grad", [False, True])
def test_fp8_linear_saving_the_original_input(recipe, contiguous, delay, main_grad):
    """save_original_input: the Linear keeps x (bf16, its own memory) instead of its FP8 copy for the
    wgrad (block-fp8: xᵀ; mxfp8: x's columnwise copy) and quantizes that when the wgrad runs: the same
    bits, into .grad or main_grad. An x whose rows are not its memory (here a transposed view, which
    the Linear would copy) falls back to the FP8 copy."""
    g = torch.Generator().manual_seed(4)
    n_in, n_out = (200, 150) if recipe == "block-fp8" else (192, 160)  # (mxfp8: multiples of 32)
    lin = mnn.Linear(n_in, n_out, recipe=recipe, seed=1)
    base = torch.randn(185, n_in, generator=g).to(torch.bfloat16)
    dy = torch.randn(185, n_out, generator=g).to(torch.bfloat16)
    runs = []
    for original in (False, True):
        x = (base.clone() if contiguous else base.T.contiguous().T).requires_grad_()
        lin.weight.grad = None
        if main_grad:
            lin.weight.main_grad = torch.full(lin.weight.shape, 0.5)
        defer = lin.deferred_wgrad() if delay else None
        y = lin(x, wgrad=defer, save_original_input=original)
        saved = [t.data_ptr() for t in y.grad_fn.saved_tensors if t is not None]
        assert (x.data_ptr() in saved) == (original and contiguous)
        y.backward(dy)
        runs.append((y.detach(), x.grad, lin.weight.main_grad if main_grad else lin.weight.grad))
        assert runs[-1][2] is not None
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def mla_step_bits(m, x, cu=None, layout=None):
    """(output, dx, every parameter's gradient) of one forward + backward of m."""
    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    o = m(xi, cu_seqlens=cu, layout=layout)
    o.float().square().mean().backward()
    return [o.detach(), xi.grad] + [p.grad for _, p in sorted(m.named_parameters())]


def mla_output_projection_keeps_the_attention_output(recipe, device="cpu"):
    # (DeepSeek-V3's head dims: the ones torch's SDPA takes to cuDNN on the GPU)
    m = mnn.MLA(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=128, rope_dim=64, v_dim=128,
                max_seq_len=64, seed=9, device=device, **recipe_kw(recipe))
    x = randn(2, 64, 64, seed=4).to(device=device, dtype=torch.bfloat16).requires_grad_()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.data_ptr()) or t, lambda t: t):
        out = m(x)
    wo_saved = out.grad_fn.saved_tensors  # wo's node (tp 1: its output is the block's)
    assert wo_saved[0].dtype == torch.bfloat16 and tuple(wo_saved[0].shape) == (128, 256)
    assert packed.count(wo_saved[0].data_ptr()) >= 2, "O saved by the attention and by wo, one storage"
    out.float().square().mean().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_mla_output_projection_keeps_the_attention_output_it_reads():
    """Under "mxfp8" wo saves no FP8 copy of its input O: it keeps O itself, which the attention saves
    anyway (one storage saved twice), and quantizes it when its wgrad runs. (block-fp8 does the same
    where torch's SDPA returns O with rows of its own memory, as cuDNN's does: the GPU test.)"""
    mla_output_projection_keeps_the_attention_output("mxfp8")


@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_mla_mxfp8_thd_is_bshd_bit_for_bit_on_whole_blocks(q_lora_rank):
    """Under "mxfp8", thd runs the fused query path (the tables' rows gathered by each token's position in
    its own sequence) and quantizes q, K and V as [t, h·d], columnwise blocks of 32 along the packed
    tokens. With sequences of 32·n tokens no block straddles two sequences, so packing them gives the
    bits of bshd with one sequence a batch row: output, dx and every gradient (q_lora_rank 0: the fused
    op on wq)."""
    kw = dict(hidden=64, heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, seed=9, recipe="mxfp8")
    m = mnn.MLA(**kw)
    x = randn(3, 64, 64, seed=4).to(torch.bfloat16)
    bshd = mla_step_bits(m, x)
    thd = mla_step_bits(m, x.reshape(192, 64), cu=[0, 64, 128, 192], layout="thd")
    assert torch.equal(thd[0].reshape(3, 64, 64), bshd[0]) and torch.equal(thd[1].reshape(3, 64, 64), bshd[1])
    for a, b in zip(thd[2:], bshd[2:]):
        assert torch.equal(a, b)


def test_mla_mxfp8_fused_query_path_checks():
    with pytest.raises(ValueError, match="recipe 'mxfp8' needs nope_dim \\+ rope_dim \\(40\\) and v_dim \\(32\\) to be "
                                         "multiples of 32"):
        mnn.MLA(64, 2, 32, 32, nope_dim=24, rope_dim=16, v_dim=32, recipe="mxfp8")
    q = mnn.MLAQUpProj(32, 2, 32, 32, weights="mxfp8", layout="thd", max_seq_len=16)
    with pytest.raises(ValueError, match="a sequence of 20 tokens is longer than max_seq_len=16"):
        q(randn(24, 32).to(torch.bfloat16), cu_seqlens=[0, 4, 24])
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        q(randn(24, 32).to(torch.bfloat16), cu_seqlens=[0, 4, 20])
    with pytest.raises(ValueError, match="x must be \\[t, in_features\\]"):
        q(randn(1, 24, 32).to(torch.bfloat16))
    with pytest.raises(ValueError, match="cu_seqlens is for layout 'thd'"):
        mnn.MLAQUpProj(32, 2, 32, 32, layout="bshd")(randn(1, 4, 32).to(torch.bfloat16), cu_seqlens=[0, 4])
    from mxmla.nn.qproj import attention_from_mxfp8_q
    q8, anchor = mnn.MLAQUpProj(32, 2, 32, 32, weights="mxfp8", layout="bshd")(randn(1, 4, 32).to(torch.bfloat16))
    kv = randn(1, 4, 2, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="q8 must be the thd tensor of MLAQUpProj"):
        attention_from_mxfp8_q(q8, anchor, kv, kv, cu_seqlens=[0, 4])
    with pytest.raises(ValueError, match="max_seqlen is for packed sequences"):
        attention_from_mxfp8_q(q8, anchor, kv, kv, max_seqlen=4)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mla_mxfp8_deterministic_reaches_the_attention_backward(layout, monkeypatch):
    """MLA(deterministic=True) hands deterministic=True to every attention backward of the block
    (attention_from_latent, bshd and thd alike), and the default hands False; on the CPU (the float64
    reference, one summation order) both give the same gradients."""
    import mxmla.nn.qproj as nq
    import mxmla.attention_autograd as aa
    seen = []
    real = mxmla.attention_backward

    def spy(*a, **k):
        seen.append(k.get("deterministic"))
        return real(*a, **k)
    for mod in (mxmla, nq, aa):
        if hasattr(mod, "attention_backward"):
            monkeypatch.setattr(mod, "attention_backward", spy)
    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=64, layout=layout, seed=5, recipe="mxfp8")
    x = torch.randn((1, 40, 64) if layout == "bshd" else (40, 64), generator=torch.Generator().manual_seed(0))
    cu = [0, 25, 40] if layout == "thd" else None
    grads = []
    for det in (True, False):
        m = mnn.MLA(**kw, deterministic=det)
        xi = x.to(torch.bfloat16).requires_grad_()
        m(xi, cu_seqlens=cu).float().square().mean().backward()
        grads.append([xi.grad] + [p.grad for _, p in sorted(m.named_parameters())])
    assert seen == [True, False], seen
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert "deterministic=True" in repr(mnn.MLA(**kw, deterministic=True))


# ----------------------------------------------------------------------------- Decoder
def decoder(**kw):
    args = dict(hidden=32, layers=2, heads=2, max_seq_len=64, seed=0)
    args.update(kw)
    return mnn.Decoder(**args)


def test_decoder_structure_and_shapes():
    d = decoder()
    names = {n for n, _ in d.named_parameters()}
    assert {"embed", "norm.weight", "head.weight", "layers.0.attn_norm.weight", "layers.0.attn.wq_a.weight",
            "layers.0.ffn_norm.weight", "layers.0.ffn.w1.weight", "layers.1.attn.wo.weight"} <= names
    assert d.embed.shape == (256, 32) and d.head.weight.shape == (256, 32)
    mx = decoder(hidden=64, recipe="mxfp8", q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32)
    assert mx.head.recipe == "bf16" and mx.layers[0].ffn.w1.recipe == "mxfp8"  # the output head stays bf16
    t = mnn.byte_tokens("hello, world")
    assert t.dtype == torch.int64 and t.tolist() == list(b"hello, world")
    logits = d(t.view(2, 6))
    assert logits.shape == (2, 6, 256) and logits.dtype == torch.float32
    packed = d(t, cu_seqlens=[0, 6, 12])  # thd: the same two sequences packed
    torch.testing.assert_close(packed.view(2, 6, 256), logits, atol=2e-2, rtol=2e-2)
    d32 = decoder(dtype=torch.float32)
    torch.testing.assert_close(d32(t, cu_seqlens=[0, 6, 12]).view(2, 6, 256), d32(t.view(2, 6)), atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="tokens"):
        d(t.view(1, 2, 6))


def test_decoder_weights_deterministic_and_state_dict_round_trip():
    a, b, c = decoder(seed=5), decoder(seed=5), decoder(seed=6)
    sa = a.state_dict()
    assert all(torch.equal(sa[k], v) for k, v in b.state_dict().items())
    assert not torch.equal(sa["layers.0.attn.wq_a.weight"], c.state_dict()["layers.0.attn.wq_a.weight"])
    # the same seed gives the same values at float64
    d64 = decoder(seed=5, dtype=torch.float64)
    assert torch.equal(d64.state_dict()["layers.1.ffn.w2.weight"], sa["layers.1.ffn.w2.weight"].double())
    assert not any("rope" in k for k in sa)
    c.load_state_dict(sa)
    t = mnn.byte_tokens("state dict round trip").view(1, -1)
    assert torch.equal(c(t), a(t))
    # through a file, into a model built from another seed
    import io

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    e = decoder(seed=9)
    e.load_state_dict(torch.load(buf))
    assert torch.equal(e(t), a(t))


def test_decoder_learns():
    torch.manual_seed(0)
    data = mnn.byte_tokens(TEXT.read_text())
    d = decoder(hidden=32, layers=1, heads=2)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    seq, losses = 32, []
    for _ in range(40):
        starts = torch.randint(0, len(data) - seq - 1, (8,), generator=g)
        w = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        loss = d.loss(w[:, :-1], w[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)  # uniform over bytes at the start
    assert sum(losses[-5:]) / 5 < 0.65 * losses[0], losses


# ----------------------------------------------------------------------------- examples/train_mla.py
def _script_env():
    env = dict(os.environ)
    pkg_parent = str(pathlib.Path(mxmla.__file__).resolve().parents[1])  # the mxmla these tests import
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, as on a machine without a GPU
    return env


def test_train_script_end_to_end(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(SCRIPT), "--text-file", str(TEXT), "--steps", "6", "--layers", "1",
                        "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=_script_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "running a tiny configuration on the CPU" in r.stdout
    assert "[bf16] step 6/6" in r.stdout and "final loss gap: only one recipe ran (bf16)" in r.stdout
    rows = (out / "loss_bf16.csv").read_text().splitlines()
    assert rows[0] == "step,loss" and len(rows) == 7
    assert [int(l.split(",")[0]) for l in rows[1:]] == list(range(1, 7))
    assert all(math.isfinite(float(l.split(",")[1])) for l in rows[1:])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in r.stdout
    else:
        assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_script_runs_the_fp8_recipes_beside_bf16(tmp_path):
    recipes = ("bf16", "mxfp8", "block-fp8", "mxfp8-linears")
    r = subprocess.run([sys.executable, str(SCRIPT), "--text-file", str(TEXT), "--recipe", ",".join(recipes),
                        "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                       env=_script_env())
    assert r.returncode == 0, r.stderr
    for recipe in recipes[1:]:
        assert f"final loss gap {recipe} - bf16" in r.stdout, recipe
    for recipe in recipes:
        assert (tmp_path / f"loss_{recipe}.csv").exists(), recipe


def test_train_script_deterministic_runs_repeat(tmp_path):
    """--deterministic switches torch's deterministic algorithms on, strict (in the script's own process), and two
    runs give the same loss curve."""
    curves = []
    for k in range(2):
        out = tmp_path / str(k)
        r = subprocess.run([sys.executable, str(SCRIPT), "--text-file", str(TEXT), "--recipe", "mxfp8", "--steps", "3",
                            "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "4",
                            "--deterministic", "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=_script_env())
        assert r.returncode == 0, r.stdout + r.stderr
        assert "; deterministic (torch.use_deterministic_algorithms on, strict)" in r.stdout
        curves.append((out / "loss_mxfp8.csv").read_text())
    assert curves[0] == curves[1] and len(curves[0].splitlines()) == 4


def test_torch_deterministic_warns_or_raises(monkeypatch):
    """torch_deterministic(): torch's deterministic algorithms on with warn_only (repro_probe.py
    --torch-deterministic), strict=True without it (the script's --deterministic, repro_probe.py --torch-strict),
    cuBLAS's fixed workspace unless one is set."""
    tm = load_script()
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # (recorded first, so that the undo also removes what
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")      # torch_deterministic sets where nothing was set)
    try:
        tm.torch_deterministic()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        tm.torch_deterministic(strict=True)
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_train_script_cuda_graph_needs_a_gpu_and_one_process(tmp_path, capsys):
    tm = load_script()
    args = ["--text-file", str(TEXT), "--steps", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq",
            "32", "--batch", "2", "--out", str(tmp_path), "--cuda-graph"]
    assert tm.main(args + ["--device", "cpu"]) == 2
    assert "--cuda-graph needs a CUDA device (--device cpu)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tm.parse_args(args + ["--tp", "2"])
    assert "--cuda-graph: one process only" in capsys.readouterr().err


def test_train_script_two_recipes_same_weights_and_data(tmp_path, monkeypatch, capsys):
    """A second recipe slots in: here a stand-in that builds the bf16 model, so both runs start from
    the same weights and see the same batches; the curves are identical and the gap is zero."""
    tm = load_script()
    build = tm.build_model
    monkeypatch.setattr(tm, "build_model", lambda recipe, *a: build("bf16", *a))
    assert tm.main(["--text-file", str(TEXT), "--recipe", "bf16,other", "--steps", "4", "--layers", "1",
                    "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "2", "--device", "cpu",
                    "--out", str(tmp_path)]) == 0
    a, b = ((tmp_path / f"loss_{r}.csv").read_text() for r in ("bf16", "other"))
    assert a == b
    assert "final loss gap other - bf16: +0.0000 (training), +0.0000 (held-out)" in capsys.readouterr().out


def test_train_script_run_continued_from_its_state_is_the_same_run():
    """train_recipe over steps [0, 5) and then, on a fresh model and optimizer loaded with that state, over
    [5, 12) gives the losses of one run over [0, 12) bit for bit (the schedule and data order continue);
    eval_windows=0 leaves the held-out loss out."""
    import copy

    tm = load_script()
    cfg = dict(layers=1, hidden=32, heads=2, seq=32, batch=2, steps=12, lr=3e-3)
    train, val = tm.split_corpus(TEXT.read_bytes(), cfg["seq"])
    whole = tm.train_recipe("bf16", tm.build_model("bf16", cfg, 0, "cpu"), train, val, cfg, 0, "cpu", 100)
    model = tm.build_model("bf16", cfg, 0, "cpu")
    opt = tm.make_optimizer(model, cfg["lr"])
    head = tm.train_recipe("bf16", model, train, val, cfg, 0, "cpu", 100, opt=opt, span=(0, 5), eval_windows=0)
    state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model = tm.build_model("bf16", cfg, 1, "cpu")  # other weights, overwritten by the state
    model.load_state_dict(state)
    opt = tm.make_optimizer(model, cfg["lr"])
    opt.load_state_dict(opt_state)
    tail = tm.train_recipe("bf16", model, train, val, cfg, 0, "cpu", 100, opt=opt, span=(5, 12))
    assert len(head["losses"]) == 5 and len(tail["losses"]) == 7 and head["held_out"] is None
    assert head["losses"] + tail["losses"] == whole["losses"]
    assert tail["held_out"] == whole["held_out"]


def test_train_script_corpus(tmp_path):
    tm = load_script()
    with pytest.raises(SystemExit, match="sudo apt-get install python3-doc"):
        tm.load_corpus(root=tmp_path)  # no python3-doc here
    src = tmp_path / "python3.11" / "html" / "_sources"
    (src / "library").mkdir(parents=True)
    (src / "b.rst.txt").write_bytes(b"second")
    (src / "library" / "a.rst.txt").write_bytes(b"third")
    (src / "a.rst.txt").write_bytes(b"first")
    (src / "skip.html").write_bytes(b"not text")
    data, source, name = tm.load_corpus(root=tmp_path)
    assert data == b"first\nsecond\nthird" and "python3-doc" in source and "3 files" in source
    train, held = tm.split_corpus(b"x" * 1000, 8)
    assert len(train) == 990 and len(held) == 10
    with pytest.raises(SystemExit, match="too few"):
        tm.split_corpus(b"x" * 20, 16)
    # the data order is the seed's
    assert (tm.batch_offsets(1000, 8, 4, 3, seed=1) == tm.batch_offsets(1000, 8, 4, 3, seed=1)).all()


def test_train_script_real_corpus_when_installed():
    tm = load_script()
    if tm.corpus_dir() is None:
        pytest.skip("Debian's python3-doc is not installed: the default corpus is not here")
    data, source, _ = tm.load_corpus()
    assert len(data) > 5_000_000 and b"Python" in data[:100_000]


def test_import_mxmla_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import mxmla\n"
            "try:\n    import mxmla.nn\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_script_env())
    assert r.returncode == 0, r.stderr
    assert "ImportError: mxmla.nn needs torch" in r.stdout


# ----------------------------------------------------------------------------- CUDA graph capture (logic)
def _pretend_capturing(monkeypatch, capturing=True):
    """torch as it answers on a GPU while a CUDA graph is (or is not) being captured (the GPU tests
    capture for real)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)


def test_weight_cache_is_bypassed_while_capturing(monkeypatch):
    """The once-per-version cache of a weight's FP8 copies: outside a capture one make per version;
    while a CUDA graph is being captured a make at every call and nothing cached (a replay runs no
    Python: a cached copy would be frozen into every replay); after a capture that read the weight,
    a make at every eager call too (replays change weights without a new version)."""
    from mxmla.nn.layers import _per_version

    class CudaWeight:  # what _per_version reads of a CUDA tensor
        is_cuda, device, _version = True, "cuda:0", 0

        def data_ptr(self):
            return 1234

        def detach(self):
            return self

    w, made = CudaWeight(), []
    make = lambda t: made.append(t) or len(made)  # noqa: E731
    _pretend_capturing(monkeypatch, False)
    assert [_per_version(w, "_c", make) for _ in range(3)] == [1, 1, 1]  # not capturing: made once
    _pretend_capturing(monkeypatch)
    assert [_per_version(w, "_c", make) for _ in range(2)] == [2, 3]
    assert w._c[1] == 1  # the cache holds the copy made outside the capture, untouched
    # after the capture the weight may change by replays (a captured optimizer step) with neither a new
    # version nor a new generation: an eager call between replays makes its copy afresh every time
    _pretend_capturing(monkeypatch, False)
    assert [_per_version(w, "_c", make) for _ in range(2)] == [4, 5]


def test_packed_sequences_refuse_capture(monkeypatch):
    """MLA on packed sequences makes its RoPE positions and cu_seqlens on the host at each call:
    while a CUDA graph is being captured that is a clear error, before any work is queued."""
    block = mnn.MLA(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
                    max_seq_len=64, layout="thd", recipe="mxfp8", seed=3)
    x = torch.randn(40, 64).to(torch.bfloat16)
    _pretend_capturing(monkeypatch)
    with pytest.raises(RuntimeError, match=r"packed sequences \(layout 'thd'\) cannot be captured in a CUDA graph"):
        block(x, cu_seqlens=[0, 24, 40])
    from mxmla.nn.qproj import packed_positions

    with pytest.raises(RuntimeError, match="cannot be captured"):
        packed_positions([0, 24, 40])


def test_packed_positions_restart_at_every_sequence():
    """Each packed token's position inside its own sequence, empty sequences included (the fused Q
    path's RoPE rows), as mxmla.positions_from_cu_seqlens gives them."""
    from mxmla.nn.qproj import packed_positions

    for cu in ([0, 3, 3, 7, 8], [0, 5], [0, 0], [0]):
        got = packed_positions(cu)
        assert got.dtype == torch.int64
        assert got.tolist() == [i - a for a, b in zip(cu, cu[1:]) for i in range(a, b)]
        if len(cu) > 1:  # (positions_from_cu_seqlens takes at least one sequence)
            assert got.tolist() == [int(p) for p in mxmla.positions_from_cu_seqlens(cu)]
