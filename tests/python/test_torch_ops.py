"""torch integration: every public op is a torch.library custom op (namespace mxmla) with a fake
implementation; torch.compile(fullgraph=True, backend="aot_eager") traces each one and gives the
eager result bit for bit; meta tensors get the right shapes; apply_rope / rope_backward are
differentiable (each is the other's gradient, bit for bit); ops without a gradient raise instead of
cutting the graph. The CUDA tests compare the custom ops on the GPU with the CPU reference."""
import warnings

import numpy as np
import pytest

import mxmla

torch = pytest.importorskip("torch")

HAVE_GPU = torch.cuda.is_available() and bool(mxmla.info()["gpus"]) and mxmla.info()["cuda_enabled"]
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible (or a CPU-only build): GPU test skipped")

OPS = ["quantize", "quantize_attention", "dequantize", "swizzle_scales", "unswizzle_scales", "attention_scales_to_bhsd",
       "to_bhsd", "apply_rope", "apply_rope_out", "rope_backward", "rope_backward_out", "rope_backward_quantize",
       "fused_q_uproj_rope_quant", "attention", "gemm", "gemm_out"]
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
STYLES = ["interleaved_in_halves_out", "interleaved", "rotate_half"]


def bits(t):
    """A tensor's bit pattern (NaN-safe exact comparison)."""
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def flat(r):
    out = []
    for v in r if isinstance(r, (list, tuple)) else [r]:
        if isinstance(v, mxmla.MXFP8Tensor):
            out += [getattr(v, f) for f in FIELDS if getattr(v, f) is not None]
        elif isinstance(v, (list, tuple)):
            out += flat(v)
        else:
            out.append(v)
    return out


def compiled_equals_eager(fn, *args):
    eager = fn(*args)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    e, c = flat(eager), flat(compiled)
    assert len(e) == len(c) and len(e) > 0
    for a, b in zip(e, c):
        assert same(a, b)
    return eager, compiled


def int_bf16(shape, lo=-4, hi=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(torch.bfloat16)


# ----------------------------------------------------------------------------- registration
def test_every_op_is_registered_on_import():
    for name in OPS:
        op = getattr(torch.ops.mxmla, name)
        assert isinstance(op.default, torch._ops.OpOverload), name
    assert mxmla.info()["torch_ops"] is True


def test_register_torch_op_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="registered on import"):
        op = mxmla.register_torch_op()
    assert op is torch.ops.mxmla.fused_q_uproj_rope_quant


# ----------------------------------------------------------------------------- torch.compile, op by op
@pytest.mark.parametrize("swizzle", [False, True])
def test_compile_quantize_and_dequantize(swizzle):
    x = torch.randn(100, 96, dtype=torch.bfloat16)
    x[3, 5] = float("nan")

    def f(x):
        q = mxmla.quantize(x, swizzle=swizzle)
        return q, q.dequantize(torch.float32), q.dequantize(torch.bfloat16, columnwise=True)

    (q, d32, d16), _ = compiled_equals_eager(f, x)
    assert q.scale_layout == ("swizzled" if swizzle else "compact")
    ref = mxmla.quantize(x.view(torch.int16).numpy().view(np.uint16), swizzle=swizzle)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(q, name).numpy(), getattr(ref, name))


def test_compile_quantize_one_direction_and_e5m2():
    x = torch.randn(64, 64)

    def f(x):
        return mxmla.quantize(x, rowwise=False, fp8_format="e5m2")

    q, qc = compiled_equals_eager(f, x)
    assert q.rowwise_data is None and qc.rowwise_data is None and qc.fp8_format == "e5m2"


