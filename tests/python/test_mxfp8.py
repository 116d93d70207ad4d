"""Python layer tests: numpy and torch front ends, the oracle check against ml_dtypes, layouts
against the SPEC's torch-view formulas (written here with numpy), errors, and the CLI."""
import os
import shutil
import subprocess

import numpy as np
import pytest

import mxmla

ml_dtypes = pytest.importorskip("ml_dtypes")

try:
    import torch
except ImportError:  # torch is optional: its tests skip
    torch = None

HAVE_GPU = torch is not None and torch.cuda.is_available() and bool(mxmla.info()["gpus"])
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or torch without CUDA): GPU test skipped")

FMT = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def rand(M, K, seed=0, spread=12):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    return x * np.exp2(rng.integers(-spread, spread, size=(M, 1))).astype(np.float32)


# ----------------------------------------------------------------------------- oracle: ml_dtypes
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_codes_match_ml_dtypes_where_no_saturation(fmt):
    """Codes = ml_dtypes' RNE conversion of x * 2^(127-e) (fp32 multiply), wherever ml_dtypes does
    not overflow: ml_dtypes maps values past max normal to NaN (e4m3fn) / Inf (e5m2), while SPEC §2
    saturates (cvt.satfinite), so only in-range values are compared."""
    f8, maxn = FMT[fmt]
    x = rand(256, 512, seed=1)
    q = mxmla.quantize(x, fp8_format=fmt)
    e = q.rowwise_scale_inv.astype(np.int32)  # [M, K/32]
    assert (e > 0).all() and (e < 254).all()
    mult = np.exp2(127.0 - e).astype(np.float32)
    y = x.reshape(256, 16, 32) * mult[:, :, None]
    expect = y.astype(f8).view(np.uint8).reshape(256, 512)
    in_range = (np.abs(y) <= maxn).reshape(256, 512)
    assert in_range.mean() > 0.99
    np.testing.assert_array_equal(q.rowwise_data[in_range], expect[in_range])
    # saturation where ml_dtypes overflows
    assert (q.rowwise_data[~in_range] & 0x7F == (0x7E if fmt == "e4m3" else 0x7B)).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scales_are_the_smallest_power_of_two_covering_amax(fmt):
    """ml_dtypes' float8_e8m0fnu decodes our scale bytes; the scale is ceil-rounded: 2^(e-127) >=
    fp32(amax * fp32(1/max)) > 2^(e-128). (ml_dtypes' own float32 -> e8m0 encoding rounds to nearest,
    not up, so it is only an oracle for decoding, and for exact powers of two.)"""
    _, maxn = FMT[fmt]
    x = rand(512, 256, seed=2)
    q = mxmla.quantize(x, fp8_format=fmt)
    scale = q.columnwise_scale_inv.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)  # [M/32, K]
    amax = np.abs(x.reshape(16, 32, 256)).max(axis=1)
    prod = (amax * np.float32(1.0 / maxn)).astype(np.float32).astype(np.float64)
    assert (scale >= prod).all() and (scale / 2 < prod).all()
    pow2 = np.exp2(np.arange(-20, 20, dtype=np.float32))
    np.testing.assert_array_equal(pow2.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8),
                                  (np.arange(-20, 20) + 127).astype(np.uint8))


def test_dequantize_matches_ml_dtypes_decode():
    x = rand(64, 128, seed=3)
    q = mxmla.quantize(x)
    for colw in (False, True):
        got = q.dequantize("float32", columnwise=colw)
        codes = (q.columnwise_data if colw else q.rowwise_data).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        s = (q.columnwise_scale_inv if colw else q.rowwise_scale_inv).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
        s = np.repeat(s, 32, axis=0)[:64] if colw else np.repeat(s, 32, axis=1)
        np.testing.assert_array_equal(got, (codes * s).astype(np.float32))
        assert np.abs(got - x).max() <= np.abs(x).max() * 2 ** -3


# ----------------------------------------------------------------------------- numpy front end
def test_bf16_as_uint16_and_tails():
    x = rand(33, 96, seed=4)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact bf16 values
    xb = (bits.astype(np.uint32) << 16).view(np.float32)
    qa = mxmla.quantize(bits)
    qb = mxmla.quantize(xb)
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(qa, name), getattr(qb, name))
    assert qa.columnwise_scale_inv.shape == (2, 96) and qa.rowwise_scale_inv.shape == (33, 3)
    back = qa.dequantize("bfloat16")
    assert back.dtype == np.uint16 and back.shape == (33, 96)


