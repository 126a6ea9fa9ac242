"""The bundled target's frozen compiled step built as an engine builds it (one core, one
thread), then run on two cores and two threads, as plain decoding on the drafter's lent cores
runs it. Prints the graphs compiled, the seconds and the anonymous memory the process gained at
each thread count (the warm-up at two threads compiles a second graph where the compiler guards
on the thread count), then the median step (ms) by thread count and (batch, tokens a sequence):
twelve blocks a thread count in turns, 20 steps of each shape a block after 5, contexts of 150
tokens. Run from the checkout to measure, in a fresh process:

    cd CHECKOUT && TORCHINDUCTOR_CACHE_DIR=DIR PYTHONPATH=$PWD python $REPO/benchmarks/results/one-graph-all-threads/threads.py
"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from backend.model.captured import compiled_graphs
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "one-token-graph"))
from memory import anonymous_mib  # noqa: E402
from step_time import SHAPES, step_cases  # noqa: E402

CORES = sorted(os.sched_getaffinity(0))


def on(threads: int) -> None:
    os.sched_setaffinity(0, CORES[:threads])
    torch.set_num_threads(threads)


if __name__ == "__main__":
    on(1)
    model = load_model("models/tiny-target", attention="paged")
    kv = PagedKVCache.for_model(model.config, 64 << 20, block_size=16, dtype=torch.float32, device="cpu")
    m0, t0 = anonymous_mib(), time.perf_counter()
    step = capture_for(model, kv, "auto", "target", max_query_len=5)
    one_s, m1, g1 = time.perf_counter() - t0, anonymous_mib(), compiled_graphs()
    on(2)
    t0 = time.perf_counter()
    step.warm_up(kv)
    two_s, m2, g2 = time.perf_counter() - t0, anonymous_mib(), compiled_graphs()
    times = {(n, shape): [] for n in (1, 2) for shape in SHAPES}
    with torch.inference_mode():
        cases = step_cases(model, kv)
        for _ in range(12):
            for n in (1, 2):
                on(n)
                for i in range(25):
                    for shape, meta, tokens, rows in cases:
                        t0 = time.perf_counter()
                        step(tokens, meta, kv.kv, rows)
                        if i >= 5:
                            times[(n, shape)].append(time.perf_counter() - t0)
    print(f"one thread: {g1} graph(s) in {one_s:.1f} s, +{m1 - m0:.0f} MiB; "
          f"two threads: {g2 - g1} more in {two_s:.1f} s, +{m2 - m1:.0f} MiB")
    print("  ".join(f"t{n}b{b}q{q} {1e3 * statistics.median(times[(n, (b, q))]):.3f}"
                    for n in (1, 2) for b, q in SHAPES), "ms; graphs in all:", compiled_graphs())
