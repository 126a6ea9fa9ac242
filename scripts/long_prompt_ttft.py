"""Time to first token of short requests beside a long prompt, at engine level.

    cd <checkout> && .venv/bin/python scripts/long_prompt_ttft.py [--chunk 512]

Runs the checkout it is started from (its backend/ and tests/). A random 2-layer Llama with a
4096-position context (tests/model_factory.py, the tiny pair's tokenizer); a 4096-token KV pool;
four requests decoding (prompt 600, 300 tokens each); after 8 steps a 2400-token prompt
arrives (its first chunk fits beside them, all of it does not), and then every 4 steps a short request (32-token prompt, 16 tokens), 8 of them.
Prints per request the steps and milliseconds from its arrival to its first token, and the
engine's preemptions and recomputed prefill tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NIGHTDRAFT_COMPILE", "off")
ROOT = Path.cwd()
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from backend.engine.config import EngineConfig  # noqa: E402
from backend.engine.engine import Engine  # noqa: E402
from backend.model.config import ModelConfig  # noqa: E402
from backend.model.kv_cache import PagedKVCache  # noqa: E402
from backend.sampling.params import SamplingParams  # noqa: E402
from model_factory import save_random_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--decode-prompt", type=int, default=600)
    ap.add_argument("--decode-tokens", type=int, default=300)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    ap.add_argument("--long", type=int, default=2400)
    ap.add_argument("--max-steps", type=int, default=3000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    ckpt = save_random_llama(tmp / "model", hidden=64, layers=2, max_positions=4096, seed=3)
    per_block = PagedKVCache.bytes_per_block(ModelConfig.from_pretrained(ckpt), 16, torch.float32)
    engine = Engine(EngineConfig(target=str(ckpt), kv_cache_bytes=args.pool_tokens // 16 * per_block,
                                 block_size=16, max_num_batched_tokens=args.chunk, mode="ar", num_threads=1))
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1, 4000) for _ in range(n)]  # noqa: E731
    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"decode{i}", ids(args.decode_prompt), decode) for i in range(4)],
                8: [("long", ids(args.long), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]}
    for k in range(8):
        arrivals.setdefault(9 + 4 * k, []).append(
            (f"short{k}", ids(32), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)))
    arrived: dict[str, tuple[int, float]] = {}
    first: dict[str, tuple[int, float]] = {}
    recomputed = 0
    step = 0
    while (engine.has_unfinished() or any(s > step for s in arrivals)) and step < args.max_steps:
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            arrived[rid] = (step, time.perf_counter())
        before = engine.stats().steps
        outs = engine.step()
        if engine.stats().steps > before:
            recomputed += engine.stats().last_step.num_recompute_tokens
        step += 1
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = (step, now)
    rows = {rid: {"ttft_steps": first[rid][0] - arrived[rid][0] if rid in first else None,
                  "ttft_ms": round(1000 * (first[rid][1] - arrived[rid][1]), 1) if rid in first else None}
            for rid in arrived}
    shorts = [rows[r]["ttft_steps"] for r in rows if r.startswith("short")]
    short_ms = [rows[r]["ttft_ms"] for r in rows if r.startswith("short")]
    print(json.dumps({"checkout": str(ROOT), "chunk": args.chunk, "steps": step,
                      "finished": not engine.has_unfinished(),
                      "preemptions": engine.stats().preemptions, "recomputed_prefill_tokens": recomputed,
                      "long": rows["long"],
                      "short_ttft_steps": shorts, "short_ttft_ms": short_ms}, indent=1))


if __name__ == "__main__":
    main()
