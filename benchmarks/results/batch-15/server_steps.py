#!/usr/bin/env python3
"""Decode steps of a step trace (NIGHTDRAFT_STEP_TRACE) by mode, running batch (16 or more, or
fewer) and whether they fed a prompt: their count and median cycle, step, gap before the next,
forward, scheduling, commit and drafting time (ms). A PSD step's running batch is taken as
twice the sub-batch it verified.

    python benchmarks/results/batch-15/server_steps.py TRACE_FOLDER
"""
from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path


def main(folder: str) -> None:
    for path in sorted(Path(folder).glob("steps-*.jsonl")):
        steps = sorted((json.loads(line) for line in open(path)), key=lambda s: s["t"])
        groups = collections.defaultdict(list)
        for s in steps:
            if s["num_forward_tokens"] <= s["num_prefill_tokens"]:
                continue                           # prompts only
            running = 2 * s["batch_size"] if s["mode"] == "psd" else s["batch_size"]
            groups[(s["mode"], ">=16" if running >= 16 else "<16",
                    "prompt" if s["num_prefill_tokens"] else "-")].append(s)
        print(path.name)
        print(f"  {'mode':4} {'batch':5} {'prompt':6} {'steps':>5} {'cycle':>7} {'step':>7} {'gap':>6}"
              f" {'forward':>7} {'sched':>6} {'commit':>6} {'draft':>6}")
        for (mode, batch, prompt), group in sorted(groups.items()):
            if len(group) < 8:
                continue

            def med(f):
                return 1e3 * statistics.median(f(s) for s in group)
            print(f"  {mode:4} {batch:5} {prompt:6} {len(group):5d} {med(lambda s: s['t_cycle_s']):7.2f}"
                  f" {med(lambda s: s['t_step_s']):7.2f} {med(lambda s: s['t_cycle_s'] - s['t_step_s']):6.2f}"
                  f" {med(lambda s: s['t_forward_s']):7.2f} {med(lambda s: s['t_schedule_s']):6.2f}"
                  f" {med(lambda s: s['t_commit_s']):6.2f} {med(lambda s: s['t_draft_s']):6.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
