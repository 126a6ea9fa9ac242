"""The drafter in its own process, bound to its own device.

On a CUDA host the worker owns a GPU of its own; on a CPU-only host it owns a set of cores (and
the engine's process keeps the others), which gives the target and the drafter real parallelism.
The protocol is a few messages over a pipe: `propose` (per sequence: the tokens committed since
its last proposal, gamma and sampling params), `free`, `offload`, `reload`, `ping` and
`shutdown`. After answering a `propose` whose requests ask for it, the worker drafts ahead
(`backend.speculation.draft_ahead`) until the next message arrives. Draft probabilities, the only bulky payload, travel one of two ways
(`WorkerSpec.probs_transport`): on a CPU host they are written into a shared-memory buffer
allocated once by the engine and copied out once on arrival; on CUDA they travel as tensors
(torch's multiprocessing reductions: CUDA IPC handles). The "tensor" transport also runs on
CPU tensors (shared-memory file descriptors), which is how the CUDA path is tested here.

`RemoteDrafter` is a :class:`~backend.speculation.proposer.Proposer`, as the in-process
`Drafter` is, so sequential SD and batch-parallel SD run unchanged on top of it. A worker that dies, or does not take a message
or answer within `timeout_s` (it may be stopped, not dead: sends are bounded too), is killed and
raises `DrafterFailed`; the engine then decodes without drafts until a new worker is up.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from multiprocessing.reduction import ForkingPickler

import torch

from backend.process_start import helper_context, helper_name, name_this_process
from backend.speculation.placement import pin_worker
from backend.speculation.proposer import DraftRequest, Proposal, ProposerStats

log = logging.getLogger("nightdraft.drafter_worker")


# What ps, top and /proc/PID/comm call the worker process.
WORKER_NAME = helper_name("drafter")


class DrafterFailed(RuntimeError):
    """The drafter worker died, hung, or refused a request."""


@dataclass
class WorkerSpec:
    path: str
    device: str               # "cpu", "cpu:CORES" or "cuda:N"
    dtype: str
    kv_cache_bytes: int
    block_size: int
    seed: int
    cores: list[int] | None = None   # CPU: the cores to pin to, planned by the engine before it
                                     # pinned itself (a child inherits its parent's affinity)
    probs_transport: str | None = None   # "shared_buffer" | "tensor"; None: by device (see above)
    start_offloaded: bool = False    # weights in host memory from the start (see Drafter.load)
    pack_linears: bool = True        # CPU linear layers pick their faster kernel
    attention: str = "auto"          # EngineConfig.attention
    compile: str = "off"             # EngineConfig.compile
    max_query_len: int = 9           # tokens a sequence a compiled step covers

    @property
    def transport(self) -> str:
        if self.probs_transport is not None:
            return self.probs_transport
        return "shared_buffer" if self.device.startswith("cpu") else "tensor"


@dataclass
class WireProposal:
    """One proposal as it crosses the pipe: its probabilities are a tensor (CUDA IPC, or shared
    memory when the buffer is full), an offset into the shared buffer, or -1 (none: greedy)."""
    tokens: list[int]
    probs: torch.Tensor | int
    error: str | None = None
    resync: bool = False


@dataclass
class ProposeReply:
    """The worker's answer to a `propose`."""
    call_id: int
    proposals: list[WireProposal]
    seconds: float                 # the worker's time for the proposal
    stats: ProposerStats = field(default_factory=ProposerStats)   # ahead: {} until a pre-draft met a verdict


def _worker_stats(drafter) -> ProposerStats:
    st = drafter.stats()
    ahead = st.ahead if st.ahead.get("rounds") or st.ahead.get("interrupted") else {}
    return replace(st, ahead=ahead, cpu_s=time.process_time())   # every thread of this process



