"""The MXFP8 Linear's GEMMs with fused quantization (mxmla.linear_forward / linear_backward): the bits of
quantize + gemm on the CPU (numpy, torch) and on a GPU (the fused CUDA path against the unfused CUDA
calls, whose kernels are the same: bit for bit; tails of T, strided x, main_grad); blocks that bf16
cannot hold exactly (the FP8 fallback, checked against the CPU reference where a rounded bf16 copy
would be far off); the GEMM design forced by MXMLA_GEMM_DESIGN; errors; custom ops, fakes and
torch.compile; MXFP8LinearFunction through them."""
import numpy as np
import pytest

import mxmla

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

HAVE_GPU = torch.cuda.is_available() and bool(mxmla.info()["gpus"]) and mxmla.info()["cuda_enabled"]
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU test skipped")


def data(shape, seed, dev="cpu"):
    """N(0, 1) rows times a power of two each (blocks with different scales), bf16."""
    g = np.random.default_rng(seed)
    v = g.standard_normal(shape) * np.exp2(g.integers(-3, 4, (shape[0], 1)))
    return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16).to(dev)


def same(a, b):
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.uint8: torch.uint8}
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype]))


def composed(x, w8, dy, main_grad=None):
    """What the fused calls must equal: quantize + gemm."""
    x8, dy8 = mxmla.quantize(x), mxmla.quantize(dy)
    y = mxmla.gemm(x8, w8)
    dx = mxmla.gemm(dy8, w8, trans_b=False)
    if main_grad is not None:
        mxmla.gemm(dy8, x8, trans_a=True, trans_b=False, out=main_grad, accumulate=True)
        return y, x8, dx, main_grad
    return y, x8, dx, mxmla.gemm(dy8, x8, trans_a=True, trans_b=False, out_dtype="float32")


def check_against_composition(T, K, N, dev, seed=0, strided=False):
    x, w, dy = data((T, K), seed, dev), data((N, K), seed + 1, dev), data((T, N), seed + 2, dev)
    if strided:  # rows of x and dy inside wider buffers
        x = torch.cat([x, data((T, 32), seed + 3, dev)], 1)[:, :K]
        dy = torch.cat([dy, data((T, 64), seed + 4, dev)], 1)[:, :N]
    w8 = mxmla.quantize(w)
    y0, x8, dx0, dw0 = composed(x, w8, dy)
    y, xs = mxmla.linear_forward(x, w8)
    assert same(y, y0), (T, K, N)
    assert xs.rowwise_data is None and xs.shape == (T, K) and xs.fp8_format == "e4m3"
    assert same(xs.columnwise_data, x8.columnwise_data) and same(xs.columnwise_scale_inv, x8.columnwise_scale_inv)
    dx, dw = mxmla.linear_backward(dy, w8, xs)
    assert same(dx, dx0) and same(dw, dw0), (T, K, N)
    mg0 = torch.full((N, K), 0.25, device=dev)
    composed(x, w8, dy, mg0)
    mg = torch.full((N, K), 0.25, device=dev)
    dx2, dw2 = mxmla.linear_backward(dy, w8, xs, main_grad=mg, need_dx=False)
    assert dx2 is None and dw2 is None and same(mg, mg0)


@pytest.mark.parametrize("T", [1, 31, 33, 100])
def test_cpu_equals_quantize_and_gemm(T):
    check_against_composition(T, 64, 96, "cpu", seed=T)


def test_cpu_strided_inputs_and_numpy():
    check_against_composition(40, 64, 32, "cpu", strided=True)
    x, w = data((40, 64), 7), data((32, 64), 8)
    xn = x.view(torch.int16).numpy().view(np.uint16).view(ml_dtypes.bfloat16)
    wn = mxmla.quantize(w.view(torch.int16).numpy().view(np.uint16).view(ml_dtypes.bfloat16))
    y, xs = mxmla.linear_forward(xn, wn)
    want = mxmla.gemm(mxmla.quantize(xn), wn)
    assert isinstance(y, np.ndarray) and np.array_equal(y.view(np.uint16), want.view(np.uint16))
    assert isinstance(xs.columnwise_data, np.ndarray)


