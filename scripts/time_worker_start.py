#!/usr/bin/env python3
"""How long a drafter worker takes to start: forked from the fork server, or a fresh interpreter.

    .venv/bin/python scripts/time_worker_start.py [--repeats 5] [--json PATH]

Starts the bundled tiny drafter as a worker (`RemoteDrafter`, on the last core) `--repeats`
times with each start method, alternately, and prints the median and range of the seconds from
the start until the worker reports ready (its weights loaded). The fork server's first start
includes starting the server itself (as an engine's first worker does) and is reported apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def start_once(method: str) -> float:
    import multiprocessing as mp

    from backend.speculation import worker
    from backend.speculation.worker import RemoteDrafter, WorkerSpec

    spec = WorkerSpec(path=str(REPO / "models" / "tiny-drafter"), device="cpu", dtype="float32",
                      kv_cache_bytes=64 << 20, block_size=16, seed=0,
                      cores=[max(os.sched_getaffinity(0))])
    chosen = worker.helper_context
    if method == "spawn":
        worker.helper_context = lambda: mp.get_context("spawn")
    try:
        t0 = time.perf_counter()
        drafter = RemoteDrafter(spec, vocab_size=2048, max_rows=64)
        seconds = time.perf_counter() - t0
    finally:
        worker.helper_context = chosen
    drafter.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    first = start_once("forkserver")          # starts the fork server too
    times: dict[str, list[float]] = {"forkserver": [], "spawn": []}
    for _ in range(args.repeats):
        for method in times:
            times[method].append(start_once(method))
    report = {"date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(),
              "first_forkserver_start_s": round(first, 3),
              "start_s": {m: {"median": round(statistics.median(t), 3), "min": round(min(t), 3),
                              "max": round(max(t), 3), "runs": [round(x, 3) for x in t]}
                          for m, t in times.items()}}
    print(f"first start with the fork server (starting it): {first:.2f} s")
    for m, r in report["start_s"].items():
        print(f"{m:>10}: median {r['median']:.2f} s (range {r['min']:.2f}-{r['max']:.2f}, {args.repeats} starts)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
