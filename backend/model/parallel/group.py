"""The rank group: N-1 rank processes that follow the driver (the engine's process, rank 0).

Each rank holds its slice of the target (:mod:`backend.model.parallel.shard`) and a KV pool of
its own heads, with the same block count as the driver's: the driver allocates blocks and builds
each forward's layout, the ranks only store K/V where the layout says. Per step the driver
broadcasts one message (the flat token ids and the attention metadata, pickled into one byte
tensor; a second broadcast only when a message outgrows it), every rank runs the same forward,
and the row-parallel layers' all-reduces keep them in lock step. Only the driver computes logits.

Two process groups over one TCP store (the driver hosts it): ``compute`` (NCCL between distinct
GPUs; gloo on the CPU, or for ranks that share a GPU, which NCCL refuses) carries the all-reduces
and has the collective timeout: a rank that hangs makes the driver's forward fail after
`timeout_s`; a rank that dies makes it fail at once (gloo sees the closed connection). ``control``
(gloo) carries the step messages; ranks wait on it while the engine idles, so their timeout there
is long (the driver's is `timeout_s` in both: a stopped rank never takes a broadcast).
Groups are built from the process-group classes themselves, not torch.distributed's process-wide
default group, so that several engines (tests, calibration) can live in one process.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend.process_start import helper_context, helper_name, name_this_process

log = logging.getLogger("nightdraft.tensor_parallel")

MESSAGE_BYTES = 64 << 10          # the step message's broadcast buffer (a step's ids and layout)
IDLE_TIMEOUT = datetime.timedelta(days=365)
CONNECT_TIMEOUT = datetime.timedelta(seconds=120)


class GroupFailed(RuntimeError):
    """A rank of the tensor-parallel group died, hung, or refused a step; the group is unusable."""


@dataclass
class RankSpec:
    path: str
    size: int
    device: str               # this rank's torch device ("cpu" or "cuda:N")
    dtype: str
    attention: str
    block_size: int
    num_blocks: int
    pack_linears: bool
    port: int
    timeout_s: float
    backend: str              # "gloo" | "nccl"
    cores: list[int] | None   # CPU: the cores to pin to (None: a GPU rank's, not pinned)
    threads: int              # torch intra-op threads


def connect(rank: int, size: int, port: int, backend: str, timeout_s: float, store=None):
    """(store, compute group, control group) of `rank`. Timeouts are each process's own: the
    driver waits for the ranks at most `timeout_s` in either group (a stopped rank never takes
    a broadcast), the ranks wait for the driver's next step as long as the engine idles."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=CONNECT_TIMEOUT)
    # Connecting waits for every rank to start (imports, seconds): under the connect timeout;
    # the collectives then run under the group's own.
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute/", store), rank, size, opts)
    else:
        compute = dist.ProcessGroupGloo(dist.PrefixStore("compute/", store), rank, size, CONNECT_TIMEOUT)
        compute.set_timeout(timeout)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size, CONNECT_TIMEOUT)
    control.set_timeout(timeout if rank == 0 else IDLE_TIMEOUT)
    return store, compute, control


