"""Each forced arm's score over its run's cost (ms a token), by concurrency, from forced-c*.txt
(forced_arms.py's output): the medians and ranges over rounds, and the share of the run in its
decoding steps.

    python benchmarks/results/planner-scores/summary.py
"""
import re
import statistics
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"\[\d+\] (\S+)\s+run ([\d.]+) ms/token .*score ([\d.]+) ms/token \| decoding steps ([\d.]+) of the run")

for path in sorted(Path(__file__).parent.glob("forced-c*.txt"), key=lambda p: int(p.stem[8:])):
    ratios, shares, runs = defaultdict(list), defaultdict(list), defaultdict(list)
    for line in path.read_text().splitlines():
        m = LINE.search(line)
        if m:
            arm, run, score, share = m.group(1), float(m.group(2)), float(m.group(3)), float(m.group(4))
            ratios[arm].append(score / run)
            shares[arm].append(share)
            runs[arm].append(run)
    print(f"concurrency {path.stem[8:]}:")
    for arm in ratios:
        r = ratios[arm]
        print(f"  {arm:<6} run {statistics.median(runs[arm]):.3f} ms/token; score / run {statistics.median(r):.2f} "
              f"({min(r):.2f}-{max(r):.2f}); decoding steps {statistics.median(shares[arm]):.2f} of the run")