@needs_gpu
@pytest.mark.parametrize("T,K,N", [(1, 64, 96), (31, 64, 96), (33, 512, 32), (100, 96, 256), (257, 1536, 576),
                                   (4097, 512, 1024)])
def test_cuda_equals_quantize_and_gemm(T, K, N):
    """The fused CUDA path against the unfused CUDA calls (the same GEMM kernels, K splits included):
    bit for bit, every output."""
    check_against_composition(T, K, N, "cuda", seed=T + K)


@needs_gpu
def test_cuda_strided_inputs():
    check_against_composition(70, 128, 64, "cuda", strided=True)


def _reference(x, w, dy):
    """The CPU composition on the same bf16 values (float64 sums, rounded once)."""
    return [t for t in composed(x.cpu(), mxmla.quantize(w.cpu()), dy.cpu())]


def _rows_close(got, want, rows):
    """Each listed row within 2^-7 of its own largest value (design B's 14-bit block sums and a bf16
    output's rounding lie far inside; rows lost to underflow or flushed to zero do not)."""
    got, want = got.float().cpu(), want.float().cpu()
    for r in rows:
        scale = want[r].abs().max().item()
        assert scale > 0 and (got[r] - want[r]).abs().max().item() <= 2.0 ** -7 * scale, r


def _amax_rows(v, amax):
    """Rows of v scaled to a largest magnitude of exactly `amax` (a power of two)."""
    v = v.float()
    return (v / v.abs().amax(dim=-1, keepdim=True) * amax).to(torch.bfloat16)


@needs_gpu
def test_cuda_blocks_bf16_cannot_hold_take_the_fp8_path():
    """x's rows 0-2 with a largest magnitude of 2^-117 (rowwise scale bytes 1-2: the smallest codes
    times their factors lie below bf16's subnormals, so a bf16 copy cannot hold them) and dy's column 5
    likewise through all tokens (columnwise blocks only; its rowwise blocks stay exact): the fused calls
    give the bits of the unfused ones (which take design B by their own check) and the CPU reference's
    values on those rows. Design B multiplies a block pair's two factors in fp32, so the other
    operands are large enough for the pair's scale bytes to sum to 128 or more (W's rows at 1024, x at
    512 times the usual size)."""
    T, K, N = 96, 64, 64
    x, dy = (data((T, K), 1, "cuda").float() * 512).bfloat16(), data((T, N), 3, "cuda")
    w = _amax_rows(data((N, K), 2, "cuda"), 1024.0)
    x[:3] = _amax_rows(x[:3], 2.0 ** -117)
    dy[:, 5] = _amax_rows(dy[:, 5][None], 2.0 ** -117)[0]
    xs_, dys_, ws_ = mxmla.quantize(x), mxmla.quantize(dy), mxmla.quantize(w)
    assert (xs_.rowwise_scale_inv[:3].int() < 3).all() and (dys_.columnwise_scale_inv[:, 5].int() < 3).all()
    assert (xs_.rowwise_scale_inv[:3].int() + ws_.rowwise_scale_inv.int().min() >= 128).all()
    assert (dys_.columnwise_scale_inv[:, 5].int() + xs_.columnwise_scale_inv.int().min() >= 128).all()
    w8 = mxmla.quantize(w)
    y0, _, dx0, dw0 = composed(x, w8, dy)
    y, xs = mxmla.linear_forward(x, w8)
    dx, dw = mxmla.linear_backward(dy, w8, xs)
    assert same(y, y0) and same(dx, dx0) and same(dw, dw0)
    ry, _, _, rdw = _reference(x, w, dy)
    _rows_close(y, ry, [0, 1, 2])
    _rows_close(dw, rdw, [5])


