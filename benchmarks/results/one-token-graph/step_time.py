"""The bundled target's frozen compiled step on one core and one thread: the graphs compiled and
the time it took, then the median step (ms) at each (batch, tokens a sequence), 300 steps after
30, the shapes in turns, contexts of 150 tokens. Run from the checkout to measure, in a fresh
process:

    cd CHECKOUT && TORCHINDUCTOR_CACHE_DIR=DIR PYTHONPATH=$PWD python $REPO/benchmarks/results/one-token-graph/step_time.py
"""
import os
import statistics
import time

import torch

from backend.model.captured import compiled_graphs
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for

SHAPES = [(1, 1), (4, 1), (16, 1), (4, 5)]      # decode at 1, 4, 16; verification of 4 drafts at 4


def step_cases(model, kv, shapes=SHAPES):
    """For each of `shapes`, in `kv`: (shape, its metadata, tokens, logits rows), contexts of 150
    tokens. Call in inference mode, as the engine's step runs (tensors of another kind compile
    again)."""
    cases = []
    for b, q in shapes:
        ids = [f"s{b}_{q}_{i}" for i in range(b)]
        for sid in ids:
            kv.ensure_capacity(sid, 200)
        meta = model.prepare(kv, ids, [150] * b, [q] * b)
        cases.append(((b, q), meta, torch.zeros(b * q, dtype=torch.long), meta.last_token_indices))
    return cases


def time_shapes(model, kv, step, shapes=SHAPES, rounds=330, skip=30) -> dict:
    """{shape: the step's seconds in each round after the first `skip`}, the shapes in turns."""
    times = {shape: [] for shape in shapes}
    with torch.inference_mode():     # as the engine's step (tensors of another kind compile again)
        cases = step_cases(model, kv, shapes)
        for i in range(rounds):
            for shape, meta, tokens, rows in cases:
                t0 = time.perf_counter()
                step(tokens, meta, kv.kv, rows)
                if i >= skip:
                    times[shape].append(time.perf_counter() - t0)
    return times

if __name__ == "__main__":
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    torch.set_num_threads(1)
    model = load_model("models/tiny-target", attention="paged")
    kv = PagedKVCache.for_model(model.config, 64 << 20, block_size=16, dtype=torch.float32, device="cpu")
    t0 = time.perf_counter()
    step = capture_for(model, kv, "auto", "target", max_query_len=5)
    print(f"compiled {compiled_graphs()} graph(s) in {time.perf_counter() - t0:.1f} s")
    times = time_shapes(model, kv, step)
    print("  ".join(f"b{b}q{q} {1e3 * statistics.median(times[(b, q)]):.3f}" for b, q in SHAPES),
          f"ms; graphs in all: {compiled_graphs()}")
