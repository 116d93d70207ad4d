"""mxmla.rope_linear_backward: the backward GEMMs of a Linear whose output went through RoPE (the fused Q
up-projection's backward from attention's dQ) give the bits of rope_backward_quantize + gemm — on the CPU
(numpy, torch), and on a GPU against the unfused CUDA calls, whose GEMM kernels are the same: the fast
path (bf16 DeepSeek-V3 query heads, d 192 / rope 64, at one token stride) whose RoPE pass writes the
GEMMs' bf16 copies, and the other shapes (the codes and the GEMMs' own passes); layouts, packed
sequences, tails of T, one head, strided dq, fp32 and bf16 tables, main_grad, blocks that bf16 cannot
hold exactly (the FP8 fallback), forced GEMM designs; errors; custom ops, fakes and torch.compile."""
import numpy as np
import pytest

import mxmla

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

HAVE_GPU = torch.cuda.is_available() and bool(mxmla.info()["gpus"]) and mxmla.info()["cuda_enabled"]
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU test skipped")


def same(a, b):
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype]))


def bf16(shape, seed, dev="cpu", spread=3):
    """N(0, 1) values times a power of two per leading index (blocks with different scales), bf16."""
    g = np.random.default_rng(seed)
    v = g.standard_normal(shape) * np.exp2(g.integers(-spread, spread + 1, (shape[0],) + (1,) * (len(shape) - 1)))
    return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16).to(dev)


def dq_shape(layout, S, B, H, D):
    return {"sbhd": (S, B, H, D), "bshd": (B, S, H, D), "thd": (S * B, H, D)}[layout]


def case(layout, S, B, H, D, R, K, dev, seed=0, table_dtype=torch.float32):
    """dq, cos, sin, W's and x's MXFP8 copies, the call's keywords."""
    dq = bf16(dq_shape(layout, S, B, H, D), seed, dev)
    cos, sin = mxmla.rope_tables(torch.arange(max(S * B, 1)), R, style="interleaved")
    cos, sin = cos.to(dev, table_dtype), sin.to(dev, table_dtype)
    T = S * B
    w8 = mxmla.quantize(bf16((H * D, K), seed + 1, dev))
    x8 = mxmla.quantize(bf16((T, K), seed + 2, dev), rowwise=False)
    return dq, cos, sin, w8, x8, dict(style="interleaved", layout=layout, rope_dim=R)


def composed(dq, cos, sin, w8, x8, kw, main_grad=None):
    """What the fused call must equal: rope_backward_quantize + gemm."""
    d8 = mxmla.rope_backward_quantize(dq, cos, sin, **kw)
    dx = mxmla.gemm(d8, w8, trans_b=False)
    if main_grad is not None:
        mxmla.gemm(d8, x8, trans_a=True, trans_b=False, out=main_grad, accumulate=True)
        return dx, main_grad
    return dx, mxmla.gemm(d8, x8, trans_a=True, trans_b=False, out_dtype="float32")


def check(dq, cos, sin, w8, x8, kw):
    dx0, dw0 = composed(dq, cos, sin, w8, x8, kw)
    dx, dw = mxmla.rope_linear_backward(dq, cos, sin, w8, x8, **kw)
    assert same(dx, dx0) and same(dw, dw0)
    N, K = w8.shape
    mg0 = torch.full((N, K), 0.25, device=dq.device)
    composed(dq, cos, sin, w8, x8, kw, mg0)
    mg = torch.full((N, K), 0.25, device=dq.device)
    dx2, dw2 = mxmla.rope_linear_backward(dq, cos, sin, w8, x8, main_grad=mg, need_dx=False, **kw)
    assert dx2 is None and dw2 is None and same(mg, mg0)


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("H,D,R", [(2, 192, 64), (3, 64, 32)])
@pytest.mark.parametrize("S", [1, 31, 33])
def test_cpu_equals_rope_backward_quantize_and_gemm(layout, H, D, R, S):
    check(*case(layout, S, 2, H, D, R, 64, "cpu", seed=S + H))


