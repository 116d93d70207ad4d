"""Context parallelism (mxmla.nn.context_parallel_attention, MLA / Decoder with cp_group) on 2-4 CPU
processes with the gloo backend (and, where a GPU is visible, on the one GPU and on two): each rank
holds chunks r and 2·cp−1−r of the sequence (cp_split), the keys and values go around the ring, and
the gathered output and gradients are compared with the whole sequence's on one process.

References and bounds:
- the attention against float64 attention of the dequantized whole-sequence inputs (plain torch
  math, its own mask and autograd; with chunks of 32 tokens their MXFP8 blocks are the whole
  sequence's; with power-of-two scales a normal value rounds the same in any block): O within
  relative RMS 0.5 % and every element within 0.02 + 0.02·|ref| (the attention forward's bounds),
  dQ, dK, dV within relative RMS 1 % and 0.02·max|ref| + 0.05·|ref| (the backward's); measured
  ≤ 0.25 % and ≤ 0.31 %;
- the attention against mxmla's attention of the whole sequence (no ring, no merge): O within 2^-6
  of O's largest magnitude (each pair's O is rounded to bf16 before the fp32 merge, then the merged
  O once more; measured ≤ 0.6 %);
- MLA, the decoder and tp × cp: the bounds of MLA_BOUND and _decoder_case (those of the tensor
  parallel tests).
Mutations checked by hand: the pair rule of the later steps swapped fails every causal case (errors
about 100 %); the ring reversed fails the cases with cp >= 3 (with two ranks both directions are the
same ring); MLA's RoPE at positions 0..s-1 instead of the chunks' fails q's weight gradients (30-50 %);
a Decoder whose blocks do not get cp_group fails by about 100 %."""
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.multiprocessing")

from test_tp import spawn_ranks, tp_slice  # noqa: E402  (ranks' processes with a deadline; the shard of a whole gradient)


