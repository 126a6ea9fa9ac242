"""The bundled target's compiled decode step (backend.model.captured.CompiledStep), compiled
with this process on one core and one thread (as an engine beside a CPU drafter builds its
target; `--compile-threads 2`: on both, as plain decoding on every core does), then timed at batch 4 and 16 on one thread (one core) and on two threads (both cores:
plain decoding on the drafter's lent cores). `--dynamic-threads` compiles with inductor's
`cpp.dynamic_threads` (its loops decide their threads when they run, not when compiled).
Medians of 200 steps after 20, in turns. Run each form in a fresh process with its own
compile cache:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/results/lent-kernels/compiled_threads.py \
        [--dynamic-threads] [--compile-threads 2]
"""
import os
import statistics
import sys
import time

import torch

from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for

dynamic = "--dynamic-threads" in sys.argv
at = int(sys.argv[sys.argv.index("--compile-threads") + 1]) if "--compile-threads" in sys.argv else 1
cores = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, cores[:at])
torch.set_num_threads(at)
model = load_model("models/tiny-target", attention="paged")
kv = PagedKVCache.for_model(model.config, 64 << 20, block_size=16, dtype=torch.float32, device="cpu")
if dynamic:
    import torch._inductor.config
    torch._inductor.config.cpp.dynamic_threads = True
t0 = time.perf_counter()
step = capture_for(model, kv, "auto", "target", max_query_len=5)      # frozen, as the engine's target
with torch.inference_mode():
    print(f"compiled on {at} thread(s){' (dynamic threads)' if dynamic else ''} in {time.perf_counter() - t0:.1f} s")
    for batch in (4, 16):
        ids = [f"s{i}" for i in range(batch)]
        for sid in ids:
            kv.ensure_capacity(sid, 200)
        meta = model.prepare(kv, ids, [150] * batch, [1] * batch)
        tokens = torch.zeros(batch, dtype=torch.long)
        rows = torch.arange(batch)
        times = {1: [], 2: []}
        for i in range(220):
            for threads in (1, 2):
                os.sched_setaffinity(0, cores[:threads])
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                step(tokens, meta, kv.kv, rows)
                if i >= 20:
                    times[threads].append(time.perf_counter() - t0)
        for sid in ids:
            kv.free(sid)
        print(f"batch {batch:2d}: one thread {1e3 * statistics.median(times[1]):.3f} ms, "
              f"two threads {1e3 * statistics.median(times[2]):.3f} ms")
os.sched_setaffinity(0, cores)
