"""The engine's background loop: one thread calls ``engine.step()`` while there is work.

Triton-agnostic. The Triton model (or any front end) hands requests over with ``submit`` and
gets every ``RequestOutput`` of its request through a callback, called on the loop thread; it
must be quick (queue the output, do not block). Guarantees:

- every submitted request gets exactly one output with ``finished=True`` (also when ``step()``
  raises, when the engine loses a request, and at ``shutdown``);
- validation errors from ``engine.add_request`` are raised to the caller of ``submit`` and no
  callback is kept for that request;
- an exception in ``step()`` never kills the loop silently: it is logged, the requests it
  affects get a final output with ``finish_reason="error"`` (all in-flight requests, unless the
  exception names them in a ``request_ids`` attribute), and they are aborted in the engine so
  their KV blocks are freed. If ``step()`` fails several times in a row, the loop marks itself
  unhealthy (``healthy`` is False) and refuses new work with ``EngineLoopError``.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Callable, Protocol

from backend.errors import InvalidRequest
from backend.engine.outputs import RequestOutput
from backend.sampling.params import SamplingParams

log = logging.getLogger("nightdraft.engine_loop")

OutputCallback = Callable[[RequestOutput], None]


class EngineLoopError(RuntimeError):
    """The loop is shutting down or the engine is broken; the request was not accepted."""


class _EngineLike(Protocol):  # what the loop needs from backend.engine.engine.Engine
    def prepare(self, request_id: str, prompt, params: SamplingParams): ...
    def enqueue(self, prepared) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def background_pending(self) -> bool: ...
    def poll_background(self) -> None: ...


class EngineLoop:
    # After this many failing steps in a row with no request left to fail, give up.
    MAX_CONSECUTIVE_FAILURES = 5
    # While idle with background work (a drafter reload or restart under way, or an offloaded
    # drafter to bring back): how often to look again.
    IDLE_POLL_S = 0.05

    def __init__(self, engine: _EngineLike, *, name: str = "nightdraft-engine-loop",
                 on_step: Callable[[list[RequestOutput]], None] | None = None,
                 logger: logging.Logger | None = None, start: bool = True):
        """``on_step(outputs)`` runs on the loop thread after every step (metrics, stats);
        its exceptions are logged and ignored."""
        self.engine = engine
        self._log = logger or log
        self._on_step = on_step
        self._cv = threading.Condition(threading.Lock())
        self._callbacks: dict[str, OutputCallback] = {}
        self._stopping = False
        self._healthy = True
        self._fatal: str | None = None
        self._idle_failures = 0
        self.steps = 0
        self.step_errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self._thread.start()

    # ---------------------------------------------------------------- front-end side (any thread)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._healthy and self._thread.is_alive()

    @property
    def fatal(self) -> str | None:
        """Why the loop gave up (None while it serves)."""
        return self._fatal

    @property
    def num_inflight(self) -> int:
        with self._cv:
            return len(self._callbacks)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               on_output: OutputCallback) -> None:
        """Hand a request to the engine. Raises ``InvalidRequest`` (bad input, the message is
        safe to return to the client), ``ServerBusy`` (the queue is full) or ``EngineLoopError``
        (shutting down / engine broken)."""
        self._check_accepting()
        # Validation and tokenization outside the lock: a long prompt must not hold up the
        # step thread, which takes this lock between steps.
        prepared = self.engine.prepare(request_id, prompt, params)
        with self._cv:
            self._check_accepting()
            if request_id in self._callbacks:
                raise InvalidRequest(f"duplicate request id {request_id!r}")
            # Registered before enqueue so that no output can arrive unrouted.
            self._callbacks[request_id] = on_output
            try:
                self.engine.enqueue(prepared)
            except BaseException:
                self._callbacks.pop(request_id, None)
                raise
            self._cv.notify_all()

    def _check_accepting(self) -> None:
        if self._stopping:
            raise EngineLoopError("the server is shutting down; request not accepted")
        if not self._healthy:
            raise EngineLoopError(f"the engine has failed and accepts no requests: {self._fatal}")

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored). Its final output, with
        ``finish_reason="abort"``, comes from a later step."""
        with self._cv:
            if request_id not in self._callbacks:
                return
        try:
            self.engine.abort(request_id)
        except Exception:  # the engine's abort is documented idempotent; never let it escape
            self._log.exception("engine.abort(%s) failed", request_id)
        with self._cv:
            self._cv.notify_all()

    def shutdown(self, abort_inflight: bool = True, timeout_s: float | None = 60.0,
                 grace_s: float = 0.0) -> None:
        """Stop accepting work and end every in-flight request, then join the thread.

        With ``grace_s`` > 0, in-flight requests first get that long to finish on their own (a
        drain); then, or at once with ``abort_inflight``, the rest are aborted in the engine
        (their final outputs say ``finish_reason="abort"``). ``abort_inflight=False`` without a
        grace period waits up to ``timeout_s`` for them. Every request gets its final output,
        synthesized here if the engine did not produce it in time."""
        with self._cv:
            if self._stopping and not self._thread.is_alive():
                return
            self._stopping = True
            self._cv.notify_all()
            if grace_s > 0:
                deadline = time.monotonic() + grace_s
                while self._callbacks and self._thread.is_alive() and time.monotonic() < deadline:
                    self._cv.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
            ids = list(self._callbacks)
        if abort_inflight or grace_s > 0:
            if ids and grace_s > 0:
                self._log.warning("%d request(s) still running after the %.0f s grace period; "
                                  "aborting them", len(ids), grace_s)
            for rid in ids:
                try:
                    self.engine.abort(rid)
                except Exception:
                    self._log.exception("engine.abort(%s) failed during shutdown", rid)
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._log.error("engine loop did not stop within %s s; failing %d request(s)",
                                timeout_s, self.num_inflight)
        # Whatever is still registered never got a final output from the engine.
        self._fail_all("abort" if abort_inflight or grace_s > 0 else "error",
                       "the server shut down before the request finished")

    # ---------------------------------------------------------------- loop thread

    def _run(self) -> None:
        while True:
            look_again = False          # idle, with the drafter's return under way
            with self._cv:
                while True:
                    if self._stopping and not self._callbacks:
                        return  # every request has had its final output
                    if self._healthy and self._engine_busy():
                        orphans: list[str] = []
                        break
                    if self._callbacks:
                        # The engine has no work (or is broken) but requests still wait for a
                        # final output: fail them rather than leave their clients hanging.
                        orphans = list(self._callbacks)
                        break
                    if self._background_pending():
                        # Idle, but the drafter's weights (or a replacement drafter) are on
                        # their way, or to be brought back: look again shortly (outside the
                        # lock), so that its state is reported as it is, not as it was at the
                        # last step.
                        self._cv.wait(self.IDLE_POLL_S)
                        look_again, orphans = True, []
                        break
                    self._cv.wait()
            if look_again:
                self._poll_background()
                continue
            if orphans:
                why = (f"the engine has failed: {self._fatal}" if not self._healthy
                       else "the engine dropped the request without finishing it")
                self._fail(orphans, "error", why)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - any failure of a step is handled here
                self._step_failed(e)
                continue
            self._idle_failures = 0
            self.steps += 1
            self._dispatch(outputs)
            self._after_step(outputs)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        if self._on_step is not None:
            try:
                self._on_step(outputs)
            except Exception:
                self._log.exception("on_step hook failed")

    def _background_pending(self) -> bool:
        try:
            return bool(self.engine.background_pending())
        except Exception:
            self._log.exception("engine.background_pending() failed")
            return False

    def _poll_background(self) -> None:
        try:
            self.engine.poll_background()
        except Exception:
            self._log.exception("engine.poll_background() failed")
            return
        if not self._background_pending():
            self._after_step([])      # what the engine reports has changed: the hook refreshes it

    def _engine_busy(self) -> bool:
        try:
            return bool(self.engine.has_unfinished())
        except Exception:
            self._log.exception("engine.has_unfinished() failed")
            return bool(self._callbacks)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._cv:
                cb = self._callbacks.pop(out.request_id, None) if out.finished \
                    else self._callbacks.get(out.request_id)
                if out.finished and not self._callbacks:
                    self._cv.notify_all()        # a draining shutdown waits for this
            if cb is None:
                continue  # already failed or its consumer went away
            try:
                cb(out)
            except Exception:
                self._log.exception("output callback for %s failed; aborting the request", out.request_id)
                if not out.finished:
                    with self._cv:
                        self._callbacks.pop(out.request_id, None)
                    try:
                        self.engine.abort(out.request_id)
                    except Exception:
                        self._log.exception("engine.abort(%s) failed", out.request_id)

    def _step_failed(self, e: Exception) -> None:
        self.step_errors += 1
        tb = traceback.format_exc()
        named = getattr(e, "request_ids", None)
        with self._cv:
            ids = [r for r in named if r in self._callbacks] if named else list(self._callbacks)
        self._log.error("engine.step() failed (%s: %s); failing %d request(s):\n%s",
                        type(e).__name__, e, len(ids), tb)
        msg = f"internal engine error: {type(e).__name__}: {e}"
        self._fail(ids, "error", msg)
        for rid in ids:  # free their KV blocks; their abort outputs find no callback
            try:
                self.engine.abort(rid)
            except Exception:
                self._log.exception("engine.abort(%s) failed", rid)
        # A request at fault fails alone inside the step (see backend.engine); a step that
        # raises is the engine's own failure. A few in a row, whether or not they had requests
        # to fail, mean it is broken: stop stepping and refuse new work (with a reason).
        self._idle_failures += 1
        if self._idle_failures >= self.MAX_CONSECUTIVE_FAILURES:
            with self._cv:
                self._healthy = False
                self._fatal = msg
            self._log.error("engine.step() failed %d times in a row; the engine loop stops "
                            "stepping and refuses new requests", self._idle_failures)
            return
        # Back off a little so a persistent failure does not spin a core.
        time.sleep(min(0.5, 0.01 * 2 ** min(self._idle_failures, 6)))

    def _fail(self, ids: list[str], reason: str, message: str) -> None:
        for rid in ids:
            with self._cv:
                cb = self._callbacks.pop(rid, None)
            if cb is None:
                continue
            try:
                cb(RequestOutput(request_id=rid, new_token_ids=[], new_text="", finished=True,
                                 finish_reason=reason, error=message if reason == "error" else None))
            except Exception:
                self._log.exception("output callback for %s failed", rid)

    def _fail_all(self, reason: str, message: str) -> None:
        with self._cv:
            ids = list(self._callbacks)
        self._fail(ids, reason, message)
