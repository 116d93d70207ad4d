"""One rule for errors everywhere: the message names the op, the argument the user passed, and the
rule. One case per problem found in review (empty inputs, cu_seqlens, bool / int / choice
arguments, dequantize's q, the fused class, YaRN keys), then every public function's arguments
(types, torch vs numpy mixing, devices)."""
import numpy as np
import pytest

import mxmla

try:
    import torch
except ImportError:  # torch is optional: its cases skip
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
HAVE_GPU = torch is not None and torch.cuda.is_available() and bool(mxmla.info()["gpus"]) and \
    mxmla.info()["cuda_enabled"]
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU test skipped")


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def bf16(*shape):
    return np.zeros(shape, np.uint16)


C, S = mxmla.rope_tables(mxmla.positions_arange(8))


# ----------------------------------------------------------------------------- empty inputs work
def test_empty_quantize_numpy_and_torch():
    for swizzle in (False, True):
        q = mxmla.quantize(np.zeros((0, 64), np.float32), swizzle=swizzle)
        ref = mxmla.quantize(np.zeros((1, 64), np.float32), swizzle=swizzle)
        assert q.rowwise_data.shape == (0, 64) and q.columnwise_data.shape == (0, 64)
        assert q.rowwise_scale_inv.shape == ((0, 4) if swizzle else (0, 2))
        assert q.columnwise_scale_inv.shape == ((0, 128) if swizzle else (0, 64))
        assert ref.rowwise_scale_inv.shape[1] == q.rowwise_scale_inv.shape[1]
        assert q.dequantize("float32").shape == (0, 64) and q.dequantize("bfloat16", columnwise=True).shape == (0, 64)
    q3 = mxmla.quantize(np.zeros((2, 0, 64), np.float32))
    assert q3.rowwise_data.shape == (2, 0, 64) and q3.rowwise_scale_inv.shape == (0, 2)
    assert mxmla.swizzle_scales(np.zeros((0, 2), np.uint8), 0, 64).shape == (0, 4)
    if torch is not None:
        qt = mxmla.quantize(torch.zeros(0, 64, dtype=torch.bfloat16))
        assert qt.rowwise_data.shape == (0, 64) and qt.dequantize(torch.bfloat16).shape == (0, 64)


def test_empty_rope_t0_and_s0():
    c, s = mxmla.rope_tables([])
    assert c.shape == (0, 64)
    assert mxmla.apply_rope(np.zeros((0, 3, 192), np.float32), C, S, layout="thd").shape == (0, 3, 192)
    assert mxmla.apply_rope(np.zeros((0, 2, 3, 192), np.float32), c, s).shape == (0, 2, 3, 192)
    assert mxmla.rope_backward(bf16(2, 0, 3, 192), c, s, layout="bshd").shape == (2, 0, 3, 192)
    q, dx = mxmla.rope_backward_quantize(np.zeros((0, 2, 3, 192), np.float32), c, s, dx_copy="bfloat16")
    assert q.shape == (0, 576) and q.rowwise_scale_inv.shape == (0, 18) and dx.shape == (0, 2, 3, 192)
    q = mxmla.rope_backward_quantize(np.zeros((0, 3, 192), np.float32), c, s, layout="thd", cu_seqlens=[0, 0])
    assert q.columnwise_scale_inv.shape == (0, 576)


def test_empty_attention_s0():
    for bhsd in (False, True):
        q = mxmla.quantize_attention(np.zeros((0, 2, 3, 64), np.float32), bhsd_scales=bhsd)
        assert q.rowwise_data.shape == (0, 2, 3, 64)
        assert q.rowwise_scale_inv.shape == ((2, 3, 0, 4) if bhsd else (0, 2))
        assert q.columnwise_scale_inv.shape == ((2, 3, 0, 128) if bhsd else (0, 384))
    (b,) = mxmla.to_bhsd(mxmla.quantize_attention(np.zeros((2, 0, 3, 64), np.float32), "bshd", bhsd_scales=False))
    assert b.rowwise_scale_inv.shape == (2, 3, 0, 4)


