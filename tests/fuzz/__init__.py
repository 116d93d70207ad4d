"""Property tests (fuzzers) of mxmla's public ops.

A config is a pure function of (op, seed, profile) (gen.generate); its inputs are rebuilt from the
config alone (gen.materialize); runner.run executes it on a device through the public Python API
and returns every output as bytes; oracle.expected says what each output must be (numpy +
ml_dtypes, from SPEC §2-§6: bits, or for attention's and gemm's float64 sums an interval); check
compares bytes (those two: intervals; on a GPU the kernels' bounds) and checks invariants. driver
is the command line: `python3 -m tests.fuzz --op quantize --seed 123 [--device cuda]`, `--count N --all`.
docs/testing.md describes what is drawn and the counts.
"""
from .gen import OPS, PROFILES, generate, materialize  # noqa: F401
