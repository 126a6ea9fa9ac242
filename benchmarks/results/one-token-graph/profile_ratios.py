"""Prints, from a folder's {before,after}{1,2,3}.json (`nightdraft bench profile --configs ar,sd
--concurrency 1,4,16`, run from worktrees of two commits in turns; by default this folder's
profile/, dcd987c and 329a3da), each configuration's median tok/s and step / floor before and
after, with after / before and its spread by round:

    python benchmarks/results/one-token-graph/profile_ratios.py [FOLDER]
"""
import json
import statistics
import sys
from pathlib import Path

HERE = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "profile"


def rows(side: str) -> list[dict]:
    """{(config, concurrency): row} for each round of `side`."""
    return [{(r["config"], r["concurrency"]): r for r in json.loads((HERE / f"{side}{i}.json").read_text())["rows"]}
            for i in (1, 2, 3)]


if __name__ == "__main__":
    before, after = rows("before"), rows("after")
    print("| mode | c | tok/s before | tok/s after | after / before (by round) | step/floor before | step/floor after |")
    print("|---|---|---|---|---|---|---|")
    for key in before[0]:
        tb = [r[key]["tokens_per_s"] for r in before]
        ta = [r[key]["tokens_per_s"] for r in after]
        ratios = [a / b for a, b in zip(ta, tb)]
        fb = statistics.median(r[key]["step_over_floor"] for r in before)
        fa = statistics.median(r[key]["step_over_floor"] for r in after)
        print(f"| {key[0]} | {key[1]} | {statistics.median(tb):.0f} | {statistics.median(ta):.0f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {fb:.2f} | {fa:.2f} |")
