"""Mode auto with plain decoding only (its cost profile off) and the drafter's core lent: two
requests of 40 tokens in a fresh process; the graphs compiled while they ran and the slowest
steps (seconds, lent, threads). Run in a fresh compile cache, from the checkout to measure:

    cd CHECKOUT && TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD python $REPO/benchmarks/results/lent-kernels/lend_stall.py
"""
import time

import torch

from backend.engine.engine import Engine
from backend.engine.config import EngineConfig
from backend.sampling.params import SamplingParams
from backend.model.captured import compiled_graphs

if __name__ == "__main__":
    import backend
    print("code:", backend.__file__)
    e = Engine(EngineConfig(target="models/tiny-target", drafter="models/tiny-drafter", mode="auto",
                            drafter_device="cpu", num_threads=1, kv_cache_bytes=16 << 20, planner={"modes": ["ar"]},
                            planner_cost_profile="off", lend_drafter_cores=True))
    try:
        g0 = compiled_graphs()
        steps = []
        t = [time.perf_counter()]

        def on_step(_):
            now = time.perf_counter()
            steps.append((round(now - t[0], 4), e._placement.lent, torch.get_num_threads()))
            t[0] = now
        e.generate(["def add(a, b):\n", "import os\n"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                   on_step=on_step)
        print("graphs compiled while serving:", compiled_graphs() - g0)
        print("slowest steps (s, lent, threads):", sorted(steps, reverse=True)[:3])
        print("lent steps:", sum(1 for s in steps if s[1]), "of", len(steps))
    finally:
        e.close()
