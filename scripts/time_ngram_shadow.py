#!/usr/bin/env python3
"""Time the n-gram shadow lookup (backend/speculation/ngram.py, NgramShadow) alone: what a
`proposer: "both"` engine adds to each step for the planner's n-gram prior.

    .venv/bin/python scripts/time_ngram_shadow.py [--seqs 64] [--prompt-tokens 1000] [--new 2] [--steps 50]

Prints the first sight of `--seqs` requests of `--prompt-tokens` random tokens (their prompts
indexed) and the median step with `--new` new tokens per request.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backend.speculation.ngram import NgramShadow  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--new", type=int, default=2, help="tokens each request commits per step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--gamma", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2000)
    args = p.parse_args()
    rng = random.Random(0)
    seqs = [SimpleNamespace(request_id=str(i), speculates=True,
                            token_ids=[rng.randrange(args.vocab) for _ in range(args.prompt_tokens)])
            for i in range(args.seqs)]
    shadow = NgramShadow(args.gamma)
    t0 = time.perf_counter()
    shadow.observe(seqs)
    first = time.perf_counter() - t0
    steps = []
    for _ in range(args.steps):
        for s in seqs:
            s.token_ids += [rng.randrange(args.vocab) for _ in range(args.new)]
        t0 = time.perf_counter()
        shadow.observe(seqs)
        steps.append(time.perf_counter() - t0)
    print(f"first sight of {args.seqs} requests x {args.prompt_tokens} prompt tokens: {first * 1e3:.1f} ms "
          f"({first * 1e3 / args.seqs / args.prompt_tokens * 1000:.2f} ms per 1,000 prompt tokens)")
    print(f"per step, {args.seqs} requests, {args.new} new tokens each: median {statistics.median(steps) * 1e3:.3f} ms "
          f"(min {min(steps) * 1e3:.3f}, max {max(steps) * 1e3:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
