"""A prompt's forward op by op against the same forward through the captured (compiled) step:
one prompt of each length, fed whole to an empty sequence, at one thread and at two (the
drafter's lent cores), the two ways in turns in one process, 12 measured rounds after 2; prints
the median ms of each, their ratio, the largest logit difference and the graphs compiled after
the build (0: no prompt length compiled the step again).

    python benchmarks/results/captured-prompts/prefill.py                       # the target (frozen)
    python benchmarks/results/captured-prompts/prefill.py --role drafter --model models/tiny-drafter
"""
import argparse
import statistics
import time

import torch

from backend.model.captured import compiled_graphs
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import capture_for

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="models/tiny-target")
parser.add_argument("--role", default="target", choices=["target", "drafter"])
parser.add_argument("--lengths", default="10,26,61,104,211,376,600,1000")
args = parser.parse_args()
lengths = [int(x) for x in args.lengths.split(",")]

torch.set_num_threads(1)          # as the engine builds its steps
model = load_model(args.model, attention="paged")
kv = PagedKVCache.for_model(model.config, 64 << 20, block_size=16)
with torch.inference_mode():
    step = capture_for(model, kv, "on", args.role, 9)     # gamma_max 8, as the engine's default
built = compiled_graphs()
times, logits = {}, {}
with torch.inference_mode():
    for rnd in range(14):
        for n in lengths:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for way in ("eager", "captured") if rnd % 2 else ("captured", "eager"):
                    assert kv.ensure_capacity("p", n)
                    t0 = time.perf_counter()
                    meta = model.prepare(kv, ["p"], [0], [n], 0)
                    ids = torch.arange(5, 5 + n)
                    fn = model if way == "eager" else step
                    out = fn(ids, meta, kv.kv, meta.last_token_indices)
                    seconds = time.perf_counter() - t0
                    kv.free("p")
                    if rnd >= 2:
                        times.setdefault((n, threads, way), []).append(seconds)
                    else:
                        logits[(n, threads, way)] = out.clone()
print(f"{args.role} ({args.model}); graphs compiled after the build: {compiled_graphs() - built}")
for n in lengths:
    for t in (1, 2):
        e, c = (1e3 * statistics.median(times[(n, t, w)]) for w in ("eager", "captured"))
        diff = (logits[(n, t, "eager")] - logits[(n, t, "captured")]).abs().max().item()
        print(f"{n:5d} tokens, {t} thread(s): op by op {e:7.2f} ms, captured {c:7.2f} ms, "
              f"captured / op by op {c / e:.2f}, max |logit diff| {diff:.1e}")
