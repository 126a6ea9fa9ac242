"""The driver's side of a tensor-parallel target: its runner, its KV pool, and the group's
failures and restarts.

:class:`TensorParallelRunner` is a :class:`~backend.model.runner.ModelRunner`: the engine, the
proposers' verification and calibration call it as they call the single-device one. Each forward
first sends the step (token ids and the attention metadata the driver built over its own pool)
to the ranks, then runs the driver's slice; the driver alone computes logits.

Faults. A rank that dies (noticed by a monitor thread within ``MONITOR_S``, or at once by the
collective on the closed connection) or hangs (the compute group's collective timeout) fails the
group: the forward in flight raises :class:`GroupFailed`, and so does, at once, every later
forward of a sequence whose K/V the ranks held (it is gone with them), so the engine fails
exactly the in-flight requests, each with that error. A background thread kills what is left of
the old group and starts a new one (retrying with a growing pause); forwards of new sequences
wait for it (up to ``RESTART_WAIT_S``). While the group is down, :attr:`TensorParallelRunner.
down_reason` says why, which the serving layer reports as an unhealthy engine.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time

import torch

from backend.model.kv_cache import PagedKVCache
from backend.model.llama import CausalLM
from backend.model.parallel.group import GroupFailed, RankGroup, RankSpec, on_device
from backend.model.parallel.layers import make_row_parallel
from backend.model.runner import ModelRunner

log = logging.getLogger("nightdraft.tensor_parallel")

MONITOR_S = 0.2              # how often the driver looks for dead ranks
RESTART_PAUSE_S = (1.0, 30.0)  # the pause before a restart after a failed one: first, at most
RESTART_WAIT_S = 60.0        # how long a forward of a new sequence waits for a restarting group


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:limit]}"


class ShardedKVCache(PagedKVCache):
    """The driver's pool of its kv heads. Its allocator and block tables are the group's: ranks
    keep only storage of the same block count. A resize is mirrored on every rank, all or
    nothing across the group."""

    group: "TargetGroup | None" = None

    def resize(self, num_blocks: int, storage: torch.Tensor | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_blocks == self.num_blocks:
            return
        moves = self._allocator.relocation(num_blocks)      # raises before anything changes
        if storage is None:
            storage = self.new_storage(num_blocks)          # may raise: nothing sent yet
        self.group.resize_ranks(num_blocks, moves)          # raises RuntimeError where a rank cannot
        super().resize(num_blocks, storage)


class TargetGroup:
    """The driver's handle on the group, kept across restarts."""

    def __init__(self, model: CausalLM, kv: ShardedKVCache, specs: list[RankSpec],
                 start_timeout_s: float = 300.0):
        self.model, self.kv, self.specs = model, kv, specs
        self.start_timeout_s = start_timeout_s
        self.group = RankGroup(specs, start_timeout_s=start_timeout_s)
        make_row_parallel(model, self.group.compute)
        kv.group = self
        self.failure: str | None = None      # why the group is down (None: serving)
        self.failures = 0
        self.restarts = 0
        self._lost: set = set()              # sequences whose K/V went with a failed group
        self._lost_reason = ""
        self._ready = threading.Event()
        self._ready.set()
        self._lock = threading.Lock()        # failure state
        self._step = threading.Lock()        # held while the group runs a step
        self._closed = threading.Event()
        self._pool_keys = itertools.count(1)
        self._monitor = threading.Thread(target=self._watch, name="nightdraft-tp-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return list(self.group.pids)

    def new_pool_key(self) -> int:
        return next(self._pool_keys)

    # ---- steps ----------------------------------------------------------------------------

    def run(self, pool_key: int, kv: PagedKVCache, ids: torch.Tensor, meta, idx: torch.Tensor) -> torch.Tensor:
        if pool_key == 0 and self._lost:
            lost = [s for s in meta.host.seq_ids if s in self._lost] if meta.host is not None else []
            if lost:
                raise GroupFailed("the tensor-parallel group failed and lost this request's KV cache "
                                  f"({self._lost_reason})")
        if not self._ready.wait(RESTART_WAIT_S):
            raise GroupFailed(f"the tensor-parallel group is down: {self.failure}")
        with self._step:
            group = self.group
            try:
                group.send(("forward", pool_key, kv.num_blocks, ids.cpu(), on_device(meta, "cpu")))
                return self.model(ids, meta, kv.kv, idx)
            except Exception as e:    # noqa: BLE001 - the ranks may be anywhere in the step now
                why = group.death_report(wait_s=0.5) or _first_line(e)
                self.fail(why)
                raise GroupFailed(f"the tensor-parallel group failed during a forward: {why}") from e

    def resize_ranks(self, num_blocks: int, moves: dict[int, int]) -> None:
        if not self._ready.is_set():
            raise RuntimeError(f"the tensor-parallel group is down ({self.failure}); the pool keeps its size")
        with self._step:
            try:
                self.group.send(("resize", num_blocks, moves))
                ok = self.group.channel.agree(True)
            except Exception as e:      # noqa: BLE001
                self.fail(f"{type(e).__name__} during a KV pool resize")
                raise RuntimeError(f"the tensor-parallel group failed during a KV pool resize: {e}") from e
        if not ok:
            raise RuntimeError(f"a tensor-parallel rank could not allocate a pool of {num_blocks} blocks")

    # ---- failures and restarts -------------------------------------------------------------

    def fail(self, why: str) -> None:
        with self._lock:
            if self.failure is not None or self._closed.is_set():
                return
            self.failure = why
            self._lost_reason = why
            self._ready.clear()
            self._lost = set(self.kv.seq_ids())
            self.failures += 1
        log.error("tensor-parallel group failed (%s); %d sequence(s) lost their KV cache; restarting it",
                  why, len(self._lost))
        threading.Thread(target=self._restart, name="nightdraft-tp-restart", daemon=True).start()

    def _restart(self) -> None:
        self.group.close(timeout_s=2.0, graceful=False)
        pause = RESTART_PAUSE_S[0]
        while not self._closed.is_set():
            try:
                specs = [dataclasses.replace(s, num_blocks=self.kv.num_blocks) for s in self.specs]
                group = RankGroup(specs, start_timeout_s=self.start_timeout_s)
            except Exception as e:     # noqa: BLE001 - try again after a pause
                log.error("tensor-parallel group restart failed (%s); next try in %.0f s", e, pause)
                if self._closed.wait(pause):
                    return
                pause = min(2 * pause, RESTART_PAUSE_S[1])
                continue
            with self._step:
                if self._closed.is_set():
                    group.close()
                    return
                self.group = group
                make_row_parallel(self.model, group.compute)
                # The driver's pool keeps its K/V, but it is useless without the ranks': zeroed
                # like theirs, for the sequences that come next.
                self.kv.kv.zero_()
                with self._lock:
                    self.failure = None
                    self.restarts += 1
                self._ready.set()
            log.info("tensor-parallel group restarted (ranks %s)", group.pids)
            return

    def _watch(self) -> None:
        while not self._closed.wait(MONITOR_S):
            if self.failure is None:
                why = self.group.death_report()
                if why:
                    self.fail(why)

    def forget_finished(self) -> None:
        """Drop lost sequences that have left the pool (failed and freed)."""
        if self._lost:
            self._lost.intersection_update(self.kv.seq_ids())

    def close(self) -> None:
        self._closed.set()
        self._ready.set()        # nobody waits on a closed group
        with self._step:
            self.group.close(graceful=self.failure is None)


class TensorParallelRunner(ModelRunner):
    """A :class:`ModelRunner` whose model is the driver's slice of a tensor-parallel group."""

    def __init__(self, model: CausalLM, kv: PagedKVCache, group: TargetGroup, pool_key: int = 0):
        super().__init__(model, kv, None)
        self.group = group
        self.pool_key = pool_key

    def with_cache(self, kv: PagedKVCache) -> "TensorParallelRunner":
        # Ranks keep one throw-away pool beside their own: a new key replaces it.
        return TensorParallelRunner(self.model, kv, self.group, self.group.new_pool_key())

    def _run(self, input_ids: torch.Tensor, meta, idx: torch.Tensor) -> torch.Tensor:
        self._meta = meta
        if self.pool_key == 0:
            self.group.forget_finished()
        logits = self.group.run(self.pool_key, self.kv, input_ids, meta, idx)
        self.eager_forwards += 1
        return logits

    @property
    def failures(self) -> int:
        """Times the group failed (a rank died or hung)."""
        return self.group.failures

    @property
    def restarts(self) -> int:
        """Times the group was brought back after a failure."""
        return self.group.restarts

    @property
    def down_reason(self) -> str | None:
        """Why the target cannot run now (its group failed and is restarting), or None."""
        why = self.group.failure
        return f"a tensor-parallel rank failed ({why}); the group is restarting" if why else None

    def close(self) -> None:
        self.group.close()
