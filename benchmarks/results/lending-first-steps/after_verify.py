"""Does the frozen target's plain decode step at batch 16 cost more right after a verification
step (7 tokens a sequence) or right after a step on two threads and both cores, in one process?
Prints, for the 8 steps after each (and after plain steps), the median ms and page faults a step,
20 rounds. From the checkout: `PYTHONPATH=$PWD python
benchmarks/results/lending-first-steps/after_verify.py` (output: `after_verify.txt`)."""
import os, statistics, time, resource
import torch
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for

CORES = sorted(os.sched_getaffinity(0))
def on(n, pin=True):
    os.sched_setaffinity(0, CORES[:n] if pin else CORES)
    torch.set_num_threads(n)

def case(model, kv, b, q, tag, all_rows):
    ids = [f"{tag}{i}" for i in range(b)]
    for sid in ids: kv.ensure_capacity(sid, 200)
    meta = model.prepare(kv, ids, [150] * b, [q] * b)
    rows = torch.arange(b * q) if all_rows else meta.last_token_indices
    return meta, torch.zeros(b * q, dtype=torch.long), rows

def minflt(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

on(1)
model = load_model("models/tiny-target", attention="paged")
kv = PagedKVCache.for_model(model.config, 64 << 20, block_size=16, dtype=torch.float32, device="cpu")
step = capture_for(model, kv, "auto", "target", max_query_len=8)
res = {}
with torch.inference_mode():
    dec = case(model, kv, 16, 1, "d", False)
    ver = case(model, kv, 16, 7, "v", True)
    def run(c): step(c[1], c[0], kv.kv, c[2])
    on(2); run(dec); run(ver); on(1)
    for _ in range(5): run(dec); run(ver)
    for rep in range(20):
        for kind in ("plain", "after_verify", "after_lent"):
            on(1)
            if kind == "after_verify": run(ver)
            if kind == "after_lent": on(2, pin=False); run(dec); on(1)
            for k in range(8):
                f0 = minflt(); t0 = time.perf_counter(); run(dec); dt = time.perf_counter() - t0
                res.setdefault((kind, k), []).append((dt, minflt() - f0))
for kind in ("plain", "after_verify", "after_lent"):
    print(kind, "  ".join(f"{k}:{1e3*statistics.median(d for d, _ in res[(kind,k)]):.3f}/{statistics.median(f for _, f in res[(kind,k)]):.0f}"
                          for k in range(8)))
