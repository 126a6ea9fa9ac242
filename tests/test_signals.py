"""Load signals: the engine's own stats, and Triton's /metrics endpoint.

The Triton samples under tests/data were scraped from a real tritonserver 2.51 (the
nvidia-pytriton wheel) by tests/data/capture_triton_metrics.py: two trivial Python-backend
models, requests sent before each of two scrapes (see tests/data/triton_metrics.json). The host has
no GPU, so Triton exported no GPU family; the GPU lines below are written in Triton's format to
test that part of the parser. The slow test scrapes a live server the same way."""
from __future__ import annotations

import http.server
import json
import logging
import math
import socket
import threading
import time
from pathlib import Path

import pytest

from backend.serving.metrics_scraper import MetricsParseError, TritonMetricsSignals, parse_metrics
from planner.demand import DemandEstimate
from planner.signals import EngineSignals, LoadSignals

DATA = Path(__file__).parent / "data"
FIRST = (DATA / "triton_metrics.txt").read_text()
LATER = (DATA / "triton_metrics_later.txt").read_text()
META = json.loads((DATA / "triton_metrics.json").read_text())
DT = META["seconds_between_scrapes"]

# Triton's GPU families as its metrics endpoint writes them (2.51, one GPU); not from this host
GPU_LINES = """\
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-9f1b2c3d-0000-1111-2222-333344445555"} 0.75
nv_gpu_utilization{gpu_uuid="GPU-0a0b0c0d-6666-7777-8888-9999aaaabbbb"} 0.25
# HELP nv_gpu_memory_total_bytes GPU total memory, in bytes
# TYPE nv_gpu_memory_total_bytes gauge
nv_gpu_memory_total_bytes{gpu_uuid="GPU-9f1b2c3d-0000-1111-2222-333344445555"} 85899345920
nv_gpu_memory_total_bytes{gpu_uuid="GPU-0a0b0c0d-6666-7777-8888-9999aaaabbbb"} 85899345920
# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes
# TYPE nv_gpu_memory_used_bytes gauge
nv_gpu_memory_used_bytes{gpu_uuid="GPU-9f1b2c3d-0000-1111-2222-333344445555"} 64424509440
nv_gpu_memory_used_bytes{gpu_uuid="GPU-0a0b0c0d-6666-7777-8888-9999aaaabbbb"} 1073741824
"""


def unused_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]   # closed again on exit: nobody listens there


class Scripted:
    """A fetch function returning queued texts (or raising queued exceptions)."""

    def __init__(self, *items):
        self.items = list(items)

    def __call__(self, url, timeout):
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


# ---------------------------------------------------------------------------------------------
# engine signals


def test_engine_signals_arrival_rate_over_a_sliding_window():
    e = EngineSignals(window_s=10.0)
    assert e.arrival_rate(now=100.0) == 0.0          # starts the clock
    for i in range(20):                               # 4 requests/s for 5 s
        e.record_arrivals(1, now=100.0 + i * 0.25)
    assert e.arrival_rate(now=105.0) == pytest.approx(20 / 5.0)
    e.record_arrivals(10, now=108.0)                  # a burst
    # the window is (now - 10 s, now]: the arrival at exactly 100.0 has left it
    assert e.arrival_rate(now=110.0) == pytest.approx(29 / 10.0)
    # the window slides: only the burst is left 10 s after the first arrivals
    assert e.arrival_rate(now=117.5) == pytest.approx(10 / 10.0)
    assert e.arrival_rate(now=130.0) == 0.0
    assert e.total_arrivals == 30
    s = e.snapshot(batch_size=7, waiting=3, kv_usage=0.8, now=130.0)
    assert (s.batch_size, s.waiting, s.kv_usage, s.arrival_rate, s.now) == (7, 3, 0.8, 0.0, 130.0)
    assert s.server_pending is None and s.gpu_memory_used_bytes is None


