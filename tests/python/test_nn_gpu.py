"""mxmla.nn on the GPU: the MXFP8 Linear, the query path (MLAQUpProj) and the MLA block under the
"mxfp8" recipe run mxmla's CUDA kernels; these tests hold them to the CPU path and to the bf16 block.

- MXFP8 Linear: on integer-valued data (every fp32 partial sum exact) the CUDA forward, dgrad and
  wgrad equal the CPU path bit for bit.
- MLAQUpProj: the CUDA fused op and its backward against the same module on the CPU; with MXFP8
  weights (mxmla.gemm, RoPE, quantize_attention on the GPU) bit for bit on integer-valued data.
- MLA, DeepSeek-V3 dims (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, 128 / 64 / 128), T 512:
  the "mxfp8" block against the "bf16" block with the same weights (stated bounds below), and a
  small block's "mxfp8" CUDA run against its CPU run (the same MXFP8 math; fp32 against float64).
- A small Decoder trains under "mxfp8" on the GPU: the loss falls and stays finite.
"""
import math
import pathlib

import pytest

torch = pytest.importorskip("torch")
import mxmla  # noqa: E402
import mxmla.nn as mnn  # noqa: E402
from test_nn import recipe_kw  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device visible (the GPU check runs these)")
TEXT = pathlib.Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def ints(*shape, lo=-4, hi=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(torch.bfloat16)


def test_mxfp8_linear_cuda_equals_cpu_on_integer_data():
    """Integers in [-4, 4]: the codes are exact, the scales are powers of two and every fp32 partial
    sum is an exact integer, so the CUDA GEMMs and the CPU reference agree bit for bit."""
    cpu = mnn.Linear(96, 64, recipe="mxfp8", seed=3)
    with torch.no_grad():
        cpu.weight.copy_(ints(64, 96, seed=1).float())
    gpu = mnn.Linear(96, 64, recipe="mxfp8", seed=3).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, dy = ints(3, 45, 96, seed=2), ints(3, 45, 64, seed=3)  # T = 135: a columnwise tail block
    outs = []
    for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
        xi = x.to(dev).clone().requires_grad_()
        y = m(xi)
        y.backward(dy.to(dev))
        outs.append((y.detach().cpu(), xi.grad.cpu(), m.weight.grad.cpu()))
    for name, c, g in zip(("y", "dx", "dw"), *outs):
        assert torch.equal(c, g), name


def test_block_fp8_linear_cuda_equals_cpu_on_integer_data():
    """The block-FP8 Linear (DeepSeek-V3's recipe) on integers in [-4, 4]: codes exact, power-of-two
    scales, every fp32 partial sum exact, so the CUDA forward, dgrad and wgrad (Hopper's FP8 tensor
    cores) equal the CPU reference bit for bit; T = 135, K = 200, N = 160 (partial blocks), and the
    wgrad added into a main_grad."""
    cpu = mnn.Linear(200, 160, recipe="block-fp8", seed=3)
    with torch.no_grad():
        cpu.weight.copy_(ints(160, 200, seed=1).float())
    gpu = mnn.Linear(200, 160, recipe="block-fp8", seed=3).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x, dy = ints(3, 45, 200, seed=2), ints(3, 45, 160, seed=3)
    outs = []
    for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
        xi = x.to(dev).clone().requires_grad_()
        y = m(xi)
        y.backward(dy.to(dev))
        dw = m.weight.grad.cpu()
        m.weight.main_grad = torch.full((160, 200), 0.5, device=dev)
        m.weight.grad = None
        m(x.to(dev)).backward(dy.to(dev))
        assert m.weight.grad is None
        outs.append((y.detach().cpu(), xi.grad.cpu(), dw, m.weight.main_grad.cpu()))
    for name, c, g in zip(("y", "dx", "dw", "main_grad"), *outs):
        assert torch.equal(c, g), name
    assert torch.equal(outs[0][3], outs[0][2] + 0.5)


@pytest.mark.parametrize("weights", ["bf16", "mxfp8", "block-fp8"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_mlaqupproj_cuda_against_cpu(layout, weights):
    """The fused op (GEMM + RoPE + MXFP8) and its backward (RoPE backward, dgrad, wgrad) on the GPU
    against the same module on the CPU: the MXFP8 Q's bytes may differ where the fp32 GEMM lands next
    to a rounding boundary (< 1 % of codes, measured 0), the gradients within 1 % relative RMS. thd:
    packed sequences of unequal lengths (an empty one), compact scales, positions by sequence."""
    s, b, K, H = 64, 2, 128, 4
    g = torch.Generator().manual_seed(0)
    # the SM90 fused kernel's heads: nope 128 + rope 64
    mods = [mnn.MLAQUpProj(K, H, 128, 64, weights=weights, layout=layout, max_seq_len=s, seed=3, init_std=0.05)
            for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    mods[1].cuda()
    x = torch.randn(s, b, K, generator=g).to(torch.bfloat16)
    kw = {}
    if layout == "thd":
        x, kw = x.reshape(s * b, K), dict(cu_seqlens=[0, 50, 50, 100, 128])
    dq = None
    res = []
    for m, dev in zip(mods, ("cpu", "cuda")):
        xi = x.to(dev).clone().requires_grad_()
        q8, anchor = m(xi, **kw)
        if dq is None:
            dq = torch.randn(anchor.shape, generator=g).to(torch.bfloat16)
        dx, dw = torch.autograd.grad(anchor, (xi, m.weight), dq.to(dev))
        res.append((q8.rowwise_data.cpu(), q8.columnwise_data.cpu(), dx.cpu(), dw.cpu()))
    (r0, c0, dx0, dw0), (r1, c1, dx1, dw1) = res
    assert (r0 != r1).float().mean() < 0.01 and (c0 != c1).float().mean() < 0.01
    assert rel(dx1, dx0) < 0.01 and rel(dw1, dw0) < 0.01


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fused_op_with_mxfp8_weights_exact_fallback_for_tiny_scales(fmt):
    """Blocks of x with scale byte 1 (amax 7 · 2^-120 in E4M3, 7 · 2^-113 in E5M2) whose other values
    are n · 2^-135 (|n| <= 3, exact codes): those dequantize below bf16's smallest subnormal
    (2^-133), so the bf16 copies the fused kernel multiplies would lose them; the scale check
    switches the kernel to its exact fp32 path, which must equal the CPU reference bit for bit
    (every product and sum exact in fp32). Also x with normal scales (the wgmma path) and x with
    such blocks in half of its rows only."""
    T, K, H = 80, 96, 2
    w = ints(H * 192, K, seed=8)
    w[:, ::32] = 0  # (the large values of x meet zeros: the sums stay within fp32's 24 bits, so exact)
    cos, sin = mxmla.rope_tables(torch.arange(80), 64, yarn="deepseek_v3")
    tiny = ints(T, K, lo=-3, hi=4, seed=9).float() * 2.0 ** -135
    tiny[:, ::32] = 7 * 2.0 ** (-120 if fmt == "e4m3" else -113)
    normal = ints(T, K, lo=-7, hi=8, seed=10).float() * 2.0 ** -6
    mixed = torch.cat([tiny[: T // 2], normal[T // 2:]])
    for x, has_tiny in ((tiny, True), (normal, False), (mixed, True)):  # fp32 x
        w8, x8 = (mxmla.quantize(t, fp8_format=fmt) for t in (w, x))
        d = mxmla.dequantize(x8, "float32")
        assert bool(((d != 0) & (d.abs() < 2.0 ** -133)).any()) == has_tiny
        kw = dict(layout="sbhd", batch=2, return_q=True, fp8_format=fmt)
        a, qa = mxmla.fused_q_uproj_rope_quant(x8, w8, cos, sin, 128, 64, **kw)
        w8c, x8c = (mxmla.quantize(t.cuda(), fp8_format=fmt) for t in (w, x))
        assert torch.equal(x8c.rowwise_data.cpu(), x8.rowwise_data)
        assert torch.equal(x8c.rowwise_scale_inv.cpu(), x8.rowwise_scale_inv)
        b, qb = mxmla.fused_q_uproj_rope_quant(x8c, w8c, cos.cuda(), sin.cuda(), 128, 64, **kw)
        for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            assert torch.equal(getattr(a, f), getattr(b, f).cpu()), f
        assert torch.equal(qa, qb.cpu())
        assert bool(qa.float().abs().max() > 0)


def test_fused_op_with_mxfp8_weights_cuda_equals_cpu_on_integer_data():
    """The MXFP8-weight fused op on the GPU (mxmla.gemm's kernel, the RoPE and quantize_attention
    kernels) equals the CPU path bit for bit on integer-valued x and W (every fp32 partial sum exact);
    and MLAQUpProj(weights="mxfp8")'s forward and backward on the GPU against the CPU."""
    T, K, H = 96, 128, 2
    x, w = ints(T, K, seed=4), ints(H * 192, K, seed=5)
    cos, sin = mxmla.rope_tables(torch.arange(48), 64, yarn="deepseek_v3", style="interleaved")
    kw = dict(style="interleaved", layout="bshd", batch=2, bhsd_scales=True, return_q=True)
    a, qa = mxmla.fused_q_uproj_rope_quant(x, mxmla.quantize(w), cos, sin, 128, 64, **kw)
    b, qb = mxmla.fused_q_uproj_rope_quant(x.cuda(), mxmla.quantize(w.cuda()), cos.cuda(), sin.cuda(), 128, 64, **kw)
    for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(a, f), getattr(b, f).cpu()), f
    assert torch.equal(qa, qb.cpu())
    mods = [mnn.MLAQUpProj(K, H, 128, 64, weights="mxfp8", layout="sbhd", max_seq_len=64, seed=3, init_std=0.05)
            for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    mods[1].cuda()
    g = torch.Generator().manual_seed(6)
    xs = torch.randn(48, 2, K, generator=g).to(torch.bfloat16)
    dq, res = None, []
    for m, dev in zip(mods, ("cpu", "cuda")):
        xi = xs.to(dev).clone().requires_grad_()
        q8, anchor = m(xi)
        if dq is None:
            dq = torch.randn(anchor.shape, generator=g).to(torch.bfloat16)
        dx, dw = torch.autograd.grad(anchor, (xi, m.weight), dq.to(dev))
        res.append((q8.rowwise_data.cpu(), dx.cpu(), dw.cpu()))
    assert (res[0][0] != res[1][0]).float().mean() < 0.01
    assert rel(res[1][1], res[0][1]) < 0.01 and rel(res[1][2], res[0][2]) < 0.01


def _grads(m, x):
    xi = x.clone().requires_grad_()
    o = m(xi)
    o.float().square().mean().backward()
    return o.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8", "mxfp8-linears"])
def test_mla_block_tracks_bf16_at_deepseek_v3_dims(recipe):
    """DeepSeek-V3's MLA (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128),
    T 512, causal, the same weights: the "mxfp8" block (MXFP8 GEMMs, MXFP8 attention forward and
    backward), the "block-fp8" block (block-FP8 GEMMs, attention in bf16) and "mxfp8" with
    fp8_attention=False (MXFP8 GEMMs, attention in bf16) against the "bf16" block.
    Bounds: relative RMS of the output and dx < 10 %, of every parameter gradient < 25 % (the CPU
    test's bounds at small dims; the measured values are printed)."""
    kw = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=512, layout="bshd", seed=11)
    ref = mnn.MLA(**kw).cuda()
    mx = mnn.MLA(**kw, **recipe_kw(recipe)).cuda()
    mx.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 512, 7168, generator=g).to(torch.bfloat16).cuda()
    o0, dx0, p0 = _grads(ref, x)
    o1, dx1, p1 = _grads(mx, x)
    errs = {"out": rel(o1, o0), "dx": rel(dx1, dx0)}
    errs.update({n: rel(p1[n], gr) for n, gr in p0.items()})
    print(f"relative RMS, {recipe} vs bf16:", {k: round(v, 4) for k, v in errs.items()})
    assert all(math.isfinite(v) for v in errs.values()), errs
    assert errs["out"] < 0.1 and errs["dx"] < 0.1, errs
    for n in p0:
        assert errs[n] < 0.25, (n, errs[n])


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mla_mxfp8_block_cuda_against_cpu(layout):
    """The same "mxfp8" block on the CPU (float64 references of every MXFP8 op) and on the GPU (the
    CUDA kernels, fp32 accumulation): one set of MXFP8 math. Quantization is a step function (an fp32
    difference moves a value across a rounding boundary now and then), so: relative RMS < 3 % for the
    output and dx (measured: bshd, whose query path is the fused up-projection, 0.8 % and 2.1 %), < 10 %
    for every parameter gradient (the query path's gradients are differences of nearly equal terms at
    initialization, where the attention is nearly uniform: measured 4.4 % for wq_a on thd, the others
    below 3.1 %)."""
    kw = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=64, layout=layout, recipe="mxfp8", seed=7)  # the CUDA attention's heads: 192 / 128
    cpu = mnn.MLA(**kw)
    gpu = mnn.MLA(**kw).cuda()
    gpu.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn((2, 40, 64) if layout == "bshd" else (80, 64), generator=g).to(torch.bfloat16)
    cu = [0, 40, 80] if layout == "thd" else None
    res = []
    for m, xx in ((cpu, x), (gpu, x.cuda())):
        xi = xx.clone().requires_grad_()
        o = m(xi, cu_seqlens=cu)
        o.float().square().mean().backward()
        res.append((o.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    errs = {"out": rel(res[1][0], res[0][0]), "dx": rel(res[1][1], res[0][1])}
    errs.update({n: rel(res[1][2][n], gr) for n, gr in res[0][2].items()})
    print(f"relative RMS, {layout} CUDA vs CPU:", {k: round(v, 4) for k, v in errs.items()})
    assert errs.pop("out") < 0.03 and errs.pop("dx") < 0.03, errs
    for n, e in errs.items():
        assert e < 0.1, (n, e)


@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_mla_mxfp8_thd_is_bshd_bit_for_bit_on_whole_blocks(q_lora_rank):
    """The CUDA path of tests/python/test_nn.py's test of the same name, at the SM90 kernels' head dims
    (192 / 128): packed sequences of 32·n tokens give the bits of bshd with one sequence a batch row —
    output, dx and every gradient (deterministic=True: the attention backward's dQ in a fixed order)."""
    kw = dict(hidden=64, heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=320, seed=3, recipe="mxfp8", deterministic=True)
    m = mnn.MLA(**kw).cuda()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 320, 64, generator=g).to(torch.bfloat16).cuda()

    def step(xx, **k):
        m.zero_grad(set_to_none=True)
        xi = xx.clone().requires_grad_()
        o = m(xi, **k)
        o.float().square().mean().backward()
        return [o.detach().reshape(2, 320, 64), xi.grad.reshape(2, 320, 64)] + \
            [p.grad for _, p in sorted(m.named_parameters())]

    bshd = step(x)
    thd = step(x.reshape(640, 64), cu_seqlens=[0, 320, 640], layout="thd")
    names = ["out", "dx"] + [n for n, _ in sorted(m.named_parameters())]
    for n, a, b in zip(names, thd, bshd):
        assert torch.equal(a, b), (n, rel(a, b))


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mla_mxfp8_deterministic_gradients_are_bitwise_reproducible(layout):
    """MLA(deterministic=True) under "mxfp8": the attention backward adds dQ's parts in a fixed order,
    so two steps on the same data give the same bits in every gradient (the fused query path and
    attention_from_latent, thd with packed sequences); several key blocks of 96 and query tiles of 64. Its
    gradients agree with the default order's within fp32 summation-order noise (relative RMS < 1e-2)."""
    kw = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=512, layout=layout, recipe="mxfp8", seed=3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn((1, 500, 64) if layout == "bshd" else (500, 64), generator=g).to(torch.bfloat16).cuda()
    cu = [0, 300, 500] if layout == "thd" else None

    def grads(m):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        m(xi, cu_seqlens=cu).float().square().mean().backward()
        torch.cuda.synchronize()
        return [xi.grad] + [p.grad for _, p in sorted(m.named_parameters())]

    det = mnn.MLA(**kw, deterministic=True).cuda()
    runs = [grads(det) for _ in range(3)]
    for i in (1, 2):
        for a, b in zip(runs[0], runs[i]):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))
    free = mnn.MLA(**kw).cuda()
    free.load_state_dict(det.state_dict())
    for a, b in zip(grads(free), runs[0]):
        assert rel(a, b) < 1e-2


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8", "mxfp8-linears"])
def test_decoder_trains_on_the_gpu(recipe):
    """(block-fp8: its SwiGLU quantizes x once for w1 / w3 and defers w2's wgrad, its MLA likewise for
    wq_a / wkv_a and wo)"""
    torch.manual_seed(0)
    data = mnn.byte_tokens(TEXT.read_text())
    d = mnn.Decoder(hidden=64, layers=2, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=128, rope_dim=64,
                    v_dim=128, max_seq_len=64, seed=0, **recipe_kw(recipe)).cuda()
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    seq, losses = 64, []
    for _ in range(40):
        starts = torch.randint(0, len(data) - seq - 1, (8,), generator=g)
        w = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).cuda()
        loss = d.loss(w[:, :-1], w[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)
    assert sum(losses[-5:]) / 5 < 0.65 * losses[0], losses


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8", "mxfp8-linears"])
def test_mla_output_projection_keeps_the_attention_output_it_reads(recipe):
    """wo keeps the attention's saved O for its wgrad instead of an FP8 copy of its own, under both FP8
    recipes (block-fp8, and mxfp8 with its attention in bf16: cuDNN's SDPA returns O in the query's bshd
    layout, rows of its own memory)."""
    from test_nn import mla_output_projection_keeps_the_attention_output

    mla_output_projection_keeps_the_attention_output(recipe, "cuda")


def _train_example():
    """examples/train_mla.py as a module (its make_optimizer, train_step and GraphedStep)."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_mla.py"
    spec = importlib.util.spec_from_file_location("train_mla_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same_bits(a, b):
    a, b = a.detach(), b.detach()
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["mxfp8", "block-fp8", "bf16"])
def test_cuda_graph_of_a_training_step_replays_the_eager_steps(recipe):
    """A whole training step of a small Decoder (forward, backward, gradient clipping, capturable AdamW
    with the learning rate as a device tensor) captured once in a CUDA graph after three eager warm-up
    steps on a side stream (examples/train_mla.py --cuda-graph's GraphedStep) and replayed on nine new
    batches at a changing learning rate, against the same twelve steps run eagerly from the same
    weights: under "mxfp8" (deterministic attention backward; mxmla's GEMMs sum in a fixed order) the
    same bits in every loss and weight; under "block-fp8" and "bf16", whose torch SDPA backward need
    not be reproducible, the losses within 2e-3 and the weights within relative RMS 1e-2. A replay that
    left out work the host decided at capture (a weight's MXFP8 copy cached instead of quantized
    again, a stale learning rate or input) would train on other values and fail this."""
    ex = _train_example()
    kw = dict(hidden=64, layers=2, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=64, seed=0, recipe=recipe, deterministic=recipe == "mxfp8")
    data = mnn.byte_tokens(TEXT.read_text())
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(12):
        starts = torch.randint(0, len(data) - 65, (8,), generator=g)
        w = torch.stack([data[s:s + 65] for s in starts.tolist()]).cuda()
        batches.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    lrs = [1e-2 * (1 - i / 16) for i in range(12)]
    eager, graphed = mnn.Decoder(**kw).cuda(), mnn.Decoder(**kw).cuda()
    graphed.load_state_dict(eager.state_dict())
    opt_e, opt_g = ex.make_optimizer(eager, lrs[0], graph=True), ex.make_optimizer(graphed, lrs[0], graph=True)

    ref = []
    for (x, y), lr in zip(batches, lrs):
        ex.set_lr(opt_e, lr)
        ref.append(ex.train_step(eager, opt_e, x, y).detach().clone())
    side, step, got = torch.cuda.Stream(), None, []
    side.wait_stream(torch.cuda.current_stream())
    for i, ((x, y), lr) in enumerate(zip(batches, lrs)):
        if i < ex.GRAPH_WARMUP:
            with torch.cuda.stream(side):
                ex.set_lr(opt_g, lr)
                got.append(ex.train_step(graphed, opt_g, x, y).detach().clone())
            torch.cuda.current_stream().wait_stream(side)
            continue
        if step is None:
            step = ex.GraphedStep(graphed, opt_g, x, y)
        ex.set_lr(opt_g, lr)
        got.append(step(x, y))
    torch.cuda.synchronize()
    ref, got = torch.stack(ref).float().cpu(), torch.stack(got).float().cpu()
    assert torch.isfinite(got).all() and ref[-1] < ref[0], (ref, got)
    params = list(zip(eager.state_dict().items(), graphed.state_dict().values()))
    if recipe == "mxfp8":
        assert _same_bits(ref, got), (ref, got)
        for (name, a), b in params:
            assert _same_bits(a, b), name
    else:
        assert (ref - got).abs().max() < 2e-3, (ref, got)
        for (name, a), b in params:
            assert rel(b, a) < 1e-2, name


def test_make_graphed_callables_runs_the_mxfp8_mla_block():
    """torch.cuda.make_graphed_callables on an "mxfp8" MLA block (per-layer graphs of the forward and
    the backward, as Megatron's and TransformerEngine's layer-wise CUDA graphs use them; deterministic
    attention backward): the output, the input's gradient and every weight gradient equal eager calls'
    bit for bit on two new inputs, after the weights changed in place between them (the graph
    quantizes them again; it holds no cached copy)."""
    kw = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=256, recipe="mxfp8", seed=3, deterministic=True)
    eager, block = mnn.MLA(**kw).cuda(), mnn.MLA(**kw).cuda()
    block.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn((2, 200, 64), generator=g).to(torch.bfloat16).cuda().requires_grad_() for _ in range(3)]
    graphed = torch.cuda.make_graphed_callables(block, (xs[0],), num_warmup_iters=3)
    for i, x in enumerate(xs[1:]):
        if i:
            with torch.no_grad():
                for m in (eager, block):
                    for p in m.parameters():
                        p.mul_(0.75)
        outs = []
        for m in (eager, graphed):
            for p in block.parameters():
                p.grad = None
            for p in eager.parameters():
                p.grad = None
            xi = x.detach().clone().requires_grad_()
            y = m(xi)
            y.float().square().mean().backward()
            src = eager if m is eager else block
            outs.append([y.detach().clone(), xi.grad.clone()] + [p.grad.clone() for _, p in sorted(src.named_parameters())])
        torch.cuda.synchronize()
        for a, b in zip(*outs):
            assert _same_bits(a, b)


def test_packed_sequences_refuse_cuda_graph_capture():
    """An MLA block on packed sequences (thd) builds its RoPE positions on the host at each call; under
    CUDA graph capture that would bake the capture's into every replay, so it is a clear error."""
    block = mnn.MLA(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=128, rope_dim=64, v_dim=128,
                    max_seq_len=64, layout="thd", recipe="mxfp8", seed=3).cuda()
    x = torch.randn(40, 64, device="cuda").to(torch.bfloat16)
    from cuda_capture import refused_under_capture

    block(x, cu_seqlens=[0, 24, 40])  # eagerly: fine
    refused_under_capture(torch, lambda: block(x, cu_seqlens=[0, 24, 40]), RuntimeError,
                          r"packed sequences \(layout 'thd'\) cannot be captured")
