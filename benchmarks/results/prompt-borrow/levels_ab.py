"""Fixed SD over plain decoding on both cores in `bench levels` runs of each side (levels-ab/):
per concurrency and side, the median ratio of the two configurations' tokens/s at full load over
every measured repeat (and its spread), SD's median tokens/s and both mean request latencies.

    python benchmarks/results/prompt-borrow/levels_ab.py benchmarks/results/prompt-borrow/levels-ab
"""
import glob
import json
import re
import statistics
import sys
from collections import defaultdict
rows = defaultdict(list)   # (side, conc, config) -> [(tok, whole, lat)]
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    side, n = re.match(r".*/(base|new)(\d+)\.json", f).groups()
    d = json.load(open(f))
    for r in d["runs"]:
        if r.get("warmup"): continue
        rows[(side, r["concurrency"], r["config"], n)].append((r["tokens_per_s"], r["tokens_per_s_whole_run"], r["mean_latency_s"]))
for conc in (1, 4):
    for side in ("base", "new"):
        ratios = []; sd_tok = []; sd_lat = []; ar_lat = []
        for n in map(str, range(1, 6)):
            sd = rows.get((side, conc, "sd", n)); ar = rows.get((side, conc, "ar-2dev", n))
            if not sd: continue
            ratios += [s[0] / a[0] for s, a in zip(sd, ar)]
            sd_tok += [s[0] for s in sd]; sd_lat += [s[2] for s in sd]; ar_lat += [a[2] for a in ar]
        print(f"c={conc} {side}: sd/ar-2dev median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} repeats); "
              f"sd tok/s median {statistics.median(sd_tok):.0f}; mean latency sd {statistics.median(sd_lat)*1e3:.0f} ms, ar-2dev {statistics.median(ar_lat)*1e3:.0f} ms")
