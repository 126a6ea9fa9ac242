"""Paged KV cache: it allocates blocks and stores K/V; how attention reads them is the
attention backend's business (:mod:`backend.model.attention`).

The cache is a pool of fixed-size blocks, each holding ``block_size`` tokens of K and V for every
layer. A sequence owns a list of blocks (its *block table*); token ``p`` of the sequence lives in
block ``table[p // block_size]`` at offset ``p % block_size``, i.e. at flat *slot*
``table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable

import torch

from backend.model.config import ModelConfig


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks in the pool."""


class BlockAllocator:
    """Bookkeeping for a pool of ``num_blocks`` block ids (no tensors).

    Allocation always hands out the lowest free ids, which keeps the used blocks packed at the
    bottom of the pool so that shrinking it rarely has to move anything.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_blocks = num_blocks
        self._free_heap = list(range(num_blocks))  # sorted, hence a valid heap
        self._free_set = set(self._free_heap)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free_set)

    @property
    def num_used(self) -> int:
        return self._num_blocks - len(self._free_set)

    def is_free(self, block: int) -> bool:
        return block in self._free_set

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free_set):
            raise NoFreeBlocks(f"need {n} blocks, only {len(self._free_set)} free")
        blocks = [heapq.heappop(self._free_heap) for _ in range(n)]
        self._free_set.difference_update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for b in blocks:
            if not 0 <= b < self._num_blocks:
                raise ValueError(f"block {b} is not in the pool (size {self._num_blocks})")
            if b in self._free_set:
                raise ValueError(f"double free of block {b}")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"double free: duplicate blocks in {blocks}")
        for b in blocks:
            heapq.heappush(self._free_heap, b)
        self._free_set.update(blocks)

    def resize(self, num_blocks: int) -> dict[int, int]:
        """Grow or shrink the pool to ``num_blocks``.

        When shrinking, used blocks with ids >= ``num_blocks`` are relocated to free ids below it;
        returns that relocation as ``{old_id: new_id}`` (empty when growing). The caller must move the
        data and rewrite its block tables. Raises :class:`NoFreeBlocks` (changing nothing) if more
        than ``num_blocks`` blocks are in use.
        """
        moves = self.relocation(num_blocks)
        self.commit_resize(num_blocks, moves)
        return moves

    def relocation(self, num_blocks: int) -> dict[int, int]:
        """What :meth:`resize` to ``num_blocks`` would move, ``{old_id: new_id}``, changing
        nothing. Raises :class:`NoFreeBlocks` if more than ``num_blocks`` blocks are in use."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks >= self._num_blocks:
            return {}
        if self.num_used > num_blocks:
            raise NoFreeBlocks(
                f"cannot shrink the pool to {num_blocks} blocks: {self.num_used} are in use"
            )
        moving = [b for b in range(num_blocks, self._num_blocks) if b not in self._free_set]
        targets = sorted(b for b in self._free_set if b < num_blocks)[: len(moving)]
        return dict(zip(moving, targets))

    def commit_resize(self, num_blocks: int, moves: dict[int, int]) -> None:
        """Take the new size, with `moves` as :meth:`relocation` planned it for this state."""
        old = self._num_blocks
        if num_blocks >= old:
            for b in range(old, num_blocks):
                heapq.heappush(self._free_heap, b)
            self._free_set.update(range(old, num_blocks))
        else:
            free = {b for b in self._free_set if b < num_blocks} - set(moves.values())
            self._free_set = free
            self._free_heap = sorted(free)
        self._num_blocks = num_blocks


