"""The reference attention backend: PyTorch's scaled_dot_product_attention over each sequence's
context, gathered from the paged cache block by block.

Decoding and verifying sequences (at most ``SHORT_QUERY_LEN`` new tokens) share one padded batch;
prefill chunks get their own, so a chunk does not pad every decode in its step to its length.
Masks are additive, in the cache dtype, and built once per forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.model.attention.base import AttentionMetadata, layout_tensors
from backend.model.kv_cache import PagedKVCache

# Sequences feeding at most this many tokens (decode, verification of a draft) share one padded
# attention batch; longer ones (prefill chunks) get their own, so that a prefill chunk in the same
# step as many decodes does not pad every decode to the chunk's length.
SHORT_QUERY_LEN = 16


@dataclass
class AttentionGroup:
    """Sequences whose attention runs as one padded batch: their queries are gathered into a grid
    ``[n, max_query_len]`` and their contexts through ``block_tables`` into
    ``[n, max_blocks * block_size]`` keys. Index tensors are None where they would be the identity."""

    block_tables: torch.Tensor  # [n, max_blocks] long, padded with block 0
    # [n, 1, max_query_len, max_blocks * block_size] additive mask in the cache dtype: 0 where the
    # query may attend the key (key position <= query position), -inf where not.
    attn_mask: torch.Tensor
    max_query_len: int
    # [n * max_query_len]: flat token at each grid cell (padding cells repeat the sequence's last
    # token; their outputs are dropped).
    query_src: torch.Tensor | None
    grid_index: torch.Tensor | None  # [T_g]: grid cell of each of the group's tokens
    token_index: torch.Tensor | None  # [T_g]: flat index of each of the group's tokens


@dataclass
class SdpaMetadata(AttentionMetadata):
    groups: list[AttentionGroup] = None  # attention batches (usually one) covering all sequences


class SdpaBackend:
    name = "sdpa"

    def prepare(self, kv: PagedKVCache, seq_ids: list, num_cached: list[int],
                num_new: list[int], lookahead: int = 0) -> SdpaMetadata:
        meta = layout_tensors(kv, seq_ids, num_cached, num_new, cls=SdpaMetadata, lookahead=lookahead)
        B = len(seq_ids)
        short = [b for b in range(B) if num_new[b] <= SHORT_QUERY_LEN]
        long = [b for b in range(B) if num_new[b] > SHORT_QUERY_LEN]
        meta.groups = [self._group(kv, members, meta, num_cached, num_new, whole=len(members) == B)
                       for members in (short, long) if members]
        return meta

    def advance(self, kv: PagedKVCache, meta: SdpaMetadata, keep: list[int]) -> SdpaMetadata:
        h = meta.host
        return self.prepare(kv, [h.seq_ids[r] for r in keep], [int(h.lens[r]) for r in keep], [1] * len(keep))

    @staticmethod
    def _group(kv, members, meta: SdpaMetadata, num_cached, num_new, whole) -> AttentionGroup:
        """An attention batch over sequences ``members`` (batch indices, ascending)."""
        bs = kv.block_size
        starts = meta.query_start_loc
        max_q = max(num_new[b] for b in members)
        query_src, grid_index, token_index = [], [], []
        for i, b in enumerate(members):
            tokens = range(starts[b], starts[b + 1])
            query_src.extend(tokens)
            query_src.extend([starts[b + 1] - 1] * (max_q - num_new[b]))
            grid_index.extend(range(i * max_q, i * max_q + num_new[b]))
            token_index.extend(tokens)
        padded = len(query_src) != len(token_index)

        # Query i of a sequence sits at position num_cached + i and sees keys at positions <= that
        # (key j of the gathered context is at position j). Padding queries are clamped to the last
        # real position so that no mask row is empty.
        cached = torch.tensor([num_cached[b] for b in members])
        last = cached + torch.tensor([num_new[b] for b in members]) - 1
        q_pos = torch.minimum(cached[:, None] + torch.arange(max_q), last[:, None])
        max_blocks = max(-(-(num_cached[b] + num_new[b]) // bs) for b in members)
        visible = torch.arange(max_blocks * bs) <= q_pos[:, :, None]
        # Additive, in the cache dtype, so attention need not convert it in every layer.
        mask = torch.zeros(visible.shape, dtype=kv.dtype).masked_fill_(~visible, float("-inf"))

        dev = kv.device
        tables = meta.block_tables if whole else meta.block_tables[torch.tensor(members, device=dev)]
        return AttentionGroup(
            block_tables=tables[:, :max_blocks].contiguous(),
            attn_mask=mask.unsqueeze(1).to(dev),
            max_query_len=max_q,
            query_src=torch.tensor(query_src, device=dev) if padded or not whole else None,
            grid_index=torch.tensor(grid_index, device=dev) if padded else None,
            token_index=None if whole else torch.tensor(token_index, device=dev),
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               layer: int, meta: SdpaMetadata, scale: float) -> torch.Tensor:
        """Causal attention of the flat new tokens over their sequences' cached context.

        q ``[T, h, d]``, k/v ``[T, kvh, d]`` (the new tokens' keys/values, written to the cache here),
        the cache's whole storage and the layer to use. Returns ``[T, h, d]``.
        """
        T, h, d = q.shape
        kvh = k.shape[1]
        bs = kv_cache.shape[-1]
        k_cache = kv_cache[layer, 0]                                    # [blocks, kvh, d, bs]
        v_cache = kv_cache[layer, 1].view(kv_cache.shape[2], kvh, bs, d)  # [blocks, kvh, bs, d]
        blocks, offsets = meta.slot_mapping // bs, meta.slot_mapping % bs
        k_cache[blocks, :, :, offsets] = k      # keys are stored transposed within their block
        v_cache[blocks, :, offsets, :] = v

        out = None
        for g in meta.groups:  # usually one
            # Each sequence's context, gathered block by block: [n, kvh, S, d], S = max_blocks * block_size.
            n, max_blocks = g.block_tables.shape
            S = max_blocks * bs
            tables = g.block_tables.view(-1)
            keys = (k_cache.index_select(0, tables).view(n, max_blocks, kvh, d, bs)
                    .permute(0, 2, 1, 4, 3).reshape(n, kvh, S, d))
            values = (v_cache.index_select(0, tables).view(n, max_blocks, kvh, bs, d)
                      .transpose(1, 2).reshape(n, kvh, S, d))
            # Queries gathered into a padded grid [n, h, max_q, d].
            qg = q if g.query_src is None else q.index_select(0, g.query_src)
            qg = qg.reshape(n, g.max_query_len, h, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=g.attn_mask, scale=scale, enable_gqa=kvh != h
            )
            o = o.transpose(1, 2).reshape(-1, h, d)
            if g.grid_index is not None:
                o = o.index_select(0, g.grid_index)  # drop padding queries
            if g.token_index is None:  # the group is the whole batch, in order
                return o
            if out is None:
                out = q.new_empty(T, h, d)
            out.index_copy_(0, g.token_index, o)
        return out
