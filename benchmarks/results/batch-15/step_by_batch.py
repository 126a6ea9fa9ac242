"""The bundled target's frozen compiled step on one core and one thread, by batch size around 16
(one token a sequence, contexts of 150 tokens): the median step (ms) and per sequence, 200 steps
after 20, the batch sizes in turns. From the checkout:

    PYTHONPATH=$PWD python benchmarks/results/batch-15/step_by_batch.py
"""
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "one-token-graph"))
import step_time  # noqa: E402

from backend.model.kv_cache import PagedKVCache  # noqa: E402
from backend.model.loader import load_model  # noqa: E402
from backend.model.runner import capture_for  # noqa: E402

SHAPES = [(b, 1) for b in (8, 12, 13, 14, 15, 16, 17, 20, 24)]

if __name__ == "__main__":
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    torch.set_num_threads(1)
    model = load_model("models/tiny-target", attention="paged")
    kv = PagedKVCache.for_model(model.config, 512 << 20, block_size=16, dtype=torch.float32, device="cpu")
    step = capture_for(model, kv, "auto", "target", max_query_len=5)
    for (b, _), ts in step_time.time_shapes(model, kv, step, SHAPES, rounds=220, skip=20).items():
        ms = 1e3 * statistics.median(ts)
        print(f"batch {b:3d}: {ms:6.2f} ms a step, {ms / b:.3f} ms a sequence")
