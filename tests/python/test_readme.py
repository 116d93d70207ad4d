"""The README runs as written.

Each fenced code block in README.md that is preceded by a marker comment is checked:
  <!-- test: cpu -->                Python: run here (numpy, CPU reference; torch on the CPU if installed)
  <!-- test: cuda -->               Python: run only where a CUDA device is visible (skips otherwise)
  <!-- test: shell -->              shell: every line that starts with `mxmla` runs and exits 0
  <!-- test: excerpt PATH -->       any language: its lines appear, in order, in the file PATH
  <!-- test: output-cpu -->         `$ mxmla ...` and its output without a GPU: the same lines, numbers aside
  <!-- test: none -->              not run (e.g. commands that install or build); it must say why nearby
Every Python block carries a marker, so no example goes untested; the relative links of the README
point to files of the repository, and no text refers to files outside it.
"""
import os
import pathlib
import re
import shlex
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

_BLOCK = re.compile(r"(?:<!--\s*test:\s*(?P<marker>[^>]*?)\s*-->\s*\n)?```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```",
                    re.S | re.M)


def blocks():
    text = README.read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("body"))
        out.append((m.group("marker"), m.group("lang"), m.group("body"), line))
    return out


def _ids(bs):
    return [f"README.md:{b[3]}" for b in bs]


PY = [b for b in blocks() if b[1] == "python"]
CPU = [b for b in PY if b[0] == "cpu"]
CUDA = [b for b in PY if b[0] == "cuda"]
SHELL = [b for b in blocks() if b[0] == "shell"]
EXCERPTS = [b for b in blocks() if b[0] and b[0].startswith("excerpt ")]
OUTPUTS = [b for b in blocks() if b[0] == "output-cpu"]


def _cuda_visible():
    try:
        import torch
        import mxmla
    except ImportError:
        return False
    return torch.cuda.is_available() and mxmla.info()["cuda_enabled"]


def _run_python(body, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(body, "README.md", "exec")
    exec(code, {"__name__": "__readme__"})  # a fresh namespace: each block defines every name it uses


def test_readme_has_tested_examples():
    assert CPU and CUDA and SHELL and EXCERPTS and OUTPUTS
    unmarked = [b[3] for b in PY if b[0] not in ("cpu", "cuda")]
    assert not unmarked, f"Python blocks without a <!-- test: cpu|cuda --> marker at README.md lines {unmarked}"


@pytest.mark.parametrize("block", CPU, ids=_ids(CPU))
def test_readme_cpu_example(block, tmp_path, monkeypatch):
    if re.search(r"^import torch|^import mxmla\.nn", block[2], re.M):
        pytest.importorskip("torch")  # the torch examples on the CPU run where torch is installed
    _run_python(block[2], tmp_path, monkeypatch)


@pytest.mark.parametrize("block", CUDA, ids=_ids(CUDA))
def test_readme_cuda_example(block, tmp_path, monkeypatch):
    if not _cuda_visible():
        pytest.skip("no CUDA device visible (or a CPU-only build, or torch without CUDA): README CUDA example not run")
    _run_python(block[2], tmp_path, monkeypatch)


def _cli():
    from test_tools import CLI  # the same search: $MXMLA_CLI, pip's scripts directory, PATH, the build tree

    if CLI is None:
        pytest.skip("the mxmla command-line tool is not built (set MXMLA_CLI)")
    return CLI


@pytest.mark.parametrize("block", SHELL, ids=_ids(SHELL))
def test_readme_shell_commands(block):
    cli = _cli()
    cmds = [l.split("#")[0].strip() for l in block[2].splitlines()]
    cmds = [c for c in cmds if c.startswith("mxmla")]
    assert cmds
    for c in cmds:
        args = shlex.split(c)[1:]
        r = subprocess.run([cli, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, f"{c}: exit {r.returncode}\n{r.stderr}"


def _shape(text):
    # a line's words without its numbers (times and rates vary) or the CPU-only build's note
    return [re.sub(r"[0-9][0-9.]*", "#", l.replace(" (a CPU-only build)", "")) for l in text.strip().splitlines()]


@pytest.mark.parametrize("block", OUTPUTS, ids=_ids(OUTPUTS))
def test_readme_cpu_output_is_what_the_tool_prints(block):
    from test_tools import _gpu_visible

    cli = _cli()
    if _gpu_visible():
        pytest.skip("a CUDA device is visible: the tool would run on it")
    cmd, *expected = block[2].strip().splitlines()
    assert cmd.startswith("$ mxmla ")
    r = subprocess.run([cli, *shlex.split(cmd[len("$ mxmla "):])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert _shape(r.stdout) == _shape("\n".join(expected))


@pytest.mark.parametrize("block", EXCERPTS, ids=_ids(EXCERPTS))
def test_readme_excerpts_match_the_files(block):
    path = ROOT / block[0].split(None, 1)[1]
    assert path.is_file(), path
    have = [l.strip() for l in path.read_text().splitlines()]
    i = 0
    for line in (l.strip() for l in block[2].splitlines()):
        if not line or line in ("// ...", "# ...", "..."):
            continue
        while i < len(have) and have[i] != line:
            i += 1
        assert i < len(have), f"README.md:{block[3]}: line not found (in order) in {path.name}: {line!r}"
        i += 1


def test_readme_first_lines_are_the_two_commands():
    first = blocks()[0]
    assert first[1] == "bash"
    cmds = [l.split("#")[0].strip() for l in first[2].splitlines() if l.strip()]
    assert cmds == ["./scripts/run", "./scripts/test"]
    for c in cmds:
        assert os.access(ROOT / c, os.X_OK), c


def test_readme_links_point_into_the_repository():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    targets += re.findall(r"`((?:docs|scripts|tests|tools|include|src|python|bench|dev|cmake)/[\w./-]+)`", text)
    missing = sorted({t for t in targets if not t.startswith(("http://", "https://")) and not (ROOT / t).exists()})
    assert not missing, f"README refers to paths that do not exist: {missing}"
    assert "../" not in re.sub(r"```.*?```", "", text, flags=re.S), "README refers to a file outside the repository"
