"""The bundled target's linear layers (all 32, one after another as in a forward), timed with
MKL's F.linear and with the packed oneDNN kernel at 1 and 2 threads (this process on the
cores the thread count needs), best of 30 in turns; and the verdicts the kernel cache holds
for each thread count (`backend.model.linear`: True where the packed kernel was chosen, by
ROW_LADDER rung).

    python benchmarks/results/lent-kernels/kernels.py
"""
import json
import os
import time

import torch
import torch.nn.functional as F

import backend.model.linear as L
from backend.model.loader import load_model

ROWS = (1, 4, 8, 16, 32, 64)

model = load_model("models/tiny-target")
layers = [m for m in model.modules() if isinstance(m, L.Linear)]
for lin in layers:
    lin.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)
cores = sorted(os.sched_getaffinity(0))
print(f"{len(layers)} layers; ROW_LADDER {L.ROW_LADDER}")
with torch.inference_mode():
    for threads in (1, 2):
        os.sched_setaffinity(0, cores[:threads])
        torch.set_num_threads(threads)
        f = L._cache_file(layers)
        print(f"{threads} thread(s): cached verdicts {json.loads(f.read_text()) if f.exists() else None}")
        for rows in ROWS:
            xs = {lin.in_features: torch.randn(rows, lin.in_features) for lin in layers}
            kernels = (lambda: [F.linear(xs[lin.in_features], lin.weight, lin.bias) for lin in layers],
                       lambda: [torch.ops.mkldnn._linear_pointwise(xs[lin.in_features], lin.packed, lin.bias,
                                                                    "none", [], "") for lin in layers])
            best = [float("inf")] * 2
            for k in kernels:
                k()
            for _ in range(30):
                for i, k in enumerate(kernels):
                    t0 = time.perf_counter()
                    k()
                    best[i] = min(best[i], time.perf_counter() - t0)
            print(f"  {rows:3d} rows: MKL {1e3 * best[0]:.3f} ms, packed {1e3 * best[1]:.3f} ms")
os.sched_setaffinity(0, cores)