def _spawn(world, case, *args, device="cpu"):
    """case on `world` processes (device "cpu" / "cuda": gloo, "cuda2": NCCL, a GPU a rank); each rank's result."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    with tempfile.TemporaryDirectory() as d:
        init, out = os.path.join(d, "init"), os.path.join(d, "result")
        spawn_ranks((world, init, out, case, device, *args), world, case.__name__)
        errs = [open(os.path.join(d, f)).read() for f in os.listdir(d) if ".err" in f]
        assert not errs, errs[0]
        return [eval(open(f"{out}.rank{r}").read()) for r in range(world)]  # noqa: S307 - our own repr


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / (b.norm() + 1e-30))


def _f64_attention(q, k, v, causal, scale, layout, cu=None):
    """float64 softmax(Q·Kᵀ·scale)·V of [b, s, h, d] (bshd), [s, b, h, d] (sbhd) or [t, h, d] (thd: the
    sequences of cu attend to themselves only), GQA by repeating K, V."""
    if layout == "thd":
        q, k, v = (t.unsqueeze(0) for t in (q, k, v))
    elif layout == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n = s.shape[-1]
    hidden = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else torch.zeros(n, n, dtype=torch.bool)
    if layout == "thd":  # no attention across sequences
        seq_of = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        hidden |= seq_of[:, None] != seq_of[None, :]
    o = torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(hidden, float("-inf")).softmax(-1), v)
    return o[0] if layout == "thd" else o.transpose(0, 1) if layout == "sbhd" else o


def _dequantized(x, layout, fp8, columnwise=False):
    """x as the attention forward reads it: bf16 as it is, MXFP8 through one copy (Q, K rowwise; V
    columnwise), dequantized."""
    import mxmla
    from mxmla.attention_autograd import quantize_for_attention

    if not fp8:
        return x.double()
    m = mxmla.quantize(x.flatten(1)) if layout == "thd" else quantize_for_attention(x, layout)  # thd: as [t, h·d]
    return mxmla.dequantize(m, columnwise=columnwise).double().reshape(x.shape)


def _attn_case(rank, world, device, backend, layout, causal, fp8, h_kv, dims, group="world", cu=None, comm="p2p"):
    """The ring's O and gradients (gathered) against the whole sequence's (on `device`; the float64
    reference on the CPU). thd: the sequences of cu (dims' s is their token count, b unused)."""
    import mxmla
    from mxmla.nn import DotProductAttention
    from mxmla.nn.cp import context_parallel_attention, cp_gather, cp_split

    group = dist.group.WORLD if group == "world" else group
    b, s, h, d, dv = dims
    seq = 1 if layout == "bshd" else 0
    g = torch.Generator().manual_seed(7)

    def rnd(heads, dd):
        shape = (s, heads, dd) if layout == "thd" else (b, s, heads, dd) if seq == 1 else (s, b, heads, dd)
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    q, k, v = rnd(h, d), rnd(h_kv, d), rnd(h_kv, dv)
    do = rnd(h, dv)
    mine = [cp_split(t, seq, group, cu).to(device).requires_grad_() for t in (q, k, v)]
    o = context_parallel_attention(*mine, group, causal=causal, layout=layout, fp8=fp8, cu_seqlens=cu,
                                   cp_comm_type=comm)
    o.backward(cp_split(do, seq, group, cu).to(device))
    got = [cp_gather(t, seq, group, cu).cpu() for t in (o.detach(), *(m.grad for m in mine))]

    scale = d ** -0.5
    ref_in = [_dequantized(t, layout, fp8, i == 2).requires_grad_() for i, t in enumerate((q, k, v))]
    ref_o = _f64_attention(*ref_in, causal, scale, layout, cu)
    ref_o.backward(do.double())
    refs = [ref_o.detach()] + [t.grad for t in ref_in]
    errs, bad = {}, {}
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        rel = _rel(got[i], refs[i])
        diff = (got[i].double() - refs[i]).abs()
        if i == 0:
            ok = rel <= 5e-3 and bool((diff <= 0.02 + 0.02 * refs[i].abs()).all())
        else:
            ok = rel <= 1e-2 and bool((diff <= 0.02 * refs[i].abs().max() + 0.05 * refs[i].abs()).all())
        errs[name] = rel
        if not ok:
            bad[name] = (rel, float(diff.max()))
    # against mxmla's own attention of the whole sequence (no ring, no merge)
    qw, kw, vw = (t.to(device).clone().requires_grad_() for t in (q, k, v))
    if fp8:
        whole = DotProductAttention(causal=causal, layout=layout)(qw, kw, vw, cu_seqlens_q=cu)
    else:
        from mxmla.nn.cp import _BF16Attention

        whole = _BF16Attention.apply(qw, kw, vw, dict(causal=causal, layout=layout, cu_seqlens_q=cu,
                                                      cu_seqlens_kv=cu), False)
    if comm == "a2a":  # the whole sequences' attention per head: the same bits, forward and backward
        whole.backward(do.to(device))
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, (whole, qw.grad, kw.grad, vw.grad)):
            if not torch.equal(a, b.detach().cpu()):
                bad[f"{name}_bits"] = float((a.double() - b.detach().cpu().double()).abs().max())
    whole = whole.detach().cpu()
    gap = float((got[0].double() - whole.double()).abs().max() / whole.double().abs().max())
    errs["o_vs_whole"] = gap
    if gap > 2.0 ** -6:
        bad["o_vs_whole"] = gap
    return dict(bad=bad, errs=errs)


CASES = [  # (cp, layout, causal, fp8, h_kv)
    (2, "bshd", True, True, 2),
    (3, "bshd", True, True, 1),  # an odd ring; GQA (2 query heads a key head)
    (2, "sbhd", True, False, 2),  # bf16 operands
    (2, "bshd", False, True, 2),
    (4, "sbhd", True, True, 2),
]


@pytest.mark.parametrize("cp,layout,causal,fp8,h_kv", CASES)
def test_context_parallel_attention_matches_the_whole_sequence(cp, layout, causal, fp8, h_kv):
    dims = (2, 2 * cp * 32, 2, 64, 32)  # b, whole s (chunks of 32 tokens), h, d_qk, d_v
    for r, res in enumerate(_spawn(cp, _attn_case, layout, causal, fp8, h_kv, dims)):
        assert not res["bad"], (r, res["errs"], res["bad"])


