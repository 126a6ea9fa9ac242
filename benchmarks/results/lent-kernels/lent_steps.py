"""Plain decoding's steps on two threads in step traces of `bench levels --configs auto,ar-2dev`
(engine 0 auto, engine 1 ar-2dev): per trace and batch size, the median target forward and step
cycle of each engine's plain steps without prompts, and auto's over ar-2dev's.

    python lent_steps.py traces/*.jsonl.gz   (engine 0 and 1 in each trace: auto, ar-2dev)
"""
import gzip
import json
import statistics
import sys
from collections import defaultdict

NAMES = {0: "auto", 1: "ar-2dev"}
for name in sys.argv[1:]:
    steps = defaultdict(list)       # (engine, batch) -> (forward, cycle) in ms
    with gzip.open(name, "rt") as f:
        for line in f:
            r = json.loads(line)
            if (r["mode"] == "ar" and r["decode_tokens"] and not r["num_prefill_tokens"]
                    and r["threads"] == 2 and r["batch_size"] in (4, 16)):
                steps[(r["engine"], r["batch_size"])].append((1e3 * r["t_forward_s"], 1e3 * r["t_cycle_s"]))
    print(name)
    for batch in (4, 16):
        med = {}
        for e in (0, 1):
            v = steps.get((e, batch), [])
            if v:
                med[e] = (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), len(v))
        cells = [f"{NAMES[e]} forward {m[0]:.3f} cycle {m[1]:.3f} ms ({m[2]} steps)" for e, m in med.items()]
        if len(med) == 2:
            cells.append(f"auto / ar-2dev: forward {med[0][0] / med[1][0]:.3f}, cycle {med[0][1] / med[1][1]:.3f}")
        print(f"  batch {batch:2d}: " + "; ".join(cells))
