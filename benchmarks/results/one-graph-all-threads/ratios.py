"""New over base from a `threads.py` log (default: threads.txt in this folder): per round, each (thread count, shape)'s median
step on new over base's, then the median and spread of those ratios over the rounds; and each
side's compile seconds and memory at two threads.

    python benchmarks/results/one-graph-all-threads/ratios.py [LOG]
"""
import re
import statistics
import sys
from pathlib import Path

rounds: dict[str, dict[str, dict]] = {}
side = None
log = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "threads.txt"
for line in log.read_text().splitlines():
    if m := re.match(r"== (\d+) (\w+)", line):
        side = rounds.setdefault(m[1], {}).setdefault(m[2], {})
    elif m := re.match(r"one thread: .* in ([\d.]+) s, \+(\d+) MiB; two threads: (\d+) more in ([\d.]+) s, \+(\d+) MiB", line):
        side.update(one_s=float(m[1]), two_graphs=int(m[3]), two_s=float(m[4]), two_mib=int(m[5]))
    elif line.startswith("t1"):
        side["steps"] = {k: float(v) for k, v in re.findall(r"(t\d+b\d+q\d+) ([\d.]+)", line)}
shapes = list(next(iter(rounds.values()))["base"]["steps"])
print(f"{len(rounds)} rounds; new over base, median (spread):")
for shape in shapes:
    r = [s["new"]["steps"][shape] / s["base"]["steps"][shape] for s in rounds.values()]
    print(f"  {shape}: {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})")
for name in ("base", "new"):
    sides = [s[name] for s in rounds.values()]
    print(f"{name}: graphs added at two threads {sorted({s['two_graphs'] for s in sides})}, "
          f"seconds {statistics.median(s['two_s'] for s in sides):.1f} (median), "
          f"memory +{min(s['two_mib'] for s in sides)}-{max(s['two_mib'] for s in sides)} MiB; "
          f"one thread: {statistics.median(s['one_s'] for s in sides):.1f} s (median)")
