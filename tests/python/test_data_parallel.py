"""mxmla.nn under PyTorch's data parallelism on two CPU processes with the gloo backend: FSDP2
(torch.distributed.fsdp.fully_shard: a Block per recipe, its parameters sharded over the ranks) and
DistributedDataParallel (replicated, gradients all-reduced in buckets as autograd produces them,
the deferred weight gradient of the FP8 recipes included), each trained three SGD steps on each
rank's own batch, against the plain Block trained on the mean of the ranks' losses.

Bounds (relative RMS): the first step's output bit for bit and its gradients within 1e-6 (FSDP
reduce-scatters the ranks' fp32 gradients in another order of additions); the later steps' outputs
and gradients within 2^-7, since parameters that differ by an fp32 rounding can then quantize
differently (one E4M3 / bf16 step in an element now and then; measured at most 3e-3 on outputs).
Measured: every step bit for bit under all three recipes and both wrappers (2026-12-04, torch 2.11
on the CPU, three runs each). A stale FP8 copy of a weight would move a later step's output by about
what one optimizer step moves it (measured 3.8-5.9 %): the test checks that this is more than 4
times the bound, so that such a copy fails it. It did: FSDP2 refills its unsharded parameters
without a new version of the tensor and often at the same address, and the FP8 recipes' cache, then
keyed by the version and the address alone, returned the previous step's copies in about half the
runs (mxfp8, step 2: gradients off by up to 18 %); the cache now also ends at every optimizer step
(mxmla.nn.layers: _GENERATION)."""
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.multiprocessing")

from test_tp import _spawn  # noqa: E402  (the two-process harness)

KW = dict(hidden=64, heads=2, q_lora_rank=32, kv_lora_rank=32, nope_dim=32, rope_dim=32, v_dim=32, inter_dim=96,
          max_seq_len=64)
BOUND = 2.0 ** -7
LR = 100.0  # large enough that one step moves the output well past the bound


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / (b.norm() + 1e-30))


def _case(rank, world, device, backend, recipe, wrapper, *_):
    import mxmla.nn as mnn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ref = mnn.Block(**KW, recipe=recipe, seed=3)
    first = mnn.Block(**KW, recipe=recipe, seed=3)  # the initial weights, never trained
    m = mnn.Block(**KW, recipe=recipe, seed=3)
    if wrapper == "fsdp2":
        # a CPU mesh named: fully_shard's default mesh is CUDA's wherever a GPU is visible (it then
        # moves the parameters there), and this test trains on the CPU
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(m.attn, mesh=mesh)
        fully_shard(m.ffn, mesh=mesh)
        fully_shard(m, mesh=mesh)
        whole = lambda g: g.full_tensor()  # noqa: E731
    else:
        m = DistributedDataParallel(m, bucket_cap_mb=1)  # several buckets: reductions during the backward
        whole = lambda g: g  # noqa: E731
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=LR), torch.optim.SGD(m.parameters(), lr=LR)
    errs, bad = {}, {}
    for step in range(3):
        xs = [torch.randn(1, 16, KW["hidden"], generator=torch.Generator().manual_seed(100 * step + r)).to(torch.bfloat16)
              for r in range(world)]
        y = m(xs[rank])
        y.float().square().mean().backward()
        fresh = mnn.Block(**KW, recipe=recipe, seed=4)  # the reference's weights, no cached FP8 copies
        fresh.load_state_dict(ref.state_dict())
        errs[f"step{step} out"] = _rel(y, fresh(xs[rank]))
        ys = [ref(x) for x in xs]
        (sum(t.float().square().mean() for t in ys) / world).backward()
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            errs[f"step{step} grad {name}"] = _rel(whole(p.grad), q.grad)
        if step == 1:  # what a stale FP8 copy of the step-0 weights would give
            errs["stale"] = _rel(first(xs[rank]), ys[rank])
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    for k, e in errs.items():
        if k == "stale":
            continue
        limit = (0.0 if "out" in k else 1e-6) if k.startswith("step0") else BOUND
        if not e <= limit:
            bad[k] = e
    if not errs["stale"] > 4 * BOUND:
        bad["stale"] = errs["stale"]
    return dict(bad=bad, errs=errs, sd_same=True, reload=True)


@pytest.mark.parametrize("wrapper", ["fsdp2", "ddp"])
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "block-fp8"])
def test_data_parallel_block_trains_as_the_plain_one_on_gloo(recipe, wrapper):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch")
    r = _spawn(recipe, wrapper, None, "cpu", case=_case)
    assert not r["bad"], (r["bad"], r["errs"])
    assert len(r["errs"]) > 60, r["errs"]  # every parameter's gradient at every step, on both ranks
