"""Auto's plain decode steps on the lent cores (two threads, batch 4, no prompts) by their
position in the run of lent plain steps they belong to: the median target forward over
`ar-2dev`'s median at batch 4 in the same trace (engine 0 auto, engine 1 ar-2dev), positions
9 and later together:

    python benchmarks/results/lent-kernels/lent_position.py benchmarks/results/lent-kernels/traces/tr-*.jsonl.gz
"""
import gzip
import json
import statistics
import sys
from collections import defaultdict

LAST = 9


def plain_decode(r: dict, batch: int = 4) -> bool:
    return r["mode"] == "ar" and r["decode_tokens"] and not r["num_prefill_tokens"] and r["batch_size"] == batch


if __name__ == "__main__":
    for name in sys.argv[1:]:
        with gzip.open(name, "rt") as f:
            rows = [json.loads(line) for line in f]
        reference = statistics.median(1e3 * r["t_forward_s"] for r in rows if r["engine"] == 1 and plain_decode(r))
        by_position = defaultdict(list)
        position = 0
        for r in rows:
            if r["engine"] != 0:
                continue
            lent = r["threads"] == 2 and r["mode"] == "ar"
            position = position + 1 if lent else 0
            if lent and plain_decode(r):
                by_position[min(position, LAST)].append(1e3 * r["t_forward_s"] / reference)
        cells = [f"{p}{'+' if p == LAST else ''}: {statistics.median(v):.3f} (n={len(v)})"
                 for p, v in sorted(by_position.items())]
        print(f"{name.rsplit('/', 1)[-1]}: ar-2dev {reference:.3f} ms; " + "  ".join(cells))
