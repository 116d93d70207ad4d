"""numpy callers: ml_dtypes.bfloat16 arrays are bfloat16 everywhere (inputs, tables, outputs come
back as ml_dtypes.bfloat16); uint16 arrays are bfloat16 bits where the op takes bfloat16 and come
back as uint16; results are bit-identical between the two spellings."""
import numpy as np
import pytest

import mxmla

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = ml_dtypes.bfloat16
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def bf16_pair(*shape, seed=0, integer=False):
    """The same bfloat16 values as (ml_dtypes array, uint16 bits)."""
    rng = np.random.default_rng(seed)
    v = rng.integers(-4, 5, shape).astype(np.float32) if integer else rng.standard_normal(shape).astype(np.float32)
    a = v.astype(BF16)
    return a, a.view(np.uint16)


def same_q(a, b):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_quantize_and_attention_take_ml_dtypes_bf16():
    a, u = bf16_pair(70, 96, seed=1)
    same_q(mxmla.quantize(a), mxmla.quantize(u))
    same_q(mxmla.quantize(a, swizzle=True), mxmla.quantize(a.astype(np.float32), swizzle=True))
    a4, u4 = bf16_pair(40, 2, 3, 64, seed=2)
    same_q(mxmla.quantize_attention(a4), mxmla.quantize_attention(u4))


def test_dequantize_dtypes_for_numpy():
    q = mxmla.quantize(bf16_pair(64, 64, seed=3)[0])
    ml = q.dequantize(BF16)
    bits = q.dequantize("bfloat16")
    assert ml.dtype == BF16 and bits.dtype == np.uint16
    np.testing.assert_array_equal(ml.view(np.uint16), bits)
    f = q.dequantize(np.float32)
    assert f.dtype == np.float32
    np.testing.assert_array_equal(q.dequantize(np.dtype("float32")), f)
    np.testing.assert_array_equal(ml.astype(np.float32), f)  # E4M3 times a power of two is exact in bf16


@pytest.mark.parametrize("style", ["interleaved_in_halves_out", "interleaved", "rotate_half"])
def test_rope_bf16_in_bf16_out_per_flavour(style):
    a, u = bf16_pair(9, 2, 3, 192, seed=4)
    c, s = mxmla.rope_tables(mxmla.positions_arange(9), style=style)
    ya, yu = mxmla.apply_rope(a, c, s, style=style), mxmla.apply_rope(u, c, s, style=style)
    assert ya.dtype == BF16 and yu.dtype == np.uint16
    np.testing.assert_array_equal(ya.view(np.uint16), yu)
    ga = mxmla.rope_backward(a, c, s, style=style)
    assert ga.dtype == BF16
    np.testing.assert_array_equal(ga.view(np.uint16), mxmla.rope_backward(u, c, s, style=style))
    out = np.empty_like(a)  # out= of the ml_dtypes flavour
    mxmla.apply_rope(a, c, s, style=style, out=out)
    np.testing.assert_array_equal(out.view(np.uint16), yu)


def test_bf16_tables_both_flavours():
    pos = mxmla.positions_arange(16)
    cm, sm = mxmla.rope_tables(pos, dtype=BF16)
    cu, su = mxmla.rope_tables(pos, dtype="bfloat16")
    assert cm.dtype == BF16 and cu.dtype == np.uint16
    np.testing.assert_array_equal(cm.view(np.uint16), cu)
    x = bf16_pair(16, 1, 2, 192, seed=5)[1]
    np.testing.assert_array_equal(mxmla.apply_rope(x, cm, sm), mxmla.apply_rope(x, cu, su))


def test_rope_backward_quantize_dx_copy_flavours():
    a, u = bf16_pair(8, 2, 2, 192, seed=6)
    c, s = mxmla.rope_tables(mxmla.positions_arange(8))
    qa, dxa = mxmla.rope_backward_quantize(a, c, s, dx_copy="bfloat16")
    qu, dxu = mxmla.rope_backward_quantize(u, c, s, dx_copy="bfloat16")
    same_q(qa, qu)
    assert dxa.dtype == BF16 and dxu.dtype == np.uint16
    np.testing.assert_array_equal(dxa.view(np.uint16), dxu)
    f = np.zeros((8, 2, 2, 192), np.float32)
    assert mxmla.rope_backward_quantize(f, c, s, dx_copy="bfloat16")[1].dtype == np.uint16  # fp32 in: bits, as before
    assert mxmla.rope_backward_quantize(f, c, s, dx_copy=BF16)[1].dtype == BF16  # asked for by type
    assert mxmla.rope_backward_quantize(f, c, s, dx_copy=np.float32)[1].dtype == np.float32


def test_fused_q_takes_ml_dtypes_and_returns_q_in_that_flavour():
    T, H, K = 40, 2, 64
    xa, xu = bf16_pair(T, K, seed=7, integer=True)
    wa, wu = bf16_pair(H * 192, K, seed=8, integer=True)
    c, s = mxmla.rope_tables(mxmla.positions_arange(T))
    qa, qba = mxmla.fused_q_uproj_rope_quant(xa, wa, c, s, return_q=True)
    qu, qbu = mxmla.fused_q_uproj_rope_quant(xu, wu, c, s, return_q=True)
    same_q(qa, qu)
    assert qba.dtype == BF16 and qbu.dtype == np.uint16
    np.testing.assert_array_equal(qba.view(np.uint16), qbu)


def test_uint16_outside_bf16_arguments_is_rejected():
    with pytest.raises(ValueError, match="mxmla.unswizzle_scales: argument 'scales': dtype uint16 is not supported here"):
        mxmla.unswizzle_scales(np.zeros((128, 4), np.uint16), 4, 64)
    q = mxmla.quantize_attention(np.ones((32, 1, 2, 64), np.float32), bhsd_scales=False)
    with pytest.raises(ValueError, match="mxmla.attention_scales_to_bhsd: argument 'scales': dtype uint16"):
        mxmla.attention_scales_to_bhsd(q.rowwise_scale_inv.astype(np.uint16), (32, 1, 2, 64))
    with pytest.raises(ValueError, match="mxmla.apply_rope: argument 'cu_seqlens': dtype bfloat16 is not supported"):
        mxmla.apply_rope(np.zeros((4, 1, 64), np.float32), *mxmla.rope_tables(range(4)), layout="thd",
                         cu_seqlens=np.zeros(2, BF16))
