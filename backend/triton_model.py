"""The Triton Python-backend glue: a decoupled model over the engine loop.

Triton-specific code lives here, but ``pb_utils`` (``triton_python_backend_utils``) is passed in
by the thin ``model.py`` files of the model repository, so importing ``backend`` never needs
Triton. Two flavours share this code:

``kind="text"`` (model ``nightdraft``)
    The request schema of Triton's vLLM backend: ``text_input`` (required), ``stream``,
    ``sampling_parameters`` (JSON; numbers may be strings), ``exclude_input_in_output``,
    ``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens``,
    ``max_tokens``; request parameters (``/generate``'s ``"parameters"``) are read too, and the
    tensor inputs win over them. Outputs ``text_output`` (a delta per streamed response),
    ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``.

``kind="tokens"`` (model ``nightdraft_tokens``, the middle of the ensemble)
    TensorRT-LLM-style token I/O: ``input_ids`` (required), ``request_output_len``,
    ``streaming``, ``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``random_seed``,
    ``sampling_parameters``. Outputs ``output_ids`` and ``output_offset``: each response holds a
    window of token ids whose first ``output_offset`` ids were already sent (context for the
    decoder), so the stateless ``postprocessing`` model can decode exactly the text delta the
    engine's incremental detokenizer produced, also across multi-byte characters.

Threads: ``execute`` parses and submits, then returns. The engine loop thread steps the engine
and queues every output; one response thread turns them into responses, sends them, and polls
``is_cancelled()`` of in-flight requests (a cancelled request is aborted in the engine, which
frees its KV blocks). Every request gets exactly one final flag: sent in ``finally``, also when
building a response fails, and at ``finalize`` (which aborts in-flight work and joins threads).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backend.engine_config import ConfigError, EngineConfig
from backend.engine_loop import EngineLoop, EngineLoopError
from backend.outputs import RequestOutput, coalesce
from backend.triton_health import ReadinessProbe
from backend.errors import InvalidRequest, ServerBusy
from backend.sampling_params import SamplingParams, parse_json_object, parse_sampling_json

log = logging.getLogger("nightdraft.triton")

CANCEL_POLL_S = 0.05
UNLOAD_POLL_S = 0.25
# In-flight requests get this long to finish once the server stops (or unloads the model);
# keep it below tritonserver's --exit-timeout-secs (30 s by default), after which Triton gives up.
DEFAULT_SHUTDOWN_GRACE_S = 20.0
PLANNER_SUMMARY = "planner summary: "      # prefix of the JSON line logged at unload
# Sampling knobs that may also come as tensor inputs (they win over sampling_parameters).
_SAMPLING_TENSORS = ("ignore_eos", "min_tokens")
# Keys of request parameters / sampling_parameters that are request options, not sampling knobs.
_TEXT_FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason",
               "return_num_input_tokens", "return_num_output_tokens")


class _PbLogHandler(logging.Handler):
    """Forward the ``nightdraft`` loggers to Triton's log."""

    def __init__(self, pb_utils: Any):
        super().__init__(logging.INFO)
        self._logger = pb_utils.Logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            if record.levelno >= logging.ERROR:
                self._logger.log_error(msg)
            elif record.levelno >= logging.WARNING:
                self._logger.log_warn(msg)
            else:
                self._logger.log_info(msg)
        except Exception:  # never let logging break serving
            pass


def _install_log_bridge(pb_utils: Any) -> None:
    root = logging.getLogger("nightdraft")
    if not any(isinstance(h, _PbLogHandler) for h in root.handlers):
        h = _PbLogHandler(pb_utils)
        h.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False


# ------------------------------------------------------------------------------ input parsing


def _scalar(tensor: Any, name: str) -> Any:
    arr = tensor.as_numpy()
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"input {name!r} must hold exactly one value, got {flat.size}")
    return flat[0]


