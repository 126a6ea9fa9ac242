"""The bundled target's frozen compiled step (as an engine builds it): the graphs compiled and
the anonymous memory the process gained, first at one thread (the target beside a CPU drafter)
then at two (plain decoding on the drafter's lent cores, which compiles again: the compiler
guards on the thread count). Run from the checkout to measure, in a fresh process:

    cd CHECKOUT && TORCHINDUCTOR_CACHE_DIR=DIR PYTHONPATH=$PWD python $REPO/benchmarks/results/one-token-graph/memory.py
"""
import gc
import os

import torch

from backend.model.captured import compiled_graphs
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for


def anonymous_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


if __name__ == "__main__":
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    torch.set_num_threads(1)
    model = load_model("models/tiny-target", attention="paged")
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    kv = PagedKVCache.for_model(model.config, 8 << 20, block_size=16)
    before = anonymous_mib()
    step = capture_for(model, kv, "auto", "target", max_query_len=5)
    one = anonymous_mib()
    graphs_one = compiled_graphs()
    os.sched_setaffinity(0, cores[:2])
    torch.set_num_threads(2)
    step.warm_up(kv)
    two = anonymous_mib()
    print(f"weights {weights:.1f} MiB; one thread: {graphs_one} graph(s), +{one - before:.0f} MiB; "
          f"two threads: {compiled_graphs() - graphs_one} more, +{two - one:.0f} MiB; "
          f"in all +{two - before:.0f} MiB")
