"""Tensor-parallel MLA (mxmla.nn.MLA(tp_group=...)) on two CPU processes with the gloo backend: the
forward output and every gradient at tp 2 against tp 1 on the same weights, and the unsharded state
dict round trip. Bounds (stated in the README), relative RMS: bf16 <= 2^-7 (wo's output is two bf16
partial sums added in fp32 and rounded again instead of one bf16 rounding; the replicated latents'
gradients likewise; measured < 0.3 %); mxfp8 <= 2^-4 (the MXFP8 blocks are the same at either tp size,
but a gradient that differs by a bf16 rounding is then quantized again, and an element near an E4M3
rounding midpoint moves by one E4M3 step, 2^-3 relative; measured about 3 %). On a GPU the same
comparison runs with both processes on the one GPU (gloo on CUDA tensors) at head dims that take
the CUDA kernels (the fused Q op, MXFP8 attention forward and backward, MXFP8 GEMMs): the sharded
math with the kernels that the two-GPU run uses. The whole decoder (MLA and the MLP tensor parallel,
with and without sequence parallelism) is compared the same way, with the bounds of DECODER_BOUNDS."""
import os
import sys
import tempfile
import time
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

KW = dict(hidden=64, heads=4, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32, max_seq_len=64,
          seed=5)
# DeepSeek-V3's head dims (the SM90 kernels' shapes), few heads and small projections
KW_GPU = dict(hidden=256, heads=4, q_lora_rank=64, kv_lora_rank=64, nope_dim=128, rope_dim=64, v_dim=128,
              max_seq_len=128, seed=5)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / (b.norm() + 1e-30))


def _run_rank(rank, world, init_file, result_file, case, device, *args):
    """One rank's process: joins the group (gloo; device "cuda2": one GPU a rank with NCCL, the
    two-GPU run), runs case(rank, world, device, backend, *args), writes the dict it returns (each
    rank its own results: its shards, its slice), or the traceback of what it raised."""
    try:
        backend = "gloo"
        if device == "cuda2":
            torch.cuda.set_device(rank)
            device, backend = f"cuda:{rank}", "nccl"
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = case(rank, world, device, backend, *args)
        with open(f"{result_file}.rank{rank}", "w") as f:
            f.write(repr(result))
        dist.barrier()  # no rank tears gloo down while the other still reads its last message
        dist.destroy_process_group()
        # leave without the interpreter's teardown: a gloo worker thread can still be releasing a
        # completed collective's tensors, which needs the GIL, and a thread that asks for it while the
        # interpreter finalizes aborts the process (std::terminate, SIGABRT, no Python exception)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except Exception:  # noqa: BLE001
        with open(result_file + f".err{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise


def tp_slice(tp_mla, name, whole, tp_rank):
    """The part of `whole` (a tensor of the unsharded MLA's parameter `name`) that tp_mla holds on tensor
    parallel rank tp_rank: its heads' rows (wq / wq_b, wkv_b), their columns (wo), or all (replicated)."""
    shards = {n: (per, col) for n, per, col in tp_mla._sharded()}
    mod = name.rsplit(".", 1)[0]
    if mod not in shards:
        return whole
    per, col = shards[mod]
    lo, hi = tp_rank * tp_mla.local_heads * per, (tp_rank + 1) * tp_mla.local_heads * per
    return whole[:, lo:hi] if col else whole[lo:hi]


def _mla_case(rank, world, device, backend, recipe, layout, q_lora, sp):
    """MLA at tp 2 against tp 1 on the same weights: the output, the input gradient and every
    parameter's gradient; the unsharded state dict both ways."""
    import mxmla.nn as mnn

    base = KW_GPU if device != "cpu" else KW
    kw = dict(base, recipe=recipe, layout=layout, q_lora_rank=q_lora or 0, device=device)
    full = mnn.MLA(**kw)
    tp = mnn.MLA(**kw, tp_group=dist.group.WORLD, sequence_parallel=sp)
    assert tp.local_heads == base["heads"] // world
    g = torch.Generator().manual_seed(3)
    hid = base["hidden"]
    shape = (2, 40, hid) if layout == "bshd" else (80, hid)
    x = torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
    cu = [0, 40, 80] if layout == "thd" else None
    res = []
    # sequence parallelism: each rank's slice of the sequence dim in and out; the loss is the sum of
    # the ranks' parts (each rank's output grad is its slice of the whole output's)
    seq = 1 if layout == "bshd" else 0
    mine = (lambda t: t.chunk(world, dim=seq)[rank]) if sp else (lambda t: t)  # noqa: E731
    for m in (full, tp):
        xi = (mine(x) if m is tp else x).clone().requires_grad_()
        o = m(xi, cu_seqlens=cu)
        (o.float().square().sum() * (1e3 / x.numel())).backward()  # (tp 1: the mean, times 1e3)
        res.append((o.detach() if m is tp else mine(o.detach()), xi.grad if m is tp else mine(xi.grad)))
    bound = 2.0 ** -7 if recipe == "bf16" else 2.0 ** -4
    errs = {"out": _rel(res[1][0], res[0][0]), "dx": _rel(res[1][1], res[0][1])}
    for name, p in tp.named_parameters():
        errs[name] = _rel(p.grad, tp_slice(tp, name, dict(full.named_parameters())[name].grad, rank))
    bad = {k: v for k, v in errs.items() if not v <= bound}
    same = reload_ok = True
    if backend == "nccl" or device == "cpu":  # the unsharded state dict round trip (not gloo on CUDA tensors)
        sd = tp.unsharded_state_dict()
        same = all(torch.equal(sd[k], v) for k, v in full.state_dict().items())
        other = mnn.MLA(**dict(kw, seed=99), tp_group=dist.group.WORLD)
        other.load_unsharded_state_dict(full.state_dict())
        reload_ok = all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), tp.state_dict().values()))
    return dict(bad=bad, errs=errs, sd_same=same, reload=reload_ok)


