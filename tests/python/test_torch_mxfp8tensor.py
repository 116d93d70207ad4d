"""MXFP8Tensor as PyTorch users meet it: codes and scales as torch's own fp8 dtypes (numpy: the
ml_dtypes types), TransformerEngine's MXFP8Tensor fields (names, shapes, padding, swizzle flag),
torch._scaled_mm's MX arguments (checked against torch's own rules on fake CUDA tensors: MX
scaled_mm runs only on SM100), and a compact repr."""
import numpy as np
import pytest

import mxmla

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def rup(a, b):
    return (a + b - 1) // b * b


# ----------------------------------------------------------------------------- fp8 dtypes
@pytest.mark.parametrize("fmt,dt", [("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2")])
def test_view_fp8_gives_torch_fp8_dtypes_without_copy(fmt, dt):
    x = torch.randn(64, 96)
    q = mxmla.quantize(x, fp8_format=fmt)
    assert q.rowwise_data.dtype == torch.uint8  # stored as TE stores them
    assert q.fp8_dtype == getattr(torch, dt) and q.scale_dtype == torch.float8_e8m0fnu
    v = q.view_fp8()
    for name in FIELDS:
        a, b = getattr(q, name), getattr(v, name)
        assert b.data_ptr() == a.data_ptr()
        assert b.dtype == (torch.float8_e8m0fnu if "scale" in name else getattr(torch, dt))
    # the typed codes are the values: codes * 2^(scale - 127) is dequantize, computed by torch
    codes = v.rowwise_data.float()
    scales = v.rowwise_scale_inv.float().repeat_interleave(32, dim=1)
    assert torch.equal(codes * scales, q.dequantize(torch.float32))
    # the typed tensor is accepted everywhere the uint8 one is, and converts back
    assert torch.equal(v.dequantize(torch.float32), q.dequantize(torch.float32))
    assert torch.equal(mxmla.swizzle_scales(v.rowwise_scale_inv, 64, 96), mxmla.swizzle_scales(q.rowwise_scale_inv, 64, 96))
    assert all(getattr(v.view_uint8(), n).dtype == torch.uint8 for n in FIELDS)


def test_codes_of_the_wrong_fp8_type_are_rejected():
    q = mxmla.quantize(torch.randn(32, 64))
    wrong = mxmla.MXFP8Tensor(q.shape, "e5m2", "compact", q.rowwise_data.view(torch.float8_e4m3fn),
                              q.rowwise_scale_inv)
    with pytest.raises(ValueError, match="mxmla.dequantize: argument 'q.rowwise_data': dtype float8_e4m3 must be uint8 "
                                         "or float8_e5m2"):
        wrong.dequantize()


def test_numpy_views_are_ml_dtypes():
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    q = mxmla.quantize(x)
    v = q.view_fp8()
    assert v.rowwise_data.dtype == ml_dtypes.float8_e4m3fn and v.columnwise_scale_inv.dtype == ml_dtypes.float8_e8m0fnu
    np.testing.assert_array_equal(v.dequantize("float32"), q.dequantize("float32"))
    vals = v.rowwise_data.astype(np.float32) * np.repeat(v.rowwise_scale_inv.astype(np.float32), 32, axis=1)
    np.testing.assert_array_equal(vals, q.dequantize("float32"))


