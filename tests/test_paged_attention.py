"""The paged attention kernel against the reference backend (SDPA over gathered contexts).

Every layout the kernel has a path for: head sizes with a compiled-in accumulator (32, 64, 128)
and without (16, 48), block sizes that are whole vector chunks (16) and not (4, 5, 24),
grouped-query, multi-query and plain multi-head attention, float32 and bfloat16, decode, verify
and prefill rows in one call, blocks scattered over the pool; plus what a captured step adds
(padding tokens and an empty sequence) and what it must refuse.
"""
from __future__ import annotations

import random

import pytest
import torch

from backend.model.attention import kernels
from backend.model.attention.paged import PagedBackend
from backend.model.attention.sdpa import SdpaBackend
from backend.model.captured import step_tensors
from backend.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"no paged attention kernel: {kernels.error()}")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def scattered_cache(heads, kv_heads, head_dim, block_size, lens, dtype=torch.float32, seed=0):
    """A cache whose sequences' blocks interleave (grown round-robin, a block at a time), filled
    with random K/V; returns the cache and the sequence ids."""
    torch.manual_seed(seed)
    total_blocks = sum(-(-n // block_size) for n in lens) + 3
    kv = PagedKVCache(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, num_blocks=total_blocks,
                      block_size=block_size, dtype=dtype)
    kv.kv.normal_()
    ids = [f"s{i}" for i in range(len(lens))]
    for upto in range(block_size, max(lens) + block_size, block_size):
        for sid, n in zip(ids, lens):
            assert kv.ensure_capacity(sid, min(n, upto))
    return kv, ids


def run_both(kv, ids, lens, q_lens, heads, layer=1, dtype=torch.float32):
    """The same new tokens through both backends, each on its own copy of the cache: outputs and
    the caches after the K/V writes."""
    cached = [n - q for n, q in zip(lens, q_lens)]
    T = sum(q_lens)
    d, kvh = kv.head_dim, kv.num_kv_heads
    q = torch.randn(T, heads, d).to(dtype)
    k = torch.randn(T, kvh, d).to(dtype)
    v = torch.randn(T, kvh, d).to(dtype)
    results = []
    for backend in (SdpaBackend(), PagedBackend()):
        storage = kv.kv.clone()
        meta = backend.prepare(kv, ids, cached, q_lens)
        out = backend.attend(q, k, v, storage, layer, meta, d ** -0.5)
        results.append((out, storage))
    return results


@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 1), (4, 4)])
def test_matches_the_reference_for_every_head_layout(head_dim, heads, kv_heads):
    lens, q_lens = [37, 16, 70, 5], [1, 5, 20, 5]
    kv, ids = scattered_cache(heads, kv_heads, head_dim, 16, lens)
    (ref, ref_cache), (got, got_cache) = run_both(kv, ids, lens, q_lens, heads)
    torch.testing.assert_close(got, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.equal(got_cache, ref_cache), "the kernel wrote the new K/V elsewhere than the reference"


@pytest.mark.parametrize("block_size", [4, 5, 16, 24])
def test_matches_the_reference_for_every_block_size(block_size):
    lens, q_lens = [41, 9, 100], [9, 1, 3]
    kv, ids = scattered_cache(8, 4, 32, block_size, lens)
    (ref, ref_cache), (got, got_cache) = run_both(kv, ids, lens, q_lens, 8)
    torch.testing.assert_close(got, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.equal(got_cache, ref_cache)


def test_bfloat16_matches_the_reference_within_its_precision():
    lens, q_lens = [33, 64, 7], [1, 5, 7]
    kv, ids = scattered_cache(8, 4, 32, 16, lens, dtype=torch.bfloat16)
    (ref, ref_cache), (got, got_cache) = run_both(kv, ids, lens, q_lens, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert torch.equal(got_cache, ref_cache)


def test_a_row_depends_only_on_its_own_query_and_keys():
    """Batch-invariance: a sequence's output is bitwise the same alone and in a batch, and a
    verify row equals the decode of the same token (what lets speculation stay exact)."""
    random.seed(1)
    lens = [50, 80, 17]
    kv, ids = scattered_cache(8, 4, 32, 16, lens)
    cached = [n - 5 for n in lens]
    q = torch.randn(15, 8, 32)
    k = torch.randn(15, 4, 32)
    v = torch.randn(15, 4, 32)
    paged = PagedBackend()
    meta = paged.prepare(kv, ids, cached, [5, 5, 5])
    together = paged.attend(q, k, v, kv.kv.clone(), 0, meta, 0.2)
    storage = kv.kv.clone()
    alone = paged.attend(q[5:10], k[5:10], v[5:10], storage, 0, paged.prepare(kv, ids[1:2], cached[1:2], [5]), 0.2)
    assert torch.equal(together[5:10], alone)
    # the last of the five verified tokens, decoded on its own after the first four were written
    last = paged.attend(q[9:10], k[9:10], v[9:10], storage, 0, paged.prepare(kv, ids[1:2], [lens[1] - 1], [1]), 0.2)
    assert torch.equal(last, alone[4:5])


def test_padding_tokens_and_an_empty_sequence_are_inert():
    """What a captured step adds (backend.model.captured.step_tensors): an empty sequence and a
    zero table column, and tokens past the last sequence with slot -1. Real rows are unchanged,
    padding rows are zero, and nothing is written for them."""
    lens = [23]
    kv, ids = scattered_cache(8, 4, 32, 16, lens)
    paged = PagedBackend()
    meta = paged.prepare(kv, ids, [22], [1])
    q, k, v = torch.randn(3, 8, 32), torch.randn(3, 4, 32), torch.randn(3, 4, 32)
    plain_cache = kv.kv.clone()
    plain = paged.attend(q[:1], k[:1], v[:1], plain_cache, 0, meta, 0.2)
    padded_meta = step_tensors(meta)
    assert padded_meta.block_tables.shape == (2, 2) and padded_meta.context_lens.tolist() == [23, 0]
    slots = torch.cat((meta.slot_mapping, torch.tensor([-1, -1])))
    padded_cache = kv.kv.clone()
    out = torch.ops.nightdraft.paged_attention(q, k, v, padded_cache, 0, slots, padded_meta.block_tables,
                                               padded_meta.query_start, padded_meta.context_lens, 0.2)
    assert torch.equal(out[:1], plain) and not out[1:].any()
    assert torch.equal(padded_cache, plain_cache)


def test_refuses_tables_and_slots_outside_the_pool():
    kv, ids = scattered_cache(8, 4, 32, 16, [20])
    paged = PagedBackend()
    meta = paged.prepare(kv, ids, [19], [1])
    q, k, v = torch.randn(1, 8, 32), torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    bad_table = meta.block_tables.clone()
    bad_table[0, 1] = kv.num_blocks + 5
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.nightdraft.paged_attention(q, k, v, kv.kv, 0, meta.slot_mapping, bad_table,
                                             meta.query_start, meta.context_lens, 0.2)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.nightdraft.paged_attention(q, k, v, kv.kv, 0, meta.slot_mapping + kv.num_blocks * 16,
                                             meta.block_tables, meta.query_start, meta.context_lens, 0.2)
    with pytest.raises(RuntimeError, match="layer"):
        torch.ops.nightdraft.paged_attention(q, k, v, kv.kv, 7, meta.slot_mapping, meta.block_tables,
                                             meta.query_start, meta.context_lens, 0.2)


def test_advancing_a_layout_equals_preparing_it_afresh():
    """The drafter's next position: advance_layout from the previous forward's host arrays gives
    what a full prepare from the block tables gives."""
    kv, ids = scattered_cache(8, 4, 32, 4, [30, 9, 14])
    paged = PagedBackend()
    first = paged.prepare(kv, ids, [27, 7, 13], [1, 2, 1], lookahead=3)
    nxt = paged.advance(kv, first, [0, 2])
    fresh = paged.prepare(kv, [ids[0], ids[2]], [28, 14], [1, 1])
    for field in ("positions", "slot_mapping", "context_lens", "query_start", "last_token_indices"):
        assert torch.equal(getattr(nxt, field), getattr(fresh, field)), field
    width = fresh.block_tables.shape[1]
    assert torch.equal(nxt.block_tables[:, :width], fresh.block_tables)
    with pytest.raises(ValueError, match="lookahead"):
        paged.advance(kv, paged.prepare(kv, ids, [27, 7, 11], [1, 1, 1]), [0, 1, 2])