@needs_gpu
def test_cuda_other_operands_blocks_bf16_cannot_hold_take_the_fp8_path():
    """x and dy exact in the directions the fused passes copy, and only each GEMM's other operand not:
    W's rows 0-2 (fprop's rowwise W) and column 7 through all rows (dgrad's columnwise W), x's column 9
    through all tokens (wgrad's x_saved), with a largest magnitude of 2^-117. Each GEMM's own check of
    that operand picks design B, which reads the fused pass's operand as codes too: the bits of the
    unfused calls, and the CPU reference's values on the rows those blocks reach. x and dy at 1024 (the
    pairs' scale bytes sum to 128 or more: design B's fp32 factors stay normal)."""
    T, K, N = 96, 64, 64
    x, dy, w = (_amax_rows(data(shape, seed, "cuda"), 1024.0) for shape, seed in (((T, K), 1), ((T, N), 3),
                                                                                  ((N, K), 2)))
    w[:3] = _amax_rows(w[:3], 2.0 ** -117)
    w[:, 7] = _amax_rows(w[:, 7][None], 2.0 ** -117)[0]
    x[:, 9] = _amax_rows(x[:, 9][None], 2.0 ** -117)[0]
    x8, dy8, w8 = mxmla.quantize(x), mxmla.quantize(dy), mxmla.quantize(w)
    for t in (x8.rowwise_scale_inv, dy8.rowwise_scale_inv, dy8.columnwise_scale_inv):  # the fused copies: exact
        assert (t.int() >= 10).all()
    assert (w8.rowwise_scale_inv[:3].int() < 3).all() and (w8.columnwise_scale_inv[:, 7].int() < 3).all()
    assert (x8.columnwise_scale_inv[:, 9].int() < 3).all()
    assert (x8.rowwise_scale_inv.int().min() + w8.rowwise_scale_inv[:3].int() >= 128).all()
    assert (dy8.rowwise_scale_inv.int().min() + w8.columnwise_scale_inv[:, 7].int() >= 128).all()
    assert (dy8.columnwise_scale_inv.int().min() + x8.columnwise_scale_inv[:, 9].int() >= 128).all()
    y0, _, dx0, dw0 = composed(x, w8, dy)
    y, xs = mxmla.linear_forward(x, w8)
    dx, dw = mxmla.linear_backward(dy, w8, xs)
    assert same(y, y0) and same(dx, dx0) and same(dw, dw0)
    ry, _, rdx, rdw = _reference(x, w, dy)
    _rows_close(y.T, ry.T, [0, 1, 2])
    _rows_close(dx.T, rdx.T, [7])
    _rows_close(dw.T, rdw.T, [9])


@needs_gpu
@pytest.mark.parametrize("design", ["A", "B", "C", "D"])
def test_cuda_forced_designs(design, monkeypatch):
    """With MXMLA_GEMM_DESIGN forcing a design (A, B and D read the codes, which the fused path then
    always writes): the bits of the unfused calls under the same setting."""
    monkeypatch.setenv("MXMLA_GEMM_DESIGN", design)
    check_against_composition(65, 128, 96, "cuda", seed=5)


@needs_gpu
def test_cuda_errors():
    x, w8 = data((8, 64), 0, "cuda"), mxmla.quantize(data((32, 64), 1, "cuda"))
    with pytest.raises(ValueError, match=r"linear_forward: argument 'w.rowwise_data': is on cpu:0 but x is on cuda:0"):
        mxmla.linear_forward(x, mxmla.quantize(data((32, 64), 1)))
    with pytest.raises(ValueError, match=r"argument 'x': row stride must be a multiple of 16 bytes"):
        mxmla.linear_forward(torch.empty(8, 68, device="cuda", dtype=torch.bfloat16)[:, :64], w8)
    y, xs = mxmla.linear_forward(x, w8)
    with pytest.raises(ValueError, match=r"argument 'dw': dtype bfloat16 must be float32 with accumulate"):
        mxmla.linear_backward(data((8, 32), 2, "cuda"), w8, xs, main_grad=torch.empty(32, 64, device="cuda",
                                                                                      dtype=torch.bfloat16))