# The decoder's bounds, relative RMS against tp 1: recipe "bf16" computed in float64 (CPU) or float32
# (GPU: its SDPA and cuBLAS) — the sharding's math itself, summation order aside; "mxfp8" (one block)
# 2^-3: through the tensor-parallel MLP the gradient that reaches MLA differs by bf16 roundings too,
# and each difference can move an element across an E4M3 midpoint when it is quantized (measured:
# 3.8 % on the CPU, 6.4 % at the GPU dims, in wkv_a's gradient).
DECODER_BOUNDS = {torch.float64: 1e-10, torch.float32: 1e-4, "mxfp8": 2.0 ** -3}


def _decoder_case(rank, world, device, backend, recipe, layout, _q_lora, sp):
    """mxmla.nn.Decoder at tp 2 (Megatron's: MLA's heads and the MLP's inter_dim split; sp: the
    sequence split between the blocks) against tp 1 on the same weights: the loss, every gradient
    (each rank's shards against tp 1's), the unsharded state dict both ways; bad input errors.
    recipe "float64" / "float32": the "bf16" recipe computed in that dtype."""
    import mxmla.nn as mnn
    from mxmla.nn.tp import _shards

    dims = {k: v for k, v in (KW if device == "cpu" else KW_GPU).items() if k != "seed"}
    dtype = {"float64": torch.float64, "float32": torch.float32}.get(recipe, torch.bfloat16)
    kw = dict(dims, recipe="mxfp8" if recipe == "mxfp8" else "bf16", dtype=dtype, seed=7, device=device,
              layers=1 if recipe == "mxfp8" else 2)
    full = mnn.Decoder(**kw)
    tp = mnn.Decoder(**kw, tp_group=dist.group.WORLD, sequence_parallel=sp)
    g = torch.Generator().manual_seed(4)
    if layout == "bshd":
        tokens, cu = torch.randint(0, 256, (2, 41), generator=g), None
        inp, tgt = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    else:
        tokens, cu = torch.randint(0, 256, (81,), generator=g), [0, 30, 80]
        inp, tgt = tokens[:-1].to(device), tokens[1:].to(device)
    losses = []
    for m in (full, tp):
        loss = m.loss(inp, tgt, cu)
        loss.backward()
        losses.append(loss.detach().double())
    bound = DECODER_BOUNDS[recipe if recipe == "mxfp8" else dtype]
    errs = {"loss": float(abs(losses[1] - losses[0]) / losses[0])}
    dims_of = {key: dim for key, dim, _, _ in _shards(tp)}
    ref = dict(full.named_parameters())
    for name, prm in tp.named_parameters():
        r = ref[name].grad
        if name in dims_of:
            r = r.chunk(world, dim=dims_of[name])[rank]
        errs[name] = _rel(prm.grad, r)
    bad = {k: v for k, v in errs.items() if not v <= bound}
    same = reload_ok = True
    if backend == "nccl" or device == "cpu":  # the unsharded state dict round trip (not gloo on CUDA tensors)
        sd = tp.unsharded_state_dict()
        same = set(sd) == set(full.state_dict()) and all(torch.equal(sd[k], v) for k, v in full.state_dict().items())
        other = mnn.Decoder(**dict(kw, seed=99), tp_group=dist.group.WORLD, sequence_parallel=sp)
        other.load_unsharded_state_dict(full.state_dict())
        reload_ok = all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), tp.state_dict().values()))
    errors = []
    if sp:  # a sequence that the ranks cannot split evenly
        try:
            tp.loss(inp[..., :-1], tgt[..., :-1], [0, 30, 79] if cu else None)
        except ValueError as e:
            errors.append(str(e))
    try:  # an MLP width that the ranks cannot split
        mnn.SwiGLU(64, 99, tp_group=dist.group.WORLD)
    except ValueError as e:
        errors.append(str(e))
    return dict(bad=bad, errs=errs, sd_same=same, reload=reload_ok, errors=errors)


