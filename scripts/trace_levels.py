#!/usr/bin/env python3
"""Step by step, where mode auto's time goes against plain decoding on both cores at one fixed
concurrency, on `bench levels`' own engines, prompts and closed loop (every request 48 tokens).

    .venv/bin/python scripts/trace_levels.py [--concurrency 16] [--runs 4] [--first 4] [--json PATH]

The two engines run alternately, `--runs` times each, `concurrency x 6` requests a run; with
`--first`, each first runs once untimed at those concurrencies (`bench levels` runs its levels in
order, so auto comes to 16 with what it learned at 4). For every run it prints tokens/s, what
auto ran (plain decoding lent the drafter's cores, speculation on the target's own), and how the
prompts were fed: in steps that fed only prompts (a whole wave at once, as plain decoding in
lockstep does) or inside decode steps (one request's successor at a time, once the requests
finish at different steps), with the milliseconds each kind of step took; for plain decoding's
steps without prompts, also the median time the step spent before its forward (admission, the
planner, scheduling) and between its end and the next step's start (the planner's observation,
the outputs); for auto, the median time of its controller's own calls a step,
`AdaptiveController.plan` (the signals' snapshot, the planner's decision, the cores' placement)
and `AdaptiveController.observe` (the planner's and the lending choice's bookkeeping), timed
around each call.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(acc: list[float], call):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            acc.append(time.perf_counter() - t0)
    return wrapper


def run(engine, placement, concurrency: int) -> dict:
    from backend.sampling.params import SamplingParams
    from client.bench_compare import _apply
    from client.prompts import load_prompts

    _apply(placement)
    ctl = engine.adaptive
    steps = []

    def on_step(_outputs):
        st = engine.stats().last_step
        lent = ctl is not None and ctl.placement is not None and ctl.placement.lent
        steps.append((st.decoded, bool(st.drafted), lent, st.t_cycle_s, st.num_prefill_tokens,
                      st.tokens_committed, st.t_schedule_s, st.t_cycle_s - st.t_step_s))

    prompts = load_prompts(None, concurrency * 6)
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True) for _ in prompts]
    spent = {"plan": [], "observe": []} if ctl is not None else {}
    for name, acc in spent.items():           # an instance attribute shadows the method
        setattr(ctl, name, _timed(acc, getattr(ctl, name)))
    t0 = time.perf_counter()
    try:
        out = engine.generate(prompts, params, on_step=on_step, max_concurrency=concurrency)
    finally:
        wall = time.perf_counter() - t0
        for name in spent:
            delattr(ctl, name)
    kinds = collections.defaultdict(lambda: [0, 0.0, 0, 0])    # steps, seconds, tokens, prompt tokens
    plain = [(sched, gap) for decoded, drafted, _, _, prefill, _, sched, gap in steps
             if decoded and not drafted and not prefill]
    for decoded, drafted, lent, cycle, prefill, committed, _, _ in steps:
        if not decoded:
            kind = "prompts only"
        else:
            kind = ("speculative" if drafted else "plain" + (" lent" if lent else "")) + (
                " + prompts" if prefill else "")
        k = kinds[kind]
        k[0] += 1
        k[1] += cycle
        k[2] += committed
        k[3] += prefill
    around = ({"before_forward_ms": 1e3 * statistics.median(p[0] for p in plain),
               "after_step_ms": 1e3 * statistics.median(p[1] for p in plain)} if plain else {})
    return {"tokens_per_s": sum(len(c.output_ids) for c in out) / wall, "steps": len(steps),
            "ms_per_step": 1e3 * wall / max(len(steps), 1),
            "controller_us": {name: 1e6 * statistics.median(v) for name, v in spent.items() if v},
            "plain_step_overhead": around,
            "kinds": {kind: {"steps": n, "ms_per_step": 1e3 * s / n, "tokens": tok, "prompt_tokens": pf}
                      for kind, (n, s, tok, pf) in sorted(kinds.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--first", default="", help="comma-separated concurrencies run first, untimed")
    ap.add_argument("--json")
    args = ap.parse_args()

    from client.bench_compare import build_engines
    from client.bench_levels import add_levels_parser
    levels = argparse.ArgumentParser()
    add_levels_parser(levels.add_subparsers())
    engines = build_engines(levels.parse_args(["levels"]), ["ar-2dev", "auto"])
    results = {name: [] for name in engines}
    try:
        for level in (int(c) for c in args.first.split(",") if c):
            for name, (engine, placement) in engines.items():
                print(f"{name}: first at concurrency {level} (untimed)", flush=True)
                run(engine, placement, level)
        for i in range(args.runs):
            for name, (engine, placement) in engines.items():
                r = run(engine, placement, args.concurrency)
                results[name].append(r)
                o, c = r["plain_step_overhead"], r["controller_us"]
                print(f"run {i + 1} {name:8s} {r['tokens_per_s']:6.0f} tok/s, {r['steps']} steps, "
                      f"{r['ms_per_step']:.2f} ms a step" + (
                          f"; plain steps: {o['before_forward_ms']:.2f} ms before the forward, "
                          f"{o['after_step_ms']:.2f} ms after the step" if o else "") + (
                          f"; controller: plan {c['plan']:.0f} us, observe {c['observe']:.0f} us a step"
                          if c else ""), flush=True)
                for kind, k in r["kinds"].items():
                    print(f"    {kind:26s} {k['steps']:4d} steps {k['ms_per_step']:6.1f} ms a step, "
                          f"{k['prompt_tokens']:5d} prompt tokens", flush=True)
    finally:
        for engine, _ in engines.values():
            engine.close()
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results["auto"], results["ar-2dev"])]
    print(f"auto / ar-2dev, run by run: {' '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"concurrency": args.concurrency, "first": args.first, "runs": results,
                                               "auto_over_ar_2dev": ratios}, indent=1))


if __name__ == "__main__":
    main()
