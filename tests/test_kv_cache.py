"""Paged KV cache: block accounting, per-step metadata, and resizing under live sequences."""

from __future__ import annotations

import pytest
import torch

from backend.model.attention import SdpaBackend
from backend.model.kv_cache import BlockAllocator, NoFreeBlocks, PagedKVCache
from backend.model.llama import CausalLM
from backend.model.config import ModelConfig
from memory_faults import OUT_OF_MEMORY, allocations_fail

SDPA = SdpaBackend()

CFG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def make_cache(num_blocks=8, block_size=4, config=CFG) -> PagedKVCache:
    return PagedKVCache(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
    )


# ---- BlockAllocator -----------------------------------------------------------------------------


def test_allocator_accounting():
    a = BlockAllocator(6)
    assert (a.num_blocks, a.num_free, a.num_used) == (6, 6, 0)
    x = a.allocate(2)
    y = a.allocate(3)
    assert x == [0, 1] and y == [2, 3, 4]  # lowest ids first
    assert (a.num_free, a.num_used) == (1, 5)
    with pytest.raises(NoFreeBlocks):
        a.allocate(2)
    assert a.num_free == 1  # the failed allocation took nothing
    a.free(x)
    assert a.allocate(1) == [0]
    a.free([0])
    a.free(y)
    assert (a.num_free, a.num_used) == (6, 0)
    assert a.allocate(0) == []