@pytest.mark.parametrize("cp,causal,fp8", [(2, True, True), (3, True, True), (2, False, False)])
def test_packed_sequences(cp, causal, fp8):
    """thd: sequences of 2·cp·{32, 0, 64, 8} tokens (an empty one, chunks of 8 tokens: MXFP8 tail blocks)
    split per sequence, each attending to itself only."""
    lens = [2 * cp * n for n in (32, 0, 64, 8)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    for r, res in enumerate(_spawn(cp, _attn_case, "thd", causal, fp8, 2, (1, cu[-1], 4, 64, 32), "world", cu)):
        assert not res["bad"], (r, res["errs"], res["bad"])


@pytest.mark.parametrize("cp,layout,causal,fp8", [(2, "bshd", True, True), (3, "sbhd", True, False),
                                                 (2, "bshd", False, True), (2, "thd", True, True)])
def test_all_to_all_gives_the_whole_sequences_bits(cp, layout, causal, fp8):
    """cp_comm_type "a2a": the output and the gradients bit for bit those of attention on the whole
    sequences (each head's attention runs unsplit on one rank), and within the float64 bounds."""
    cu, dims = None, (2, 2 * cp * 32, 2 * cp, 64, 32)
    if layout == "thd":
        cu = [0, 2 * cp * 32, 2 * cp * 32, 2 * cp * 40]
        dims = (1, cu[-1], 2 * cp, 64, 32)
    for r, res in enumerate(_spawn(cp, _attn_case, layout, causal, fp8, cp, dims, "world", cu, "a2a")):
        assert not res["bad"], (r, res["errs"], res["bad"])


def test_chunks_that_are_not_multiples_of_32_tokens():
    """Chunks of 24 tokens: each chunk's MXFP8 blocks are its own (a tail block of 24), not the whole
    sequence's; with power-of-two scales a normal value rounds the same in either block, so the
    float64 reference of the whole sequence's quantization still holds within the bounds."""
    for r, res in enumerate(_spawn(3, _attn_case, "bshd", True, True, 2, (1, 2 * 3 * 24, 2, 64, 32))):
        assert not res["bad"], (r, res["errs"], res["bad"])


def _one_rank_case(device):
    """cp_group None: the chunked path (pairs, merge) on one process against DotProductAttention."""
    return _attn_case(0, 1, device, None, "bshd", True, True, 2, (2, 256, 2, 64 if device == "cpu" else 192,
                                                                   32 if device == "cpu" else 128), group=None)


def test_one_rank_runs_the_chunked_path():
    res = _one_rank_case("cpu")
    assert not res["bad"], (res["errs"], res["bad"])


def test_bad_input_gets_clear_errors():
    from mxmla.nn import DotProductAttention
    from mxmla.nn.cp import context_parallel_attention, cp_split

    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even"):
        context_parallel_attention(q[:, :7], q[:, :7], q[:, :7], None)
    with pytest.raises(ValueError, match="argument 'k': 6 tokens .* differ from q's 8"):
        context_parallel_attention(q, q[:, :6], q, None)
    with pytest.raises(ValueError, match="'bshd', 'sbhd' or 'thd'"):
        context_parallel_attention(q, q, q, None, layout="bhsd")
    with pytest.raises(TypeError, match="argument 'v'.*bfloat16"):
        context_parallel_attention(q, q, q.float(), None)
    with pytest.raises(TypeError, match="argument 'q'.*3-D"):
        context_parallel_attention(q, q, q, None, layout="thd", cu_seqlens=[0, 8])
    t = q[0]  # [8, 2, 64] packed
    with pytest.raises(ValueError, match="'cu_seqlens'.*needs the whole sequences'"):
        context_parallel_attention(t, t, t, None, layout="thd")
    with pytest.raises(ValueError, match="cu_seqlens must start at 0.*end at the token count 8"):
        context_parallel_attention(t, t, t, None, layout="thd", cu_seqlens=[0, 6])
    with pytest.raises(ValueError, match="multiple of 2·cp \\(2\\).*lengths \\[3, 3\\]"):
        context_parallel_attention(t, t, t, None, layout="thd", cu_seqlens=[0, 2, 5, 8])
    with pytest.raises(ValueError, match="'cu_seqlens': is for layout 'thd'"):
        context_parallel_attention(q, q, q, None, cu_seqlens=[0, 8])
    with pytest.raises(ValueError, match="cp_group.*'sbhd', 'bshd' or 'thd'"):
        DotProductAttention(layout="bhsd", cp_group=object())
    with pytest.raises(RuntimeError, match="not initialized"):
        context_parallel_attention(q, q, q, object())
    if not dist.is_initialized():
        import mxmla.nn as mnn

        with pytest.raises(RuntimeError, match="cp_group given, but torch.distributed is not initialized"):
            mnn.MLA(**MLA_KW, cp_group=object())
    with pytest.raises(ValueError, match="divisible by 2·cp"):
        import mxmla.nn.cp as cpm

        old = cpm.cp_size_rank
        cpm.cp_size_rank = lambda g: (2, 0)
        try:
            cp_split(q[:, :6], 1, object())
        finally:
            cpm.cp_size_rank = old


MLA_KW = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              max_seq_len=256, seed=5)
# DeepSeek-V3's head dims (the CUDA kernels' shapes), few heads, small projections
MLA_KW_GPU = dict(hidden=256, heads=4, q_lora_rank=64, kv_lora_rank=64, nope_dim=128, rope_dim=64, v_dim=128,
                  max_seq_len=512, seed=5)
