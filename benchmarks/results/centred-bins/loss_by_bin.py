#!/usr/bin/env python3
"""What mode auto's planner scored against what its steps cost, per batch bin and mode, from the
step-by-step loss log `loss_log.diff` writes (SCRATCH_LOSS_LOG=PREFIX: one ``PREFIX.<pid>`` file
per engine process).

    python benchmarks/results/centred-bins/loss_by_bin.py PREFIX.<pid>

For each bin and mode: its steps, those left out of the arm's mean (a turn-off, a pipeline
fill, a lending try, a prompt not yet priced) and their share of the mode's time; the mode's
cycle time per committed token over all its steps and over those scored; the wall the planner
kept (less the prompts' and the catch-up's share) per committed and per scored token; and the
mean loss it scored (rescaled to the bin's reference batch by `norm`).
"""
from __future__ import annotations

import collections
import json
import sys


def main(path: str) -> None:
    steps = [json.loads(line) for line in open(path)]
    bins = collections.Counter(s["ctx"] for s in steps)
    print(f"{len(steps)} steps; by bin: {dict(bins.most_common())}")
    for ctx, _ in bins.most_common(2):
        agg: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for s in steps:
            if s["ctx"] != ctx:
                continue
            for key in (s["arm"].split(":")[0], "all"):
                a = agg[key]
                a["steps"] += 1
                a["cycle"] += s["cycle"]
                a["committed"] += s["committed"]
                if s["off"] or s["fill"] or s["trying"] or s["unpriced"] or s["loss"] is None:
                    a["left_out"] += 1
                    a["left_out_cycle"] += s["cycle"]
                else:
                    a["in_cycle"] += s["cycle"]
                    a["in_committed"] += s["committed"]
                    a["in_wall"] += s["wall"]
                    a["in_scored"] += s["scored_tokens"]
                    a["loss_w"] += s["loss"] * s["weight"]
                    a["norm_w"] += s["norm"] * s["weight"]
                    a["w"] += s["weight"]
        print(ctx)
        print(f"  {'mode':4} {'steps':>5} {'left out':>8} {'of time':>7} {'cycle/tok':>9} {'scored: cycle/tok':>17}"
              f" {'wall/tok':>8} {'wall/scored':>11} {'loss':>6} {'norm':>5}   (ms)")
        for mode, a in sorted(agg.items()):
            if not a["in_committed"]:
                continue
            print(f"  {mode:4} {a['steps']:5d} {a['left_out']:8d} {a['left_out_cycle'] / a['cycle']:7.2f}"
                  f" {1e3 * a['cycle'] / a['committed']:9.3f} {1e3 * a['in_cycle'] / a['in_committed']:17.3f}"
                  f" {1e3 * a['in_wall'] / a['in_committed']:8.3f} {1e3 * a['in_wall'] / a['in_scored']:11.3f}"
                  f" {1e3 * a['loss_w'] / a['w']:6.3f} {a['norm_w'] / a['w']:5.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
