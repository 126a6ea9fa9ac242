"""Print auto / best fixed (and the best fixed configuration, auto's share of plain decoding and
its two most played arms) by concurrency for every levels JSON given; the median per side (the
side is the file name without its trailing number); then per commit (`COMMIT_OF_SIDE`) the
medians over all its runs and, between the two commits, a rank-sum test at each concurrency.

    python summary.py ab/*.json aa/*.json
    python summary.py ab/new=ef2e021 ab/old=2e414c7 ab/*.json     (SIDE=COMMIT names a side's commit)
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from scipy.stats import mannwhitneyu

COMMIT_OF_SIDE = {"ab/new": "438072b", "aa/first": "438072b", "aa/second": "438072b", "ab/old": "0b735f0"}

COMMIT_OF_SIDE.update(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
by_side: dict = defaultdict(lambda: defaultdict(list))
for name in (a for a in sys.argv[1:] if "=" not in a):
    path = Path(name)
    stem = re.sub(r"\d+$", "", path.stem)
    side = f"{path.parent.name}/{stem}"
    cells = []
    for row in json.loads(path.read_text())["rows"]:
        c, r = row["concurrency"], row["auto_over_best_fixed"]
        by_side[side][c].append(r)
        top = max(row["tokens_per_s"].items(), key=lambda kv: kv[1] if kv[0] != "auto" else -1)
        shares = row.get("auto_arm_shares")      # (none through the server: its planner is out of reach)
        if shares:
            arms = " ".join(f"{a}:{s:.0%}" for a, s in list(shares.items())[:2])
            cells.append(f"c={c} {r:.2f} (best {top[0]}, auto played ar:{shares.get('ar', 0.0):.0%}; {arms})")
        else:
            cells.append(f"c={c} {r:.2f} (best {top[0]})")
    print(f"{path.parent.name}/{path.stem:6s} " + " | ".join(cells))
print()
for side, levels in by_side.items():
    print(f"{side:8s} median auto/best " + "  ".join(
        f"c={c} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] n={len(v)}"
        for c, v in sorted(levels.items())))

by_commit: dict = defaultdict(lambda: defaultdict(list))
for side, levels in by_side.items():
    for c, v in levels.items():
        by_commit[COMMIT_OF_SIDE.get(side, side)][c] += v
print()
for commit, levels in by_commit.items():
    print(f"{commit:8s} median auto/best " + "  ".join(
        f"c={c} {statistics.median(v):.2f} n={len(v)}" for c, v in sorted(levels.items())))
if len(by_commit) == 2:
    (a, la), (b, lb) = by_commit.items()
    for c in sorted(la):
        test = mannwhitneyu(lb[c], la[c], alternative="two-sided", method="asymptotic")
        n1, n2 = len(lb[c]), len(la[c])
        z = (test.statistic - n1 * n2 / 2) / (n1 * n2 * (n1 + n2 + 1) / 12) ** 0.5
        print(f"c={c}: U({b} over {a}) = {test.statistic:.1f} of {n1 * n2}, z = {z:.2f}, p = {test.pvalue:.2f}")