class PagedKVCache:
    """K/V storage for every layer plus the block tables of the sequences using it.

    Storage is one tensor ``[num_layers, 2, num_blocks, num_kv_heads, head_dim, block_size]``
    (a block is contiguous in it, for all of a layer's heads); :meth:`layer` returns the
    ``(k, v)`` views of one layer: keys ``[num_blocks, num_kv_heads, head_dim, block_size]``
    (transposed within the block, so that attention scores a run of keys with vector FMAs) and
    values ``[num_blocks, num_kv_heads, block_size, head_dim]`` (rows, added with vector FMAs).
    Views must not be kept across :meth:`resize`, which replaces the storage.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self._block_size = block_size
        self._allocator = BlockAllocator(num_blocks)
        self._tables: dict[Hashable, list[int]] = {}
        # Zero-filled, never empty(): masked-out keys are still multiplied by 0 in attention, and
        # 0 * NaN from uninitialised memory would poison the output.
        self.kv = self.new_storage(num_blocks, zero_from=0)
        self._layers = self._layer_views()

    def new_storage(self, num_blocks: int, zero_from: int | None = None) -> torch.Tensor:
        """Storage for `num_blocks` blocks; blocks from `zero_from` on (by default: beyond the
        current pool, whose blocks a resize copies over) are zero-filled."""
        if zero_from is None:
            zero_from = self.num_blocks
        shape = (self.num_layers, 2, num_blocks, self.num_kv_heads, self.head_dim, self._block_size)
        # Always a normal tensor, never an inference tensor, whichever mode the caller is in (a
        # resize runs inside the engine's inference-mode step, the first pool outside it): a
        # captured step guards on its inputs' dispatch keys, and a pool of the other kind would
        # make it compile its whole graph again (tens of seconds on a CPU) on the next forward.
        with torch.inference_mode(False):
            if zero_from <= 0:
                return torch.zeros(shape, dtype=self.dtype, device=self.device)
            kv = torch.empty(shape, dtype=self.dtype, device=self.device)
            kv[:, :, zero_from:].zero_()
            return kv

    def _layer_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.kv.shape[2]
        return [(self.kv[i, 0], self.kv[i, 1].view(n, self.num_kv_heads, self._block_size, self.head_dim))
                for i in range(self.num_layers)]

    # ---- sizing -------------------------------------------------------------------------------

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        *,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> "PagedKVCache":
        per_block = cls.bytes_per_block(config, block_size, dtype)
        num_blocks = int(budget_bytes // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes is less than one block ({per_block} bytes "
                f"at block_size={block_size}, dtype={dtype})"
            )
        return cls(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
        )

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self._allocator.num_used

    def usage(self) -> float:
        return self._allocator.num_used / self._allocator.num_blocks

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) cache of layer ``i``: keys ``[num_blocks, num_kv_heads, head_dim, block_size]``,
        values ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
        return self._layers[i]

    # ---- per-sequence blocks ------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        return max(0, self._blocks_for(num_tokens) - have)

    def ensure_capacity(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens of ``seq_id``. All or nothing: returns False (and
        allocates nothing) if there are not enough free blocks."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self._allocator.num_free:
            return False
        blocks = self._allocator.allocate(need)
        self._tables.setdefault(seq_id, []).extend(blocks)
        return True

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the blocks holding the first ``num_tokens`` tokens of ``seq_id`` (no-op for an
        unknown sequence, which holds nothing). K/V of later tokens left in the last kept block is
        simply overwritten when new tokens are written."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        keep = self._blocks_for(num_tokens)
        if keep < len(table):
            self._allocator.free(table[keep:])
            del table[keep:]

    def free(self, seq_id: Hashable) -> None:
        table = self._tables.pop(seq_id, None)
        if table:
            self._allocator.free(table)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._tables[seq_id])

    def table_view(self, seq_id: Hashable) -> list[int]:
        """The sequence's block table itself (empty for an unknown one): read it, never change it."""
        return self._tables.get(seq_id, [])

    def seq_ids(self) -> list:
        return list(self._tables)

    def resize(self, num_blocks: int, storage: torch.Tensor | None = None) -> None:
        """Grow the pool (new free blocks) or shrink it. Shrinking moves the K/V of used blocks
        above the new size into free low blocks and rewrites the block tables, so sequences keep
        their contents.

        All or nothing: the new storage is allocated and filled while the old one still serves,
        and only then do the allocator, the block tables and the storage take the new size. If
        anything fails first (:class:`NoFreeBlocks` when more than ``num_blocks`` blocks are in
        use, or the allocation itself: out of memory) nothing has changed. The allocator never
        hands out a block the storage does not have."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        old = self.num_blocks
        if num_blocks == old:
            return
        moves = self._allocator.relocation(num_blocks)     # raises before anything changes
        # may raise (out of memory); `storage`: allocated beforehand by new_storage(num_blocks)
        kv = storage if storage is not None else self.new_storage(num_blocks)
        keep = min(old, num_blocks)
        kv[:, :, :keep] = self.kv[:, :, :keep]
        if moves:
            src = torch.tensor(list(moves.keys()), device=self.device)
            dst = torch.tensor(list(moves.values()), device=self.device)
            kv[:, :, dst] = self.kv[:, :, src]
        # Commit: nothing below can fail for want of memory.
        self._allocator.commit_resize(num_blocks, moves)
        if moves:
            for table in self._tables.values():
                table[:] = [moves.get(b, b) for b in table]
        self.kv = kv
        self._layers = self._layer_views()
        if num_blocks < old:
            release_cached_memory(self.device)


def release_cached_memory(device: torch.device) -> None:
    """Hand memory freed on a CUDA device back to the driver: torch's caching allocator keeps
    freed blocks for this process, where another process on the same GPU (the drafter's worker,
    or the target's engine) cannot use them. No-op elsewhere."""
    if device.type == "cuda" and torch.cuda.is_available():
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