# relative RMS against the unsplit block (the same weights): bf16 as tensor parallelism's (its attention is
# mxmla's bf16 one here, torch's SDPA without cp: roundings apart); mxfp8 2^-4 (a value that differs by a bf16
# rounding and is quantized again moves by one E4M3 step now and then; the unsplit block's query path is
# the fused op, the split one's an MXFP8 Linear and RoPE)
MLA_BOUND = {"bf16": 2.0 ** -7, "mxfp8": 2.0 ** -4, "block-fp8": 2.0 ** -4}


def _mla_case(rank, world, device, backend, recipe, layout, comm="p2p"):
    """MLA(cp_group) on this rank's chunks against MLA on the whole sequence: the gathered output and input
    gradient, and every parameter's gradient summed over the ranks."""
    import mxmla.nn as mnn
    from mxmla.nn.cp import cp_gather, cp_split

    group = dist.group.WORLD
    kw = dict(MLA_KW if device == "cpu" else MLA_KW_GPU, recipe=recipe, layout=layout, device=device)
    whole, split = mnn.MLA(**kw), mnn.MLA(**kw, cp_group=group, cp_comm_type=comm)
    seq = 1 if layout == "bshd" else 0
    g = torch.Generator().manual_seed(3)
    s = 2 * world * 32
    cu = None
    if layout == "thd":  # three packed sequences of 2·cp·{32, 8, 16} tokens
        cu = [0, 2 * world * 32, 2 * world * 40, 2 * world * 56]
        shape = (cu[-1], kw["hidden"])
    else:
        shape = (2, s, kw["hidden"]) if seq == 1 else (s, 2, kw["hidden"])
    x, dy = (torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    xw = x.clone().requires_grad_()
    whole(xw, cu_seqlens=cu).backward(dy)
    xs = cp_split(x, seq, group, cu).requires_grad_()
    split(xs, cu_seqlens=cu).backward(cp_split(dy, seq, group, cu))
    with torch.no_grad():
        y_whole = whole(x, cu_seqlens=cu)
        y_split = cp_gather(split(cp_split(x, seq, group, cu), cu_seqlens=cu), seq, group, cu)
    pairs = [("y", y_split, y_whole), ("dx", cp_gather(xs.grad, seq, group, cu), xw.grad)]
    for (name, p), (_, p2) in zip(split.named_parameters(), whole.named_parameters()):
        gsum = p.grad.clone()
        dist.all_reduce(gsum, group=group)
        pairs.append((name, gsum, p2.grad))
    errs = {name: _rel(a, b) for name, a, b in pairs}
    return dict(bad={k: v for k, v in errs.items() if not v <= MLA_BOUND[recipe]}, errs=errs)


@pytest.mark.parametrize("cp,recipe,layout,comm", [(2, "bf16", "bshd", "p2p"), (2, "mxfp8", "bshd", "p2p"),
                                                   (3, "mxfp8", "sbhd", "p2p"), (2, "block-fp8", "sbhd", "p2p"),
                                                   (2, "mxfp8", "thd", "p2p"), (3, "bf16", "thd", "p2p"),
                                                   (2, "mxfp8", "bshd", "a2a"), (4, "bf16", "thd", "a2a")])
def test_mla_context_parallel_matches_the_whole_sequence(cp, recipe, layout, comm):
    for r, res in enumerate(_spawn(cp, _mla_case, recipe, layout, comm)):
        assert not res["bad"], (r, res["errs"], res["bad"])


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="fewer than two CUDA devices visible (the two-GPU run)")
GPU_DIMS = (2, 2 * 2 * 64, 4, 192, 128)  # b, whole s, h, d_qk, d_v: DeepSeek-V3's head dims