def test_compile_scale_conversions():
    q = mxmla.quantize(torch.randn(200, 96))

    def f(rs, cs):
        s = mxmla.swizzle_scales(rs, 200, 96)
        sc = mxmla.swizzle_scales(cs, 200, 96, rowwise=False)
        return s, sc, mxmla.unswizzle_scales(s, 200, 96), mxmla.unswizzle_scales(sc, 200, 96, rowwise=False)

    (s, sc, back, backc), _ = compiled_equals_eager(f, q.rowwise_scale_inv, q.columnwise_scale_inv)
    assert torch.equal(back, q.rowwise_scale_inv) and torch.equal(backc, q.columnwise_scale_inv)


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
def test_compile_attention_two_phases(layout):
    x = torch.randn(45, 2, 3, 192) if layout == "sbhd" else torch.randn(2, 45, 3, 192)

    def f(x):
        fused = mxmla.quantize_attention(x, layout=layout)
        p1 = mxmla.quantize_attention(x, layout=layout, bhsd_scales=False)
        (b,) = mxmla.to_bhsd(p1)
        one = mxmla.attention_scales_to_bhsd(p1.columnwise_scale_inv, x.shape, layout, False)
        return fused, b, one, b.dequantize(torch.float32, columnwise=True)

    (fused, b, one, _), _ = compiled_equals_eager(f, x)
    assert torch.equal(b.rowwise_scale_inv, fused.rowwise_scale_inv)
    assert torch.equal(one, fused.columnwise_scale_inv)


def test_compile_with_an_mxfp8tensor_as_input():
    q = mxmla.quantize(torch.randn(64, 96))
    p1 = mxmla.quantize_attention(torch.randn(40, 1, 2, 64), bhsd_scales=False)

    def f(q, p1):
        return q.dequantize(torch.float32), mxmla.swizzle_scales(q.rowwise_scale_inv, 64, 96), mxmla.to_bhsd(p1)[0]

    compiled_equals_eager(f, q, p1)


def test_compile_to_bhsd_several_tensors():
    q, k = torch.randn(40, 1, 2, 192), torch.randn(40, 1, 2, 192)

    def f(q, k):
        a = mxmla.quantize_attention(q, bhsd_scales=False)
        b = mxmla.quantize_attention(k, bhsd_scales=False, rowwise=False)
        return mxmla.to_bhsd(a, b)

    (a, b), _ = compiled_equals_eager(f, q, k)
    assert b.rowwise_scale_inv is None and b.columnwise_scale_inv is not None


@pytest.mark.parametrize("style", STYLES)
def test_compile_rope_forward_backward_out_and_in_place(style):
    x = torch.randn(33, 2, 3, 192, dtype=torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(33), yarn="deepseek_v3", style=style)

    def f(x, c, s):
        y = mxmla.apply_rope(x, c, s, style=style)
        g = mxmla.rope_backward(y, c, s, style=style)
        o = torch.empty_like(x)
        mxmla.apply_rope(x, c, s, style=style, out=o)
        inplace = x.clone()
        mxmla.rope_backward(inplace, c, s, style=style, out=inplace)
        return y, g, o, inplace

    (y, g, o, inplace), _ = compiled_equals_eager(f, x, c, s)
    assert same(o, y) and same(inplace, mxmla.rope_backward(x, c, s, style=style))


def test_compile_rope_thd_with_cu_seqlens_list_and_tensor():
    x = torch.randn(50, 2, 192)
    c, s = mxmla.rope_tables(torch.arange(30))

    def f(x, c, s, cu):
        return mxmla.apply_rope(x, c, s, layout="thd", cu_seqlens=[0, 20, 50]), \
            mxmla.rope_backward(x, c, s, layout="thd", cu_seqlens=cu)

    (a, b), _ = compiled_equals_eager(f, x, c, s, torch.tensor([0, 20, 50], dtype=torch.int32))
    np.testing.assert_array_equal(a.numpy(), mxmla.apply_rope(x.numpy(), c.numpy(), s.numpy(), layout="thd",
                                                              cu_seqlens=np.array([0, 20, 50], np.int64)))


@pytest.mark.parametrize("dx_copy", [None, "bfloat16", "float32"])
def test_compile_rope_backward_quantize(dx_copy):
    dq = torch.randn(40, 2, 2, 192, dtype=torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(40))

    def f(dq, c, s):
        return mxmla.rope_backward_quantize(dq, c, s, dx_copy=dx_copy, swizzle=True)

    r, _ = compiled_equals_eager(f, dq, c, s)
    q = r[0] if dx_copy else r
    assert q.shape == (80, 384) and q.rowwise_scale_inv.shape == (128, 12)
    if dx_copy:
        assert r[1].dtype == getattr(torch, dx_copy) and r[1].shape == dq.shape


