"""A step that feeds only prompts, on the target's one core against the drafter's borrowed core
too: the bundled target's forward of one prompt of each length (op by op, as a prompt runs),
in a CPU placement like fixed SD's (the drafter's worker not started: its core idles, as it does
while the target feeds prompts), the two placements in turns in one process, 15 rounds after 3;
prints the median ms of each and their ratio.

    python benchmarks/results/prompt-borrow/prefill.py
"""
import statistics
import time

import torch

from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import ModelRunner
from backend.speculation.placement import CpuPlacement

LENGTHS = [26, 61, 104, 165, 211, 376]

if __name__ == "__main__":
    place = CpuPlacement("cpu", 1)
    place.place()
    try:
        model = load_model("models/tiny-target", attention="paged")
        kv = PagedKVCache.for_model(model.config, 32 << 20, block_size=16)
        runner = ModelRunner(model, kv)
        times = {(n, borrowed): [] for n in LENGTHS for borrowed in (False, True)}
        with torch.inference_mode():
            for rnd in range(18):
                for n in LENGTHS:
                    for borrowed in (False, True) if rnd % 2 else (True, False):
                        assert kv.ensure_capacity("p", n)
                        t0 = time.perf_counter()
                        if borrowed:
                            with place.borrowing():
                                runner.forward(["p"], [0], [n], list(range(5, 5 + n)))
                        else:
                            runner.forward(["p"], [0], [n], list(range(5, 5 + n)))
                        if rnd >= 3:
                            times[(n, borrowed)].append(time.perf_counter() - t0)
                        kv.free("p")
    finally:
        place.restore()
    for n in LENGTHS:
        one, both = (1e3 * statistics.median(times[(n, b)]) for b in (False, True))
        print(f"{n:4d} tokens: one core {one:6.1f} ms, borrowed {both:6.1f} ms, borrowed / one core {both / one:.2f}")
