"""Eager forward of the bundled target (no packed weights: this host's verdicts), b1 and b16 decode."""
import os, statistics, sys, time, torch
sys.path.insert(0, "benchmarks/results/one-token-graph")
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from step_time import step_cases
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1]); torch.set_num_threads(1)
model = load_model("models/tiny-target", attention="paged")
kv = PagedKVCache.for_model(model.config, 64 << 20, block_size=16, dtype=torch.float32, device="cpu")
t = {}
with torch.inference_mode():
    cases = step_cases(model, kv)
    fwd = model.forward
    for i in range(130):
        for shape, meta, tokens, rows in cases:
            t0 = time.perf_counter(); fwd(tokens, meta, kv.kv, rows)
            if i >= 30: t.setdefault(shape, []).append(time.perf_counter() - t0)
print(" ".join(f"b{b}q{q} {1e3*statistics.median(v):.3f}" for (b, q), v in t.items()), "ms")
