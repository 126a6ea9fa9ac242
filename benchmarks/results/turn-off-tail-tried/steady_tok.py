"""The synthetic engine of `tests/test_planner.py::test_steady_blocks_held_without_a_snapshot_decide_exactly_as_every_step_decided`
(no turn-off transient in its costs, 5 % noise): tokens per simulated second in its two plain
phases (steps 200-800 at demand 80-90 and 1500-2100 at demand 60-70), with and without PSD. Run
from a checkout (it imports that checkout's tests and planner):

    cd CHECKOUT && PYTHONPATH=$PWD python $REPO/benchmarks/results/turn-off-tail-tried/steady_tok.py
"""
import sys

import planner

sys.path.insert(0, 'tests')
from test_planner import *  # noqa: F403 (the test's engine, costs and imports)

print('code:', planner.__file__)
for PSD in (False, True):
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, reload_after_s=0.05), gamma_max=4, psd_available=PSD, seed=0)
    eng = KVBoundEngine(p, base=128, steady=False)
    load = ([2] * 200 + [80, 90, 85] * 200 + [200] * 400 + [2] * 300 + [60, 60, 60, 70] * 150 + [3, 2] * 100)
    acc = {"tok": 0, "plain": 0}
    real = p.observe

    def obs(d, o, real=real):
        acc["tok"] += o.tokens_committed
        acc["plain"] += not d.speculative
        real(d, o)
    p.observe = obs
    marks = {}
    for i, dm in enumerate(load):
        if i in (200, 800, 1500, 2100):
            marks[i] = (eng.t, acc["tok"], acc["plain"])
        eng.step(dm)
    for a, b in ((200, 800), (1500, 2100)):
        dt = marks[b][0] - marks[a][0]; dk = marks[b][1] - marks[a][1]
        plain = marks[b][2] - marks[a][2]
        print(f"psd={PSD} steps {a}-{b}: {dk / dt:.0f} tok/s, plain decoding on {plain} of {b - a} steps")
    print(f"psd={PSD} turn-off ratios learned by place: {p.stats()['switch_cost'].get('turn_off_tail_ratios', '(none)')}")