@ON_GPU
def test_cuda_one_rank_runs_the_chunked_path():
    res = _one_rank_case("cuda")
    assert not res["bad"], (res["errs"], res["bad"])


@ON_GPU
@pytest.mark.parametrize("fp8,causal,layout,comm", [(True, True, "bshd", "p2p"), (False, True, "bshd", "p2p"),
                                                    (True, False, "bshd", "p2p"), (True, True, "thd", "p2p"),
                                                    (True, True, "bshd", "a2a"), (True, True, "thd", "a2a")])
def test_cuda_context_parallel_attention_on_one_gpu(fp8, causal, layout, comm):
    """Two processes on the one GPU (gloo: the ring's buffers staged through the host): the CUDA kernels
    on the chunks, the ring's logic as on two GPUs. thd: sequences of 4·{64, 0, 96, 8} tokens. a2a: the
    whole sequences' bits too."""
    cu, dims = None, GPU_DIMS
    if layout == "thd":
        cu = [0, 256, 256, 640, 672]
        dims = (1, cu[-1]) + GPU_DIMS[2:]
    for r, res in enumerate(_spawn(2, _attn_case, layout, causal, fp8, 2, dims, "world", cu, comm, device="cuda")):
        assert not res["bad"], (r, res["errs"], res["bad"])


@ON_GPU
@pytest.mark.parametrize("recipe,layout", [("mxfp8", "bshd"), ("block-fp8", "bshd"), ("mxfp8", "thd")])
def test_cuda_mla_context_parallel_on_one_gpu(recipe, layout):
    for r, res in enumerate(_spawn(2, _mla_case, recipe, layout, device="cuda")):
        assert not res["bad"], (r, res["errs"], res["bad"])


@TWO_GPUS
def test_two_gpus_context_parallel_attention_nccl():
    """A GPU a rank, NCCL's point-to-point sends on their own streams while the attention runs."""
    for r, res in enumerate(_spawn(2, _attn_case, "bshd", True, True, 2, GPU_DIMS, device="cuda2")):
        assert not res["bad"], (r, res["errs"], res["bad"])


@TWO_GPUS
def test_two_gpus_mla_context_parallel_nccl():
    for r, res in enumerate(_spawn(2, _mla_case, "mxfp8", "bshd", device="cuda2")):
        assert not res["bad"], (r, res["errs"], res["bad"])


def _decoder_case(rank, world, device, backend, recipe, packed=False):
    """Decoder(cp_group): the mean of the ranks' losses and the ranks' summed (/ cp) gradients against the
    whole sequence's loss and gradients."""
    import mxmla.nn as mnn
    from mxmla.nn.cp import cp_split

    group = dist.group.WORLD
    kw = dict(hidden=64, layers=2, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32,
              inter_dim=96, max_seq_len=256, recipe=recipe, seed=4)
    whole, split = mnn.Decoder(**kw), mnn.Decoder(**kw, cp_group=group)
    gen = torch.Generator().manual_seed(9)
    if packed:  # sequences of 2·cp·{32, 16} tokens, packed; random targets
        cu = [0, 2 * world * 32, 2 * world * 48]
        x, y = (torch.randint(0, 256, (cu[-1],), generator=gen) for _ in range(2))
        dim = 0
    else:
        tokens = torch.randint(0, 256, (2, 2 * world * 32 + 1), generator=gen)
        x, y, cu, dim = tokens[:, :-1], tokens[:, 1:], None, 1
    lw = whole.loss(x, y, cu_seqlens=cu)
    lw.backward()
    ls = split.loss(cp_split(x, dim, group, cu), cp_split(y, dim, group, cu), cu_seqlens=cu)
    ls.backward()
    mean = ls.detach().clone()
    dist.all_reduce(mean, group=group)
    errs = {"loss": abs(float(mean) / world - float(lw.detach())) / float(lw.detach())}
    for (name, p), (_, p2) in zip(split.named_parameters(), whole.named_parameters()):
        gsum = p.grad.clone()
        dist.all_reduce(gsum, group=group)
        errs[name] = _rel(gsum / world, p2.grad)
    bound = {"bf16": 2.0 ** -7, "mxfp8": 2.0 ** -3}[recipe]  # mxfp8: two blocks deep (tensor parallelism's bound)
    return dict(bad={k: v for k, v in errs.items() if not v <= bound}, errs=errs)


