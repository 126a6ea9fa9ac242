"""The batch-1 sim of `test_the_first_steps_measure_the_acceptance_the_prior_only_assumes`, seed
by seed: the share of steps after the first third that drafted, without the acceptance probe and
with it. Needs `acceptance_probe.diff` applied (its helper takes the costs and the config); from
the checkout: `PYTHONPATH=$PWD python benchmarks/results/acceptance-probe/sims/batch1_lock.py`."""
import sys

sys.path.insert(0, "tests")
from helpers.planner_sim import ServerCosts, speculative_share_at_batch_1  # noqa: E402
from planner import PlannerConfig  # noqa: E402

costs = ServerCosts(d0=0.0035, alpha=0.95)
for probe in (0, 32):
    shares = [speculative_share_at_batch_1(seed, 0, costs=costs, config=PlannerConfig(alpha_probe_sequences=probe))
              for seed in range(8)]
    print(f"alpha_probe_sequences={probe}:", [round(s, 2) for s in shares])
