"""The block-FP8 GEMM (the DeepSeek-V3 recipe's Linear GEMMs: ``mxmla.gemm`` on BlockFP8Tensors) and
the transposed block quantization its backward operands come from (alone, and with the plain one in
one pass: ``quantize_blockwise_both``): the CPU reference against
float64 numpy math on the dequantized operands, the three GEMMs of a Linear, the CUDA kernels bit for
bit against the CPU reference where every block's sum is exact (integer-valued codes), random data
within the stated bound, NaN / Inf scales, tails, strided and unaligned outputs, accumulation, and
errors."""
import numpy as np
import pytest

import mxmla

try:
    import torch
except ImportError:  # torch is optional: its tests skip
    torch = None

HAVE_GPU = torch is not None and torch.cuda.is_available() and mxmla.info()["cuda_enabled"]
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU (or a build without CUDA): GPU test skipped")


def edge_matrix(rows, cols, seed):
    """Normal values with a zero block, a NaN, an Inf and a block of fp32 subnormals."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    if rows > 130 and cols > 130:
        x[:128, 0] = 0.0
        x[3, 1] = np.nan
        x[200 % rows, 2] = np.inf
        x[128:, 1] = 1e-40
    return x


def ints(rows, cols, seed, lim=3):
    """Integer values in [-lim, lim]: quantized with power-of-two scales their codes are exact
    integers times the scale, so every block's sum (at most 128 · lim^2) is exact on the tensor
    cores and every fp32 sum across blocks too."""
    return np.random.default_rng(seed).integers(-lim, lim + 1, (rows, cols)).astype(np.float32)


def deq(b):
    return np.asarray(b.dequantize(), np.float64)


def ref_gemm(a, b):
    """float64: Σ over 128-wide blocks of K of (block sum of code products) · both factors."""
    ad, bd = deq(a), deq(b)
    return ad @ bd.T


# ------------------------------------------------------------------ CPU
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("shape", [(1, 1), (3, 300), (257, 129), (130, 257)])
def test_transposed_quantization_is_that_of_the_transpose(block_rows, shape):
    x = edge_matrix(*shape, seed=sum(shape))
    t = mxmla.quantize_blockwise(x, block_rows, transpose=True)
    r = mxmla.quantize_blockwise(np.ascontiguousarray(x.T), block_rows)
    assert t.shape == (shape[1], shape[0])
    np.testing.assert_array_equal(t.data, r.data)
    np.testing.assert_array_equal(t.scale_inv.view(np.uint32), r.scale_inv.view(np.uint32))


def _bits(t, dtype):
    """A numpy or torch array's bytes as a numpy array of `dtype` (np.uint8 codes, np.uint32 scales)."""
    if torch is not None and isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        t = (t.view(torch.uint8) if dtype == np.uint8 else t.view(torch.int32)).numpy()
    return np.asarray(t).view(dtype)


def _same(a, b):
    """Two BlockFP8Tensors hold the same bits (numpy or torch, any device)."""
    assert a.shape == b.shape and a.block_rows == b.block_rows
    np.testing.assert_array_equal(_bits(a.data, np.uint8), _bits(b.data, np.uint8))
    np.testing.assert_array_equal(_bits(a.scale_inv, np.uint32), _bits(b.scale_inv, np.uint32))


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("shape", [(1, 1), (3, 300), (257, 129), (130, 257)])
def test_both_directions_are_the_two_quantizations(block_rows, shape):
    """quantize_blockwise_both(x) = (quantize_blockwise(x), quantize_blockwise(x, transpose=True))."""
    x = edge_matrix(*shape, seed=sum(shape) + 1)
    q, t = mxmla.quantize_blockwise_both(x, block_rows)
    _same(q, mxmla.quantize_blockwise(x, block_rows))
    _same(t, mxmla.quantize_blockwise(x, block_rows, transpose=True))
    assert q.shape == shape and t.shape == shape[::-1]
    with pytest.raises(ValueError, match="block_rows"):
        mxmla.quantize_blockwise_both(x, 64)
    with pytest.raises(ValueError, match="'input'.*2-D"):
        mxmla.quantize_blockwise_both(x[0])