def _worker_main(conn, spec: WorkerSpec, probs_buffer: torch.Tensor | None) -> None:
    from backend.speculation.drafter import Drafter

    name_this_process(WORKER_NAME)
    device = pin_worker(spec.device, spec.cores)
    dtype = getattr(torch, spec.dtype)
    drafter = Drafter.load(spec.path, device=device, dtype=dtype, kv_cache_bytes=spec.kv_cache_bytes,
                           block_size=spec.block_size, seed=spec.seed, offloaded=spec.start_offloaded,
                           pack=spec.pack_linears, attention=spec.attention, compile=spec.compile,
                           max_query_len=spec.max_query_len)
    conn.send(("ready", {"pid": os.getpid(), "loaded_bytes": drafter.loaded_bytes()}))
    capacity = probs_buffer.shape[0] if probs_buffer is not None else 0
    inbox: list = []        # messages read while drafting ahead, handled next in order

    def engine_waits() -> bool:
        """Is the engine waiting on this worker? A `free` is only bookkeeping: it is kept for
        later and the pre-draft goes on; anything else ends it."""
        while conn.poll(0):
            inbox.append(conn.recv())
            if inbox[-1][0] != "free":
                return True
        return False

    while True:
        try:
            msg = inbox.pop(0) if inbox else conn.recv()
        except EOFError:
            return
        kind = msg[0]
        if kind == "propose":
            _, call_id, requests = msg
            t0 = time.perf_counter()
            proposals = drafter.propose(requests)
            offset = 0
            wire = []
            for p in proposals:
                where: torch.Tensor | int = -1
                if p.probs is not None:
                    rows = p.probs.shape[0]
                    if probs_buffer is None or offset + rows > capacity:
                        # The tensor itself: a CUDA IPC handle, or (CPU, buffer full) shared memory.
                        where = p.probs
                    else:
                        probs_buffer[offset:offset + rows].copy_(p.probs)
                        where, offset = offset, offset + rows
                wire.append(WireProposal(p.tokens, where, p.error, p.resync))
            conn.send(("proposals", ProposeReply(call_id, wire, time.perf_counter() - t0, _worker_stats(drafter))))
            if any(r.ahead for r in requests):
                # While the target verifies: the next round, until the next message comes.
                drafter.draft_ahead(requests, proposals, should_stop=engine_waits)
        elif kind == "free":
            for seq_id in msg[1]:
                drafter.free(seq_id)
        elif kind == "offload":
            conn.send(("offloaded", drafter.offload()))
        elif kind == "reload":
            t0 = time.perf_counter()
            drafter.reload()
            conn.send(("reloaded", time.perf_counter() - t0))
        elif kind == "ping":
            conn.send(("pong", _worker_stats(drafter)))
        elif kind == "shutdown":
            conn.send(("bye",))
            return


class DraftFuture:
    def __init__(self, owner: "RemoteDrafter", call_id: int, requests: list[DraftRequest]):
        self._owner, self._call_id = owner, call_id
        self.requests = requests
        self._result: list[Proposal] | None = None

    def result(self) -> list[Proposal]:
        if self._result is None:
            self._result = self._owner._collect(self._call_id)
        return self._result


class ReloadFuture:
    """Weights travelling back to the worker's device; `done()` never blocks. (Its owner gives
    up on it after ``reload_timeout_s``: DrafterManager.poll_reload.)"""

    def __init__(self, owner: "RemoteDrafter"):
        self._owner = owner
        self.seconds: float | None = None

    def done(self) -> bool:
        if self.seconds is None and (self._owner._conn.poll(0) or not self._owner.alive):
            self.seconds = self.result()
        return self.seconds is not None

    def result(self) -> float:
        if self.seconds is None:
            try:
                reply = self._owner._recv(self._owner.reload_timeout_s)
            finally:
                self._owner._in_flight = None
            if reply[0] != "reloaded":
                raise DrafterFailed(f"drafter worker answered a reload with {reply[0]!r}")
            self.seconds = reply[1]
        return self.seconds