def test_demand_follows_a_step_in_the_arrival_rate_within_seconds():
    d = DemandEstimate(tau_s=2.0)
    assert d.rates(0.0) == (0.0, 0.0)
    t = 0.0
    while t < 20.0:                                    # 2 requests/s of 64 tokens for 20 s
        d.arrived(t, max_tokens=64)
        t += 0.5
    req, tok = d.rates(20.0)
    assert req == pytest.approx(2.0, rel=0.25) and tok == pytest.approx(128.0, rel=0.25)
    while t < 26.0:                                    # then 10 requests/s
        d.arrived(t, max_tokens=64)
        t += 0.1
    assert d.rates(26.0)[0] == pytest.approx(10.0, rel=0.2)   # 3 time constants after the step
    # a 10 s window would still say (4 s x 2 + 6 s x 10) / 10 s = 6.8
    assert d.rates(32.0)[0] < 0.6                      # and it falls as fast when arrivals stop


def test_demand_of_a_fresh_estimate_is_not_inflated_by_its_first_arrivals():
    d = DemandEstimate(tau_s=2.0)
    d.arrived(100.0, max_tokens=16)
    assert d.rates(100.0)[0] <= 1.0 / (2.0 * (1 - math.exp(-DemandEstimate.MIN_AGE_S / 2.0))) + 1e-9
    for i in range(1, 10):                             # 4/s for a little over two seconds
        d.arrived(100.0 + i * 0.25, max_tokens=16)
    assert d.rates(102.25)[0] == pytest.approx(4.0, rel=0.3)


def test_token_demand_counts_the_share_of_budgets_really_used():
    d = DemandEstimate(tau_s=2.0)
    for i in range(40):
        d.arrived(i * 0.25, max_tokens=100)
    full = d.rates(10.0)[1]
    for _ in range(8):
        d.finished(generated=25, max_tokens=100)       # requests stop at EOS after a quarter
    assert d.used_share == pytest.approx(0.25)
    assert d.rates(10.0)[1] == pytest.approx(full / 4)
    d.finished(generated=500, max_tokens=100)          # clipped to the budget
    assert d.used_share <= 1.0


def test_engine_signals_snapshot_carries_the_demand():
    e = EngineSignals(demand_tau_s=1.0)
    for i in range(20):
        e.record_arrivals(1, now=50.0 + i * 0.5, max_tokens=32)
    s = e.snapshot(batch_size=3, now=60.0)
    assert s.demand_req_s == pytest.approx(2.0, rel=0.3)
    assert s.demand_tok_s == pytest.approx(64.0, rel=0.3)
    assert LoadSignals(batch_size=1).demand_tok_s is None     # a front end without the estimate


