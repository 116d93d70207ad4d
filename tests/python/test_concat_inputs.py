"""Inputs read in place: quantize_attention of a strided 4-D view and of a pair (x0, x1) standing for
torch.cat([x0, x1], -1) (k_pe broadcast over the heads by a stride of 0), linear_backward of a pair
(dy = torch.cat([dy0, dy1], -1).flatten(-2)), and mxmla.nn.MLA's mxfp8 path built on them
(attention_from_latent) — each bit for bit against the same op on the materialised tensor, which is
what it promises: the CPU reference (numpy, torch CPU) and the CUDA kernels (GPU tests skip without a
GPU). Tails (s not a multiple of 32), b > 1, one head, both layouts, compact and BHSD scales, bf16 /
fp16 / fp32, E4M3 / E5M2, NaN and Inf, main_grad; bad pairs → errors naming the part and the rule."""
import numpy as np
import pytest

import mxmla

torch = pytest.importorskip("torch")

HAVE_GPU = torch.cuda.is_available() and bool(mxmla.info()["gpus"])
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or torch without CUDA): GPU test skipped")
NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def same_bits(a, b):
    """Every direction of two MXFP8Tensors holds the same bytes (NaN codes included)."""
    assert a.shape == b.shape
    for n in NAMES:
        x, y = getattr(a, n), getattr(b, n)
        assert (x is None) == (y is None), n
        if x is not None:
            assert torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)), n


def kv_parts(b, s, h, nope=128, rope=64, v=128, dtype=torch.bfloat16, seed=0, layout="bshd", device="cpu"):
    """MLA's pieces: kv [.., h, nope + v] (a projection's output), k_pe [.., 1, rope] — with a spread
    of magnitudes per token, a NaN and an Inf — and the views K = (k_nope, k_pe over the heads), V."""
    g = torch.Generator().manual_seed(seed)
    lead = (b, s) if layout == "bshd" else (s, b)
    kv = torch.randn(*lead, h, nope + v, generator=g) * torch.exp2(torch.randint(-8, 8, (*lead, 1, 1), generator=g).float())
    pe = torch.randn(*lead, 1, rope, generator=g)
    kv.view(-1)[5] = float("nan")
    pe.view(-1)[3] = float("inf")
    kv, pe = kv.to(dtype).to(device), pe.to(dtype).to(device)
    return kv, pe, kv[..., :nope], pe.expand(*lead, h, rope), kv[..., nope:]


# ----------------------------------------------------------------------------- quantize_attention
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("bhsd", [True, False])
@pytest.mark.parametrize("b,s,h", [(2, 37, 3), (1, 64, 1)])
def test_pair_and_strided_view_equal_the_materialised_tensor_cpu(layout, bhsd, b, s, h):
    kv, pe, kn, pex, v = kv_parts(b, s, h, layout=layout)
    same_bits(mxmla.quantize_attention((kn, pex), layout, bhsd_scales=bhsd),
              mxmla.quantize_attention(torch.cat([kn, pex], -1), layout, bhsd_scales=bhsd))
    same_bits(mxmla.quantize_attention(v, layout, bhsd_scales=bhsd),
              mxmla.quantize_attention(v.contiguous(), layout, bhsd_scales=bhsd))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_pair_other_dtypes_and_formats_cpu(dtype, fmt):
    # parts of 8 / 24 (fp16: whole 16-byte pieces) and a single direction
    kv, pe, kn, pex, v = kv_parts(2, 33, 2, nope=40, rope=24, v=32, dtype=dtype)
    for rw, cw in ((True, True), (False, True), (True, False)):
        same_bits(mxmla.quantize_attention((kn, pex), "bshd", rowwise=rw, columnwise=cw, fp8_format=fmt),
                  mxmla.quantize_attention(torch.cat([kn, pex], -1), "bshd", rowwise=rw, columnwise=cw, fp8_format=fmt))


def test_pair_numpy():
    kv, pe, kn, pex, v = kv_parts(2, 35, 2, dtype=torch.float32)
    a, p = kv.numpy(), pe.numpy()
    kn_np, pe_np = a[..., :128], np.broadcast_to(p, (2, 35, 2, 64))  # a view and a stride-0 broadcast
    q = mxmla.quantize_attention((kn_np, pe_np), "bshd")
    r = mxmla.quantize_attention(np.concatenate([kn_np, pe_np], -1), "bshd")
    for n in NAMES:
        np.testing.assert_array_equal(getattr(q, n).view(np.uint8), getattr(r, n).view(np.uint8))


