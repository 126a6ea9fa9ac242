"""Custom Prometheus metrics for the generation models, through ``pb_utils.MetricFamily``.

Triton's own latency metrics cover only ``execute()`` for decoupled models, which returns at
once, so the model reports what a client feels (time to first token, time per output token,
end-to-end latency) and what the engine does (tokens, queue, KV usage, speculation) here.

``pb_utils`` is passed in, so the ``backend`` package never imports Triton and this module is
testable with a fake. Every family and metric object is kept referenced for the model's
lifetime (Triton drops a metric whose Python object is collected).

Families (label ``model``, ``version``; some add one more label):

==============================================  =========  ====================================
nightdraft_time_to_first_token_seconds          histogram  arrival -> first generated token
nightdraft_time_per_output_token_seconds        histogram  per request, mean gap after the first
nightdraft_e2e_request_latency_seconds          histogram  arrival -> final response
nightdraft_prompt_tokens_total                  counter
nightdraft_generation_tokens_total              counter
nightdraft_request_success_total                counter    label finish_reason
nightdraft_num_requests_running                 gauge
nightdraft_num_requests_waiting                 gauge
nightdraft_kv_cache_usage_ratio                 gauge      target KV pool, 0..1
nightdraft_kv_cache_free_blocks                 gauge
nightdraft_kv_cache_total_blocks                gauge
nightdraft_drafter_kv_cache_usage_ratio         gauge
nightdraft_spec_decode_draft_tokens_total       counter
nightdraft_spec_decode_accepted_tokens_total    counter
nightdraft_spec_decode_acceptance_rate          gauge      accepted / drafted, since start
nightdraft_spec_decode_gamma                    gauge      speculation length now in use
nightdraft_pipeline_mode                        gauge      label mode (ar|sd|psd|ngram); 1 = current
nightdraft_drafter_state                        gauge      label state (none|on_device|offloaded|
                                                           reloading|restarting|failed); 1 = current
nightdraft_psd_overlap_ratio                    gauge      last PSD step: overlap of draft/verify
nightdraft_preemptions_total                    counter
nightdraft_engine_steps_total                   counter
nightdraft_drafter_{failures,restarts,catchup_tokens,offloads,reloads}_total   counters
nightdraft_drafter_restart_failures_total       counter    restart attempts that failed
nightdraft_drafter_{offload,reload}_failures_total   counters  the KV pool could not be resized
nightdraft_planner_switches_total               counter
nightdraft_drafter_cpu_seconds_total            counter    CPU time of the drafter's worker process
nightdraft_compiled_graphs_total                counter    graphs compiled in the engine's process
nightdraft_tensor_parallel_{failures,restarts}_total  counters  the target's group failed / came back
nightdraft_drafter_request_failures_total       counter    requests decoded without drafts after a
                                                           drafter fault of their own
nightdraft_request_errors_total                 counter    requests failed alone inside a step
nightdraft_engine_healthy                       gauge      0 once the engine loop refuses requests
                                                           or the drafter could not be restarted
nightdraft_model_state                          gauge      label state (serving|unhealthy|draining)
nightdraft_readiness_probe_errors_total         counter    polls of the model's own readiness that
                                                           got no answer (never start a drain)
nightdraft_psd_{steps,overlapped_steps,fallback_steps}_total                   counters
==============================================  =========  ====================================
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from backend.mode import STEP_MODES, Mode

log = logging.getLogger("nightdraft.metrics")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 300.0]

MODES = STEP_MODES
DRAFTER_STATES = ("none", "on_device", "offloaded", "reloading", "restarting", "failed")
MODEL_STATES = ("serving", "unhealthy", "draining")
# Cumulative engine counters exported as they are (EngineStats attribute -> family, help).
EXTRA_COUNTERS = {
    "preemptions": ("nightdraft_preemptions_total", "Requests preempted for KV space"),
    "steps": ("nightdraft_engine_steps_total", "Engine steps run"),
    "drafter_failures": ("nightdraft_drafter_failures_total", "Drafter worker failures"),
    "drafter_restarts": ("nightdraft_drafter_restarts_total", "Drafter worker restarts"),
    "drafter_restart_failures": ("nightdraft_drafter_restart_failures_total",
                                 "Drafter restart attempts that failed (each doubles the wait before the next)"),
    "drafter_catchup_tokens": ("nightdraft_drafter_catchup_tokens_total",
                               "Tokens re-fed to rebuild the drafter's KV cache (switching cost)"),
    "offloads": ("nightdraft_drafter_offloads_total", "Drafter weights moved off the device"),
    "drafter_cpu_s": ("nightdraft_drafter_cpu_seconds_total",
                      "CPU seconds used by the drafter's own worker process (0 for a drafter in process)"),
    "tensor_parallel_failures": ("nightdraft_tensor_parallel_failures_total",
                                 "Times the target's tensor-parallel group failed (a rank died or hung)"),
    "tensor_parallel_restarts": ("nightdraft_tensor_parallel_restarts_total",
                                 "Times the target's tensor-parallel group was brought back after a failure"),
    "compiled_graphs": ("nightdraft_compiled_graphs_total",
                        "Graphs torch.compile made in the engine's process (a rise under load is a recompilation)"),
    "reloads": ("nightdraft_drafter_reloads_total", "Drafter weights brought back to the device"),
    "offload_failures": ("nightdraft_drafter_offload_failures_total",
                         "Offloads that lent nothing: the KV pool could not grow (out of memory)"),
    "reload_failures": ("nightdraft_drafter_reload_failures_total",
                        "Reloads not started: the KV pool could not shrink back (out of memory)"),
    "planner_switches": ("nightdraft_planner_switches_total", "Planner decisions that changed mode or gamma"),
    "drafter_request_failures": ("nightdraft_drafter_request_failures_total",
                                 "Requests the drafter could not serve (they decoded without drafts)"),
    "request_errors": ("nightdraft_request_errors_total",
                       "Requests failed alone by a fault inside a batched engine step"),
    "psd_steps": ("nightdraft_psd_steps_total", "Batch-parallel (PSD) steps"),
    "psd_overlapped_steps": ("nightdraft_psd_overlapped_steps_total",
                             "PSD steps whose drafting of one sub-batch overlapped the other's verify"),
    "psd_fallback_steps": ("nightdraft_psd_fallback_steps_total",
                           "PSD steps that had to draft in line (no proposals in hand)"),
}
FINISH_REASONS = ("stop", "length", "abort", "error")


class TritonMetrics:
    """Create once per model instance; call from any thread."""

    def __init__(self, pb_utils: Any, labels: dict[str, str], *, min_update_interval_s: float = 0.1):
        self._pb = pb_utils
        self._labels = dict(labels)
        self._lock = threading.Lock()
        self._min_interval = min_update_interval_s
        self._last_update = 0.0
        self._last_counts: dict[str, float] = {}
        self.families: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        self._create_request_metrics()
        self._create_engine_metrics()

    def _family(self, name: str, desc: str, kind: Any) -> Any:
        fam = self._pb.MetricFamily(name=name, description=desc, kind=kind)
        self.families[name] = fam
        return fam

    def _metric(self, key: str, fam: Any, extra: dict[str, str] | None = None, buckets=None) -> Any:
        lab = {**self._labels, **(extra or {})}
        m = fam.Metric(labels=lab, buckets=buckets) if buckets is not None else fam.Metric(labels=lab)
        self.metrics[key] = m
        return m

    def _create_request_metrics(self) -> None:
        family, metric = self._family, self._metric
        H, C = self._pb.MetricFamily.HISTOGRAM, self._pb.MetricFamily.COUNTER
        metric("ttft", family("nightdraft_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token", H), buckets=TTFT_BUCKETS)
        metric("tpot", family("nightdraft_time_per_output_token_seconds",
                              "Per request, mean time per output token after the first", H), buckets=TPOT_BUCKETS)
        metric("e2e", family("nightdraft_e2e_request_latency_seconds",
                             "Time from request arrival to its final response", H), buckets=E2E_BUCKETS)
        metric("prompt_tokens", family("nightdraft_prompt_tokens_total", "Prompt tokens processed", C))
        metric("generation_tokens", family("nightdraft_generation_tokens_total", "Tokens generated", C))
        fam = family("nightdraft_request_success_total", "Requests finished, by finish reason", C)
        for r in FINISH_REASONS:
            metric(f"finished:{r}", fam, {"finish_reason": r})

    def _create_engine_metrics(self) -> None:
        family, metric = self._family, self._metric
        C, G = self._pb.MetricFamily.COUNTER, self._pb.MetricFamily.GAUGE
        metric("running", family("nightdraft_num_requests_running", "Requests being decoded", G))
        metric("waiting", family("nightdraft_num_requests_waiting", "Requests waiting to be scheduled", G))
        metric("kv_usage", family("nightdraft_kv_cache_usage_ratio", "Fraction of target KV blocks in use", G))
        metric("kv_free", family("nightdraft_kv_cache_free_blocks", "Free target KV blocks", G))
        metric("kv_total", family("nightdraft_kv_cache_total_blocks", "Target KV blocks in the pool", G))
        metric("drafter_kv_usage", family("nightdraft_drafter_kv_cache_usage_ratio",
                                          "Fraction of drafter KV blocks in use", G))
        metric("drafted", family("nightdraft_spec_decode_draft_tokens_total", "Draft tokens proposed", C))
        metric("accepted", family("nightdraft_spec_decode_accepted_tokens_total",
                                  "Draft tokens accepted by verification", C))
        metric("acceptance", family("nightdraft_spec_decode_acceptance_rate",
                                    "Accepted / drafted tokens since start", G))
        metric("gamma", family("nightdraft_spec_decode_gamma", "Speculation length in use (0 = none)", G))
        fam = family("nightdraft_pipeline_mode", "Pipeline mode in use (1 for the current one)", G)
        for m in MODES:
            metric(f"mode:{m.value}", fam, {"mode": m.value})
        fam = family("nightdraft_drafter_state", "Where the drafter's weights are (1 for the current state)", G)
        for s in DRAFTER_STATES:
            metric(f"drafter:{s}", fam, {"state": s})
        metric("overlap", family("nightdraft_psd_overlap_ratio",
                                 "Last batch-parallel step: share of the shorter of draft/verify hidden "
                                 "under the other (0 when not in PSD mode)", G))
        for attr, (name, desc) in EXTRA_COUNTERS.items():
            metric(attr, family(name, desc, C))
        metric("healthy", family("nightdraft_engine_healthy",
                                 "1 while the engine loop serves; 0 once it has failed and refuses "
                                 "requests, or once its drafter could not be restarted", G)).set(1)
        fam = family("nightdraft_model_state", "What the model does now (1 for the current state): "
                     "serving; unhealthy (the engine cannot serve); draining (the server stops or "
                     "unloads the model)", G)
        for st in MODEL_STATES:
            metric(f"state:{st}", fam, {"state": st}).set(1 if st == "serving" else 0)
        metric("probe_errors", family("nightdraft_readiness_probe_errors_total",
                                      "Polls of the model's own readiness endpoint that got no answer "
                                      "(they never start a drain)", C))

    # ---------------------------------------------------------------- per request

    def observe_request(self, *, ttft_s: float | None, tpot_s: float | None, e2e_s: float,
                        finish_reason: str | None) -> None:
        try:
            if ttft_s is not None:
                self.metrics["ttft"].observe(max(0.0, ttft_s))
            if tpot_s is not None:
                self.metrics["tpot"].observe(max(0.0, tpot_s))
            self.metrics["e2e"].observe(max(0.0, e2e_s))
            key = f"finished:{finish_reason}"
            if key in self.metrics:
                self.metrics[key].increment(1)
        except Exception:
            log.exception("recording request metrics failed")

    # ---------------------------------------------------------------- engine-wide

    def set_healthy(self, healthy: bool) -> None:
        self.metrics["healthy"].set(1 if healthy else 0)

    def set_model_state(self, state: str, probe_errors: int) -> None:
        """The model's state (one of MODEL_STATES) and its readiness probe's errors so far."""
        with self._lock:
            for st in MODEL_STATES:
                self.metrics[f"state:{st}"].set(1 if st == state else 0)
            self._counter_to("probe_errors", float(probe_errors))

    def due(self) -> bool:
        """Would a non-forced update run now? (Lets callers skip computing stats.)"""
        return time.monotonic() - self._last_update >= self._min_interval

    def update_from_stats(self, stats: Any, force: bool = False) -> bool:
        """Set gauges and advance counters from ``engine.stats()``; throttled to one update per
        ``min_update_interval_s`` unless ``force``. Returns whether it updated."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_update < self._min_interval:
                return False
            self._last_update = now
            try:
                self._update(stats)
            except Exception:
                log.exception("updating engine metrics failed")
            return True

    def _counter_to(self, key: str, total: float) -> None:
        prev = self._last_counts.get(key, 0.0)
        if total > prev:
            self.metrics[key].increment(total - prev)
            self._last_counts[key] = total

    def _update(self, s: Any) -> None:
        m = self.metrics
        m["running"].set(float(s.num_running))
        m["waiting"].set(float(s.num_waiting))
        m["kv_usage"].set(float(s.kv_usage))
        m["kv_free"].set(float(s.kv_free_blocks))
        m["kv_total"].set(float(s.kv_total_blocks))
        m["drafter_kv_usage"].set(float(getattr(s, "drafter_kv_usage", 0.0)))
        self._counter_to("prompt_tokens", float(s.prompt_tokens))
        self._counter_to("generation_tokens", float(s.generation_tokens))
        self._counter_to("drafted", float(s.drafted_tokens))
        self._counter_to("accepted", float(s.accepted_tokens))
        for attr in EXTRA_COUNTERS:
            self._counter_to(attr, float(getattr(s, attr, 0) or 0))
        drafted = float(s.drafted_tokens)
        m["acceptance"].set(float(s.accepted_tokens) / drafted if drafted else 0.0)
        m["gamma"].set(float(s.gamma))
        mode = getattr(s, "mode", Mode.AR)
        for md in MODES:
            m[f"mode:{md.value}"].set(1.0 if md == mode else 0.0)
        state = getattr(s, "drafter_state", "none")
        for st in DRAFTER_STATES:
            m[f"drafter:{st}"].set(1.0 if st == state else 0.0)
        m["overlap"].set(psd_overlap(s))


