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
  nothing else differs; --no-control leaves it out),
- as each recipe of --recipes (default mxfp8),
and the final training loss (the mean of the run's last 10 % of steps) and the held-out loss of each
continuation are printed against the reference's, in %. Over seeds, a recipe's mean gap against the
control's spread says whether the recipe moves the loss once the early divergence is out of the way.

--branch-at takes several steps too (e.g. 100,200,300: how the gap depends on where the recipes part):
the trunk is then trained once, up to each branch point in turn (each leg continues the previous one's
weights and optimizer state as a continuation does), the control and every recipe continue from each
point (labelled NAME@STEP), and the bf16 reference continues once, from the last point: with
--deterministic a bf16 continuation ends on the same losses from any point, so one reference serves
all (on the GPU, 2026-12-07: the same printed losses branched at step 200 and at step 400).

    PYTHONPATH=<build>/python python3 dev/bench/branch_gap.py --device cuda --deterministic --cuda-graph \\
        --mxfp8-dims --text-file T --layers 4 --hidden 512 --heads 8 --seq 512 --batch 32 --lr 2e-3 \\
        --steps 2000 --branch-at 400 --seeds 0 1   (or --branch-at 100,200,300)

Not a test. The size options default to train_mla.py's CPU configuration on any device.
"""
import copy
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "dev" / "bench"))

import torch  # noqa: E402

import train_mla as tm  # noqa: E402
from parity_table import curve, rel_gap, stats  # noqa: E402
from twin_spread import jitter, run_options, start  # noqa: E402

CONTROL = "bf16~"  # the nudged bf16 continuation's label
BRANCHES = ("mxfp8", "mxfp8-linears", "block-fp8")  # train_mla.py's recipes besides bf16


def resume(trunk, recipe, cfg, seed, a, dims, eps=0.0):
    """(model, optimizer) of recipe holding trunk's model and optimizer state (trunk = (losses, model
    state, optimizer state)), its weights nudged by a relative eps if eps."""
    _, model_state, opt_state = trunk
    model = tm.build_model(recipe, cfg, seed, a.device, dims, deterministic=a.deterministic)
    model.load_state_dict(model_state)
    if eps:
        jitter(list(model.parameters()), eps, torch.Generator().manual_seed(30_000 + seed))
    opt = tm.make_optimizer(model, cfg["lr"], graph=a.cuda_graph)
    opt.load_state_dict(copy.deepcopy(opt_state))
    return model, opt


def train_span(recipe, model, opt, start, end, cfg, train, val, seed, a, eval_windows):
    return tm.train_recipe(recipe, model, train, val, cfg, seed, a.device, log_every=cfg["steps"] + 1,
                           cuda_graph=a.cuda_graph, opt=opt, span=(start, end), eval_windows=eval_windows)


def continue_from(trunk, recipe, cfg, train, val, seed, a, dims, eps=0.0):
    """(final training loss of the whole run, held-out loss, the whole run's loss curve) of recipe
    continuing trunk = (losses, model state, optimizer state), trained for its len(losses) steps, to
    the end."""
    model, opt = resume(trunk, recipe, cfg, seed, a, dims, eps)
    r = train_span(recipe, model, opt, len(trunk[0]), cfg["steps"], cfg, train, val, seed, a, a.eval_windows)
    whole = trunk[0] + r["losses"]
    return tm.final_loss(whole), r["held_out"], whole


def extend_trunk(trunk, to, cfg, train, val, seed, a, dims):
    """The bf16 trunk's next leg: trunk continued to step `to`, as a continuation continues it."""
    model, opt = resume(trunk, "bf16", cfg, seed, a, dims)
    r = train_span("bf16", model, opt, len(trunk[0]), to, cfg, train, val, seed, a, 0)
    return trunk[0] + r["losses"], copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def window_gaps(curves, ref, first, width):
    """[(first step, last step, [per seed: % gap of the window's mean loss])] of curves against ref (lists
    of per-seed loss curves), windows of width steps from step first (0-based) to the end."""
    out = []
    for lo in range(first, len(ref[0]), width):
        hi = min(lo + width, len(ref[0]))
        out.append((lo + 1, hi, [rel_gap(c[lo:hi], r[lo:hi]) for c, r in zip(curves, ref)]))
    return out


def main(argv=None):
    p = run_options(__doc__.split("\n\n")[0], [0, 1])
    p.add_argument("--branch-at", default="400",
                   help="the trunk's steps (bf16), before the recipes part; comma-separated for several branch points")
    p.add_argument("--recipes", default="mxfp8", help="comma-separated recipes continuing the trunk (besides bf16)")
    p.add_argument("--eps", type=float, default=1e-5, help="the control continuation's relative weight nudge")
    p.add_argument("--no-control", action="store_true",
                   help="no control continuation (e.g. where earlier runs of the same seeds measured it)")
    p.add_argument("--window", type=int, default=200, help="steps a window of the gaps' table after the branch")
    p.add_argument("--out", help="a folder for every continuation's loss curve (seed<S>_<name>.csv, the whole run) "
                                 "and held-out loss (seed<S>_held_out.csv)")
    p.add_argument("--tables", nargs="+", metavar="DIR",
                   help="train nothing: the tables over the seeds that runs with --out left in these folders "
                        "(--branch-at and --window as those runs had them)")
    a = p.parse_args(argv)
    try:
        points = sorted({int(x) for x in a.branch_at.split(",") if x.strip()})
    except ValueError:
        points = []
    if not points:
        p.error(f"--branch-at: {a.branch_at!r} is not a step or a comma-separated list of steps")
    if a.tables:
        try:
            return tables(a.tables, points[0], a.window)
        except ValueError as e:
            p.error(str(e))
    recipes = [r for r in a.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in BRANCHES]
    if unknown or len(set(recipes)) != len(recipes):
        p.error(f"--recipes: {', '.join(unknown) or a.recipes} is not a list of distinct recipes to branch into "
                f"(each one of {', '.join(BRANCHES)}; bf16 always continues)")
    for b in points:
        if not 0 < b < a.steps:
            p.error(f"--branch-at must lie strictly between 0 and --steps ({a.steps}), got {b}")
    cfg = start(p, a)
    dims = tm.mla_dims(cfg, ["bf16"] + recipes + (["mxfp8"] if a.mxfp8_dims else []), a.device)
    data, source, _ = tm.load_corpus(a.text_file)
    train, val = tm.split_corpus(data, cfg["seq"])
    print(f"corpus {len(train):,} training bytes, {len(val):,} held out; {cfg}; "
          f"branch at step{'s' if len(points) > 1 else ''} {', '.join(map(str, points))}; "
          f"{'no control' if a.no_control else f'control eps {a.eps}'}; on {a.device}"
          f"{' (deterministic)' if a.deterministic else ''}"
          f"{' (CUDA graph)' if a.cuda_graph else ''}", flush=True)
    label = (lambda n, b: f"{n}@{b}") if len(points) > 1 else (lambda n, b: n)  # noqa: E731
    kinds = ([] if a.no_control else [CONTROL]) + recipes
    legs = [(b, n, label(n, b)) for b in points for n in kinds]  # (branch point, recipe or control, label)
    names = [lab for _, _, lab in legs]
    branch_of = {lab: b for b, _, lab in legs}
    gaps = {n: ([], []) for n in names}
    curves = {n: [] for n in ["bf16"] + names}
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for seed in a.seeds:
        model = tm.build_model("bf16", cfg, seed, a.device, dims, deterministic=a.deterministic)
        opt = tm.make_optimizer(model, cfg["lr"], graph=a.cuda_graph)
        r = train_span("bf16", model, opt, 0, points[0], cfg, train, val, seed, a, 0)
        trunks = {points[0]: (r["losses"], copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))}
        del model, opt
        for prev, b in zip(points, points[1:]):  # the trunk's next legs, bf16 continuing to each branch point
            trunks[b] = extend_trunk(trunks[prev], b, cfg, train, val, seed, a, dims)
        # a line per continuation as it ends (a run cut short keeps what it measured)
        for b, kind, n in [(points[-1], "bf16", "bf16")] + legs:
            t, h, run = continue_from(trunks[b], "bf16" if kind == CONTROL else kind, cfg, train, val, seed, a, dims,
                                      eps=a.eps if kind == CONTROL else 0.0)
            curves[n].append(run)
            if out:
                tm.write_csv(out / f"seed{seed}_{n}.csv", run)
                with (out / f"seed{seed}_held_out.csv").open("w" if n == "bf16" else "a") as f:
                    f.write(("continuation,held_out\n" if n == "bf16" else "") + f"{n},{h:.6f}\n")
            if n == "bf16":
                ref = t, h
                print(f"seed {seed} bf16: {t:.4f} / held-out {h:.4f}", flush=True)
                continue
            gaps[n][0].append(100 * (t / ref[0] - 1))
            gaps[n][1].append(100 * (h / ref[1] - 1))
            print(f"seed {seed} {n}: {t:.4f} ({gaps[n][0][-1]:+.3f} %) / held-out {h:.4f} ({gaps[n][1][-1]:+.3f} %)",
                  flush=True)
    report(names, curves, {n: curves["bf16"] for n in names}, gaps, branch_of, a.window)
    return 0