@pytest.mark.parametrize("bhsd", [False, True])
def test_compile_fused_q_uproj_rope_quant(bhsd):
    T, H, K = 64, 2, 64
    x, w = int_bf16((T, K), seed=1), int_bf16((H * 192, K), seed=2)
    c, s = mxmla.rope_tables(torch.arange(T))

    def f(x, w, c, s):
        return mxmla.fused_q_uproj_rope_quant(x, w, c, s, bhsd_scales=bhsd, return_q=True)

    (q, qb), _ = compiled_equals_eager(f, x, w, c, s)
    ref, refq = mxmla.fused_q_uproj_rope_quant(x.view(torch.int16).numpy().view(np.uint16),
                                               w.view(torch.int16).numpy().view(np.uint16), c.numpy(), s.numpy(),
                                               bhsd_scales=bhsd, return_q=True)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(q, name).numpy(), getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(qb.view(torch.int16).numpy().view(np.uint16), refq)


def test_compile_raw_custom_op_keeps_the_old_signature():
    """register_torch_op()'s op, positionally as before (new arguments at the end, with defaults)."""
    T, K = 64, 64
    x, w = int_bf16((T, K), seed=3), int_bf16((192, K), seed=4)
    c, s = mxmla.rope_tables(torch.arange(T))
    op = torch.ops.mxmla.fused_q_uproj_rope_quant

    def f(x, w, c, s):
        return op(x, w, c, s, 128, 64, "interleaved_in_halves_out", "sbhd", 1, "e4m3", False)

    r, _ = compiled_equals_eager(f, x, w, c, s)
    assert len(r) == 5 and r[4].numel() == 0  # q only with return_q=True
    assert torch.equal(r[0], mxmla.fused_q_uproj_rope_quant(x, w, c, s).rowwise_data)


# ----------------------------------------------------------------------------- fakes: meta tensors, shape functions
def test_meta_tensors_get_the_shapes_of_the_real_ops():
    x = torch.empty(300, 4, 192, device="meta", dtype=torch.bfloat16)
    q = mxmla.quantize(x, swizzle=True)
    real = mxmla.quantize(torch.zeros(300, 4, 192, dtype=torch.bfloat16), swizzle=True)
    for name in FIELDS:
        assert getattr(q, name).device.type == "meta" and getattr(q, name).shape == getattr(real, name).shape
    a = mxmla.quantize_attention(torch.empty(2, 130, 3, 192, device="meta"), layout="bshd")
    assert a.rowwise_scale_inv.shape == (2, 3, 256, 8) and a.columnwise_scale_inv.shape == (2, 3, 8, 256)
    c, s = torch.empty(130, 64, device="meta"), torch.empty(130, 64, device="meta")
    y = mxmla.apply_rope(torch.empty(130, 2, 3, 192, device="meta"), c, s)
    assert y.shape == (130, 2, 3, 192) and y.device.type == "meta"
    fq = mxmla.fused_q_uproj_rope_quant(torch.empty(260, 1536, device="meta", dtype=torch.bfloat16),
                                        torch.empty(4 * 192, 1536, device="meta", dtype=torch.bfloat16), c, s,
                                        layout="bshd", batch=2, bhsd_scales=True)
    assert fq.shape == (2, 130, 4, 192) and fq.rowwise_scale_inv.shape == (2, 4, 256, 8)


def test_fake_shape_errors_name_the_op():
    with pytest.raises(ValueError, match="mxmla.quantize: argument 'x': last dimension 100"):
        mxmla.quantize(torch.empty(4, 100, device="meta"))