def psd_overlap(stats: Any) -> float:
    """Overlap of the last step's draft and verify phases, 0..1 (1: the shorter phase was fully
    hidden under the longer one). An engine may report it directly as ``psd_overlap``."""
    direct = getattr(stats, "psd_overlap", None)
    if direct is not None:
        return float(direct)
    step = getattr(stats, "last_step", None)
    if step is None or getattr(step, "mode", None) != Mode.PSD:
        return 0.0
    d, v, t = step.t_draft_s, step.t_verify_s, step.t_step_s
    shorter = min(d, v)
    if shorter <= 0 or t <= 0:
        return 0.0
    return max(0.0, min(1.0, (d + v - t) / shorter))


class ModelMetrics:
    """Every metric family of one model instance: nightdraft's own (``report_custom_metrics``,
    on by default) and vLLM's names (``REPORT_CUSTOM_METRICS``, as the vLLM backend; off by
    default). Either may be None; every call is safe from any thread."""

    def __init__(self, ours: TritonMetrics | None, vllm: Any | None, *, min_update_interval_s: float = 0.1):
        self.ours, self.vllm = ours, vllm
        self._lock = threading.Lock()
        self._min_interval = min_update_interval_s
        self._last_update = 0.0

    def due(self) -> bool:
        return time.monotonic() - self._last_update >= self._min_interval

    def update_from_stats(self, stats: Any, force: bool = False) -> bool:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_update < self._min_interval:
                return False
            self._last_update = now
            for sink in (self.ours, self.vllm):
                if sink is None:
                    continue
                try:
                    sink.update_from_stats(stats, force=True) if sink is self.ours else sink.update_from_stats(stats)
                except Exception:
                    log.exception("updating engine metrics failed")
            return True

    def observe_tokens(self, count: int, since_s: float | None, first_token_s: float | None) -> None:
        if self.vllm is not None and count:
            try:
                self.vllm.observe_tokens(count, since_s, first_token_s)
            except Exception:
                log.exception("recording token metrics failed")

    def observe_request(self, *, ttft_s: float | None, tpot_s: float | None, e2e_s: float,
                        finish_reason: str | None, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        if self.ours is not None:
            self.ours.observe_request(ttft_s=ttft_s, tpot_s=tpot_s, e2e_s=e2e_s, finish_reason=finish_reason)
        if self.vllm is not None:
            try:
                self.vllm.observe_request(e2e_s, prompt_tokens, generation_tokens)
            except Exception:
                log.exception("recording request metrics failed")

    def set_healthy(self, healthy: bool) -> None:
        if self.ours is not None:
            self.ours.set_healthy(healthy)

    def set_model_state(self, state: str, probe_errors: int) -> None:
        if self.ours is not None:
            self.ours.set_model_state(state, probe_errors)
