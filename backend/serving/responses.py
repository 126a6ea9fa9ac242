"""Responses out: the one error builder, and the thread that sends every response.

The engine loop thread only queues each output (``ResponseThread.callback``). The response
thread takes what is queued, merges each request's outputs into one (``coalesce``: a thread
that falls behind the engine catches up by sending one response per request, not one per
step), builds the responses with the request's schema, sends them, and polls
``is_cancelled()`` of the requests in flight every ``CANCEL_POLL_S`` (a cancelled request is
aborted in the engine, which frees its KV blocks at the next step). Every request gets exactly
one final flag: sent in ``finally``, also when building its response fails. Nothing but ``stop``
ends the thread: a failure while handling one request's output (building a response, an error
response, the metrics, an IPC call) is logged, and that request still gets its final flag.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from dataclasses import replace
from typing import Any, Callable

from backend.engine.outputs import RequestOutput
from backend.serving.request import InflightRequests, ServedRequest

log = logging.getLogger("nightdraft.triton")

CANCEL_POLL_S = 0.05
MAX_BATCH = 4096


def error_response(pb: Any, message: str, code: str = "INTERNAL") -> Any:
    """An error response; ``code`` names a ``pb_utils.TritonError`` code (INVALID_ARG,
    UNAVAILABLE, CANCELLED, INTERNAL). Older stubs take no code: the message alone then."""
    try:
        err = pb.TritonError(message, getattr(pb.TritonError, code))
    except (TypeError, AttributeError):
        err = pb.TritonError(message)
    return pb.InferenceResponse(output_tensors=[], error=err)


def send_error(pb: Any, sender: Any, message: str, code: str, name: str = "nightdraft") -> None:
    """An error response with the final flag (``name``: the model, for the log)."""
    try:
        sender.send(error_response(pb, message, code), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception:
        log.error("%s: sending an error response failed:\n%s", name, traceback.format_exc())


def coalesce(outputs: list[RequestOutput]) -> list[tuple[RequestOutput, int]]:
    """Merge the outputs of the same request that are waiting to be sent into one, in order:
    (merged output, index of its first part). A server that falls behind then sends one
    response per request instead of one per engine step, which is what lets it catch up.
    Nothing follows a request's final output (the engine sends none)."""
    merged: dict[str, int] = {}
    out: list[tuple[RequestOutput, int]] = []
    for i, o in enumerate(outputs):
        k = merged.get(o.request_id)
        if k is None or out[k][0].finished:
            merged[o.request_id] = len(out)
            out.append((o, i))
            continue
        prev, first = out[k]
        logprobs = None if prev.logprobs is None and o.logprobs is None else \
            (prev.logprobs or []) + (o.logprobs or [])
        out[k] = (replace(o, new_token_ids=prev.new_token_ids + o.new_token_ids,
                          new_text=prev.new_text + o.new_text, logprobs=logprobs,
                          prompt_logprobs=prev.prompt_logprobs or o.prompt_logprobs), first)
    return out


