"""Paged attention on the CPU: one C++ kernel (``csrc/paged_attention.cpp``) reads each
sequence's K/V through its block table once, writes the new tokens' K/V, and never builds a mask
or gathers a context. It serves every forward (prefill chunks, decode, verification); the
reference backend (:mod:`backend.model.attention.sdpa`) is what the tests compare it with.

Its metadata is the forward's layout itself (positions, slots, block tables, lengths), so a
captured step can take it as plain tensors.
"""
from __future__ import annotations

import torch

from backend.model.attention import kernels
from backend.model.attention.base import AttentionMetadata, advance_layout, layout_tensors
from backend.model.kv_cache import PagedKVCache


class PagedBackend:
    name = "paged"

    def __init__(self):
        if not kernels.load():
            raise RuntimeError(f"the paged attention kernel is unavailable: {kernels.error()}")

    def prepare(self, kv: PagedKVCache, seq_ids: list, num_cached: list[int],
                num_new: list[int], lookahead: int = 0) -> AttentionMetadata:
        return layout_tensors(kv, seq_ids, num_cached, num_new, lookahead=lookahead)

    def advance(self, kv: PagedKVCache, meta: AttentionMetadata, keep: list[int]) -> AttentionMetadata:
        return advance_layout(meta, keep, kv.device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return torch.ops.nightdraft.paged_attention(q, k, v, kv_cache, layer, meta.slot_mapping,
                                                    meta.block_tables, meta.query_start,
                                                    meta.context_lens, scale)