class Channel:
    """Step messages from the driver to every rank, over the control group."""

    def __init__(self, control):
        self.group = control
        self._buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)

    def send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        first = min(n, MESSAGE_BYTES - 8)
        self._buf[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
        self._buf[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        dist.broadcast(self._buf, group_src=0, group=self.group)
        if n > first:
            dist.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8),
                           group_src=0, group=self.group)

    def recv(self):
        dist.broadcast(self._buf, group_src=0, group=self.group)
        n = int.from_bytes(self._buf[:8].numpy().tobytes(), "little")
        first = min(n, MESSAGE_BYTES - 8)
        data = self._buf[8:8 + first].numpy().tobytes()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8)
            dist.broadcast(rest, group_src=0, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def agree(self, ok: bool) -> bool:
        """Did every member say ok? (all-reduce of a flag over the control group)"""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


def on_device(obj, device):
    """`obj` (tensors, dataclasses of them, lists) with every tensor moved to `device`; a
    metadata's host-side arrays (`host`) are dropped: ranks never advance a layout themselves."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: on_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                   if f.name != "host"}
        if any(f.name == "host" for f in dataclasses.fields(obj)):
            changes["host"] = None
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, list):
        return [on_device(x, device) for x in obj]
    return obj


def resized_storage(old: torch.Tensor, new: torch.Tensor, moves: dict[int, int]) -> torch.Tensor:
    """`new` (a pool's storage for another block count) filled from `old` as
    :meth:`PagedKVCache.resize` fills it: the blocks both have, and `moves` ({old: new})."""
    keep = min(old.shape[2], new.shape[2])
    new[:, :, :keep] = old[:, :, :keep]
    if moves:
        src = torch.tensor(list(moves.keys()), device=old.device)
        dst = torch.tensor(list(moves.values()), device=old.device)
        new[:, :, dst] = old[:, :, src]
    return new


# ---- the rank process -----------------------------------------------------------------------------

def rank_main(rank: int, spec: RankSpec) -> None:
    """A rank: load its slice, then follow the driver's messages until told to stop (or until the
    driver is gone: its connections close and the broadcast raises)."""
    from backend.model.kv_cache import PagedKVCache, release_cached_memory
    from backend.model.linear import pack_linears
    from backend.model.parallel.layers import make_row_parallel
    from backend.model.parallel.shard import load_shard

    name_this_process(helper_name(f"tp-rank{rank}"))
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.size, False, timeout=CONNECT_TIMEOUT)
    store.set(f"alive/{rank}", "ok")      # the driver waits for this, watching the process
    store, compute, control = connect(rank, spec.size, spec.port, spec.backend, spec.timeout_s, store=store)
    try:
        model = load_shard(spec.path, rank, spec.size, device=device, dtype=getattr(torch, spec.dtype),
                           attention=spec.attention)
        make_row_parallel(model, compute)
        if spec.pack_linears:
            pack_linears(model)
        cfg = model.config
        pool = PagedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            num_blocks=spec.num_blocks, block_size=spec.block_size, dtype=model.embed_tokens.weight.dtype,
                            device=device)
    except BaseException as e:
        store.set(f"ready/{rank}", f"error: {type(e).__name__}: {e}")
        raise
    store.set(f"ready/{rank}", "ok")
    channel = Channel(control)
    scratch: tuple[tuple[int, int], torch.Tensor] | None = None     # ((key, blocks), storage) of a throw-away pool
    no_rows = torch.empty(0, dtype=torch.long, device=device)
    with torch.inference_mode():
        while True:
            msg = channel.recv()
            kind = msg[0]
            if kind == "forward":
                _, key, num_blocks, ids, meta = msg
                if key == 0:
                    kv = pool.kv
                else:
                    if scratch is None or scratch[0] != (key, num_blocks):
                        scratch = None
                        scratch = ((key, num_blocks), pool.new_storage(num_blocks, zero_from=0))
                    kv = scratch[1]
                model(ids.to(device), on_device(meta, device), kv, no_rows)
            elif kind == "resize":
                _, num_blocks, moves = msg
                try:
                    # zero what lies beyond this rank's storage (its allocator's count is never
                    # updated: the driver allocates), as the driver zeroes beyond its pool
                    new = pool.new_storage(num_blocks, zero_from=pool.kv.shape[2])
                except (RuntimeError, MemoryError):
                    new = None
                if channel.agree(new is not None):
                    shrinking = num_blocks < pool.kv.shape[2]
                    pool.kv = resized_storage(pool.kv, new, moves)
                    pool._layers = pool._layer_views()
                    if shrinking:
                        release_cached_memory(device)
                del new
            elif kind == "shutdown":
                return


# ---- the driver's side ----------------------------------------------------------------------------

class RankGroup:
    """The driver's handle on ranks 1..size-1: started, connected and loaded when constructed."""

    def __init__(self, specs: list[RankSpec], *, start_timeout_s: float = 300.0):
        size = specs[0].size
        self.size = size
        self.timeout_s = specs[0].timeout_s
        ctx = helper_context()
        self._store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=CONNECT_TIMEOUT,
                                    wait_for_workers=False)
        port = self._store.port
        self.procs = []
        for rank, spec in enumerate(specs[1:], start=1):
            spec = dataclasses.replace(spec, port=port)
            p = ctx.Process(target=rank_main, args=(rank, spec), daemon=True, name=f"nightdraft-tp-rank{rank}")
            p.start()
            self.procs.append(p)
        self.pids = [p.pid for p in self.procs]
        try:
            # A rank that dies before it connects (a failed import, a spawn error) must fail the
            # start at once, not after the connect timeout: wait for each, watching its process.
            deadline = time.monotonic() + start_timeout_s
            self._wait_for("alive", "started", deadline)
            _, self.compute, control = connect(0, size, port, specs[0].backend, specs[0].timeout_s,
                                               store=self._store)
            self._wait_for("ready", "loaded", deadline)
        except BaseException:
            self.close(timeout_s=1.0)
            raise
        self.channel = Channel(control)

    def _wait_for(self, key: str, what: str, deadline: float) -> None:
        """Every rank's `key` in the store, failing as soon as a rank's process is gone."""
        for rank, p in enumerate(self.procs, start=1):
            while not self._store.check([f"{key}/{rank}"]):
                if not p.is_alive():
                    raise GroupFailed(f"tensor-parallel rank {rank} exited before it {what} (code {p.exitcode})")
                if time.monotonic() > deadline:
                    raise GroupFailed(f"tensor-parallel rank {rank} not {what} within the start timeout")
                time.sleep(0.05)
            status = self._store.get(f"{key}/{rank}").decode()
            if status != "ok":
                raise GroupFailed(f"tensor-parallel rank {rank} failed to load: {status}")

    def dead_ranks(self) -> list[int]:
        return [rank for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def death_report(self, wait_s: float = 0.0) -> str | None:
        """"rank N died (exit code C)" for ranks that are gone (waiting up to `wait_s` for one
        whose connection just closed to be reaped), else None."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return "; ".join(f"rank {rank} died (exit code {code})" for rank, code in dead) or None

    def send(self, msg) -> None:
        self.channel.send(msg)

    def close(self, timeout_s: float = 5.0, graceful: bool = True) -> None:
        """Stop the ranks: asked to (`graceful`, for a group that works: a rank stuck in a
        collective would never read the request); killed when not, or when they do not exit
        within `timeout_s`."""
        channel = getattr(self, "channel", None)
        if graceful and channel is not None and not self.dead_ranks():
            try:
                channel.send(("shutdown",))
            except Exception:   # noqa: BLE001 - a broken group: they are killed below
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout_s)
