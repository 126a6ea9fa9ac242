"""Print auto / best fixed (and the best fixed configuration) by concurrency for every levels
JSON given, and the median per side (the side is the file name without its trailing number).

    python summary.py ab/*.json aa/*.json
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

by_side: dict = defaultdict(lambda: defaultdict(list))
for name in sys.argv[1:]:
    path = Path(name)
    stem = re.sub(r"\d+$", "", path.stem)
    side = f"{path.parent.name}/{stem}"
    cells = []
    for row in json.loads(path.read_text())["rows"]:
        c, r = row["concurrency"], row["auto_over_best_fixed"]
        by_side[side][c].append(r)
        top = max(row["tokens_per_s"].items(), key=lambda kv: kv[1] if kv[0] != "auto" else -1)
        arms = " ".join(f"{a}:{s:.0%}" for a, s in list(row["auto_arm_shares"].items())[:2])
        cells.append(f"c={c} {r:.2f} (best {top[0]}, auto played {arms})")
    print(f"{path.parent.name}/{path.stem:6s} " + " | ".join(cells))
print()
for side, levels in by_side.items():
    print(f"{side:8s} median auto/best " + "  ".join(
        f"c={c} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] n={len(v)}"
        for c, v in sorted(levels.items())))