class ResponseThread:
    """Sends the responses of one model instance. ``abort_message()`` says why a request the
    engine aborted (and the client did not cancel) ended: (message, code)."""

    def __init__(self, pb: Any, name: str, *, loop: Any, inflight: InflightRequests,
                 metrics: Any, abort_message: Callable[[], tuple[str, str]]):
        self.pb, self.name = pb, name
        self.loop, self.inflight, self.metrics = loop, inflight, metrics
        self._abort_message = abort_message
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = object()
        self._thread = threading.Thread(target=self._run, name=f"{name}-responses", daemon=True)
        self._thread.start()

    def callback(self, r: ServedRequest) -> Callable[[RequestOutput], None]:
        """The engine loop's callback for ``r``: runs on the loop thread, so it only queues."""
        put = self._queue.put

        def on_output(out: RequestOutput) -> None:
            put((r, out, time.monotonic()))
        return on_output

    def stop(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, then end the thread."""
        self._queue.put(self._stop)
        self._thread.join(timeout=timeout_s)

    # ---- the thread

    def _run(self) -> None:
        # Nothing may end this thread but stop(): every client in flight, and every later one,
        # waits on it for its final flag.
        last_poll = time.monotonic()
        while True:
            batch = self._take()
            stopping = any(item is self._stop for item in batch)
            if stopping:   # drain what is queued (finals from the shutdown) before leaving
                batch += self._take_queued()
            items = [item for item in batch if item is not self._stop]
            try:
                self._send_batch(items)
            except Exception:
                log.error("%s: sending responses failed:\n%s", self.name, traceback.format_exc())
                for r, out, _ in items:
                    if out.finished:
                        self._end(r)
            if stopping:
                return
            now = time.monotonic()
            if now - last_poll >= CANCEL_POLL_S:
                last_poll = now
                try:
                    self.poll_cancelled()
                except Exception:
                    log.error("%s: polling cancellations failed:\n%s", self.name, traceback.format_exc())

    def _take(self) -> list:
        """What is queued: wait up to CANCEL_POLL_S for the first item, then take the rest."""
        try:
            first = self._queue.get(timeout=CANCEL_POLL_S)
        except queue.Empty:
            return []
        return [first] + self._take_queued(MAX_BATCH - 1)

    def _take_queued(self, limit: int | None = None) -> list:
        items: list = []
        while limit is None or len(items) < limit:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def _send_batch(self, items: list[tuple]) -> None:
        """One response per request; the first part's time is its first token's."""
        latest = {out.request_id: (r, t_out) for r, out, t_out in items}
        for out, first in coalesce([out for _, out, _ in items]):
            r, t_last = latest[out.request_id]
            try:
                self._handle(r, out, items[first][2], t_last)
            except Exception:   # this request's problem alone
                log.error("%s: handling an output of request %s failed:\n%s", self.name, r.label,
                          traceback.format_exc())
                if out.finished:
                    self._end(r)
                else:
                    self._abort(r)

    def poll_cancelled(self) -> None:
        """Abort the requests in flight whose clients cancelled them (the thread's poll)."""
        for r in self.inflight.watched():
            if r.client_cancelled():
                # Set before the abort: a request still inside submit (being tokenized) is not
                # known to the engine yet, and the model aborts it after submit when this is set.
                r.cancelled = True
                log.info("%s: request %s cancelled by the client; aborting it", self.name, r.label)
                self._abort(r)

    def _abort(self, r: ServedRequest) -> None:
        try:
            self.loop.abort(r.id)
        except Exception:
            log.error("%s: aborting request %s failed:\n%s", self.name, r.label, traceback.format_exc())

    def _handle(self, r: ServedRequest, out: RequestOutput, t_first: float, t_last: float) -> None:
        if r.final_sent:
            return
        if self.metrics is not None and out.new_token_ids:
            first = r.first_token_at is None
            try:   # what the metrics do never changes what the client gets
                self.metrics.observe_tokens(len(out.new_token_ids),
                                            since_s=(t_last - t_first) if first else t_last - r.last_token_at,
                                            first_token_s=(t_first - r.arrival) if first else None)
            except Exception:
                log.error("%s: recording token metrics failed:\n%s", self.name, traceback.format_exc())
        r.track(out, t_first, t_last)
        if not out.finished:
            try:
                response = r.partial_response(out)
                if response is not None:
                    r.sender.send(response)
            except Exception:
                log.error("%s: sending a partial response failed; aborting the request:\n%s",
                          self.name, traceback.format_exc())
                self._abort(r)
            return
        response = None
        try:
            response = self._final_response(r, out)
        except Exception as e:
            log.error("%s: building the final response failed:\n%s", self.name, traceback.format_exc())
            response = error_response(self.pb, f"internal error: {type(e).__name__}: {e}", "INTERNAL")
        finally:
            self._finish(r, out)
            self._send_final(r, response)

    def _final_response(self, r: ServedRequest, out: RequestOutput) -> Any:
        if out.finish_reason == "error":
            return error_response(self.pb, out.error or "internal engine error", "INTERNAL")
        if out.finish_reason == "abort":
            if r.cancelled:
                return error_response(self.pb, "request cancelled by the client", "CANCELLED")
            return error_response(self.pb, *self._abort_message())
        return r.final_response(out)

    def _send_final(self, r: ServedRequest, response: Any) -> None:
        """The final response (None: the final flag alone)."""
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None:
            self._send_flag(r)
            return
        try:
            r.sender.send(response, flags=final)
        except Exception:
            log.error("%s: sending the final response failed:\n%s", self.name, traceback.format_exc())
            self._send_flag(r)   # at least the flag, so the client is not left waiting

    def _send_flag(self, r: ServedRequest) -> None:
        try:
            r.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            log.error("%s: sending the final flag of request %s failed:\n%s", self.name, r.label,
                      traceback.format_exc())

    def _end(self, r: ServedRequest) -> None:
        """A request whose final output could not be handled: its final flag, if not sent yet."""
        if r.final_sent:
            return
        r.mark_final()
        self.inflight.remove(r)
        try:
            response = error_response(self.pb, "internal error: the final response could not be built", "INTERNAL")
        except Exception:
            response = None
        self._send_final(r, response)

    def _finish(self, r: ServedRequest, out: RequestOutput) -> None:
        r.mark_final()
        self.inflight.remove(r)
        if self.metrics is None:
            return
        try:
            ttft, tpot = r.latencies()
            reason = "abort" if r.cancelled else out.finish_reason
            self.metrics.observe_request(ttft_s=ttft, tpot_s=tpot, e2e_s=time.monotonic() - r.arrival,
                                         finish_reason=reason, prompt_tokens=r.num_prompt_tokens,
                                         generation_tokens=r.num_output_tokens)
        except Exception:   # the request's final flag comes next, whatever the metrics do
            log.error("%s: recording the metrics of request %s failed:\n%s", self.name, r.label,
                      traceback.format_exc())
