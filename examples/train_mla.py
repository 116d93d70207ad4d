#!/usr/bin/env python3
"""Train a small DeepSeek-V3-shaped decoder (MLA blocks + SwiGLU MLP, byte tokens) on real text, once
per recipe, from the same initial weights and in the same data order; write the loss curves.

    python examples/train_mla.py                      # GPU: 4 layers, hidden 512, 2000 steps
    python examples/train_mla.py --steps 300 --out runs/a
    python examples/train_mla.py --text-file notes.txt
    python examples/train_mla.py --recipe mxfp8 --cuda-graph   # the step as one CUDA graph

The corpus is the Python documentation that Debian's package python3-doc installs: its
reStructuredText sources, /usr/share/doc/python3.X/html/_sources/**/*.rst.txt (about 12 MB of
plain text for Python 3.11), read in sorted order; nothing is downloaded. --text-file trains on
any other file instead. The last 1% of the bytes is held out for the final evaluation.

Recipes (--recipe, comma-separated): "bf16" is the baseline (every Linear and the attention in
bf16, fp32 master weights, AdamW); "mxfp8" runs every Linear on mxmla's MXFP8 GEMM and the attention
on MXFP8 Q, K, V (forward and backward); "mxfp8-linears" runs the Linears as "mxfp8" does and the
attention in bf16 as "bf16" does (mxmla.nn.MLA's fp8_attention=False, TransformerEngine's fp8_dpa off);
"block-fp8" is DeepSeek-V3's recipe (the Linears on the block-FP8 GEMM, the attention in bf16).
With "mxfp8" or "mxfp8-linears" in the run every recipe uses MXFP8-friendly
MLA dims (multiples of 32; on a GPU DeepSeek-V3's head dims 192 / 128), so that all start from the
same weights. With two or more recipes the script prints the final loss gap of each against the
first. At these small dims every recipe's eager step is bound by the host (Python, launches);
--cuda-graph captures one whole training step in a CUDA graph and replays it (GraphedStep below).

Outputs in --out (default train_mla_out): loss_<recipe>.csv (step,loss: the training loss of every
step) and loss.png (the curves; needs matplotlib, else the plot is skipped with a note); with --save
also model_<recipe>.pt, each recipe's trained weights as the whole model's state dict (a tp size of
1's, whatever --tp was) with the model's configuration. --load DIR starts each recipe from DIR's
model_<recipe>.pt instead of the seed's weights (any --tp; the same model dimensions), prints its
held-out loss, and trains on from there (weights only: the optimizer and the learning-rate schedule
start afresh).

Parallelism (one process per rank under python -m torch.distributed.run): --tp N splits MLA's heads
and the MLP's width over N ranks (--sp adds sequence parallelism); --cp N splits each sequence over N
ranks (context parallelism: each rank holds two of 2N chunks, the attention passes keys and values
around a ring, or with --cp-comm a2a all-to-alls them over the heads; the ranks' gradients are
averaged before the optimizer step); --tp and --cp combine (N·M processes: tp groups of consecutive
ranks).

Without a CUDA device (or with a CPU-only mxmla build) it runs a tiny configuration on the CPU,
where mxmla's ops run their CPU reference, and says so; options given explicitly still apply.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

CORPUS_PACKAGE = "python3-doc"
CORPUS_ROOT = Path("/usr/share/doc")
CORPUS_DIR_RE = re.compile(r"^python3\.(\d+)$")  # /usr/share/doc/python3.X/html/_sources
CORPUS_PATTERN = "*.rst.txt"

# Defaults on a GPU, and the tiny configuration on the CPU (well under a minute on 2 cores).
GPU_CONFIG = dict(layers=4, hidden=512, heads=8, seq=512, batch=32, steps=2000, lr=2e-3)
CPU_CONFIG = dict(layers=2, hidden=64, heads=2, seq=128, batch=16, steps=200, lr=3e-3)
SIZE_KEYS = tuple(GPU_CONFIG)
GRAPH_WARMUP = 3  # eager steps before --cuda-graph captures one (torch's CUDA graph notes ask for a few)


# ---------------------------------------------------------------------------- corpus
def corpus_dir(root: Path = CORPUS_ROOT) -> Optional[Path]:
    """The newest /usr/share/doc/python3.X/html/_sources that python3-doc installed, or None."""
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = CORPUS_DIR_RE.match(d.name)
            src = d / "html" / "_sources"
            if m and src.is_dir():
                found.append((int(m.group(1)), src))
    return max(found)[1] if found else None


def load_corpus(text_file: Optional[str] = None, root: Path = CORPUS_ROOT) -> Tuple[bytes, str, str]:
    """(the corpus bytes, a line that names where they came from, a short name)."""
    if text_file:
        data = Path(text_file).read_bytes()
        return data, f"{text_file} ({len(data) / 1e6:.2f} MB)", Path(text_file).name
    src = corpus_dir(root)
    files = sorted(src.rglob(CORPUS_PATTERN)) if src else []
    if not files:
        raise SystemExit(f"train_mla.py: the corpus is the Python documentation of Debian's package {CORPUS_PACKAGE} "
                         f"(the text files {root}/python3.X/html/_sources/**/{CORPUS_PATTERN}), which is not installed.\n"
                         f"Install it with:  sudo apt-get install {CORPUS_PACKAGE}\n"
                         f"or train on another text with --text-file FILE.")
    data = b"\n".join(f.read_bytes() for f in files)
    return data, (f"Debian package {CORPUS_PACKAGE}: {len(files)} files {src}/**/{CORPUS_PATTERN} "
                  f"({len(data) / 1e6:.2f} MB)"), f"{CORPUS_PACKAGE} ({src.parent.parent.name} documentation)"


def split_corpus(data: bytes, seq: int) -> Tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes: the last 1%, at least one window of seq + 1)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    held = max(len(arr) // 100, seq + 1)
    if len(arr) - held < seq + 2:
        raise SystemExit(f"train_mla.py: the corpus has {len(arr)} bytes, too few for --seq {seq} "
                         f"(it needs at least {held + seq + 2})")
    return arr[:-held], arr[-held:]


def batch_offsets(n: int, seq: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """[steps, batch] window starts, drawn from `seed`: every recipe sees the same data order."""
    return np.random.default_rng(seed).integers(0, n - seq - 1, size=(steps, batch))


def windows(arr: np.ndarray, starts: Sequence[int], seq: int):
    import torch

    w = np.stack([arr[s:s + seq + 1] for s in starts]).astype(np.int64)
    w = torch.from_numpy(w)
    return w[:, :-1], w[:, 1:]


# ---------------------------------------------------------------------------- the run
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="bf16",
                   help="comma-separated recipes, each trained from the same weights and data order (bf16; mxfp8 "
                        "needs the MXFP8 GEMM and attention backward; mxfp8-linears: the Linears in MXFP8, the "
                        "attention in bf16; block-fp8, DeepSeek-V3's recipe: the Linears on the block-FP8 GEMM). "
                        "Default: bf16")
    p.add_argument("--steps", type=int, help=f"optimizer steps (GPU {GPU_CONFIG['steps']}, CPU {CPU_CONFIG['steps']})")
    p.add_argument("--layers", type=int, help=f"blocks (GPU {GPU_CONFIG['layers']}, CPU {CPU_CONFIG['layers']})")
    p.add_argument("--hidden", type=int, help=f"model width (GPU {GPU_CONFIG['hidden']}, CPU {CPU_CONFIG['hidden']})")
    p.add_argument("--heads", type=int, help=f"attention heads (GPU {GPU_CONFIG['heads']}, CPU {CPU_CONFIG['heads']})")
    p.add_argument("--seq", type=int, help=f"tokens (bytes) per sequence (GPU {GPU_CONFIG['seq']}, CPU {CPU_CONFIG['seq']})")
    p.add_argument("--batch", type=int, help=f"sequences per step (GPU {GPU_CONFIG['batch']}, CPU {CPU_CONFIG['batch']})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (GPU {GPU_CONFIG['lr']}, CPU {CPU_CONFIG['lr']})")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order (default 0)")
    p.add_argument("--deterministic", action="store_true",
                   help="the mxfp8 attention backward in a fixed summation order (~1.1x its time) and torch's "
                        "deterministic algorithms, strict (torch raises at an op without a fixed-order form, as "
                        "Megatron's --deterministic-mode): reproducible runs")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when usable, else cpu)")
    p.add_argument("--out", default="train_mla_out", help="output folder (default train_mla_out)")
    p.add_argument("--text-file", default=None, help=f"train on this file instead of {CORPUS_PACKAGE}'s documentation")
    p.add_argument("--log-every", type=int, default=None, help="steps between progress lines (default steps/15)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (MLA's heads and the MLP's width split over them); launch with "
                        "python -m torch.distributed.run --nproc-per-node N examples/train_mla.py --tp N")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks (each sequence split over them; --seq a multiple of 2N); launch "
                        "with python -m torch.distributed.run --nproc-per-node N examples/train_mla.py --cp N")
    p.add_argument("--cp-comm", choices=("p2p", "a2a"), default="p2p",
                   help="with --cp: keys and values around a ring of the ranks (p2p, default) or all-to-all over the "
                        "heads (a2a: --heads divisible by --cp, per --tp rank)")
    p.add_argument("--save", action="store_true",
                   help="also write each recipe's trained weights to --out/model_<recipe>.pt (the whole model's "
                        "state dict, loadable at any --tp)")
    p.add_argument("--load", default=None, metavar="DIR",
                   help="start each recipe from DIR/model_<recipe>.pt (a --save of the same dimensions, any --tp)")
    p.add_argument("--sp", action="store_true",
                   help="with --tp N: sequence parallelism too (each rank holds 1/N of the sequence between the "
                        "blocks; --seq a multiple of N)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="GPU: capture one whole training step (forward, backward, gradient clipping, AdamW) in a "
                        "CUDA graph after %d eager warm-up steps and replay it for the rest (AdamW capturable, "
                        "the learning rate a device tensor)" % GRAPH_WARMUP)
    args = p.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipe.split(",") if r.strip()]
    if not args.recipes or len(set(args.recipes)) != len(args.recipes):
        p.error(f"--recipe: give one or more distinct recipes, got {args.recipe!r}")
    for k in ("steps", "layers", "hidden", "heads", "seq", "batch", "log_every", "tp", "cp"):
        v = getattr(args, k)
        if v is not None and v < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    if args.sp and args.tp == 1:
        p.error("--sp (sequence parallelism) needs --tp N with N > 1")
    if args.cuda_graph and (args.tp > 1 or args.cp > 1):
        p.error("--cuda-graph: one process only for now (with --tp or --cp the collectives would be captured too; "
                "not checked)")
    if args.seq is not None and args.seq % (2 * args.cp):
        p.error(f"--cp: --seq ({args.seq}) must be a multiple of 2 x --cp ({2 * args.cp}): each rank holds two equal "
                "chunks of every sequence")
    if args.sp and args.seq is not None and (args.seq // args.cp) % args.tp:
        p.error(f"--sp: --seq ({args.seq}) / --cp ({args.cp}) must be a multiple of --tp ({args.tp}): each rank holds "
                "an equal slice")
    return args


def pick_device(requested: Optional[str]) -> Tuple[str, Optional[str]]:
    """(device, why the CPU when it was not asked for)."""
    import torch

    import mxmla

    kernels = mxmla.info()["cuda_enabled"]
    if requested is not None:
        if requested.startswith("cuda"):
            if not torch.cuda.is_available():
                raise SystemExit(f"train_mla.py: --device {requested}: torch sees no CUDA device")
            if not kernels:
                raise SystemExit(f"train_mla.py: --device {requested}: this mxmla build has no CUDA kernels "
                                 f"(install it where nvcc is found: pip install .)")
        return requested, ("--device cpu" if requested == "cpu" else None)
    if torch.cuda.is_available() and kernels:
        return "cuda", None
    return "cpu", ("no CUDA device visible" if not torch.cuda.is_available() else
                   "this mxmla build has no CUDA kernels (built without nvcc)")


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 5% of the steps, then cosine decay to 10% of the peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def mla_dims(cfg: Dict, recipes, device: str, cp: int = 1) -> Dict:
    """The MLA dims every recipe of the run shares (same initial weights). With "mxfp8" (or
    "mxfp8-linears") among the recipes, or with context parallelism (mxmla's attention under every
    recipe), they must suit MXFP8: every Linear's dims multiples of 32, head dims multiples of 32, and
    on a GPU the attention kernel's
    (d_qk, d_v) = (192, 128) (DeepSeek-V3's heads: nope 128, rope 64, v 128). Otherwise the Decoder's
    defaults."""
    if not {"mxfp8", "mxfp8-linears"} & set(recipes) and cp == 1:
        return {}
    h = cfg["hidden"]
    if h % 32:
        raise ValueError(f"recipe mxfp8 and --cp need --hidden to be a multiple of 32, got {h}")
    lora = lambda n: max(32, n // 32 * 32)  # noqa: E731
    head = dict(nope_dim=128, rope_dim=64, v_dim=128) if device.startswith("cuda") else \
        dict(nope_dim=32, rope_dim=32, v_dim=32)
    return dict(head, q_lora_rank=lora(h // 2), kv_lora_rank=lora(h // 4))


def build_model(recipe: str, cfg: Dict, seed: int, device: str, dims: Dict = None, par: "Parallel" = None,
                deterministic: bool = False, sequence_parallel: bool = False):
    from mxmla.nn import Decoder

    par = par or Parallel()
    extra = dict(recipe="mxfp8", fp8_attention=False) if recipe == "mxfp8-linears" else dict(recipe=recipe)
    return Decoder(cfg["hidden"], cfg["layers"], cfg["heads"], max_seq_len=cfg["seq"], **extra, seed=seed,
                   device=device, tp_group=par.tp_group, cp_group=par.cp_group, cp_comm_type=par.cp_comm_type,
                   deterministic=deterministic,
                   sequence_parallel=sequence_parallel, **(dims or {}))


class Parallel:
    """The run's process groups (None where a size is 1): tensor parallel (tp_group) and context parallel
    (cp_group), and what context parallelism adds to a step: each rank's part of the batch's sequences,
    the mean of the ranks' losses and gradients."""

    def __init__(self, tp_group=None, cp_group=None, cp: int = 1, cp_comm_type: str = "p2p"):
        self.tp_group, self.cp_group, self.cp, self.cp_comm_type = tp_group, cp_group, cp, cp_comm_type

    def split(self, t):
        """This rank's two chunks of each sequence of t [b, s] (mxmla.nn.cp_split)."""
        from mxmla.nn import cp_split

        return t if self.cp_group is None else cp_split(t, 1, self.cp_group)

    def mean(self, v):
        """The mean over the context-parallel ranks of a tensor (a loss, a gradient), in place."""
        if self.cp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(v, group=self.cp_group)
            v.div_(self.cp)
        return v

    def mean_grads(self, model) -> None:
        """Every gradient averaged over the context-parallel ranks (each holds its tokens' part): the
        gradient of the whole batch's mean loss."""
        if self.cp_group is not None:
            for p in model.parameters():
                if p.grad is not None:
                    self.mean(p.grad)


def init_parallel(tp: int, cp: int, device: str, cp_comm_type: str = "p2p"):
    """(Parallel, device of this rank, rank) for --tp / --cp: one process per rank, started by
    torch.distributed.run (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR / MASTER_PORT in the environment).
    With both, rank = cp_rank·tp + tp_rank: tp groups of consecutive ranks, cp groups strided by tp."""
    if tp == 1 and cp == 1:
        return Parallel(), device, 0
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * cp:
        flags = " ".join(f"--{k} {n}" for k, n in (("tp", tp), ("cp", cp)) if n > 1)
        raise SystemExit(f"train_mla.py: {flags} needs {tp * cp} processes: launch with python -m "
                         f"torch.distributed.run --nproc-per-node {tp * cp} examples/train_mla.py {flags} ... "
                         f"(WORLD_SIZE is {world})")
    cuda = device.startswith("cuda")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if tp == world:
        return Parallel(tp_group=dist.group.WORLD), device, rank
    if cp == world:
        return Parallel(cp_group=dist.group.WORLD, cp=cp, cp_comm_type=cp_comm_type), device, rank
    # every rank creates every group, in the same order (torch.distributed.new_group's rule)
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    return Parallel(tp_groups[rank // tp], cp_groups[rank % tp], cp, cp_comm_type), device, rank


def checkpoint_path(folder, recipe: str) -> Path:
    return Path(folder) / f"model_{recipe}.pt"


def model_config(model) -> Dict:
    """The model's configuration in plain values (what torch.load(weights_only=True) reads back)."""
    return {k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v) for k, v in model.config.items()}


def save_model(model, path: Path, rank: int) -> None:
    """The whole model's state dict (every rank's shards gathered: all ranks take part) and its
    configuration, written by rank 0."""
    import torch

    sd = model.unsharded_state_dict()
    if rank == 0:
        torch.save(dict(config=model_config(model), state_dict={k: v.cpu() for k, v in sd.items()}), path)


def load_model(model, path: Path) -> None:
    """Loads a save_model file into model (this rank's shards of it), after checking that the
    configuration is the model's."""
    import torch

    if not path.is_file():
        raise SystemExit(f"train_mla.py: --load: {path} does not exist (write it with --save)")
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if ck.get("config") != model_config(model):
        raise SystemExit(f"train_mla.py: --load: {path} holds a model of another configuration: "
                         f"{ck.get('config')} against this run's {model_config(model)}")
    dev = next(model.parameters()).device
    model.load_unsharded_state_dict({k: v.to(dev) for k, v in ck["state_dict"].items()})


def held_out_loss(model, val: np.ndarray, cfg: Dict, device: str, max_windows: int = 64,
                  par: Parallel = None) -> float:
    import torch

    par = par or Parallel()
    seq = cfg["seq"]
    starts = list(range(0, len(val) - seq - 1 + 1, seq))[:max_windows]
    total, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(starts), cfg["batch"]):
            x, y = windows(val, starts[i:i + cfg["batch"]], seq)
            total += float(par.mean(model.loss(par.split(x).to(device), par.split(y).to(device)))) * len(x)
            n += len(x)
    model.train()
    return total / n


def make_optimizer(model, lr: float, graph: bool = False):
    """AdamW (weight decay on the matrices only). graph: capturable, the learning rate a device tensor
    per parameter group (set_lr fills it), so that a CUDA graph of opt.step() reads the current one."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)]
    if graph:
        dev = decay[0].device
        for g in groups:
            g["lr"] = torch.tensor(lr, dtype=torch.float32, device=dev)
        return torch.optim.AdamW(groups, lr=torch.tensor(lr, dtype=torch.float32, device=dev), betas=(0.9, 0.95),
                                 eps=1e-8, capturable=True)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], float):
            group["lr"] = lr
        else:
            group["lr"].fill_(lr)  # (stream-ordered before the next step or graph replay)


def train_step(model, opt, x, y, par: Parallel = None):
    """One optimizer step on a batch: the loss (a device tensor; with context parallelism the mean of
    the ranks', each over its chunks of the sequences)."""
    from mxmla.nn.tp import clip_grad_norm_

    par = par or Parallel()
    loss = model.loss(par.split(x), par.split(y))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    par.mean_grads(model)
    clip_grad_norm_(model, 1.0, par.tp_group)  # the whole model's norm (sharded weights summed over the ranks)
    opt.step()
    return par.mean(loss.detach())


class GraphedStep:
    """train_step captured once in a CUDA graph (torch.cuda.graph, whole-network capture), on static
    input buffers of the batch's shape: __call__ copies the batch in and replays the graph, which
    reruns every kernel of the captured step, mxmla's included (the weights' MXFP8 copies are quantized
    again at each replay: the graph holds the quantization, not a cached copy). The optimizer must be
    make_optimizer(..., graph=True)'s, warmed up by a few eager steps on a side stream first."""

    def __init__(self, model, opt, x, y):
        import torch

        self.x, self.y = x.clone(), y.clone()
        self.graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)  # the gradients are allocated in the graph's memory, at capture
        with torch.cuda.graph(self.graph):
            self.loss = train_step(model, opt, self.x, self.y)

    def __call__(self, x, y):
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.graph.replay()
        return self.loss.detach().clone()


def train_recipe(recipe: str, model, train: np.ndarray, val: np.ndarray, cfg: Dict, seed: int, device: str,
                 log_every: int, par: Parallel = None, cuda_graph: bool = False, opt=None,
                 span: Sequence[int] = None, eval_windows: int = 64) -> Dict:
    """Trains model over the run's steps (cfg["steps"]; the data order and learning-rate schedule drawn
    from seed), or over the steps [first, last) of span only, continuing with opt (a make_optimizer
    optimizer, graph=cuda_graph; None: a fresh one). Returns the span's losses, its wall time and the
    held-out loss after it over eval_windows held-out windows (0: not evaluated, None)."""
    import torch

    torch.manual_seed(seed)
    opt = opt or make_optimizer(model, cfg["lr"], graph=cuda_graph)
    offsets = batch_offsets(len(train), cfg["seq"], cfg["batch"], cfg["steps"], seed)
    first, last = span or (0, cfg["steps"])
    losses: List[float] = []
    pending = []  # this interval's losses, still on the device (one synchronization per progress line)
    t0 = time.perf_counter()
    tokens = cfg["batch"] * cfg["seq"]
    graphed, side = None, None
    if cuda_graph:  # the eager warm-up steps on a side stream, as torch's CUDA graph notes ask
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
    for step in range(first, last):
        x, y = windows(train, offsets[step], cfg["seq"])
        lr = lr_at(step, cfg["steps"], cfg["lr"])
        if cuda_graph and step < first + GRAPH_WARMUP:
            with torch.cuda.stream(side):
                set_lr(opt, lr)
                loss = train_step(model, opt, x.to(device), y.to(device))
            torch.cuda.current_stream().wait_stream(side)
        elif cuda_graph:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if graphed is None:
                graphed = GraphedStep(model, opt, x, y)
            set_lr(opt, lr)
            loss = graphed(x, y)
        else:
            set_lr(opt, lr)
            loss = train_step(model, opt, x.to(device, non_blocking=True), y.to(device, non_blocking=True), par)
        pending.append(loss.detach())
        if (step + 1) % log_every == 0 or step + 1 == last:
            losses += torch.stack(pending).float().tolist()
            pending = []
            bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
            if bad:
                raise SystemExit(f"train_mla.py: [{recipe}] the loss is {losses[bad[0]]} at step {first + bad[0] + 1}")
            dt = time.perf_counter() - t0
            print(f"[{recipe}] step {step + 1:>{len(str(cfg['steps']))}}/{cfg['steps']}  loss {losses[-1]:.4f}  "
                  f"lr {lr:.2e}  {dt:6.1f} s  {tokens * (step + 1 - first) / dt / 1e3:7.1f}k tok/s", flush=True)
    seconds = time.perf_counter() - t0
    held_out = held_out_loss(model, val, cfg, device, max_windows=eval_windows, par=par) if eval_windows else None
    return dict(losses=losses, seconds=seconds, held_out=held_out)


def final_loss(losses: Sequence[float]) -> float:
    """The mean training loss of the last 10% of the steps (one step's loss is noisy)."""
    k = max(1, len(losses) // 10)
    return float(np.mean(losses[-k:]))


def write_csv(path: Path, losses: Sequence[float]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss"])
        for i, v in enumerate(losses, 1):
            w.writerow([i, f"{v:.6f}"])


def plot(path: Path, results: Dict[str, Dict], title: str) -> Optional[str]:
    """Writes the PNG; returns None, or why the plot was skipped."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for recipe, r in results.items():
        y = np.asarray(r["losses"])
        x = np.arange(1, len(y) + 1)
        line, = ax.plot(x, y, alpha=0.25, linewidth=0.8)
        k = max(1, len(y) // 50)  # a moving average over 2% of the steps
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(x[k - 1:], smooth, color=line.get_color(), linewidth=1.6,
                label=f"{recipe} (final {final_loss(y):.3f}, held-out {r['held_out']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def torch_deterministic(strict: bool = False) -> None:
    """torch's own kernels in their fixed-order forms (some have no fixed order by default; mxmla's attention
    backward follows the same switch) and cuBLAS's reproducible workspaces (read when cuBLAS starts). strict:
    torch raises at an op that has no fixed-order form instead of warning (warn_only=False)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=not strict)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("train_mla.py: needs torch (pip install torch)", file=sys.stderr)
        return 2
    if args.deterministic:
        torch_deterministic(strict=True)
    device, why_cpu = pick_device(args.device)
    par, device, rank = init_parallel(args.tp, args.cp, device, args.cp_comm)
    if rank != 0:  # one rank reports and writes the outputs
        sys.stdout = open(os.devnull, "w")
    base = GPU_CONFIG if device.startswith("cuda") else CPU_CONFIG
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in SIZE_KEYS}
    if cfg["seq"] % (2 * args.cp):
        print(f"train_mla.py: --cp: the sequence length ({cfg['seq']}) must be a multiple of 2 x --cp "
              f"({2 * args.cp}); give --seq", file=sys.stderr)
        return 2
    if args.sp and (cfg["seq"] // args.cp) % args.tp:
        print(f"train_mla.py: --sp: the sequence length ({cfg['seq']}) / --cp ({args.cp}) must be a multiple of "
              f"--tp ({args.tp}); give --seq", file=sys.stderr)
        return 2
    if args.cuda_graph and not device.startswith("cuda"):
        print(f"train_mla.py: --cuda-graph needs a CUDA device ({why_cpu or 'the device is ' + device})",
              file=sys.stderr)
        return 2
    if why_cpu:
        print(f"train_mla.py: {why_cpu}: running a tiny configuration on the CPU (mxmla's ops run their CPU "
              f"reference); options given explicitly still apply", flush=True)
    data, source, corpus_name = load_corpus(args.text_file)
    train, val = split_corpus(data, cfg["seq"])
    log_every = args.log_every or max(1, cfg["steps"] // 15)

    # every recipe's model first: a recipe that cannot run stops the script before any training
    models = {}
    for recipe in args.recipes:
        try:
            models[recipe] = build_model(recipe, cfg, args.seed, device, mla_dims(cfg, args.recipes, device, args.cp), par,
                                         args.deterministic, args.sp)
        except (NotImplementedError, ValueError) as e:
            print(f"train_mla.py: --recipe {recipe}: {e}", file=sys.stderr)
            return 2
    n_params = sum(p.numel() for p in next(iter(models.values())).parameters())
    model_cfg = next(iter(models.values())).config
    print(f"corpus: {source}; {len(train):,} bytes for training, {len(val):,} held out", flush=True)
    print(f"model: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads (q_lora_rank "
          f"{model_cfg['q_lora_rank']}, kv_lora_rank {model_cfg['kv_lora_rank']}, nope/rope/v "
          f"{model_cfg['nope_dim']}/{model_cfg['rope_dim']}/{model_cfg['v_dim']}, SwiGLU {model_cfg['inter_dim']}), "
          f"{n_params / 1e6:.2f} M parameters{' on this rank' if args.tp > 1 else ''}; device {device}"
          f"{f'; tensor parallel over {args.tp} ranks' if args.tp > 1 else ''}"
          f"{f'; context parallel over {args.cp} ranks ({args.cp_comm})' if args.cp > 1 else ''}"
          f"{', sequence parallel' if args.sp else ''}", flush=True)
    print(f"training: {cfg['steps']} steps x {cfg['batch']} sequences x {cfg['seq']} bytes, peak lr {cfg['lr']}, "
          f"seed {args.seed}; recipes {', '.join(args.recipes)}"
          f"{'; deterministic (torch.use_deterministic_algorithms on, strict)' if args.deterministic else ''}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Dict] = {}
    for recipe, model in models.items():
        if args.load is not None:
            load_model(model, checkpoint_path(args.load, recipe))
            print(f"[{recipe}] loaded {checkpoint_path(args.load, recipe)}: held-out loss "
                  f"{held_out_loss(model, val, cfg, device, par=par):.4f}", flush=True)
        results[recipe] = r = train_recipe(recipe, model, train, val, cfg, args.seed, device, log_every, par,
                                           args.cuda_graph)
        if args.save:
            save_model(model, checkpoint_path(out, recipe), rank)
            print(f"[{recipe}] saved {checkpoint_path(out, recipe)}", flush=True)
        if rank == 0:
            write_csv(out / f"loss_{recipe}.csv", r["losses"])
        print(f"[{recipe}] done in {r['seconds']:.1f} s: final loss {final_loss(r['losses']):.4f} (mean of the last "
              f"{max(1, len(r['losses']) // 10)} steps), held-out loss {r['held_out']:.4f}; "
              f"wrote {out / f'loss_{recipe}.csv'}", flush=True)
        models[recipe] = None  # free it before the next recipe
    title = (f"MLA decoder: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads; "
             f"{cfg['batch']} x {cfg['seq']} bytes per step; {device}\ncorpus: {corpus_name}")
    skipped = plot(out / "loss.png", results, title) if rank == 0 else None
    print(f"plot: {skipped}" if skipped else f"plot: wrote {out / 'loss.png'}", flush=True)

    first = args.recipes[0]
    if len(results) < 2:
        print(f"final loss gap: only one recipe ran ({first}); give --recipe {first},OTHER to compare", flush=True)
    for recipe in args.recipes[1:]:
        a, b = results[first], results[recipe]
        print(f"final loss gap {recipe} - {first}: {final_loss(b['losses']) - final_loss(a['losses']):+.4f} "
              f"(training), {b['held_out'] - a['held_out']:+.4f} (held-out)", flush=True)
    if args.tp > 1 or args.cp > 1:
        import torch.distributed as dist

        gloo = dist.get_backend() == "gloo"
        dist.barrier()  # no rank tears the group down while another still reads its last message
        dist.destroy_process_group()
        if gloo:
            # leave without the interpreter's teardown (as bench/mla_tp_step.py does): a gloo worker thread
            # can still be releasing the tensors of a collective that has completed, which needs the GIL,
            # and a thread that asks for it while the interpreter finalizes aborts the process (SIGABRT,
            # "terminate called without an active exception"); everything this script writes is closed
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
