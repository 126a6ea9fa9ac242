"""What a start spends compiling the bundled pair's steps as an engine builds them on one core
(the target's frozen, the drafter's not), with the compile cache of earlier runs: the seconds
each took and how many times the tracer went through each (a restart traces the whole step
again). Run from the checkout to measure, in a fresh process:

    cd CHECKOUT && TORCHINDUCTOR_CACHE_DIR=DIR PYTHONPATH=$PWD python $REPO/benchmarks/results/trace-once/start.py
"""
import os
import time

import torch
from torch._dynamo.utils import compilation_time_metrics

from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for


def attempts() -> int:
    """Traces so far, restarts included (dynamo times each as compile_attempt_<n>)."""
    return sum(len(v) for k, v in compilation_time_metrics.items() if k.startswith("compile_attempt_"))


if __name__ == "__main__":
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    torch.set_num_threads(1)
    parts = []
    for role, path in (("target", "models/tiny-target"), ("drafter", "models/tiny-drafter")):
        model = load_model(path, attention="paged")
        kv = PagedKVCache.for_model(model.config, 8 << 20, block_size=16)
        before, t0 = attempts(), time.perf_counter()
        capture_for(model, kv, "auto", role, max_query_len=5)
        parts.append(f"{role} {time.perf_counter() - t0:.1f} s, {attempts() - before} trace(s)")
    print("; ".join(parts))
