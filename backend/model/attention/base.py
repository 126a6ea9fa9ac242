"""What every attention backend builds and offers.

Tokens of a forward are flat: the ``T`` new tokens of ``B`` sequences concatenated, sequence ``b``
owning ``query_lens[b]`` consecutive tokens starting at ``query_start_loc[b]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
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
    block_tables: torch.Tensor  # [B, max_blocks] long: each context's blocks, padded with 0
    query_start: torch.Tensor  # [B + 1] long: query_start_loc as a tensor
    host: "HostLayout | None" = None  # the same on the host, for advancing to the next position

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
                num_new: list[int], lookahead: int = 0) -> AttentionMetadata:
        """Metadata for one forward in which sequence ``seq_ids[b]`` already has
        ``num_cached[b]`` tokens in the cache and feeds ``num_new[b]`` new ones (capacity for
        them must already be ensured; `lookahead`: see :func:`layout_tensors`)."""

    def advance(self, kv: PagedKVCache, meta: AttentionMetadata, keep: list[int]) -> AttentionMetadata:
        """Metadata for the next forward, in which sequences `keep` (rows of `meta`) feed the
        token after their context (a drafter's next position)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write the new tokens' k/v ``[T, kvh, d]`` into layer `layer` of the cache's storage
        (``PagedKVCache.kv``, laid out as :class:`PagedKVCache` says) and return the causal
        attention of ``q`` ``[T, h, d]`` over each sequence's context, ``[T, h, d]``."""


@dataclass
class HostLayout:
    """What advancing a layout by one token per sequence needs, kept on the host."""
    seq_ids: list
    tables: np.ndarray      # [B, width] the blocks of each sequence's context and lookahead
    filled: np.ndarray      # [B] how many of a row's entries are its blocks (the rest is padding)
    lens: np.ndarray        # [B] tokens in cache per sequence after the forward
    block_size: int


def layout_tensors(kv: PagedKVCache, seq_ids: list, num_cached: list[int], num_new: list[int],
                   cls: type = AttentionMetadata, lookahead: int = 0, **extra) -> AttentionMetadata:
    """The layout of one forward in which sequence ``seq_ids[b]`` has ``num_cached[b]`` tokens in
    the cache and feeds ``num_new[b]`` new ones, computed with array arithmetic (no loop over
    tokens). Capacity for the new tokens must already be ensured; with `lookahead`, the block
    tables also hold the blocks of that many further tokens where they are allocated (so that
    :func:`advance_layout` can follow without reading the tables again)."""
    B = len(seq_ids)
    if not (B == len(num_cached) == len(num_new)) or B == 0:
        raise ValueError("prepare needs equally long, non-empty seq_ids / num_cached / num_new")
    cached = np.asarray(num_cached, dtype=np.int64)
    new = np.asarray(num_new, dtype=np.int64)
    if (new < 1).any() or (cached < 0).any():
        b = int(np.flatnonzero((new < 1) | (cached < 0))[0])
        raise ValueError(f"sequence {seq_ids[b]!r}: num_new must be >= 1 and num_cached >= 0")
    bs = kv.block_size
    lens = cached + new
    need = -(-lens // bs)
    ahead = -(-(lens + lookahead) // bs)
    tables = np.zeros((B, int(ahead.max())), dtype=np.int64)
    filled = np.empty(B, dtype=np.int64)
    for b, sid in enumerate(seq_ids):
        table = kv.table_view(sid)
        n = int(need[b])
        if len(table) < n:
            raise ValueError(f"sequence {sid!r} has room for {len(table) * bs} tokens, needs "
                             f"{int(lens[b])}; call ensure_capacity first")
        keep = filled[b] = min(len(table), int(ahead[b]))    # blocks past the context are not needed
        tables[b, :keep] = table[:keep]
    starts = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(new, out=starts[1:])
    T = int(starts[-1])
    owner = np.repeat(np.arange(B), new)
    positions = np.arange(T, dtype=np.int64) + np.repeat(cached - starts[:-1], new)
    slots = tables[owner, positions // bs] * bs + positions % bs
    dev = kv.device

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(dev)

    return cls(positions=tensor(positions), slot_mapping=tensor(slots), context_lens=tensor(lens),
               query_lens=new.tolist(), query_start_loc=starts.tolist(),
               last_token_indices=tensor(starts[1:] - 1), block_tables=tensor(tables),
               query_start=tensor(starts), host=HostLayout(list(seq_ids), tables, filled, lens, bs), **extra)


def advance_layout(meta: AttentionMetadata, keep: list[int], device, cls: type = AttentionMetadata,
                   **extra) -> AttentionMetadata:
    """The layout of the forward after `meta`'s in which sequences `keep` (its rows) feed one
    token each, the one after their context: arithmetic on the host arrays, no table read. Their
    blocks must be in `meta`'s tables (a forward built with enough `lookahead`)."""
    h = meta.host
    rows = np.asarray(keep, dtype=np.int64)
    whole = len(rows) == len(h.lens) and bool((rows == np.arange(len(rows))).all())
    tables = h.tables if whole else h.tables[rows]
    filled = h.filled if whole else h.filled[rows]
    positions = h.lens[rows]
    bs = h.block_size
    if (positions // bs >= filled).any():
        raise ValueError("advance_layout: a sequence's next block is not in the tables (lookahead too short)")
    lens = positions + 1
    slots = tables[np.arange(len(rows)), positions // bs] * bs + positions % bs
    B = len(rows)
    starts = np.arange(B + 1, dtype=np.int64)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return cls(positions=tensor(positions), slot_mapping=tensor(slots), context_lens=tensor(lens),
               query_lens=[1] * B, query_start_loc=starts.tolist(), last_token_indices=tensor(starts[1:] - 1),
               block_tables=tensor(tables), query_start=tensor(starts),
               host=HostLayout([h.seq_ids[r] for r in keep], tables, filled, lens, bs), **extra)
