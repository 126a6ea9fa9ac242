#!/usr/bin/env python3
"""What turning the drafter off costs: plain steps timed by their place after a drafting step.

    .venv/bin/python scripts/turn_off_cost.py [--modes sd,psd] [--batch 8] [--json PATH]

On `bench levels`' auto engine (the bundled pair, the drafter a worker on its own core), the
planner's decision is replaced by a script: 4 steps of the mode at gamma 3, then 8 of plain
decoding, over and over, for `batch x 8` requests of 48 tokens at concurrency `batch`. Prints the
median target forward time of the plain steps at full batch without prompts, by their place
after the last drafting step (1 = the first plain step, 6 = the sixth and later).
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


def measure(mode: str, batch: int) -> dict:
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
    script = itertools.cycle([Decision(mode, 3)] * 4 + [Decision("ar", 0)] * 8)
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
                by_place[min(place[0], 6)].append(st.t_forward_s * 1e3)
    try:
        _apply(placement)
        prompts = load_prompts(None, batch * 8)
        engine.generate(prompts, [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)] * len(prompts),
                        on_step=on_step, max_concurrency=batch)
    finally:
        engine.close()
    return {str(k): {"steps": len(v), "median_forward_ms": statistics.median(v)} for k, v in sorted(by_place.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="sd,psd")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    for mode in args.modes.split(","):
        results[mode] = r = measure(mode, args.batch)
        print(f"after {mode}: " + ", ".join(f"{k}: {v['median_forward_ms']:.2f} ms ({v['steps']})" for k, v in r.items()),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": args.batch, "forward_ms_by_place": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