def _pretrained_case(rank, world, device, backend, naming, *_):
    """mxmla.nn.load_pretrained into a tensor-parallel Block (MLA's heads and the MLP's inter_dim split)
    from a whole (tp 1) checkpoint in `naming`: each rank's shards and replicated weights equal tp 1's
    module loaded from the same checkpoint, and pretrained_state_dict gathers the same checkpoint
    back on every rank."""
    import mxmla.nn as mnn
    from mxmla.nn.tp import _shards

    dims = {k: v for k, v in KW.items() if k not in ("seed", "max_seq_len")}
    kw = dict(dims, inter_dim=96, max_seq_len=64, dtype=torch.float64)
    ckpt = mnn.pretrained_state_dict(mnn.Block(**kw, seed=11), naming, prefix="model.layers.0.", dtype=None)
    full, tp = mnn.Block(**kw, seed=1), mnn.Block(**kw, seed=2, tp_group=dist.group.WORLD)
    for m in (full, tp):
        assert mnn.load_pretrained(m, ckpt, prefix="model.layers.0.") == naming
    dims_of = {key: dim for key, dim, _, _ in _shards(tp)}
    ref = full.state_dict()
    bad = {}
    for k, v in tp.state_dict().items():
        want = ref[k].chunk(world, dim=dims_of[k])[rank] if k in dims_of else ref[k]
        if not torch.equal(v, want):
            bad[k] = 1.0
    back = mnn.pretrained_state_dict(tp, naming, prefix="model.layers.0.", dtype=None)
    same = set(back) == set(ckpt) and all(torch.equal(back[k], v) for k, v in ckpt.items())
    # reload: the six sharded weights (MLA's wq_b, wkv_b, wo; the MLP's w1, w3, w2) were compared as shards
    return dict(bad=bad, errs={"sharded": len(dims_of)}, sd_same=same, reload=len(dims_of) == 6)


# how long the rank processes of one test may run before it fails instead of hanging the suite
SPAWN_TIMEOUT_S = float(os.environ.get("MXMLA_TEST_SPAWN_TIMEOUT", "300"))


def spawn_ranks(args, nprocs, what):
    """mp.spawn(_run_rank, args, nprocs) with a deadline: ranks still running after SPAWN_TIMEOUT_S
    seconds are killed and the test fails naming `what` (a rank that raised fails it as before)."""
    ctx = mp.spawn(_run_rank, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{what}: its {nprocs} rank processes were still running after {SPAWN_TIMEOUT_S:.0f} s "
                        "(MXMLA_TEST_SPAWN_TIMEOUT sets the limit); killed")


