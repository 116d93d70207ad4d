"""How far two training runs of examples/train_mla.py drift apart when they differ by almost nothing.

The GPU's parity runs (docs/performance.md, "Training") cannot resolve a 0.5 % loss gap because one run
lands 0.7 % (bf16) to 2.3 % (mxfp8) from its own twin: the same seed, weights and batches, differing only
in the GPU's non-deterministic summation orders. This script measures that sensitivity where runs are
deterministic (the CPU with torch's bf16 recipe; on a GPU with --deterministic, any recipe): per seed it
trains the model twice, the twin's initial weights multiplied by (1 + eps · N(0, 1)) (and with
--grad-noise G its gradients by (1 + G · N(0, 1)) at every step), and reports the twin's final losses
against the first run's, in %. Comparing settings (the corpus's size against the tokens trained, i.e.
epochs; the learning rate) says which setup a parity run should use to resolve a small gap with few
seeds.

    python3 dev/bench/twin_spread.py --corpus-bytes 1000000 --steps 1500 --seeds 0 1 2 3
    python3 dev/bench/twin_spread.py --corpus-bytes 0 ...   (the whole corpus)

Prints one line per seed and the standard deviation of the twin gaps (training: mean loss of the last
10 % of steps; held-out: every held-out window, up to --eval-windows). Not a test. The size options
default to train_mla.py's CPU configuration on any device.
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

import train_mla as tm  # noqa: E402


def jitter(tensors, rel, gen):
    """Each tensor multiplied in place by (1 + rel · N(0, 1)), the normals drawn on the CPU from gen."""
    with torch.no_grad():
        for t in tensors:
            t.mul_(1 + rel * torch.randn(t.shape, generator=gen).to(t.device, t.dtype))


class NoisyGrads(tm.Parallel):
    """One process (no groups), every gradient multiplied by (1 + rel · N(0, 1)) after each backward: a
    perturbation at every step, as the GPU's changing summation orders make one, instead of once."""

    def __init__(self, rel, seed):
        super().__init__()
        self.rel, self.gen = rel, torch.Generator().manual_seed(20_000 + seed)

    def mean_grads(self, model) -> None:
        jitter([p.grad for p in model.parameters() if p.grad is not None], self.rel, self.gen)


def run(cfg, train, val, seed, eps, eval_windows, recipe, device, deterministic, mxfp8_dims, cuda_graph=False,
        grad_noise=0.0):
    dims = tm.mla_dims(cfg, [recipe] + (["mxfp8"] if mxfp8_dims else []), device)
    model = tm.build_model(recipe, cfg, seed, device, dims, deterministic=deterministic)
    if eps:
        jitter(list(model.parameters()), eps, torch.Generator().manual_seed(10_000 + seed))
    par = NoisyGrads(grad_noise, seed) if grad_noise else None
    r = tm.train_recipe(recipe, model, train, val, cfg, seed, device, log_every=cfg["steps"] + 1, par=par,
                        cuda_graph=cuda_graph, eval_windows=eval_windows)
    return tm.final_loss(r["losses"]), r["held_out"]


def run_options(description, seeds):
    """The options that twin_spread.py and branch_gap.py share: train_mla.py's sizes (its CPU
    configuration by default, on any device), seeds, device and the run's form."""
    p = argparse.ArgumentParser(description=description)
    for k, v in tm.CPU_CONFIG.items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    p.add_argument("--seeds", type=int, nargs="+", default=seeds)
    p.add_argument("--eval-windows", type=int, default=1024, help="held-out windows evaluated after a run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--deterministic", action="store_true", help="as train_mla.py's (needed for twins on a GPU)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="as train_mla.py's (the step as one CUDA graph, as the GPU's parity runs take it)")
    p.add_argument("--text-file", help="as train_mla.py's")
    p.add_argument("--mxfp8-dims", action="store_true",
                   help="the MLA dims that every recipe of train_mla.py --recipe bf16,mxfp8 shares (for bf16)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def start(p, a):
    """Checks the shared options, sets torch's threads and deterministic mode; returns the size config."""
    if a.cuda_graph and a.device == "cpu":
        p.error("--cuda-graph needs a CUDA --device")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.deterministic:
        tm.torch_deterministic(strict=True)
    return {k: getattr(a, k) for k in tm.SIZE_KEYS}


def main(argv=None):
    p = run_options(__doc__.split("\n\n")[0], [0, 1, 2])
    p.add_argument("--corpus-bytes", type=int, default=0, help="train on the corpus's first N bytes (0: all)")
    p.add_argument("--eps", type=float, default=1e-5, help="the twin's relative weight perturbation")
    p.add_argument("--grad-noise", type=float, default=0.0,
                   help="the twin's gradients multiplied by (1 + G · N(0, 1)) at every step (besides --eps)")
    p.add_argument("--recipe", default="bf16")
    a = p.parse_args(argv)
    if a.cuda_graph and a.grad_noise:
        p.error("--cuda-graph takes no --grad-noise (its noise is drawn eagerly, on the CPU)")
    cfg = start(p, a)
    data, source, _ = tm.load_corpus(a.text_file)
    if a.corpus_bytes:
        data = data[:a.corpus_bytes]
    train, val = tm.split_corpus(data, cfg["seq"])
    epochs = cfg["steps"] * cfg["batch"] * cfg["seq"] / len(train)
    print(f"corpus {len(train):,} training bytes ({epochs:.2f} epochs), {len(val):,} held out; {cfg}; eps {a.eps}; "
          f"grad noise {a.grad_noise}; {a.recipe} on {a.device}{' (deterministic)' if a.deterministic else ''}"
          f"{' (CUDA graph)' if a.cuda_graph else ''}",
          flush=True)
    gaps_t, gaps_h = [], []
    for seed in a.seeds:
        args = (a.eval_windows, a.recipe, a.device, a.deterministic, a.mxfp8_dims, a.cuda_graph)
        t0, h0 = run(cfg, train, val, seed, 0.0, *args)
        t1, h1 = run(cfg, train, val, seed, a.eps, *args, grad_noise=a.grad_noise)
        gaps_t.append(100 * (t1 / t0 - 1))
        gaps_h.append(100 * (h1 / h0 - 1))
        print(f"seed {seed}: training {t0:.4f} / twin {t1:.4f} ({gaps_t[-1]:+.3f} %), held-out {h0:.4f} / "
              f"{h1:.4f} ({gaps_h[-1]:+.3f} %)", flush=True)
    if len(gaps_t) > 1:
        rms = lambda xs: math.sqrt(sum(x * x for x in xs) / len(xs))  # noqa: E731
        print(f"twin gaps over {len(gaps_t)} seeds: training rms {rms(gaps_t):.3f} % (sd {statistics.stdev(gaps_t):.3f}), "
              f"held-out rms {rms(gaps_h):.3f} % (sd {statistics.stdev(gaps_h):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
