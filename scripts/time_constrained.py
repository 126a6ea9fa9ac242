#!/usr/bin/env python3
"""What penalties and structured outputs cost, in plain decoding and in SD: tokens per second of
the same prompts with and without them, interleaved, in process (one thread, the bundled pair).

    .venv/bin/python scripts/time_constrained.py [--concurrency 1,32] [--repeats 2] [--json out.json]

Kinds: `plain` (no processing), `penalties` (presence 0.5, frequency 0.5, repetition 1.2),
`regex` (structured_outputs regex `[a-z_][a-z0-9_ ]{31,47}`: up to 48 tokens drawn from a small
alphabet). Greedy; every request runs to its 48 tokens or the grammar's end; tokens per second
counts what was generated.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from backend.engine.config import EngineConfig  # noqa: E402
from backend.engine.engine import Engine  # noqa: E402
from backend.sampling.params import SamplingParams  # noqa: E402
from client.prompts import load_prompts  # noqa: E402

KINDS = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "regex": {"structured_outputs": {"regex": "[a-z_][a-z0-9_ ]{31,47}"}},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    common = dict(target=str(REPO / "models/tiny-target"), num_threads=1, seed=0, max_num_seqs=64)
    engines = {"ar": Engine(EngineConfig(**common, mode="ar")),
               "sd": Engine(EngineConfig(**common, mode="sd", drafter=str(REPO / "models/tiny-drafter"), gamma=4))}
    prompts = load_prompts(n=64)
    levels = [int(c) for c in args.concurrency.split(",")]
    times: dict[tuple, list[float]] = {}
    for r in range(args.repeats + 1):            # the first round warms up (compiles, grammars)
        for conc in levels:
            for mode, engine in engines.items():
                for kind, extra in KINDS.items():
                    params = SamplingParams.from_dict({"max_tokens": args.max_tokens, "temperature": 0, **extra})
                    batch = prompts[:max(conc, 8)]
                    t0 = time.perf_counter()
                    done = engine.generate(batch, params, max_concurrency=conc)
                    wall = time.perf_counter() - t0
                    if r:
                        times.setdefault((conc, mode, kind), []).append(sum(len(c.output_ids) for c in done) / wall)
    rows = []
    for (conc, mode, kind), v in times.items():
        rows.append({"concurrency": conc, "mode": mode, "kind": kind, "tokens_per_s": statistics.median(v),
                     "runs": v})
    def tps(conc, mode, kind):
        return next(r["tokens_per_s"] for r in rows if (r["concurrency"], r["mode"], r["kind"]) == (conc, mode, kind))
    print("| c | kind | AR tok/s | kind / plain (AR) | SD tok/s | SD / AR |")
    print("|---|---|---|---|---|---|")
    for conc in levels:
        for kind in KINDS:
            ar, sd = tps(conc, "ar", kind), tps(conc, "sd", kind)
            print(f"| {conc} | {kind} | {ar:.0f} | {ar / tps(conc, 'ar', 'plain'):.2f} | {sd:.0f} | {sd / ar:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
