"""From the per-step dumps (`dumps/*.json`, written by `loss_dump.py`): per run, the turn-off's
ratios by place that the planner learned (ef2e021 and the within-run variant), and in the bin of each
level, plain decoding's scored steps by place after the last drafting step: how many, their
measured loss and the loss the bandit was given (ms a token, normalised to the bin), and how
many plain steps were settled (place 8 and later), and the window's mean measured loss over
the settled steps'.

    python tail_ratios.py dumps/*.json.gz
"""
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

for name in sys.argv[1:]:
    d = json.loads(gzip.open(name).read())
    print(f"{Path(name).name.split('.')[0]}: learned ratios {d.get('switch', {}).get('turn_off_tail_ratios', '(none: before ef2e021)')}")
    rows = defaultdict(lambda: [0, 0.0, 0.0])      # (bin, place) -> steps, measured, scored
    place = 99
    for r in d["log"]:
        if "mark" in r or not r["decoded"]:
            continue
        place = place + 1 if r["ran"] == "ar" else 0
        if r["ran"] != "ar" or r.get("how") != "scored" or r["phase"].startswith("c2"):
            continue
        k = (r["ctx"], min(place, 8))
        rows[k][0] += 1
        rows[k][1] += r["loss_m"]
        rows[k][2] += r["loss"]
    for ctx in sorted({k[0] for k in rows}, key=lambda c: int(c[1:].split("-")[0])):
        cells = []
        for p in range(2, 9):
            n, m, s = rows.get((ctx, p), (0, 0, 0))
            if n:
                cells.append(f"{p if p < 8 else '8+'}: {n} x {1e3 * m / n:.3f}->{1e3 * s / n:.3f}")
        window = [rows[(ctx, p)] for p in range(2, 8) if (ctx, p) in rows]
        settled = rows.get((ctx, 8))
        if window and settled:
            n = sum(w[0] for w in window)
            cells.append(f"| places 2-7 / settled: {sum(w[1] for w in window) / n / (settled[1] / settled[0]):.2f}"
                         f" ({n} against {settled[0]} steps)")
        print(f"   {ctx:7s} " + "  ".join(cells))