def test_empty_fused_t0():
    w = bf16(2 * 192, 64)
    q, qb = mxmla.fused_q_uproj_rope_quant(bf16(0, 64), w, C, S, return_q=True)
    assert q.shape == (0, 1, 2, 192) and qb.shape == (0, 1, 2, 192)
    assert q.rowwise_scale_inv.shape == (0, 6) and q.columnwise_scale_inv.shape == (0, 384)
    qb2 = mxmla.fused_q_uproj_rope_quant(bf16(0, 64), w, C, S, batch=2, layout="bshd", bhsd_scales=True)
    assert qb2.shape == (2, 0, 2, 192) and qb2.rowwise_scale_inv.shape == (2, 2, 0, 8)


# ----------------------------------------------------------------------------- cu_seqlens
def test_cu_seqlens_as_a_list_or_tuple_of_ints():
    x = f32(8, 2, 192)
    want = mxmla.apply_rope(x, C, S, layout="thd", cu_seqlens=np.array([0, 3, 8], np.int32))
    np.testing.assert_array_equal(mxmla.apply_rope(x, C, S, layout="thd", cu_seqlens=[0, 3, 8]), want)
    np.testing.assert_array_equal(mxmla.apply_rope(x, C, S, layout="thd", cu_seqlens=(0, 3, 8)), want)
    np.testing.assert_array_equal(mxmla.apply_rope(x, C, S, layout="thd", cu_seqlens=[np.int64(0), 3, 8]), want)
    if torch is not None:
        xt, ct, st = torch.from_numpy(x), torch.from_numpy(C), torch.from_numpy(S)
        np.testing.assert_array_equal(mxmla.apply_rope(xt, ct, st, layout="thd", cu_seqlens=[0, 3, 8]).numpy(), want)


@pytest.mark.parametrize(
    "cu,exc,match",
    [
        ([0, 3.5, 8], ValueError, "mxmla.apply_rope: argument 'cu_seqlens\\[1\\]': must be an int, got 3.5"),
        ([0, True, 8], ValueError, "argument 'cu_seqlens\\[1\\]': must be an int, got True"),
        (np.array([0, 3, 8], np.float32), ValueError, "argument 'cu_seqlens': dtype float32 must be int32 or int64"),
        (np.array([0, 3, 8], np.float64), ValueError, "argument 'cu_seqlens': dtype float64 is not supported \\(int32 or int64\\)"),
        (np.array([0, 3, 8], np.uint16), ValueError, "argument 'cu_seqlens': dtype uint16 is not supported here \\(int32 or int64\\)"),
        ("0,3,8", TypeError, "argument 'cu_seqlens': must be a list / tuple of ints or an int32 / int64 array"),
        (np.array([0, 3, 9], np.int64), ValueError, "argument 'cu_seqlens': last entry 9 is out of range"),
    ],
)
def test_cu_seqlens_errors_name_cu_seqlens(cu, exc, match):
    with pytest.raises(exc, match=match):
        mxmla.apply_rope(f32(8, 2, 192), C, S, layout="thd", cu_seqlens=cu)


@needs_torch
def test_cu_seqlens_torch_float_and_numpy_mixing():
    x, c, s = torch.zeros(8, 2, 192), torch.from_numpy(C), torch.from_numpy(S)
    with pytest.raises(ValueError, match="mxmla.rope_backward: argument 'cu_seqlens': dtype float32 must be int32 or int64"):
        mxmla.rope_backward(x, c, s, layout="thd", cu_seqlens=torch.tensor([0.0, 3.0, 8.0]))
    with pytest.raises(TypeError, match="argument 'cu_seqlens': expected a torch.Tensor like argument 'x'"):
        mxmla.apply_rope(x, c, s, layout="thd", cu_seqlens=np.array([0, 3, 8], np.int64))


# ----------------------------------------------------------------------------- bool / int / choice arguments
@pytest.mark.parametrize("value", [None, 1, "yes", 0.0])
def test_swizzle_none_and_other_non_bools(value):
    with pytest.raises(ValueError, match=f"mxmla.quantize: argument 'swizzle': must be True or False, got {value!r}"):
        mxmla.quantize(f32(4, 64), swizzle=value)