def test_errors():
    x, w8 = data((8, 64), 0), mxmla.quantize(data((32, 64), 1))
    with pytest.raises(ValueError, match=r"linear_forward: argument 'x': last dimension 48 \(K\) must be a positive "
                                         r"multiple of 32"):
        mxmla.linear_forward(data((8, 48), 0), w8)
    with pytest.raises(ValueError, match=r"argument 'x': dtype float32 must be bfloat16"):
        mxmla.linear_forward(x.float(), w8)
    with pytest.raises(TypeError, match=r"argument 'w': expected an MXFP8Tensor"):
        mxmla.linear_forward(x, torch.ones(32, 64))
    with pytest.raises(ValueError, match=r"argument 'w': shape \[32, 64\] must be \[N, K\] with K = 96"):
        mxmla.linear_forward(data((8, 96), 0), w8)
    with pytest.raises(ValueError, match=r"argument 'w': FP8 format e5m2 must be e4m3"):
        mxmla.linear_forward(x, mxmla.quantize(data((32, 64), 1), fp8_format="e5m2"))
    with pytest.raises(ValueError, match=r"argument 'w.rowwise_data': is absent: mxmla.linear_forward reads its "
                                         r"rowwise copy.*quantize w with rowwise enabled"):
        mxmla.linear_forward(x, mxmla.quantize(data((32, 64), 1), rowwise=False))
    _, xs = mxmla.linear_forward(x, w8)
    with pytest.raises(ValueError, match=r"argument 'w.columnwise_data': is absent"):
        mxmla.linear_backward(data((8, 32), 2), mxmla.quantize(data((32, 64), 1), columnwise=False), xs)
    with pytest.raises(ValueError, match=r"argument 'x_saved': shape \[8, 64\] must be \[T, K\] = \[9, 64\]"):
        mxmla.linear_backward(data((9, 32), 2), w8, xs)
    with pytest.raises(ValueError, match=r"argument 'x_saved.columnwise_data': is absent"):
        mxmla.linear_backward(data((8, 32), 2), w8, mxmla.quantize(x, columnwise=False))
    with pytest.raises(RuntimeError, match=r"linear_forward: argument 'x': requires grad"):
        mxmla.linear_forward(x.float().requires_grad_().bfloat16(), w8)


def test_custom_ops_fakes_and_compile():
    for name in ("linear_forward", "linear_backward", "linear_backward_acc"):
        assert isinstance(getattr(torch.ops.mxmla, name).default, torch._ops.OpOverload)
    x = torch.empty(33, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(96, 64, device="meta", dtype=torch.uint8)
    s = torch.empty(96, 2, device="meta", dtype=torch.uint8)
    y, xc, xs = torch.ops.mxmla.linear_forward(x, w, s, "e4m3:compact:-:96x64")
    assert y.shape == (33, 96) and y.dtype == torch.bfloat16 and xc.shape == (33, 64) and xs.shape == (2, 64)

    x, w, dy = data((33, 64), 0), data((96, 64), 1), data((33, 96), 2)
    w8 = mxmla.quantize(w)

    def step(x, dy, mg):
        y, xs = mxmla.linear_forward(x, w8)
        dx, dw = mxmla.linear_backward(dy, w8, xs)
        mxmla.linear_backward(dy, w8, xs, main_grad=mg, need_dx=False)
        return y, dx, dw, mg

    eager = step(x, dy, torch.zeros(96, 64))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, dy, torch.zeros(96, 64))
    for e, c in zip(eager, compiled):
        assert same(e, c)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_linear_function_runs_the_fused_calls(dev):
    """MXFP8LinearFunction's output and gradients equal the quantize + gemm composition's bits."""
    from mxmla.nn import Linear

    lin = Linear(64, 96, recipe="mxfp8").to(dev)
    x = data((2 * 20, 64), 4, dev).float().reshape(2, 20, 64).requires_grad_()
    dy = data((40, 96), 5, dev)
    y = lin(x)
    y.backward(dy.reshape(2, 20, 96))
    w8 = mxmla.quantize(lin.weight.detach().bfloat16())
    y0, _, dx0, dw0 = composed(x.detach().reshape(40, 64).bfloat16(), w8, dy)
    assert same(y.reshape(40, 96), y0) and same(x.grad.reshape(40, 64).bfloat16(), dx0) and same(lin.weight.grad, dw0)
