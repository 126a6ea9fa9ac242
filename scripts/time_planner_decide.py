#!/usr/bin/env python3
"""Time the planner's decision alone (planner/planner.py, Planner.decide + observe): what mode
auto adds to every engine step, in the worst case of a new batch-size bin almost every step.

    .venv/bin/python scripts/time_planner_decide.py [--steps 4000] [--gamma-max 8] [--seed 0]
        [--flush-mib 0] [--json PATH]

Prints the median and 99th percentile of decide, and of observe, in microseconds (with --json,
also writes them there). The cost profile is synthetic (linear in batch and tokens), as in
tests/test_planner.py. With ``--flush-mib N``, N MiB are read between steps, as an engine's
forward streams its weights and KV through the caches: the planner then runs with cold caches,
as it does between two forwards.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402

from planner import Planner, StepOutcome  # noqa: E402
from planner.cost_model import CostProfile  # noqa: E402
from planner.signals import LoadSignals  # noqa: E402


def synthetic_profile() -> CostProfile:
    batches = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostProfile({(b, n): 0.020 + 0.0006 * b * n for b in batches for n in range(1, 8)},
                       {b: 0.002 + 0.00005 * b for b in batches})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--gamma-max", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flush-mib", type=int, default=0,
                   help="MiB read between steps, evicting the caches as a forward does (0: none)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = p.parse_args()
    planner = Planner(gamma_max=args.gamma_max, psd_available=True, cost_profile=synthetic_profile(),
                      seed=args.seed)
    batches = np.random.default_rng(args.seed).integers(1, 100, size=args.steps)
    flush = np.ones(args.flush_mib * 2**20 // 8) if args.flush_mib > 0 else None
    decide_s, observe_s = [], []
    for i, b in enumerate(batches):
        if flush is not None:
            flush.sum()
        signals = LoadSignals(batch_size=int(b), now=i * 0.01)
        t0 = time.perf_counter()
        d = planner.decide(signals)
        t1 = time.perf_counter()
        planner.observe(d, StepOutcome(step_wall_s=0.02, tokens_committed=int(b), batch_size=int(b)))
        t2 = time.perf_counter()
        decide_s.append(t1 - t0)
        observe_s.append(t2 - t1)
    report = {"steps": args.steps, "gamma_max": args.gamma_max, "seed": args.seed,
              "flush_mib": args.flush_mib}
    for name, xs in (("decide", decide_s), ("observe", observe_s)):
        xs = sorted(xs)
        median_us, p99_us = statistics.median(xs) * 1e6, xs[int(0.99 * (len(xs) - 1))] * 1e6
        report[name] = {"median_us": median_us, "p99_us": p99_us}
        print(f"{name}: median {median_us:.0f} us, p99 {p99_us:.0f} us over {len(xs)} steps")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
