"""The developer tools that turn profiler output into the figures of docs/performance.md."""
import csv
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
