"""Plain decoding's forward by its position after the last drafting step, from a step trace
(`NIGHTDRAFT_STEP_TRACE`): steps at batch 5-10 that fed no prompt, before the first offload
(the drafter on its device, 'on') and after it ('off'), the forward normalised to batch 8.

    python benchmarks/results/offload-settled/turn_off_by_position.py \
        benchmarks/results/offload-settled/trace-steps.jsonl.gz
"""
import collections
import gzip
import json
import statistics
import sys


def main(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        steps = [json.loads(line) for line in f]
    offloaded = next((i for i, r in enumerate(steps) if r["mode"] == "ar" and r["batch_size"] >= 16), len(steps))
    rows = collections.defaultdict(list)
    position = 0
    for i, r in enumerate(steps):
        position = position + 1 if r["mode"] == "ar" and i and steps[i - 1]["mode"] == "ar" else int(r["mode"] == "ar")
        if r["mode"] != "ar" or r["num_prefill_tokens"] or not 5 <= r["batch_size"] <= 10:
            continue
        rows[("on" if i < offloaded else "off", min(position, 9))].append(r["t_forward_s"] / r["batch_size"] * 8)
    for (state, pos), v in sorted(rows.items()):
        label = f"{pos}" if pos < 9 else "9+"
        print(f"drafter {state:3s}, plain step {label:>2s} after drafting: {len(v):3d} steps, "
              f"forward {statistics.median(v) * 1e3:.2f} ms at batch 8 (median)")


if __name__ == "__main__":
    main(sys.argv[1])
