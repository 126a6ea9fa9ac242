#!/usr/bin/env python3
"""Auto over the best fixed configuration, and over plain decoding on one core, in each `bench
levels` result of an A/B folder (`base-N.json`, `new-N.json`), by side and concurrency, with
the medians over the runs' repeats and over the runs.

    python benchmarks/results/lending-first-steps/ab_summary.py benchmarks/results/lending-first-steps/server
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    table = defaultdict(list)   # (path, side, concurrency) -> [(auto/best, auto/ar-1dev, auto tok/s, best fixed)]
    for f in sorted(folder.glob("*-[0-9]*.json")):
        side = f.stem.rsplit("-", 1)[0]
        for row in json.loads(f.read_text())["rows"]:
            tps = row["tokens_per_s"]
            table[row["path"], side, row["concurrency"]].append(
                (row["auto_over_best_fixed"], tps["auto"] / tps["ar-1dev"] if "ar-1dev" in tps else None,
                 tps["auto"], row["best_fixed"]))
            print(f"{f.name:12s} {row['path']:10s} c={row['concurrency']:<3d} best fixed {row['best_fixed']:8s} "
                  f"auto/best {row['auto_over_best_fixed']:.3f} (by repeat "
                  + " ".join(f"{x:.3f}" for x in row["auto_over_best_fixed_by_repeat"])
                  + ") " + " ".join(f"{k} {v:.0f}" for k, v in tps.items()))
    print()
    for (path, side, c), runs in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        best = [r[0] for r in runs]
        one_core = [r[1] for r in runs if r[1] is not None]
        print(f"{path:10s} c={c:<3d} {side:5s} auto/best median {statistics.median(best):.3f} "
              f"(runs {' '.join(f'{x:.3f}' for x in best)}); auto tok/s median {statistics.median(r[2] for r in runs):.0f}"
              + (f"; auto/ar-1dev median {statistics.median(one_core):.3f}" if one_core else ""))


if __name__ == "__main__":
    main()
