"""The fused Q up-projection (issue 4) through Python: the numpy path (CPU reference) against an
independent numpy composition (float64 GEMM -> bf16 -> the fp32 RoPE term -> quantize_attention),
the class and custom-op front ends, torch.compile tracing through the fake implementation, the
CUDA kernel bit for bit against the numpy path (integer-valued inputs), and errors."""
import numpy as np
import pytest

import mxmla

try:
    import torch
except ImportError:  # torch is optional: its tests skip
    torch = None

STYLES = ["interleaved_in_halves_out", "interleaved", "rotate_half"]
HAVE_GPU = torch is not None and torch.cuda.is_available() and mxmla.info()["cuda_enabled"]


def bf16_bits(a):
    """float32 -> bf16 bits, round to nearest even (inputs here are finite)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def inputs(T, heads, K, seed=0, integer=True):
    rng = np.random.default_rng(seed)
    if integer:
        x, w = rng.integers(-4, 5, (T, K)), rng.integers(-4, 5, (heads * 192, K))
    else:
        x, w = rng.standard_normal((T, K)), rng.standard_normal((heads * 192, K)) / np.sqrt(K)
    return bf16_bits(x), bf16_bits(w)


def rope_fp32(x, c, s, style):
    """The fp32 term of include/mxmla/rope.h, fmaf(sign s, x_b, fp32(c x_a)), with the fma done exactly in
    float64 (an fp32 product is exact there) and one rounding to float32."""
    R = x.shape[-1]
    h = R // 2
    j = np.arange(R)
    if style == "interleaved_in_halves_out":
        a = np.where(j < h, 2 * j, 2 * (j - h) + 1)
        b = np.where(j < h, 2 * j + 1, 2 * (j - h))
        sign = np.where(j < h, -1.0, 1.0)
    elif style == "interleaved":
        a, b, sign = j, j ^ 1, np.where(j % 2 == 0, -1.0, 1.0)
    else:
        a, b, sign = j, np.where(j < h, j + h, j - h), np.where(j < h, -1.0, 1.0)
    prod = (c * x[..., a]).astype(np.float32)  # c, x float32: the product rounded to fp32
    return (sign * s.astype(np.float64) * x[..., b].astype(np.float64) + prod.astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("style", STYLES)
def test_numpy_matches_independent_composition(style):
    T, H, K = 45, 2, 40
    x, w = inputs(T, H, K, seed=1, integer=False)
    c, s = mxmla.rope_tables(mxmla.positions_arange(T), 64, yarn="deepseek_v3", style=style)
    q, qb = mxmla.fused_q_uproj_rope_quant(x, w, c, s, style=style, return_q=True)
    # q = bf16(x W^T), then RoPE in fp32 on the last 64 of each head
    acc = bf16_value(x).astype(np.float64) @ bf16_value(w).astype(np.float64).T
    qh = bf16_value(bf16_bits(acc.astype(np.float32))).reshape(T, 1, H, 192)
    want = qh.copy()
    want[..., 128:] = rope_fp32(qh[..., 128:], c[:, None, None, :], s[:, None, None, :], style)
    np.testing.assert_array_equal(qb, bf16_bits(want))
    ref = mxmla.quantize_attention(want, layout="sbhd", bhsd_scales=False)
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(q, name), getattr(ref, name), err_msg=name)
    assert q.shape == (T, 1, H, 192) and q.rowwise_scale_inv.shape == (T * H, 6)
    assert q.columnwise_scale_inv.shape == (2, H * 192)


def test_bshd_batch_and_bhsd_scales_match_quantize_attention():
    S, B, H, K = 40, 3, 2, 32
    x, w = inputs(S * B, H, K, seed=2)
    c, s = mxmla.rope_tables(mxmla.positions_arange(S), 64)
    q, qb = mxmla.fused_q_uproj_rope_quant(x, w, c, s, layout="bshd", batch=B, bhsd_scales=True, return_q=True)
    assert q.shape == (B, S, H, 192) and q.scale_layout == "bhsd"
    # integer inputs with small sums: q after RoPE is what quantize_attention must see (fp32)
    acc = bf16_value(x).astype(np.float64) @ bf16_value(w).astype(np.float64).T
    qh = bf16_value(bf16_bits(acc.astype(np.float32))).reshape(B, S, H, 192)
    want = qh.copy()
    want[..., 128:] = rope_fp32(qh[..., 128:], c[None, :, None, :], s[None, :, None, :], "interleaved_in_halves_out")
    ref = mxmla.quantize_attention(want, layout="bshd", bhsd_scales=True)
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(q, name), getattr(ref, name), err_msg=name)


def test_class_front_end_and_saved_activation():
    s_len, b, H, K = 32, 2, 1, 64
    x, w = inputs(s_len * b, H, K, seed=3)
    c, s = mxmla.rope_tables(mxmla.positions_arange(s_len), 64)
    op = mxmla.FusedMLAQUpProjRopeQuant()
    assert isinstance(op.is_supported(), bool)
    q, saved = op.run(x.reshape(s_len, b, K), w, c, s, s_len, b)
    assert saved.shape == (s_len * b, K)
    ref = mxmla.fused_q_uproj_rope_quant(x, w, c, s, batch=b)
    np.testing.assert_array_equal(q.rowwise_data, ref.rowwise_data)
    with pytest.raises(ValueError, match="tokens"):
        op.run(x, w, c, s, s_len + 1, b)


def test_weight_layout_kn_equals_nk():
    T, H, K = 33, 2, 48
    x, w = inputs(T, H, K, seed=6)
    c, s = mxmla.rope_tables(mxmla.positions_arange(T), 64)
    a = mxmla.fused_q_uproj_rope_quant(x, w, c, s)
    b = mxmla.fused_q_uproj_rope_quant(x, np.ascontiguousarray(w.T), c, s, weight_layout="kn")
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_errors_name_the_argument():
    x, w = inputs(32, 1, 64)
    c, s = mxmla.rope_tables(mxmla.positions_arange(32), 64)
    with pytest.raises(ValueError, match="'style'"):
        mxmla.fused_q_uproj_rope_quant(x, w, c, s, style="nope")
    with pytest.raises(ValueError, match="'layout'"):
        mxmla.fused_q_uproj_rope_quant(x, w, c, s, layout="thd")
    with pytest.raises(ValueError, match="argument 'w'.*does not match K"):
        mxmla.fused_q_uproj_rope_quant(x, w[:, :32], c, s)
    with pytest.raises(ValueError, match="argument 'cos'.*positions are needed"):
        mxmla.fused_q_uproj_rope_quant(x, w, c[:16], s[:16])
    with pytest.raises(ValueError, match="argument 'x'.*batch"):
        mxmla.fused_q_uproj_rope_quant(x, w, c, s, batch=3)
    with pytest.raises(ValueError, match="weight_layout"):
        mxmla.fused_q_uproj_rope_quant(x, w, c, s, weight_layout="xx")


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_custom_op_traces_under_compile():
    op = torch.ops.mxmla.fused_q_uproj_rope_quant  # registered on import mxmla (register_torch_op() is deprecated)
    T, H, K = 64, 1, 64
    xn, wn = inputs(T, H, K, seed=4)
    x = torch.from_numpy(xn.astype(np.int16)).view(torch.bfloat16)
    w = torch.from_numpy(wn.astype(np.int16)).view(torch.bfloat16)
    c, s = mxmla.rope_tables(mxmla.positions_arange(T), 64)
    c, s = torch.from_numpy(c), torch.from_numpy(s)

    def f(x, w, c, s):
        return op(x, w, c, s, 128, 64, "interleaved_in_halves_out", "sbhd", 1, "e4m3", False)

    eager = f(x, w, c, s)
    compiled = torch.compile(f, fullgraph=True, backend="eager")(x, w, c, s)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    ref = mxmla.fused_q_uproj_rope_quant(xn, wn, c.numpy(), s.numpy())
    np.testing.assert_array_equal(eager[0].numpy(), ref.rowwise_data)


@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU comparison skipped")
def test_cuda_kn_weight_with_more_k_tiles_than_a_grid_dimension():
    """W given as [K, N] is transposed first by a pass that walks K in 32-row tiles, at most 65 535 of
    them on a grid dimension: K = 2^21 + 96 takes 65 539 (before, the launch failed). x and W are zero
    but for six rows of K spread over the range (the first, the last, some past 2^21) of small integers,
    so every fp32 sum is exact and equals the CPU reference's on those six rows alone: bit for bit."""
    T, H, K = 8, 1, 2**21 + 96
    rows = np.array([0, 1, 777, 2**20 + 5, 2**21 + 3, K - 1])
    xs, ws = inputs(T, H, len(rows), seed=9)  # x [T, 6], W [192, 6]
    c, s = mxmla.rope_tables(mxmla.positions_arange(T), 64)
    ref, qref = mxmla.fused_q_uproj_rope_quant(xs, ws, c, s, return_q=True)
    dev = torch.device("cuda")
    x = torch.zeros(T, K, dtype=torch.int16, device=dev)
    w = torch.zeros(K, H * 192, dtype=torch.int16, device=dev)  # [K, N]
    idx = torch.from_numpy(rows).to(dev)
    x[:, idx] = torch.from_numpy(xs.astype(np.int16)).to(dev)
    w[idx, :] = torch.from_numpy(np.ascontiguousarray(ws.T).astype(np.int16)).to(dev)
    q, qb = mxmla.fused_q_uproj_rope_quant(x.view(torch.bfloat16), w.view(torch.bfloat16), torch.from_numpy(c).to(dev),
                                           torch.from_numpy(s).to(dev), weight_layout="kn", return_q=True)
    torch.cuda.synchronize()
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(q, name).cpu().numpy(), getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(qb.cpu().view(torch.int16).numpy().astype(np.uint16), qref)


@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU comparison skipped")
@pytest.mark.parametrize("style", STYLES)
def test_cuda_matches_numpy_bit_exact(style):
    T, H, K = 97, 3, 96
    xn, wn = inputs(T, H, K, seed=5)
    c, s = mxmla.rope_tables(mxmla.positions_arange(T), 64, style=style)
    ref, qref = mxmla.fused_q_uproj_rope_quant(xn, wn, c, s, style=style, return_q=True)
    dev = torch.device("cuda")
    x = torch.from_numpy(xn.astype(np.int16)).view(torch.bfloat16).to(dev)
    w = torch.from_numpy(wn.astype(np.int16)).view(torch.bfloat16).to(dev)
    q, qb = mxmla.fused_q_uproj_rope_quant(x, w, torch.from_numpy(c).to(dev), torch.from_numpy(s).to(dev),
                                           style=style, return_q=True)
    torch.cuda.synchronize()
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(q, name).cpu().numpy(), getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(qb.cpu().view(torch.int16).numpy().astype(np.uint16), qref)
