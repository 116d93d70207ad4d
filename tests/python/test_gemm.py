"""The MXFP8 GEMM through Python (SPEC §6): the numpy path (CPU reference) against an independent float64
GEMM written here on operands decoded here (ml_dtypes codes, 2^(e-127) scales, compact and F8_128x4
indexing from SPEC §2.1) for the three GEMMs of a Linear (fprop, dgrad, wgrad) with token counts that
leave tail blocks; integer-valued data bit for bit against an fp32 accumulation; bf16 operands; out,
out_dtype, accumulate and alpha; the torch CPU path bit for bit against numpy; errors; the CUDA path
(no kernel yet: a clear error, checked on the CPU through the core and on a GPU with torch); the custom
ops, their fakes and torch.compile."""
import math

import numpy as np
import pytest

import mxmla
from mxmla import _mxmla_core as core

ml_dtypes = pytest.importorskip("ml_dtypes")

try:
    import torch
except ImportError:  # torch is optional: its tests skip
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
HAVE_GPU = torch is not None and torch.cuda.is_available() and bool(mxmla.info()["gpus"]) and \
    mxmla.info()["cuda_enabled"]
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU test skipped")

BF16 = ml_dtypes.bfloat16


# ----------------------------------------------------------------------------- the test's own oracle
def np_(a):
    """numpy view of a buffer (torch CPU tensors: the same bits)."""
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).numpy().view(np.uint16).view(BF16)
        return a.numpy()
    return np.asarray(a)


def f64(a):
    """float64 values (uint16 arrays are bf16 bits)."""
    a = np_(a)
    return (a.view(BF16) if a.dtype == np.uint16 else a).astype(np.float64)


