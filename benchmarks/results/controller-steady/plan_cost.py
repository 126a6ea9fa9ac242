#!/usr/bin/env python3
"""What mode auto's `AdaptiveController.plan` costs a step when the planner speculates, with and
without steady steps, in process on `bench levels`' auto engine with the planner's arms limited
to `--modes` (greedy, 48 tokens a request, `24 x concurrency` requests a run):

    .venv/bin/python benchmarks/results/controller-steady/plan_cost.py [--modes sd] [--concurrency 1] [--runs 3]

The two variants alternate on one engine (`no-steady`: `Planner.steady` granting none), after
one untimed pass; for each run, tokens/s, the median microseconds of `plan` over the steps whose
plan drafted, and how many of those steps were held (decided without a snapshot).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def run(engine, placement, concurrency: int, requests: int, steady: bool) -> dict:
    from backend.sampling.params import SamplingParams
    from client.bench_compare import _apply
    from client.prompts import load_prompts

    _apply(placement)
    ctl, planner = engine.adaptive, engine.adaptive.planner
    if not steady:
        planner.steady = lambda signals: (0, 0.0)
    real_plan = ctl.plan
    timed = []          # (seconds, held) of each plan that drafted

    def plan():
        held_before = planner.held_steps
        t0 = time.perf_counter()
        p = real_plan()
        dt = time.perf_counter() - t0
        if p.gamma > 0:
            timed.append((dt, planner.held_steps > held_before))
        return p
    ctl.plan = plan
    prompts = load_prompts(None, requests)
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts]
    t0 = time.perf_counter()
    try:
        out = engine.generate(prompts, params, max_concurrency=concurrency)
    finally:
        wall = time.perf_counter() - t0
        del ctl.plan
        if not steady:
            del planner.steady
    return {"tokens_per_s": sum(len(c.output_ids) for c in out) / wall, "drafting_steps": len(timed),
            "held": sum(h for _, h in timed),
            "plan_us": 1e6 * statistics.median(t for t, _ in timed) if timed else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="sd", help="the planner's modes (engine.json's planner.modes)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests-per-slot", type=int, default=24)
    ap.add_argument("--json")
    args = ap.parse_args()

    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine
    from client.bench_compare import engine_config
    from client.bench_levels import add_levels_parser
    levels = argparse.ArgumentParser()
    add_levels_parser(levels.add_subparsers())
    cfg, placement = engine_config("auto", levels.parse_args(["levels"]))
    cfg["planner"] = {"modes": args.modes.split(",")}
    engine = Engine(EngineConfig(**cfg))
    requests = args.concurrency * args.requests_per_slot
    results = {"steady": [], "no-steady": []}
    try:
        run(engine, placement, args.concurrency, requests, True)       # untimed
        for i in range(args.runs):
            for name in results:
                r = run(engine, placement, args.concurrency, requests, name == "steady")
                results[name].append(r)
                print(f"run {i + 1} {name:9s} {r['tokens_per_s']:6.0f} tok/s, {r['drafting_steps']} drafting "
                      f"steps ({r['held']} held), plan {r['plan_us']:.1f} us (median)", flush=True)
    finally:
        engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"modes": args.modes, "concurrency": args.concurrency,
                                               "requests": requests, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
