#!/usr/bin/env python3
"""What turning the drafter off costs: plain steps timed by their place after a drafting step.

    .venv/bin/python scripts/turn_off_cost.py [--modes sd,psd] [--gammas 3] [--drafting-steps 4] [--batch 8] [--rounds 8] [--plain-steps 8] [--json PATH]

On `bench levels`' auto engine (the bundled pair, the drafter a worker on its own core), the
planner's decision is replaced by a script: `--drafting-steps` of the mode at each gamma, then
`--plain-steps` of plain decoding, over and over, for `batch x rounds` requests of 48 tokens at
concurrency `batch`. Prints the median target forward time of the plain steps at full batch
without prompts, by their place after the last drafting step (1 = the first plain step; the last
place shown holds it and every later one).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(mode: str, gamma: int, batch: int, plain_steps: int, drafting_steps: int, rounds: int) -> dict:
    from backend.sampling.params import SamplingParams
    from client.bench_compare import _apply, build_engines
    from client.bench_levels import add_levels_parser
    from client.prompts import load_prompts
    from planner import Decision

    levels = argparse.ArgumentParser()
    add_levels_parser(levels.add_subparsers())
    engine, placement = build_engines(levels.parse_args(["levels"]), ["auto"])["auto"]
    planner = engine.adaptive.planner
    decide = planner.decide
    script = itertools.cycle([Decision(mode, gamma)] * drafting_steps + [Decision("ar", 0)] * plain_steps)
    planner.decide = lambda signals: (decide(signals), next(script))[1]
    by_place = collections.defaultdict(list)
    place = [None]

    def on_step(_outputs):
        st = engine.stats().last_step
        if st.drafted:
            place[0] = 0
        elif place[0] is not None:
            place[0] += 1
            if st.decoded and not st.num_prefill_tokens and st.batch_size == batch:
                by_place[min(place[0], plain_steps - 2)].append(st.t_forward_s * 1e3)
    try:
        _apply(placement)
        prompts = load_prompts(None, batch * rounds)
        engine.generate(prompts, [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)] * len(prompts),
                        on_step=on_step, max_concurrency=batch)
    finally:
        engine.close()
    return {str(k): {"steps": len(v), "median_forward_ms": statistics.median(v)} for k, v in sorted(by_place.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="sd,psd")
    ap.add_argument("--gammas", default="3", help="comma-separated speculation lengths of the drafting steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--drafting-steps", default="4", help="comma-separated lengths of the drafting runs")
    ap.add_argument("--plain-steps", type=int, default=8, help="plain steps after each drafting run (at least 3)")
    ap.add_argument("--rounds", type=int, default=8, help="requests = batch x rounds")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.plain_steps < 3:
        ap.error("--plain-steps: at least 3")
    results = {}
    for mode in args.modes.split(","):
        for gamma, n in itertools.product((int(g) for g in args.gammas.split(",")),
                                          (int(d) for d in args.drafting_steps.split(","))):
            key = f"{mode}:{gamma}" + (f" x{n}" if n != 4 else "")
            results[key] = r = measure(mode, gamma, args.batch, args.plain_steps, n, args.rounds)
            print(f"after {key}: " + ", ".join(f"{k}: {v['median_forward_ms']:.2f} ms ({v['steps']})"
                                                     for k, v in r.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": args.batch, "plain_steps": args.plain_steps, "rounds": args.rounds,
                                               "forward_ms_by_place": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