@pytest.mark.parametrize(
    "parts,match",
    [
        (lambda: (torch.zeros(2, 8, 2, 34), torch.zeros(2, 8, 2, 30)), r"argument 'x\[0\]': last dimension 34 must be a multiple of 4"),
        (lambda: (torch.zeros(2, 8, 2, 32), torch.zeros(2, 8, 2, 8)), "argument .x.: head dimension 40 must be a positive multiple of 32"),
        (lambda: (torch.zeros(2, 8, 2, 32), torch.zeros(2, 8, 3, 32)), r"argument 'x\[1\]': shape \(2, 8, 3, 32\) must match"),
        (lambda: (torch.zeros(2, 8, 2, 32), torch.zeros(2, 8, 2, 32, dtype=torch.float16)), r"argument 'x\[1\]': dtype float16 must be part0's"),
        (lambda: (torch.zeros(2, 8, 2, 64)[..., ::2], torch.zeros(2, 8, 2, 32)), r"argument 'x\[0\]': last dimension must be contiguous"),
        (lambda: (torch.zeros(8, 2, 32), torch.zeros(8, 2, 32)), r"argument 'x\[0\]': must be 4-D"),
        (lambda: (torch.zeros(2, 8, 2, 32), np.zeros((2, 8, 2, 32), np.float32)), r"argument 'x\[1\]': expected a torch.Tensor"),
        (lambda: (torch.zeros(2, 8, 2, 32),), "got 1 items"),
    ],
)
def test_pair_errors(parts, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mxmla.quantize_attention(parts(), "bshd")


def test_pair_requires_no_grad():
    a = torch.zeros(2, 8, 2, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"argument 'x\[0\]': requires grad"):
        mxmla.quantize_attention((a, torch.zeros(2, 8, 2, 32)), "bshd")


@needs_gpu
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("b,s,h", [(2, 129, 3), (1, 1000, 16), (1, 31, 1)])
def test_pair_and_strided_view_cuda_match_cpu(layout, b, s, h):
    kv, pe, kn, pex, v = kv_parts(b, s, h, layout=layout, device="cuda")
    k_ref = torch.cat([kn, pex], -1).cpu()
    for bhsd in (True, False):
        k8 = mxmla.quantize_attention((kn, pex), layout, bhsd_scales=bhsd)
        assert k8.rowwise_data.is_cuda
        same_bits(k8, mxmla.quantize_attention(k_ref, layout, bhsd_scales=bhsd))
        same_bits(k8, mxmla.quantize_attention(torch.cat([kn, pex], -1), layout, bhsd_scales=bhsd))
        same_bits(mxmla.quantize_attention(v, layout, bhsd_scales=bhsd),
                  mxmla.quantize_attention(v.contiguous().cpu(), layout, bhsd_scales=bhsd))


@needs_gpu
def test_pair_cuda_alignment_errors():
    a = torch.zeros(2, 8, 2, 40, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument 'x\[0\]': strides .* must be multiples of 16 bytes"):
        mxmla.quantize_attention((a[..., :20].as_strided((2, 8, 2, 8), (644, 80, 36, 1)),
                                  torch.zeros(2, 8, 2, 24, device="cuda", dtype=torch.bfloat16)), "bshd")
    with pytest.raises(ValueError, match=r"argument 'x\[1\]': is on"):
        mxmla.quantize_attention((a[..., :8], torch.zeros(2, 8, 2, 24, dtype=torch.bfloat16)), "bshd")


# ----------------------------------------------------------------------------- linear_backward
def lin_case(T, h, nope, v, K, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    dk = torch.randn(T, h, nope + 64, generator=g).to(torch.bfloat16).to(device)
    dv = torch.randn(T, h, v, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(h * (nope + v), K, generator=g).to(torch.bfloat16).to(device)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).to(device)
    w8 = mxmla.quantize(w)
    _, x8 = mxmla.linear_forward(x, w8)
    return dk, dv, w8, x8


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("T,h", [(45, 3), (1, 1), (100, 2)])
def test_linear_backward_pair_equals_the_concatenation(device, T, h):
    dk, dv, w8, x8 = lin_case(T, h, 128, 128, 64, device)
    dy = torch.cat([dk[..., :128], dv], -1).flatten(-2)
    dx1, dw1 = mxmla.linear_backward((dk[..., :128], dv), w8, x8)
    dx2, dw2 = mxmla.linear_backward(dy, w8, x8)
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)
    # main_grad and need_dx=False
    m1, m2 = torch.ones_like(dw1), torch.ones_like(dw1)
    dx1, none1 = mxmla.linear_backward((dk[..., :128], dv), w8, x8, main_grad=m1, need_dx=False)
    mxmla.linear_backward(dy, w8, x8, main_grad=m2, need_dx=False)
    assert dx1 is None and none1 is None and torch.equal(m1, m2)


def test_linear_backward_pair_numpy():
    dk, dv, w8, x8 = lin_case(33, 2, 32, 32, 32, "cpu")
    bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    w8n = mxmla.MXFP8Tensor(w8.shape, "e4m3", "compact", *(None if getattr(w8, n) is None else getattr(w8, n).numpy() for n in NAMES))
    x8n = mxmla.MXFP8Tensor(x8.shape, "e4m3", "compact", *(None if getattr(x8, n) is None else getattr(x8, n).numpy() for n in NAMES))
    dx1, dw1 = mxmla.linear_backward((bits(dk)[..., :32], bits(dv)), w8n, x8n)
    dx2, dw2 = mxmla.linear_backward(np.concatenate([bits(dk)[..., :32], bits(dv)], -1).reshape(33, -1), w8n, x8n)
    np.testing.assert_array_equal(dx1, dx2)
    np.testing.assert_array_equal(dw1, dw2)


@pytest.mark.parametrize(
    "dy,match",
    [
        (lambda dk, dv: (dk[..., :128].float(), dv.float()), r"argument 'dy\[0\]': dtype float32 must be bfloat16"),
        (lambda dk, dv: (dk[..., :100], dv[..., :60]), r"argument 'dy\[0\]': last dimension 100 must be a multiple of 8"),
        (lambda dk, dv: (dk[..., :128], dv[:4]), r"argument 'dy\[1\]': shape .* must match"),
        (lambda dk, dv: (dk[..., :128], dv[..., :96]), r"argument 'w': shape \[512, 64\] must be \[N, K\] with N = 448"),
        (lambda dk, dv: (dk[..., :128].flatten(-2), dv.flatten(-2)), r"argument 'dy\[0\]': must be 3-D"),
    ],
)
def test_linear_backward_pair_errors(dy, match):
    dk, dv, w8, x8 = lin_case(8, 2, 128, 128, 64, "cpu")
    with pytest.raises((ValueError, TypeError), match=match):
        mxmla.linear_backward(dy(dk, dv), w8, x8)


# ----------------------------------------------------------------------------- mxmla.nn.MLA
def mla_grads(m, x, layout, composed, cu=None):
    """Output, dx and every parameter's gradient of m (composed: the composition attention_from_latent
    replaces, written with the kv_b Linear, torch.cat and attention_from_mxfp8_q; cu: thd's cu_seqlens)."""
    from mxmla.nn.qproj import attention_from_mxfp8_q

    def old(xi):
        H = m.local_heads
        q8, anchor = m._fused_q(m.q_norm(m.wq_a(xi)), layout, cu)
        kv, k_pe = m.wkv_a(xi).split([m.kv_lora_rank, m.rope_dim], -1)
        k_pe = m._rope(k_pe.unsqueeze(-2).contiguous(), layout, cu)
        kv = m.wkv_b(m.kv_norm(kv)).unflatten(-1, (H, m.nope_dim + m.v_dim))
        k_nope, v = kv.split([m.nope_dim, m.v_dim], -1)
        k = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], m.rope_dim)], -1)
        return m.wo(attention_from_mxfp8_q(q8, anchor, k, v, causal=True, softmax_scale=m.softmax_scale,
                                           cu_seqlens=cu).flatten(-2))

    m.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    o = old(xi) if composed else m(xi, cu_seqlens=cu)
    o.float().square().mean().backward()
    return o.detach(), xi.grad, {n: (p.grad, getattr(p, "main_grad", None)) for n, p in m.named_parameters()}


