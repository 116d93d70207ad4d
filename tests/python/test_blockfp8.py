"""Block FP8 (the DeepSeek-V3 recipe): quantize_blockwise against an independent numpy version of
the rule (float32 numpy arithmetic, ml_dtypes' E4M3 rounding), the fused Q up-projection with a
block-FP8 weight against the bf16 op on the dequantized operands (power-of-two scales make those
exact in bf16) and against float64 math, the CUDA kernels bit for bit against the CPU reference
(integer-valued codes, so that every block's sum is exact on the FP8 tensor cores), random data
within the stated bound, and errors."""
import ml_dtypes
import numpy as np
import pytest

import mxmla

try:
    import torch
except ImportError:  # torch is optional: its tests skip
    torch = None

STYLES = ["interleaved_in_halves_out", "interleaved", "rotate_half"]
HAVE_GPU = torch is not None and torch.cuda.is_available() and mxmla.info()["cuda_enabled"]
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU (or a build without CUDA): GPU test skipped")


def ref_quantize(x, block_rows, pow2):
    """The rule of include/mxmla/blockfp8.h in numpy float32 arithmetic."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    nbr, nbc = -(-rows // block_rows), -(-cols // 128)
    codes = np.zeros((rows, cols), np.uint8)
    si = np.zeros((nbr, nbc), np.float32)
    for i in range(nbr):
        for j in range(nbc):
            rs, cs = slice(i * block_rows, (i + 1) * block_rows), slice(j * 128, (j + 1) * 128)
            blk = x[rs, cs]
            a = np.abs(blk[~np.isnan(blk)])
            amax = np.float32(a.max()) if a.size else np.float32(0)
            if amax == 0 or np.isinf(amax):
                s = np.float32(1)
            else:
                with np.errstate(over="ignore"):
                    s = np.float32(448) / amax
                if np.isinf(s):
                    s = np.finfo(np.float32).max
            if pow2:
                s = np.array([s], np.float32).view(np.uint32)[0] & np.uint32(0xFF800000)
                s = np.array([s], np.uint32).view(np.float32)[0]
            si[i, j] = np.float32(1) / s
            with np.errstate(invalid="ignore", over="ignore"):
                prod = (blk * s).astype(np.float32)
            c = np.clip(prod, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            c[np.isnan(prod)] = 0x7F
            codes[rs, cs] = c
    return codes, si


def edge_matrix(rows, cols, seed=0):
    """Normal values with edge cases: a zero block, a NaN, Inf, a huge and a subnormal-only block."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    if rows > 2 and cols > 130:
        x[0, :128] = 0.0                 # zero 1x128 block
        x[1, 3] = np.nan                 # NaN (ignored by amax, code 0x7F)
        x[2, 200] = np.inf               # Inf: scale 1, saturates to 448
        x[2, 130] = -1e30
        x[1, 128:] = 1e-40 * np.sign(x[1, 128:])  # fp32 subnormals only: 448 / amax overflows
    return x


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (3, 300), (130, 257), (129, 128)])
def test_quantize_blockwise_cpu_matches_the_rule(block_rows, pow2, shape):
    x = edge_matrix(*shape, seed=sum(shape))
    b = mxmla.quantize_blockwise(x, block_rows=block_rows, pow2_scales=pow2)
    codes, si = ref_quantize(x, block_rows, pow2)
    assert b.data.dtype == np.uint8 and b.scale_inv.dtype == np.float32
    np.testing.assert_array_equal(b.data, codes)
    np.testing.assert_array_equal(b.scale_inv.view(np.uint32), si.view(np.uint32))


def test_quantize_blockwise_bf16_input_and_round_trip():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 384)).astype(ml_dtypes.bfloat16)
    b = mxmla.quantize_blockwise(x)
    codes, si = ref_quantize(x.astype(np.float32), 1, True)
    np.testing.assert_array_equal(b.data, codes)
    np.testing.assert_array_equal(b.scale_inv, si)
    d = b.dequantize()
    # E4M3 keeps 3 mantissa bits: within half an ulp of 2^-3 relative, or a subnormal step, of x
    xf = x.astype(np.float32)
    assert np.all(np.abs(d - xf) <= np.abs(xf) * 2.0 ** -4 + np.repeat(si, 128, 1) * 2.0 ** -9)
    assert mxmla.quantize_blockwise(x, block_rows=128).scale_inv.shape == (1, 3)