X4 = f32(8, 1, 2, 64)
BOOL_ARGS = [
    (lambda v: mxmla.quantize(f32(4, 64), rowwise=v), "mxmla.quantize: argument 'rowwise'"),
    (lambda v: mxmla.quantize(f32(4, 64), columnwise=v), "mxmla.quantize: argument 'columnwise'"),
    (lambda v: mxmla.quantize_attention(X4, bhsd_scales=v), "mxmla.quantize_attention: argument 'bhsd_scales'"),
    (lambda v: mxmla.quantize_attention(X4, rowwise=v), "mxmla.quantize_attention: argument 'rowwise'"),
    (lambda v: mxmla.swizzle_scales(np.zeros((4, 2), np.uint8), 4, 64, rowwise=v), "mxmla.swizzle_scales: argument 'rowwise'"),
    (lambda v: mxmla.unswizzle_scales(np.zeros((128, 4), np.uint8), 4, 64, v), "mxmla.unswizzle_scales: argument 'rowwise'"),
    (lambda v: mxmla.attention_scales_to_bhsd(np.zeros((16, 2), np.uint8), (8, 1, 2, 64), "sbhd", v),
     "mxmla.attention_scales_to_bhsd: argument 'rowwise'"),
    (lambda v: mxmla.apply_rope(f32(8, 1, 2, 192), C, S, tables_per_token=v), "mxmla.apply_rope: argument 'tables_per_token'"),
    (lambda v: mxmla.rope_backward_quantize(f32(8, 1, 2, 192), C, S, swizzle=v),
     "mxmla.rope_backward_quantize: argument 'swizzle'"),
    (lambda v: mxmla.fused_q_uproj_rope_quant(bf16(8, 64), bf16(192, 64), C, S, return_q=v),
     "mxmla.fused_q_uproj_rope_quant: argument 'return_q'"),
    (lambda v: mxmla.fused_q_uproj_rope_quant(bf16(8, 64), bf16(192, 64), C, S, bhsd_scales=v),
     "mxmla.fused_q_uproj_rope_quant: argument 'bhsd_scales'"),
    (lambda v: mxmla.FusedMLAQUpProjRopeQuant(bhsd_scales=v), "mxmla.FusedMLAQUpProjRopeQuant: argument 'bhsd_scales'"),
]


@pytest.mark.parametrize("call,match", BOOL_ARGS)
def test_every_bool_argument_is_checked(call, match):
    with pytest.raises(ValueError, match=match + ": must be True or False, got None"):
        call(None)
    call(np.bool_(True))  # numpy bools are bools


def test_dequantize_given_a_dtype_as_q():
    with pytest.raises(TypeError, match="mxmla.dequantize: argument 'q': expected an MXFP8Tensor .*numpy.float32.*"
                                        "the dtype is the second argument: dequantize\\(q, dtype\\)"):
        mxmla.dequantize(np.float32)
    with pytest.raises(TypeError, match="argument 'q': expected an MXFP8Tensor"):
        mxmla.dequantize(f32(4, 64))
    with pytest.raises(ValueError, match="mxmla.dequantize: argument 'dtype': must be float32 or bfloat16"):
        mxmla.quantize(f32(4, 64)).dequantize(np.float16)
    with pytest.raises(ValueError, match="mxmla.dequantize: argument 'columnwise': must be True or False, got 'yes'"):
        mxmla.quantize(f32(4, 64)).dequantize("float32", columnwise="yes")  # None (the default) picks a direction
    with pytest.raises(ValueError, match="mxmla.dequantize: argument 'q': has no rowwise data"):
        mxmla.quantize(f32(4, 64), rowwise=False).dequantize("float32", columnwise=False)


