"""Shutdown is a drain: notice that Triton is stopping or unloading the model, stop admitting,
give the requests in flight a grace period, end the rest with a final error.

Triton counts a decoupled request as in flight only while ``execute`` runs, so at shutdown it
sees none, starts unloading the model, and waits for the model's streams, which nobody ends:
finalize never runs, and after --exit-timeout-secs the process is torn down with every client
waiting. The model's readiness is what changes when the unload begins. It is asked over the
server's own HTTP endpoint (``health.ReadinessProbe``): asking through the Python backend
(``pb_utils.is_model_ready``) while the unload begins crashed the stub in about one shutdown
in four here (Triton 2.51).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from backend.serving.health import ReadinessProbe
from backend.serving.request import InflightRequests

log = logging.getLogger("nightdraft.triton")

UNLOAD_POLL_S = 0.25
# In-flight requests get this long to finish once the server stops (or unloads the model);
# keep it below tritonserver's --exit-timeout-secs (30 s by default), after which Triton gives up.
DEFAULT_SHUTDOWN_GRACE_S = 20.0


class Drain:
    def __init__(self, name: str, version: str, *, loop: Any, inflight: InflightRequests,
                 grace_s: float = DEFAULT_SHUTDOWN_GRACE_S):
        self.name, self.version = name, version
        self.loop, self.inflight, self.grace_s = loop, inflight, grace_s
        self.draining = threading.Event()
        self.served = threading.Event()      # execute() has been called
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self) -> None:
        """Start watching for the unload (a daemon thread; ``close`` ends it)."""
        self._watcher = threading.Thread(target=self._watch_for_unload, name=f"{self.name}-unload",
                                         daemon=True)
        self._watcher.start()

    def close(self) -> None:
        self._closed.set()

    def abort_message(self) -> tuple[str, str]:
        """Why a request the engine aborted ended, when its client did not cancel it."""
        if self.draining.is_set():
            return (f"the server is stopping: the request did not finish within the shutdown "
                    f"grace period ({self.grace_s:.0f} s)", "UNAVAILABLE")
        return ("request aborted (the server is shutting down or the request was aborted)",
                "UNAVAILABLE")

    def _watch_for_unload(self) -> None:
        probe = ReadinessProbe.for_this_server(self.name, self.version)
        if probe is None:
            log.warning("%s: cannot find this server's HTTP endpoint (started with "
                        "--allow-http=false?); in-flight requests will not be drained at shutdown",
                        self.name)
            return
        seen_ready = False
        while not self._closed.wait(UNLOAD_POLL_S):
            ready = probe.ready()
            # Not ready is "still loading" until the model has been seen ready, or has been
            # sent a request (which only a ready model is): a shutdown that comes sooner than
            # the first poll must still be noticed.
            seen_ready = seen_ready or ready or self.served.is_set()
            if seen_ready and not ready:
                self.drain("Triton is stopping or unloading the model")
                return

    def drain(self, why: str) -> None:
        """Stop admitting; give in-flight requests the grace period; end the rest with a final
        error; return once every client has its final response."""
        if self.draining.is_set():
            return
        self.draining.set()
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