class RemoteDrafter:
    def __init__(self, spec: WorkerSpec, *, vocab_size: int, max_rows: int, timeout_s: float = 10.0,
                 start_timeout_s: float = 120.0, reload_timeout_s: float | None = None):
        self.spec = spec
        self.timeout_s = timeout_s
        # A reload moves every weight: it may take longer than any other message.
        self.reload_timeout_s = reload_timeout_s if reload_timeout_s is not None else max(timeout_s, 60.0)
        self._ctx = helper_context()
        self._probs = None
        if spec.transport == "shared_buffer":
            self._probs = torch.zeros(max_rows, vocab_size).share_memory_()
        self._conn, child = self._ctx.Pipe()
        # A message this small fits the socket's buffer whenever select() calls it writable
        # (Linux calls a Unix socket writable while at most a quarter of its send buffer is in
        # use), so it is sent in line; a bigger one (a long resync) goes through a helper
        # thread that a deadline can abandon.
        with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            self._inline_send_bytes = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 8
        self._proc = self._ctx.Process(target=_worker_main, args=(child, spec, self._probs),
                                       daemon=True, name="nightdraft-drafter")
        self._proc.start()
        child.close()
        self._call_id = 0
        self._in_flight: int | None = None     # call id of the reply owed; -1: a reload's
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nightdraft-drafter-send")
        self._pending_frees: list[str] = []
        self._stats = ProposerStats()      # as the worker's last reply had them
        self.pid = None
        try:
            reply = self._recv(start_timeout_s)
        except DrafterFailed:
            self.close(timeout_s=1.0)
            raise
        if reply[0] != "ready":
            self.close(timeout_s=1.0)
            raise DrafterFailed(f"drafter worker did not start: {reply!r}")
        self.pid = reply[1]["pid"]
        self._loaded_bytes = int(reply[1]["loaded_bytes"])   # weights + KV pool, when loaded

    # -- the Drafter interface -----------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return self.propose_async(requests).result()

    def propose_async(self, requests: list[DraftRequest]) -> DraftFuture:
        self._settle()
        self._flush_frees()
        self._call_id += 1
        self._send(("propose", self._call_id, requests))
        self._in_flight = self._call_id
        return DraftFuture(self, self._call_id, requests)

    def offload(self) -> int:
        """Weights to host memory, KV pool released, in the worker; returns bytes freed there."""
        self._settle()
        self._flush_frees()
        self._send(("offload",))
        return self._expect("offloaded", self.timeout_s)[1]

    def reload_async(self) -> ReloadFuture:
        self._settle()
        self._flush_frees()
        self._send(("reload",))
        self._in_flight = -1
        return ReloadFuture(self)

    def _settle(self) -> None:
        """A reply still owed (a proposal its caller never collected, e.g. because the step
        that started it failed) is read and dropped, so the pipe is in step again."""
        if self._in_flight is None:
            return
        log.warning("drafter worker: dropping an uncollected %s",
                    "reload reply" if self._in_flight == -1 else "proposal")
        try:
            self._recv(self.reload_timeout_s if self._in_flight == -1 else self.timeout_s)
        finally:
            self._in_flight = None

    def free(self, seq_id: str) -> None:
        self._pending_frees.append(seq_id)
        if self._in_flight is None:
            self._flush_frees()

    def stats(self) -> ProposerStats:
        return self._stats

    def loaded_bytes(self) -> int:
        return self._loaded_bytes

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit; kill it if it does not within `timeout_s` (also when it is
        stopped, not dead: the goodbye is sent with a deadline too)."""
        if self._proc.is_alive():
            self._in_flight = None
            try:
                self._send(("shutdown",), timeout_s=timeout_s)
                self._proc.join(timeout_s)
            except DrafterFailed:
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout_s)
        self._sender.shutdown(wait=False, cancel_futures=True)
        self._conn.close()

    def refresh_stats(self) -> None:
        """Ask the worker for its KV usage and sequence count (both also arrive with proposals)."""
        if self._in_flight is not None:
            return
        self._flush_frees()
        self._send(("ping",))
        fresh = self._expect("pong", self.timeout_s)[1]
        self._stats = replace(self._stats, kv_usage=fresh.kv_usage, num_sequences=fresh.num_sequences)

    def kill(self) -> None:
        """For failure tests: the worker dies as if it crashed."""
        self._proc.kill()
        self._proc.join(5)

    # -- plumbing --------------------------------------------------------------------------------

    def _flush_frees(self) -> None:
        if self._pending_frees:
            self._send(("free", self._pending_frees))
            self._pending_frees = []

    def _send(self, msg, timeout_s: float | None = None) -> None:
        """Send within a deadline: a stopped worker stops reading, and a message bigger than the
        socket's free buffer would block the engine's thread forever."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        buf = ForkingPickler.dumps(msg)
        try:
            if len(buf) <= self._inline_send_bytes and self._writable():
                self._conn.send_bytes(buf)
                return
            self._sender.submit(self._conn.send_bytes, buf).result(timeout_s)
        except FutureTimeout:
            self._proc.kill()            # the blocked send then fails; the thread is released
            raise DrafterFailed(f"drafter worker did not take a message within {timeout_s:.1f}s; "
                                "killed it") from None
        except (OSError, BrokenPipeError, RuntimeError) as e:   # RuntimeError: sender shut down
            raise DrafterFailed(f"drafter worker is gone ({e})") from None

    def _writable(self) -> bool:
        try:
            return bool(select.select([], [self._conn.fileno()], [], 0)[1])
        except (OSError, ValueError):
            return False

    def _expect(self, kind: str, timeout_s: float):
        reply = self._recv(timeout_s)
        if reply[0] != kind:
            raise DrafterFailed(f"drafter worker answered {reply[0]!r}, expected {kind!r}")
        return reply

    def _recv(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            # Short polls so that a dead worker is noticed at once, not at the deadline.
            if self._conn.poll(0.05):
                try:
                    return self._conn.recv()
                except (EOFError, OSError) as e:
                    raise DrafterFailed(f"drafter worker is gone ({e})") from None
            if not self._proc.is_alive():
                raise DrafterFailed(f"drafter worker exited (code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise DrafterFailed(f"drafter worker did not answer within {timeout_s:.1f}s; killed it")

    def _collect(self, call_id: int) -> list[Proposal]:
        if self._in_flight != call_id:
            raise RuntimeError("proposal already collected")
        try:
            reply = self._expect("proposals", self.timeout_s)
        finally:
            self._in_flight = None
        answer: ProposeReply = reply[1]
        if answer.call_id != call_id:
            raise DrafterFailed(f"drafter replied to call {answer.call_id}, expected {call_id}")
        # (draft-ahead counters come once a pre-draft has met a verdict; until then the last kept)
        self._stats = replace(answer.stats, last_propose_s=answer.seconds,
                              ahead=answer.stats.ahead or self._stats.ahead)
        self._flush_frees()
        out = []
        for wp in answer.proposals:
            tokens, where = wp.tokens, wp.probs
            if isinstance(where, torch.Tensor):
                # A CUDA IPC tensor is the worker's memory: copy it so the worker may reuse it.
                probs = where.clone() if where.is_cuda else where
            elif where >= 0:
                # One copy out of shared memory: the next call reuses the buffer while these
                # proposals may still wait a step for verification (batch-parallel SD).
                probs = self._probs[where:where + len(tokens)].clone()
            else:
                probs = None
            out.append(Proposal(tokens, probs, wp.error, wp.resync))
        return out