def test_fused_class_validates_at_construction():
    with pytest.raises(ValueError, match="mxmla.FusedMLAQUpProjRopeQuant: argument 'style': must be "
                                         "'interleaved_in_halves_out', 'interleaved' or 'rotate_half', got 'foo'"):
        mxmla.FusedMLAQUpProjRopeQuant(style="foo")
    with pytest.raises(ValueError, match="mxmla.FusedMLAQUpProjRopeQuant: argument 'layout': must be 'sbhd' or 'bshd'"):
        mxmla.FusedMLAQUpProjRopeQuant(layout="thd")
    with pytest.raises(ValueError, match="mxmla.FusedMLAQUpProjRopeQuant: argument 'fp8_format'"):
        mxmla.FusedMLAQUpProjRopeQuant(fp8_format="e4m3fn")
    with pytest.raises(ValueError, match="mxmla.FusedMLAQUpProjRopeQuant: argument 'nope_dim': nope_dim \\+ rope_dim = "
                                         "164 must be a multiple of 32"):  # the C++ rule, checked at construction
        mxmla.FusedMLAQUpProjRopeQuant(nope_dim=100)
    with pytest.raises(ValueError, match="mxmla.FusedMLAQUpProjRopeQuant: argument 'rope_dim': must be an int"):
        mxmla.FusedMLAQUpProjRopeQuant(rope_dim=64.0)
    op = mxmla.FusedMLAQUpProjRopeQuant(style=mxmla.RopeStyle.rotate_half)
    assert op.style == "rotate_half" and "rotate_half" in repr(op)
    with pytest.raises(ValueError, match="mxmla.FusedMLAQUpProjRopeQuant.run: argument 's': must be an int"):
        op.run(bf16(8, 64), bf16(192, 64), C, S, "8")


def test_misspelt_yarn_key():
    with pytest.raises(ValueError, match="mxmla.rope_tables: argument 'yarn': unknown key 'fator' \\(valid keys: factor, "
                                         "original_max_position, beta_fast, beta_slow, mscale, mscale_all_dim\\)"):
        mxmla.rope_tables([0, 1], yarn={"fator": 2})
    with pytest.raises(ValueError, match="mxmla.rope_inv_freq: argument 'yarn': unknown key"):
        mxmla.rope_inv_freq(yarn={"beta": 1})
    with pytest.raises(ValueError, match="mxmla.yarn_softmax_scale: argument 'yarn\\['factor'\\]': must be a number"):
        mxmla.yarn_softmax_scale(192, {"factor": "40"})
    with pytest.raises(ValueError, match="argument 'yarn\\['original_max_position'\\]': must be an int"):
        mxmla.rope_tables([0], yarn={"original_max_position": 4096.5})
    with pytest.raises(ValueError, match="argument 'yarn': unknown preset 'deepseek'"):
        mxmla.rope_tables([0], yarn="deepseek")
    with pytest.raises(TypeError, match="mxmla.rope_tables: argument 'yarn': must be None, 'deepseek_v3', a dict"):
        mxmla.rope_tables([0], yarn=40)
    # a partial dict keeps DeepSeek-V3's other values
    np.testing.assert_array_equal(mxmla.rope_inv_freq(yarn={"factor": 40.0}), mxmla.rope_inv_freq(yarn="deepseek_v3"))


@pytest.mark.parametrize("value", ["64", True, 64.0, None])
def test_rope_dim_must_be_an_int(value):
    with pytest.raises(ValueError, match=f"mxmla.rope_tables: argument 'rope_dim': must be an int, got {value!r}"):
        mxmla.rope_tables([0, 1], rope_dim=value)
    with pytest.raises(ValueError, match="mxmla.apply_rope: argument 'rope_dim': must be an int"):
        mxmla.apply_rope(f32(8, 1, 2, 192), C, S, rope_dim=value)
    assert mxmla.rope_tables([0, 1], rope_dim=np.int64(64))[0].shape == (2, 64)  # numpy ints are ints


