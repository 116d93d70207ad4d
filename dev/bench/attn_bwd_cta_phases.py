"""What the attention backward's SM90 kernel spends outside its tile loop, per CTA: needs the probe
build (dev/patches/attn_bwd_cta_probe.patch applied: clock64 stamps at a CTA's entry, the roles'
split, K / V landed, the first stage landed, the end of the tile loop and each role's end, with
%smid and %globaltimer, for every CTA of the first launch — KV heads from 0 — written to the file that
MXMLA_BWD_CTA_PROBE names). Runs one backward call (after warm-up) with MXFP8 inputs and one with
bf16 inputs (attn_bwd_phases.py's calls: DeepSeek-V3 head dims, causal, bshd, b 1, H heads, s
tokens) and prints, in cycles a CTA (means over the launch's CTAs): the prologue (entry -> the
roles' split -> K / V landed -> the first stage landed), the tile loop, the epilogue (the loop's end
-> consumer 0's end -> the CTA's last role's end), the gap to the next CTA on the same SM (clock64 is
the SM's own counter), and the share of the SMs' time (first entry to last end on each SM) that each
takes; then how long the SMs idle at the launch's ends (%globaltimer). The first tile's loads are
the prologue's last part: what a persistent kernel could overlap with the previous CTA's
epilogue, not remove.
Usage: PYTHONPATH=<probe build>/python python3 dev/bench/attn_bwd_cta_phases.py [H s]   (default 128 4096)"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_bwd_phases import main  # noqa: E402
from parts import probe_stamps  # noqa: E402

CTAS, SLOTS = 1 << 16, 12  # the patch's kCtaMax, kCtaSlots
# slots: 0 smid, 1 entry, 2 split, 3 K/V landed, 4 first stage landed, 5 loop end, 6 consumer 0 end,
# 7 consumer 1 end, 8 producer end, 9 tiles, 10 globaltimer at entry, 11 globaltimer at consumer 0's end


def run(label, fn):
    a = probe_stamps(fn, "MXMLA_BWD_CTA_PROBE", CTAS * SLOTS).reshape(CTAS, SLOTS)
    a = a[(a[:, 1] != 0) & (a[:, 9] > 0) & (a[:, 6] != 0)]  # CTAs that ran tiles
    n = len(a)
    end = np.max(a[:, 6:9], axis=1)
    parts = {
        "entry -> roles' split (setup; MXFP8: K / V conversion)": a[:, 2] - a[:, 1],
        "split -> K / V landed (consumer 0)": a[:, 3] - a[:, 2],
        "K / V landed -> first stage landed": a[:, 4] - a[:, 3],
        "tile loop (first stage landed -> loop end)": a[:, 5] - a[:, 4],
        "loop end -> consumer 0 end (dK, dV out)": a[:, 6] - a[:, 5],
        "consumer 0 end -> the CTA's last role's end": end - a[:, 6],
    }
    # per SM (its CTAs in start order): the gaps between them and its span (clock64), and its first
    # entry and last end by %globaltimer (ns, comparable across SMs: the launch's ends)
    gaps, span_sum, sm_first, sm_last = [], 0, [], []
    for sm in np.unique(a[:, 0]):
        on = a[:, 0] == sm
        o = np.argsort(a[on, 1])
        s, e = a[on, 1][o], end[on][o]
        gaps.extend(s[1:] - e[:-1])
        span_sum += e[-1] - s[0]
        sm_first.append(a[on, 10].min()), sm_last.append(a[on, 11].max())
    gaps, sm_first, sm_last = np.array(gaps), np.array(sm_first), np.array(sm_last)
    gt = (a[:, 11] - a[:, 10]).astype(np.float64)
    ghz = np.median((a[:, 6] - a[:, 1]) / np.where(gt > 0, gt, np.nan))
    tiles = a[:, 9]
    print(f"== {label}: {n} CTAs on {len(np.unique(a[:, 0]))} SMs, {tiles.mean():.1f} tiles a CTA (max {tiles.max()}), "
          f"SM clock ~{ghz:.2f} GHz (clock64 / globaltimer)")
    for name, v in parts.items():
        print(f"  {name:58s} mean {v.mean():9.0f}  median {np.median(v):9.0f}  share {v.sum() / span_sum * 100:5.2f} %")
    print(f"  {'gap to the next CTA on the SM (CTA end -> next entry)':58s} mean {gaps.mean():9.0f}  median "
          f"{np.median(gaps):9.0f}  share {gaps.sum() / span_sum * 100:5.2f} %")
    loop = a[:, 5] - a[:, 4]
    print(f"  loop cycles a tile {np.sum(loop) / np.sum(tiles):.0f}; outside the loop (all but it, gaps included) "
          f"{(1 - loop.sum() / span_sum) * 100:.2f} % of the SMs' time")
    # how long each SM idles after its last CTA (consumer 0's end) until the launch's last one, and
    # before its first CTA's entry
    g0, g1 = sm_first.min(), sm_last.max()
    print(f"  launch {(g1 - g0) / 1e3:.1f} us (first entry to last end); SMs idle after their last CTA "
          f"{np.mean(g1 - sm_last) / (g1 - g0) * 100:.2f} %, before their first {np.mean(sm_first - g0) / (g1 - g0) * 100:.2f} % "
          f"of it (means over SMs)")


if __name__ == "__main__":
    main(run)
