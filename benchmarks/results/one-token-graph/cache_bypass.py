"""Why every start compiles the frozen target again: compiles the bundled target's step as the
engine does (frozen, one core) and prints the seconds and inductor's cache counters. Run it
twice with the same cache; with `TORCH_LOGS=+inductor` the log names the bypass's reason
("mkldnn tensors unpickleable": the weights freezing pre-packs for oneDNN cannot be stored):

    TORCHINDUCTOR_CACHE_DIR=DIR TORCH_LOGS=+inductor python benchmarks/results/one-token-graph/cache_bypass.py 2>&1 | grep -i bypass
"""
import os
import time

import torch
from torch._dynamo.utils import counters

from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for

if __name__ == "__main__":
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    torch.set_num_threads(1)
    model = load_model("models/tiny-target", attention="paged")
    kv = PagedKVCache.for_model(model.config, 8 << 20, block_size=16)
    t0 = time.perf_counter()
    capture_for(model, kv, "auto", "target", max_query_len=5)
    inductor = counters["inductor"]
    print(f"compiled in {time.perf_counter() - t0:.1f} s; FX graph cache: hits {inductor['fxgraph_cache_hit']}, "
          f"misses {inductor['fxgraph_cache_miss']}, bypasses {inductor['fxgraph_cache_bypass']}")