INT_ARGS = [
    (lambda v: mxmla.swizzle_scales(np.zeros((4, 2), np.uint8), v, 64), "mxmla.swizzle_scales: argument 'M'"),
    (lambda v: mxmla.unswizzle_scales(np.zeros((128, 4), np.uint8), 4, v), "mxmla.unswizzle_scales: argument 'K'"),
    (lambda v: mxmla.attention_scales_to_bhsd(np.zeros((16, 2), np.uint8), (8, 1, v, 64)),
     "mxmla.attention_scales_to_bhsd: argument 'shape\\[2\\]'"),
    (lambda v: mxmla.rope_backward(f32(8, 1, 2, 192), C, S, rope_dim=v), "mxmla.rope_backward: argument 'rope_dim'"),
    (lambda v: mxmla.rope_backward_quantize(f32(8, 1, 2, 192), C, S, rope_dim=v),
     "mxmla.rope_backward_quantize: argument 'rope_dim'"),
    (lambda v: mxmla.fused_q_uproj_rope_quant(bf16(8, 64), bf16(192, 64), C, S, batch=v),
     "mxmla.fused_q_uproj_rope_quant: argument 'batch'"),
    (lambda v: mxmla.fused_q_uproj_rope_quant(bf16(8, 64), bf16(192, 64), C, S, nope_dim=v),
     "mxmla.fused_q_uproj_rope_quant: argument 'nope_dim'"),
    (lambda v: mxmla.rope_inv_freq(v), "mxmla.rope_inv_freq: argument 'rope_dim'"),
    (lambda v: mxmla.yarn_softmax_scale(v), "mxmla.yarn_softmax_scale: argument 'head_dim'"),
    (lambda v: mxmla.positions_arange(v), "mxmla.positions_arange: argument 'n'"),
    (lambda v: mxmla.positions_arange(4, v), "mxmla.positions_arange: argument 'offset'"),
    (lambda v: mxmla.positions_context_parallel(8, v, 0), "mxmla.positions_context_parallel: argument 'cp_size'"),
    (lambda v: mxmla.positions_from_cu_seqlens([0, v]), "mxmla.positions_from_cu_seqlens: argument 'cu_seqlens\\[1\\]'"),
]


@pytest.mark.parametrize("call,match", INT_ARGS)
@pytest.mark.parametrize("value", ["8", 8.0, True])
def test_every_int_argument_is_checked(call, match, value):
    with pytest.raises(ValueError, match=match + f": must be an int, got {value!r}"):
        call(value)


CHOICE_ARGS = [
    (lambda v: mxmla.quantize(f32(4, 64), fp8_format=v), "mxmla.quantize: argument 'fp8_format': must be 'e4m3' or 'e5m2'"),
    (lambda v: mxmla.quantize_attention(X4, layout=v), "mxmla.quantize_attention: argument 'layout': must be 'sbhd' or 'bshd'"),
    (lambda v: mxmla.attention_scales_to_bhsd(np.zeros((16, 2), np.uint8), (8, 1, 2, 64), v),
     "mxmla.attention_scales_to_bhsd: argument 'layout'"),
    (lambda v: mxmla.apply_rope(f32(8, 1, 2, 192), C, S, layout=v),
     "mxmla.apply_rope: argument 'layout': must be 'sbhd', 'bshd' or 'thd'"),
    (lambda v: mxmla.rope_backward(f32(8, 1, 2, 192), C, S, style=v), "mxmla.rope_backward: argument 'style'"),
    (lambda v: mxmla.rope_backward_quantize(f32(8, 1, 2, 192), C, S, fp8_format=v),
     "mxmla.rope_backward_quantize: argument 'fp8_format'"),
    (lambda v: mxmla.rope_tables([0], style=v), "mxmla.rope_tables: argument 'style'"),
    (lambda v: mxmla.fused_q_uproj_rope_quant(bf16(8, 64), bf16(192, 64), C, S, weight_layout=v),
     "mxmla.fused_q_uproj_rope_quant: argument 'weight_layout': must be 'nk' or 'kn'"),
]


@pytest.mark.parametrize("call,match", CHOICE_ARGS)
@pytest.mark.parametrize("value", ["E4M3 ", None, 3])
def test_every_choice_argument_lists_its_values(call, match, value):
    with pytest.raises(ValueError, match=match + ".*, got " + repr(value).replace("(", "\\(")):
        call(value)


