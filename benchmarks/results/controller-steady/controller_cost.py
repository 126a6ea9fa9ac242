#!/usr/bin/env python3
"""What mode auto's controller costs at a fixed concurrency, in process, on `bench levels`' own
engines, prompts and closed loop (greedy, 48 tokens a request):

    .venv/bin/python benchmarks/results/controller-steady/controller_cost.py [--concurrency 1]
        [--runs 4] [--requests-per-slot 24] [--configs ar-2dev,auto,no-steady,no-controller] [--json PATH]

Configurations, run alternately, each `--runs` times after one untimed pass:

* `ar-2dev`: plain decoding on both cores (the best fixed configuration in process);
* `auto`: mode auto as it ships;
* `no-steady`: mode auto deciding on a whole snapshot every step (`Planner.steady` granting none);
* `no-controller`: mode auto's engine with its controller's two calls stubbed out after the
  untimed pass (the drafter's cores lent, every step plain, nothing observed): what the same
  engine would do with a free controller, a bound, not a configuration anyone runs.

For each run: tokens/s, and the medians over its plain decode steps (no prompt fed, nothing
drafted) of the target's forward, the step's scheduling (the plan included), its commit, the
whole step and the cycle (the step plus the gap to the next one, where the observation runs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

CONFIGS = ("ar-2dev", "auto", "no-steady", "no-controller")
PARTS = ("forward_ms", "schedule_ms", "commit_ms", "step_ms", "cycle_ms")


def run(engine, placement, concurrency: int, requests: int, variant: str) -> dict:
    from backend.sampling.params import SamplingParams
    from backend.step import PLAIN
    from client.bench_compare import _apply
    from client.prompts import load_prompts

    _apply(placement)
    ctl = engine.adaptive
    if variant == "no-steady":
        ctl.planner.steady = lambda signals: (0, 0.0)
    elif variant == "no-controller":
        ctl.placement.lend_drafter_cores()
        ctl.plan = lambda: PLAIN
        ctl.observe = lambda *args, **kwargs: None
    plain = []

    def on_step(_outputs):
        st = engine.stats().last_step
        if st.decoded and not st.drafted and not st.num_prefill_tokens:
            plain.append((st.t_forward_s, st.t_schedule_s, st.t_commit_s, st.t_step_s, st.t_cycle_s))

    held_before = ctl.planner.held_steps if ctl is not None else 0
    prompts = load_prompts(None, requests)
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts]
    t0 = time.perf_counter()
    try:
        out = engine.generate(prompts, params, on_step=on_step, max_concurrency=concurrency)
    finally:
        wall = time.perf_counter() - t0
        for obj, name in ((ctl, "plan"), (ctl, "observe"), (ctl and ctl.planner, "steady")):
            if obj is not None and name in vars(obj):      # an instance attribute shadows the method
                delattr(obj, name)
    r = {"tokens_per_s": sum(len(c.output_ids) for c in out) / wall, "plain_steps": len(plain)}
    for i, part in enumerate(PARTS):
        r[part] = 1e3 * statistics.median(p[i] for p in plain) if plain else None
    if ctl is not None:
        r["held_steps"] = ctl.planner.held_steps - held_before
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--requests-per-slot", type=int, default=24)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown or "ar-2dev" not in configs:
        ap.error(f"--configs: from {', '.join(CONFIGS)}, ar-2dev among them (got {args.configs})")

    from client.bench_compare import build_engines
    from client.bench_levels import add_levels_parser
    levels = argparse.ArgumentParser()
    add_levels_parser(levels.add_subparsers())
    engine_of = {c: "ar-2dev" if c == "ar-2dev" else "auto" for c in configs}
    engines = build_engines(levels.parse_args(["levels"]), sorted(set(engine_of.values())))
    requests = args.concurrency * args.requests_per_slot
    results = {c: [] for c in configs}
    try:
        for name, (engine, placement) in engines.items():
            print(f"{name}: one untimed pass", flush=True)
            run(engine, placement, args.concurrency, requests, name)
        for i in range(args.runs):
            for c in configs:
                engine, placement = engines[engine_of[c]]
                r = run(engine, placement, args.concurrency, requests, c)
                results[c].append(r)
                print(f"run {i + 1} {c:13s} {r['tokens_per_s']:6.0f} tok/s, {r['plain_steps']} plain steps"
                      + (f" ({r['held_steps']} held)" if "held_steps" in r else "") + "; their medians (ms): "
                      + " ".join(f"{p[:-3]} {r[p]:.3f}" for p in PARTS if r[p] is not None), flush=True)
    finally:
        for engine, _ in engines.values():
            engine.close()
    ratios = {c: [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results[c], results["ar-2dev"])]
              for c in configs if c != "ar-2dev"}
    for c, rs in ratios.items():
        print(f"{c} / ar-2dev, run by run: {' '.join(f'{x:.3f}' for x in rs)} (median {statistics.median(rs):.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"concurrency": args.concurrency, "requests": requests, "runs": results,
             "over_ar_2dev": ratios}, indent=1))


if __name__ == "__main__":
    main()
