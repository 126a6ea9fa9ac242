#!/usr/bin/env python3
"""One seed of planner_sim.py traced: the planner at batch 96 with the diff at
``shift_keep_common`` 0.3, every step's wall time 0.7x from step 3,000 on; the bin's six lowest
means (ms, with their evidence) before the speed-up, right after the shift is detected, and at
steps 3,050-3,600.

    git apply benchmarks/results/planner-scores/common-cost/common_cost.diff
    python benchmarks/results/planner-scores/common-cost/planner_trace.py  # planner_trace.txt
"""
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import test_planner as T                      # noqa: E402
from planner import Planner, PlannerConfig   # noqa: E402

p = Planner(gamma_max=6, psd_available=True, cost_profile=T.profile(), seed=0,
            config=PlannerConfig.from_dict({"shift_keep_common": 0.3}))
observe, n = p.observe, [0]


def faster(decision, outcome):
    f = 0.7 if n[0] >= 3000 else 1.0
    n[0] += 1
    observe(decision, dataclasses.replace(outcome, step_wall_s=outcome.step_wall_s * f,
                                          drafter_rebuild_s=outcome.drafter_rebuild_s * f))


def show(tag):
    means = sorted((m, f"{a[0].value}:{a[1]}", e) for a, (m, e) in p.bandit.means(p._ctx).items())[:6]
    print(f"{tag}: " + ", ".join(f"{a} {1e3 * m:.3f} ({e:.1f})" for m, a, e in means))


p.observe = faster
engine = T.FakeEngine(p, seed=0)
shifts = 0
for i in range(3601):
    if p.bandit.shifts != shifts:
        shifts = p.bandit.shifts
        show(f"shift detected before step {i}")
    d = engine.step(96)[0]
    if i in (2999, 3050, 3100, 3300, 3600):
        show(f"step {i}, ran {d.mode.value}:{d.gamma}")