# ----------------------------------------------------------------------------- autograd
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_rope_gradient_is_rope_backward_bit_for_bit(style, dtype):
    x = torch.randn(17, 2, 3, 192, dtype=dtype, requires_grad=True)
    c, s = mxmla.rope_tables(torch.arange(17), yarn="deepseek_v3", style=style)
    y = mxmla.apply_rope(x, c, s, style=style)
    assert y.requires_grad and "mxmla_apply_rope" in type(y.grad_fn).__name__
    g = torch.randn_like(y)
    y.backward(g)
    assert same(x.grad, mxmla.rope_backward(g, c, s, style=style))


def test_rope_backward_gradient_is_apply_rope_and_expanded_grads():
    g = torch.randn(9, 1, 2, 128, requires_grad=True)
    c, s = mxmla.rope_tables(torch.arange(9))
    dx = mxmla.rope_backward(g, c, s)
    dx.sum().backward()  # the incoming gradient is an expanded (stride 0) tensor of ones
    assert same(g.grad, mxmla.apply_rope(torch.ones_like(g), c, s))


def test_double_backward_and_thd_autograd():
    x = torch.randn(30, 2, 192, requires_grad=True)
    c, s = mxmla.rope_tables(torch.arange(20))
    cu = [0, 10, 30]
    y = mxmla.apply_rope(x, c, s, layout="thd", cu_seqlens=cu)
    v = torch.randn_like(y, requires_grad=True)
    (gx,) = torch.autograd.grad(y, x, v, create_graph=True)
    assert same(gx, mxmla.rope_backward(v.detach(), c, s, layout="thd", cu_seqlens=cu))
    w = torch.randn_like(gx)
    (gv,) = torch.autograd.grad(gx, v, w)  # d<R^T v, w>/dv = R w
    assert same(gv, mxmla.apply_rope(w, c, s, layout="thd", cu_seqlens=cu))


def test_gradcheck_apply_rope_in_fp32():
    """A finite-difference check of the registered gradient (fp32 ops: loose tolerances)."""
    c, s = mxmla.rope_tables(torch.arange(4), 32)
    x = torch.randn(4, 1, 2, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert torch.autograd.gradcheck(lambda t: mxmla.apply_rope(t, c, s, rope_dim=32), (x,), eps=1e-2, atol=2e-3,
                                        rtol=1e-2)


def test_compiled_autograd_matches_eager():
    x = torch.randn(40, 2, 3, 192)
    c, s = mxmla.rope_tables(torch.arange(40), yarn="deepseek_v3")

    def f(x):
        return (mxmla.apply_rope(x, c, s) * 3).sum()

    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(a).backward()
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="aot_eager")(b).backward()
    assert same(a.grad, b.grad)