# ----------------------------------------------------------------------------- C++ rules under the Python names
def test_core_errors_use_the_python_argument_names():
    with pytest.raises(ValueError, match="mxmla.quantize: argument 'x': last dimension must be contiguous"):
        mxmla.quantize(f32(4, 128)[:, ::2])
    with pytest.raises(ValueError, match="mxmla.rope_backward_quantize: argument 'dq': head dimension 80"):
        mxmla.rope_backward_quantize(f32(4, 1, 2, 80), C, S)
    with pytest.raises(ValueError, match="mxmla.rope_backward: argument 'out': shape"):
        mxmla.rope_backward(f32(8, 1, 2, 192), C, S, out=f32(8, 1, 2, 160))
    q = mxmla.quantize(f32(64, 64))
    bad = mxmla.MXFP8Tensor(q.shape, "e4m3", "compact", q.rowwise_data, q.rowwise_scale_inv[:, :1].copy())
    with pytest.raises(ValueError, match="mxmla.dequantize: argument 'q.rowwise_scale_inv': shape \\[64, 1\\] must be "
                                         "\\[64, 2\\]"):
        bad.dequantize()
    p1 = mxmla.quantize_attention(X4, bhsd_scales=False)
    broken = mxmla.MXFP8Tensor(p1.shape, "e4m3", "compact", p1.rowwise_data, p1.rowwise_scale_inv,
                               p1.columnwise_data, p1.columnwise_scale_inv[:, :10].copy(), attention=True)
    with pytest.raises(ValueError, match="mxmla.to_bhsd: argument 'tensors\\[1\\].columnwise_scale_inv': shape"):
        mxmla.to_bhsd(p1, broken)
    with pytest.raises(ValueError, match="mxmla.attention_scales_to_bhsd: argument 'shape': must be 4-D"):
        mxmla.attention_scales_to_bhsd(p1.rowwise_scale_inv, (8, 2, 64))
    with pytest.raises(ValueError, match="mxmla.rope_tables: argument 'rope_dim': 63 must be positive and even"):
        mxmla.rope_tables([0], rope_dim=63)


def test_uint16_is_bf16_only_where_the_op_takes_bf16():
    with pytest.raises(ValueError, match="mxmla.swizzle_scales: argument 'scales': dtype uint16 is not supported here "
                                         "\\(uint8 or float8_e8m0fnu scale bytes\\)"):
        mxmla.swizzle_scales(np.zeros((4, 2), np.uint16), 4, 64)
    with pytest.raises(ValueError, match="mxmla.quantize: argument 'x': dtype float64 is not supported \\(float32, "
                                         "float16, or bfloat16 as ml_dtypes.bfloat16 or uint16 bits\\)"):
        mxmla.quantize(np.zeros((4, 64)))
    with pytest.raises(ValueError, match="mxmla.fused_q_uproj_rope_quant: argument 'x': dtype float32 must be bfloat16"):
        mxmla.fused_q_uproj_rope_quant(f32(8, 64), bf16(192, 64), C, S)


def test_table_style_mismatch_is_an_error_not_a_wrong_result():
    c, s = mxmla.rope_tables(mxmla.positions_arange(8), style="interleaved")
    with pytest.raises(ValueError, match="mxmla.apply_rope: argument 'cos': was built by rope_tables for style "
                                         "'interleaved', but style='interleaved_in_halves_out' was passed"):
        mxmla.apply_rope(f32(8, 1, 2, 192), c, s)
    with pytest.raises(ValueError, match="mxmla.rope_backward_quantize: argument 'cos'"):
        mxmla.rope_backward_quantize(f32(8, 1, 2, 192), c, s, style="rotate_half")
    with pytest.raises(ValueError, match="mxmla.fused_q_uproj_rope_quant: argument 'cos'"):
        mxmla.fused_q_uproj_rope_quant(bf16(8, 64), bf16(192, 64), c, s)
    _, s2 = mxmla.rope_tables(mxmla.positions_arange(8))
    with pytest.raises(ValueError, match="mxmla.rope_backward: argument 'sin': was built by rope_tables for style "
                                         "'interleaved_in_halves_out'"):
        mxmla.rope_backward(f32(8, 1, 2, 192), c, s2, style="interleaved")