# On CUDA dQ's fp32 partial sums are added in scheduling order (attention_backward's default), so what
# dQ reaches — dx and the query path's parameters — may differ in its last bits from run to run: those
# are compared within 1e-2 relative RMS there, everything else bit for bit.
VIA_DQ = ("wq_a.weight", "q_norm.weight", "wq_b.weight")


def close_or_equal(a, b, exact, what):
    if exact:
        assert torch.equal(a, b), what
    else:
        a, b = a.double(), b.double()
        assert float((a - b).norm()) <= 1e-2 * float(b.norm()), what


def assert_same_step(a, b, dq_exact=True):
    assert torch.equal(a[0], b[0])
    close_or_equal(a[1], b[1], dq_exact, "dx")
    for n, (g, mg) in a[2].items():
        g2, mg2 = b[2][n]
        exact = dq_exact or n not in VIA_DQ
        assert (g is None) == (g2 is None) and (g is None or close_or_equal(g, g2, exact, n) is None), n
        assert (mg is None) == (mg2 is None) and (mg is None or close_or_equal(mg, mg2, exact, n) is None), n


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
def test_mla_mxfp8_path_is_the_concatenation_composition_bit_for_bit(device, layout):
    """thd: packed sequences of unequal lengths (an empty one among them), the same tokens as bshd's."""
    import mxmla.nn as mnn

    if device == "cpu":
        kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32)
        shape = (2, 40, 64)
    else:  # DeepSeek-V3's head dims (the SM90 attention kernels' shapes), fewer heads and tokens
        kw = dict(hidden=256, heads=4, q_lora_rank=128, kv_lora_rank=64, nope_dim=128, rope_dim=64, v_dim=128)
        shape = (2, 300, 256)
    m = mnn.MLA(**kw, max_seq_len=512, layout=layout, seed=7, recipe="mxfp8", device=device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(torch.bfloat16)
    cu = None
    if layout == "thd":
        T = shape[0] * shape[1]
        x, cu = x.reshape(-1, shape[-1]), [0, 29, 29, T // 2 + 7, T]
    x = (x if layout != "sbhd" else x.transpose(0, 1).contiguous()).to(device)
    exact = device == "cpu"
    assert_same_step(mla_grads(m, x, layout, False, cu), mla_grads(m, x, layout, True, cu), exact)
    # Megatron's main_grad on kv_b's weight: the wgrad is added into it, no .grad
    w = m.wkv_b.weight
    w.main_grad = torch.full_like(w, 0.5, dtype=torch.float32)
    a = mla_grads(m, x, layout, False, cu)
    mg_a = w.main_grad.clone()
    w.main_grad.fill_(0.5)
    b = mla_grads(m, x, layout, True, cu)
    assert a[2]["wkv_b.weight"][0] is None and torch.equal(mg_a, w.main_grad)
    assert_same_step(a, b, exact)


def test_pairs_trace_with_torch_compile():
    """The pair forms are custom ops with fake implementations: torch.compile traces them fullgraph."""
    kv, pe, kn, pex, v = kv_parts(1, 33, 2)

    def f(kv, pe):
        k8 = mxmla.quantize_attention((kv[..., :128], pe.expand(1, 33, 2, 64)), "bshd")
        return k8.rowwise_data, k8.columnwise_scale_inv

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(kv, pe)
    ref = mxmla.quantize_attention(torch.cat([kn, pex], -1), "bshd")
    assert torch.equal(got[0], ref.rowwise_data) and torch.equal(got[1], ref.columnwise_scale_inv)
    dk, dv, w8, x8 = lin_case(33, 2, 128, 128, 64, "cpu")

    def g(dk, dv):
        return mxmla.linear_backward((dk[..., :128], dv), w8, x8)

    dx, dw = torch.compile(g, fullgraph=True, backend="aot_eager")(dk, dv)
    dx0, dw0 = mxmla.linear_backward(torch.cat([dk[..., :128], dv], -1).flatten(-2), w8, x8)
    assert torch.equal(dx, dx0) and torch.equal(dw, dw0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_attention_autograd_reads_packed_qkv_views_in_place(device):
    """MXFP8Attention on q, k, v that are views of one packed [s, b, 3, h, d] tensor (TransformerEngine's
    sb3hd): the same output and gradients as on contiguous copies (the views are quantized in place)."""
    from mxmla.attention_autograd import MXFP8Attention

    s, b, h, d = 70, 2, 2, 128
    g = torch.Generator().manual_seed(3)
    packed = torch.randn(s, b, 3, h, d, generator=g).to(torch.bfloat16).to(device)
    do = torch.randn(s, b, h, d, generator=g).to(torch.bfloat16).to(device)
    outs = []
    for views in (True, False):
        x = packed.clone().requires_grad_()
        q, k, v = (x[:, :, i] if views else x[:, :, i].contiguous() for i in range(3))
        # (deterministic=True: dQ's fp32 parts are added in a fixed order on CUDA too)
        o = MXFP8Attention.apply(q, k, v, True, None, "sbhd", None, None, None, None, "e4m3", False, True)
        o.backward(do)
        outs.append((o.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