@pytest.mark.parametrize("a_br,b_br", [(1, 128), (1, 1), (128, 128), (128, 1)])
@pytest.mark.parametrize("M,N,K", [(1, 1, 16), (31, 33, 128), (130, 257, 300), (5, 140, 1000)])
def test_cpu_gemm_against_float64(a_br, b_br, M, N, K):
    rng = np.random.default_rng(M * 7 + N + K)
    a = mxmla.quantize_blockwise(rng.standard_normal((M, K)).astype(np.float32), a_br)
    b = mxmla.quantize_blockwise(rng.standard_normal((N, K)).astype(np.float32) * 0.1, b_br)
    d = mxmla.gemm(a, b, out_dtype="float32")
    assert d.shape == (M, N) and d.dtype == np.float32
    ref = ref_gemm(a, b)  # power-of-two scales: the dequantized values are exact, only the sum order differs
    np.testing.assert_allclose(d, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    d16 = mxmla.gemm(a, b)  # bf16 (uint16 bits for numpy), rounded once from float64
    assert d16.dtype == np.uint16
    v16 = (d16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert (np.abs(v16 - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-30).all()  # half an ulp


def test_cpu_gemm_fp32_scales_alpha_accumulate_strided_out():
    rng = np.random.default_rng(1)
    a = mxmla.quantize_blockwise(rng.standard_normal((40, 384)).astype(np.float32), 1, pow2_scales=False)
    b = mxmla.quantize_blockwise(rng.standard_normal((70, 384)).astype(np.float32), 128, pow2_scales=False)
    base = rng.standard_normal((40, 80)).astype(np.float32)
    out = base.copy()
    r = mxmla.gemm(a, b, out=out[:, :70], accumulate=True, alpha=-0.5)
    assert np.shares_memory(r, out)
    # float64 per block: blocks of 128 products exact, then scaled
    ad, bd = a.data, b.data
    from ml_dtypes import float8_e4m3fn
    av, bv = ad.view(float8_e4m3fn).astype(np.float64), bd.view(float8_e4m3fn).astype(np.float64)
    ref = np.zeros((40, 70))
    for kb in range(3):
        blk = av[:, 128 * kb:128 * (kb + 1)] @ bv[:, 128 * kb:128 * (kb + 1)].T
        ref += blk * a.scale_inv[:, kb:kb + 1].astype(np.float64) * b.scale_inv[np.arange(70) // 128, kb][None, :]
    ref = (base[:, :70].astype(np.float64) + (-0.5) * ref).astype(np.float32)
    np.testing.assert_allclose(out[:, :70], ref, rtol=2e-6, atol=1e-5)
    np.testing.assert_array_equal(out[:, 70:], base[:, 70:])  # past N: untouched


@pytest.mark.parametrize("T,K,N", [(300, 256, 200), (130, 1536, 384)])
def test_cpu_linear_three_gemms(T, K, N):
    """fprop y = x·Wᵀ, dgrad dx = dy·W, wgrad dW = dyᵀ·x, each on the K-major operands the recipe
    quantizes (x, dy 1 x 128 along their last dim; dyᵀ, xᵀ 1 x 128 along the tokens; W and Wᵀ
    128 x 128) against float64 math on those dequantized operands."""
    rng = np.random.default_rng(T + K + N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    dy = rng.standard_normal((T, N)).astype(np.float32)
    q = mxmla.quantize_blockwise
    xq, wq, dyq = q(x), q(w, 128), q(dy)
    wt, dyt, xt = q(w, 128, transpose=True), q(dy, transpose=True), q(x, transpose=True)
    np.testing.assert_array_equal(wt.scale_inv, wq.scale_inv.T)  # the same 128 x 128 blocks
    for d, ref in ((mxmla.gemm(xq, wq, out_dtype="float32"), deq(xq) @ deq(wq).T),
                   (mxmla.gemm(dyq, wt, out_dtype="float32"), deq(dyq) @ deq(wt).T),
                   (mxmla.gemm(dyt, xt, out_dtype="float32"), deq(dyt) @ deq(xt).T)):
        np.testing.assert_allclose(d, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    # and close to the unquantized math (E4M3: 2^-4 relative per value)
    ref = dy.astype(np.float64).T @ x
    err = np.sqrt(((mxmla.gemm(dyt, xt, out_dtype="float32") - ref) ** 2).mean() / (ref ** 2).mean())
    assert err < 0.05, err


def test_cpu_nan_and_inf_scales_propagate_where_the_math_says():
    a = mxmla.quantize_blockwise(ints(4, 256, 0), 1)
    b = mxmla.quantize_blockwise(ints(6, 256, 1), 1)
    a.scale_inv[1, 1] = np.nan
    b.scale_inv[2, 0] = np.inf
    d = mxmla.gemm(a, b, out_dtype="float32")
    assert np.isnan(d[1]).all()  # a NaN factor reaches its whole row
    assert not np.isfinite(d[:, 2]).any()  # an Inf one its column (±Inf, NaN where the block sums to 0)
    rest = np.delete(np.delete(d, 1, 0), 2, 1)
    assert np.isfinite(rest).all()


def test_errors():
    a = mxmla.quantize_blockwise(np.ones((4, 256), np.float32))
    b = mxmla.quantize_blockwise(np.ones((8, 256), np.float32), 128)
    with pytest.raises(ValueError, match="'trans_a'.*K-major"):
        mxmla.gemm(a, b, trans_a=True)
    with pytest.raises(ValueError, match="'trans_b'.*K-major"):
        mxmla.gemm(a, b, trans_b=False)
    with pytest.raises(TypeError, match="'b'.*BlockFP8Tensor"):
        mxmla.gemm(a, np.ones((8, 256), np.float32))
    with pytest.raises(ValueError, match="'b.data'.*does not match a's K"):
        mxmla.gemm(a, mxmla.quantize_blockwise(np.ones((8, 128), np.float32), 128))
    with pytest.raises(ValueError, match="'b.block_rows'"):
        mxmla.gemm(a, mxmla.BlockFP8Tensor(b.data, b.scale_inv, 32))
    with pytest.raises(ValueError, match="'b.scale_inv'.*must be"):
        mxmla.gemm(a, mxmla.BlockFP8Tensor(b.data, b.scale_inv, 1))
    with pytest.raises(ValueError, match="'accumulate'"):
        mxmla.gemm(a, b, accumulate=True)
    with pytest.raises(ValueError, match="'out'.*float32 with accumulate"):
        mxmla.gemm(a, b, out=np.zeros((4, 8), np.uint16), accumulate=True)
    with pytest.raises(ValueError, match="'out'.*must be \\[M, N\\]"):
        mxmla.gemm(a, b, out=np.zeros((4, 9), np.float32))
    with pytest.raises(ValueError, match="'transpose'"):
        mxmla.quantize_blockwise(np.ones((4, 8), np.float32), transpose="yes")


@needs_torch
def test_torch_compile_traces_the_block_gemm():
    x, w, dy = torch.randn(64, 256), torch.randn(96, 256), torch.randn(64, 96)
    q = mxmla.quantize_blockwise

    def f(x, w, dy):  # fprop, dgrad, wgrad
        return (mxmla.gemm(q(x), q(w, 128)), mxmla.gemm(q(dy), q(w, 128, transpose=True)),
                mxmla.gemm(q(dy, transpose=True), q(x, transpose=True), out_dtype="float32"))

    eager = f(x, w, dy)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, dy)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    out = torch.zeros(64, 96)
    mxmla.gemm(mxmla.quantize_blockwise(x), mxmla.quantize_blockwise(w, 128), out=out, accumulate=True)
    torch.testing.assert_close(out, eager[0].float(), rtol=2 ** -8, atol=1e-3)  # fp32 into out, bf16 returned
    with pytest.raises(RuntimeError, match="requires grad"):
        mxmla.gemm(mxmla.quantize_blockwise(x), mxmla.BlockFP8Tensor(
            mxmla.quantize_blockwise(w, 128).data.float().requires_grad_(), torch.ones(1, 2), 128))


@needs_torch
def test_torch_compile_traces_both_directions():
    x = torch.randn(200, 136)

    def f(x):
        q, t = mxmla.quantize_blockwise_both(x)
        return q.data.view(torch.uint8), q.scale_inv, t.data.view(torch.uint8), t.scale_inv

    for e, c in zip(f(x), torch.compile(f, backend="aot_eager", fullgraph=True)(x)):
        assert e.shape == c.shape and torch.equal(e, c)


# ------------------------------------------------------------------ CUDA
def _cuda(b):
    return mxmla.BlockFP8Tensor(torch.from_numpy(np.asarray(b.data)).cuda().view(torch.float8_e4m3fn),
                                torch.from_numpy(np.asarray(b.scale_inv)).cuda(), b.block_rows)


def _cpu(b):
    return mxmla.BlockFP8Tensor(torch.from_numpy(np.asarray(b.data)).view(torch.float8_e4m3fn),
                                torch.from_numpy(np.asarray(b.scale_inv)), b.block_rows)


@needs_gpu
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 300), (130, 257), (257, 129), (4097, 1536)])
def test_cuda_transposed_quantization_matches_cpu(block_rows, dtype, shape):
    x = torch.from_numpy(edge_matrix(*shape, seed=shape[0])).to(getattr(torch, dtype))
    for pow2 in (True, False):
        g = mxmla.quantize_blockwise(x.cuda(), block_rows, pow2, transpose=True)
        h = mxmla.quantize_blockwise(x, block_rows, pow2, transpose=True)
        assert torch.equal(g.data.view(torch.uint8).cpu(), h.data.view(torch.uint8))
        assert torch.equal(g.scale_inv.cpu().view(torch.int32), h.scale_inv.view(torch.int32))


@needs_gpu
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 300), (130, 257), (257, 129), (4097, 1536), (384, 7168)])
def test_cuda_both_directions_match_cpu(block_rows, dtype, shape):
    """One pass writing x's and xᵀ's quantization: the CPU reference's bits (its two calls), with a
    zero block, NaN, Inf and subnormals, and tails in both directions."""
    x = torch.from_numpy(edge_matrix(*shape, seed=shape[0] + 2)).to(getattr(torch, dtype))
    for pow2 in (True, False):
        g = mxmla.quantize_blockwise_both(x.cuda(), block_rows, pow2)
        h = mxmla.quantize_blockwise_both(x, block_rows, pow2)
        for a, b in zip(g, h):
            _same(a, b)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lo,hi", [(64, 448), (3, 300), (1, 9)])
