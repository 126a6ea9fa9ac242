#!/usr/bin/env python3
"""ab_c16.py's result files summarised: auto and auto-off over ar-2dev run by run (median and
quartiles), the shifts detected and the speculative steps played (ab-c16-2.json only).

    python benchmarks/results/planner-scores/common-cost/ab_summary.py     # ab_summary.txt
"""
import json
import statistics
from pathlib import Path

here = Path(__file__).parent
for f in sorted(here.glob("ab-c16-*.json")):
    res = json.loads(f.read_text())
    print(f"{f.name}: {len(res['ar-2dev'])} runs a configuration")
    for n in ("auto", "auto-off"):
        rs = [a["tok_s"] / b["tok_s"] for a, b in zip(res[n], res["ar-2dev"])]
        q = statistics.quantiles(rs, n=4)
        spec = [a["spec"] for a in res[n] if "spec" in a]
        print(f"  {n:8s} / ar-2dev: median {statistics.median(rs):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}), "
              f"shifts {sum(a['shifts'] for a in res[n])}"
              + (f", speculative steps {sum(spec)} in {sum(s > 0 for s in spec)} runs" if spec else ""))
