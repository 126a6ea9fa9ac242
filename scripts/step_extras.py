#!/usr/bin/env python3
"""What one-off costs land on a single step, read from the planner's per-step logs
(`scripts/planner_log_levels.py`):

* the turn-on step (the drafter's catch-up reported): its wall time less that catch-up, against
  the median of its arm's other steps at the same batch, and the same for the step after it;
* the drafter's time on new requests' prompts (`prompt_ms`: only logs written on commit b0fa7de,
  `benchmarks/results/prompt-spread-c1/after-*.json`, have it).

    .venv/bin/python scripts/step_extras.py LOG.json [LOG.json ...]
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def quartiles(xs: list[float]) -> str:
    if len(xs) < 2:
        return "n/a"
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return f"median {q2:.1f} ms, quartiles {q1:.1f} / {q3:.1f} ms, n = {len(xs)}"


def main(paths: list[str]) -> int:
    turn_on, after, prompt = [], [], []
    for path in paths:
        with open(path) as f:
            log = json.load(f)["log"]
        steady = defaultdict(list)       # (arm, batch) -> walls of steps with nothing one-off
        for s in log:
            if s["decoded"] and s["ran"] is None and s["catchup_ms"] == 0 and not s.get("prompt_ms"):
                steady[(s["issued"], s["batch"])].append(s["wall_ms"])
        for k, s in enumerate(log):
            if s.get("prompt_ms"):
                prompt.append(s["prompt_ms"])
            if s["catchup_ms"] <= 0 or s["ran"] is not None:
                continue
            walls = steady.get((s["issued"], s["batch"]))
            if not walls or len(walls) < 3:
                continue
            typical = statistics.median(walls)
            turn_on.append(s["wall_ms"] - s["catchup_ms"] - typical)
            nxt = log[k + 1] if k + 1 < len(log) else None
            if nxt and nxt["issued"] == s["issued"] and nxt["ran"] is None and nxt["decoded"]:
                after.append(nxt["wall_ms"] - typical)
    print("turn-on step, less its catch-up, over its arm's median:", quartiles(turn_on))
    print("the step after it, over the same median:               ", quartiles(after))
    print("the drafter's time on new prompts, where reported:     ", quartiles(prompt),
          f"(range {min(prompt):.1f}-{max(prompt):.1f} ms)" if prompt else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