def test_cuda_both_directions_strided_input(dtype, lo, hi):
    """Column slices of a wider matrix: 16-byte aligned rows (64:448) and rows that are not (the
    kernel's element loads), 300 rows (a tail of the transposed blocks)."""
    x = torch.randn(300, 512, device="cuda").to(getattr(torch, dtype))[:, lo:hi]
    for block_rows in (1, 128):
        for a, b in zip(mxmla.quantize_blockwise_both(x, block_rows), mxmla.quantize_blockwise_both(x.cpu(), block_rows)):
            _same(a, b)


@needs_gpu
def test_cuda_transposed_quantization_strided_input():
    x = torch.randn(300, 512, device="cuda")[:, 64:448]
    g = mxmla.quantize_blockwise(x, 1, transpose=True)
    h = mxmla.quantize_blockwise(x.cpu(), 1, transpose=True)
    assert torch.equal(g.data.view(torch.uint8).cpu(), h.data.view(torch.uint8))


@pytest.fixture(params=["chosen", "128", "256"])
def tile_n(request, monkeypatch):
    """The GEMM's tile width: as the launcher chooses it, or 128 / 256 columns forced
    (MXMLA_BLOCK_GEMM_TILE_N): every case through both kernels."""
    if request.param != "chosen":
        monkeypatch.setenv("MXMLA_BLOCK_GEMM_TILE_N", request.param)
    return request.param


