#!/usr/bin/env python3
"""The plain-decoding steps of one bin in a planner step log (`planner_step_log.diff` applied,
the server run with SCRATCH_PLANNER_LOG set), each with the steps around it: what was issued
and what ran, the batch, the cycle and forward times, the tokens, the prompt tokens fed, whether
the step ran on the drafter's lent cores and was a try of the lending choice, and plain
decoding's estimated mean (ms a token, rescaled as the bandit's losses are) and evidence in the
bin before the step was observed, against the best arm's. Then how many of the bin's plain steps
the lending choice could measure (no prompt, after a plain step, on the placement of the step
before).

    python benchmarks/results/lending-first-steps/plain_steps.py planner-steps-6a55694.jsonl.gz [b8-15]
"""
from __future__ import annotations

import collections
import gzip
import json
import statistics
import sys

AR = "(<Mode.AR: 'ar'>, 0)"


def arm_label(key: str) -> str:
    """"(<Mode.SD: 'sd'>, 5)" -> "sd:5", as the planner names its arms."""
    mode = key.split("'")[1]
    gamma = key.rstrip(")").rsplit(",", 1)[1].strip()
    return mode if mode == "ar" else f"{mode}:{gamma}"


def main() -> None:
    path, ctx = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "b8-15")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    kinds, prev = collections.Counter(), None
    for i, r in enumerate(rows):
        if r["ctx"] == ctx and r["ran"] == "ar" and r["decoded"]:
            means = r["all"]
            ar = means.get(AR)
            best_arm, best = min(((k, v) for k, v in means.items() if v and v[0] is not None), key=lambda kv: kv[1][0])
            print(f"{i:5d} issued {r['issued']:6s} batch {r['batch']:2d} cycle {1e3 * r['cycle']:5.1f} ms, "
                  f"forward {1e3 * r['fwd']:5.1f}, {r['tok']:2d} tokens, {r['prefill']:3d} prompt tokens, "
                  f"lent {r['lent']!s:5s} try {r['trying']!s:5s} | plain's mean {1e3 * ar[0]:.3f} ({ar[1]:.1f} obs), "
                  f"best {arm_label(best_arm)} {1e3 * best[0]:.3f}; the step before: "
                  f"{prev['ran'] if prev else None}")
            measurable = (not r["prefill"] and prev is not None and prev["ran"] == "ar"
                          and prev["lent"] == r["lent"])
            kinds["lent" if r["lent"] else "own", "measurable" if measurable else
                  "prompt" if r["prefill"] else "after another mode or placement"] += 1
        prev = r
    print()
    for k, n in sorted(kinds.items()):
        print(f"{k[0]:4s} {k[1]:34s} {n}")
    print()
    by_place, since = collections.defaultdict(list), None
    for r in rows:
        if r["ran"] != "ar":
            since = 0
            continue
        if not r["decoded"]:
            continue
        since = since + 1 if since is not None else 99
        if not r["prefill"] and not r["lent"] and 12 <= r["batch"] <= 16:
            by_place[min(since, 6)].append((r["fwd"] / r["batch"], r["cycle"] / r["batch"]))
    for place, steps in sorted(by_place.items()):
        print(f"own-thread plain step {'6 or later' if place == 6 else place} after a speculative one: "
              f"{len(steps)} steps, forward {1e3 * statistics.median(f for f, _ in steps):.3f} ms and cycle "
              f"{1e3 * statistics.median(c for _, c in steps):.3f} ms a sequence (medians)")


if __name__ == "__main__":
    main()
