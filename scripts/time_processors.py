#!/usr/bin/env python3
"""Time the logits processors (backend/sampling/processors.py) and the grammar masks
(backend/sampling/grammar.py) alone, at the shapes of a verification step: what a request's
penalties, bad words, biases or structured output add to the engine's decide.

    .venv/bin/python scripts/time_processors.py [--seqs 32] [--gamma 4] [--context 256] [--vocab 4096]

Prints the median time of one step's processing of `--seqs` requests with `--gamma` drafts each
(gamma + 1 rows a request), for each processor alone and all together, and the median time of one
grammar mask (xgrammar fill + unpack) per verified row for a JSON schema on the bundled tokenizer.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from backend.sampling.params import SamplingParams  # noqa: E402
from backend.sampling.processors import Context, Row, process_logits  # noqa: E402


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--context", type=int, default=256, help="prompt + output tokens per request")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    cases = {
        "penalties": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
        "logit_bias (8 ids)": dict(logit_bias={t: 1.0 for t in range(8)}),
        "allowed_token_ids (256)": dict(allowed_token_ids=list(range(256))),
        "bad_words (4 of 2 tokens)": dict(bad_words_token_ids=tuple((rng.randrange(args.vocab),
                                                                     rng.randrange(args.vocab)) for _ in range(4))),
    }
    cases["all"] = {k: v for c in cases.values() for k, v in c.items()}
    rows_n = args.seqs * (args.gamma + 1)
    logits = torch.randn(rows_n, args.vocab)
    print(f"{args.seqs} requests x {args.gamma + 1} rows, context {args.context}, vocab {args.vocab}:")
    for name, keys in cases.items():
        params = SamplingParams(**keys)
        contexts = [Context(params, [rng.randrange(args.vocab) for _ in range(args.context)], args.context // 2)
                    for _ in range(args.seqs)]
        rows = [Row(c, [rng.randrange(args.vocab) for _ in range(j)]) for c in range(args.seqs)
                for j in range(args.gamma + 1)]
        s = median_s(lambda: process_logits(logits.clone(), list(range(rows_n)), contexts, rows), args.repeats)
        print(f"  {name:28s} {s * 1e3:8.3f} ms a step")
    try:
        grammar_masks(args)
    except ImportError as e:
        print(f"grammar masks: not measured ({e})")
    return 0


def grammar_masks(args) -> None:
    from backend.model.tokenizer import Tokenizer
    from backend.sampling.grammar import GrammarCompiler, allocate_bitmask, allowed_tokens
    from backend.sampling.structured import parse_structured_outputs
    tok = Tokenizer.from_pretrained(REPO / "models" / "tiny-target")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "n", "tags"]}
    so = parse_structured_outputs("structured_outputs", {"json": schema})
    compiler = GrammarCompiler(tok, tok.vocab_size)
    t0 = time.perf_counter()
    compiler.compile(so)
    print(f"compile the JSON schema: {(time.perf_counter() - t0) * 1e3:.1f} ms (then cached)")
    text = json.dumps({"name": "ab cd", "n": 12345, "tags": ["x", "yz", "w"]})
    path = tok.encode_plain(text)
    bitmask = allocate_bitmask(1, tok.vocab_size)
    fills, unpacks = [], []
    for _ in range(max(1, args.repeats // 10)):
        m = compiler.matcher(so)
        for t in path:
            t0 = time.perf_counter()
            m.fill(bitmask, 0)
            t1 = time.perf_counter()
            allowed_tokens(bitmask, tok.vocab_size)
            unpacks.append(time.perf_counter() - t1)
            fills.append(t1 - t0)
            assert m.accept(t), "the sample text does not follow the schema"
    print(f"grammar mask per row: fill {statistics.median(fills) * 1e6:.1f} us, "
          f"unpack {statistics.median(unpacks) * 1e6:.1f} us ({len(path)} tokens of JSON)")


if __name__ == "__main__":
    sys.exit(main())