@needs_gpu
@pytest.mark.parametrize("a_br,b_br", [(1, 128), (1, 1), (128, 128)])
@pytest.mark.parametrize("M,N,K", [(1, 1, 16), (31, 33, 128), (130, 257, 384), (257, 520, 1536), (4097, 300, 256),
                                   (200, 1000, 4096)])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_cuda_gemm_bitwise_on_integer_data(a_br, b_br, M, N, K, out_dtype, tile_n):
    a = mxmla.quantize_blockwise(ints(M, K, M + K), a_br)
    b = mxmla.quantize_blockwise(ints(N, K, N + 2 * K), b_br)
    g = mxmla.gemm(_cuda(a), _cuda(b), out_dtype=out_dtype)
    h = mxmla.gemm(_cpu(a), _cpu(b), out_dtype=out_dtype)
    assert g.dtype == h.dtype and torch.equal(g.cpu(), h)


@needs_gpu
def test_cuda_gemm_accumulate_alpha_strided_and_unaligned_out(tile_n):
    a = mxmla.quantize_blockwise(ints(130, 384, 5), 1)
    b = mxmla.quantize_blockwise(ints(300, 384, 6), 128)
    ga, gb, ha, hb = _cuda(a), _cuda(b), _cpu(a), _cpu(b)
    base = torch.randint(-8, 9, (130, 310)).float()
    og, oh = base.cuda(), base.clone()
    mxmla.gemm(ga, gb, out=og[:, 3:303], accumulate=True, alpha=0.5)
    mxmla.gemm(ha, hb, out=oh[:, 3:303], accumulate=True, alpha=0.5)
    assert torch.equal(og.cpu(), oh)
    # bf16 out, a row stride that TMA cannot take and an odd start: stored from the registers
    g16 = torch.full((130, 305), 7.0, dtype=torch.bfloat16, device="cuda")
    h16 = g16.cpu().clone()
    mxmla.gemm(ga, gb, out=g16[:, 1:301])
    mxmla.gemm(ha, hb, out=h16[:, 1:301])
    assert torch.equal(g16.cpu(), h16)
    # bf16 out whose rows TMA could describe but whose N (300) ends inside a 16-byte chunk: the bytes
    # between N and the row stride stay (the TMA epilogue stores whole chunks: not taken here)
    g16 = torch.full((130, 312), 7.0, dtype=torch.bfloat16, device="cuda")
    h16 = g16.cpu().clone()
    mxmla.gemm(ga, gb, out=g16[:, :300])
    mxmla.gemm(ha, hb, out=h16[:, :300])
    assert torch.equal(g16.cpu(), h16)


