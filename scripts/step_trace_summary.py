#!/usr/bin/env python3
"""Sum up the per-step traces an engine writes with NIGHTDRAFT_STEP_TRACE set
(backend/engine/step_trace.py): for each kind of decode step, by batch size, how many there were
and the median milliseconds a step, a committed token and a forward, the median batch and
context a sequence (two traces' steps in one bucket can differ in both), with the threads and
cores they ran on.

    .venv/bin/python scripts/step_trace_summary.py FOLDER_OR_FILE [...] [--json PATH]

Rows are per process and engine (a folder holds a file per process: a server's stub has one
engine; a process that builds several, a benchmark's configurations in process, numbers them
from 0). A kind is the mode that ran and the step's
placement of the target's thread (`step_trace.where`: none, pinned, open, lent). A forward that
borrows the drafter's cores for its own time inside a pinned step (`PlainDecoding.alongside`)
shows as pinned, its `forward_cores` in the file. The batch buckets are the planner's bins
(`planner.contexts.batch_bin`), so a row reads beside the planner's `per_context` summary.
Steps that fed only prompts are left out: their cost is the prompt's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from planner.contexts import batch_bin  # noqa: E402


def label(batches: tuple[int, int]) -> str:
    """A batch bin's name: "1", "2-3", ..."""
    lo, hi = batches
    return str(lo) if lo == hi else f"{lo}-{hi}"


def read(paths: list[Path]) -> list[dict]:
    steps = []
    for p in paths:
        for f in sorted(p.glob("steps-*.jsonl")) if p.is_dir() else [p]:
            lines = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            # lines written before they carried the process id and the engine's number: the
            # file's name has the process id, and such a process traced one engine
            pid = f.stem.removeprefix("steps-")
            for s in lines:
                if "pid" not in s and pid.isdigit():
                    s["pid"] = int(pid)
                s.setdefault("engine", 0)
            steps += lines
    return steps


def summarize(steps: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in steps:
        if s["num_forward_tokens"] > s["num_prefill_tokens"]:       # it decoded
            groups[(s["pid"], s["engine"], s["mode"], s["placement"], batch_bin(s["batch_size"]))].append(s)
    rows = []
    for (pid, engine, mode, where, batches), group in sorted(groups.items()):
        rows.append({
            "pid": pid, "engine": engine, "mode": mode, "placement": where, "batch": label(batches), "steps": len(group),
            # a bucket's batches and contexts can differ between two traces: the same bucket,
            # a different load
            "batch_median": statistics.median(s["batch_size"] for s in group),
            "context_per_seq": statistics.median(s["num_context_tokens"] / s["batch_size"] for s in group),
            "ms_per_step": 1e3 * statistics.median(s["t_cycle_s"] for s in group),
            "ms_per_token": 1e3 * statistics.median(s["t_cycle_s"] / max(s["tokens_committed"], 1) for s in group),
            "forward_ms": 1e3 * statistics.median(s["t_forward_s"] for s in group),
            "threads": sorted({s["threads"] for s in group}),
            "cores": [list(c) for c in sorted({tuple(s["cores"]) for s in group})],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args(argv)
    steps = read(args.paths)
    if not steps:
        print("no steps in " + ", ".join(map(str, args.paths)), file=sys.stderr)
        return 1
    rows = summarize(steps)
    print(f"{len(steps)} steps; decode steps by process, engine, mode, placement and batch (medians):")
    print(f"{'pid':>7} {'engine':>6} {'mode':6} {'where':7} {'batch':>6} {'median':>6} {'ctx/seq':>7} {'steps':>6} "
          f"{'ms/step':>8} {'ms/token':>9} {'forward':>8}  threads cores")
    for r in rows:
        print(f"{r['pid']:>7} {r['engine']:>6} {r['mode']:6} {r['placement']:7} {r['batch']:>6} {r['batch_median']:6.1f} "
              f"{r['context_per_seq']:7.0f} {r['steps']:>6} {r['ms_per_step']:8.2f} "
              f"{r['ms_per_token']:9.3f} {r['forward_ms']:8.2f}  {r['threads']} {r['cores']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
