"""From `compiled_threads.txt` (what `compiled_threads.py` printed, each form in turn): per form
and batch, two threads' step time over one thread's, round by round.

    python benchmarks/results/lent-kernels/compiled_threads_ratios.py benchmarks/results/lent-kernels/compiled_threads.txt
"""
import re
import sys
from collections import defaultdict

ratios = defaultdict(list)      # (form, batch) -> ratios
form = None
for line in open(sys.argv[1]):
    m = re.match(r"compiled on (\d) thread\(s\)( \(dynamic threads\))?", line)
    if m:
        form = f"compiled at {m[1]}" + (", dynamic threads" if m[2] else "")
    m = re.match(r"batch +(\d+): one thread ([\d.]+) ms, two threads ([\d.]+) ms", line)
    if m:
        ratios[(form, int(m[1]))].append(float(m[3]) / float(m[2]))
for (form, batch), v in ratios.items():
    print(f"{form:32s} batch {batch:2d}: two threads / one thread " + ", ".join(f"{r:.3f}" for r in v))