def test_allocator_rejects_double_and_foreign_free():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.free(blocks[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free(blocks[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free([blocks[1], blocks[1]])
    with pytest.raises(ValueError, match="not in the pool"):
        a.free([7])
    assert a.num_used == 1


def test_allocator_resize():
    a = BlockAllocator(4)
    a.allocate(4)
    assert a.resize(6) == {}
    assert (a.num_blocks, a.num_free) == (6, 2)
    assert a.allocate(2) == [4, 5]
    a.free([0, 1, 2])
    assert a.resize(4) == {4: 0, 5: 1}  # used blocks above the new size move to free low ids
    assert (a.num_blocks, a.num_used, a.num_free) == (4, 3, 1)
    assert a.allocate(1) == [2]
    with pytest.raises(NoFreeBlocks):
        a.resize(3)
    assert (a.num_blocks, a.num_used) == (4, 4)


# ---- PagedKVCache bookkeeping ---------------------------------------------------------------


def test_sizing():
    per_block = PagedKVCache.bytes_per_block(CFG, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 8 * 4  # layers * (K, V) * tokens * kv heads * head_dim * 4 B
    assert PagedKVCache.bytes_per_block(CFG, 16, torch.bfloat16) == per_block // 2
    cache = PagedKVCache.for_model(CFG, 10 * per_block + 5, block_size=16, dtype=torch.float32)
    assert cache.num_blocks == 10 and cache.block_size == 16
    assert cache.kv.numel() * 4 == 10 * per_block
    k, v = cache.layer(1)
    assert k.shape == (10, 2, 8, 16) and v.shape == (10, 2, 16, 8)   # keys transposed within a block
    with pytest.raises(ValueError, match="less than one block"):
        PagedKVCache.for_model(CFG, per_block - 1, block_size=16, dtype=torch.float32)


def test_ensure_truncate_free_accounting():
    cache = make_cache(num_blocks=8, block_size=4)
    assert cache.blocks_needed("a", 9) == 3
    assert cache.ensure_capacity("a", 9)
    assert cache.block_table("a") == [0, 1, 2] and cache.num_used_blocks == 3
    assert cache.blocks_needed("a", 12) == 0 and cache.blocks_needed("a", 13) == 1
    assert cache.ensure_capacity("a", 12)  # fits in the blocks it has
    assert cache.num_used_blocks == 3
    assert cache.ensure_capacity(5, 16)
    assert cache.block_table(5) == [3, 4, 5, 6]
    assert cache.usage() == pytest.approx(7 / 8)

    # All or nothing: "a" needs 2 more blocks, only 1 is free.
    assert not cache.ensure_capacity("a", 20)
    assert cache.block_table("a") == [0, 1, 2] and cache.num_free_blocks == 1
    assert not cache.ensure_capacity("new", 5)
    assert "new" not in cache.seq_ids()

    cache.truncate(5, 9)  # 9 tokens need 3 blocks
    assert cache.block_table(5) == [3, 4, 5] and cache.num_free_blocks == 2
    cache.truncate(5, 8)  # 8 tokens: exactly 2 blocks
    assert cache.block_table(5) == [3, 4]
    cache.truncate(5, 8)
    assert cache.block_table(5) == [3, 4]
    assert cache.ensure_capacity("a", 20)
    assert cache.block_table("a") == [0, 1, 2, 5, 6]

    assert sorted(cache.seq_ids(), key=str) == [5, "a"]
    cache.truncate("a", 0)
    assert cache.block_table("a") == []
    cache.free("a")
    cache.free(5)
    cache.free("never-seen")  # no-op
    cache.truncate("never-seen", 3)  # no-op: it holds nothing
    assert "never-seen" not in cache.seq_ids()
    assert cache.num_free_blocks == cache.num_blocks == 8 and cache.num_used_blocks == 0
    assert cache.seq_ids() == [] and cache.usage() == 0.0


def test_prepare_metadata():
    cache = make_cache(num_blocks=10, block_size=4)
    # interleave the sequences' blocks
    for n in (4, 8):
        cache.ensure_capacity("p", n)
        cache.ensure_capacity("d", n)
    assert cache.block_table("p") == [0, 2] and cache.block_table("d") == [1, 3]
    cache.ensure_capacity("d", 9)  # d gets block 4, which it only needs after this step
    meta = SDPA.prepare(cache, ["p", "d"], [3, 5], [3, 1])
    assert meta.positions.tolist() == [3, 4, 5, 5]
    # p: pos 3 -> block 0 offset 3; pos 4, 5 -> block 2 offsets 0, 1. d: pos 5 -> block 3 offset 1
    assert meta.slot_mapping.tolist() == [3, 8, 9, 13]
    assert meta.block_tables.tolist() == [[0, 2], [1, 3]]  # block 4 is beyond d's context
    assert meta.context_lens.tolist() == [6, 6]
    assert meta.query_lens == [3, 1] and meta.query_start_loc == [0, 3, 4]
    assert meta.max_query_len == 3 and meta.num_seqs == 2 and meta.num_tokens == 4
    assert meta.last_token_indices.tolist() == [2, 3]
    (g,) = meta.groups
    assert g.max_query_len == 3 and g.block_tables.tolist() == [[0, 2], [1, 3]]
    assert g.query_src.tolist() == [0, 1, 2, 3, 3, 3]  # d's grid row padded with its last token
    assert g.grid_index.tolist() == [0, 1, 2, 3] and g.token_index is None
    visible = g.attn_mask[:, 0] == 0
    assert visible.shape == (2, 3, 8)
    assert visible[0].sum(-1).tolist() == [4, 5, 6]  # p's queries at positions 3, 4, 5
    assert visible[1, 0].sum() == 6 and visible[1, 0, :6].all()  # d's one query at position 5

    with pytest.raises(ValueError, match="ensure_capacity"):
        SDPA.prepare(cache, ["p"], [8], [1])
    with pytest.raises(ValueError, match="ensure_capacity"):
        SDPA.prepare(cache, ["unknown"], [0], [1])

    (g,) = SDPA.prepare(cache, ["p", "d"], [4, 4], [2, 2]).groups
    assert g.query_src is None and g.grid_index is None  # no padding: the flat tokens are the grid

    # A prefill chunk gets its own attention batch, apart from the short queries.
    cache.ensure_capacity("long", 20)
    meta = SDPA.prepare(cache, ["p", "long", "d"], [4, 0, 4], [2, 20, 1])
    short, long = meta.groups
    assert short.block_tables.tolist() == [[0, 2], [1, 3]] and short.max_query_len == 2
    assert short.token_index.tolist() == [0, 1, 22] and short.query_src.tolist() == [0, 1, 22, 22]
    assert long.token_index.tolist() == list(range(2, 22)) and long.grid_index is None
    assert long.max_query_len == 20 and long.block_tables.shape == (1, 5)
    assert meta.block_tables.shape == (3, 5)


# ---- resize under live sequences ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = CausalLM(CFG).eval().requires_grad_(False)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def feed(model, cache, batch):
    """batch: list of (seq_id, num_cached, tokens); returns the flat logits."""
    for sid, cached, toks in batch:
        assert cache.ensure_capacity(sid, cached + len(toks))
    meta = SDPA.prepare(cache, [b[0] for b in batch], [b[1] for b in batch], [len(b[2]) for b in batch])
    with torch.no_grad():
        return model(torch.tensor([t for b in batch for t in b[2]]), meta, cache.kv)


def test_resize_grow_then_shrink_keeps_sequences(model):
    g = torch.Generator().manual_seed(1)
    prompts = {s: torch.randint(0, 64, (n,), generator=g).tolist() for s, n in (("a", 11), ("b", 7))}
    cont = {"a": [3, 9, 27], "b": [5]}

    cache = make_cache(num_blocks=4, block_size=4)
    assert cache.ensure_capacity("filler", 16)  # the whole pool
    cache.resize(12)
    assert cache.num_blocks == 12 and cache.num_free_blocks == 8
    assert cache.block_table("filler") == [0, 1, 2, 3]
    feed(model, cache, [("a", 0, prompts["a"]), ("b", 0, prompts["b"])])
    assert cache.block_table("a") == [4, 5, 6] and cache.block_table("b") == [7, 8]
    cache.free("filler")

    # Continuation logits before shrinking, then roll the continuation back.
    batch = [("a", 11, cont["a"]), ("b", 7, cont["b"])]
    before = feed(model, cache, batch)
    cache.truncate("a", 11)
    cache.truncate("b", 7)
    k_before = {s: [cache.layer(0)[0][b].clone() for b in cache.block_table(s)] for s in ("a", "b")}

    cache.resize(5)  # all five used blocks (4..8) must move below 5
    assert cache.num_blocks == 5 and cache.num_used_blocks == 5 and cache.num_free_blocks == 0
    assert all(b < 5 for s in ("a", "b") for b in cache.block_table(s))
    for s in ("a", "b"):
        for blk, old in zip(cache.block_table(s), k_before[s]):
            assert torch.equal(cache.layer(0)[0][blk], old)
    assert cache.kv.shape[2] == 5

    cache.resize(7)  # room for "a" to grow into a fourth block again
    after = feed(model, cache, batch)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)

    # And equal to a fresh, never-resized cache.
    fresh = make_cache(num_blocks=8, block_size=4)
    ref_a = feed(model, fresh, [("a", 0, prompts["a"] + cont["a"])])
    torch.testing.assert_close(after[:3], ref_a[11:], atol=1e-5, rtol=1e-5)


def test_shrink_below_used_raises_and_changes_nothing(model):
    cache = make_cache(num_blocks=8, block_size=4)
    feed(model, cache, [("x", 0, list(range(10))), ("y", 0, list(range(20, 27)))])
    cache.free("x")  # leaves y in blocks 3, 4
    assert cache.block_table("y") == [3, 4]
    cache.ensure_capacity("z", 12)  # z takes 0, 1, 2
    snapshot = cache.kv.clone()
    tables = {s: cache.block_table(s) for s in cache.seq_ids()}
    with pytest.raises(NoFreeBlocks):
        cache.resize(4)
    assert cache.num_blocks == 8 and cache.num_used_blocks == 5
    assert {s: cache.block_table(s) for s in cache.seq_ids()} == tables
    assert torch.equal(cache.kv, snapshot)
    cache.resize(5)  # exactly enough: nothing above 5 is used, so nothing moves
    assert cache.num_blocks == 5 and cache.block_table("y") == [3, 4]
    assert torch.equal(cache.kv, snapshot[:, :, :5])


def _storage_agrees(cache: PagedKVCache) -> None:
    """Every block the allocator can hand out, and every block a table holds, is in the storage."""
    assert cache.kv.shape[2] == cache.num_blocks
    assert all(k.shape[0] == cache.num_blocks for k, _ in (cache.layer(i) for i in range(cache.num_layers)))
    assert all(b < cache.num_blocks for s in cache.seq_ids() for b in cache.table_view(s))
    assert cache.num_free_blocks + cache.num_used_blocks == cache.num_blocks


@pytest.mark.parametrize("new_size", [12, 5], ids=["grow", "shrink"])
def test_a_resize_that_cannot_allocate_changes_nothing(model, monkeypatch, new_size):
    cache = make_cache(num_blocks=8, block_size=4)
    feed(model, cache, [("x", 0, list(range(10))), ("y", 0, list(range(20, 27)))])
    cache.free("x")                      # y keeps blocks 3 and 4: a shrink to 5 moves nothing,
    cache.ensure_capacity("z", 8)        # z takes 0, 1; a shrink to 3 would have to move
    snapshot = cache.kv.clone()
    tables = {s: cache.block_table(s) for s in cache.seq_ids()}
    free = cache.num_free_blocks
    with allocations_fail(monkeypatch), pytest.raises(OUT_OF_MEMORY):
        cache.resize(new_size)
    assert cache.num_blocks == 8 and cache.num_free_blocks == free
    assert {s: cache.block_table(s) for s in cache.seq_ids()} == tables
    assert torch.equal(cache.kv, snapshot)
    _storage_agrees(cache)
    # and it still works: every free block can be taken, and each is in the storage
    assert cache.ensure_capacity("w", cache.num_free_blocks * cache.block_size)
    _storage_agrees(cache)
    cache.free("w")
    cache.resize(new_size)               # with memory, the same resize goes through
    assert cache.num_blocks == new_size
    _storage_agrees(cache)


def test_a_shrink_that_moves_blocks_and_cannot_allocate_changes_nothing(model, monkeypatch):
    cache = make_cache(num_blocks=8, block_size=4)
    feed(model, cache, [("x", 0, list(range(12))), ("y", 0, list(range(20, 27)))])
    cache.free("x")                      # y in blocks 3, 4: a shrink to 3 must move both
    snapshot = cache.kv.clone()
    with allocations_fail(monkeypatch), pytest.raises(OUT_OF_MEMORY):
        cache.resize(3)
    assert cache.block_table("y") == [3, 4]
    assert torch.equal(cache.kv, snapshot), "K/V moved although the resize failed"
    _storage_agrees(cache)
    cache.resize(3)
    assert cache.block_table("y") == [0, 1]
    assert torch.equal(cache.kv[:, :, :2], snapshot[:, :, 3:5])


def test_cache_rejects_bad_sizes():
    with pytest.raises(ValueError):
        make_cache(num_blocks=0)
    cache = make_cache(num_blocks=2)
    with pytest.raises(ValueError):
        cache.resize(0)