@pytest.mark.parametrize("recipe,packed", [("bf16", False), ("mxfp8", False), ("mxfp8", True)])
def test_decoder_context_parallel_matches_the_whole_sequence(recipe, packed):
    """The loss of a token is its own (the head and the norms per token), so the whole sequence's mean loss
    is the mean of the ranks' (equal token counts), and its gradient the mean of theirs."""
    for r, res in enumerate(_spawn(2, _decoder_case, recipe, packed)):
        assert not res["bad"], (r, res["errs"], res["bad"])


def _tp_cp_case(rank, world, device, backend, recipe, sp):
    """MLA with tensor parallelism (tp 2: heads) and context parallelism (cp 2: the sequence) on four
    ranks -- tp groups {0, 1}, {2, 3}; cp groups {0, 2}, {1, 3} -- against MLA on the whole sequence:
    the gathered output and input gradient, each rank's shard of every gradient summed over its cp group."""
    import mxmla.nn as mnn
    from mxmla.nn.cp import cp_gather, cp_split

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, cp_rank = rank % 2, rank // 2
    tpg, cpg = tp_groups[cp_rank], cp_groups[tp_rank]
    kw = dict(MLA_KW, recipe=recipe, layout="bshd", device=device)
    whole = mnn.MLA(**kw)
    split = mnn.MLA(**kw, tp_group=tpg, cp_group=cpg, sequence_parallel=sp)
    g = torch.Generator().manual_seed(3)
    shape = (2, 2 * 2 * 32, kw["hidden"])
    x, dy = (torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    xw = x.clone().requires_grad_()
    whole(xw).backward(dy)
    # sequence parallelism: each tp rank's slice of its cp part
    sp_part = (lambda t: t.chunk(2, dim=1)[tp_rank]) if sp else (lambda t: t)  # noqa: E731
    xs = sp_part(cp_split(x, 1, cpg)).clone().requires_grad_()
    y = split(xs)
    y.backward(sp_part(cp_split(dy, 1, cpg)))

    def whole_seq(t):  # this rank's part back to the whole sequence
        if sp:
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=tpg)
            t = torch.cat(parts, 1)
        return cp_gather(t, 1, cpg)

    errs = {"y": _rel(whole_seq(y.detach()), whole(x).detach()), "dx": _rel(whole_seq(xs.grad), xw.grad)}
    for name, p in split.named_parameters():
        gsum = p.grad.clone()
        dist.all_reduce(gsum, group=cpg)
        errs[name] = _rel(gsum, tp_slice(split, name, dict(whole.named_parameters())[name].grad, tp_rank))
    return dict(bad={k: v for k, v in errs.items() if not v <= MLA_BOUND[recipe]}, errs=errs)


@pytest.mark.parametrize("recipe,sp", [("bf16", False), ("mxfp8", False), ("mxfp8", True)])
def test_tensor_and_context_parallel_together(recipe, sp):
    for r, res in enumerate(_spawn(4, _tp_cp_case, recipe, sp)):
        assert not res["bad"], (r, res["errs"], res["bad"])


