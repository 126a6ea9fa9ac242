"""`bench levels` runs of two checkouts (a folder of base<n>.json and new<n>.json): per
concurrency and configuration, each side's median tokens/s at full load over every measured
repeat (its range) and median mean request latency.

    python benchmarks/results/captured-prompts/levels_sides.py benchmarks/results/captured-prompts/levels-ab
"""
import glob
import json
import re
import statistics
import sys
from collections import defaultdict

rows = defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    side = re.match(r".*/(base|new)\d+\.json", f).group(1)
    for r in json.load(open(f))["runs"]:
        if not r.get("warmup"):
            rows[(side, r["concurrency"], r["config"])].append((r["tokens_per_s"], r["mean_latency_s"]))
for conc in sorted({k[1] for k in rows}):
    for config in sorted({k[2] for k in rows if k[1] == conc}):
        cells = []
        for side in ("base", "new"):
            tok = [x[0] for x in rows[(side, conc, config)]]
            lat = [x[1] for x in rows[(side, conc, config)]]
            cells.append(f"{side} {statistics.median(tok):6.0f} tok/s ({min(tok):.0f}-{max(tok):.0f}), "
                         f"latency {1e3 * statistics.median(lat):4.0f} ms")
        print(f"c={conc} {config:8s} " + " | ".join(cells))
