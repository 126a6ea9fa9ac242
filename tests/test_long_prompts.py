"""Long prompts beside decoding requests: admitted only with room for all of their tokens (no
prefill that stops halfway and throws its chunks away), and no holding back the short requests
behind them that fit (a bounded head-of-line bypass)."""
import pytest
import torch

from backend.batching.scheduler import MAX_HEAD_BYPASS, Scheduler
from backend.batching.sequence import Sequence
from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.model.config import ModelConfig
from backend.model.kv_cache import PagedKVCache
from backend.sampling.params import SamplingParams
from model_factory import TINY_TARGET

BLOCK = 16
POOL_BLOCKS = 64            # 1024 tokens: the tiny target's whole context
CHUNK = 128                 # prefill tokens per step
LONG_TOKENS = 800           # 50 blocks: its first chunks fit beside four decoders, all of it does not
DECODE = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def block_bytes() -> int:
    return PagedKVCache.bytes_per_block(ModelConfig.from_pretrained(TINY_TARGET), BLOCK, torch.float32)


def make_engine(pool_blocks: int) -> Engine:
    return Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=pool_blocks * block_bytes(),
                               block_size=BLOCK, max_num_batched_tokens=CHUNK, mode="ar"))


@pytest.fixture(scope="module")
def requests():
    from client.prompts import load_prompts
    engine = make_engine(POOL_BLOCKS)
    ids = [t for p in load_prompts(n=16) for t in engine.tokenizer.encode(p)]
    assert len(ids) >= LONG_TOKENS + 4 * 64 + 32
    decoders = [ids[64 * i:64 * (i + 1)] for i in range(4)]
    long = ids[256:256 + LONG_TOKENS]
    short = ids[-32:]
    return decoders, long, short


def run(engine: Engine, decoders, long, short, max_steps: int = 600):
    """Four requests decode; then a long prompt arrives, and a short request behind it. Returns
    per request its tokens and the step of its first token (counted from the long prompt's
    arrival), and the prefill tokens recomputed after preemptions."""
    tokens: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    for i, p in enumerate(decoders):
        engine.add_request(f"d{i}", p, DECODE)
    for _ in range(8):
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.add_request("long", long, SHORT)
    engine.add_request("short", short, SHORT)
    recomputed = prefilled = 0
    step = 0
    while engine.has_unfinished() and step < max_steps:
        before = engine.stats().steps
        outs = engine.step()
        step += 1
        if engine.stats().steps > before:
            recomputed += engine.stats().last_step.num_recompute_tokens
            prefilled += engine.stats().last_step.num_prefill_tokens
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_token_ids:
                first.setdefault(o.request_id, step)
    assert not engine.has_unfinished(), f"requests still unfinished after {max_steps} steps"
    return tokens, first, recomputed, prefilled


def test_a_long_prompt_is_neither_thrashed_nor_in_the_way_of_short_ones(requests):
    decoders, long, short = requests
    # The same requests with room for all of them at once: what each must generate.
    expected, _, _, _ = run(make_engine(4 * POOL_BLOCKS), decoders, long, short)

    engine = make_engine(POOL_BLOCKS)
    assert engine.kv.num_blocks == POOL_BLOCKS
    tokens, first, recomputed, prefilled = run(engine, decoders, long, short)
    assert tokens == expected
    # Admitted only once there is room for all of it: nothing preempted, nothing recomputed
    # (admitting it for its first chunk preempted it at a later chunk, again and again, and
    # re-prefilled tens of thousands of tokens).
    assert engine.stats().preemptions == 0
    assert recomputed == 0
    assert prefilled <= LONG_TOKENS + len(short)      # each prompt token fed once
    # The short request fits beside the decoders: it does not wait for the long prompt
    # (behind it, it waited for the decoders to finish, about 110 steps).
    assert first["short"] <= 2
    assert first["short"] < first["long"]
    assert engine.scheduler.num_bypasses >= 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def seq(rid: str, n: int) -> Sequence:
    return Sequence(request_id=rid, token_ids=list(range(1, n + 1)), num_prompt_tokens=n,
                    params=SHORT, detokenizer=None)


def small_scheduler(blocks: int, chunk: int = 4096, **kw) -> Scheduler:
    kv = PagedKVCache.for_model(ModelConfig.from_pretrained(TINY_TARGET), blocks * block_bytes(), block_size=BLOCK)
    return Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=chunk, **kw)


def test_a_prompt_is_admitted_with_its_blocks_for_every_chunk_reserved():
    sched = small_scheduler(16, chunk=32)
    sched.add(seq("running", 96))                 # 6 blocks
    sched.schedule(lambda s: 0)
    sched.running[0].num_computed = 95            # decoding
    # 150 tokens = 10 blocks: its first chunk (2 blocks) fits in the 10 free, all of it does not
    # beside the running request's headroom, so it waits rather than start a prefill that cannot end.
    sched.add(seq("long", 150))
    batch = sched.schedule(lambda s: 0)
    assert [s.seq.request_id for s in batch] == ["running"]
    assert len(sched.waiting) == 1 and sched.kv.num_used_blocks == 6
    # Once the running request is gone it is admitted with all 10 blocks, not its first chunk's 2.
    sched.remove(sched.running[0])
    batch = sched.schedule(lambda s: 0)
    assert [(s.seq.request_id, s.num_new) for s in batch] == [("long", 32)]
    assert len(sched.kv.table_view("long")) == 10


def test_requests_behind_one_that_does_not_fit_pass_it_a_bounded_number_of_times():
    assert MAX_HEAD_BYPASS >= 1
    sched = small_scheduler(48, max_head_bypass=2)
    sched.add(seq("running", 400))                # 25 blocks
    sched.schedule(lambda s: 0)
    sched.running[0].num_computed = 399
    sched.add(seq("long", 400))                   # 25 blocks: does not fit in the 23 free
    for i in range(5):
        sched.add(seq(f"short{i}", 10))           # 1 block each (and 1 of headroom)
    batch = sched.schedule(lambda s: 0)
    # short2 would fit too (21 blocks free), but the long prompt has been passed twice
    assert [s.seq.request_id for s in batch] == ["running", "short0", "short1"]
    assert sched.kv.num_free_blocks == 21
    assert [s.request_id for s in sched.waiting] == ["long", "short2", "short3", "short4"]
    assert sched.num_bypasses == 2
    # Once it fits it goes first, and the others follow it.
    sched.remove(sched.running[0])
    for s in sched.running:
        s.num_computed = len(s) - 1
    batch = sched.schedule(lambda s: 0)
    assert [s.seq.request_id for s in batch] == ["short0", "short1", "long", "short2", "short3", "short4"]