def report(names, curves, refs, gaps, branch_of, window):
    """The gaps by window of steps after each continuation's branch point (branch_of[n]; curves[n]
    against refs[n], bf16's curves of the same seeds), and (over two seeds or more) the final gaps' mean."""
    for n in names:
        table = window_gaps(curves[n], refs[n], branch_of[n], window)
        cells = [f"{lo}-{hi} {stats(g)[0]:+.3f}" + (f" ({stats(g)[1]:.3f})" if len(g) > 1 else "")
                 for lo, hi, g in table]
        print(f"{n} against bf16 by window of steps, mean % (sd): " + ", ".join(cells))
    rms = lambda xs: math.sqrt(sum(x * x for x in xs) / len(xs))  # noqa: E731
    for n in names:
        if len(gaps[n][0]) > 1:
            (mt, sdt, set_), (mh, sdh, seh) = (stats(g) for g in gaps[n])
            print(f"{n} against bf16 over {len(gaps[n][0])} seeds: training mean {mt:+.3f} % (sd {sdt:.3f}, se "
                  f"{set_:.3f}, rms {rms(gaps[n][0]):.3f}), held-out mean {mh:+.3f} % (sd {sdh:.3f}, se {seh:.3f}, "
                  f"rms {rms(gaps[n][1]):.3f})")


