"""The command-line tool `mxmla` (help, version, options, errors, the CPU fallback, progress), the
packaging facts that can be checked without a GPU (no libcudart.so needed), and the developer
tools that turn profiler output into the figures of docs/performance.md.

The tool is found as $MXMLA_CLI, else in the build tree of the imported mxmla package
(build/python/mxmla -> build/bin/mxmla), else next to the interpreter (pip's scripts directory,
where `pip install .` puts it), else on PATH, else in ./build/bin; the tests skip when none exists.
"""
import csv
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- finding the tool
def _find_cli():
    cands = [os.environ.get("MXMLA_CLI")]
    try:
        import mxmla

        pkg = pathlib.Path(mxmla.__file__).resolve().parent  # <build>/python/mxmla in a build tree
        cands.append(str(pkg.parent.parent / "bin" / "mxmla"))
    except ImportError:
        pass
    cands += [os.path.join(sysconfig.get_path("scripts"), "mxmla"), shutil.which("mxmla"), str(ROOT / "build" / "bin" / "mxmla")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


CLI = _find_cli()
needs_cli = pytest.mark.skipif(CLI is None, reason="the mxmla command-line tool is not built (set MXMLA_CLI)")


def mxmla_cli(*args, env=None, timeout=300):
    e = dict(os.environ)
    e.pop("MXMLA_PROGRESS_INTERVAL", None)
    e.update(env or {})
    return subprocess.run([CLI, *args], capture_output=True, text=True, env=e, timeout=timeout)


def _gpu_visible():
    if CLI is None:
        return False
    return "gpu: none visible" not in mxmla_cli("info").stdout


SMALL_RUN = ["--device", "cpu", "--tokens", "40", "--heads", "2", "--k", "64"]


def _project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(mxmla VERSION ([0-9.]+)", text).group(1)


# ----------------------------------------------------------------------------- help and version
@needs_cli
def test_cli_version():
    r = mxmla_cli("--version")
    assert r.returncode == 0 and r.stdout == f"mxmla {_project_version()}\n"


@needs_cli
@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"]])
def test_cli_help_lists_commands(args):
    r = mxmla_cli(*args)
    assert r.returncode == 0 and r.stderr == ""
    for word in ["usage: mxmla <command>", "info", "run", "run-quantize", "--version", "without a GPU", "--opt=value"]:
        assert word in r.stdout


@needs_cli
def test_cli_without_command_is_usage_error():
    r = mxmla_cli()
    assert r.returncode == 2 and "usage: mxmla" in r.stderr and r.stdout == ""


RUN_OPTIONS = ["--op", "--tokens", "--heads", "--k", "--style", "--format", "--iters", "--check-groups", "--seed", "--device",
               "--threads"]
QUANTIZE_OPTIONS = ["--tokens", "--heads", "--head-dim", "--format", "--swizzle", "--iters", "--check-blocks", "--seed",
                    "--device", "--threads"]


@needs_cli
@pytest.mark.parametrize("cmd,options", [("run", RUN_OPTIONS), ("run-quantize", QUANTIZE_OPTIONS), ("info", [])])
def test_cli_command_help(cmd, options):
    for args in ([cmd, "--help"], [cmd, "-h"], ["help", cmd]):
        r = mxmla_cli(*args)
        assert r.returncode == 0 and r.stderr == "", (args, r.stderr)
        assert r.stdout.startswith(f"usage: mxmla {cmd}")
        for o in options:
            assert re.search(rf"^  {o}\b", r.stdout, re.M), (cmd, o)
    if cmd == "run":  # what it does, its defaults and what happens without a GPU
        for words in ["T 4096, NH 128, K 1536", "Without a GPU", "T 256, NH 16", "cuBLAS", "stderr",
                      "interleaved_in_halves_out", "interleaved", "rotate_half"]:
            assert words in r.stdout, words


# ----------------------------------------------------------------------------- options
def _result_lines(out):
    # what a run prints without its time
    return [re.sub(r"in [0-9.]+ s.*", "", l) for l in out.splitlines()]


@needs_cli
def test_cli_options_take_both_spellings():
    a = mxmla_cli("run", *SMALL_RUN, "--style", "rotate_half", "--format", "e5m2", "--seed", "7", "--threads", "1")
    b = mxmla_cli("run", "--device=cpu", "--tokens=40", "--heads=2", "--k=64", "--style=rotate_half", "--format=e5m2",
                  "--seed=7", "--threads=1")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "T 40, NH 2, K 64" in a.stdout and _result_lines(a.stdout) == _result_lines(b.stdout)


@needs_cli
@pytest.mark.parametrize("style", ["interleaved_in_halves_out", "interleaved", "rotate_half", "halves"])
def test_cli_rope_styles_are_the_python_names(style):
    r = mxmla_cli("run", *SMALL_RUN, "--style", style)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


@needs_cli
def test_cli_threads_do_not_change_the_result():
    one = mxmla_cli("run", "--device", "cpu", "--tokens", "100", "--heads", "3", "--k", "96", "--threads", "1")
    two = mxmla_cli("run", "--device", "cpu", "--tokens", "100", "--heads", "3", "--k", "96", "--threads", "2")
    assert one.returncode == 0 and two.returncode == 0
    err = [re.search(r"relative error .*", r.stdout).group(0) for r in (one, two)]
    assert err[0] == err[1]


BAD = [  # (command line, the option the message must name, words of the rule)
    (["run", "--iters", "0"], "--iters", "integer from 1"),
    (["run", "--iters=-2"], "--iters", "integer from 1"),
    (["run", "--tokens", "0"], "--tokens", "integer from 1"),
    (["run", "--heads=0"], "--heads", "integer from 1"),
    (["run", "--k", "-5"], "--k", "integer from 1"),
    (["run", "--k", "12x"], "--k", "integer"),
    (["run", "--tokens", "99999999999999999999"], "--tokens", "integer from 1"),
    (["run", "--check-groups", "0"], "--check-groups", "integer from 1"),
    (["run", "--threads", "0"], "--threads", "integer from 1 to 1024"),
    (["run", "--seed", "-1"], "--seed", "integer from 0 to 2^63 - 1"),
    (["run", "--style", "spin"], "--style", "rotate_half"),
    (["run", "--format", "e3m4"], "--format", "e4m3 or e5m2"),
    (["run", "--weights", "fp4"], "--weights", "bf16, mxfp8 or block-fp8"),
    (["run", "--device", "cpu", "--weights", "mxfp8", "--k", "48"], "--k", "multiple of 32"),
    (["run", "--device", "tpu"], "--device", "auto, cpu or cuda"),
    (["run", "--tokens"], "--tokens", "needs a value"),
    (["run", "--bogus"], "--bogus", "unknown option"),
    (["run", "--bogus=1"], "--bogus", "unknown option"),
    (["run", "stray"], "stray", "takes only options"),
    (["run", "--op", "softmax"], "--op", "qproj, attention or quantize"),
    (["run", "--op"], "--op", "needs a value"),
    (["run-quantize", "--head-dim", "100"], "--head-dim", "multiple of 32"),
    (["run-quantize", "--head-dim", "0"], "--head-dim", "integer from 1"),
    (["run-quantize", "--iters", "0"], "--iters", "integer from 1"),
    (["run-quantize", "--check-blocks", "0"], "--check-blocks", "integer from 1"),
    (["run-quantize", "--swizzle=yes"], "--swizzle", "takes no value"),
    (["info", "--verbose"], "--verbose", "unknown option"),
    (["run", "--device", "cpu", "--tokens", "2000000000", "--heads", "100000"], "T 2000000000", "host memory"),
]


@needs_cli
@pytest.mark.parametrize("args,option,rule", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_cli_rejects_bad_input(args, option, rule):
    r = mxmla_cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert option in r.stderr and rule in r.stderr, r.stderr
    assert f"see 'mxmla {args[0]} --help'" in r.stderr
    assert "Traceback" not in r.stderr and "terminate" not in r.stderr


@needs_cli
def test_cli_unknown_command():
    r = mxmla_cli("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr


@needs_cli
def test_cli_device_cuda_without_gpu_is_an_error():
    if _gpu_visible():
        pytest.skip("a CUDA device is visible")
    r = mxmla_cli("run", "--device", "cuda")
    assert r.returncode == 2 and "--device" in r.stderr and ("no CUDA device" in r.stderr or "no CUDA kernels" in r.stderr)


# ----------------------------------------------------------------------------- the jobs on the CPU
@needs_cli
def test_cli_run_falls_back_to_the_cpu_reference():
    if _gpu_visible():
        pytest.skip("a CUDA device is visible: `mxmla run` runs on it")
    r = mxmla_cli("run", "--tokens", "64", "--heads", "2", "--k", "64")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("mxmla run: no GPU found")
    assert "running the CPU reference of the fused Q up-projection at T 64, NH 2, K 64" in lines[1]
    assert lines[-1].endswith("OK")


@needs_cli
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cli_run_mxfp8_weights_cpu(fmt):
    r = mxmla_cli("run", "--device", "cpu", "--tokens", "64", "--heads", "2", "--k", "64", "--weights", "mxfp8",
                  "--format", fmt)
    assert r.returncode == 0, r.stderr
    assert "--weights mxfp8: x and W quantized rowwise" in r.stdout and r.stdout.splitlines()[-1].endswith("OK")


@needs_cli
def test_cli_run_block_fp8_weights_cpu():
    r = mxmla_cli("run", "--device", "cpu", "--tokens", "64", "--heads", "2", "--k", "200", "--weights", "block-fp8")
    assert r.returncode == 0, r.stderr
    assert "--weights block-fp8: x (1 x 128 blocks) and W (128 x 128 blocks)" in r.stdout
    assert r.stdout.splitlines()[-1].endswith("OK")


@needs_cli
def test_cli_run_default_cpu_size_says_it_is_smaller():
    r = mxmla_cli("run", "--device", "cpu", "--k", "32")  # defaults T 256, NH 16; K small to stay quick
    assert r.returncode == 0, r.stderr
    assert "at T 256, NH 16, K 32 (smaller than the GPU default T 4096, NH 128)" in r.stdout


@needs_cli
@pytest.mark.parametrize("extra", [[], ["--swizzle"], ["--format", "e5m2"]])
def test_cli_run_quantize_cpu(extra):
    r = mxmla_cli("run-quantize", "--device", "cpu", "--tokens", "70", "--heads", "3", "--head-dim", "64", *extra)
    assert r.returncode == 0, r.stderr
    assert "CPU reference at [70, 3, 64]" in r.stdout and r.stdout.rstrip().endswith("OK")
    if extra == ["--swizzle"]:
        assert "swizzled scales" in r.stdout


ATTN_OPTIONS = ["--op", "--seq", "--heads", "--causal", "--no-causal", "--p-format", "--format", "--iters", "--check-rows",
                "--seed", "--device", "--threads"]


@needs_cli
def test_cli_run_attention_help():
    for args in (["run", "--op", "attention", "--help"], ["run", "-h", "--op=attention"]):
        r = mxmla_cli(*args)
        assert r.returncode == 0 and r.stderr == "", (args, r.stderr)
        assert r.stdout.startswith("usage: mxmla run --op attention")
        for o in ATTN_OPTIONS:
            assert re.search(rf"^  {o}\b", r.stdout, re.M), o
        for words in ["s 4096, h 128", "Without a GPU", "s 256, h 2", "float64", "2*b*h*(s^2/2)*(d_qk + d_v)"]:
            assert words in r.stdout, words
    assert "run --op attention" in mxmla_cli("--help").stdout


@needs_cli
@pytest.mark.parametrize("extra", [[], ["--no-causal"], ["--p-format", "e4m3"], ["--format=e5m2", "--p-format=bf16"]])
def test_cli_run_attention_cpu(extra):
    """`mxmla run --op attention` on the CPU: the library's CPU reference, checked by the tool on every row."""
    r = mxmla_cli("run", "--op", "attention", "--device", "cpu", "--seq", "64", "--heads", "2", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.startswith("mxmla run --op attention: no GPU in use: running the CPU reference of the attention "
                          "forward at s 64, h 2\n"), out
    assert ("not causal" in out) == ("--no-causal" in extra)
    assert ("P E4M3" in out) == ("e4m3" in extra)
    assert re.search(r"^attention forward in [0-9.]+ s on the CPU reference", out, re.M), out
    assert re.search(r"^check: 128 of 128 \(b, h, row\) triples .*: OK$", out, re.M)
    assert re.search(r"^attention backward in [0-9.]+ s on the CPU reference", out, re.M), out
    assert re.search(r"^check: backward, 128 of 128 rows \(dQ\) and keys \(dK, dV\) .*: OK$", out, re.M)
    assert out.rstrip().endswith("OK")


@needs_cli
def test_cli_run_attention_default_cpu_size():
    if _gpu_visible():
        pytest.skip("a CUDA device is visible: `mxmla run --op attention` runs on it")
    r = mxmla_cli("run", "--op", "attention")  # falls back to the CPU at s 256, h 2
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("mxmla run --op attention: no GPU found")
    assert "at s 256, h 2 (smaller than the GPU default s 4096, h 128)" in lines[1]
    assert "check: 512 of 512 " in r.stdout and lines[-1].endswith("OK")


ATTN_BAD = [
    (["--p-format", "fp16"], "--p-format", "bfloat16, bf16 or e4m3"),
    (["--seq", "0"], "--seq", "integer from 1"),
    (["--heads=-1"], "--heads", "integer from 1"),
    (["--check-rows", "0"], "--check-rows", "integer from 1"),
    (["--causal=yes"], "--causal", "takes no value"),
    (["--tokens", "64"], "--tokens", "unknown option"),
    (["--device", "cpu", "--seq", "2000000000", "--heads", "100000"], "s 2000000000", "host memory"),
]


@needs_cli
@pytest.mark.parametrize("args,option,rule", ATTN_BAD, ids=[" ".join(b[0]) for b in ATTN_BAD])
def test_cli_run_attention_rejects_bad_input(args, option, rule):
    r = mxmla_cli("run", "--op", "attention", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert option in r.stderr and rule in r.stderr and "see 'mxmla run --op attention --help'" in r.stderr, r.stderr


@needs_cli
def test_cli_run_op_quantize_is_run_quantize():
    args = ["--device", "cpu", "--tokens", "70", "--heads", "3", "--head-dim", "64", "--threads", "1"]
    a, b = mxmla_cli("run", "--op", "quantize", *args), mxmla_cli("run-quantize", *args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert _result_lines(a.stdout) == _result_lines(b.stdout)


@needs_cli
def test_cli_run_attention_on_the_gpu():
    if not _gpu_visible():
        pytest.skip("no CUDA device visible: the GPU job is not run")
    r = mxmla_cli("run", "--op", "attention", "--seq", "512", "--heads", "4", "--iters", "2", "--check-rows", "100")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.startswith("mxmla run --op attention: GPU ") and "check: 100 of 2048 (b, h, row) triples" in out, out
    assert re.search(r"^check: .*: OK$", out, re.M) and re.search(r"^MXFP8 attention : [0-9.]+ ms +[0-9]+ TFLOP/s", out, re.M)
    assert re.search(r"^check: backward, 100 of 2048 rows .*: OK$", out, re.M), out
    assert re.search(r"^MXFP8 attention backward : [0-9.]+ ms +[0-9]+ TFLOP/s", out, re.M), out


@needs_cli
def test_cli_run_on_the_gpu():
    if not _gpu_visible():
        pytest.skip("no CUDA device visible: the GPU job is not run")
    r = mxmla_cli("run", "--tokens", "300", "--heads", "8", "--iters", "2", "--check-groups", "40")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.startswith("mxmla run: GPU ") and "40 of 80 (32-token group, head) pairs" in out
    assert re.search(r"^check: .*: OK$", out, re.M) and re.search(r"^fused +: [0-9.]+ ms", out, re.M)
    assert re.search(r"^ratio +: fused / cuBLAS GEMM alone = [0-9.]+", out, re.M), out  # cuBLAS was loaded
    r = mxmla_cli("run", "--tokens", "300", "--heads", "8", "--iters", "2", "--check-groups", "40", "--weights", "mxfp8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^check: .*: OK$", r.stdout, re.M) and "(MXFP8 W; x's quantization" in r.stdout, r.stdout
    r = mxmla_cli("run", "--tokens", "300", "--heads", "8", "--iters", "2", "--check-groups", "40", "--weights",
                  "block-fp8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^check: .*: OK$", r.stdout, re.M) and "(block-FP8 W; x's 1 x 128" in r.stdout, r.stdout
    r = mxmla_cli("run-quantize", "--tokens", "100", "--heads", "4", "--iters", "2", "--swizzle")
    assert r.returncode == 0 and "bit-exact" in r.stdout, r.stdout + r.stderr
    r = mxmla_cli("run", "--k", "36", "--tokens", "64", "--heads", "1")  # the kernel needs K % 8 == 0
    assert r.returncode == 2 and "8" in r.stderr, r.stdout + r.stderr


@needs_cli
def test_cli_progress_goes_to_stderr():
    r = mxmla_cli("run", "--device", "cpu", "--tokens", "256", "--heads", "8", "--k", "256", "--threads", "1",
                  env={"MXMLA_PROGRESS_INTERVAL": "0.01"})
    assert r.returncode == 0, r.stderr
    prog = [l for l in r.stderr.splitlines() if l.startswith("mxmla run: CPU reference")]
    assert prog and re.search(r"\d+ % \(\d+ of 256 tokens\)", prog[0]), r.stderr
    assert prog[-1].endswith(" s") and "done in" in prog[-1]
    assert "%" not in r.stdout  # results stay clean on stdout
    quiet = mxmla_cli("run", *SMALL_RUN)  # a short run with the default interval prints no progress
    assert quiet.returncode == 0 and quiet.stderr == ""


# ----------------------------------------------------------------------------- packaging
def _needed(path):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def test_python_module_needs_no_cuda_shared_library():
    """The CUDA runtime is linked statically: the module loads where the loader knows no CUDA path."""
    mxmla = pytest.importorskip("mxmla")
    core = mxmla._mxmla_core.__file__
    needed = _needed(core)
    assert needed, core
    assert not [n for n in needed if n.startswith(("libcudart", "libcublas"))], needed


@needs_cli
def test_cli_needs_no_cuda_shared_library():
    needed = _needed(CLI)
    assert not [n for n in needed if n.startswith(("libcudart", "libcublas"))], needed


def _write_export(path):
    # The shape of `ncu --page source --csv --print-source sass`: a kernel-name line, the header,
    # one row per SASS instruction.
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
           "L1 Wavefronts Shared", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
    rows = [
        ["0x0", "LDS.128 R4, [R2]", "10", "8", "32", "6", "4", "6"],
        ["0x10", "@!P0 STG.E.128 desc[UR4][R6.64], R4", "5", "8", "0", "5", "0", "5"],
        ["0x20", "IMAD.MOV.U32 R1, RZ, RZ, R2", "2", "16", "0", "2", "0", "2"],
        ["0x30", "BAR.SYNC.DEFER_BLOCKING 0x0", "20", "4", "0", "0", "20", "0"],
    ]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "k"])
        w.writerow(hdr)
        w.writerows(rows)


def test_sass_summary_counts(tmp_path):
    export = tmp_path / "sass.csv"
    _write_export(export)
    out = subprocess.run([sys.executable, str(ROOT / "dev" / "scripts" / "sass-summary"), str(export), "--per", "4",
                          "--block", "2"], check=True, capture_output=True, text=True).stdout
    # 36 executions / 4 = 9 per unit, 32 shared wavefronts / 4 = 8, 37 samples
    assert "4 instructions, 37 stall samples, 9.0 warp instructions executed and 8.0 shared wavefronts" in out
    lines = out.splitlines()
    assert any(l.split()[:3] == ["wait", "13", "35.1"] for l in lines)  # 13 of 37 samples
    assert any(l.split()[:3] == ["barrier", "24", "64.9"] for l in lines)
    # opcode table: predicated instructions count under their opcode, suffixes dropped
    assert any(l.split()[:4] == ["STG", "2.0", "22.2", "0.0"] for l in lines)
    assert any(l.split()[:4] == ["LDS", "2.0", "22.2", "8.0"] for l in lines)
    # code map: two blocks of two instructions
    assert any(l.split()[:4] == ["0", "samples", "40.5", "%"] for l in lines)
    assert any(l.split()[:4] == ["2", "samples", "59.5", "%"] for l in lines)


def test_sass_summary_rejects_other_csv(tmp_path):
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    r = subprocess.run([sys.executable, str(ROOT / "dev" / "scripts" / "sass-summary"), str(bad)], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "no header row" in r.stderr


# ----------------------------------------------------------------------------- dev/bench/parity_table.py
def _write_run(folder, seed, results, curves):
    """A train_mla.py log (the lines parity_table.py reads) and its loss curves in the --out folder beside it."""
    folder.mkdir()
    lines = [f"training: 4 steps x 2 sequences x 8 bytes, peak lr 0.002, seed {seed}; recipes bf16, mxfp8"]
    for recipe, (final, held) in results.items():
        lines.append(f"[{recipe}] done in 1.0 s: final loss {final:.4f} (mean of the last 1 steps), held-out loss "
                     f"{held:.4f}; wrote {folder}/loss_{recipe}.csv")
        rows = "".join(f"{i + 1},{v}\n" for i, v in enumerate(curves[recipe]))
        (folder / f"loss_{recipe}.csv").write_text("step,loss\n" + rows)
    log = folder.parent / f"{folder.name}.log"
    log.write_text("\n".join(lines) + "\n")
    return str(log)


def test_parity_table_gaps_and_windows(tmp_path):
    b = [1.0, 1.0, 2.0, 2.0]
    logs = [_write_run(tmp_path / "gap-7", 7, {"bf16": (1.0, 2.0), "mxfp8": (1.01, 1.98)},
                       {"bf16": b, "mxfp8": [1.1, 1.1, 2.0, 2.0]}),
            _write_run(tmp_path / "gap-8", 8, {"bf16": (1.0, 2.0), "mxfp8": (1.03, 2.02)},
                       {"bf16": b, "mxfp8": [1.0, 1.0, 2.2, 2.2]})]
    out = subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "parity_table.py"), "--windows", "2", *logs],
                         check=True, capture_output=True, text=True).stdout
    rows = [l.split() for l in out.splitlines()]
    assert ["0.002", "7", "mxfp8", "1.0100", "1.9800", "1.0000", "2.0000", "+1.00", "-1.00"] in rows
    assert ["0.002", "8", "mxfp8", "1.0300", "2.0200", "1.0000", "2.0000", "+3.00", "+1.00"] in rows
    # training gaps +1, +3: mean 2, sd sqrt(2), se 1; held-out -1, +1: mean 0, sd sqrt(2), se 1
    assert ["0.002", "mxfp8", "2", "+2.00", "1.41", "1.00", "+0.00", "1.41", "1.00", "2.24", "1.00"] in rows
    # windows of 2 steps: seed 7 +10 % then 0, seed 8 0 then +10 %
    assert ["0.002", "mxfp8", "1-2", "2", "+5.00", "7.07", "5.00", "1", "/", "2"] in rows
    assert ["0.002", "mxfp8", "3-4", "2", "+5.00", "7.07", "5.00", "1", "/", "2"] in rows


def test_parity_table_adjusts_for_the_early_gap(tmp_path):
    # early gaps (steps 1-2) 1, 2, 3 %; final gaps 1 + 2 x early (training), 0.5 + 1 x early (held-out)
    b = [1.0, 1.0, 2.0, 2.0]
    logs = [_write_run(tmp_path / f"gap-{e}", e, {"bf16": (1.0, 2.0), "mxfp8": (1 + (1 + 2 * e) / 100,
                                                                               2 * (1 + (0.5 + e) / 100))},
                       {"bf16": b, "mxfp8": [1 + e / 100, 1 + e / 100, 2.0, 2.0]}) for e in (1, 2, 3)]
    out = subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "parity_table.py"), "--adjust", "1-2", *logs],
                         check=True, capture_output=True, text=True).stdout
    rows = [l.split() for l in out.splitlines()]
    assert "final gap = a + b x (gap in steps 1-2), least squares over the runs:" in out
    assert ["0.002", "mxfp8", "3", "training", "+1.00", "0.00", "2.00", "0.00", "1.00", "0.00", "2.00"] in rows
    assert ["0.002", "mxfp8", "3", "held-out", "+0.50", "0.00", "1.00", "0.00", "1.00", "0.00", "1.00"] in rows