# ----------------------------------------------------------------------------- kinds and devices
@needs_torch
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x, c: mxmla.apply_rope(x, c.numpy(), c), "mxmla.apply_rope: argument 'cos': expected a torch.Tensor like "
                                                         "argument 'x', got numpy.ndarray"),
        (lambda x, c: mxmla.apply_rope(x.numpy(), c.numpy(), c), "argument 'sin': expected a numpy.ndarray like "
                                                                 "argument 'x', got torch.Tensor"),
        (lambda x, c: mxmla.apply_rope(x, c, c, out=x.numpy()), "argument 'out': expected a torch.Tensor"),
        (lambda x, c: mxmla.rope_backward_quantize(x, c, c.numpy()), "mxmla.rope_backward_quantize: argument 'sin'"),
        (lambda x, c: mxmla.fused_q_uproj_rope_quant(torch.zeros(8, 64, dtype=torch.bfloat16), np.zeros((192, 64), np.uint16),
                                                     c, c), "mxmla.fused_q_uproj_rope_quant: argument 'w': expected a torch.Tensor"),
        (lambda x, c: mxmla.quantize([[1.0] * 32]), "mxmla.quantize: argument 'x': expected a torch.Tensor or numpy.ndarray, "
                                                    "got list"),
        (lambda x, c: mxmla.swizzle_scales([0] * 4, 4, 32), "mxmla.swizzle_scales: argument 'scales': expected a torch.Tensor"),
        (lambda x, c: mxmla.to_bhsd(mxmla.quantize_attention(x, bhsd_scales=False),
                                    mxmla.quantize_attention(x.numpy(), bhsd_scales=False)),
         "mxmla.to_bhsd: argument 'tensors\\[1\\]': mixes torch and numpy buffers"),
        (lambda x, c: mxmla.to_bhsd(mxmla.quantize(x.view(-1, 192))), "mxmla.to_bhsd: argument 'tensors\\[0\\]': must come "
                                                                       "from quantize_attention"),
    ],
)
def test_torch_and_numpy_do_not_mix(call, match):
    x = torch.zeros(8, 1, 2, 192)
    c = torch.from_numpy(C)
    with pytest.raises((TypeError, ValueError), match=match):
        call(x, c)


@needs_torch
def test_unsupported_torch_dtype_and_device():
    with pytest.raises(ValueError, match="mxmla.quantize: argument 'x': dtype float64 is not supported"):
        mxmla.quantize(torch.zeros(4, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="mxmla.swizzle_scales: argument 'scales': dtype int16 is not supported"):
        mxmla.swizzle_scales(torch.zeros(4, 2, dtype=torch.int16), 4, 64)


@needs_gpu
def test_device_mismatch_names_the_argument():
    x = torch.zeros(8, 1, 2, 192, device="cuda")
    c, s = mxmla.rope_tables(torch.arange(8))
    with pytest.raises(ValueError, match="mxmla.apply_rope: argument 'cos': is on another device than the input"):
        mxmla.apply_rope(x, c, s.cuda())
    with pytest.raises(ValueError, match="mxmla.fused_q_uproj_rope_quant: argument 'w': is on another device than x"):
        mxmla.fused_q_uproj_rope_quant(torch.zeros(8, 64, dtype=torch.bfloat16, device="cuda"),
                                       torch.zeros(192, 64, dtype=torch.bfloat16), c.cuda(), s.cuda())
    q = mxmla.quantize(torch.zeros(32, 64, device="cuda"))
    mixed = mxmla.MXFP8Tensor(q.shape, "e4m3", "compact", q.rowwise_data, q.rowwise_scale_inv.cpu())
    with pytest.raises(ValueError, match="mxmla.dequantize: argument 'q.rowwise_scale_inv': is on cpu:0 but the input "
                                         "is on cuda:0"):
        mixed.dequantize()
