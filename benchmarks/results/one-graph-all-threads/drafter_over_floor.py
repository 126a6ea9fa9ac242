"""The drafter's step over its floor in `bench profile`'s SD rows, by round, for each side of
each folder given ({before,after}{1,2,3}.json), with the median:

    python benchmarks/results/one-graph-all-threads/drafter_over_floor.py \
        benchmarks/results/one-graph-all-threads/profile benchmarks/results/one-graph-all-threads/profile-fix
"""
import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":
    for folder in map(Path, sys.argv[1:]):
        for side in ("before", "after"):
            by_c: dict[int, list[float]] = {}
            for i in (1, 2, 3):
                for r in json.loads((folder / f"{side}{i}.json").read_text())["rows"]:
                    if r["config"] == "sd":
                        by_c.setdefault(r["concurrency"], []).append(r["drafter_step_over_floor"])
            print(f"{folder.name} {side}: " + "; ".join(
                f"c={c} {statistics.median(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})" for c, v in by_c.items()))