def test_parity_table_rejects_a_bad_window(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "parity_table.py"), "--windows", "0", "x.log"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--windows takes a positive number of steps" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "parity_table.py"), "--adjust", "400-201",
                        "x.log"], capture_output=True, text=True)
    assert r.returncode == 2 and "--adjust takes a window of steps FIRST-LAST" in r.stderr


# ----------------------------------------------------------------------------- dev/bench/repro_probe.py
def _probe(*args):
    pytest.importorskip("torch")
    mxmla = pytest.importorskip("mxmla")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(mxmla.__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "repro_probe.py"), "--layers", "1",
                           "--hidden", "64", "--seq", "32", "--batch", "4", "--device", "cpu", *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_repro_probe_finds_nothing_on_the_cpu(recipe):
    r = _probe("--recipe", recipe, "--repeats", "2", "--batches", "1", "--steps-before", "1")
    assert r.returncode == 0, r.stderr
    assert "each after 1 steps" in r.stdout
    assert "loss" in r.stdout and "the same bits in every repeat" in r.stdout
    assert "all parameter gradients: the same bits; weights after the step: the same bits" in r.stdout
    assert "no module's own backward differed between repeats" in r.stdout


def test_repro_probe_torch_strict_on_the_cpu():
    r = _probe("--recipe", "bf16", "--repeats", "2", "--batches", "1", "--torch-strict")
    assert r.returncode == 0, r.stderr
    assert "torch deterministic (strict)" in r.stdout
    assert "all parameter gradients: the same bits; weights after the step: the same bits" in r.stdout