def _spawn(recipe, layout, q_lora, device, sp=False, case=_mla_case):
    """case (_mla_case) on two processes; both ranks' results merged (bad / errs keyed by rank; the
    state dict checks true on both); a rank's traceback fails the test."""
    with tempfile.TemporaryDirectory() as d:
        init, out = os.path.join(d, "init"), os.path.join(d, "result")
        spawn_ranks((2, init, out, case, device, recipe, layout, q_lora, sp), 2, case.__name__)
        errs = [open(os.path.join(d, f)).read() for f in os.listdir(d) if ".err" in f]
        assert not errs, errs[0]
        ranks = [eval(open(f"{out}.rank{r}").read()) for r in range(2)]  # noqa: S307 - our own repr
        return dict(bad={f"rank{r} {k}": v for r, x in enumerate(ranks) for k, v in x["bad"].items()},
                    errs={f"rank{r} {k}": v for r, x in enumerate(ranks) for k, v in x["errs"].items()},
                    sd_same=all(x["sd_same"] for x in ranks), reload=all(x["reload"] for x in ranks),
                    errors=[x.get("errors", []) for x in ranks])


def _sleep_case(rank, world, device, backend):
    time.sleep(120)


def test_spawned_ranks_that_hang_fail_the_test_instead_of_the_suite(monkeypatch):
    """A case whose ranks outlive the deadline fails its test, naming the case, soon after the deadline
    (shortened to 3 s here), not when the ranks' 120 s sleep ends."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    monkeypatch.setattr(sys.modules[__name__], "SPAWN_TIMEOUT_S", 3.0)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(pytest.fail.Exception, match=r"_sleep_case: its 2 rank processes were still running after 3 s"):
            spawn_ranks((2, os.path.join(d, "init"), os.path.join(d, "result"), _sleep_case, "cpu"), 2, "_sleep_case")
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("recipe,layout,q_lora", [("bf16", "bshd", 32), ("bf16", "thd", 0), ("mxfp8", "bshd", 32),
                                                ("block-fp8", "bshd", 32)])
def test_tp2_equals_tp1_on_gloo(recipe, layout, q_lora):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    r = _spawn(recipe, layout, q_lora, "cpu")
    assert not r["bad"], r["errs"]
    assert r["sd_same"] and r["reload"]


@pytest.mark.parametrize("recipe,layout,q_lora", [("bf16", "bshd", 32), ("bf16", "thd", 0), ("mxfp8", "bshd", 32)])
def test_tp2_sequence_parallel_equals_tp1_on_gloo(recipe, layout, q_lora):
    """sequence_parallel=True: each rank gives its slice of the sequence (bshd: s; thd: the packed
    tokens, cu_seqlens of the whole) and gets its slice of the output; against tp 1's slices, with the
    same bounds (wo's partial sums reduce-scattered instead of all-reduced: the same fp32 sums)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    r = _spawn(recipe, layout, q_lora, "cpu", sp=True)
    assert not r["bad"], r["errs"]
    assert r["sd_same"] and r["reload"]


@pytest.mark.parametrize("recipe,layout,sp", [("float64", "bshd", False), ("float64", "bshd", True),
                                              ("float64", "thd", True), ("mxfp8", "bshd", True)])
def test_decoder_tp2_equals_tp1_on_gloo(recipe, layout, sp):
    """The whole decoder tensor parallel (MLA and the MLP; sp: the residual stream and the blocks'
    norms on sequence slices) against tp 1: the loss and every gradient within DECODER_BOUNDS (two
    blocks in float64: the sharded math exact but for summation order; one mxfp8 block), the
    unsharded state dict both ways, clear errors for a sequence or an MLP width that the ranks
    cannot split."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    r = _spawn(recipe, layout, None, "cpu", sp=sp, case=_decoder_case)
    assert not r["bad"], r["errs"]
    assert len(r["errs"]) > 20, r["errs"]  # the loss and every parameter's gradient on both ranks
    assert r["sd_same"] and r["reload"]
    for errors in r["errors"]:
        assert len(errors) == (2 if sp else 1), errors
        assert "inter_dim (99) must divide" in errors[-1], errors
        if sp:
            assert "must be a multiple of the tensor-parallel size (2)" in errors[0], errors


@pytest.mark.parametrize("naming", ["hf", "megatron"])
def test_pretrained_weights_load_into_tp2_shards_on_gloo(naming):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    r = _spawn(naming, None, None, "cpu", case=_pretrained_case)
    assert not r["bad"], r["bad"]
    assert r["sd_same"] and r["reload"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("recipe,sp", [("mxfp8", True), ("mxfp8", False), ("float32", True)])
def test_decoder_tp2_equals_tp1_on_one_gpu(recipe, sp):
    """The decoder's tensor-parallel form with both ranks on the one GPU, at the head dims of the CUDA
    kernels: the same checks as on gloo but the state dict round trip."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    r = _spawn(recipe, "bshd", None, "cuda", sp=sp, case=_decoder_case)
    assert not r["bad"], r["errs"]
    assert len(r["errs"]) > 20, r["errs"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two CUDA devices visible (the two-GPU run)")
@pytest.mark.parametrize("recipe,sp", [("mxfp8", True), ("float32", True), ("mxfp8", False)])
def test_decoder_tp2_equals_tp1_on_two_gpus(recipe, sp):
    """The decoder's tensor-parallel form with one GPU a rank and NCCL (its reduce-scatter under
    sequence parallelism): the gloo test's checks, the state dict round trip included."""
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available in this torch")
    r = _spawn(recipe, "bshd", None, "cuda2", sp=sp, case=_decoder_case)
    assert not r["bad"], r["errs"]
    assert len(r["errs"]) > 20, r["errs"]
    assert r["sd_same"] and r["reload"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (the GPU check runs this)")
@pytest.mark.parametrize("recipe,layout,q_lora,sp", [("mxfp8", "bshd", 64, False), ("mxfp8", "thd", 0, False),
                                                   ("bf16", "bshd", 64, False), ("mxfp8", "bshd", 64, True)])
def test_tp2_equals_tp1_on_one_gpu(recipe, layout, q_lora, sp):
    """Both ranks on the one GPU (gloo all-reduces CUDA tensors): tp 2 against tp 1 within the same
    bounds, with the CUDA kernels at DeepSeek-V3's head dims and two local heads per rank (sp: with
    sequence parallelism)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    r = _spawn(recipe, layout, q_lora, "cuda", sp=sp)
    assert not r["bad"], r["errs"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two CUDA devices visible (the two-GPU run)")
@pytest.mark.parametrize("recipe,layout,q_lora,sp", [("mxfp8", "bshd", 64, False), ("mxfp8", "thd", 0, False),
                                                   ("bf16", "bshd", 64, False), ("mxfp8", "bshd", 64, True),
                                                   ("bf16", "thd", 0, True)])
def test_tp2_equals_tp1_on_two_gpus(recipe, layout, q_lora, sp):
    """One GPU a rank, NCCL: tp 2 against tp 1 (each rank's full block on its own GPU) within the same
    bounds, and the unsharded state dict round trip (sp: with sequence parallelism, NCCL's
    reduce-scatter)."""
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available in this torch")
    r = _spawn(recipe, layout, q_lora, "cuda2", sp=sp)
    assert not r["bad"], r["errs"]
    assert r["sd_same"] and r["reload"]


def _cpu_launch_env():
    """(the repository's root, the environment) for a script run on CPU processes under
    torch.distributed.run with gloo: no GPU visible, the tested mxmla package on PYTHONPATH."""
    import pathlib

    import mxmla

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(mxmla.__file__).resolve().parents[1])]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    return pathlib.Path(__file__).resolve().parents[2], env


# two CPU processes under torch.distributed.run
DIST_RUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _launch(cmd, env, timeout=600):
    """subprocess.run(cmd) with its output captured as text"""
    import subprocess

    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _failed(r):
    """the end of a failed run's output, stdout and stderr"""
    return f"exit status {r.returncode}\n-- stdout:\n{r.stdout[-2000:]}\n-- stderr:\n{r.stderr[-3000:]}"


def test_train_script_tp2_on_gloo_matches_tp1(tmp_path):
    """examples/train_mla.py --tp 2 (and --tp 2 --sp) under torch.distributed.run (two CPU processes,
    gloo): the same losses as one process (bf16 rounding of the all-reduced partial sums aside)."""
    import csv

    root, env = _cpu_launch_env()
    common = [str(root / "examples" / "train_mla.py"), "--steps", "3", "--text-file",
              str(root / "tests" / "python" / "data" / "tiny_corpus.txt")]
    runs = {}
    for name, launch, extra in (("tp1", [sys.executable], ["--tp", "1"]), ("tp2", DIST_RUN, ["--tp", "2"]),
                                ("tp2-sp", DIST_RUN, ["--tp", "2", "--sp"])):
        out = tmp_path / name
        r = _launch(launch + common + extra + ["--out", str(out)], env)
        assert r.returncode == 0, _failed(r)
        assert ("sequence parallel" in r.stdout) == (name == "tp2-sp"), r.stdout
        with open(out / "loss_bf16.csv") as f:
            runs[name] = [float(row["loss"]) for row in csv.DictReader(f)]
    assert len(runs["tp1"]) == len(runs["tp2"]) == len(runs["tp2-sp"]) == 3
    for name in ("tp2", "tp2-sp"):
        for a, b in zip(runs["tp1"], runs[name]):
            assert abs(a - b) <= 1e-3 * abs(a), runs


def test_train_script_checkpoints_load_at_any_tp(tmp_path):
    """--save writes the whole model (a tp size of 1's state dict) at any --tp and --load reads it at
    any other: trained at tp 1, loaded and trained on at tp 2 with sequence parallelism, loaded back
    at tp 1; each loaded model's held-out loss is the saving run's final one (bf16 rounding of the
    partial sums aside); a model of other dimensions is refused."""
    import re
    import subprocess

    root, env = _cpu_launch_env()
    common = [str(root / "examples" / "train_mla.py"), "--steps", "2", "--text-file",
              str(root / "tests" / "python" / "data" / "tiny_corpus.txt"), "--save"]
    held = {}
    for name, launch, extra in (("a", [sys.executable], []),
                                ("b", DIST_RUN, ["--tp", "2", "--sp", "--load", str(tmp_path / "a")]),
                                ("c", [sys.executable], ["--load", str(tmp_path / "b")])):
        r = _launch(launch + common + extra + ["--out", str(tmp_path / name)], env)
        assert r.returncode == 0, _failed(r)
        assert (tmp_path / name / "model_bf16.pt").is_file()
        held[name] = float(re.search(r"\] done in .* held-out loss (\S+);", r.stdout).group(1))
        if name != "a":
            loaded = float(re.search(r"loaded .*: held-out loss (\S+)", r.stdout).group(1))
            before = held["a" if name == "b" else "b"]
            assert abs(loaded - before) <= 1e-3 * before, (name, loaded, before, r.stdout)
    r = subprocess.run([sys.executable] + common + ["--hidden", "128", "--load", str(tmp_path / "a"), "--out",
                                                    str(tmp_path / "d")], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode != 0 and "holds a model of another configuration" in r.stderr, r.stderr[-2000:]


def test_train_script_sp_needs_tp():
    root, env = _cpu_launch_env()
    import subprocess

    r = subprocess.run([sys.executable, str(root / "examples" / "train_mla.py"), "--sp"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--sp (sequence parallelism) needs --tp N with N > 1" in r.stderr, r.stderr


@pytest.mark.parametrize("sp", [False, True])
def test_tp_step_bench_runs_on_gloo(sp):
    """bench/mla_tp_step.py --small under torch.distributed.run (two CPU processes, gloo): both recipes'
    rows, the tp step's output against tp 1's within the bounds above, the collectives it recorded
    (--sp: with sequence parallelism, the input's all-gather among them)."""
    import re

    root, env = _cpu_launch_env()
    r = _launch(DIST_RUN + [str(root / "bench" / "mla_tp_step.py"), "--small"] + (["--sp"] if sp else []), env)
    assert r.returncode == 0, _failed(r)
    assert "not a performance figure" in r.stdout
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s*64\s+(bf16|mxfp8)\s.*\s(\S+)$", r.stdout, re.M)}
    assert set(rows) == {"bf16", "mxfp8"}, r.stdout
    assert rows["bf16"] <= 2.0 ** -7 and rows["mxfp8"] <= 2.0 ** -4, r.stdout
    assert r.stdout.count("collectives in a tp step: ") == 2 and "float32" in r.stdout, r.stdout
    assert ("all_gather" in r.stdout) == sp and ("sequence parallelism" in r.stdout) == sp, r.stdout


def test_tp_group_needs_an_initialized_process_group():
    import mxmla.nn as mnn

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        mnn.MLA(**KW, tp_group=object())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