def test_eager_calls_run_the_op_function_directly_and_traced_calls_the_op(monkeypatch):
    """Eager calls on plain tensors skip torch's custom-op dispatch (host time) and run the function
    behind torch.ops.mxmla.<op> directly: the same bits. Meta and fake tensors, torch.compile and
    inputs that need a gradient go through the op (its fake implementation, its autograd)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxmla import _dispatch
    seen = []
    for name in ("quantize", "apply_rope"):
        fn = _dispatch._EAGER[name]
        monkeypatch.setitem(_dispatch._EAGER, name, lambda *a, _fn=fn, _n=name: (seen.append(_n), _fn(*a))[1])
    x = int_bf16((64, 64))
    q = mxmla.quantize(x)
    assert seen == ["quantize"]
    via_op = torch.ops.mxmla.quantize(x, True, True, "e4m3", False)
    assert all(same(getattr(q, f), t) for f, t in zip(FIELDS, via_op))
    seen.clear()
    assert mxmla.quantize(torch.empty(64, 64, dtype=torch.bfloat16, device="meta")).rowwise_data.device.type == "meta"
    with FakeTensorMode():
        assert mxmla.quantize(torch.empty(64, 64, dtype=torch.bfloat16)).rowwise_data.shape == (64, 64)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: mxmla.quantize(t).rowwise_data, fullgraph=True, backend="aot_eager")(x)
    assert same(compiled, q.rowwise_data)
    traced = torch.jit.trace(lambda t: mxmla.quantize(t).rowwise_data, (x,), check_trace=False)
    assert "mxmla::quantize" in str(traced.graph) and same(traced(x), q.rowwise_data)
    assert seen == []
    xr = torch.randn(40, 1, 2, 192, requires_grad=True)
    c, s = mxmla.rope_tables(torch.arange(40))
    mxmla.apply_rope(xr, c, s).sum().backward()  # the op's autograd
    assert seen == [] and xr.grad is not None
    with torch.no_grad():
        mxmla.apply_rope(xr, c, s)
    assert seen == ["apply_rope"]


def test_no_grad_mode_and_detached_inputs_run():
    x = torch.randn(32, 64, requires_grad=True)
    with torch.no_grad():
        assert mxmla.quantize(x).rowwise_data is not None
    assert mxmla.quantize(x.detach()).rowwise_data is not None

    class Quantized(torch.autograd.Function):  # the supported training pattern
        @staticmethod
        def forward(ctx, t):
            return mxmla.quantize(t).dequantize(torch.float32)

        @staticmethod
        def backward(ctx, g):
            return g

    Quantized.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_non_differentiable_ops_raise_instead_of_cutting_the_graph():
    x = torch.randn(40, 1, 2, 192, requires_grad=True)
    c, s = mxmla.rope_tables(torch.arange(40))
    cases = [
        (lambda: mxmla.quantize(x), "mxmla.quantize: argument 'x': requires grad, but quantize has no gradient"),
        (lambda: mxmla.quantize_attention(x), "mxmla.quantize_attention: argument 'x': requires grad"),
        (lambda: mxmla.rope_backward_quantize(x, c, s), "mxmla.rope_backward_quantize: argument 'dq': requires grad"),
        (lambda: mxmla.apply_rope(x, c, s, out=torch.empty_like(x)), "mxmla.apply_rope: argument 'out': the out= form"),
        (lambda: mxmla.rope_backward(x.detach(), c, s, out=torch.zeros_like(x, requires_grad=True)),
         "mxmla.rope_backward: argument 'out': the out= form is not differentiable"),
        (lambda: mxmla.apply_rope(x.detach(), c.clone().requires_grad_(), s),
         "mxmla.apply_rope: argument 'cos': requires grad, but apply_rope has no gradient for the tables"),
        # the raw custom ops raise too (in the forward, not at backward time)
        (lambda: torch.ops.mxmla.quantize(x, True, True, "e4m3", False), "mxmla.quantize: argument 'x': requires grad"),
        (lambda: torch.ops.mxmla.apply_rope(x, c.clone().requires_grad_(), s, "interleaved", "sbhd", 64, None, False),
         "argument 'cos': requires grad"),
    ]
    for call, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call()
    xf = torch.randint(-2, 3, (32, 64)).to(torch.bfloat16).requires_grad_()
    w = torch.randint(-2, 3, (192, 64)).to(torch.bfloat16)
    c2, s2 = mxmla.rope_tables(torch.arange(32))
    with pytest.raises(RuntimeError, match="mxmla.fused_q_uproj_rope_quant: argument 'x': requires grad, but "
                                           "fused_q_uproj_rope_quant has no gradient \\(the op is forward only: "
                                           "mxmla.nn.MLAQUpProj"):
        mxmla.fused_q_uproj_rope_quant(xf, w, c2, s2)
    with pytest.raises(RuntimeError, match="argument 'w': requires grad"):
        mxmla.fused_q_uproj_rope_quant(xf.detach(), w.requires_grad_(), c2, s2)


# ----------------------------------------------------------------------------- CUDA (run on the H200)
@needs_gpu
def test_cuda_custom_ops_match_cpu_reference_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(300, 4, 192, dtype=torch.bfloat16)
    for swizzle in (False, True):
        qg, qc = mxmla.quantize(x.cuda(), swizzle=swizzle), mxmla.quantize(x, swizzle=swizzle)
        for name in FIELDS:
            assert torch.equal(getattr(qg, name).cpu(), getattr(qc, name)), name
        assert same(qg.dequantize(torch.bfloat16).cpu(), qc.dequantize(torch.bfloat16))
    a = x.view(300, 1, 4, 192)
    pg, pc = mxmla.quantize_attention(a.cuda(), bhsd_scales=False), mxmla.quantize_attention(a, bhsd_scales=False)
    (bg,), (bc,) = mxmla.to_bhsd(pg), mxmla.to_bhsd(pc)
    for name in FIELDS:
        assert torch.equal(getattr(bg, name).cpu(), getattr(bc, name)), name
    c, s = mxmla.rope_tables(torch.arange(300), yarn="deepseek_v3")
    cg, sg = c.cuda(), s.cuda()
    assert same(mxmla.apply_rope(a.cuda(), cg, sg).cpu(), mxmla.apply_rope(a, c, s))


@needs_gpu
def test_cuda_compile_matches_eager():
    x = torch.randn(256, 2, 4, 192, device="cuda", dtype=torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(256, device="cuda"), yarn="deepseek_v3")

    def f(x, c, s):
        y = mxmla.apply_rope(x, c, s)
        q = mxmla.quantize_attention(y, bhsd_scales=True)
        r = mxmla.rope_backward_quantize(y, c, s)
        return y, q, r

    compiled_equals_eager(f, x, c, s)


@needs_gpu
def test_cuda_autograd_gradient_equals_rope_backward():
    x = torch.randn(64, 2, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    c, s = mxmla.rope_tables(torch.arange(64, device="cuda"), yarn="deepseek_v3")
    y = mxmla.apply_rope(x, c, s)
    g = torch.randn_like(y)
    y.backward(g)
    assert same(x.grad, mxmla.rope_backward(g, c, s))
    x.grad = None
    mxmla.apply_rope(x, c, s).float().sum().backward()  # expanded grad: copied for the kernel's rules
    assert same(x.grad.cpu(), mxmla.rope_backward(torch.ones(64, 2, 4, 192, dtype=torch.bfloat16), c.cpu(), s.cpu()))


@needs_gpu
def test_cuda_ops_run_on_the_current_stream_without_sync():
    x = torch.randn(4096, 576, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q = mxmla.quantize(x)
        d = q.dequantize(torch.bfloat16)
    side.synchronize()
    ref = mxmla.quantize(x.cpu())
    assert torch.equal(q.rowwise_data.cpu(), ref.rowwise_data) and d.is_cuda


@needs_gpu
def test_cuda_hot_path_does_not_synchronize():
    """torch's sync debug mode raises on any synchronizing call the Python layer makes (e.g. .cpu(),
    .item()): the ops only allocate, describe and launch on the current stream."""
    x = torch.randn(1024, 2, 4, 192, device="cuda", dtype=torch.bfloat16)
    c, s = mxmla.rope_tables(torch.arange(1024, device="cuda"), yarn="deepseek_v3")
    xx = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4 * 192, 256, device="cuda", dtype=torch.bfloat16)
    qt, kt = (torch.randn(300, 4, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    vt = torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16)
    # packed sequences with host cu_seqlens and both bounds: the lists reach the GPU from pinned memory
    # (torch's copy of a pageable tensor would synchronize), once when q's and kv's are the same list
    cu, bounds = [0, 100, 300], dict(max_seqlen_q=200, max_seqlen_kv=200)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q = mxmla.quantize(x, swizzle=True)
        q.dequantize(torch.bfloat16)
        mxmla.unswizzle_scales(q.rowwise_scale_inv, 2048 * 4, 192)
        (b,) = mxmla.to_bhsd(mxmla.quantize_attention(x, bhsd_scales=False))
        y = mxmla.apply_rope(x, c, s)
        mxmla.rope_backward(y, c, s, out=y)
        mxmla.rope_backward_quantize(y, c, s, dx_copy="bfloat16")
        mxmla.fused_q_uproj_rope_quant(xx, w, c, s, return_q=True, bhsd_scales=True)
        o, lse = mxmla.attention(qt, kt, vt, causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu, return_lse=True, **bounds)
        mxmla.attention_backward(o, qt, kt, vt, o, lse, causal=True, cu_seqlens_q=cu, cu_seqlens_kv=[0, 100, 300],
                                 **bounds)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