def test_repro_probe_names_a_perturbed_module():
    r = _probe("--recipe", "bf16", "--repeats", "3", "--batches", "1", "--self-check", "layers.0.ffn.w1")
    assert r.returncode == 0, r.stderr
    assert "not reproducible: layers.0.ffn.w1 (Linear): its parameters' gradients (batches [0])" in r.stdout
    assert "first differing gradient: the one reaching layers.0.ffn_norm" in r.stdout
    assert "all parameter gradients: differ in 2 repeats" in r.stdout


def test_repro_probe_compares_across_processes(tmp_path):
    """--save in one process, --against in another: the same step agrees; another seed's weights do not."""
    f = tmp_path / "first.pt"
    r = _probe("--recipe", "bf16", "--repeats", "2", "--batches", "1", "--save", str(f))
    assert r.returncode == 0, r.stderr
    assert f.exists() and f"first repeats written to {f}" in r.stdout
    r = _probe("--recipe", "bf16", "--repeats", "2", "--batches", "1", "--against", str(f))
    assert r.returncode == 0, r.stderr
    assert "compared with the first repeats of" in r.stdout
    assert "all parameter gradients: the same bits; weights after the step: the same bits" in r.stdout
    r = _probe("--recipe", "bf16", "--repeats", "2", "--batches", "1", "--seed", "5", "--against", str(f))
    assert r.returncode == 0, r.stderr
    assert "first differing output (forward)" in r.stdout and "differ in 2 repeats" in r.stdout
    r = _probe("--recipe", "bf16", "--repeats", "2", "--batches", "2", "--against", str(f))
    assert r.returncode != 0 and "holds 1 batches, this run has 2" in r.stderr


