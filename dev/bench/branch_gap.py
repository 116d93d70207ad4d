"""The recipes' loss gap measured from a shared trunk: bf16 trains examples/train_mla.py's model for the
first --branch-at steps, then each recipe continues from those weights and that optimizer state.

The parity runs (docs/performance.md, "Training") start both recipes from the same initial weights, and a
seed's final gap is mostly set before step 400, where the loss leaves its early plateau and runs of one
recipe part as far as the two recipes' runs do (one run lands 0.7 % (bf16) to 2.3 % (mxfp8) from its own
twin). Branching after that point asks what the recipe changes in the rest of the run: per seed the
trunk (bf16, the run's own data order and learning-rate schedule) is trained once, then continued
- as bf16 (the reference continuation),
- as bf16 again with its weights multiplied by (1 + --eps · N(0, 1)) at the branch (the control: how far
  a continuation lands from the reference when nothing but a tiny nudge differs; with --deterministic
  nothing else differs),
- as each recipe of --recipes (default mxfp8),
and the final training loss (the mean of the run's last 10 % of steps) and the held-out loss of each
continuation are printed against the reference's, in %. Over seeds, a recipe's mean gap against the
control's spread says whether the recipe moves the loss once the early divergence is out of the way.

    PYTHONPATH=<build>/python python3 dev/bench/branch_gap.py --device cuda --deterministic --cuda-graph \\
        --mxfp8-dims --text-file T --layers 4 --hidden 512 --heads 8 --seq 512 --batch 32 --lr 2e-3 \\
        --steps 2000 --branch-at 400 --seeds 0 1

Not a test. The size options default to train_mla.py's CPU configuration on any device.
"""
import copy
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "dev" / "bench"))

import torch  # noqa: E402

import train_mla as tm  # noqa: E402
from twin_spread import jitter, run_options, start  # noqa: E402

CONTROL = "bf16~"  # the nudged bf16 continuation's label
BRANCHES = ("mxfp8", "mxfp8-linears", "block-fp8")  # train_mla.py's recipes besides bf16


def continue_from(trunk, recipe, cfg, train, val, seed, a, dims, eps=0.0):
    """(final training loss of the whole run, held-out loss) of recipe continuing trunk = (losses,
    model state, optimizer state) from step --branch-at to the end."""
    losses, model_state, opt_state = trunk
    model = tm.build_model(recipe, cfg, seed, a.device, dims, deterministic=a.deterministic)
    model.load_state_dict(model_state)
    if eps:
        jitter(list(model.parameters()), eps, torch.Generator().manual_seed(30_000 + seed))
    opt = tm.make_optimizer(model, cfg["lr"], graph=a.cuda_graph)
    opt.load_state_dict(copy.deepcopy(opt_state))
    r = tm.train_recipe(recipe, model, train, val, cfg, seed, a.device, log_every=cfg["steps"] + 1,
                        cuda_graph=a.cuda_graph, opt=opt, span=(a.branch_at, cfg["steps"]))
    return tm.final_loss(losses + r["losses"]), tm.held_out_loss(model, val, cfg, a.device, max_windows=a.eval_windows)


def main(argv=None):
    p = run_options(__doc__.split("\n\n")[0], [0, 1])
    p.add_argument("--branch-at", type=int, default=400, help="the trunk's steps (bf16), before the recipes part")
    p.add_argument("--recipes", default="mxfp8", help="comma-separated recipes continuing the trunk (besides bf16)")
    p.add_argument("--eps", type=float, default=1e-5, help="the control continuation's relative weight nudge")
    a = p.parse_args(argv)
    recipes = [r for r in a.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in BRANCHES]
    if unknown or len(set(recipes)) != len(recipes):
        p.error(f"--recipes: {', '.join(unknown) or a.recipes} is not a list of distinct recipes to branch into "
                f"(each one of {', '.join(BRANCHES)}; bf16 always continues)")
    if not 0 < a.branch_at < a.steps:
        p.error(f"--branch-at must lie strictly between 0 and --steps ({a.steps}), got {a.branch_at}")
    cfg = start(p, a)
    dims = tm.mla_dims(cfg, ["bf16"] + recipes + (["mxfp8"] if a.mxfp8_dims else []), a.device)
    data, source, _ = tm.load_corpus(a.text_file)
    train, val = tm.split_corpus(data, cfg["seq"])
    print(f"corpus {len(train):,} training bytes, {len(val):,} held out; {cfg}; branch at step {a.branch_at}; "
          f"control eps {a.eps}; on {a.device}{' (deterministic)' if a.deterministic else ''}"
          f"{' (CUDA graph)' if a.cuda_graph else ''}", flush=True)
    names = [CONTROL] + recipes
    gaps = {n: ([], []) for n in names}
    for seed in a.seeds:
        model = tm.build_model("bf16", cfg, seed, a.device, dims, deterministic=a.deterministic)
        opt = tm.make_optimizer(model, cfg["lr"], graph=a.cuda_graph)
        r = tm.train_recipe("bf16", model, train, val, cfg, seed, a.device, log_every=cfg["steps"] + 1,
                            cuda_graph=a.cuda_graph, opt=opt, span=(0, a.branch_at))
        trunk = (r["losses"], copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        del model, opt
        ref = continue_from(trunk, "bf16", cfg, train, val, seed, a, dims)
        print(f"seed {seed} bf16: {ref[0]:.4f} / held-out {ref[1]:.4f}", flush=True)
        for n in names:  # a line per continuation as it ends (a run cut short keeps what it measured)
            t, h = continue_from(trunk, "bf16" if n == CONTROL else n, cfg, train, val, seed, a, dims,
                                 eps=a.eps if n == CONTROL else 0.0)
            gaps[n][0].append(100 * (t / ref[0] - 1))
            gaps[n][1].append(100 * (h / ref[1] - 1))
            print(f"seed {seed} {n}: {t:.4f} ({gaps[n][0][-1]:+.3f} %) / held-out {h:.4f} ({gaps[n][1][-1]:+.3f} %)",
                  flush=True)
    if len(a.seeds) > 1:
        for n in names:
            gt, gh = gaps[n]
            rms = lambda xs: math.sqrt(sum(x * x for x in xs) / len(xs))  # noqa: E731
            print(f"{n} against bf16 over {len(gt)} seeds: training mean {statistics.mean(gt):+.3f} % (sd "
                  f"{statistics.stdev(gt):.3f}, rms {rms(gt):.3f}), held-out mean {statistics.mean(gh):+.3f} % "
                  f"(sd {statistics.stdev(gh):.3f}, rms {rms(gh):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
