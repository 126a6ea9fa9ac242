"""Engines on the tiny pair, the prompts they decode, and the checks every engine test repeats."""
from __future__ import annotations

from pathlib import Path

import torch

from model_factory import TINY_DRAFTER, TINY_TARGET


def tiny_engine(mode: str = "ar", drafter: Path | str | None = TINY_DRAFTER, **kw):
    """An engine on the tiny target (and drafter, unless None; the drafter runs in its own
    worker for psd and auto, which need one). 16 MiB of KV cache unless told."""
    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine
    kw.setdefault("kv_cache_bytes", 16 << 20)
    if drafter is not None and mode in ("psd", "auto"):
        kw.setdefault("drafter_device", "cpu")
    return Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(drafter) if drafter is not None else None,
                               mode=mode, **kw))


def block_bytes(block_size: int = 16) -> int:
    """Bytes of one KV block of the tiny target in float32."""
    from backend.model.config import ModelConfig
    from backend.model.kv_cache import PagedKVCache
    return PagedKVCache.bytes_per_block(ModelConfig.from_pretrained(TINY_TARGET), block_size, torch.float32)


def code_prompts(n: int, first: int, stride: int, span: int) -> list[str]:
    """The first n prompts of the bundled code set, cut to mixed lengths: prompt i keeps
    first + stride * i % span characters."""
    from client.prompts import load_prompts
    return [p[: first + stride * i % span] for i, p in enumerate(load_prompts(n=n))]


def plain_outputs(prompts: list[str], params) -> list[list[int]]:
    """Plain decoding's tokens (the reference every speculative mode must equal)."""
    engine = tiny_engine("ar", drafter=None)
    try:
        return [c.output_ids for c in engine.generate(prompts, params)]
    finally:
        engine.close()


def assert_no_leaks(engine) -> None:
    """Every KV block free in the target's pool and the drafter's, no sequence left anywhere."""
    assert not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "target KV blocks leaked"
    if engine.drafter is not None:
        held = engine.drafter.stats(refresh=True)
        assert held.num_sequences == 0, "drafter still holds sequences"
        assert held.kv_usage == 0.0, "drafter KV blocks leaked"
    assert not any(engine.sub_batches.members), "a finished request is still in a sub-batch"