def test_repro_probe_rejects_one_repeat():
    r = _probe("--repeats", "1")
    assert r.returncode == 2 and "--repeats must be at least 2" in r.stderr
    r = _probe("--steps-before", "-1")
    assert r.returncode == 2 and "--steps-before at least 0" in r.stderr


# ----------------------------------------------------------------------------- dev/bench/twin_spread.py
def _twin(*args):
    pytest.importorskip("torch")
    mxmla = pytest.importorskip("mxmla")
    corpus = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(mxmla.__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "twin_spread.py"), "--steps", "3", "--seq", "32",
                           "--batch", "4", "--hidden", "32", "--layers", "1", "--eval-windows", "4", "--threads", "1",
                           "--text-file", str(corpus), "--seeds", "0", "1", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_twin_spread_sees_no_gap_without_a_nudge_and_one_with_it():
    """--eps 0: the twin is the same run (the CPU is deterministic), every gap +0.000 %; a 1 % nudge of the
    initial weights moves the losses, and so does noise on the twin's gradients alone."""
    r = _twin("--eps", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("(+0.000 %)") == 4 and "training rms 0.000 %" in r.stdout, r.stdout
    for args in (("--eps", "1e-2"), ("--eps", "0", "--grad-noise", "1e-1")):  # a nudge; noisy gradients only
        r = _twin(*args)
        assert r.returncode == 0, r.stderr
        gaps = [float(g) for g in re.findall(r"\(([+-]\d+\.\d+) %\)", r.stdout)]
        assert len(gaps) == 4 and any(g != 0.0 for g in gaps), (args, r.stdout)


def test_twin_spread_refuses_a_cuda_graph_on_the_cpu():
    r = _twin("--cuda-graph")
    assert r.returncode == 2 and "--cuda-graph needs a CUDA --device" in r.stderr, (r.stdout, r.stderr)
    r = _twin("--cuda-graph", "--device", "cuda", "--grad-noise", "1e-3")
    assert r.returncode == 2 and "--cuda-graph takes no --grad-noise" in r.stderr, (r.stdout, r.stderr)


def test_twin_spread_graphed_and_deterministic_twins_are_the_same_run_on_the_gpu():
    """On the GPU with --deterministic and the step as a CUDA graph (past the eager warm-up steps), an
    un-nudged twin repeats its first run bit for bit, for both recipes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the graphed twins run on the GPU only")
    for recipe in ("bf16", "mxfp8"):
        r = _twin("--eps", "0", "--device", "cuda", "--cuda-graph", "--deterministic", "--recipe", recipe,
                  "--mxfp8-dims", "--steps", "8")
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("(+0.000 %)") == 4 and "(CUDA graph)" in r.stdout, (recipe, r.stdout)


# ----------------------------------------------------------------------------- dev/bench/branch_gap.py
def _branch(*args):
    pytest.importorskip("torch")
    mxmla = pytest.importorskip("mxmla")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(mxmla.__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, str(ROOT / "dev" / "bench" / "branch_gap.py"), "--steps", "6", "--seq", "32",
                           "--batch", "4", "--hidden", "32", "--layers", "1", "--eval-windows", "4", "--threads", "1",
                           "--text-file", str(ROOT / "README.md"), "--branch-at", "3", "--seeds", "0", "1", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_branch_gap_control_without_a_nudge_is_the_reference_and_a_recipe_moves_the_loss(tmp_path):
    """--eps 0: the control continuation is the reference one (the CPU is deterministic), every gap
    +0.000 %; mxfp8 continuing the same trunk lands elsewhere; a nudge of 1 % moves the control;
    --no-control leaves the control out. The curves share the trunk's steps and part after it."""
    r = _branch("--eps", "0", "--mxfp8-dims", "--window", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "bf16~ against bf16 by window of steps, mean % (sd): 4-5 +0.000 (0.000), 6-6 +0.000 (0.000)" in r.stdout
    for seed in (0, 1):
        ref, ctl, mx = ([row.split(",")[1] for row in (tmp_path / f"seed{seed}_{n}.csv").read_text().split()[1:]]
                        for n in ("bf16", "bf16~", "mxfp8"))
        assert len(ref) == 6 and ctl == ref and mx[:3] == ref[:3] and mx[3:] != ref[3:], (ref, mx)
    summary = [ln for ln in r.stdout.splitlines() if " against bf16 " in ln]
    assert len(summary) == 4, r.stdout
    t = _branch("--window", "2", "--tables", str(tmp_path))  # the same tables from the saved curves
    assert t.returncode == 0, t.stderr
    assert [ln for ln in t.stdout.splitlines() if " against bf16 " in ln] == summary, (t.stdout, summary)
    control = re.findall(r"bf16~: \d+\.\d+ \(([+-]\d+\.\d+) %\) / held-out \d+\.\d+ \(([+-]\d+\.\d+) %\)", r.stdout)
    assert control == [("+0.000", "+0.000")] * 2, r.stdout
    mx = re.findall(r"mxfp8: \d+\.\d+ \(([+-]\d+\.\d+) %\)", r.stdout)
    assert len(mx) == 2 and any(float(g) != 0.0 for g in mx), r.stdout
    assert "mxfp8 against bf16 over 2 seeds" in r.stdout and "bf16~ against bf16 over 2 seeds" in r.stdout
    r = _branch("--eps", "1e-2", "--recipes", "block-fp8")
    assert r.returncode == 0, r.stderr
    control = re.findall(r"bf16~: \d+\.\d+ \(([+-]\d+\.\d+) %\)", r.stdout)
    assert len(control) == 2 and any(float(g) != 0.0 for g in control) and "seed 1 block-fp8: " in r.stdout, r.stdout
    r = _branch("--no-control", "--recipes", "mxfp8-linears", "--out", str(tmp_path / "nc"))
    assert r.returncode == 0, r.stderr
    assert "no control" in r.stdout and "bf16~" not in r.stdout and "seed 1 mxfp8-linears: " in r.stdout, r.stdout
    assert sorted(f.name for f in (tmp_path / "nc").iterdir()) == [
        f"seed{s}_{n}.csv" for s in (0, 1) for n in ("bf16", "held_out", "mxfp8-linears")], r.stdout


def test_branch_gap_several_branch_points_share_one_trunk_and_one_reference(tmp_path):
    """--branch-at 2,4: the trunk's second leg continues the first; the control (--eps 0) from either
    point ends on the reference's losses, which continued from the last point (so a bf16 continuation
    does not depend on where it branched); each recipe's curve shares the trunk's steps up to its own
    point and parts after it; the window tables start at each point; --tables gives the same lines."""
    r = _branch("--eps", "0", "--mxfp8-dims", "--window", "2", "--branch-at", "4,2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "branch at steps 2, 4;" in r.stdout, r.stdout
    assert "bf16~@2 against bf16 by window of steps, mean % (sd): 3-4 +0.000 (0.000), 5-6 +0.000 (0.000)" in r.stdout
    assert "bf16~@4 against bf16 by window of steps, mean % (sd): 5-6 +0.000 (0.000)" in r.stdout
    for seed in (0, 1):
        ref, c2, c4, m2, m4 = ([row.split(",")[1] for row in (tmp_path / f"seed{seed}_{n}.csv").read_text().split()[1:]]
                               for n in ("bf16", "bf16~@2", "bf16~@4", "mxfp8@2", "mxfp8@4"))
        assert len(ref) == 6 and c2 == ref and c4 == ref, (ref, c2, c4)
        assert m2[:2] == ref[:2] and m2[2:] != ref[2:] and m4[:4] == ref[:4] and m4[4:] != ref[4:], (ref, m2, m4)
    summary = [ln for ln in r.stdout.splitlines() if " against bf16 " in ln]
    assert len(summary) == 8, r.stdout
    t = _branch("--window", "2", "--tables", str(tmp_path))
    assert t.returncode == 0, t.stderr
    assert sorted(ln for ln in t.stdout.splitlines() if " against bf16 " in ln) == sorted(summary), (t.stdout, summary)


@pytest.mark.parametrize("args,message", [
    (("--recipes", "bf16"), "--recipes: bf16 is not a list of distinct recipes to branch into"),
    (("--recipes", "mxfp8,mxfp8"), "--recipes: mxfp8,mxfp8 is not a list of distinct recipes"),
    (("--branch-at", "6"), "--branch-at must lie strictly between 0 and --steps (6), got 6"),
    (("--branch-at", "0"), "--branch-at must lie strictly between 0 and --steps (6), got 0"),
    (("--branch-at", "2,7"), "--branch-at must lie strictly between 0 and --steps (6), got 7"),
    (("--branch-at", "2,x"), "--branch-at: '2,x' is not a step or a comma-separated list of steps"),
    (("--cuda-graph",), "--cuda-graph needs a CUDA --device"),
    (("--tables", str(ROOT / "docs")), "--tables: no seed*_held_out.csv in"),
])
def test_branch_gap_bad_arguments(args, message):
    r = _branch(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
