"""The bundled target's frozen compiled step built as an engine builds it (one core, one
thread), then run on two cores and two threads, as plain decoding on the drafter's lent cores
runs it. Prints the graphs compiled, the seconds and the anonymous memory the process gained at
each thread count (the warm-up at two threads compiles a second graph where the compiler guards
on the thread count), then the median step (ms) by thread count and (batch, tokens a sequence):
twelve blocks a thread count in turns, 20 steps of each shape a block after 5, contexts of 150
tokens. Run from the checkout to measure, in a fresh process:

    cd CHECKOUT && TORCHINDUCTOR_CACHE_DIR=DIR PYTHONPATH=$PWD python $REPO/benchmarks/results/one-graph-all-threads/threads.py
"""
import gc
import os
import statistics
import time

import torch

from backend.model.captured import compiled_graphs
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for

SHAPES = [(1, 1), (4, 1), (16, 1), (4, 5)]      # decode at 1, 4, 16; verification of 4 drafts at 4
CORES = sorted(os.sched_getaffinity(0))


def anonymous_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


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
    with torch.inference_mode():     # as the engine's step (tensors of another kind compile again)
        cases = []
        for b, q in SHAPES:
            ids = [f"s{b}_{q}_{i}" for i in range(b)]
            for sid in ids:
                kv.ensure_capacity(sid, 200)
            meta = model.prepare(kv, ids, [150] * b, [q] * b)
            cases.append(((b, q), meta, torch.zeros(b * q, dtype=torch.long), meta.last_token_indices))
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