@needs_gpu
@pytest.mark.parametrize("b_br", [1, 128])
def test_cuda_gemm_random_within_bound(b_br, tile_n):
    """Random data, fp32 scales: the FP8 tensor cores add a block's 128 products in their own
    precision, so D is compared with the CPU reference (float64) by error: relative RMS below 2^-10,
    every element within 2^-7 of max |D|."""
    rng = np.random.default_rng(b_br)
    a = mxmla.quantize_blockwise(rng.standard_normal((1000, 1536)).astype(np.float32), 1, pow2_scales=False)
    b = mxmla.quantize_blockwise(rng.standard_normal((700, 1536)).astype(np.float32), b_br, pow2_scales=False)
    g = mxmla.gemm(_cuda(a), _cuda(b), out_dtype="float32").cpu().double()
    h = mxmla.gemm(_cpu(a), _cpu(b), out_dtype="float32").double()
    rms = ((g - h).pow(2).mean() / h.pow(2).mean()).sqrt().item()
    assert rms < 2.0 ** -10, rms
    assert (g - h).abs().max().item() <= 2.0 ** -7 * h.abs().max().item()


@needs_gpu
def test_cuda_nan_and_inf_scales_match_cpu(tile_n):
    a = mxmla.quantize_blockwise(ints(140, 256, 0), 1)
    b = mxmla.quantize_blockwise(ints(300, 256, 1), 1)
    a.scale_inv[1, 1] = np.nan
    b.scale_inv[2, 0] = np.inf
    b.scale_inv[260, 1] = 0.0
    g = mxmla.gemm(_cuda(a), _cuda(b), out_dtype="float32").cpu()
    h = mxmla.gemm(_cpu(a), _cpu(b), out_dtype="float32")
    assert torch.equal(torch.isnan(g), torch.isnan(h))
    fin = ~torch.isnan(h)
    assert torch.equal(g[fin], h[fin])


