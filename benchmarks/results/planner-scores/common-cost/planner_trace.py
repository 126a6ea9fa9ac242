#!/usr/bin/env python3
"""One seed of planner_sim.py traced: the planner at batch 96 with the diff at
``shift_keep_common`` 0.3, every step's wall time 0.7x from step 3,000 on; the bin's six lowest
means (ms, with their evidence) before the speed-up, right after the shift is detected, and at
steps 3,050-3,600.

    git apply benchmarks/results/planner-scores/common-cost/common_cost.diff
    python benchmarks/results/planner-scores/common-cost/planner_trace.py  # planner_trace.txt
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_sim import T, wall_scaled_planner   # noqa: E402

p = wall_scaled_planner(0, 0.3, lambda i: 0.7 if i >= 3000 else 1.0)


def show(tag):
    means = sorted((m, f"{a[0].value}:{a[1]}", e) for a, (m, e) in p.bandit.means(p._ctx).items())[:6]
    print(f"{tag}: " + ", ".join(f"{a} {1e3 * m:.3f} ({e:.1f})" for m, a, e in means))


engine = T.FakeEngine(p, seed=0)
shifts = 0
for i in range(3601):
    if p.bandit.shifts != shifts:
        shifts = p.bandit.shifts
        show(f"shift detected before step {i}")
    d = engine.step(96)[0]
    if i in (2999, 3050, 3100, 3300, 3600):
        show(f"step {i}, ran {d.mode.value}:{d.gamma}")
