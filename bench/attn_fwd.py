"""bench.py's attention-forward section: mxmla.attention on MXFP8 Q, K, V against what users run today,
timed in the same run (bench/timing.py: CUDA events, L2 flushed before each call, medians).

Shape: DeepSeek-V3 MLA, b 1, h 128, d_qk 192, d_v 128, causal, s in {2048, 4096, 8192}; bf16 N(0, 1)
q, k, v [b, s, h, d] (bshd), quantized by mxmla.quantize_attention(layout="bshd"): Q and K rowwise,
V columnwise (blocks of 32 keys), E4M3, BHSD scales.
  ours         mxmla.attention(q_mx, k_mx, v_mx, causal=True) (its default path: K, V converted to
               bf16 by a pass, then the kernel on the copies, expanding Q's codes itself)
  ours-fused   the same call with MXMLA_ATTN_FWD=fused (dequantization inside the kernel, per tile)
  ours-bf16    the same op on the bf16 q, k, v
  cuDNN        torch SDPA, cuDNN backend (bf16), on the dequantized q, k, v as bhsd views of bshd
  FA4          FlashAttention-4's SM90 path (flash_attn.cute.flash_attn_func), bf16 bshd, the same
               dequantized inputs (when installed: ../shared/peers/fetch-fa4)
  dequant+best the users' pipeline today: mxmla.dequantize of q, k, v to bf16, then the faster of
               cuDNN / FA4
TFLOP/s = 2*b*h*(s^2/2)*(d_qk + d_v) / time (the causal triangle). --check compares the outputs of
ours (and ours-bf16, FA4) with cuDNN's at s 2048 before anything is timed.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

import mxmla

B, H, D_QK, D_V = 1, 128, 192, 128
SEQS = (2048, 4096, 8192)
CHECK_SEQ = 2048
FLOP_FORMULA = "2*b*h*(s^2/2)*(d_qk + d_v)"
# ours vs cuDNN, both with bf16 P on the same (dequantized) inputs: each within 2^-9 max|v| (P's
# rounding) + 2^-9 |O| (O's) of the exact result, so within 2^-8 (max|v| + |O|) of each other.
CHECK_RULE = "|ours - cuDNN| <= 2^-8 (max|v| of the head + |cuDNN|) everywhere"


def flop(s: int) -> float:
    """FLOPs of the causal forward: 2*b*h*(s^2/2)*(d_qk + d_v)."""
    return 2.0 * B * H * (s * s / 2) * (D_QK + D_V)


def _error(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def _out(r):
    """The output tensor of an attention call that may also return the LSE."""
    return r[0] if isinstance(r, (tuple, list)) else r


def load_fa4():
    """(flash_attn_func, None) or (None, why it is unavailable)."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None, "flash_attn.cute not installed"
    except Exception as e:  # installed but broken (e.g. a CUTLASS DSL library missing): not measured either
        return None, f"flash_attn.cute failed to import ({_error(e)})"
    return flash_attn_func, None


def _with_env(name: str, value: str, fn):
    """fn() with the environment variable set (the library reads it at every call), then restored."""
    import os

    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def cudnn_sdpa(q, k, v):
    """torch SDPA on the cuDNN backend only; q, k, v bshd, passed as bhsd views; output bhsd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                is_causal=True)


def compare(got, ref_bshd, v) -> Dict[str, float]:
    """Max / mean |got - ref| (both [b, s, h, d_v]) and the elements beyond CHECK_RULE's bound."""
    got, ref = got.float(), ref_bshd.float()
    diff = (got - ref).abs()
    vmax = v.float().abs().amax(dim=(1, 3), keepdim=True)  # [b, 1, h, 1]: max |v| of each head
    bound = (vmax + ref.abs()) * 2.0 ** -8
    far = int((~(diff <= bound)).sum().item())  # NaN counts as beyond
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "beyond": far, "n": diff.numel()}


