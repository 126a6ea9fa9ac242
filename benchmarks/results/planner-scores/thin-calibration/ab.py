"""`bench levels` in process at concurrency 1, 4 and 16, alternated between the commit before the
thin-calibration rule and the commit with it (levels-before-N.json, levels-after-N.json): per
side and level, auto over the best fixed configuration in each run and their median, and the
runs in which auto played plain decoding on most of its measured steps.

    python benchmarks/results/planner-scores/thin-calibration/ab.py
"""
import json
import statistics
from pathlib import Path

here = Path(__file__).parent
for side in ("before", "after"):
    runs = [json.loads(p.read_text()) for p in sorted(here.glob(f"levels-{side}-*.json"))]
    print(f"== {side}: {len(runs)} runs")
    for level in (1, 4, 16):
        rows = [next(r for r in run["rows"] if r["concurrency"] == level) for run in runs]
        ratios = [r["auto_over_best_fixed"] for r in rows]
        plain = sum(r["auto_arm_shares"].get("ar", 0) > 0.5 for r in rows)
        best = [r["best_fixed"] for r in rows]
        print(f"  c{level:<3} auto / best fixed {statistics.median(ratios):.2f} "
              f"(runs {', '.join(f'{x:.2f}' for x in ratios)}; best fixed {', '.join(best)}); "
              f"auto mostly on plain decoding in {plain} of {len(rows)}")