def test_engine_signals_are_thread_safe():
    e = EngineSignals(window_s=60.0)
    t0 = time.monotonic()
    e.arrival_rate(now=t0)
    threads = [threading.Thread(target=lambda: [e.record_arrivals(1) for _ in range(500)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(200):
        e.snapshot(batch_size=1)
    for t in threads:
        t.join()
    assert e.total_arrivals == 2000
    assert e.arrival_rate() > 0


# ---------------------------------------------------------------------------------------------
# parsing a real server's /metrics text


def test_parse_real_triton_metrics():
    s = parse_metrics(FIRST)
    assert s.requests == {"echo": 5.0, "echo_b": 2.0}
    assert s.pending == {"echo": 0.0, "echo_b": 0.0}
    assert set(s.queue_us) == {"echo", "echo_b"} and all(v > 0 for v in s.queue_us.values())
    assert s.gpu_used == {} and s.gpu_util == {}          # CPU-only host
    later = parse_metrics(LATER)
    sent = {m: META["requests_before_first_scrape"][m] + META["requests_between_scrapes"][m]
            for m in ("echo", "echo_b")}
    assert later.requests == {m: float(n) for m, n in sent.items()}
    assert later.cpu_total and later.cpu_total > later.cpu_used > 0
    assert 0.0 <= later.cpu_util <= 1.0


def test_parse_gpu_families():
    s = parse_metrics(LATER + GPU_LINES)
    assert len(s.gpu_used) == 2 and len(s.gpu_util) == 2
    t = TritonMetricsSignals("http://unused", start=False, fetch=Scripted(LATER + GPU_LINES))
    assert t.scrape_once(now=0.0)
    v = t.values()
    assert v["gpu_memory_used_bytes"] == 64424509440 + 1073741824
    assert v["gpu_memory_total_bytes"] == 2 * 85899345920
    assert v["gpu_utilization"] == pytest.approx(0.5)
    merged = t.merge(LoadSignals(batch_size=4))
    assert merged.gpu_memory_fraction == pytest.approx((64424509440 + 1073741824) / (2 * 85899345920))


@pytest.mark.parametrize("text", ["garbage here {{{", "<html><body>502 Bad Gateway</body></html>",
                                  "# just a comment\n", "node_cpu_seconds_total 12\n"])
def test_parse_rejects_what_is_not_triton_metrics(text):
    with pytest.raises(MetricsParseError):
        parse_metrics(text)


def test_arrival_rate_from_two_real_scrapes():
    between = META["requests_between_scrapes"]
    # default: the busiest model's rate (an ensemble and its steps each count every request)
    t = TritonMetricsSignals("http://unused", start=False, fetch=Scripted(FIRST, LATER))
    assert t.scrape_once(now=10.0)
    assert t.values()["server_arrival_rate"] is None          # one scrape: no rate yet
    assert t.scrape_once(now=10.0 + DT)
    v = t.values()
    assert v["server_arrival_rate"] == pytest.approx(max(between.values()) / DT)
    assert v["server_pending"] == 0
    q0, q1 = parse_metrics(FIRST).queue_us, parse_metrics(LATER).queue_us
    n = sum(between.values())
    assert v["server_queue_s"] == pytest.approx(sum(q1[m] - q0[m] for m in q1) / n * 1e-6)
    assert v["cpu_memory_total_bytes"] > 0
    # one model, or the sum over named models
    t = TritonMetricsSignals("http://unused", start=False, models="echo_b", fetch=Scripted(FIRST, LATER))
    t.scrape_once(now=0.0)
    t.scrape_once(now=DT)
    assert t.values()["server_arrival_rate"] == pytest.approx(between["echo_b"] / DT)
    t = TritonMetricsSignals("http://unused", start=False, models=["echo", "echo_b"],
                             fetch=Scripted(FIRST, LATER))
    t.scrape_once(now=0.0)
    t.scrape_once(now=DT)
    assert t.values()["server_arrival_rate"] == pytest.approx(sum(between.values()) / DT)


def test_merge_fills_triton_fields():
    t = TritonMetricsSignals("http://unused", start=False, fetch=Scripted(FIRST, LATER))
    eng = LoadSignals(batch_size=3, waiting=1, kv_usage=0.5, arrival_rate=2.0, now=5.0)
    assert t.merge(eng) is eng                     # nothing scraped yet: unchanged
    t.scrape_once(now=0.0)
    t.scrape_once(now=DT)
    m = t.merge(eng)
    assert (m.batch_size, m.waiting, m.kv_usage, m.now) == (3, 1, 0.5, 5.0)
    assert m.server_arrival_rate == pytest.approx(12 / DT)
    assert m.arrival_rate == pytest.approx(max(2.0, 12 / DT))
    assert m.server_pending == 0
    assert m.gpu_memory_used_bytes is None         # not exported on this host
    busy = LoadSignals(batch_size=3, arrival_rate=50.0)
    assert t.merge(busy).arrival_rate == 50.0


def test_counter_reset_keeps_the_last_rate():
    t = TritonMetricsSignals("http://unused", start=False, fetch=Scripted(FIRST, LATER, FIRST))
    t.scrape_once(now=0.0)
    t.scrape_once(now=1.0)
    rate = t.values()["server_arrival_rate"]
    assert t.scrape_once(now=2.0)                  # the server restarted: counters went back
    assert t.values()["server_arrival_rate"] == rate


def test_failed_scrapes_are_tolerated_and_logged_once_per_streak(caplog):
    url = f"http://127.0.0.1:{unused_port()}/metrics"
    t = TritonMetricsSignals(url, start=False, timeout_s=0.5)
    with caplog.at_level(logging.DEBUG, logger="nightdraft.serving.metrics_scraper"):
        assert not t.scrape_once()                 # connection refused
        assert not t.scrape_once()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and url in warnings[0].getMessage()
    assert t.scrapes_failed == 2 and t.failure_streak == 2 and t.values() == {}
    assert "refused" in t.last_error.lower() or "URLError" in t.last_error

    caplog.clear()
    fetch = Scripted(FIRST, LATER, "garbage {{{", ConnectionRefusedError("refused"), LATER + GPU_LINES,
                     "<html>oops</html>")
    t = TritonMetricsSignals("http://unused", start=False, fetch=fetch)
    with caplog.at_level(logging.INFO, logger="nightdraft.serving.metrics_scraper"):
        assert t.scrape_once(now=0.0) and t.scrape_once(now=1.0)
        good = t.values()
        assert not t.scrape_once(now=2.0)          # garbage text
        assert not t.scrape_once(now=3.0)          # connection refused
        assert t.values() == good                  # the last good values stay
        assert t.merge(LoadSignals(batch_size=1)).server_arrival_rate == good["server_arrival_rate"]
        assert t.scrape_once(now=4.0)              # recovered
        assert not t.scrape_once(now=5.0)          # a new streak
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert sum(1 for lv, _ in msgs if lv == logging.WARNING) == 2    # once per streak
    assert any("recovered" in m for _, m in msgs)
    assert t.scrapes_ok == 3 and t.scrapes_failed == 3


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    texts: list = []

    def do_GET(self):   # noqa: N802
        body = (self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_background_scraper_over_http():
    _MetricsHandler.texts = [FIRST, LATER]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with TritonMetricsSignals(url, interval_s=0.05, timeout_s=1.0) as t:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and t.scrapes_ok < 3:
                time.sleep(0.02)
            assert t.scrapes_ok >= 3 and t.scrapes_failed == 0
            v = t.values()
            assert v["server_pending"] == 0 and v["server_arrival_rate"] is not None
        assert t._thread is None                    # stopped
        n = t.scrapes_ok
        time.sleep(0.15)
        assert t.scrapes_ok == n
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------
# a live server


@pytest.mark.slow
def test_live_tritonserver_metrics(tmp_path):
    import importlib.util
    import sys
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("nvidia-pytriton (the serve extra) is not installed")
    sys.path.insert(0, str(DATA))
    try:
        import capture_triton_metrics as cap
    finally:
        sys.path.remove(str(DATA))
    server = cap.start_server(cap.make_repository(tmp_path / "repo"))
    try:
        # scraped by hand here (start=False) so that no background scrape splits the interval
        t = TritonMetricsSignals(server.metrics_url, start=False, timeout_s=2.0, models="echo")
        assert t.scrape_once()
        before = parse_metrics(cap.scrape(server)).requests.get("echo", 0.0)
        t0 = time.monotonic()
        cap.infer(server, "echo", 20)
        time.sleep(0.2)
        assert t.scrape_once()
        elapsed = time.monotonic() - t0
        v = t.values()
        assert parse_metrics(cap.scrape(server)).requests["echo"] == before + 20
        assert v["server_arrival_rate"] >= 20 / (elapsed + 1.0)
        assert v["server_pending"] == 0
        m = t.merge(EngineSignals().snapshot(batch_size=2))
        assert m.server_arrival_rate == v["server_arrival_rate"]
        # and the background thread against the live server
        with TritonMetricsSignals(server.metrics_url, interval_s=0.1, timeout_s=2.0) as bg:
            deadline = time.monotonic() + 10.0
            while bg.scrapes_ok < 3 and time.monotonic() < deadline:
                cap.infer(server, "echo_b", 2)
                time.sleep(0.05)
            assert bg.scrapes_ok >= 3 and bg.scrapes_failed == 0
            assert bg.values()["server_arrival_rate"] is not None
    finally:
        server.stop(timeout_s=20)
    # the server is gone: the next scrape fails, quietly keeping the values
    assert not t.scrape_once()
    assert t.values() == v