@needs_gpu
def test_cuda_linear_three_gemms_against_cpu():
    T, K, N = 1000, 1536, 768
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = (torch.randn(N, K) / K ** 0.5).to(torch.bfloat16)
    dy = torch.randn(T, N, dtype=torch.bfloat16)
    q = mxmla.quantize_blockwise
    xd, wd, dyd = x.cuda(), w.cuda(), dy.cuda()
    outs = [mxmla.gemm(q(xd), q(wd, 128), out_dtype="float32"),
            mxmla.gemm(q(dyd), q(wd, 128, transpose=True), out_dtype="float32"),
            mxmla.gemm(q(dyd, transpose=True), q(xd, transpose=True), out_dtype="float32")]
    refs = [mxmla.gemm(q(x), q(w, 128), out_dtype="float32"),
            mxmla.gemm(q(dy), q(w, 128, transpose=True), out_dtype="float32"),
            mxmla.gemm(q(dy, transpose=True), q(x, transpose=True), out_dtype="float32")]
    for g, h in zip(outs, refs):
        g, h = g.cpu().double(), h.double()
        rms = ((g - h).pow(2).mean() / h.pow(2).mean()).sqrt().item()
        assert rms < 2.0 ** -10, rms


@needs_gpu
@pytest.mark.parametrize("K", [1, 31, 120, 1000])
def test_cuda_gemm_any_k_and_unaligned_rows(K, tile_n):
    """K not a multiple of 16 (code rows TMA cannot take: copied into aligned rows first) and a view
    with an odd row stride, bit for bit against the CPU."""
    a = mxmla.quantize_blockwise(ints(70, K, K), 1)
    b = mxmla.quantize_blockwise(ints(300, K, K + 1), 1)
    g = mxmla.gemm(_cuda(a), _cuda(b), out_dtype="float32")
    h = mxmla.gemm(_cpu(a), _cpu(b), out_dtype="float32")
    assert torch.equal(g.cpu(), h)
    wide = torch.zeros(300, K + 5, dtype=torch.uint8)
    wide[:, 2:K + 2] = torch.from_numpy(b.data)
    bv = mxmla.BlockFP8Tensor(wide.cuda()[:, 2:K + 2].view(torch.float8_e4m3fn), _cuda(b).scale_inv, 1)
    assert torch.equal(mxmla.gemm(_cuda(a), bv, out_dtype="float32").cpu(), h)


@needs_gpu
def test_cuda_errors():
    a = _cuda(mxmla.quantize_blockwise(np.ones((4, 128), np.float32)))
    with pytest.raises(ValueError, match="another device|one device"):
        mxmla.gemm(a, _cpu(mxmla.quantize_blockwise(np.ones((8, 128), np.float32), 128)))
    with pytest.raises(ValueError, match="'trans_b'"):
        mxmla.gemm(a, a, trans_b=False)
