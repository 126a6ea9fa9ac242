#!/usr/bin/env python3
"""What mode auto's controller adds to a step, beside plain decoding on every core.

    .venv/bin/python scripts/time_controller.py [--concurrency 1] [--runs 4] [--requests 48]
        [--json PATH]

Builds `bench levels`' ar-2dev and auto engines (the bundled pair, auto's drafter a worker on its
own core), warms both, then runs the same prompts through each in turn (the order alternating)
at a fixed concurrency. Prints each run's tokens a second, and the controller's own time per
step in auto's engine: `AdaptiveController.plan` (the signals' snapshot, the planner's decision,
the cores' placement) and `AdaptiveController.observe` (the planner's and the lending choice's
bookkeeping), timed around each call, medians over every step of the measured runs. At
concurrency 1 auto plays plain decoding where it measures faster than SD, so what it loses to
ar-2dev there is mostly this time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = ["ar-2dev", "auto"]


def _timed(acc: list[float], call):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            acc.append(time.perf_counter() - t0)
    return wrapper


def measure(concurrency: int, runs: int, requests: int) -> dict:
    from client.bench_compare import build_engines, run_level
    from client.bench_levels import add_levels_parser
    from client.prompts import load_prompts
    from planner.arms import arm_str

    parser = argparse.ArgumentParser()
    add_levels_parser(parser.add_subparsers())
    args = parser.parse_args(["levels"])
    engines = build_engines(args, CONFIGS)
    try:
        prompts = load_prompts(args.prompts, requests)
        for engine, placement in engines.values():     # compiles, then a first pass at this load
            run_level(engine, placement, load_prompts(args.prompts, 4), concurrency=2, max_tokens=6,
                      temperature=0.0)
            run_level(engine, placement, prompts[:16], concurrency=concurrency,
                      max_tokens=args.max_tokens, temperature=0.0)
        controller = engines["auto"][0].adaptive
        arms_before = controller.planner.bandit.arm_counts()
        spent = {"plan": [], "observe": []}
        for name, acc in spent.items():
            setattr(controller, name, _timed(acc, getattr(controller, name)))
        tok_s = {name: [] for name in CONFIGS}
        step_ms = {name: [] for name in CONFIGS}       # each run's wall time over its steps
        for run in range(runs):
            for name in (CONFIGS if run % 2 == 0 else CONFIGS[::-1]):
                engine, placement = engines[name]
                r = run_level(engine, placement, prompts, concurrency=concurrency,
                              max_tokens=args.max_tokens, temperature=0.0)
                tok_s[name].append(r["tokens_per_s"])
                step_ms[name].append(r["wall_s"] / max(r["steps"], 1) * 1e3)
                print(f"run {run + 1}/{runs} {name:8s} {r['tokens_per_s']:7.1f} tok/s", file=sys.stderr)
        arms = {a: n - arms_before.get(a, 0) for a, n in controller.planner.bandit.arm_counts().items()}
    finally:
        for engine, _ in engines.values():
            engine.close()
    ratios = [a / b for a, b in zip(tok_s["auto"], tok_s["ar-2dev"])]
    return {"concurrency": concurrency, "runs": runs, "requests": requests, "max_tokens": args.max_tokens,
            "tokens_per_s": tok_s, "step_ms": step_ms, "auto_over_ar_2dev": ratios,
            "median_ratio": statistics.median(ratios),
            "auto_arm_steps": {arm_str(a): n for a, n in arms.items() if n},
            "controller_us": {name: {"median": statistics.median(v) * 1e6, "mean": statistics.mean(v) * 1e6,
                                     "calls": len(v)} for name, v in spent.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out = measure(a.concurrency, a.runs, a.requests)
    c = out["controller_us"]
    print(f"auto / ar-2dev at concurrency {a.concurrency}: "
          + ", ".join(f"{r:.2f}" for r in out["auto_over_ar_2dev"]) + f" (median {out['median_ratio']:.2f})")
    print(f"controller per step: plan {c['plan']['median']:.0f} us, observe {c['observe']['median']:.0f} us "
          f"(medians of {c['plan']['calls']} steps)")
    med = {name: statistics.median(v) for name, v in out["step_ms"].items()}
    print(f"a step: ar-2dev {med['ar-2dev']:.2f} ms, auto {med['auto']:.2f} ms (medians of the runs' means); "
          f"auto's arms: {out['auto_arm_steps']}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