# ----------------------------------------------------------------------------- TransformerEngine
def te_scale_shapes(shape):
    """TE MXFP8Quantizer.get_scale_shape (rowwise, columnwise), for M % 32 == 0."""
    M = int(np.prod(shape[:-1]))
    K = shape[-1]
    return (rup(M, 128), rup(K // 32, 4)), (rup(M // 32, 4), rup(K, 128))


@pytest.mark.parametrize("shape", [(200, 96), (4, 64, 320)])
def test_te_kwargs_compact_are_padded_like_te_allocates(shape):
    x = torch.randn(*shape)
    q = mxmla.quantize(x)
    kw = q.to_te_kwargs()
    assert set(kw) == {"shape", "dtype", "rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
                       "fp8_dtype", "quantizer", "requires_grad", "device", "with_gemm_swizzled_scales"}
    rs_shape, cs_shape = te_scale_shapes(shape)
    assert kw["rowwise_scale_inv"].shape == rs_shape and kw["columnwise_scale_inv"].shape == cs_shape
    assert kw["rowwise_scale_inv"].dtype == torch.uint8 and kw["rowwise_data"].dtype == torch.uint8
    assert kw["rowwise_data"] is q.rowwise_data and kw["columnwise_data"] is q.columnwise_data  # codes: no copy
    assert kw["with_gemm_swizzled_scales"] is False and kw["shape"] == shape and kw["dtype"] == torch.bfloat16
    M, K = int(np.prod(shape[:-1])), shape[-1]
    rs = kw["rowwise_scale_inv"]
    assert torch.equal(rs[:M, : K // 32], q.rowwise_scale_inv) and int(rs[M:].sum()) == 0 and int(rs[:, K // 32:].sum()) == 0
    cs = kw["columnwise_scale_inv"]
    assert torch.equal(cs[: -(-M // 32), :K], q.columnwise_scale_inv) and int(cs[:, K:].sum()) == 0
    # the swizzle TE's GEMM applies to these padded compact scales is mxmla's swizzle
    assert torch.equal(mxmla.swizzle_scales(q.rowwise_scale_inv, M, K),
                       mxmla.quantize(x, swizzle=True).rowwise_scale_inv)


def test_te_kwargs_swizzled_and_attribute_names():
    q = mxmla.quantize(torch.randn(300, 544), swizzle=True)
    kw = q.to_te_kwargs(attributes=True)
    assert set(kw) == {"_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv", "_fp8_dtype",
                       "_with_gemm_swizzled_scales"}
    assert kw["_with_gemm_swizzled_scales"] is True
    assert kw["_rowwise_scale_inv"] is q.rowwise_scale_inv and kw["_rowwise_scale_inv"].shape == (384, 20)
    assert kw["_columnwise_scale_inv"].shape == (12, 640)
    assert kw["_fp8_dtype"] in (torch.float8_e4m3fn,) or int(kw["_fp8_dtype"]) == 7  # TE's kFloat8E4M3 when installed


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_te_kwargs_attention(layout):
    s, b, h, d = 64, 2, 3, 192
    x = torch.randn(s, b, h, d) if layout == "sbhd" else torch.randn(b, s, h, d)
    comp = mxmla.quantize_attention(x, layout=layout, bhsd_scales=False).to_te_kwargs()
    # TE's fused Q up-projection / mxfp8_quantize_only wrap the compact scales as 4-D views
    assert comp["with_gemm_swizzled_scales"] is False
    assert comp["rowwise_scale_inv"].shape == x.shape[:-1] + (d // 32,)
    assert comp["columnwise_scale_inv"].shape == ((s // 32, b, h, d) if layout == "sbhd" else (b, s // 32, h, d))
    bh = mxmla.quantize_attention(x, layout=layout)
    kw = bh.to_te_kwargs()
    assert kw["with_gemm_swizzled_scales"] is True
    assert kw["rowwise_scale_inv"].shape == (b * h * 128, 8) and kw["columnwise_scale_inv"].shape == (b * h * 4, 256)
    assert kw["rowwise_scale_inv"].data_ptr() == bh.rowwise_scale_inv.data_ptr()  # a view, no copy


def test_fused_q_output_matches_te_wrap_mxfp8_layout():
    """TE's FusedMLAQUpProjRopeQuant.wrap_mxfp8: rowwise scales viewed [s, b, nh, d/32], columnwise
    [s/32, b, nh, d], no swizzle."""
    T, H, K = 64, 2, 64
    x = torch.randint(-2, 3, (T, K)).to(torch.bfloat16)
    w = torch.randint(-2, 3, (H * 192, K)).to(torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(T))
    kw = mxmla.fused_q_uproj_rope_quant(x, w, c, s).to_te_kwargs()
    assert kw["shape"] == (T, 1, H, 192) and kw["rowwise_scale_inv"].shape == (T, 1, H, 6)
    assert kw["columnwise_scale_inv"].shape == (T // 32, 1, H, 192) and kw["with_gemm_swizzled_scales"] is False


def test_te_kwargs_need_torch_buffers():
    with pytest.raises(TypeError, match="to_te_kwargs: TransformerEngine takes torch tensors"):
        mxmla.quantize(np.ones((32, 32), np.float32)).to_te_kwargs()


# ----------------------------------------------------------------------------- torch._scaled_mm
def test_scaled_mm_args_have_the_form_torch_checks_for_mx():
    """torch's own shape/dtype/layout rules for MX block scaling (BlockWise1x32), run on fake CUDA
    tensors of the same shapes, strides and dtypes (torch's MX kernel needs SM100)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    M, N, K = 200, 256, 96
    a_q = mxmla.quantize(torch.randn(M, K), columnwise=False)  # compact scales: swizzled for torch
    w_q = mxmla.quantize(torch.randn(N, K), columnwise=False, swizzle=True)
    a, b, sa, sb = a_q.scaled_mm_args(w_q)
    assert a.dtype == torch.float8_e4m3fn and a.shape == (M, K) and a.stride() == (K, 1)
    assert b.dtype == torch.float8_e4m3fn and b.shape == (K, N) and b.stride() == (1, K)  # column-major
    assert sa.dtype == sb.dtype == torch.float8_e8m0fnu
    assert sa.shape == (rup(M, 128), rup(K // 32, 4)) and sb.shape == (rup(N, 128), rup(K // 32, 4))
    assert torch.equal(sa.view(torch.uint8), mxmla.swizzle_scales(a_q.rowwise_scale_inv, M, K))
    assert sb.data_ptr() == w_q.rowwise_scale_inv.data_ptr()
    with FakeTensorMode(allow_non_fake_inputs=True):
        like = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")  # noqa: E731
        out = torch._scaled_mm(like(a), like(b), like(sa), like(sb), out_dtype=torch.bfloat16)
        assert out.shape == (M, N) and out.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="Invalid blockwise scaling"):
            torch._scaled_mm(like(a), like(b), like(sa)[:128], like(sb), out_dtype=torch.bfloat16)


def test_scaled_mm_numerics_where_torch_runs_it():
    """On the CPU torch runs per-tensor scaling only, on Hopper it raises for MX: both skip. On an
    SM100 GPU this checks torch's MX GEMM against the dequantized operands."""
    dev = "cuda" if torch.cuda.is_available() and mxmla.info()["cuda_enabled"] and mxmla.info()["gpus"] else "cpu"
    a_q = mxmla.quantize(torch.randn(128, 64, device=dev), columnwise=False)
    w_q = mxmla.quantize(torch.randn(128, 64, device=dev), columnwise=False)
    args = a_q.scaled_mm_args(w_q)
    try:
        got = torch._scaled_mm(*args, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run MX block scaling on {dev} here (it needs SM100): "
                    f"{str(e).splitlines()[0]}")
    ref = a_q.dequantize(torch.float32).double() @ w_q.dequantize(torch.float32).double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_scaled_mm_args_errors():
    a = mxmla.quantize(torch.randn(64, 64), rowwise=False)
    w = mxmla.quantize(torch.randn(64, 96))
    with pytest.raises(ValueError, match="argument 'self': needs rowwise torch buffers"):
        a.scaled_mm_args(w)
    with pytest.raises(ValueError, match="argument 'other': K = 96 does not match K = 64"):
        mxmla.quantize(torch.randn(64, 64)).scaled_mm_args(w)
    with pytest.raises(ValueError, match="attention"):
        mxmla.quantize(torch.randn(64, 64)).scaled_mm_args(mxmla.quantize_attention(torch.randn(32, 1, 2, 64)))
    with pytest.raises(TypeError, match="argument 'other': expected an MXFP8Tensor"):
        w.scaled_mm_args(torch.randn(3))


# ----------------------------------------------------------------------------- repr
def test_repr_is_compact():
    q = mxmla.quantize(torch.randn(4096, 192), columnwise=False, swizzle=True)
    r = repr(q)
    assert r == "MXFP8Tensor(shape=(4096, 192), fp8_format='e4m3', scale_layout='swizzled', rowwise, device='cpu')"
    a = mxmla.quantize_attention(torch.randn(33, 2, 3, 64), layout="sbhd")
    assert repr(a) == ("MXFP8Tensor(shape=(33, 2, 3, 64), fp8_format='e4m3', scale_layout='bhsd', attention='sbhd', "
                       "rowwise+columnwise, device='cpu')")
    assert "numpy" in repr(mxmla.quantize(np.ones((32, 32), np.float32)))
    assert len(r) < 200 and "tensor(" not in r
