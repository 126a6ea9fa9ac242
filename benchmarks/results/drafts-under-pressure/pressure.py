"""Sequential SD on a KV pool too small for its requests: how many steps the same work takes, how
many drafts the scheduler gave, how many sequences were preempted. 24 requests (the bundled code
prompts, 200-500 characters), 64 tokens each, greedy, gamma 4, target pools of 40, 64 and 96
blocks of 16 tokens (the drafter's: as many tokens). In process, the tiny pair, one engine;
greedy, so every count but the seconds is the same on every run of one commit.

    python benchmarks/results/drafts-under-pressure/pressure.py [requests tokens]
"""
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from backend.engine.config import EngineConfig  # noqa: E402
from backend.engine.engine import Engine  # noqa: E402
from backend.sampling.params import SamplingParams  # noqa: E402
from helpers.engines import block_bytes, code_prompts  # noqa: E402
from model_factory import TINY_DRAFTER, TINY_TARGET  # noqa: E402


def run(blocks: int, requests: int = 24, tokens: int = 64) -> str:
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), gamma=4, mode="sd",
                                 kv_cache_bytes=blocks * block_bytes()))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(code_prompts(requests, 200, 37, 300)):
        engine.add_request(str(i), p, params)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    st = engine.stats()
    line = (f"{blocks:4d} blocks: {seconds:6.2f} s, {steps:4d} steps, {st.drafted_tokens:5d} drafted, {st.accepted_tokens:5d} accepted, "
            f"{engine.scheduler.num_preemptions:3d} preemptions")
    engine.close()
    return line


if __name__ == "__main__":
    requests, tokens = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (24, 64)
    for blocks in (40, 64, 96):
        print(run(blocks, requests, tokens), flush=True)
