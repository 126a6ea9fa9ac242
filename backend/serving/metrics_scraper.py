"""Triton's Prometheus endpoint (``/metrics``) as load signals for the planner (mode auto).

When the model parameter ``metrics_url`` is set, a background thread scrapes it at most every
``interval_s`` (plain urllib, short timeout), parses it with ``prometheus_client``'s text parser
and keeps: the request rate (delta of ``nv_inference_request_success`` over the time between two
scrapes), the pending requests (``nv_inference_pending_request_count``), the average queueing
time per request over the interval (``nv_inference_queue_duration_us``), and the GPU
(``nv_gpu_memory_used_bytes``, ``nv_gpu_memory_total_bytes``, ``nv_gpu_utilization``) and CPU
families when the server exports them. A failed scrape (connection refused, timeout, not
Prometheus text, no Triton families) is logged once per failure streak and otherwise ignored:
the last good values stay. ``merge(snapshot)`` returns the engine's snapshot with the server
fields filled in: the engine takes it as its ``extra_signals``.

Per-model families are summed over the models named in ``models`` (all models when None) —
except the request rate, which with ``models=None`` is the largest per-model rate, so that an
ensemble and its composing models (each of which counts every request) are not counted twice.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Iterable

from planner.signals import LoadSignals

log = logging.getLogger("nightdraft.serving.metrics_scraper")

# ------------------------------------------------------------------------------------------------
# Triton's /metrics
REQUESTS = "nv_inference_request_success"
PENDING = "nv_inference_pending_request_count"
QUEUE_US = "nv_inference_queue_duration_us"
GPU_USED = "nv_gpu_memory_used_bytes"
GPU_TOTAL = "nv_gpu_memory_total_bytes"
GPU_UTIL = "nv_gpu_utilization"
CPU_UTIL = "nv_cpu_utilization"
CPU_USED = "nv_cpu_memory_used_bytes"
CPU_TOTAL = "nv_cpu_memory_total_bytes"


class MetricsParseError(ValueError):
    pass


@dataclass
class TritonSample:
    """One parsed scrape. Per-model counters/gauges are dicts keyed by model name."""
    requests: dict[str, float]      # cumulative successful requests per model
    queue_us: dict[str, float]      # cumulative queueing microseconds per model
    pending: dict[str, float]       # pending requests per model (gauge)
    gpu_used: dict[str, float]      # per gpu_uuid
    gpu_total: dict[str, float]
    gpu_util: dict[str, float]
    cpu_util: float | None = None
    cpu_used: float | None = None
    cpu_total: float | None = None


def parse_metrics(text: str) -> TritonSample:
    """Parse Triton's Prometheus text; raises MetricsParseError if it is not Prometheus text
    or holds no Triton (``nv_``) family."""
    from prometheus_client.parser import text_string_to_metric_families
    fams: dict[str, list] = {}
    try:
        for fam in text_string_to_metric_families(text):
            fams[fam.name] = [s for s in fam.samples if s.name in (fam.name, fam.name + "_total")]
    except Exception as e:  # the parser raises ValueError and friends on bad lines
        raise MetricsParseError(f"not Prometheus text: {e}") from e
    if not any(name.startswith("nv_") for name in fams):
        raise MetricsParseError("no Triton (nv_*) metric families in the response")

    def by(label: str, name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in fams.get(name, ()):
            key = s.labels.get(label, "")
            if math.isfinite(s.value):
                out[key] = out.get(key, 0.0) + float(s.value)
        return out

    def scalar(name: str) -> float | None:
        vals = [float(s.value) for s in fams.get(name, ()) if math.isfinite(s.value)]
        return sum(vals) if vals else None

    return TritonSample(requests=by("model", REQUESTS), queue_us=by("model", QUEUE_US),
                        pending=by("model", PENDING), gpu_used=by("gpu_uuid", GPU_USED),
                        gpu_total=by("gpu_uuid", GPU_TOTAL), gpu_util=by("gpu_uuid", GPU_UTIL),
                        cpu_util=scalar(CPU_UTIL), cpu_used=scalar(CPU_USED), cpu_total=scalar(CPU_TOTAL))


class TritonMetricsSignals:
    """Scrapes Triton's metrics endpoint in a background thread (``start()``), or on demand
    (``scrape_once()``), and fills the server fields of the engine's signals (``merge``)."""

    def __init__(self, url: str, *, interval_s: float = 1.0, timeout_s: float = 0.5,
                 models: Iterable[str] | str | None = None, start: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 fetch: Callable[[str, float], str] | None = None):
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.url = url
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.models = {models} if isinstance(models, str) else (set(models) if models is not None else None)
        self._clock = clock
        self._fetch = fetch or _http_get
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prev: tuple[float, TritonSample] | None = None
        self._values: dict[str, float | None] = {}
        self.scrapes_ok = 0
        self.scrapes_failed = 0
        self.failure_streak = 0
        self.last_error: str | None = None
        self.last_ok_at: float | None = None
        if start:
            self.start()

    # -------------------------------------------------------------- background thread

    def start(self) -> "TritonMetricsSignals":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="triton-metrics-scraper", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    close = stop

    def __enter__(self) -> "TritonMetricsSignals":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = self._clock()
            self.scrape_once()
            self._stop.wait(max(self.interval_s - (self._clock() - t), 0.0))

    # -------------------------------------------------------------- scraping

    def scrape_once(self, now: float | None = None) -> bool:
        """Fetch, parse and fold one scrape; False (logged, values kept) if it failed."""
        try:
            text = self._fetch(self.url, self.timeout_s)
            sample = parse_metrics(text)
        except Exception as e:  # noqa: BLE001 - any failure of a scrape is tolerated
            self._failed(e)
            return False
        now = self._clock() if now is None else float(now)
        self._fold(now, sample)
        return True

    def _failed(self, e: BaseException) -> None:
        with self._lock:
            self.scrapes_failed += 1
            self.failure_streak += 1
            self.last_error = f"{type(e).__name__}: {e}"
            first = self.failure_streak == 1
        if first:
            log.warning("Triton metrics scrape of %s failed (%s); keeping the last values, "
                        "retrying every %.1f s", self.url, self.last_error, self.interval_s)
        else:
            log.debug("Triton metrics scrape of %s failed again (%s)", self.url, self.last_error)

    def _pick(self, d: dict[str, float]) -> dict[str, float]:
        return d if self.models is None else {k: v for k, v in d.items() if k in self.models}

    def _fold(self, now: float, cur: TritonSample) -> None:
        with self._lock:       # whole fold under the lock: scrape_once may race the thread
            vals: dict[str, float | None] = {}
            pending = self._pick(cur.pending)
            vals["server_pending"] = sum(pending.values()) if pending else None
            prev = self._prev
            rate = self._values.get("server_arrival_rate")
            queue_s = self._values.get("server_queue_s")
            if prev is not None and now > prev[0]:
                dt = now - prev[0]
                p = prev[1]
                deltas: dict[str, float] = {}
                reset = False
                for m, v in self._pick(cur.requests).items():
                    d = v - p.requests.get(m, 0.0)
                    if d < 0:        # counter went back: the server (or model) restarted
                        reset = True
                    deltas[m] = max(d, 0.0)
                if not reset and deltas:
                    rates = [d / dt for d in deltas.values()]
                    rate = sum(rates) if self.models is not None else max(rates)
                    n = sum(deltas.values())
                    dq = sum(max(v - p.queue_us.get(m, 0.0), 0.0)
                             for m, v in self._pick(cur.queue_us).items())
                    queue_s = (dq / n) * 1e-6 if n > 0 else 0.0
            vals["server_arrival_rate"] = rate
            vals["server_queue_s"] = queue_s
            vals["gpu_memory_used_bytes"] = sum(cur.gpu_used.values()) if cur.gpu_used else None
            total = sum(cur.gpu_total.values()) if cur.gpu_total else None
            vals["gpu_memory_total_bytes"] = total if total else None
            vals["gpu_utilization"] = (sum(cur.gpu_util.values()) / len(cur.gpu_util)
                                       if cur.gpu_util else None)
            vals["cpu_utilization"] = cur.cpu_util
            # Triton publishes CPU/GPU gauges on its own period; zeros before the first update
            vals["cpu_memory_total_bytes"] = cur.cpu_total if cur.cpu_total else None
            vals["cpu_memory_used_bytes"] = cur.cpu_used if cur.cpu_total else None
            if self.failure_streak:
                log.info("Triton metrics scrape of %s recovered after %d failure(s)", self.url,
                         self.failure_streak)
            self.failure_streak = 0
            self.scrapes_ok += 1
            self.last_ok_at = now
            self._prev = (now, cur)
            self._values = vals

    # -------------------------------------------------------------- reading

    def values(self) -> dict[str, float | None]:
        """The server fields of LoadSignals from the last good scrape (empty before one)."""
        with self._lock:
            return dict(self._values)

    def merge(self, engine: LoadSignals) -> LoadSignals:
        """The engine's snapshot with the server fields filled from the last good scrape.
        ``arrival_rate`` becomes the larger of the engine's and Triton's (Triton also sees
        requests still queued in front of the model)."""
        vals = self.values()
        if not vals:
            return engine
        fields = {k: v for k, v in vals.items() if v is not None}
        rate = vals.get("server_arrival_rate")
        if rate is not None:
            fields["arrival_rate"] = max(engine.arrival_rate, rate)
        return dataclasses.replace(engine, **fields)


def _http_get(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        status = getattr(r, "status", 200)
        if status != 200:
            raise urllib.error.HTTPError(url, status, "unexpected status", r.headers, None)
        return r.read().decode("utf-8", "replace")
