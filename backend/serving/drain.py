"""Shutdown is a drain: notice that Triton is stopping or unloading the model, stop admitting,
give the requests in flight a grace period, end the rest with a final error.

Triton counts a decoupled request as in flight only while ``execute`` runs, so at shutdown it
sees none, starts unloading the model, and waits for the model's streams, which nobody ends:
finalize never runs, and after --exit-timeout-secs the process is torn down with every client
waiting. The model's readiness is what changes when the unload begins. It is asked over the
server's own HTTP endpoint (``health.ReadinessProbe``): asking through the Python backend
(``pb_utils.is_model_ready``) while the unload begins crashed the stub in about one shutdown
in four here (Triton 2.51).

A drain is for good: it starts only when the server has said "not ready" (an HTTP answer, or its
endpoint refusing connections: Triton closes it first when it stops) on ``NOT_READY_POLLS``
polls in a row, after the model was seen ready (or served). A poll that gets no answer (a
timeout, no file descriptor left, a malformed reply) breaks the row, is counted
(``probe_errors``) and logged now and then. The watcher thread also runs ``on_poll`` (the
model's engine-health check) every poll; nothing it raises ends the thread.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from backend.serving.health import Readiness, ReadinessProbe
from backend.serving.request import InflightRequests

log = logging.getLogger("nightdraft.triton")

UNLOAD_POLL_S = 0.25
# The server must say "not ready" (or refuse the connection) this many polls in a row: one stray
# answer is not a stop. A stop keeps saying it until the process exits.
NOT_READY_POLLS = 3
# A probe that keeps failing is logged at most once per this many seconds.
PROBE_ERROR_LOG_S = 60.0
# In-flight requests get this long to finish once the server stops (or unloads the model);
# keep it below tritonserver's --exit-timeout-secs (30 s by default), after which Triton gives up.
DEFAULT_SHUTDOWN_GRACE_S = 20.0


class Drain:
    def __init__(self, name: str, version: str, *, loop: Any, inflight: InflightRequests,
                 grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, on_poll: Callable[[], None] | None = None,
                 probe: ReadinessProbe | None = None):
        """``probe``: how to ask for the model's readiness (default: this server's endpoint)."""
        self.name, self.version = name, version
        self.loop, self.inflight, self.grace_s = loop, inflight, grace_s
        self.on_poll = on_poll
        self.probe = probe
        self.draining = threading.Event()
        self.served = threading.Event()      # execute() has been called
        self.probe_errors = 0                # polls that got no answer about readiness
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._seen_ready, self._not_ready, self._last_logged = False, 0, float("-inf")

    def watch(self) -> None:
        """Start watching for the unload (a daemon thread; ``close`` ends it)."""
        self._watcher = threading.Thread(target=self._watch, name=f"{self.name}-unload", daemon=True)
        self._watcher.start()

    @property
    def watching(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive()

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def abort_message(self) -> tuple[str, str]:
        """Why a request the engine aborted ended, when its client did not cancel it."""
        if self.draining.is_set():
            return (f"the server is stopping: the request did not finish within the shutdown "
                    f"grace period ({self.grace_s:.0f} s)", "UNAVAILABLE")
        return ("request aborted (the server is shutting down or the request was aborted)",
                "UNAVAILABLE")

    def _watch(self) -> None:
        if self.probe is None:
            self.probe = ReadinessProbe.for_this_server(self.name, self.version)
        if self.probe is None:
            log.warning("%s: cannot find this server's HTTP endpoint (started with "
                        "--allow-http=false?); in-flight requests will not be drained at shutdown",
                        self.name)
        while not self._closed.wait(UNLOAD_POLL_S):
            self._run_on_poll()
            if self.probe is None or self.draining.is_set():
                continue
            try:
                self._poll_readiness()
            except Exception:   # nothing ends this thread but close(): a real stop must be seen
                self.probe_errors += 1
                self._not_ready = 0
                log.exception("%s: polling the model's readiness failed", self.name)

    def _run_on_poll(self) -> None:
        if self.on_poll is not None:
            try:
                self.on_poll()
            except Exception:
                log.exception("%s: the health check failed", self.name)

    def _poll_readiness(self) -> None:
        answer = self.probe.poll()
        if answer is Readiness.UNKNOWN:
            self.probe_errors += 1
            self._not_ready = 0
            now = time.monotonic()
            if now - self._last_logged >= PROBE_ERROR_LOG_S:
                self._last_logged = now
                log.warning("%s: cannot ask the server whether the model is ready (%s; %d such "
                            "poll(s) so far); serving on, a stop is noticed once it answers",
                            self.name, self.probe.last_error, self.probe_errors)
            return
        ready = answer is Readiness.READY
        # Not ready is "still loading" until the model has been seen ready, or has been sent a
        # request (which only a ready model is): a shutdown that comes sooner than the first
        # poll must still be noticed.
        self._seen_ready = self._seen_ready or ready or self.served.is_set()
        self._not_ready = 0 if ready or not self._seen_ready else self._not_ready + 1
        if self._not_ready >= NOT_READY_POLLS:
            self.drain("Triton is stopping or unloading the model")

    def drain(self, why: str) -> None:
        """Stop admitting; give in-flight requests the grace period; end the rest with a final
        error; return once every client has its final response."""
        if self.draining.is_set():
            return
        self.draining.set()
        self._run_on_poll()      # the state says "draining" from now, not after the drain
        log.info("%s: %s: draining %d request(s) for up to %.0f s", self.name, why,
                 self.loop.num_inflight, self.grace_s)
        try:
            self.loop.shutdown(abort_inflight=False, grace_s=self.grace_s, timeout_s=10.0)
        except Exception:
            log.exception("%s: engine loop shutdown failed", self.name)
        deadline = time.monotonic() + 10.0     # the response thread sends the finals
        while time.monotonic() < deadline and len(self.inflight):
            time.sleep(0.02)
        log.info("%s: drained", self.name)