def _tables(S, R=64):
    return mxmla.rope_tables(np.arange(S), R)


def _block_operands(T, heads, K, seed, integer, pow2=True):
    """x [T, K] bf16 bits and w [N, K] as block-FP8 tensors (numpy)."""
    rng = np.random.default_rng(seed)
    if integer:
        # small integer codes and power-of-two factors: every block sum is an integer below 2^12
        xc = rng.integers(-4, 5, (T, K)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        wc = rng.integers(-4, 5, (heads * 192, K)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        xs = (2.0 ** rng.integers(-3, 3, (T, -(-K // 128)))).astype(np.float32)
        ws = (2.0 ** rng.integers(-3, 3, (-(-heads * 192 // 128), -(-K // 128)))).astype(np.float32)
        return mxmla.BlockFP8Tensor(xc, xs, 1), mxmla.BlockFP8Tensor(wc, ws, 128)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = (rng.standard_normal((heads * 192, K)) / np.sqrt(K)).astype(np.float32)
    return (mxmla.quantize_blockwise(x, 1, pow2_scales=pow2), mxmla.quantize_blockwise(w, 128, pow2_scales=pow2))


def _bits(a):
    return a.view(np.uint16) if a.dtype != np.uint16 else a


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("T,heads,K,layout,batch", [(1, 1, 128, "sbhd", 1), (33, 3, 176, "sbhd", 1),
                                                    (66, 2, 256, "bshd", 2), (40, 1, 300 - 300 % 16, "sbhd", 2)])
def test_fused_block_weight_cpu_equals_bf16_op_on_dequantized(style, T, heads, K, layout, batch):
    xb, wb = _block_operands(T, heads, K, seed=T + K, integer=False)
    S = T // batch
    c, s = _tables(S)
    c, s = mxmla.rope_tables(np.arange(S), 64, style=style)
    q8, q = mxmla.fused_q_uproj_rope_quant(xb, wb, c, s, style=style, layout=layout, batch=batch, return_q=True)
    # power-of-two scales: the dequantized operands are bf16 numbers, so the bf16 op sees the same values
    from test_qproj import bf16_bits
    xd, wd = bf16_bits(xb.dequantize()), bf16_bits(wb.dequantize())
    assert np.array_equal(bf16_bits(xb.dequantize()).astype(np.uint32) << 16, xb.dequantize().view(np.uint32))
    r8, rq = mxmla.fused_q_uproj_rope_quant(xd, wd, c, s, style=style, layout=layout, batch=batch, return_q=True)
    np.testing.assert_array_equal(_bits(q), _bits(rq))
    for a in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        np.testing.assert_array_equal(getattr(q8, a), getattr(r8, a), err_msg=a)


def test_fused_block_weight_cpu_fp32_scales_against_float64():
    """Non-power-of-two scales: q (before RoPE's rope part) against float64 math on code · scale_inv."""
    T, heads, K = 20, 2, 384
    xb, wb = _block_operands(T, heads, K, seed=7, integer=False, pow2=False)
    assert not np.all(np.log2(wb.scale_inv) == np.round(np.log2(wb.scale_inv)))
    c, s = _tables(T)
    _, q = mxmla.fused_q_uproj_rope_quant(xb, wb, c, s, return_q=True)
    def exact(b):  # code · scale_inv in float64 (exact: 4 significant bits times 24)
        from mxmla.blockfp8 import _E4M3
        s = b.scale_inv.astype(np.float64).repeat(b.block_rows, 0).repeat(128, 1)[:b.shape[0], :b.shape[1]]
        return _E4M3[b.data] * s

    acc = exact(xb) @ exact(wb).T
    from test_qproj import bf16_bits
    want = bf16_bits(acc.astype(np.float32)).reshape(T, heads, 192)[..., :128]
    got = _bits(q).reshape(T, heads, 192)[..., :128]
    np.testing.assert_array_equal(got, want)  # the nope part is the rounded GEMM itself


@needs_torch
def test_fused_block_weight_quantizes_bf16_x_inside():
    T, heads, K = 24, 1, 256
    torch.manual_seed(0)
    x = torch.randn(T, K).bfloat16()
    wb = mxmla.quantize_blockwise(torch.randn(heads * 192, K), block_rows=128)
    c, s = mxmla.rope_tables(torch.arange(T), 64)
    a = mxmla.fused_q_uproj_rope_quant(x, wb, c, s)
    b = mxmla.fused_q_uproj_rope_quant(mxmla.quantize_blockwise(x), wb, c, s)
    assert torch.equal(a.rowwise_data, b.rowwise_data) and torch.equal(a.columnwise_data, b.columnwise_data)
    assert wb.data.dtype == torch.float8_e4m3fn


@needs_torch
def test_torch_compile_traces_the_block_ops():
    """quantize_blockwise and the fused op with a block-FP8 weight through torch.compile(fullgraph)
    (the custom ops' fake implementations), the same results as eager."""
    T, heads, K = 24, 1, 256
    torch.manual_seed(1)
    x = torch.randn(T, K).bfloat16()
    w = torch.randn(heads * 192, K)
    c, s = mxmla.rope_tables(torch.arange(T), 64)

    def f(x, w, c, s):
        wb = mxmla.quantize_blockwise(w, block_rows=128)
        q8, q = mxmla.fused_q_uproj_rope_quant(x, wb, c, s, return_q=True)
        return q8.rowwise_data, q8.columnwise_scale_inv, q, wb.scale_inv

    eager = f(x, w, c, s)
    compiled = torch.compile(f, fullgraph=True, backend="eager")(x, w, c, s)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="requires grad"):
        mxmla.quantize_blockwise(w.clone().requires_grad_())


def test_errors():
    xb, wb = _block_operands(8, 1, 128, seed=0, integer=True)
    c, s = _tables(8)
    with pytest.raises(ValueError, match="'w'.*128 x 128"):
        mxmla.fused_q_uproj_rope_quant(xb, mxmla.BlockFP8Tensor(wb.data, wb.scale_inv, 1), c, s)
    with pytest.raises(ValueError, match="'x'.*1 x 128"):
        mxmla.fused_q_uproj_rope_quant(mxmla.BlockFP8Tensor(xb.data, xb.scale_inv, 128), wb, c, s)
    with pytest.raises(ValueError, match="weight_layout"):
        mxmla.fused_q_uproj_rope_quant(xb, wb, c, s, weight_layout="kn")
    with pytest.raises(ValueError, match="w.scale_inv.*must be"):
        mxmla.fused_q_uproj_rope_quant(xb, mxmla.BlockFP8Tensor(wb.data, wb.scale_inv[:, :0], 128), c, s)
    with pytest.raises(ValueError, match="'w'.*K = 128"):
        w2 = mxmla.quantize_blockwise(np.ones((192, 256), np.float32), 128)
        mxmla.fused_q_uproj_rope_quant(xb, w2, c, s)
    with pytest.raises(ValueError, match="block_rows"):
        mxmla.quantize_blockwise(np.ones((4, 4), np.float32), block_rows=32)
    with pytest.raises(ValueError, match="'input'.*2-D"):
        mxmla.quantize_blockwise(np.ones((4,), np.float32))
    with pytest.raises(ValueError, match="'input'.*dtype"):
        mxmla.quantize_blockwise(np.ones((4, 4), np.int32))


# ------------------------------------------------------------------ CUDA
@needs_gpu
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 300), (130, 257), (4097, 1536)])
def test_cuda_quantize_blockwise_matches_cpu(block_rows, pow2, dtype, shape):
    x = torch.from_numpy(edge_matrix(*shape, seed=shape[0])).to(getattr(torch, dtype))
    g = mxmla.quantize_blockwise(x.cuda(), block_rows, pow2)
    h = mxmla.quantize_blockwise(x, block_rows, pow2)
    assert torch.equal(g.data.view(torch.uint8).cpu(), h.data.view(torch.uint8))
    assert torch.equal(g.scale_inv.cpu().view(torch.int32), h.scale_inv.view(torch.int32))


@needs_gpu
def test_cuda_quantize_blockwise_strided_input():
    x = torch.randn(40, 512, device="cuda")[:, 64:448]
    g = mxmla.quantize_blockwise(x, 1)
    h = mxmla.quantize_blockwise(x.cpu(), 1)
    assert torch.equal(g.data.view(torch.uint8).cpu(), h.data.view(torch.uint8))


def _to_torch(b, dev):
    return mxmla.BlockFP8Tensor(torch.from_numpy(b.data).to(dev).view(torch.float8_e4m3fn),
                                torch.from_numpy(b.scale_inv).to(dev), b.block_rows)


@needs_gpu
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("T,heads,K,layout,batch,bhsd", [
    (1, 1, 128, "sbhd", 1, False), (33, 3, 176, "sbhd", 1, False), (130, 2, 1536, "bshd", 2, True),
    (200, 3, 384, "sbhd", 2, False), (4097, 1, 128, "sbhd", 1, False), (257, 4, 512, "bshd", 1, True)])
def test_cuda_fused_block_weight_bitwise(style, T, heads, K, layout, batch, bhsd):
    xb, wb = _block_operands(T, heads, K, seed=T * 7 + K, integer=True)
    S = T // batch
    c, s = mxmla.rope_tables(torch.arange(S), 64, style=style)
    outs = []
    for dev in ("cpu", "cuda"):
        outs.append(mxmla.fused_q_uproj_rope_quant(_to_torch(xb, dev), _to_torch(wb, dev), c.to(dev), s.to(dev),
                                                   style=style, layout=layout, batch=batch, bhsd_scales=bhsd,
                                                   return_q=True))
    (h8, hq), (g8, gq) = outs
    assert torch.equal(gq.cpu(), hq)
    for a in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(g8, a).cpu(), getattr(h8, a)), a


@needs_gpu
def test_cuda_fused_block_weight_random_within_bound():
    """Random data, fp32 scales: the FP8 tensor cores add a block's 128 products in their own
    precision (DeepSeek-V3 §3.3.2), so q is compared with the CPU reference (float64 sums) by error:
    relative RMS below 2^-10 and every element within 2^-6 of max |q| (one bf16 rounding is 2^-8
    relative)."""
    T, heads, K = 512, 8, 1536
    xb, wb = _block_operands(T, heads, K, seed=3, integer=False, pow2=False)
    c, s = mxmla.rope_tables(torch.arange(T), 64)
    _, gq = mxmla.fused_q_uproj_rope_quant(_to_torch(xb, "cuda"), _to_torch(wb, "cuda"), c.cuda(), s.cuda(),
                                          return_q=True)
    _, hq = mxmla.fused_q_uproj_rope_quant(_to_torch(xb, "cpu"), _to_torch(wb, "cpu"), c, s, return_q=True)
    g, h = gq.cpu().double(), hq.double()
    rms = ((g - h).pow(2).mean() / h.pow(2).mean()).sqrt().item()
    assert rms < 2.0 ** -10, rms
    assert (g - h).abs().max().item() <= 2.0 ** -6 * h.abs().max().item()


@needs_gpu
def test_cuda_errors():
    xb, wb = _block_operands(8, 1, 128, seed=0, integer=True)
    c, s = mxmla.rope_tables(torch.arange(8, device="cuda"), 64)
    x, w = _to_torch(xb, "cuda"), _to_torch(wb, "cuda")
    with pytest.raises(ValueError, match="fp8_format"):
        mxmla.fused_q_uproj_rope_quant(x, w, c, s, fp8_format="e5m2")
    xb2, wb2 = _block_operands(8, 1, 120, seed=0, integer=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        mxmla.fused_q_uproj_rope_quant(_to_torch(xb2, "cuda"), _to_torch(wb2, "cuda"), c, s)
    with pytest.raises(ValueError, match="another device"):
        mxmla.fused_q_uproj_rope_quant(x, _to_torch(wb, "cpu"), c, s)
