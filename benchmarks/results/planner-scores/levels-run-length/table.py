"""The two `bench levels` runs of this folder side by side: the table `bench levels` prints for
each, and auto's steps by arm in each of its runs.

    python benchmarks/results/planner-scores/levels-run-length/table.py
"""
import json
from pathlib import Path

from client.bench_levels import format_table, summarise

for path in sorted(Path(__file__).parent.glob("requests-per-level-*.json"), key=lambda p: int(p.stem.split("-")[-1])):
    runs = json.loads(path.read_text())["runs"]
    print(f"== {path.name}")
    print(format_table(summarise(runs)))
    for r in runs:
        if r["config"] == "auto":
            rep = "warm-up" if r.get("warmup") else r["repeat"] + 1
            print(f"  auto c={r['concurrency']:<3} [{rep}] {r['tokens_per_s']:7.0f} tok/s  {r.get('arm_steps')}")
