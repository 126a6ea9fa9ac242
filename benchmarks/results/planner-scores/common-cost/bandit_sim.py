#!/usr/bin/env python3
"""The bare bandit (planner/bandit.py, its default settings) with six arms, arm 0 the cheapest
(1.0; the others 1.2-1.6, 10 % noise a step), with ``common_cost`` off and on for arm 0 (at
``shift_keep_common`` 0.3, 1, 2, 4), 20 seeds of 6,000 steps:

* a slow stretch: every arm 1.5x dearer in steps 3,000-3,299 (a host slowing down);
* arm 0 alone 1.5x dearer from step 3,000 on (arm 1 the cheapest then).

For each: plays of arms 1-5 in steps 3,000-3,599, the regret from step 3,000, and the steps
until arm 1 runs on 90 % of 100 (3,000: never).

    git apply benchmarks/results/planner-scores/common-cost/common_cost.diff
    python benchmarks/results/planner-scores/common-cost/bandit_sim.py     # bandit_sim.txt
"""
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from planner.bandit import ContextualBandit   # noqa: E402
from test_planner import simulate             # noqa: E402

ARMS = list(range(6))


def base(a):
    return 1.0 if a == 0 else 1.2 + 0.1 * (a - 1)


def slow_stretch(c, a, t):
    return base(a) * (1.5 if 3000 <= t < 3300 else 1.0)


def arm0_dearer(c, a, t):
    return base(a) * (1.5 if (a == 0 and t >= 3000) else 1.0)


for name, f in (("slow stretch: every arm x1.5 in steps 3000-3299", slow_stretch),
                ("arm 0 alone x1.5 from step 3000", arm0_dearer)):
    print(name)
    for keep in (None, 0.3, 1.0, 2.0, 4.0):
        other, follow, regret = [], [], []
        for seed in range(20):
            settings = {} if keep is None else {"shift_keep_common": keep}
            b = ContextualBandit(ARMS, seed=seed, common_cost=None if keep is None else (lambda a: a == 0),
                                 **settings)
            played, reg = simulate(b, f, 6000, seed=seed)
            other.append(sum(a != 0 for a in played[3000:3600]))
            regret.append(reg[3000:].sum())
            after = np.array(played[3000:]) == 1
            follow.append(next((i for i in range(len(after) - 100) if after[i:i + 100].mean() >= 0.9), 3000))
        tag = "common_cost off" if keep is None else f"on, keep {keep}"
        print(f"  {tag:15s}: arms 1-5 played {statistics.median(other):5.1f} (max {max(other)}), "
              f"regret {statistics.median(regret):5.1f} (max {max(regret):5.1f}), "
              f"arm 1 at 90 % after {statistics.median(follow):6.1f} steps (max {max(follow)})  [medians of 20 seeds]")
