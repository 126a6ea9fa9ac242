"""Microseconds per planner step (decide, steady, observe) with the default settings, on a
synthetic engine at batch 16 (a plain step 10 ms for 16 tokens, a speculative one 18 ms for 32),
for the planner package under the checkout given:

    .venv/bin/python benchmarks/results/policy-check/planner_step_cost.py CHECKOUT

median of three runs of 20,000 steps, after one of 2,000."""
import sys, time, statistics
sys.path.insert(0, sys.argv[1])
from planner import Planner, PlannerConfig, LoadSignals, StepOutcome
def run(n=20000):
    p = Planner(PlannerConfig(), gamma_max=4, psd_available=True, seed=0)
    t = 0.0
    t0 = time.perf_counter()
    for i in range(n):
        t += 0.01
        s = LoadSignals(batch_size=16, now=t)
        d = p.decide(s)
        p.steady(s)
        tokens = 16 if not d.speculative else 32
        p.observe(d, StepOutcome(step_wall_s=0.01 if not d.speculative else 0.018,
                                 tokens_committed=tokens, batch_size=16))
    return (time.perf_counter() - t0) / n * 1e6
run(2000)
print(statistics.median(run() for _ in range(3)))
