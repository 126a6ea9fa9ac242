"""Load signals for the planner: what it decides from.

* :class:`LoadSignals` — one snapshot: the engine's load, its drafter and memory, and what a
  serving front end adds (``server_arrival_rate``, ``server_pending``, ``server_queue_s`` and the
  GPU/CPU fields have server-agnostic names: any front end with such counters can fill them;
  ``backend.serving.metrics_scraper`` fills them from Triton's metrics endpoint).
* :class:`EngineSignals` — the engine's own stats. The engine calls ``record_arrivals(n, now)``
  when requests come in and ``snapshot(batch_size, waiting, kv_usage, now)`` before a step; the
  arrival rate is the number of arrivals in a sliding window (``window_s``) over the window's
  length (or over the time since the first call, while that is shorter); the demand
  (``demand_req_s``, ``demand_tok_s``) is the fast estimate of :mod:`planner.demand`, which the
  offload gates compare with the running arm's capacity.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from planner.demand import DemandEstimate


@dataclass
class LoadSignals:
    batch_size: int                 # running (decoding) requests
    waiting: int = 0                # requests admitted but waiting (for KV blocks or a slot)
    # of those, the ones the last admission left waiting; the rest arrived since and have not
    # been offered admission (None: not reported, every waiting request counts)
    left_waiting: int | None = None
    kv_usage: float = 0.0           # fraction of the target KV pool in use, 0..1
    arrival_rate: float = 0.0       # requests per second, over the last 10 s
    now: float | None = None        # time of the snapshot (time.monotonic() seconds)
    # demand, within seconds (planner.demand; None: the engine does not estimate it)
    demand_req_s: float | None = None       # requests arriving per second
    demand_tok_s: float | None = None       # tokens they ask for per second
    waiting_tokens: int | None = None       # tokens the waiting requests still ask for
    # the drafter, as the engine reports it
    drafter_offloaded: bool | None = None   # True while its weights are in host memory
    drafter_lag_tokens: int | None = None   # tokens the drafter must prefill to catch up
    # elastic memory, as the engine's memory manager reports it (None: no offloading there)
    kv_growth_if_offloaded: float | None = None  # target pool size after an offload / now
    kv_usage_at_base: float | None = None   # used blocks / the pool's size with the drafter on
    batch_limit: int | None = None          # most requests the engine runs at once
    # from the serving front end, e.g. Triton's metrics endpoint (None: not configured, not
    # scraped yet, or not exported)
    server_arrival_rate: float | None = None    # requests/s (Triton: nv_inference_request_success)
    server_pending: float | None = None         # requests queued in front of the model
    server_queue_s: float | None = None         # mean queueing time per request, last interval
    gpu_memory_used_bytes: float | None = None  # summed over GPUs
    gpu_memory_total_bytes: float | None = None
    gpu_utilization: float | None = None        # mean over GPUs, 0..1
    cpu_utilization: float | None = None        # 0..1
    cpu_memory_used_bytes: float | None = None
    cpu_memory_total_bytes: float | None = None

    @property
    def queued(self) -> int:
        """Requests that admission has turned away: a queue, not an arrival in transit."""
        return self.waiting if self.left_waiting is None else min(self.left_waiting, self.waiting)

    @property
    def gpu_memory_fraction(self) -> float | None:
        if self.gpu_memory_used_bytes is None or not self.gpu_memory_total_bytes:
            return None
        return self.gpu_memory_used_bytes / self.gpu_memory_total_bytes


class EngineSignals:
    """Arrival rate over a sliding window plus the engine's instantaneous stats. Thread-safe:
    arrivals may be recorded from the server's request thread while the engine loop snapshots."""

    def __init__(self, window_s: float = 10.0, min_span_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, demand_tau_s: float = 2.0):
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = float(window_s)
        self.min_span_s = float(min_span_s)
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._in_window = 0
        self._t0: float | None = None
        self.total_arrivals = 0
        self.demand = DemandEstimate(demand_tau_s)
        self._lock = threading.Lock()

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        ev = self._events
        while ev and ev[0][0] <= horizon:
            self._in_window -= ev.popleft()[1]

    def record_arrivals(self, n: int = 1, now: float | None = None, max_tokens: int = 0) -> None:
        """`n` requests arrived, each asking for up to `max_tokens` tokens."""
        if n <= 0:
            return
        now = self._clock() if now is None else float(now)
        self.demand.arrived(now, max_tokens, n)
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            self._events.append((now, int(n)))
            self._in_window += int(n)
            self.total_arrivals += int(n)
            self._prune(now)

    def arrival_rate(self, now: float | None = None) -> float:
        now = self._clock() if now is None else float(now)
        with self._lock:
            if self._t0 is None:
                self._t0 = now
                return 0.0
            self._prune(now)
            span = min(self.window_s, max(now - self._t0, self.min_span_s))
            return self._in_window / span

    def snapshot(self, batch_size: int, waiting: int = 0, kv_usage: float = 0.0,
                 now: float | None = None, **extra) -> LoadSignals:
        now = self._clock() if now is None else float(now)
        req_s, tok_s = self.demand.rates(now)
        return LoadSignals(batch_size=int(batch_size), waiting=int(waiting), kv_usage=float(kv_usage),
                           arrival_rate=self.arrival_rate(now), now=now, demand_req_s=req_s,
                           demand_tok_s=tok_s, **extra)