def _cdiv(a, b):
    return -(-a // b)


def _swz(i, j, tiles_x):
    return ((i // 128) * tiles_x + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)


def decode(t, rowwise):
    """The float64 values of one copy of a 2-D MXFP8Tensor (codes · 2^(e-127), e = 255 -> NaN)."""
    d = "rowwise" if rowwise else "columnwise"
    rows, cols = t.shape
    fp8 = ml_dtypes.float8_e4m3fn if t.fp8_format == "e4m3" else ml_dtypes.float8_e5m2
    codes = np_(getattr(t, f"{d}_data")).view(np.uint8).view(fp8).astype(np.float64)
    s = np_(getattr(t, f"{d}_scale_inv")).view(np.uint8).reshape(-1).astype(np.int64)
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    if rowwise:  # scale (r, c // 32) of [rows, cols / 32]; swizzled: i = row, j = block column
        compact, i, j, tiles = r * (cols // 32) + c // 32, r, c // 32, _cdiv(cols // 32, 4)
    else:  # scale (r // 32, c) of [ceil(rows / 32), cols]; swizzled: i = column, j = row block
        compact, i, j, tiles = (r // 32) * cols + c, c, r // 32, _cdiv(_cdiv(rows, 32), 4)
    e = s[_swz(i, j, tiles) if t.scale_layout == "swizzled" else compact]
    return codes * np.where(e == 255, np.nan, np.exp2(e - 127.0))


def oracle(a, b, trans_a=False, trans_b=True, alpha=1.0, d=None):
    """(alpha · op(A) · op(B) (+ D) in float64, sum of |products| for the summation-order bound)."""
    A = decode(a, not trans_a) if isinstance(a, mxmla.MXFP8Tensor) else f64(a)
    B = decode(b, trans_b) if isinstance(b, mxmla.MXFP8Tensor) else f64(b)
    A = A.T if trans_a else A
    B = B.T if trans_b else B
    with np.errstate(invalid="ignore", over="ignore"):
        v = alpha * (A @ B)
        if d is not None:
            v = v + f64(d)
        mag = np.abs(A) @ np.abs(B)
    return v, mag


def assert_close(got, want, mag, bf16=True):
    """got (bf16 or fp32) is want rounded once: within half an ulp of its format, plus the float64
    summation-order difference between the library (k in order) and numpy's matmul."""
    g = f64(got)
    assert g.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(g), nan), "NaN positions differ"
    ulp = 2.0 ** -8 if bf16 else 2.0 ** -23
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = want.astype(BF16 if bf16 else np.float32).astype(np.float64)  # ±Inf past the format's range
        ok = (g == rounded) | (np.abs(g - want) <= ulp * np.abs(want) + 1e-12 * mag + 1e-300)
    assert ok[~nan].all(), f"{int((~ok & ~nan).sum())} outputs off, e.g. {g[~ok & ~nan][:3]} vs {want[~ok & ~nan][:3]}"


def rand(shape, seed, lo=-3, hi=3):
    """N(0, 1) rows times a power of two each (blocks with different scales)."""
    g = np.random.default_rng(seed)
    return (g.standard_normal(shape) * np.exp2(g.integers(lo, hi + 1, (shape[0], 1)))).astype(np.float32)


def integers(shape, seed, lim=8, shift=0):
    return np.ldexp(np.random.default_rng(seed).integers(-lim, lim + 1, shape), shift).astype(np.float32)


def linear(T, K, N, fmt="e4m3", swizzle=False, seed=0, data=rand, lib="numpy"):
    """x [T, K], W [N, K], dy [T, N] quantized in both directions."""
    x, w, dy = data((T, K), seed), data((N, K), seed + 1), data((T, N), seed + 2)
    if lib == "torch":
        x, w, dy = (torch.from_numpy(v) for v in (x, w, dy))
    return [mxmla.quantize(v, fp8_format=fmt, swizzle=swizzle) for v in (x, w, dy)]


# the three GEMMs of a Linear: (name, operands from (x, w, dy), flags)
DIRECTIONS = [("fprop", lambda x, w, dy: (x, w), dict()),
              ("dgrad", lambda x, w, dy: (dy, w), dict(trans_b=False)),
              ("wgrad", lambda x, w, dy: (dy, x), dict(trans_a=True, trans_b=False))]


# ----------------------------------------------------------------------------- numpy: the CPU reference
@pytest.mark.parametrize("T", [1, 31, 33, 100])
@pytest.mark.parametrize("fmt,swizzle", [("e4m3", False), ("e4m3", True), ("e5m2", False)])
def test_numpy_linear_three_directions(T, fmt, swizzle):
    x, w, dy = linear(T, 96, 64, fmt, swizzle, seed=T)
    for name, pick, flags in DIRECTIONS:
        a, b = pick(x, w, dy)
        got = mxmla.gemm(a, b, **flags)
        want, mag = oracle(a, b, **flags)
        assert got.dtype == np.uint16, name  # bf16 bits
        assert_close(got, want, mag)


@pytest.mark.parametrize("name,pick,flags", DIRECTIONS, ids=[d[0] for d in DIRECTIONS])
def test_numpy_fp32_out_alpha_and_accumulate(name, pick, flags):
    x, w, dy = linear(65, 64, 96, swizzle=True, seed=3)
    a, b = pick(x, w, dy)
    y = mxmla.gemm(a, b, out_dtype="float32", alpha=-0.75, **flags)
    want, mag = oracle(a, b, alpha=-0.75, **flags)
    assert y.dtype == np.float32
    assert_close(y, want, mag, bf16=False)
    d = np.random.default_rng(4).standard_normal(want.shape).astype(np.float32)
    out = d.copy()
    r = mxmla.gemm(a, b, out=out, accumulate=True, alpha=0.5, **flags)
    assert r is out
    want, mag = oracle(a, b, alpha=0.5, d=d, **flags)
    assert_close(out, want, mag + np.abs(d), bf16=False)


@pytest.mark.parametrize("fmt,lim", [("e4m3", 8), ("e5m2", 4)])
@pytest.mark.parametrize("swizzle", [False, True])
def test_numpy_integer_data_bit_for_bit(fmt, lim, swizzle):
    """Small integers: quantization is exact, every fp32 partial sum too: the reference equals an fp32
    accumulation exactly (what the GPU kernel will be held to)."""
    data = lambda shape, seed: integers(shape, seed, lim, shift=seed % 3 - 1)  # noqa: E731
    x, w, dy = linear(129, 96, 64, fmt, swizzle, seed=5, data=data)
    for name, pick, flags in DIRECTIONS:
        a, b = pick(x, w, dy)
        want, _ = oracle(a, b, **flags)
        A = decode(a, not flags.get("trans_a", False)).astype(np.float32)
        B = decode(b, flags.get("trans_b", True)).astype(np.float32)
        fp32 = (A.T if flags.get("trans_a") else A) @ (B.T if flags.get("trans_b", True) else B)  # fp32 sums
        assert np.array_equal(fp32.astype(np.float64), want), name  # every sum exact
        np.testing.assert_array_equal(mxmla.gemm(a, b, out_dtype="float32", **flags), fp32)
        got = mxmla.gemm(a, b, out_dtype=BF16, **flags)
        assert got.dtype == BF16
        np.testing.assert_array_equal(got.view(np.uint16), fp32.astype(BF16).view(np.uint16))


def test_numpy_special_scales_and_zero_blocks():
    x = rand((40, 64), 0)
    x[3, :32] = 0  # a zero block
    x8, w8 = mxmla.quantize(x, swizzle=True), mxmla.quantize(rand((33, 64), 1))
    scales = x8.rowwise_scale_inv.reshape(-1)  # F8_128x4: one tile across the 2 block columns
    scales[_swz(5, 1, 1)] = 255  # NaN: row 5
    scales[_swz(7, 0, 1)] = 254  # huge: row 7 near or past the top of the range (±Inf)
    scales[_swz(9, 0, 1)] = 1    # tiny
    want, mag = oracle(x8, w8)
    for dt in ("bfloat16", "float32"):
        got = mxmla.gemm(x8, w8, out_dtype=dt)
        y = f64(got)
        assert np.isnan(y[5]).all() and not np.isnan(np.delete(y, 5, axis=0)).any()
        assert (np.abs(y[7]) > 1e30).all() and np.isinf(y[7]).any()  # 2^127-scaled: most overflow
        assert_close(got, want, mag, bf16=dt == "bfloat16")


@pytest.mark.parametrize("M,N,K", [(1, 31, 33), (31, 33, 100), (100, 1, 31), (33, 100, 1)])
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False), (True, True)])
def test_numpy_bf16_operands(M, N, K, trans_a, trans_b):
    a = rand((K, M) if trans_a else (M, K), 7).astype(BF16)
    b = rand((N, K) if trans_b else (K, N), 8).astype(BF16)
    y = mxmla.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    assert y.dtype == BF16 and y.shape == (M, N)  # ml_dtypes operands: an ml_dtypes result
    want, mag = oracle(a, b, trans_a, trans_b)
    assert_close(y, want, mag)
    y_bits = mxmla.gemm(a.view(np.uint16), b.view(np.uint16), trans_a=trans_a, trans_b=trans_b)
    assert y_bits.dtype == np.uint16
    np.testing.assert_array_equal(y_bits, y.view(np.uint16))


def test_numpy_strided_out_and_operands():
    x, w, _ = linear(33, 64, 32, seed=9)
    base = np.full((33, 40), 7.0, np.float32)
    out = base[:, :32]  # row stride 40
    assert mxmla.gemm(x, w, out=out) is out
    want, mag = oracle(x, w)
    assert_close(out, want, mag, bf16=False)
    assert (base[:, 32:] == 7.0).all()
    a = rand((31, 100), 1).astype(BF16)
    buf = np.zeros((31, 128), BF16)
    buf[:, :100] = a
    b = rand((5, 100), 2).astype(BF16)
    np.testing.assert_array_equal(mxmla.gemm(buf[:, :100], b).view(np.uint16), mxmla.gemm(a, b).view(np.uint16))


def test_numpy_empty_contraction_and_outputs():
    # wgrad over no tokens: the columnwise copies of [0, K] tensors
    dy, x = mxmla.quantize(np.zeros((0, 32), np.float32)), mxmla.quantize(np.zeros((0, 64), np.float32))
    y = mxmla.gemm(dy, x, trans_a=True, trans_b=False, out_dtype="float32")
    assert y.shape == (32, 64) and (y == 0).all()
    d = np.ones((32, 64), np.float32)
    mxmla.gemm(dy, x, trans_a=True, trans_b=False, out=d, accumulate=True)
    assert (d == 1).all()
    assert mxmla.gemm(dy, mxmla.quantize(np.zeros((5, 32), np.float32))).shape == (0, 5)


# ----------------------------------------------------------------------------- torch on the CPU
@needs_torch
@pytest.mark.parametrize("fmt,swizzle", [("e4m3", True), ("e5m2", False)])
def test_torch_cpu_matches_numpy(fmt, swizzle):
    xt, wt, dyt = linear(33, 64, 96, fmt, swizzle, seed=11, lib="torch")
    xn, wn, dyn = linear(33, 64, 96, fmt, swizzle, seed=11)
    for name, pick, flags in DIRECTIONS:
        for dt in ("bfloat16", "float32"):
            t = mxmla.gemm(*pick(xt, wt, dyt), out_dtype=getattr(torch, dt), **flags)
            n = mxmla.gemm(*pick(xn, wn, dyn), out_dtype=dt, **flags)
            assert isinstance(t, torch.Tensor) and t.dtype == getattr(torch, dt), name
            np.testing.assert_array_equal(np_(t).view(np.uint16 if dt == "bfloat16" else np.uint32),
                                          n.view(np.uint16 if dt == "bfloat16" else np.uint32))
    a, b = torch.randn(31, 40, dtype=torch.bfloat16), torch.randn(40, 17, dtype=torch.bfloat16)
    y = mxmla.gemm(a, b, trans_b=False)
    assert y.dtype == torch.bfloat16
    np.testing.assert_array_equal(np_(y).view(np.uint16), mxmla.gemm(np_(a), np_(b), trans_b=False).view(np.uint16))


@needs_torch
def test_torch_out_and_accumulate():
    x, w, dy = linear(40, 64, 32, seed=12, lib="torch")
    main_grad = torch.randn(32, 64)
    before = main_grad.clone()
    r = mxmla.gemm(dy, x, trans_a=True, trans_b=False, out=main_grad, accumulate=True)
    assert r is main_grad
    want, mag = oracle(dy, x, trans_a=True, trans_b=False, d=before)
    assert_close(main_grad, want, mag + np.abs(np_(before)), bf16=False)
    base = torch.zeros(40, 48, dtype=torch.bfloat16)
    out = base[:, 8:40]
    mxmla.gemm(x, w, out=out)
    assert torch.equal(out.view(torch.int16), mxmla.gemm(x, w).view(torch.int16))
    assert (base[:, :8] == 0).all() and (base[:, 40:] == 0).all()


# ----------------------------------------------------------------------------- errors
def test_errors_python_arguments():
    x, w, _ = linear(4, 64, 32)
    g = mxmla.gemm
    with pytest.raises(ValueError, match=r"mxmla.gemm: argument 'accumulate': adds into out"):
        g(x, w, accumulate=True)
    with pytest.raises(ValueError, match=r"argument 'out_dtype': float32 does not match out's dtype bfloat16"):
        g(x, w, out=np.zeros((4, 32), np.uint16), out_dtype="float32")
    with pytest.raises(ValueError, match=r"argument 'out_dtype': must be float32 or bfloat16"):
        g(x, w, out_dtype="float16")
    with pytest.raises(ValueError, match=r"argument 'trans_a': must be True or False"):
        g(x, w, trans_a=1)
    with pytest.raises(ValueError, match=r"argument 'alpha': must be a number"):
        g(x, w, alpha="2")
    with pytest.raises(TypeError, match=r"argument 'b': expected a torch.Tensor or numpy.ndarray, got list"):
        g(x, [[1.0]])
    with pytest.raises(TypeError, match=r"argument 'out': expected a torch.Tensor or numpy.ndarray"):
        g(x, w, out=[0])


def test_errors_from_the_core():
    x, w, dy = linear(4, 64, 32)
    g = mxmla.gemm
    with pytest.raises(ValueError, match=r"mxmla.gemm: argument 'b': contraction length 32 \(b's leading dim, "
                                         r"trans_b = false\) does not match a's K = 64"):
        g(x, w, trans_b=False)
    w_row = mxmla.quantize(np.ones((32, 64), np.float32), columnwise=False)
    with pytest.raises(ValueError, match=r"argument 'b.columnwise_data': is absent: .*\(dgrad reads W's: blocks of 32 "
                                         r"along N; .*quantize B with columnwise enabled"):
        g(dy, w_row, trans_b=False)
    x_col = mxmla.quantize(np.ones((4, 64), np.float32), rowwise=False)
    with pytest.raises(ValueError, match=r"argument 'a.rowwise_data': is absent"):
        g(x_col, w)
    with pytest.raises(ValueError, match=r"argument 'b': is bfloat16 but a is MXFP8"):
        g(x, np.ones((32, 64), BF16))
    with pytest.raises(ValueError, match=r"argument 'b': FP8 format e5m2 differs from a's e4m3"):
        g(x, mxmla.quantize(np.ones((32, 64), np.float32), fp8_format="e5m2"))
    with pytest.raises(ValueError, match=r"argument 'a': dtype float32 must be bfloat16"):
        g(np.ones((4, 64), np.float32), np.ones((32, 64), BF16))
    with pytest.raises(ValueError, match=r"argument 'out': dtype bfloat16 must be float32 with accumulate"):
        g(x, w, out=np.zeros((4, 32), BF16), accumulate=True)
    with pytest.raises(ValueError, match=r"argument 'out': shape \[4, 31\] must be \[M, N\] = \[4, 32\]"):
        g(x, w, out=np.zeros((4, 31), np.float32))
    with pytest.raises(ValueError, match=r"argument 'alpha': must be finite"):
        g(x, w, alpha=math.inf)
    att = mxmla.quantize_attention(np.ones((32, 1, 1, 64), np.float32))
    with pytest.raises(ValueError, match=r"argument 'a': is an attention hand-off tensor"):
        g(att, w)
    bad = mxmla.MXFP8Tensor((4, 64), "e4m3", "compact", x.rowwise_data, x.rowwise_scale_inv[:, :1])
    with pytest.raises(ValueError, match=r"argument 'a.rowwise_scale_inv': shape \[4, 1\] must be \[4, 2\]"):
        g(bad, w)


@needs_torch
def test_errors_torch():
    a = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"mxmla.gemm: argument 'a': requires grad, but gemm has no gradient"):
        mxmla.gemm(a.clone().requires_grad_(), w)
    with torch.no_grad():
        assert mxmla.gemm(a.clone().requires_grad_(), w).shape == (4, 32)
    with pytest.raises(RuntimeError, match=r"argument 'b': requires grad"):  # the custom op checks as well
        torch.ops.mxmla.gemm(a, w.clone().requires_grad_(), None, None, "", "", False, True, 1.0, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"argument 'out': requires grad"):
        mxmla.gemm(a, w, out=torch.zeros(4, 32, requires_grad=True))
    with pytest.raises(TypeError, match=r"argument 'b': expected a torch.Tensor like argument 'a', got numpy.ndarray"):
        mxmla.gemm(a, np_(w))
    x8 = mxmla.quantize(a.float(), rowwise=False)
    with pytest.raises(ValueError, match=r"argument 'a.rowwise_data': is absent"):
        mxmla.gemm(x8, mxmla.quantize(w))


