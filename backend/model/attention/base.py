"""What every attention backend builds and offers.

Tokens of a forward are flat: the ``T`` new tokens of ``B`` sequences concatenated, sequence ``b``
owning ``query_lens[b]`` consecutive tokens starting at ``query_start_loc[b]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from backend.model.kv_cache import PagedKVCache


@dataclass
class AttentionMetadata:
    """Built once per forward and shared by all layers; tensors are on the cache's device.
    A backend extends it with what its kernel needs."""

    positions: torch.Tensor  # [T] long: position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] long: flat cache slot where each new token's K/V goes
    context_lens: torch.Tensor  # [B] long: tokens in cache per sequence after this forward
    query_lens: list[int]  # new tokens per sequence
    query_start_loc: list[int]  # [B + 1] prefix sums of query_lens
    last_token_indices: torch.Tensor  # [B] long: flat index of each sequence's last new token

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, kv: PagedKVCache, seq_ids: list, num_cached: list[int],
                num_new: list[int]) -> AttentionMetadata:
        """Metadata for one forward in which sequence ``seq_ids[b]`` already has
        ``num_cached[b]`` tokens in the cache and feeds ``num_new[b]`` new ones (capacity for
        them must already be ensured)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write the new tokens' k/v ``[T, kvh, d]`` into the layer's caches
        ``[num_blocks, block_size, kvh, d]`` and return the causal attention of ``q``
        ``[T, h, d]`` over each sequence's context, ``[T, h, d]``."""


@dataclass
class TokenLayout:
    """Where a forward's new tokens sit: per sequence its blocks, per token its position and slot."""
    tables: list[list[int]]     # per sequence: the blocks its context (after this forward) uses
    positions: list[int]
    slots: list[int]
    starts: list[int]           # query_start_loc


def token_layout(kv: PagedKVCache, seq_ids: list, num_cached: list[int], num_new: list[int]) -> TokenLayout:
    B = len(seq_ids)
    if not (B == len(num_cached) == len(num_new)) or B == 0:
        raise ValueError("prepare needs equally long, non-empty seq_ids / num_cached / num_new")
    bs = kv.block_size
    layout = TokenLayout([], [], [], [0])
    for sid, cached, new in zip(seq_ids, num_cached, num_new):
        if new < 1 or cached < 0:
            raise ValueError(f"sequence {sid!r}: num_new must be >= 1 and num_cached >= 0")
        table = kv.table_view(sid)
        need = -(-(cached + new) // bs)
        if len(table) < need:
            raise ValueError(f"sequence {sid!r} has room for {len(table) * bs} tokens, needs "
                             f"{cached + new}; call ensure_capacity first")
        layout.tables.append(table[:need])  # blocks past the context are not needed for attention
        for p in range(cached, cached + new):
            layout.positions.append(p)
            layout.slots.append(table[p // bs] * bs + p % bs)
        layout.starts.append(layout.starts[-1] + new)
    return layout