def test_train_script_cp2_on_gloo_matches_one_process(tmp_path):
    """examples/train_mla.py --cp 2 (also with --cp-comm a2a, and --cp 2 --tp 2 --sp on four processes)
    under torch.distributed.run with gloo: the same losses as one process for both recipes (measured
    within 1e-4 relative), and --cp's argument checks."""
    import csv
    import subprocess
    import sys

    from test_tp import _cpu_launch_env

    root, env = _cpu_launch_env()
    common = [str(root / "examples" / "train_mla.py"), "--steps", "3", "--recipe", "bf16,mxfp8", "--text-file",
              str(root / "tests" / "python" / "data" / "tiny_corpus.txt")]
    dist_run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    runs = {}
    for name, launch, extra in (("one", [sys.executable], []), ("cp2", dist_run + ["2"], ["--cp", "2"]),
                                ("cp2a2a", dist_run + ["2"], ["--cp", "2", "--cp-comm", "a2a"]),
                                ("cp2tp2", dist_run + ["4"], ["--cp", "2", "--tp", "2", "--sp"])):
        out = tmp_path / name
        r = subprocess.run(launch + common + extra + ["--out", str(out)], capture_output=True, text=True,
                           timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("context parallel over 2 ranks" in r.stdout) == (name != "one"), r.stdout
        for recipe in ("bf16", "mxfp8"):
            with open(out / f"loss_{recipe}.csv") as f:
                runs[name, recipe] = [float(row["loss"]) for row in csv.DictReader(f)]
    for recipe in ("bf16", "mxfp8"):
        assert len(runs["one", recipe]) == 3
        for name in ("cp2", "cp2a2a", "cp2tp2"):
            for a, b in zip(runs["one", recipe], runs[name, recipe]):
                assert abs(a - b) <= 1e-3 * abs(a), runs
    r = subprocess.run([sys.executable] + common[:1] + ["--cp", "2", "--seq", "30"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and "must be a multiple of 2 x --cp (4)" in r.stderr, r.stderr
    r = subprocess.run([sys.executable] + common + ["--cp", "2"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode != 0 and "--cp 2 needs 2 processes" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("a2a", [False, True])
def test_cp_step_bench_runs_on_gloo(a2a):
    """bench/mla_cp_step.py --small under torch.distributed.run (two CPU processes, gloo): both recipes'
    rows, the cp step's output against the whole sequence's within MLA_BOUND, the ring's exchanges (one
    in the forward, three in the backward at cp 2), or with --a2a the all-to-alls (q, k, v, O and
    their gradients: eight)."""
    import re
    import subprocess
    import sys

    from test_tp import _cpu_launch_env

    root, env = _cpu_launch_env()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(root / "bench" / "mla_cp_step.py"), "--small"] + (["--a2a"] if a2a else []),
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "not a performance figure" in r.stdout and "context parallel over 2 ranks" in r.stdout, r.stdout
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s*128\s+(bf16|mxfp8)\s.*\s(\S+)$", r.stdout, re.M)}
    assert set(rows) == {"bf16", "mxfp8"}, r.stdout
    assert rows["bf16"] <= MLA_BOUND["bf16"] and rows["mxfp8"] <= MLA_BOUND["mxfp8"], r.stdout
    what = "all-to-alls in a cp step: 8," if a2a else "ring exchanges in a cp step: 4,"
    assert r.stdout.count(what) == 2, r.stdout


def _wrapped_case(rank, world, device, backend):
    """MLA(cp_group) under torch.utils.checkpoint (its forward, ring included, run again in the backward)
    and under torch.compile (graph breaks around the ring), each against the plain module on the same
    chunks: checkpointing bit for bit; compile within 1e-6 relative (its fused RMSNorm sums in another
    order: measured 3e-9 absolute on the norms' weight gradients, the rest bit for bit)."""
    import mxmla.nn as mnn
    from mxmla.nn.cp import cp_split
    from torch.utils.checkpoint import checkpoint

    group = dist.group.WORLD
    kw = dict(MLA_KW, recipe="mxfp8", layout="bshd")
    x = cp_split(torch.randn(2, 2 * world * 32, kw["hidden"], generator=torch.Generator().manual_seed(3))
                 .to(torch.bfloat16), 1, group)
    ref = mnn.MLA(**kw, cp_group=group)
    a = x.clone().requires_grad_()
    ref(a).float().square().sum().backward()
    errs = {}
    for mode in ("checkpoint", "compile"):
        m = mnn.MLA(**kw, cp_group=group)
        b = x.clone().requires_grad_()
        y = checkpoint(m, b, use_reentrant=False) if mode == "checkpoint" else torch.compile(m)(b)
        y.float().square().sum().backward()
        pairs = [("dx", b.grad, a.grad)] + [(n, p.grad, q.grad) for (n, p), (_, q) in
                                            zip(m.named_parameters(), ref.named_parameters())]
        errs[mode] = {n: _rel(u, v) for n, u, v in pairs}
    bad = {f"{mode} {n}": e for mode, d in errs.items() for n, e in d.items()
           if e > (0.0 if mode == "checkpoint" else 1e-6)}
    return dict(bad=bad, errs=errs)


def test_mla_context_parallel_under_checkpointing_and_compile():
    for r, res in enumerate(_spawn(2, _wrapped_case)):
        assert not res["bad"], (r, res["bad"])