def _as_str(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"input {name!r} is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"input {name!r} must be a string, got {type(value).__name__}")


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    if isinstance(value, (bytes, np.bytes_)):
        value = bytes(value).decode("utf-8", "replace")
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise InvalidRequest(f"{name} must be a boolean, got {value!r}")


def _request_parameters(request: Any) -> dict[str, Any]:
    try:
        raw = request.parameters()
    except Exception:
        return {}
    if not raw:
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    return parse_json_object(raw, "request parameters")


def _sampling_json(pb: Any, request: Any) -> dict[str, Any]:
    t = pb.get_input_tensor_by_name(request, "sampling_parameters")
    if t is None:
        return {}
    return parse_sampling_json(_as_str(_scalar(t, "sampling_parameters"), "sampling_parameters"))


@dataclass
class ParsedRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    prepend_input: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def parse_text_request(pb: Any, request: Any) -> ParsedRequest:
    """The vLLM-backend request schema -> prompt, SamplingParams and options."""
    t = pb.get_input_tensor_by_name(request, "text_input")
    if t is None:
        raise InvalidRequest("missing required input 'text_input'")
    prompt = _as_str(_scalar(t, "text_input"), "text_input")
    if not prompt:
        raise InvalidRequest("input 'text_input' is empty")

    raw = _request_parameters(request)
    raw.update(_sampling_json(pb, request))
    flags: dict[str, Any] = {k: raw.pop(k) for k in _TEXT_FLAGS if k in raw}
    for name in _TEXT_FLAGS:  # tensor inputs win over parameters
        tt = pb.get_input_tensor_by_name(request, name)
        if tt is not None:
            flags[name] = _scalar(tt, name)
    opts = {k: _as_bool(v, k) for k, v in flags.items()}
    for name in _SAMPLING_TENSORS:  # genai-perf's --extra-inputs arrive as tensors
        tt = pb.get_input_tensor_by_name(request, name)
        if tt is not None:
            v = _scalar(tt, name)
            raw[name] = v.item() if hasattr(v, "item") else v
    max_tokens = None
    mt = pb.get_input_tensor_by_name(request, "max_tokens")
    if mt is not None:
        max_tokens = _int_scalar(mt, "max_tokens")
    params = SamplingParams.from_dict(raw, max_tokens=max_tokens)

    stream = opts.get("stream", False)
    # As in the vLLM backend: the prompt is prepended to a non-streamed output unless
    # exclude_input_in_output; streamed outputs never include it.
    if "exclude_input_in_output" in opts:
        prepend = not opts["exclude_input_in_output"]
    else:
        prepend = not stream
    if prepend and stream:
        raise InvalidRequest("when streaming, exclude_input_in_output = false is not supported")
    return ParsedRequest(prompt=prompt, params=params, stream=stream, prepend_input=prepend,
                         return_finish_reason=opts.get("return_finish_reason", False),
                         return_num_input_tokens=opts.get("return_num_input_tokens", False),
                         return_num_output_tokens=opts.get("return_num_output_tokens", False))


def _int_scalar(t: Any, name: str) -> int:
    v = _scalar(t, name)
    if isinstance(v, (np.integer, int)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (bytes, np.bytes_, str)):
        s = _as_str(v, name).strip()
        try:
            return int(s)
        except ValueError:
            pass
    raise InvalidRequest(f"input {name!r} must be an integer, got {v!r}")


_TOKEN_SCALARS = {  # TensorRT-LLM input name -> SamplingParams key
    "request_output_len": "max_tokens",
    "temperature": "temperature",
    "runtime_top_k": "top_k",
    "runtime_top_p": "top_p",
    "random_seed": "seed",
}


def parse_tokens_request(pb: Any, request: Any) -> ParsedRequest:
    t = pb.get_input_tensor_by_name(request, "input_ids")
    if t is None:
        raise InvalidRequest("missing required input 'input_ids'")
    ids = np.asarray(t.as_numpy()).reshape(-1)
    if ids.dtype.kind not in "iu":
        raise InvalidRequest(f"input 'input_ids' must hold integers, got {ids.dtype}")
    lt = pb.get_input_tensor_by_name(request, "input_lengths")
    if lt is not None:
        n = _int_scalar(lt, "input_lengths")
        if not 0 <= n <= ids.size:
            raise InvalidRequest(f"input_lengths {n} outside [0, {ids.size}]")
        ids = ids[:n]
    if ids.size == 0:
        raise InvalidRequest("input 'input_ids' is empty")
    raw = _sampling_json(pb, request)
    stream = False
    if "streaming" in raw or "stream" in raw:
        stream = _as_bool(raw.pop("streaming", raw.pop("stream", False)), "streaming")
    st = pb.get_input_tensor_by_name(request, "streaming")
    if st is not None:
        stream = _as_bool(_scalar(st, "streaming"), "streaming")
    for name, key in _TOKEN_SCALARS.items():
        tt = pb.get_input_tensor_by_name(request, name)
        if tt is not None:
            v = _scalar(tt, name)
            raw[key] = v.item() if hasattr(v, "item") else v
    params = SamplingParams.from_dict(raw)
    return ParsedRequest(prompt=[int(x) for x in ids], params=params, stream=stream)


# ------------------------------------------------------------------------------ per request


@dataclass
class _Inflight:
    id: str
    client_id: str
    request: Any
    sender: Any
    parsed: ParsedRequest
    arrival: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    text: list[str] = field(default_factory=list)          # non-streamed text so far
    all_ids: list[int] = field(default_factory=list)        # tokens flavour
    win_start: int = 0                                      # tokens flavour: window start
    win_read: int = 0                                       # tokens flavour: ids already sent
    pending_ids: int = 0                                    # streamed ids not yet sent
    cancelled: bool = False
    final_sent: bool = False


def make_triton_model(pb_utils: Any, kind: str = "text") -> type:
    """Build the ``TritonPythonModel`` class for a ``model.py`` (``kind``: "text" | "tokens")."""
    if kind not in ("text", "tokens"):
        raise ValueError(f"kind must be 'text' or 'tokens', got {kind!r}")

    class TritonPythonModel(_NightdraftModel):
        pb = pb_utils
        KIND = kind

    return TritonPythonModel


class _NightdraftModel:
    pb: Any = None
    KIND = "text"

    # ------------------------------------------------------------------ life cycle

    def initialize(self, args: dict[str, str]) -> None:
        pb = self.pb
        _install_log_bridge(pb)
        self.model_config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", self.model_config.get("name", "nightdraft"))
        if not pb.using_decoupled_model_transaction_policy(self.model_config):
            raise pb.TritonModelException(
                f"{self.model_name}: config.pbtxt must set model_transaction_policy {{ decoupled: true }}")
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        cfg_path = Path(self._param("engine_config", "engine.json"))
        if not cfg_path.is_absolute():
            cfg_path = version_dir / cfg_path
        if not cfg_path.is_file():
            raise pb.TritonModelException(f"{self.model_name}: engine configuration {cfg_path} not found")
        try:
            config = EngineConfig.from_file(cfg_path)
        except ConfigError as e:
            raise pb.TritonModelException(f"{self.model_name}: {cfg_path}: {e}") from None
        log.info("%s: loading engine from %s (target %s, drafter %s, mode %s, device %s)",
                 self.model_name, cfg_path, config.target, config.drafter, config.mode, config.device)
        from backend.engine import Engine  # heavy (torch); imported when a model loads
        t0 = time.monotonic()
        self.engine = Engine(config)
        log.info("%s: engine ready in %.1f s (max_model_len %d)", self.model_name,
                 time.monotonic() - t0, self.engine.max_model_len)

        self.metrics = None
        if self._param("report_custom_metrics", "true").lower() in ("1", "true", "yes"):
            try:
                from backend.triton_metrics import TritonMetrics
                self.metrics = TritonMetrics(pb, {"model": self.model_name,
                                                  "version": str(args["model_version"])})
                self.metrics.update_from_stats(self.engine.stats(), force=True)
            except Exception as e:  # e.g. the server runs with --allow-metrics=false
                log.warning("%s: custom metrics disabled: %s", self.model_name, e)
                self.metrics = None

        self._inflight: dict[str, _Inflight] = {}
        self._inflight_lock = threading.Lock()
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = object()
        self._version = str(args["model_version"])
        try:
            self._grace_s = float(self._param("shutdown_grace_s", str(DEFAULT_SHUTDOWN_GRACE_S)))
        except ValueError:
            raise pb.TritonModelException(f"{self.model_name}: parameter shutdown_grace_s must be "
                                          "a number of seconds") from None
        self._draining = threading.Event()
        self._closed = threading.Event()
        self._served = threading.Event()       # execute() has been called
        self.loop = EngineLoop(self.engine, on_step=self._on_step, name=f"{self.model_name}-engine")
        self._response_thread = threading.Thread(target=self._response_loop,
                                                 name=f"{self.model_name}-responses", daemon=True)
        self._response_thread.start()
        self._watcher = threading.Thread(target=self._watch_for_unload, name=f"{self.model_name}-unload",
                                         daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ shutdown is a drain

    def _watch_for_unload(self) -> None:
        """Notice that Triton is stopping or unloading the model, and drain.

        Triton counts a decoupled request as in flight only while ``execute`` runs, so at
        shutdown it sees none, starts unloading the model, and waits for the model's streams,
        which nobody ends: finalize never runs, and after --exit-timeout-secs the process is
        torn down with every client waiting. The model's readiness is what changes when the
        unload begins. It is asked over the server's own HTTP endpoint: asking through the
        Python backend (``pb_utils.is_model_ready``) while the unload begins crashed the stub
        in about one shutdown in four here (Triton 2.51)."""
        probe = ReadinessProbe.for_this_server(self.model_name, self._version)
        if probe is None:
            log.warning("%s: cannot find this server's HTTP endpoint (started with "
                        "--allow-http=false?); in-flight requests will not be drained at shutdown",
                        self.model_name)
            return
        seen_ready = False
        while not self._closed.wait(UNLOAD_POLL_S):
            ready = probe.ready()
            # Not ready is "still loading" until the model has been seen ready, or has been
            # sent a request (which only a ready model is): a shutdown that comes sooner than
            # the first poll must still be noticed.
            seen_ready = seen_ready or ready or self._served.is_set()
            if seen_ready and not ready:
                self.drain("Triton is stopping or unloading the model")
                return

    def drain(self, why: str) -> None:
        """Stop admitting; give in-flight requests the grace period; end the rest with a final
        error; return once every client has its final response."""
        if self._draining.is_set():
            return
        self._draining.set()
        log.info("%s: %s: draining %d request(s) for up to %.0f s", self.model_name, why,
                 self.loop.num_inflight, self._grace_s)
        try:
            self.loop.shutdown(abort_inflight=False, grace_s=self._grace_s, timeout_s=10.0)
        except Exception:
            log.exception("%s: engine loop shutdown failed", self.model_name)
        deadline = time.monotonic() + 10.0     # the response thread sends the finals
        while time.monotonic() < deadline:
            with self._inflight_lock:
                if not self._inflight:
                    break
            time.sleep(0.02)
        log.info("%s: drained", self.model_name)

    def _param(self, key: str, default: str) -> str:
        params = self.model_config.get("parameters") or {}
        entry = params.get(key)
        if isinstance(entry, dict) and entry.get("string_value") not in (None, ""):
            return str(entry["string_value"])
        return default

    def finalize(self) -> None:
        log.info("%s: finalize: aborting %d in-flight request(s)", self.model_name, len(self._inflight))
        self._closed.set()
        try:
            self.loop.shutdown(abort_inflight=True, timeout_s=30.0)
        except Exception:
            log.exception("engine loop shutdown failed")
        self._responses.put(self._stop)
        self._response_thread.join(timeout=30.0)
        # Anything left (the response thread died or timed out) still gets its final flag.
        with self._inflight_lock:
            left = list(self._inflight.values())
            self._inflight.clear()
        for st in left:
            self._send_final_error(st, "the model was unloaded before the request finished")
        if self.metrics is not None:
            try:
                self.metrics.update_from_stats(self.engine.stats(), force=True)
            except Exception:
                log.exception("final metrics update failed")
        planner = getattr(self.engine, "planner", None)
        if planner is not None:   # what mode auto did over the model's life, for the operator
            try:
                log.info("%s: %s%s", self.model_name, PLANNER_SUMMARY,
                         json.dumps(planner.summary(), default=str))
            except Exception:
                log.exception("planner summary failed")
        close = getattr(self.engine, "close", None)   # the drafter worker, the metrics scraper
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("engine.close() failed")
        log.info("%s: finalized", self.model_name)

    # ------------------------------------------------------------------ requests in

    def execute(self, requests: list[Any]) -> None:
        now = time.monotonic()
        self._served.set()
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = (parse_text_request if self.KIND == "text" else parse_tokens_request)(self.pb, request)
                client_id = ""
                try:
                    client_id = request.request_id() or ""
                except Exception:
                    pass
                st = _Inflight(id=uuid.uuid4().hex, client_id=client_id, request=request,
                               sender=sender, parsed=parsed, arrival=now)
                with self._inflight_lock:
                    self._inflight[st.id] = st
                try:
                    self.loop.submit(st.id, parsed.prompt, parsed.params, self._make_callback(st))
                except BaseException:
                    with self._inflight_lock:
                        self._inflight.pop(st.id, None)
                    raise
            except InvalidRequest as e:
                self._send_error(sender, str(e), self.pb.TritonError.INVALID_ARG)
            except (EngineLoopError, ServerBusy) as e:
                self._send_error(sender, str(e), self.pb.TritonError.UNAVAILABLE)
            except Exception as e:  # a bug; the client still gets an answer and a final flag
                log.error("%s: request failed before reaching the engine: %s", self.model_name,
                          traceback.format_exc())
                self._send_error(sender, f"internal error: {type(e).__name__}: {e}",
                                 self.pb.TritonError.INTERNAL)
        return None

    def _make_callback(self, st: _Inflight):
        put = self._responses.put

        def on_output(out: RequestOutput) -> None:  # engine loop thread: just queue it
            put((st, out, time.monotonic()))
        return on_output

    def _on_step(self, outputs: list[RequestOutput]) -> None:  # engine loop thread
        if self.metrics is not None:
            idle = not self.engine.has_unfinished()
            if idle or self.metrics.due():
                self.metrics.update_from_stats(self.engine.stats(), force=idle)

    # ------------------------------------------------------------------ responses out

    def _response_loop(self) -> None:
        last_poll = time.monotonic()
        while True:
            try:
                batch = [self._responses.get(timeout=CANCEL_POLL_S)]
            except queue.Empty:
                batch = []
            while batch and len(batch) < 4096:   # everything queued meanwhile goes out together
                try:
                    batch.append(self._responses.get_nowait())
                except queue.Empty:
                    break
            stopping = any(item is self._stop for item in batch)
            if stopping:   # drain what is queued (finals from the shutdown) before leaving
                while True:
                    try:
                        batch.append(self._responses.get_nowait())
                    except queue.Empty:
                        break
            self._send_batch([item for item in batch if item is not self._stop])
            if stopping:
                return
            now = time.monotonic()
            if now - last_poll >= CANCEL_POLL_S:
                last_poll = now
                self._poll_cancelled()
                if self.metrics is not None:
                    self.metrics.set_healthy(self.loop.healthy or self._draining.is_set())

    def _send_batch(self, items: list[tuple]) -> None:
        """Send queued outputs, one response per request: a loop that falls behind the engine
        merges each request's deltas (the first part's time is its first token's)."""
        latest = {out.request_id: (st, t_out) for st, out, t_out in items}
        for out, first in coalesce([out for _, out, _ in items]):
            st, t_last = latest[out.request_id]
            self._handle(st, out, items[first][2], t_last)

    def _poll_cancelled(self) -> None:
        with self._inflight_lock:
            states = [s for s in self._inflight.values() if not s.cancelled and not s.final_sent]
        for st in states:
            try:
                cancelled = st.sender.is_cancelled()
            except Exception:
                try:
                    cancelled = st.request.is_cancelled()
                except Exception:
                    cancelled = False
            if cancelled:
                st.cancelled = True
                log.info("%s: request %s cancelled by the client; aborting it", self.model_name,
                         st.client_id or st.id)
                self.loop.abort(st.id)

    def _handle(self, st: _Inflight, out: RequestOutput, t_out: float,
                t_last: float | None = None) -> None:
        if st.final_sent:
            return
        if out.new_token_ids:
            if st.first_token_at is None:
                st.first_token_at = t_out
            st.last_token_at = t_last or t_out
        st.num_prompt_tokens = out.num_prompt_tokens or st.num_prompt_tokens
        st.num_output_tokens = out.num_output_tokens or st.num_output_tokens
        if not out.finished:
            try:
                self._partial(st, out)
            except Exception:
                log.error("%s: sending a partial response failed; aborting the request:\n%s",
                          self.model_name, traceback.format_exc())
                self.loop.abort(st.id)
            return
        try:
            response = self._final_response(st, out)
        except Exception as e:
            log.error("%s: building the final response failed:\n%s", self.model_name, traceback.format_exc())
            response = self._error_response(f"internal error: {type(e).__name__}: {e}",
                                            self.pb.TritonError.INTERNAL)
        finally:
            self._finish(st, out)
            try:
                st.sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                log.error("%s: sending the final response failed:\n%s", self.model_name, traceback.format_exc())
                try:  # at least the flag, so the client is not left waiting
                    st.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:
                    pass

    def _finish(self, st: _Inflight, out: RequestOutput) -> None:
        st.final_sent = True
        with self._inflight_lock:
            self._inflight.pop(st.id, None)
        if self.metrics is not None:
            end = time.monotonic()
            ttft = None if st.first_token_at is None else st.first_token_at - st.arrival
            tpot = None
            if st.first_token_at is not None and st.num_output_tokens > 1:
                tpot = (st.last_token_at - st.first_token_at) / (st.num_output_tokens - 1)
            reason = "abort" if st.cancelled else out.finish_reason
            self.metrics.observe_request(ttft_s=ttft, tpot_s=tpot, e2e_s=end - st.arrival,
                                         finish_reason=reason)

    # ---- building responses

    def _partial(self, st: _Inflight, out: RequestOutput) -> None:
        p = st.parsed
        if self.KIND == "tokens":
            st.all_ids += out.new_token_ids
            if p.stream and out.new_text:  # a clean text boundary: send the window
                st.sender.send(self._tokens_window_response(st))
            return
        if not p.stream:
            st.text.append(out.new_text)
            return
        st.pending_ids += len(out.new_token_ids)
        if not out.new_text:
            return  # e.g. half a multi-byte character; it comes with the next step
        st.sender.send(self._text_response(st, out.new_text, out, delta_ids=st.pending_ids))
        st.pending_ids = 0

    def _final_response(self, st: _Inflight, out: RequestOutput) -> Any:
        pb = self.pb
        if out.finish_reason == "error":
            return self._error_response(out.error or "internal engine error", pb.TritonError.INTERNAL)
        if out.finish_reason == "abort":
            if st.cancelled:
                return self._error_response("request cancelled by the client", pb.TritonError.CANCELLED)
            if self._draining.is_set():
                return self._error_response(
                    f"the server is stopping: the request did not finish within the shutdown "
                    f"grace period ({self._grace_s:.0f} s)", pb.TritonError.UNAVAILABLE)
            return self._error_response("request aborted (the server is shutting down or the "
                                        "request was aborted)", pb.TritonError.UNAVAILABLE)
        p = st.parsed
        if self.KIND == "tokens":
            st.all_ids += out.new_token_ids
            if p.stream:
                return self._tokens_window_response(st)
            st.win_start, st.win_read = 0, 0
            return self._tokens_window_response(st)
        if p.stream:
            st.pending_ids += len(out.new_token_ids)
            return self._text_response(st, out.new_text, out, delta_ids=st.pending_ids)
        st.text.append(out.new_text)
        text = "".join(st.text)
        if p.prepend_input and isinstance(p.prompt, str):
            text = p.prompt + text
        return self._text_response(st, text, out, delta_ids=st.num_output_tokens)

    def _text_response(self, st: _Inflight, text: str, out: RequestOutput, delta_ids: int) -> Any:
        pb, p = self.pb, st.parsed
        tensors = [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if p.return_finish_reason:
            reason = out.finish_reason if out.finished else None
            tensors.append(pb.Tensor("finish_reason",
                                     np.array([str(reason).encode("utf-8")], dtype=np.object_)))
        if p.return_num_input_tokens:
            tensors.append(pb.Tensor("num_input_tokens", np.array([st.num_prompt_tokens], dtype=np.uint32)))
        if p.return_num_output_tokens:
            tensors.append(pb.Tensor("num_output_tokens", np.array([delta_ids], dtype=np.uint32)))
        return pb.InferenceResponse(output_tensors=tensors)

    def _tokens_window_response(self, st: _Inflight) -> Any:
        pb = self.pb
        window = st.all_ids[st.win_start:]
        offset = st.win_read - st.win_start
        st.win_start, st.win_read = st.win_read, len(st.all_ids)
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("output_ids", np.array(window, dtype=np.int32)),
            pb.Tensor("output_offset", np.array([offset], dtype=np.int32)),
        ])

    def _error_response(self, message: str, code: Any) -> Any:
        pb = self.pb
        try:
            err = pb.TritonError(message, code)
        except TypeError:  # older stubs: no code argument
            err = pb.TritonError(message)
        return pb.InferenceResponse(output_tensors=[], error=err)

    def _send_error(self, sender: Any, message: str, code: Any) -> None:
        try:
            sender.send(self._error_response(message, code),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            log.error("%s: sending an error response failed:\n%s", self.model_name, traceback.format_exc())

    def _send_final_error(self, st: _Inflight, message: str) -> None:
        if st.final_sent:
            return
        st.final_sent = True
        self._send_error(st.sender, message, self.pb.TritonError.UNAVAILABLE)

