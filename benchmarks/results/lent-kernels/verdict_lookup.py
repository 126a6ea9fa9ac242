"""What the per-thread-count verdicts add to an op-by-op forward: the bundled target's 32 linear
layers at 4 rows on one thread, with one verdict (`_by_threads` empty, as in an engine without a
CPU drafter) and with a second thread count's verdicts beside it (the lookup of the thread count
in force on every layer), both on the same kernel choice. Medians of 2,000 in turns.

    python benchmarks/results/lent-kernels/verdict_lookup.py
"""
import os
import statistics
import time

import torch

import backend.model.linear as L
from backend.model.loader import load_model

os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
torch.set_num_threads(1)
model = load_model("models/tiny-target")
layers = [m for m in model.modules() if isinstance(m, L.Linear)]
for lin in layers:
    lin.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)
    lin._use_packed = (True,) * len(L.ROW_LADDER)
xs = {lin.in_features: torch.randn(4, lin.in_features) for lin in layers}
times = {"one verdict": [], "two thread counts": []}
with torch.inference_mode():
    for i in range(2200):
        for name, extra in (("one verdict", {}), ("two thread counts", {2: (True,) * len(L.ROW_LADDER)})):
            for lin in layers:
                lin._by_threads = extra
            t0 = time.perf_counter()
            for lin in layers:
                lin(xs[lin.in_features])
            if i >= 200:
                times[name].append(time.perf_counter() - t0)
for name, v in times.items():
    print(f"{name}: {1e6 * statistics.median(v):.1f} us for 32 layers")
