"""How much of a start's compile a cache hit would spare: compiles the bundled target's frozen
step as the engine does (one core), but without pre-packing its weights for oneDNN
(`cpp.weight_prepack` off), the one form of it inductor's graph cache stores, and prints the
seconds and the cache's counters. Run it twice with the same cache (the second run hits):

    TORCHINDUCTOR_CACHE_DIR=DIR python benchmarks/results/trace-once/cache_hit.py
"""
import os
import time

import torch
from torch._dynamo.utils import counters

from backend.model.captured import CompiledStep
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model

if __name__ == "__main__":
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    torch.set_num_threads(1)
    model = load_model("models/tiny-target", attention="paged")
    kv = PagedKVCache.for_model(model.config, 8 << 20, block_size=16)
    step = CompiledStep(model, max_query_len=5, freeze=True)
    step._config = torch._inductor.config.patch({"freezing": True, "cpp.weight_prepack": False})
    t0 = time.perf_counter()
    step.warm_up(kv)
    inductor = counters["inductor"]
    print(f"compiled in {time.perf_counter() - t0:.1f} s; FX graph cache: hits {inductor['fxgraph_cache_hit']}, "
          f"misses {inductor['fxgraph_cache_miss']}, bypasses {inductor['fxgraph_cache_bypass']}")
