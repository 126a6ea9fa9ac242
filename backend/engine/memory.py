"""Elastic memory: the device budget, and moving the drafter's share to the target's KV pool.

The budget on the target's device is target weights + drafter weights (when colocated) + the
target KV pool + the drafter KV pool. When the planner has turned speculation off for a while and
requests are short of KV blocks, the drafter's weights go to host memory, its KV pool is released,
and the target pool grows by the bytes freed: more requests run at once. When speculation is
wanted again the target pool shrinks back first (preempting by recompute if it must: nothing is
dropped or corrupted), then the weights travel back in the background while decoding goes on.

On a CPU-only host the same mechanism runs against a configured byte budget. With the drafter on
a device of its own (a worker), offloading frees that device instead; the target pool keeps its
size.

Resizing the pool is all or nothing (:meth:`PagedKVCache.resize`). If it fails (out of memory
for the new pool beside the old one), nothing is lent: an offload whose pool cannot grow brings
the drafter's weights straight back, a reload whose pool cannot shrink leaves the drafter
offloaded; either is counted and logged, and neither is tried again for `RETRY_AFTER_S`.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from backend.speculation.manager import DrafterManager
from backend.model.kv_cache import PagedKVCache
from backend.batching.scheduler import Scheduler

log = logging.getLogger("nightdraft.memory")


@dataclass
class MemoryEvent:
    t: float                 # time.perf_counter()
    kind: str                # "offload" | "reload_start" | "reload_done" | "offload_failed" | "reload_failed"
    target_kv_blocks: int    # the target pool's size after the event
    seconds: float = 0.0     # reload_done: how long the weights took to come back
    freed_bytes: int = 0     # offload: bytes released on the drafter's device


class ElasticMemory:
    # Events kept (the most recent): a long-lived server must not grow a list forever.
    MAX_EVENTS = 1024
    # After a resize failed, the next offload or reload waits this long: memory that could not
    # be had a moment ago rarely is the next step.
    RETRY_AFTER_S = 30.0

    def __init__(self, kv: PagedKVCache, drafter: DrafterManager, scheduler: Scheduler,
                 block_bytes: int, target_weight_bytes: int):
        self.kv = kv
        self.drafter = drafter
        self.scheduler = scheduler
        self.block_bytes = block_bytes
        self.target_weight_bytes = target_weight_bytes
        self.base_blocks = kv.num_blocks        # the pool's size with the drafter on the device
        self.events: deque[MemoryEvent] = deque(maxlen=self.MAX_EVENTS)
        self.offloads = 0
        self.reloads = 0
        self.failed_offloads = 0        # the pool could not grow: the weights came back
        self.failed_reloads = 0         # the pool could not shrink back: the weights stay off
        self.preempted_for_reload = 0
        self._retry_at = 0.0            # time.monotonic() before which no resize is tried again

    def budget(self) -> dict[str, int]:
        """Bytes on the target's device, by owner."""
        return {"target_weights": self.target_weight_bytes,
                "target_kv": self.kv.num_blocks * self.block_bytes,
                "drafter": self.drafter.device_bytes() if self.drafter.colocated else 0}

    def growth_if_offloaded(self) -> float | None:
        """The target pool's size after an offload now, over its size now (1.0 when the drafter
        has a device of its own, or is already off); None while the drafter cannot offload."""
        if not self.drafter.available or time.monotonic() < self._retry_at:
            return None
        extra = self.drafter.device_bytes() // self.block_bytes if self.drafter.colocated else 0
        return (self.kv.num_blocks + extra) / max(self.kv.num_blocks, 1)

    def usage_at_base(self) -> float:
        """Used blocks over the pool's drafter-on size: above 1, a reload would have to preempt."""
        return self.kv.num_used_blocks / max(self.base_blocks, 1)

    def agrees(self) -> bool:
        """Do the pool and the drafter claim the drafter's memory at most once? The pool is
        grown only while the drafter's weights are off its device (a colocated drafter that
        comes back, or whose replacement does, must find the pool shrunk back first)."""
        grown = self.kv.num_blocks > self.base_blocks
        return not grown or (self.drafter.offloaded and self.drafter.state != "reloading")

    def offload(self) -> None:
        if not self.drafter.available or time.monotonic() < self._retry_at:
            return
        freed = self.drafter.offload()
        if not self.drafter.offloaded:
            return
        if self.drafter.colocated and freed >= self.block_bytes:
            try:
                self.kv.resize(self.kv.num_blocks + freed // self.block_bytes)
            except (RuntimeError, MemoryError) as e:      # out of memory: the pool is unchanged
                self._resize_failed("offload_failed", e)
                self.failed_offloads += 1
                self.drafter.start_reload()       # nothing was lent: the weights come back
                self.events.append(MemoryEvent(time.perf_counter(), "reload_start", self.kv.num_blocks))
                return
        self.offloads += 1
        self.events.append(MemoryEvent(time.perf_counter(), "offload", self.kv.num_blocks,
                                       freed_bytes=freed))
        log.info("drafter offloaded (%.1f MiB freed); target KV pool now %d blocks",
                 freed / 2**20, self.kv.num_blocks)

    def start_reload(self) -> None:
        if self.drafter.state != "offloaded":     # not offloaded, already coming back, or restarting
            return
        if self.kv.num_blocks > self.base_blocks:
            if time.monotonic() < self._retry_at:
                return
            try:
                # The smaller pool first: preempting for a shrink that then cannot happen would
                # throw computed K/V away for nothing (and again at every retry).
                storage = self.kv.new_storage(self.base_blocks)
                self.preempted_for_reload += self.scheduler.preempt_until(self.base_blocks)
                self.kv.resize(self.base_blocks, storage=storage)
            except (RuntimeError, MemoryError) as e:      # the pool still holds the lent bytes
                self._resize_failed("reload_failed", e)
                self.failed_reloads += 1
                return
        self.drafter.start_reload()
        self.events.append(MemoryEvent(time.perf_counter(), "reload_start", self.kv.num_blocks))

    def _resize_failed(self, kind: str, error: BaseException) -> None:
        self._retry_at = time.monotonic() + self.RETRY_AFTER_S
        self.events.append(MemoryEvent(time.perf_counter(), kind, self.kv.num_blocks))
        log.error("%s: the target KV pool could not be resized (%s: %s); it keeps its %d blocks, "
                  "next try in %.0f s", kind.replace("_", " "), type(error).__name__, error,
                  self.kv.num_blocks, self.RETRY_AFTER_S)

    def poll(self) -> float | None:
        """Seconds the weights took to come back, on the step they arrive; else None."""
        seconds = self.drafter.poll_reload()
        if seconds is not None:
            self.reloads += 1
            self.events.append(MemoryEvent(time.perf_counter(), "reload_done", self.kv.num_blocks,
                                           seconds=seconds))
            log.info("drafter weights back on the device after %.3fs", seconds)
        return seconds
