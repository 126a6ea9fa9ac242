"""Elastic memory: the drafter's weights go to host memory and its bytes become target KV blocks,
then come back, with no request lost, corrupted or leaking blocks."""
import threading
import time

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.config import EngineConfig
from backend.engine.loop import EngineLoop
from backend.engine.memory import ElasticMemory
from backend.sampling.params import SamplingParams
from helpers.engines import block_bytes
from model_factory import TINY_DRAFTER, TINY_TARGET

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPT_CUTS = (10, 30, 23, 200)      # the conftest's `prompts` and `ar_outputs`


def sd_engine_with_memory(kv_blocks: int) -> tuple[Engine, ElasticMemory]:
    """A fixed-mode engine and its own elastic memory (which no planner drives here)."""
    block = block_bytes()
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), gamma=4,
                                 kv_cache_bytes=kv_blocks * block))
    assert isinstance(engine.memory, ElasticMemory) and engine.memory.block_bytes == block
    return engine, engine.memory


def drafter_weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.drafter.drafter.model.state_dict().items()}


def test_offload_grows_the_pool_and_reload_restores_everything(prompts, ar_outputs):
    # Tight: about a third of what all requests need at once, so they queue for blocks.
    tok = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=1 << 20)).tokenizer
    need = [-(-(len(tok.encode(p)) + GREEDY.max_tokens) // 16) for p in prompts]
    engine, memory = sd_engine_with_memory(kv_blocks=max(max(need) + 2, sum(need) // 3))
    before = drafter_weights(engine)
    base = engine.kv.num_blocks
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    tokens = {i: [] for i in range(len(prompts))}
    step, phase = 0, "sd"
    max_running_offloaded = max_running_sd = 0
    while engine.has_unfinished():
        if phase == "sd" and step == 5:
            engine.set_gamma(0)
            memory.offload()
            assert engine.drafter.state == "offloaded"
            assert engine.kv.num_blocks > base, "freed drafter bytes did not become KV blocks"
            phase = "offloaded"
        elif phase == "offloaded" and step == 25:
            memory.start_reload()
            assert engine.kv.num_blocks == base           # shrunk back first, preempting if needed
            phase = "reloading"
        elif phase == "reloading":
            if memory.poll() is not None:
                engine.set_gamma(4)
                phase = "sd-again"
        for o in engine.step():
            tokens[int(o.request_id)] += o.new_token_ids
        running = len(engine.scheduler.running)
        if phase == "offloaded":
            max_running_offloaded = max(max_running_offloaded, running)
        elif phase == "sd":
            max_running_sd = max(max_running_sd, running)
        step += 1
        if phase == "reloading":
            time.sleep(0.01)
    assert phase == "sd-again", f"the run ended in phase {phase}"
    assert [tokens[i] for i in range(len(prompts))] == ar_outputs
    assert max_running_offloaded > max_running_sd, "the bigger pool did not admit more requests"
    after = drafter_weights(engine)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "weights changed on the round trip"
    assert memory.offloads == 1 and memory.reloads == 1
    assert [e.kind for e in memory.events] == ["offload", "reload_start", "reload_done"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.drafter.stats().kv_usage == 0.0 and engine.drafter.stats().num_sequences == 0


def test_drafter_catches_up_after_reload_and_speculates_again(prompts, ar_outputs):
    engine, memory = sd_engine_with_memory(kv_blocks=64)
    engine.add_request("a", prompts[0], GREEDY)
    for _ in range(3):
        engine.step()
    engine.set_gamma(0)
    memory.offload()
    for _ in range(4):
        engine.step()
    memory.start_reload()
    while memory.poll() is None:
        time.sleep(0.01)
    engine.set_gamma(4)
    drafted = engine.stats().drafted_tokens
    catchup = engine.stats().drafter_catchup_tokens
    tokens = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
    assert engine.stats().drafted_tokens > drafted
    # The drafter rebuilt its cache for the whole sequence (prompt + tokens made while it was off).
    assert engine.stats().drafter_catchup_tokens - catchup >= len(engine.tokenizer.encode(prompts[0]))


def test_budget_accounts_for_every_owner():
    engine, memory = sd_engine_with_memory(kv_blocks=32)
    b = memory.budget()
    assert b["target_weights"] > 0 and b["target_kv"] == 32 * memory.block_bytes and b["drafter"] > 0
    memory.offload()
    b2 = memory.budget()
    assert b2["drafter"] == 0
    assert b2["target_kv"] - b["target_kv"] <= b["drafter"]    # grew by at most what was freed
    assert b2["target_kv"] > b["target_kv"]


def _drive(engine: Engine, n: int, tokens: dict) -> None:
    for _ in range(n):
        for o in engine.step():
            tokens[int(o.request_id)] += o.new_token_ids


def _decoding_without_drafts(prompts, steps: int):
    """An SD engine with a 64-block pool, 4 requests `steps` steps in, then gamma 0 (so the
    drafter can go and come back without drafts in flight)."""
    engine, memory = sd_engine_with_memory(kv_blocks=64)
    tokens = {i: [] for i in range(4)}
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, GREEDY)
    _drive(engine, steps, tokens)
    engine.set_gamma(0)
    return engine, memory, tokens


def test_an_offload_whose_pool_cannot_grow_lends_nothing_and_serving_goes_on(prompts, ar_outputs, monkeypatch):
    from memory_faults import OUT_OF_MEMORY
    engine, memory, tokens = _decoding_without_drafts(prompts, steps=3)
    base = engine.kv.num_blocks

    def no_room(*args, **kwargs):
        raise OUT_OF_MEMORY("injected: no room for the bigger pool")
    with monkeypatch.context() as m:       # the target pool's new storage only (the drafter's
        m.setattr(engine.kv, "new_storage", no_room)     # reload, under way at once, has room)
        memory.offload()
    # Nothing lent: the pool kept its size and its storage, the weights are on their way back.
    assert engine.kv.num_blocks == base == engine.kv.kv.shape[2]
    assert memory.failed_offloads == 1 and memory.offloads == 0
    assert engine.stats().offload_failures == 1
    assert engine.drafter.state in ("reloading", "on_device")
    assert memory.agrees()
    while engine.drafter.state != "on_device":
        memory.poll()
        time.sleep(0.01)
    # not tried again at once: memory that could not be had a moment ago rarely is now
    assert memory.growth_if_offloaded() is None
    memory.offload()
    assert engine.drafter.state == "on_device" and memory.offloads == 0
    engine.set_gamma(4)
    drafted = engine.stats().drafted_tokens
    while engine.has_unfinished():
        _drive(engine, 1, tokens)
    assert [tokens[i] for i in range(4)] == ar_outputs[:4]
    assert engine.stats().drafted_tokens > drafted, "the drafter did not come back"
    assert [e.kind for e in memory.events] == ["offload_failed", "reload_start", "reload_done"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_reload_whose_pool_cannot_shrink_keeps_the_memory_lent(prompts, ar_outputs, monkeypatch):
    from memory_faults import allocations_fail
    engine, memory, tokens = _decoding_without_drafts(prompts, steps=2)
    base = engine.kv.num_blocks
    memory.offload()
    grown = engine.kv.num_blocks
    assert grown > base
    _drive(engine, 2, tokens)
    with allocations_fail(monkeypatch):
        memory.start_reload()
    # The pool still holds the drafter's bytes, so the drafter stays off its device.
    assert engine.kv.num_blocks == grown == engine.kv.kv.shape[2]
    assert engine.drafter.state == "offloaded" and memory.failed_reloads == 1
    assert memory.agrees()
    while engine.has_unfinished():
        _drive(engine, 1, tokens)
    assert [tokens[i] for i in range(4)] == ar_outputs[:4]
    memory._retry_at = 0.0                 # (the retry's wait, skipped) and with memory it goes through
    memory.start_reload()
    assert engine.kv.num_blocks == base
    while memory.poll() is None:
        time.sleep(0.01)
    assert engine.drafter.state == "on_device" and memory.agrees()


def test_memory_events_are_bounded(monkeypatch):
    monkeypatch.setattr(ElasticMemory, "MAX_EVENTS", 4, raising=False)
    engine, memory = sd_engine_with_memory(kv_blocks=32)
    for _ in range(3):                      # 3 events a round trip
        memory.offload()
        memory.start_reload()
        while memory.poll() is None:
            time.sleep(0.01)
    assert memory.offloads == 3 and memory.reloads == 3
    assert [e.kind for e in memory.events] == ["reload_done", "offload", "reload_start", "reload_done"]


def test_weights_back_while_the_engine_is_idle_are_reported_back(prompts):
    """A reload still under way when the last request finishes completes on the idle loop: the
    drafter's state (what the metrics report) turns on_device without another request, and the
    reload is counted."""
    engine, memory = sd_engine_with_memory(kv_blocks=64)
    started = threading.Event()

    def offload_and_reload_at_the_end(outputs):       # on the loop thread, as a planner would
        if any(o.finished for o in outputs) and not started.is_set():
            memory.offload()
            memory.start_reload()
            started.set()

    loop = EngineLoop(engine, on_step=offload_and_reload_at_the_end)
    try:
        loop.submit("a", prompts[0], SamplingParams(max_tokens=2, temperature=0.0), lambda _out: None)
        assert started.wait(60), "the request never finished"
        deadline = time.monotonic() + 30
        while engine.drafter.state != "on_device" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.drafter.state == "on_device", f"still {engine.drafter.state} while idle"
        assert memory.offloads == 1 and memory.reloads == 1
        assert engine.kv.num_blocks == memory.base_blocks
    finally:
        loop.shutdown(timeout_s=30)


def test_an_idle_auto_engine_brings_its_offloaded_drafter_back(prompts):
    """Mode auto, the drafter offloaded in the last request's step (as the planner does under
    a burst): with no request left there is no step for the planner to decide a reload in, so
    the idle loop asks it; once idle for ``reload_after_s`` the weights come back, the pool
    shrinks to its drafter-on size, and not before."""
    reload_after_s = 0.3
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                                 gamma_max=4, kv_cache_bytes=64 * block_bytes(),
                                 planner={"reload_after_s": reload_after_s}))
    memory = engine.memory
    finished_at = []

    def offload_at_the_end(outputs):         # on the loop thread, after the step
        if any(o.finished for o in outputs) and not finished_at:
            finished_at.append(time.perf_counter())
            memory.offload()

    loop = EngineLoop(engine, on_step=offload_at_the_end)
    try:
        loop.submit("a", prompts[0], SamplingParams(max_tokens=2, temperature=0.0), lambda _out: None)
        deadline = time.monotonic() + 60
        while not (finished_at and memory.reloads) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert finished_at, "the request never finished"
        assert memory.offloads == 1 and engine.kv.num_blocks == memory.base_blocks and memory.reloads == 1, \
            f"idle with the drafter {engine.drafter.state}: {[e.kind for e in memory.events]}"
        assert engine.drafter.state == "on_device"
        start = next(e.t for e in memory.events if e.kind == "reload_start")
        # (idleness counts from the step's end, a moment before this hook ran; the loop looks
        # every 50 ms)
        assert start - finished_at[0] >= reload_after_s - 0.05
    finally:
        loop.shutdown(timeout_s=30)
