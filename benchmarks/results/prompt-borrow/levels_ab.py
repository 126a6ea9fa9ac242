"""A fixed speculative configuration over plain decoding on both cores in `bench levels` runs of
each side (a folder of base<n>.json and new<n>.json): per concurrency and side, the median ratio
of the two configurations' tokens/s at full load over every measured repeat (and its spread),
the speculative configuration's median tokens/s and both mean request latencies.

    python benchmarks/results/prompt-borrow/levels_ab.py benchmarks/results/prompt-borrow/levels-ab
    python benchmarks/results/prompt-borrow/levels_ab.py benchmarks/results/prompt-borrow/psd-levels-ab psd
"""
import glob
import json
import re
import statistics
import sys
from collections import defaultdict

folder = sys.argv[1]
spec = sys.argv[2] if len(sys.argv) > 2 else "sd"
rows = defaultdict(list)   # (side, conc, config, run) -> [(tok, whole, lat)]
runs = set()
for f in sorted(glob.glob(folder + "/*.json")):
    side, n = re.match(r".*/(base|new)(\d+)\.json", f).groups()
    runs.add(n)
    d = json.load(open(f))
    for r in d["runs"]:
        if r.get("warmup"): continue
        rows[(side, r["concurrency"], r["config"], n)].append((r["tokens_per_s"], r["tokens_per_s_whole_run"], r["mean_latency_s"]))
for conc in (1, 4):
    for side in ("base", "new"):
        ratios = []; sp_tok = []; sp_lat = []; ar_lat = []
        for n in sorted(runs, key=int):
            sp = rows.get((side, conc, spec, n)); ar = rows.get((side, conc, "ar-2dev", n))
            if not sp: continue
            ratios += [s[0] / a[0] for s, a in zip(sp, ar)]
            sp_tok += [s[0] for s in sp]; sp_lat += [s[2] for s in sp]; ar_lat += [a[2] for a in ar]
        print(f"c={conc} {side}: {spec}/ar-2dev median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} repeats); "
              f"{spec} tok/s median {statistics.median(sp_tok):.0f}; mean latency {spec} {statistics.median(sp_lat)*1e3:.0f} ms, ar-2dev {statistics.median(ar_lat)*1e3:.0f} ms")