# ----------------------------------------------------------------------------- the CUDA path
def _cuda(desc):
    """A descriptor marked cuda:0 (DLPack device type 2); its memory is never touched."""
    return desc[:4] + (2, 0)


def test_cuda_path_is_validated_first():
    """Through the core with descriptors marked cuda:0 (runs without a GPU): host memory described as
    CUDA is refused before anything runs; bad input keeps its own error; bf16 operands have no CUDA
    kernel."""
    x, w, _ = linear(4, 64, 32)
    y = np.zeros((4, 32), np.float32)

    def desc(a, dt):
        return _cuda((a.ctypes.data, dt, list(a.shape), [s // a.itemsize for s in a.strides], 1, 0))

    def operand(t):
        return (desc(t.rowwise_data, "uint8"), desc(t.rowwise_scale_inv, "uint8"), None, None, list(t.shape),
                core.Fp8Format.e4m3, core.ScaleLayout.compact, core.QKVLayout.sbhd, False)

    o = core.GemmOptions()
    # (a build without CUDA kernels says so instead of naming the device)
    with pytest.raises(ValueError, match=r"mxmla.gemm: argument 'a.rowwise_data': .*(cuda:0|no CUDA support)"):
        core.gemm(operand(x), operand(w), desc(y, "float32"), o, 0)
    assert (y == 0).all()
    with pytest.raises(ValueError, match=r"argument 'out': shape \[4, 31\]"):
        core.gemm(operand(x), operand(w), desc(y[:, :31], "float32"), o, 0)
    o.accumulate = True
    with pytest.raises(ValueError, match=r"argument 'out': dtype bfloat16 must be float32 with accumulate"):
        core.gemm(operand(x), operand(w), desc(y.view(np.uint16)[:, :32], "bfloat16"), o, 0)
    a, b = np.zeros((4, 8), np.uint16), np.zeros((8, 8), np.uint16)
    with pytest.raises(ValueError, match=r"the CUDA bf16 GEMM kernel is not available in this build yet"):
        core.gemm(desc(a, "bfloat16"), desc(b, "bfloat16"), desc(y[:, :8], "float32"), core.GemmOptions(), 0)


@needs_gpu
def test_cuda_tensors_match_the_reference():
    """The SM90 kernel against the CPU reference on the same MXFP8 operands, the three directions of a
    Linear (within the fp32-accumulation bound; the C++ suite compares integer data bit for bit)."""
    f = [rand(s, i) for i, s in enumerate(((100, 96), (64, 96), (100, 64)))]  # x [T, K], W [N, K], dy [T, N]
    cpu = [mxmla.quantize(torch.from_numpy(t)) for t in f]
    gpu = [mxmla.quantize(torch.from_numpy(t).cuda()) for t in f]
    for ta, tb, ia, ib in ((False, True, 0, 1), (False, False, 2, 1), (True, False, 2, 0)):
        want = mxmla.gemm(cpu[ia], cpu[ib], trans_a=ta, trans_b=tb, out_dtype="float32")
        got = mxmla.gemm(gpu[ia], gpu[ib], trans_a=ta, trans_b=tb, out_dtype="float32").cpu()
        scale = want.abs().max().item() + 1e-30
        assert (got - want).abs().max().item() <= 1e-5 * scale * 96, (ta, tb)
    with pytest.raises(ValueError, match=r"the CUDA bf16 GEMM kernel is not available"):
        mxmla.gemm(torch.ones(4, 64, device="cuda", dtype=torch.bfloat16),
                   torch.ones(32, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"argument 'b.rowwise_data': is on cpu:0 but a.rowwise_data is on cuda:0"):
        mxmla.gemm(gpu[0], cpu[1])


@needs_gpu
@pytest.mark.parametrize("splits", ["1", "2"])
@pytest.mark.parametrize("M,N,ld", [(192, 100, 104), (245, 226, 240), (127, 255, 256), (25, 1823, 1824),
                                    (64, 128, 136)])
def test_cuda_bf16_out_view_keeps_the_bytes_between_its_rows(M, N, ld, splits, monkeypatch):
    """A bf16 out view [M, N] with row stride ld > N that TMA could describe (16-byte aligned start and
    row stride): every byte of its buffer outside the view stays as it was, and the view equals the
    CPU reference's (integer data: bit for bit). Found by the GPU fuzzer (seeds 0, 44, 58, 63, 130 of
    gemm): the unsplit kernel's TMA epilogue stores whole 16-byte chunks of a row, so where N · 2 bytes
    is not a multiple of 16 it wrote zeros past column N; now it stores from the registers there.
    splits: MXMLA_GEMM_SPLITS (1: the unsplit kernel and its epilogue; 2: the split-K reduction)."""
    monkeypatch.setenv("MXMLA_GEMM_SPLITS", splits)
    K = 64
    a, b = (mxmla.quantize(torch.from_numpy(integers(s, i))) for i, s in enumerate(((M, K), (N, K))))
    base = torch.from_numpy(np.random.default_rng(3).integers(0, 1 << 16, (M + 1) * ld, dtype=np.int64)
                            .astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    want, got = base.clone(), base.cuda()
    # (an offset of 8 elements: a 16-byte aligned start that is not the allocation's)
    mxmla.gemm(a, b, out=want[8:8 + M * ld].view(M, ld)[:, :N])
    view = got[8:8 + M * ld].view(M, ld)[:, :N]
    assert view.data_ptr() % 16 == 0
    mxmla.gemm(*(mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout,
                                   *(None if x is None else x.cuda() for x in (t.rowwise_data, t.rowwise_scale_inv,
                                                                             t.columnwise_data, t.columnwise_scale_inv)))
                 for t in (a, b)), out=view)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


@needs_gpu
def test_cuda_contraction_up_to_the_32_bit_limit():
    """K is a 32-bit number in the CUDA kernels' tile coordinates (TMA's included). K = 2^31 - 256 runs:
    a [1, K] operand whose codes are zero but the last block of 32 (ones) against itself gives exactly
    32, so the last k-block is read from its place (about 5 s: one 1 x 1 output over 2^31 products).
    K past it is refused, naming b; before, the wrapped coordinate made TMA read zeros, silently."""
    def operand(K):
        codes = torch.zeros(1, K, dtype=torch.uint8, device="cuda")
        codes[0, -32:] = 0x38  # E4M3 1.0
        scales = torch.full((1, K // 32), 127, dtype=torch.uint8, device="cuda")  # 2^0
        return mxmla.MXFP8Tensor((1, K), "e4m3", "compact", codes, scales)
    try:
        a = operand(2**31 - 256)
        assert mxmla.gemm(a, a, out_dtype="float32").item() == 32.0
        del a
        b = operand(2**31 - 224)
        with pytest.raises(ValueError, match=r"argument 'b': contraction length K = 2147483424: the CUDA GEMM "
                                             r"kernels take at most 2\^31 - 256"):
            mxmla.gemm(b, b)
    finally:
        mxmla.release_scratch()  # (the call's ~26 GB of scratch back to the driver for the tests after)


@needs_gpu
@pytest.mark.parametrize("eb, want", [(100, 49 * 2.0**-123), (254, 49 * 2.0**31)], ids=["product_underflows",
                                                                                     "column_factor_overflows"])
def test_cuda_design_b_keeps_a_block_at_the_ends_of_the_scale_range(eb, want):
    """Design B (the FP8 tensor-core kernel, picked per call when a scale byte is too small for bf16
    copies) folds each block's sum with the factors 2^(ea-127), 2^(eb-127). One E5M2 block of the
    largest codes (57344 = 7·2^13, sum 32 · 57344² = 49 · 2^31) with ea = 0 against
    - eb = 100: times 2^-154 is 49 · 2^-123, a normal fp32 number; the factors' product 2^-154 alone is
      below fp32's range, and the kernel that formed it first gave 0 (the fuzzer's KI-3, gemm seed 168);
    - eb = 254: times 2^0 is 49 · 2^31; the sum times b's factor 2^127 alone is above fp32's range, and
      the kernel that multiplied by it first gave Inf.
    The reference gives both exactly, and so must the kernel."""
    def operand(e):
        codes = torch.full((1, 32), 0x7B, dtype=torch.uint8)  # E5M2 57344
        return mxmla.MXFP8Tensor((1, 32), "e5m2", "compact", codes, torch.full((1, 1), e, dtype=torch.uint8))
    a, b = operand(0), operand(eb)
    assert mxmla.gemm(a, b, out_dtype="float32").item() == want
    got = mxmla.gemm(*(mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout, t.rowwise_data.cuda(),
                                         t.rowwise_scale_inv.cuda()) for t in (a, b)), out_dtype="float32")
    assert got.item() == want


@needs_gpu
@pytest.mark.parametrize("M,N,K", [(1000, 300, 6176), (257, 1536, 480), (256, 256, 8192), (33, 1, 6240)])
def test_cuda_design_d_gives_design_c_bits(M, N, K, monkeypatch):
    """Design D (A's codes converted to bf16 in the GEMM's registers; chosen per call where A is
    rowwise, N small and K not short: all but 257 x 1536 x 480) makes design C's sums (A's bf16
    copy in memory) in design C's order: per call, forced D and forced C give the same bits, fp32 and bf16
    out, with K split (256 x 256 x 8192) or not, tails in M, N and K."""
    rng = np.random.default_rng(M + N + K)
    a, b = (mxmla.quantize(torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda()) for s in ((M, K), (N, K)))
    outs = {}
    for design in ("", "C", "D"):
        monkeypatch.setenv("MXMLA_GEMM_DESIGN", design)
        outs[design] = [mxmla.gemm(a, b, out_dtype=dt).cpu() for dt in ("float32", "bfloat16")]
    for design in ("C", "D"):
        for got, want in zip(outs[design], outs[""]):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), design


@needs_gpu
@pytest.mark.parametrize("M,N,K", [(1056, 320, 6244), (288, 1536, 480), (256, 256, 8192), (64, 32, 6177), (32, 96, 8193)])
def test_cuda_design_d_on_a_columnwise_a_gives_design_c_bits(M, N, K, monkeypatch):
    """Design D reading A's columnwise codes [K, M] (a wgrad's dY: ldmatrix.trans from the TMA tile,
    the fragment's rows permuted) makes design C's sums: per call (D where N is small and K not
    short: all but 288 x 1536 x 480), forced D and forced C give the same bits, fp32 and bf16 out. B columnwise
    [K, N] (a wgrad's x), K tails along both copies (6244, 6177, 8193: a partial last block), M and N
    tails, a K split (256 x 256 x 8192); where K allows it, B rowwise [N + 3, K] too (an odd N)."""
    rng = np.random.default_rng(M + N + K)
    q = lambda *shape: mxmla.quantize(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda())
    a = q(K, M)
    bs = [(q(K, N), False)] + ([(q(N + 3, K), True)] if K % 32 == 0 else [])
    for b, trans_b in bs:
        outs = {}
        for design in ("", "C", "D"):
            monkeypatch.setenv("MXMLA_GEMM_DESIGN", design)
            outs[design] = [mxmla.gemm(a, b, trans_a=True, trans_b=trans_b, out_dtype=dt).cpu()
                            for dt in ("float32", "bfloat16")]
        for design in ("C", "D"):
            for got, want in zip(outs[design], outs[""]):
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (design, trans_b)
        # and the values, against float64 sums of the dequantized operands: within the
        # fp32-accumulation bound K · 2^-24 · (|A| |B|)
        A = mxmla.dequantize(a, columnwise=True).cpu().double().numpy().T
        B = mxmla.dequantize(b, columnwise=not trans_b).cpu().double().numpy()
        B = B if trans_b else B.T
        got = outs["D"][0].double().numpy()
        assert (np.abs(got - A @ B.T) <= K * 2.0 ** -24 * (np.abs(A) @ np.abs(B).T) + 1e-30).all()


@needs_gpu
@pytest.mark.parametrize("splits", ["2", "3", "4"])
@pytest.mark.parametrize("M,N,K,cols", [(300, 200, 1056, False), (288, 520, 2080, True), (33, 1, 4096, False),
                                        (8500, 300, 1056, False), (8512, 300, 1056, True), (16896, 256, 1056, False)])
def test_cuda_design_d_with_a_k_split_gives_design_c_bits(M, N, K, cols, splits, monkeypatch):
    """Design D with K split in 2, 3, 4 parts (MXMLA_GEMM_SPLITS; design C's reduction pass adds the
    parts' fp32 sums): forced D gives forced C's bits, fp32 out, bf16 out, and a bf16 view with a
    row gap whose gap bytes stay as they were; integer inputs give the CPU reference's sums exactly.
    A rowwise A with M and N tails, a columnwise A (a wgrad's dy) with a partial tile, one column.
    On a GPU of 132 SMs (H100, H200): 8500 x 300 and 8512 x 300 have 134 tiles, so their first 66
    rows of tiles run whole in a launch of their own and only the last row of tiles is split (M and N
    tails; a rowwise A, and a columnwise A, whose M is a multiple of 32 as quantizing it along its
    rows requires: a view of A's codes and scales from row 8448); 16896 x 256 is one complete wave:
    nothing split."""
    monkeypatch.setenv("MXMLA_GEMM_SPLITS", splits)
    a = mxmla.quantize(torch.from_numpy(integers((K, M) if cols else (M, K), M)))
    b = mxmla.quantize(torch.from_numpy(integers((N, K), N + 1)))
    want = mxmla.gemm(a, b, trans_a=cols, out_dtype="float32")
    ga, gb = (mxmla.MXFP8Tensor(t.shape, t.fp8_format, t.scale_layout,
                                *(None if x is None else x.cuda() for x in (t.rowwise_data, t.rowwise_scale_inv,
                                                                          t.columnwise_data, t.columnwise_scale_inv)))
              for t in (a, b))
    ld = (N + 15) // 8 * 8  # a gap of 8 to 15 columns, rows 16-byte aligned
    outs = {}
    for design in ("C", "D"):
        monkeypatch.setenv("MXMLA_GEMM_DESIGN", design)
        buf = torch.full((M * ld,), -1.0, dtype=torch.bfloat16, device="cuda")
        mxmla.gemm(ga, gb, trans_a=cols, out=buf.view(M, ld)[:, :N])
        outs[design] = [mxmla.gemm(ga, gb, trans_a=cols, out_dtype=dt).cpu() for dt in ("float32", "bfloat16")]
        outs[design].append(buf.cpu())
        assert (buf.view(M, ld)[:, N:] == -1).all(), design
    for got, ref in zip(outs["D"], outs["C"]):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(outs["D"][0], torch.as_tensor(np.asarray(want)))


@needs_gpu
def test_cuda_design_d_hands_a_tiny_scale_block_to_design_b(monkeypatch):
    """Design D (A's codes dequantized in the GEMM's registers; chosen per call where N is small and K
    long) checks A's scales itself: a block of non-zero codes under a scale byte below the bf16-exact
    bound (E4M3 2^-9 under e = 1: 2^-135, which bf16 rounds to 0) sets the flag, and design B, queued
    after it, recomputes the output exactly. Forced (MXMLA_GEMM_DESIGN=D), the block is lost to bf16."""
    M, N, K = 3, 5, 6144  # (K long: the call picks design D)
    codes = torch.full((M, K), 0x38, dtype=torch.uint8)  # E4M3 1.0
    scales = torch.full((M, K // 32), 127, dtype=torch.uint8)
    codes[1, :32], scales[1, 0] = 0x01, 1                  # 2^-9 · 2^-126
    codes[1, 32:] = 0
    a = mxmla.MXFP8Tensor((M, K), "e4m3", "compact", codes, scales)
    b = mxmla.MXFP8Tensor((N, K), "e4m3", "compact", torch.full((N, K), 0x38, dtype=torch.uint8),
                          torch.full((N, K // 32), 127, dtype=torch.uint8))
    want = mxmla.gemm(a, b, out_dtype="float32")
    assert want[1].tolist() == [2.0**-130] * N and want[0].tolist() == [float(K)] * N
    ga, gb = (mxmla.MXFP8Tensor(t.shape, "e4m3", "compact", t.rowwise_data.cuda(), t.rowwise_scale_inv.cuda())
              for t in (a, b))
    assert torch.equal(mxmla.gemm(ga, gb, out_dtype="float32").cpu(), want)
    monkeypatch.setenv("MXMLA_GEMM_DESIGN", "D")
    forced = mxmla.gemm(ga, gb, out_dtype="float32").cpu()
    assert forced[1].tolist() == [0.0] * N and torch.equal(forced[0::2], want[0::2])



@needs_gpu
def test_cuda_design_d_on_a_columnwise_a_hands_a_tiny_scale_block_to_design_b(monkeypatch):
    """The same check where design D reads A's columnwise codes [K, M] (a wgrad's dY): row 1 of op(A)
    is column 1 of the codes, its first block 2^-9 under e = 1; design B recomputes it exactly."""
    M, N, K = 32, 5, 6144  # (K long: the call picks design D)
    codes = torch.full((K, M), 0x38, dtype=torch.uint8)  # E4M3 1.0
    scales = torch.full((K // 32, M), 127, dtype=torch.uint8)
    codes[:32, 1], scales[0, 1] = 0x01, 1                  # 2^-9 · 2^-126
    codes[32:, 1] = 0
    a = mxmla.MXFP8Tensor((K, M), "e4m3", "compact", None, None, codes, scales)
    b = mxmla.MXFP8Tensor((N, K), "e4m3", "compact", torch.full((N, K), 0x38, dtype=torch.uint8),
                          torch.full((N, K // 32), 127, dtype=torch.uint8))
    want = mxmla.gemm(a, b, trans_a=True, out_dtype="float32")
    assert want[1].tolist() == [2.0**-130] * N and want[0].tolist() == [float(K)] * N
    ga = mxmla.MXFP8Tensor((K, M), "e4m3", "compact", None, None, codes.cuda(), scales.cuda())
    gb = mxmla.MXFP8Tensor((N, K), "e4m3", "compact", b.rowwise_data.cuda(), b.rowwise_scale_inv.cuda())
    assert torch.equal(mxmla.gemm(ga, gb, trans_a=True, out_dtype="float32").cpu(), want)
    monkeypatch.setenv("MXMLA_GEMM_DESIGN", "D")
    forced = mxmla.gemm(ga, gb, trans_a=True, out_dtype="float32").cpu()
    assert forced[1].tolist() == [0.0] * N and torch.equal(forced[0], want[0]) and torch.equal(forced[2:], want[2:])

# ----------------------------------------------------------------------------- custom ops, torch.compile
@needs_torch
def test_custom_ops_are_registered_with_fakes():
    for name in ("gemm", "gemm_out"):
        assert isinstance(getattr(torch.ops.mxmla, name).default, torch._ops.OpOverload)
    a = torch.empty(40, 96, device="meta", dtype=torch.bfloat16)
    b = torch.empty(96, 24, device="meta", dtype=torch.bfloat16)
    y = torch.ops.mxmla.gemm(a, b, None, None, "", "", False, False, 1.0, torch.float32)
    assert y.shape == (40, 24) and y.dtype == torch.float32 and y.device.type == "meta"
    # MXFP8 operands: the codes read and the spec (quantized shape); wgrad dW [N, K] = dy[T, N]^T x[T, K]
    dy = torch.empty(33, 64, device="meta", dtype=torch.uint8)
    x = torch.empty(33, 96, device="meta", dtype=torch.uint8)
    s = torch.empty(2, 64, device="meta", dtype=torch.uint8)
    y = torch.ops.mxmla.gemm(dy, x, s, s, "e4m3:compact:-:33x64", "e4m3:compact:-:33x96", True, False, 1.0,
                             torch.bfloat16)
    assert y.shape == (64, 96) and y.dtype == torch.bfloat16


def _same(a, b):
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype]))


@needs_torch
def test_compile_fullgraph_mxfp8_and_bf16():
    x, w, dy = rand((33, 64), 0), rand((32, 64), 1), rand((33, 32), 2)
    x, w, dy = (torch.from_numpy(v) for v in (x, w, dy))

    def linear_step(x, w, dy, main_grad):
        x8, w8, dy8 = (mxmla.quantize(t) for t in (x, w, dy))
        y = mxmla.gemm(x8, w8)
        dx = mxmla.gemm(dy8, w8, trans_b=False, out_dtype=torch.float32)
        mxmla.gemm(dy8, x8, trans_a=True, trans_b=False, out=main_grad, accumulate=True, alpha=0.5)
        yb = mxmla.gemm(x.bfloat16(), w.bfloat16())
        return y, dx, yb, main_grad

    eager = linear_step(x, w, dy, torch.ones(32, 64))
    torch._dynamo.reset()
    compiled = torch.compile(linear_step, fullgraph=True, backend="aot_eager")(x, w, dy, torch.ones(32, 64))
    for e, c in zip(eager, compiled):
        assert _same(e, c)
