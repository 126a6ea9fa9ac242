"""How many decode steps of sequential SD drafted less than gamma a sequence, on a KV pool small
enough that requests are preempted: 24 requests (the bundled code prompts, 200-500 characters),
64 tokens each, greedy, gamma 4, a 64-block target pool (the drafter's: as many tokens).

    python benchmarks/results/preempted-drafter-copy/drafts_short.py [extra drafter blocks]

A step counts as short when the drafts it verified are fewer than what its decoding sequences
had room for (gamma, or their tokens left). In process, the tiny pair, one engine.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from backend.engine.config import EngineConfig  # noqa: E402
from backend.engine.engine import Engine  # noqa: E402
from backend.model.config import ModelConfig  # noqa: E402
from backend.model.kv_cache import PagedKVCache  # noqa: E402
from backend.sampling.params import SamplingParams  # noqa: E402
from helpers.engines import block_bytes, code_prompts  # noqa: E402
from model_factory import TINY_DRAFTER, TINY_TARGET  # noqa: E402


def main() -> None:
    extra = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    kw = dict(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), gamma=4, mode="sd",
              kv_cache_bytes=64 * block_bytes())
    if extra:
        per_block = PagedKVCache.bytes_per_block(ModelConfig.from_pretrained(TINY_DRAFTER), 16, torch.float32)
        kw["drafter_kv_cache_bytes"] = (64 + extra) * per_block
    engine = Engine(EngineConfig(**kw))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(code_prompts(24, 200, 37, 300)):
        engine.add_request(str(i), p, params)
    short = full = steps = 0
    while engine.has_unfinished():
        decoding = [s for s in engine.scheduler.running if s.num_uncomputed == 1]
        room = sum(min(4, s.params.max_tokens - s.num_output_tokens - 1) for s in decoding)
        before = engine.stats().drafted_tokens
        engine.step()
        steps += 1
        if room > 0:
            if engine.stats().drafted_tokens - before < room:
                short += 1
            else:
                full += 1
    st = engine.stats()
    print(f"extra drafter blocks {extra}: {steps} steps, {short} of {short + full} decode steps short of "
          f"drafts, {st.drafted_tokens} drafted, {st.accepted_tokens} accepted, "
          f"{engine.scheduler.num_preemptions} preemptions")
    engine.close()


if __name__ == "__main__":
    main()