def test_cpu_packed_sequences_tables_per_token_and_numpy():
    dq, cos, sin, w8, x8, kw = case("thd", 50, 1, 2, 192, 64, 32, "cpu", seed=3)
    check(dq, cos, sin, w8, x8, dict(kw, cu_seqlens=[0, 17, 17, 50]))  # an empty sequence among them
    check(dq, cos[:50], sin[:50], w8, x8, dict(kw, tables_per_token=True))
    g = np.random.default_rng(4)
    dqn = g.integers(-8, 8, (40, 2, 2, 64)).astype(np.float32)
    cn, sn = mxmla.rope_tables(np.arange(40), 32, style="interleaved")
    wn = mxmla.quantize(g.standard_normal((128, 32)).astype(np.float32))
    xn = mxmla.quantize(g.standard_normal((80, 32)).astype(np.float32))
    kw = dict(style="interleaved", layout="sbhd", rope_dim=32)
    dx, dw = mxmla.rope_linear_backward(dqn, cn, sn, wn, xn, **kw)
    dx0, dw0 = composed(dqn, cn, sn, wn, xn, kw)
    assert isinstance(dx, np.ndarray) and np.array_equal(dx.view(np.uint16), dx0.view(np.uint16))
    assert np.array_equal(dw.view(np.uint32), dw0.view(np.uint32))


@needs_gpu
@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("S,B,H", [(1, 1, 1), (31, 2, 3), (33, 1, 16), (100, 3, 2), (2049, 2, 4)])
def test_cuda_fast_path_equals_the_unfused_calls(layout, S, B, H):
    """DeepSeek-V3 query heads (192 / 64): the RoPE pass writes the GEMMs' bf16 copies."""
    check(*case(layout, S, B, H, 192, 64, 128, "cuda", seed=S + H))


@needs_gpu
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_cuda_tables_packed_sequences_and_strided_dq(table_dtype):
    dq, cos, sin, w8, x8, kw = case("thd", 300, 1, 4, 192, 64, 64, "cuda", seed=7, table_dtype=table_dtype)
    check(dq, cos, sin, w8, x8, dict(kw, cu_seqlens=[0, 100, 100, 229, 300]))
    check(dq, cos, sin, w8, x8, dict(kw, tables_per_token=True))
    # heads inside wider rows (one token stride: the fast path), and tokens at two strides (the other path)
    wide = bf16((300, 5, 256), 8, "cuda")[:, :4, :192]
    check(wide, cos, sin, w8, x8, kw)
    sb = bf16((150, 3, 4, 192), 9, "cuda")[:, :2]  # sbhd [150, 2, 4, 192] whose batch stride is not s's / b
    check(sb, cos, sin, w8, x8, dict(kw, layout="sbhd"))


@needs_gpu
@pytest.mark.parametrize("H,D,R", [(2, 64, 32), (3, 128, 64), (2, 192, 32)])
def test_cuda_other_shapes_take_the_codes(H, D, R):
    check(*case("sbhd", 45, 2, H, D, R, 64, "cuda", seed=H + D))
    dq, cos, sin, w8, x8, kw = case("sbhd", 45, 2, 2, 192, 64, 64, "cuda", seed=11)
    check(dq.float(), cos, sin, w8, x8, kw)  # fp32 dq


