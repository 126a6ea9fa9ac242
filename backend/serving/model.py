"""The decoupled generation models (``nightdraft``, ``nightdraft_tokens``): their life cycle.

One class serves both; the request class says the schema (``text_request.TextRequest``,
``token_request.TokenRequest``). Threads: ``execute`` parses, submits and returns. The engine
loop thread steps the engine and queues every output; the response thread
(``responses.ResponseThread``) turns them into responses, sends them, and polls cancellation.
A watcher thread notices the unload and drains (``drain.Drain``), and checks the engine's health
(``engine_health``) into the metrics and, with ``ENABLE_VLLM_HEALTH_CHECK``, into the model's
readiness. Every request gets exactly one final flag, also at ``finalize``, which aborts
in-flight work and joins the threads.

Model parameters (config.pbtxt): ``engine_config`` (engine.json, relative to the version
directory; the vLLM backend's model.json beside it is read too, see ``config``),
``report_custom_metrics``, ``REPORT_CUSTOM_METRICS``, ``ENABLE_VLLM_HEALTH_CHECK``,
``drafter_down_s``, ``shutdown_grace_s``, ``metrics_url`` and ``planner_summary_file`` (mode auto;
see ``planner_io``).
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from backend.engine.loop import EngineLoop, EngineLoopError
from backend.engine.outputs import RequestOutput
from backend.errors import InvalidRequest, ServerBusy
from backend.serving.config import ModelArgs, load_engine_config
from backend.serving.drain import DEFAULT_SHUTDOWN_GRACE_S, Drain
from backend.serving.engine_health import DEFAULT_DRAFTER_DOWN_S, EngineHealth
from backend.serving.log_bridge import install_log_bridge
from backend.serving.planner_io import SUMMARY_FILE, export_summary, server_signals
from backend.serving.request import InflightRequests, RequestLimits, ServedRequest
from backend.serving.responses import ResponseThread, send_error

log = logging.getLogger("nightdraft.triton")

HEALTH_CHECK_PARAMETER = "ENABLE_VLLM_HEALTH_CHECK"
# What a request gets while the engine is unhealthy (the vLLM backend says "Model is unavailable
# due to unhealthy vLLM engine").
UNHEALTHY_MESSAGE = "Model is unavailable due to unhealthy engine"


def generation_model(pb_utils: Any, request_class: type[ServedRequest]) -> type:
    """The ``TritonPythonModel`` class of a generation model with this request schema."""

    class TritonPythonModel(GenerationModel):
        pb = pb_utils
        REQUEST = request_class

    return TritonPythonModel


class GenerationModel:
    pb: Any = None
    token_text: Any = None          # the engine's tokenizer, one token at a time (for logprobs)
    _disable_log_stats = False      # model.json: disable_log_stats
    limits: RequestLimits | None = None
    health_check = False            # ENABLE_VLLM_HEALTH_CHECK
    unhealthy: str | None = None    # why the engine cannot serve, while it cannot
    REQUEST: type[ServedRequest] = ServedRequest

    # ------------------------------------------------------------------ life cycle

    def initialize(self, args: dict[str, str]) -> None:
        install_log_bridge(self.pb)
        margs = ModelArgs(self.pb, args)
        self.model_name = margs.name
        if not margs.decoupled():
            raise margs.fail("config.pbtxt must set model_transaction_policy { decoupled: true }")
        grace_s = margs.seconds("shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S)
        self._summary_file = margs.path(SUMMARY_FILE)
        self.engine = self._load_engine(margs)
        self.token_text = self.engine.tokenizer.token_text
        self.metrics = self._start_metrics(margs)
        self.inflight = InflightRequests()
        self.loop = EngineLoop(self.engine, on_step=self._on_step, name=f"{self.model_name}-engine")
        self.limits = RequestLimits.of_engine(self.engine)
        self.health = EngineHealth(self.loop, self.engine,
                                   margs.seconds("drafter_down_s", DEFAULT_DRAFTER_DOWN_S))
        # The vLLM backend's switch: an unhealthy engine unloads the model (readiness follows).
        self.health_check = margs.flag(HEALTH_CHECK_PARAMETER, False)
        self._unload_asked = False
        self.drain = Drain(self.model_name, margs.version, loop=self.loop, inflight=self.inflight,
                           grace_s=grace_s, on_poll=self._check_health)
        self.responses = ResponseThread(self.pb, self.model_name, loop=self.loop, inflight=self.inflight,
                                        metrics=self.metrics, abort_message=self.drain.abort_message)
        self.drain.watch()

    def _load_engine(self, margs: ModelArgs) -> Any:
        source = load_engine_config(margs, "engine.json")
        config = source.config
        self._disable_log_stats = source.disable_log_stats
        for line in source.log_lines:
            log.info("%s: %s", self.model_name, line)
        log.info("%s: loading engine from %s (target %s, drafter %s, mode %s, device %s)",
                 self.model_name, source.describe(), config.target, config.drafter, config.mode, config.device)
        from backend.engine.engine import Engine  # heavy (torch); imported when a model loads
        self._server_signals = server_signals(margs, config.mode)
        t0 = time.monotonic()
        try:
            merge = self._server_signals.merge if self._server_signals is not None else None
            engine = Engine(config, extra_signals=merge)
        except BaseException:
            self._close_server_signals()
            raise
        log.info("%s: engine ready in %.1f s (max_model_len %d)", self.model_name,
                 time.monotonic() - t0, engine.max_model_len)
        return engine

    def _start_metrics(self, margs: ModelArgs) -> Any | None:
        # The vLLM backend's switch, off as there when model.json says disable_log_stats.
        ours = margs.flag("report_custom_metrics", True)
        vllm = margs.flag("REPORT_CUSTOM_METRICS", False) and not self._disable_log_stats
        if not ours and not vllm:
            return None
        try:
            from backend.serving.metrics import ModelMetrics, TritonMetrics
            from backend.serving.vllm_metrics import VllmMetrics
            labels = {"model": self.model_name, "version": margs.version}
            metrics = ModelMetrics(
                TritonMetrics(self.pb, labels) if ours else None,
                VllmMetrics(self.pb, labels, self.engine.max_model_len, self.engine.config.gamma_max) if vllm else None)
            metrics.update_from_stats(self.engine.stats(), force=True)
            return metrics
        except Exception as e:  # e.g. the server runs with --allow-metrics=false
            log.warning("%s: custom metrics disabled: %s", self.model_name, e)
            return None

    def finalize(self) -> None:
        log.info("%s: finalize: aborting %d in-flight request(s)", self.model_name, len(self.inflight))
        self.drain.close()
        try:
            self.loop.shutdown(abort_inflight=True, timeout_s=30.0)
        except Exception:
            log.exception("engine loop shutdown failed")
        self.responses.stop(timeout_s=30.0)
        # Anything left (the response thread died or timed out) still gets its final flag.
        for r in self.inflight.take_all():
            if not r.final_sent:
                r.mark_final()
                send_error(self.pb, r.sender, "the model was unloaded before the request finished",
                           "UNAVAILABLE", self.model_name)
        if self.metrics is not None:
            try:
                self.metrics.update_from_stats(self.engine.stats(), force=True)
            except Exception:
                log.exception("final metrics update failed")
        self._export_planner_summary()
        try:
            self.engine.close()   # the drafter worker
        except Exception:
            log.exception("engine.close() failed")
        self._close_server_signals()
        log.info("%s: finalized", self.model_name)

    def _export_planner_summary(self) -> None:
        planner = getattr(self.engine, "planner", None)
        if planner is not None:   # what mode auto did over the model's life
            try:
                export_summary(self.model_name, planner, self._summary_file)
            except Exception:
                log.exception("planner summary failed")

    def _close_server_signals(self) -> None:
        if self._server_signals is not None:
            try:
                self._server_signals.close()
            except Exception:
                log.exception("closing the metrics scraper failed")

    # ------------------------------------------------------------------ health

    def _check_health(self) -> None:
        """The watcher thread's poll: the engine's health into the metrics and, with the health
        check on, into the model's readiness (an unhealthy engine unloads the model)."""
        if self.drain.closed:     # finalize stops the engine: that is no news, and no unload
            return
        draining = self.drain.draining.is_set()
        # A draining engine stops on purpose: that is not ill health (nor is it news).
        reason = self.unhealthy if draining else self.health.check()
        if reason != self.unhealthy:
            if reason is not None:
                log.error("%s: the engine cannot serve: %s%s", self.model_name, reason,
                          "; unloading the model (ENABLE_VLLM_HEALTH_CHECK)" if self.health_check else "")
            else:
                log.info("%s: the engine serves again", self.model_name)
            self.unhealthy = reason
        if self.metrics is not None:    # first: the unload may end the model's metrics soon after
            state = "draining" if draining else "unhealthy" if reason is not None else "serving"
            self.metrics.set_healthy(reason is None)
            self.metrics.set_model_state(state, self.drain.probe_errors)
        if reason is not None and self.health_check and not self._unload_asked and not draining:
            self._unload_asked = True
            self._unload_self()

    def _unload_self(self) -> None:
        """As the vLLM backend: ask Triton to unload this model, so that its readiness turns
        false (only a server in explicit model control mode allows it)."""
        try:
            self.pb.unload_model(self.model_name)
        except Exception as e:
            log.error("%s: cannot unload the model (%s: %s); it stays ready in Triton's eyes and "
                      "answers every request UNAVAILABLE (start tritonserver with "
                      "--model-control-mode=explicit for readiness to follow)", self.model_name,
                      type(e).__name__, e)

    # ------------------------------------------------------------------ requests in

    def execute(self, requests: list[Any]) -> None:
        now = time.monotonic()
        self.drain.served.set()
        unhealthy = self.unhealthy if self.health_check else None
        for request in requests:
            sender = request.get_response_sender()
            if unhealthy is not None:
                send_error(self.pb, sender, f"{UNHEALTHY_MESSAGE}: {unhealthy}", "UNAVAILABLE", self.model_name)
                continue
            try:
                self._admit(self.REQUEST(self.pb, request, sender, now, token_text=self.token_text,
                                         limits=self.limits))
            except InvalidRequest as e:
                send_error(self.pb, sender, str(e), "INVALID_ARG", self.model_name)
            except (EngineLoopError, ServerBusy) as e:
                send_error(self.pb, sender, str(e), "UNAVAILABLE", self.model_name)
            except Exception as e:  # a bug; the client still gets an answer and a final flag
                log.error("%s: request failed before reaching the engine: %s", self.model_name,
                          traceback.format_exc())
                send_error(self.pb, sender, f"internal error: {type(e).__name__}: {e}", "INTERNAL",
                           self.model_name)
        return None

    def _admit(self, r: ServedRequest) -> None:
        self.inflight.add(r)     # from here on the response thread polls its cancellation
        try:
            self.loop.submit(r.id, r.prompt, r.params, self.responses.callback(r))
        except BaseException:
            self.inflight.remove(r)
            r.mark_final()      # execute sends its final flag (the error) next
            raise
        # A cancellation noticed while the request was being tokenized (inside submit) was an
        # abort of an id the engine did not know yet, so it did nothing: abort it now.
        if r.cancelled:
            self.loop.abort(r.id)

    def _on_step(self, outputs: list[RequestOutput]) -> None:  # engine loop thread
        if self.metrics is not None:
            idle = not self.engine.has_unfinished()
            if idle or self.metrics.due():
                self.metrics.update_from_stats(self.engine.stats(), force=idle)