class Section:
    """The attention-forward section. `timer(fn)` returns median ms; `log` prints a line."""

    def __init__(self, timer: Callable, dev, add: Callable, log: Callable = print, seqs=SEQS, check: bool = False,
                 iters: int = 0):
        self.timer, self.dev, self.add, self.log = timer, dev, add, log
        self.seqs, self.check, self.iters = tuple(seqs), check, iters
        self.attn = getattr(mxmla, "attention", None)
        missing = None if self.attn is not None else "mxmla.attention is missing from this build"
        # the first error of each
        self.ours_errors: Dict[str, Optional[str]] = {"ours": missing, "ours-fused": missing, "ours-bf16": missing}
        self.fa4, self.fa4_error = load_fa4()
        self.rows: List[dict] = []
        self.checks: List[str] = []
        self.check_failed = False
        self.ours_raised = False
        self.context_lost = False

    # ------------------------------------------------------------------ helpers
    def _alive(self) -> bool:
        if self.dev.type != "cuda":
            return True
        try:
            torch.cuda.synchronize()
            return True
        except Exception:
            return False

    def _run(self, what: str, fn):
        """fn() or None; an error is printed and, if it took the CUDA context with it, ends the section."""
        if self.context_lost:
            return None
        try:
            return fn()
        except Exception as e:
            self.log(f"attn_fwd {what}: error: {_error(e)}")
            if not self._alive():
                self.context_lost = True
                self.log("attn_fwd: the CUDA context is lost after that error: nothing more is measured in this run")
            return None

    def _ours(self, name: str, what: str, fn):
        """Like _run for mxmla.attention on its MXFP8 ("ours") or bf16 ("ours-bf16") inputs: after the
        first error of one, that one is not called again."""
        if self.ours_errors[name] is not None:
            return None
        err: List[str] = []

        def call():
            try:
                return fn()
            except Exception as e:
                err.append(_error(e))
                raise

        r = self._run(what, call)
        if err:
            self.ours_errors[name], self.ours_raised = err[0], True
        return r

    # ------------------------------------------------------------------ the section
    def run(self) -> "Section":
        self.log(f"attn_fwd: DeepSeek-V3 MLA forward, b {B}, h {H}, d_qk {D_QK}, d_v {D_V}, causal, s {list(self.seqs)}; "
                 f"TFLOP/s = {FLOP_FORMULA} / time")
        if self.attn is None:
            self.log(f"attn_fwd ours: {self.ours_errors['ours']}: only the peers are measured")
        if self.fa4 is None:
            self.log(f"attn_fwd FA4: skipped: {self.fa4_error}")
        check_at = CHECK_SEQ if CHECK_SEQ in self.seqs else min(self.seqs)
        for s in self.seqs:
            if self.context_lost:
                break
            self._one(s, self.check and s == check_at)
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
        return self

    def _inputs(self, s: int):
        g = torch.Generator(device=self.dev).manual_seed(1000 + s)
        q, k = (torch.randn(B, s, H, D_QK, device=self.dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        v = torch.randn(B, s, H, D_V, device=self.dev, dtype=torch.bfloat16, generator=g)
        q_mx = mxmla.quantize_attention(q, layout="bshd", columnwise=False)
        k_mx = mxmla.quantize_attention(k, layout="bshd", columnwise=False)
        v_mx = mxmla.quantize_attention(v, layout="bshd", rowwise=False)
        return q, k, v, q_mx, k_mx, v_mx

    def _one(self, s: int, check: bool) -> None:
        row: Dict = {"s": s, "flop": flop(s), "ms": {}}
        q, k, v, q_mx, k_mx, v_mx = self._run(f"s {s} inputs", lambda: self._inputs(s)) or (None,) * 6
        if q is None:
            return

        def dequant():
            return (mxmla.dequantize(q_mx, torch.bfloat16), mxmla.dequantize(k_mx, torch.bfloat16),
                    mxmla.dequantize(v_mx, torch.bfloat16, columnwise=True))

        qd, kd, vd = dequant()
        attn, fa4 = self.attn, self.fa4
        ours = lambda: attn(q_mx, k_mx, v_mx, causal=True)  # noqa: E731
        ours_bf16 = lambda: attn(q, k, v, causal=True, layout="bshd")  # noqa: E731  (bf16 4-D: sbhd unless told)
        ours_fused = lambda: _with_env("MXMLA_ATTN_FWD", "fused", ours)  # noqa: E731
        peers = {"cuDNN": lambda qd, kd, vd: cudnn_sdpa(qd, kd, vd)}
        if fa4 is not None:
            peers["FA4"] = lambda qd, kd, vd: _out(fa4(qd, kd, vd, causal=True))

        # the peers first: an error of ours that takes the CUDA context with it leaves their figures
        for name, fn in peers.items():
            t = self._run(f"s {s} {name}", lambda fn=fn: self.timer(lambda: fn(qd, kd, vd)))
            if t is not None:
                row["ms"][name] = t
        timed = {n: row["ms"][n] for n in peers if n in row["ms"]}
        if timed:
            best = min(timed, key=timed.get)
            fn = peers[best]
            t = self._run(f"s {s} dequant+{best}", lambda: self.timer(lambda: fn(*dequant())))
            if t is not None:
                row["ms"]["dequant+best"], row["best"] = t, best
        if check:  # before ours is timed; a failed check flags its figures and the exit status
            self._check(s, ours, ours_fused, ours_bf16, peers, (qd, kd, vd), (q, k, v))
        for name, fn in (("ours", ours), ("ours-fused", ours_fused), ("ours-bf16", ours_bf16)):
            t = self._ours(name, f"s {s} {name}", lambda fn=fn: self.timer(fn))
            if t is not None:
                row["ms"][name] = t
        self.rows.append(row)
        for name, t in row["ms"].items():
            note = f"{row['flop'] / t / 1e9:.0f} TFLOP/s"
            if name == "dequant+best":
                note += f" (dequantize q, k, v + {row['best']})"
            self.add(f"attn_fwd s {s}", name, t, 0.0, note)

    def _check(self, s, ours, ours_fused, ours_bf16, peers, deq, bf16) -> None:
        """Each output against cuDNN's on the same inputs: the dequantized ones (ours, FA4) or the
        bf16 ones (ours-bf16)."""
        refs = {}
        for inputs, tensors in (("dequantized", deq), ("bf16", bf16)):
            refs[inputs] = self._run(f"s {s} check: cuDNN ({inputs} inputs)",
                                     lambda t=tensors: cudnn_sdpa(*t).transpose(1, 2))
        cases = [("ours", ours, "dequantized"), ("ours-fused", ours_fused, "dequantized"), ("ours-bf16", ours_bf16, "bf16")]
        if "FA4" in peers:
            cases.append(("FA4", lambda: peers["FA4"](*deq), "dequantized"))
        for name, fn, inputs in cases:
            ref, v = refs[inputs], (deq if inputs == "dequantized" else bf16)[2]
            if ref is None:
                self.checks.append(f"check at s {s}: {name}: cuDNN failed on the {inputs} inputs: nothing to compare with")
                continue
            is_ours = name in self.ours_errors
            what = f"s {s} check: {name}"
            o = self._ours(name, what, lambda fn=fn: _out(fn())) if is_ours else self._run(what, lambda fn=fn: _out(fn()))
            if o is None:
                self.checks.append(f"check at s {s}: {name} vs cuDNN: not run")
                continue
            if tuple(o.shape) != tuple(ref.shape):
                c = None
                line = f"{name} output shape {tuple(o.shape)}, cuDNN's (as bshd) {tuple(ref.shape)}: FAILED"
            else:
                c = compare(o, ref, v)
                ok = c["beyond"] == 0
                line = (f"{name} vs cuDNN ({inputs} inputs): max |diff| {c['max_abs']:.3g}, mean {c['mean_abs']:.3g}, "
                        f"{c['beyond']} of {c['n']} beyond the bound: {'OK' if ok else 'FAILED'}")
            if is_ours and (c is None or c["beyond"] > 0):
                self.check_failed = True
            self.checks.append(f"check at s {s}: {line}")
        self.checks.append(f"check rule: {CHECK_RULE}")

    # ------------------------------------------------------------------ report
    def table(self) -> List[str]:
        out = ["", f"attention forward, DeepSeek-V3 MLA (b {B}, h {H}, d_qk {D_QK}, d_v {D_V}, causal), bf16 N(0,1) "
                   f"-> MXFP8 E4M3 (Q, K rowwise; V columnwise; BHSD scales)",
               f"TFLOP/s = {FLOP_FORMULA} / time (the causal triangle); medians of {self.iters} calls, L2 flushed, "
               f"all in this run",
               f"{'s':>6} {'ours':>7} {'ours-fused':>10} {'ours-bf16':>9} {'cuDNN':>7} {'FA4':>7} {'dequant+best':>16} "
               f"{'ours/best-bf16-peer':>20} {'ours/(dequant+best)':>20}"]

        def tf(row, c):
            t = row["ms"].get(c)
            return f"{row['flop'] / t / 1e9:.0f}" if t else "-"

        for r in self.rows:
            ms = r["ms"]
            peers = [ms[p] for p in ("cuDNN", "FA4") if p in ms]
            vs_peer = f"{min(peers) / ms['ours']:.2f}x" if peers and "ours" in ms else "-"
            vs_pipe = f"{ms['dequant+best'] / ms['ours']:.2f}x" if "dequant+best" in ms and "ours" in ms else "-"
            pipe = f"{tf(r, 'dequant+best')} ({r['best']})" if "dequant+best" in ms else "-"
            flag = " (check FAILED)" if self.check_failed else ""
            out.append(f"{r['s']:>6} {tf(r, 'ours'):>7} {tf(r, 'ours-fused'):>10} {tf(r, 'ours-bf16'):>9} {tf(r, 'cuDNN'):>7} {tf(r, 'FA4'):>7} "
                       f"{pipe:>16} {vs_peer:>20} {vs_pipe:>20}{flag}")
        out.append("ratios: time of the faster bf16 peer (cuDNN, FA4) / ours; time of dequantize + that peer / ours "
                   "(> 1: ours faster)")
        if self.fa4 is None:
            out.append(f"FA4: skipped: {self.fa4_error}")
        errs = self.ours_errors
        if errs["ours"] and errs["ours"] == errs["ours-fused"] == errs["ours-bf16"]:
            out.append(f"ours, ours-fused, ours-bf16: {errs['ours']}")
        else:
            out += [f"{name}: {err}" for name, err in errs.items() if err]
        if self.context_lost:
            out.append("the CUDA context was lost: the cases after the error are not measured")
        out += self.checks
        return out

    def results(self) -> dict:
        return {"formula": FLOP_FORMULA, "rows": self.rows, "checks": self.checks, "check_failed": self.check_failed,
                "ours_errors": self.ours_errors, "fa4": self.fa4_error or "measured"}

    def status(self) -> int:
        """Exit status: 1 when ours failed the check, raised, or the context was lost; else 0."""
        return 1 if (self.check_failed or self.ours_raised or self.context_lost) else 0


def run(iters: int, flush, dev, add, seqs=SEQS, check: bool = False) -> Section:
    from timing import timer  # bench/timing.py

    return Section(lambda fn: timer(fn, iters, flush), dev, add, seqs=seqs, check=check, iters=iters).run()