def _amax(v, amax, dim):
    v = v.float()
    return (v / v.abs().amax(dim=dim, keepdim=True) * amax).to(torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("which", ["rows", "column", "rope_column", "w_column", "x_column"])
def test_cuda_blocks_bf16_cannot_hold_take_the_fp8_path(which):
    """dq's tokens 0-2 of head 1 with a largest magnitude of 2^-117 (rowwise scale bytes 1-2: the smallest
    codes times their factors lie below bf16's subnormals, so a bf16 copy cannot hold them), or one nope
    or rope column of a head through all tokens likewise (columnwise blocks only): the bits of the
    unfused calls, which take the FP8 path by their own check. w_column / x_column: dq exact, and only
    the other operand of one GEMM is not (W's column 7 through all rows: dgrad's columnwise W; x's
    column 9 through all tokens: wgrad's x): the GEMM's own check picks the FP8 path, which reads dQ''s
    codes too."""
    dq, cos, sin, w8, x8, kw = case("sbhd", 64, 1, 2, 192, 64, 64, "cuda", seed=13)
    w = _amax(bf16((384, 64), 14, "cuda"), 1024.0, -1)
    x = (bf16((64, 64), 15, "cuda").float() * 512).bfloat16()
    if which == "w_column":
        w[:, 7] = _amax(w[:, 7][None], 2.0 ** -117, -1)[0]
    if which == "x_column":
        x[:, 9] = _amax(x[:, 9][None], 2.0 ** -117, -1)[0]
    w8, x8 = mxmla.quantize(w), mxmla.quantize(x, rowwise=False)
    if which in ("w_column", "x_column"):
        small = (w8.columnwise_scale_inv.int() < 10).any(), (x8.columnwise_scale_inv.int() < 10).any()
        assert small == ((True, False) if which == "w_column" else (False, True))
        assert not (w8.rowwise_scale_inv.int() < 10).any()
    elif which == "rows":
        dq[:3, :, 1] = _amax(dq[:3, :, 1], 2.0 ** -117, -1)
    else:  # a nope column, or a rope pair (the interleaved style rotates columns 150 and 151 together)
        c = slice(5, 6) if which == "column" else slice(150, 152)
        part = dq[:, :, 0, c]
        dq[:, :, 0, c] = _amax(part.reshape(1, -1), 2.0 ** -117, -1).reshape(part.shape)
    d8 = mxmla.rope_backward_quantize(dq, cos, sin, **kw)
    row_small, col_small = (d8.rowwise_scale_inv.int() < 10).any(), (d8.columnwise_scale_inv.int() < 10).any()
    want = {"rows": (True, False), "w_column": (False, False), "x_column": (False, False)}.get(which, (False, True))
    assert (row_small, col_small) == want
    check(dq, cos, sin, w8, x8, kw)


@needs_gpu
@pytest.mark.parametrize("design", ["A", "B", "C", "D"])
def test_cuda_forced_designs(design, monkeypatch):
    monkeypatch.setenv("MXMLA_GEMM_DESIGN", design)
    check(*case("bshd", 65, 2, 2, 192, 64, 64, "cuda", seed=17))


def test_errors():
    dq, cos, sin, w8, x8, kw = case("sbhd", 8, 1, 2, 64, 32, 32, "cpu")
    with pytest.raises(ValueError, match=r"rope_linear_backward: argument 'dq': must be 4-D"):
        mxmla.rope_linear_backward(dq[0], cos, sin, w8, x8, **kw)
    with pytest.raises(ValueError, match=r"argument 'w': shape \[8, 32\] must be \[N, K\] with N = 128 \(h·d of dq\)"):
        mxmla.rope_linear_backward(dq, cos, sin, mxmla.quantize(bf16((8, 32), 1)), x8, **kw)
    with pytest.raises(ValueError, match=r"argument 'x_saved': shape \[9, 32\] must be \[T, K\] = \[8, 32\]"):
        mxmla.rope_linear_backward(dq, cos, sin, w8, mxmla.quantize(bf16((9, 32), 1)), **kw)
    with pytest.raises(ValueError, match=r"argument 'w.columnwise_data': is absent"):
        mxmla.rope_linear_backward(dq, cos, sin, mxmla.quantize(bf16((128, 32), 1), columnwise=False), x8, **kw)
    with pytest.raises(ValueError, match=r"argument 'cos': has 4 rows; 8 positions are needed"):
        mxmla.rope_linear_backward(dq, cos[:4], sin[:4], w8, x8, **kw)
    with pytest.raises(ValueError, match=r"argument 'dq': head dimension 48 must be a multiple of 32"):
        mxmla.rope_linear_backward(bf16((8, 1, 2, 48), 0), cos, sin, mxmla.quantize(bf16((96, 32), 1)), x8, **kw)
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens': is only for the thd layout"):
        mxmla.rope_linear_backward(dq, cos, sin, w8, x8, cu_seqlens=[0, 8], **kw)
    with pytest.raises(RuntimeError, match=r"rope_linear_backward: argument 'dq': requires grad"):
        mxmla.rope_linear_backward(dq.float().requires_grad_(), cos, sin, w8, x8, **kw)


def test_custom_ops_fakes_and_compile():
    for name in ("rope_linear_backward", "rope_linear_backward_acc"):
        assert isinstance(getattr(torch.ops.mxmla, name).default, torch._ops.OpOverload)
    dq, cos, sin, w8, x8, kw = case("bshd", 33, 2, 2, 64, 32, 64, "cpu", seed=21)

    def step(dq, mg):
        dx, dw = mxmla.rope_linear_backward(dq, cos, sin, w8, x8, **kw)
        mxmla.rope_linear_backward(dq, cos, sin, w8, x8, main_grad=mg, need_dx=False, **kw)
        return dx, dw, mg

    eager = step(dq, torch.zeros(128, 64))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(dq, torch.zeros(128, 64))
    for e, c in zip(eager, compiled):
        assert same(e, c)