def test_nan_inf_policy():
    x = np.ones((32, 64), np.float32)
    x[0, 3] = np.nan
    x[5, 40] = np.inf
    q = mxmla.quantize(x)
    assert q.rowwise_scale_inv[0, 0] == 0xFF and (q.rowwise_data[0, :32] == 0x7F).all()
    assert q.rowwise_scale_inv[5, 1] == 0xFE and q.rowwise_data[5, 40] == 0x7E
    assert q.columnwise_scale_inv[0, 3] == 0xFF and q.columnwise_scale_inv[0, 40] == 0xFE
    assert np.isnan(q.dequantize("float32")[0, :32]).all() and not np.isnan(q.dequantize("float32")[0, 32:]).any()


def swizzle_np(S, rows_pad, cols_pad):
    """SPEC §2.1: pad with zeros, then S.view(M/128, 4, 32, Kb/4, 4).permute(0, 3, 2, 1, 4)."""
    P = np.zeros((rows_pad, cols_pad), np.uint8)
    P[: S.shape[0], : S.shape[1]] = S
    return P.reshape(rows_pad // 128, 4, 32, cols_pad // 4, 4).transpose(0, 3, 2, 1, 4).reshape(rows_pad, cols_pad)


def rup(a, b):
    return (a + b - 1) // b * b


@pytest.mark.parametrize("M,K", [(1, 32), (200, 96), (300, 544)])
def test_swizzled_scales_follow_spec_view(M, K):
    x = rand(M, K, seed=5)
    c = mxmla.quantize(x)
    s = mxmla.quantize(x, swizzle=True)
    np.testing.assert_array_equal(s.rowwise_data, c.rowwise_data)
    np.testing.assert_array_equal(s.rowwise_scale_inv, swizzle_np(c.rowwise_scale_inv, rup(M, 128), rup(K // 32, 4)))
    Mb = -(-M // 32)
    np.testing.assert_array_equal(s.columnwise_scale_inv, swizzle_np(c.columnwise_scale_inv.T, rup(K, 128), rup(Mb, 4)).reshape(rup(Mb, 4), rup(K, 128)))
    np.testing.assert_array_equal(mxmla.swizzle_scales(c.rowwise_scale_inv, M, K), s.rowwise_scale_inv)
    np.testing.assert_array_equal(mxmla.unswizzle_scales(s.columnwise_scale_inv, M, K, rowwise=False), c.columnwise_scale_inv)
    np.testing.assert_array_equal(s.dequantize("float32"), c.dequantize("float32"))


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_attention_bhsd_scales_follow_spec(layout):
    S, B, H, D = 45, 2, 3, 192
    x = rand(S * B * H, D, seed=6).reshape(S, B, H, D)
    xin = x if layout == "sbhd" else np.ascontiguousarray(x.transpose(1, 0, 2, 3))
    q = mxmla.quantize_attention(xin, layout=layout)
    for b in range(B):
        for h in range(H):
            seq = np.ascontiguousarray(x[:, b, h, :])  # [S, D]: one (b, h) sequence
            ref = mxmla.quantize(seq)
            np.testing.assert_array_equal(q.rowwise_scale_inv[b, h], swizzle_np(ref.rowwise_scale_inv, rup(S, 128), rup(D // 32, 4)))
            Sb = -(-S // 32)
            cs = swizzle_np(ref.columnwise_scale_inv.T, rup(D, 128), rup(Sb, 4))
            np.testing.assert_array_equal(q.columnwise_scale_inv[b, h].reshape(-1), cs.reshape(-1))
    # phase two equals fused
    p1 = mxmla.quantize_attention(xin, layout=layout, bhsd_scales=False)
    np.testing.assert_array_equal(mxmla.attention_scales_to_bhsd(p1.rowwise_scale_inv, xin.shape, layout, True), q.rowwise_scale_inv)
    np.testing.assert_array_equal(mxmla.attention_scales_to_bhsd(p1.columnwise_scale_inv, xin.shape, layout, False), q.columnwise_scale_inv)
    np.testing.assert_array_equal(q.dequantize("float32", columnwise=True), p1.dequantize("float32", columnwise=True))
    (b1,) = mxmla.to_bhsd(p1)
    np.testing.assert_array_equal(b1.rowwise_scale_inv, q.rowwise_scale_inv)
    np.testing.assert_array_equal(b1.columnwise_scale_inv, q.columnwise_scale_inv)


def test_strided_numpy_input():
    wide = rand(64, 160, seed=7)
    view = wide[:, 32:128]
    np.testing.assert_array_equal(mxmla.quantize(view).columnwise_data, mxmla.quantize(np.ascontiguousarray(view)).columnwise_data)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: mxmla.quantize(np.ones((4, 33), np.float32)), "mxmla.quantize: argument 'x': last dimension 33 must be a positive multiple of 32"),
        (lambda: mxmla.quantize(np.ones((4, 32), np.int32)), "argument '(x|input)': dtype int32 is not supported"),
        (lambda: mxmla.quantize(np.ones((4, 32), np.float32), fp8_format="e3m4"), "argument 'fp8_format'"),
        (lambda: mxmla.quantize(np.ones((4, 32), np.float32), rowwise=False, columnwise=False), "at least one"),
        (lambda: mxmla.quantize(np.ones((4, 64), np.float32)[:, ::2]), "last dimension must be contiguous"),
        (lambda: mxmla.quantize_attention(np.ones((4, 32), np.float32)), "must be 4-D"),
        (lambda: mxmla.quantize_attention(np.ones((4, 1, 1, 32), np.float32), layout="bhsd"), "argument 'layout'"),
        (lambda: mxmla.quantize([1.0] * 32), "expected a torch.Tensor or numpy.ndarray"),
        (lambda: mxmla.swizzle_scales(np.zeros((4, 2), np.uint8), 4, 96), "mxmla.swizzle_scales: argument 'scales': shape \\[4, 2\\] must be \\[4, 3\\]"),
    ],
)
def test_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ----------------------------------------------------------------------------- torch
@needs_torch
def test_torch_cpu_returns_torch():
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    q = mxmla.quantize(x)
    assert isinstance(q.rowwise_data, torch.Tensor) and q.rowwise_data.dtype == torch.uint8
    ref = mxmla.quantize(x.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(q.rowwise_data.numpy(), ref.rowwise_data)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


@needs_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("swizzle", [False, True])
def test_torch_cuda_matches_cpu_reference(dtype, swizzle):
    torch.manual_seed(0)
    x = (torch.randn(300, 544) * torch.exp2(torch.randint(-10, 10, (300, 1)).float())).to(getattr(torch, dtype))
    x[3, 7] = float("nan")
    x[40, 100] = float("inf")
    qg = mxmla.quantize(x.cuda(), swizzle=swizzle)
    qc = mxmla.quantize(x, swizzle=swizzle)
    assert qg.rowwise_data.is_cuda
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(qg, name).cpu(), getattr(qc, name)), name
    for colw in (False, True):
        a = qg.dequantize(torch.float32, columnwise=colw).cpu()
        b = qc.dequantize(torch.float32, columnwise=colw)
        assert torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))


@needs_gpu
def test_torch_cuda_uses_current_stream_and_attention():
    x = torch.randn(2, 130, 4, 192, device="cuda", dtype=torch.bfloat16)  # bshd
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q = mxmla.quantize_attention(x, layout="bshd")
    s.synchronize()
    ref = mxmla.quantize_attention(x.cpu(), layout="bshd")
    assert torch.equal(q.rowwise_scale_inv.cpu(), ref.rowwise_scale_inv)
    assert torch.equal(q.columnwise_scale_inv.cpu(), ref.columnwise_scale_inv)
    assert torch.equal(q.columnwise_data.cpu(), ref.columnwise_data)


@needs_gpu
def test_torch_cuda_strided_and_misaligned():
    wide = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    view = wide[:, 64:160]
    assert torch.equal(mxmla.quantize(view).rowwise_data.cpu(), mxmla.quantize(view.cpu()).rowwise_data)
    flat = torch.randn(32 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mxmla.quantize(flat[1:].view(32, 64))


# ----------------------------------------------------------------------------- CLI
def cli():
    exe = os.environ.get("MXMLA_CLI") or shutil.which("mxmla")
    if not exe:
        here = os.path.dirname(os.path.dirname(mxmla.__file__))  # build/python
        cand = os.path.join(os.path.dirname(here), "bin", "mxmla")
        exe = cand if os.path.exists(cand) else None
    if not exe:
        pytest.skip("the mxmla command-line tool is not built (set MXMLA_CLI)")
    return exe


def test_cli_info_and_errors():
    r = subprocess.run([cli(), "info"], capture_output=True, text=True)
    assert r.returncode == 0 and "mxmla" in r.stdout and "quantize" in r.stdout
    assert "fused_q_uproj_rope_quant" in r.stdout
    r = subprocess.run([cli(), "run-quantize", "--head-dim", "100"], capture_output=True, text=True)
    assert r.returncode == 2 and "--head-dim" in r.stderr and "multiple of 32" in r.stderr
    r = subprocess.run([cli(), "run", "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "--bogus" in r.stderr
    r = subprocess.run([cli(), "run", "--style", "spin"], capture_output=True, text=True)
    assert r.returncode == 2 and "--style" in r.stderr and "rotate_half" in r.stderr


def test_cli_run_cpu_reference():
    r = subprocess.run([cli(), "run", "--device", "cpu", "--tokens", "64", "--heads", "4", "--k", "128"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CPU reference" in r.stdout and "fused q up-projection" in r.stdout and "OK" in r.stdout
    r = subprocess.run([cli(), "run-quantize", "--device", "cpu", "--tokens", "64", "--heads", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CPU reference" in r.stdout and "OK" in r.stdout
