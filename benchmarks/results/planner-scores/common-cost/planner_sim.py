#!/usr/bin/env python3
"""The planner (its default settings, the synthetic engine and cost profile of
tests/test_planner.py) at batch 16 and 96, plain decoding the cheapest at 96, with the
bandit's ``common_cost`` off and on (plain decoding; ``shift_keep_common`` 0.3 and 2), 10 seeds
of 5,000 steps, every step's wall time scaled: 1.5x in steps 3,000-3,299, 1.5x from 3,000 on,
0.7x from 3,000 on. For each: the speculative steps in steps 3,000-3,599 (per seed and summed)
and the shifts detected.

    git apply benchmarks/results/planner-scores/common-cost/common_cost.diff
    python benchmarks/results/planner-scores/common-cost/planner_sim.py    # planner_sim.txt
"""
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import test_planner as T                      # noqa: E402
from planner import Planner, PlannerConfig   # noqa: E402


def wall_scaled_planner(seed, keep, slow):
    """The planner of this sim (`keep`: ``shift_keep_common``, None: the rule off) whose
    observed wall times are scaled by ``slow(step number)``."""
    cfg = PlannerConfig.from_dict({} if keep is None else {"shift_keep_common": keep})
    p = Planner(gamma_max=6, psd_available=True, cost_profile=T.profile(), seed=seed, config=cfg)
    if keep is None:
        p.bandit._common_cost = None
    observe, n = p.observe, [0]

    def slowed(decision, outcome):
        f = slow(n[0])
        n[0] += 1
        observe(decision, dataclasses.replace(outcome, step_wall_s=outcome.step_wall_s * f,
                                              drafter_rebuild_s=outcome.drafter_rebuild_s * f))
    p.observe = slowed
    return p


def run(seed, keep, batch, slow, steps=5000):
    p = wall_scaled_planner(seed, keep, slow)
    eng = T.FakeEngine(p, seed=seed)
    modes = [eng.step(batch)[0].mode for _ in range(steps)]
    return sum(m != "ar" for m in modes[3000:3600]), p.bandit.shifts


def main():
    for batch in (16, 96):
        for name, slow in (("x1.5 in 3000-3299", lambda i: 1.5 if 3000 <= i < 3300 else 1.0),
                           ("x1.5 from 3000", lambda i: 1.5 if i >= 3000 else 1.0),
                           ("x0.7 from 3000", lambda i: 0.7 if i >= 3000 else 1.0)):
            for keep in (None, 0.3, 2.0):
                r = [run(s, keep, batch, slow) for s in range(10)]
                tag = "off" if keep is None else f"on, keep {keep}"
                print(f"batch {batch:3d} {name:18s} common_cost {tag:12s}: speculative steps in 3000-3599 "
                      f"{[x for x, _ in r]} (sum {sum(x for x, _ in r)}), shifts {sum(y for _, y in r)}",
                      flush=True)


if __name__ == "__main__":
    main()