def tables(folders, branch_at, window):
    """report() over the curves and held-out losses that runs with --out left in folders (every seed
    found, e.g. one process's folder per seed); a continuation labelled NAME@STEP branched at STEP, the
    others at branch_at."""
    curves, held, seeds = {}, {}, []
    for d in map(Path, folders):
        for f in sorted(d.glob("seed*_held_out.csv")):
            seed = f.name[len("seed"):-len("_held_out.csv")]
            seeds.append(seed)
            for row in f.read_text().split()[1:]:
                n, h = row.split(",")
                held[seed, n] = float(h)
                curves.setdefault(n, {})[seed] = curve(d / f"seed{seed}_{n}.csv")
    if not seeds:
        raise ValueError(f"--tables: no seed*_held_out.csv in {', '.join(folders)}")
    names = [n for n in curves if n != "bf16"]
    ref = {sd: (tm.final_loss(curves["bf16"][sd]), held[sd, "bf16"]) for sd in seeds}
    gaps = {n: ([100 * (tm.final_loss(curves[n][sd]) / ref[sd][0] - 1) for sd in seeds if sd in curves[n]],
                [100 * (held[sd, n] / ref[sd][1] - 1) for sd in seeds if sd in curves[n]]) for n in names}
    print(f"branch_gap.py --tables: seeds {' '.join(seeds)}")
    branch_of = {n: int(n.rsplit("@", 1)[1]) if "@" in n else branch_at for n in names}
    report(names, {n: [c[sd] for sd in seeds if sd in c] for n, c in curves.items()},
           {n: [curves["bf16"][sd] for sd in seeds if sd in curves[n]] for n in names}, gaps, branch_of, window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
