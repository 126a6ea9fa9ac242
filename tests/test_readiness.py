"""The model's readiness and its drain tell the truth.

Without a server: the readiness probe tells "the server says not ready" from "no answer", and
the drain starts only on the former; the watcher thread survives whatever its probe and health
check raise. Through real tritonservers: a server whose environment sends HTTP to a dead proxy
keeps serving request after request; a cancellation that arrives while the prompt is being
tokenized still aborts the request; a drafter that cannot be restarted makes the model unready
(ENABLE_VLLM_HEALTH_CHECK) and shows in ``nightdraft_engine_healthy``.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from backend.serving.drain import UNLOAD_POLL_S
from backend.serving.request import InflightRequests
from helpers.local_http import answering

READY_PATH = "/v2/models/nightdraft/versions/1/ready"


# ------------------------------------------------------------------ the probe, without a server


def test_the_probe_tells_not_ready_from_no_answer():
    from backend.serving.health import Readiness, ReadinessProbe

    for status, want in ((200, Readiness.READY), (400, Readiness.NOT_READY), (404, Readiness.NOT_READY),
                         (503, Readiness.NOT_READY), (403, Readiness.UNKNOWN), (502, Readiness.UNKNOWN)):
        with answering(status) as port:
            assert ReadinessProbe("127.0.0.1", port, READY_PATH).poll() is want, status
    with answering(raw=b"garbage\r\n\r\n") as port:      # http.client raises BadStatusLine
        probe = ReadinessProbe("127.0.0.1", port, READY_PATH)
        assert probe.poll() is Readiness.UNKNOWN and "BadStatusLine" in probe.last_error
    with socket.socket() as s:        # nothing listens there: refused, as a stopping Triton does
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert ReadinessProbe("127.0.0.1", port, READY_PATH).poll() is Readiness.NOT_READY
    with socket.socket() as silent:                      # accepts, never answers: a timeout
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        probe = ReadinessProbe("127.0.0.1", silent.getsockname()[1], READY_PATH, timeout_s=0.2)
        assert probe.poll() is Readiness.UNKNOWN and "timed out" in probe.last_error


def test_the_probe_never_asks_a_proxy(monkeypatch):
    from backend.serving.health import Readiness, ReadinessProbe

    with answering(200) as port, answering(400) as proxy:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy}")
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        assert ReadinessProbe("127.0.0.1", port, READY_PATH).poll() is Readiness.READY


def test_the_launcher_is_ready_only_once_the_metrics_port_answers_too(tmp_path):
    """tritonserver reports health/ready before its metrics port listens; a caller told "ready"
    that scraped at once was refused (seen in CI), so the launcher's readiness waits for both."""
    from client.launcher import TritonServer, free_port
    from test_deployment import fake_tritonserver

    def server(metrics_port, extra=()):
        return TritonServer(tmp_path, tritonserver=fake_tritonserver(tmp_path), env={},
                            http_port=health, metrics_port=metrics_port, extra_args=list(extra))
    with answering(200) as health:
        closed = free_port()
        assert not server(closed).is_ready(), "health answers, the metrics port does not listen"
        assert server(closed, ["--allow-metrics", "false"]).is_ready(), \
            "with metrics turned off there is no port to wait for"
        with answering(200) as metrics:
            assert server(metrics).is_ready()


def test_the_launcher_sees_its_server_ready_past_an_http_proxy():
    """`nightdraft serve` waits for its own server's readiness; an http_proxy in its environment
    without no_proxy for loopback must not send that request to the proxy."""
    import subprocess
    import sys

    code = ("import sys, types; from client.launcher import TritonServer; "
            "sys.exit(0 if TritonServer.is_ready(types.SimpleNamespace(http_url=sys.argv[1], "
            "metrics_url=f'http://{sys.argv[1]}/metrics', serves_metrics=True)) else 1)")
    with answering(200) as port, answering(502) as proxy:
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy")}
        env |= {"http_proxy": f"http://127.0.0.1:{proxy}", "HTTP_PROXY": f"http://127.0.0.1:{proxy}"}
        rc = subprocess.run([sys.executable, "-c", code, f"127.0.0.1:{port}"], env=env,
                            cwd=Path(__file__).resolve().parent.parent, timeout=60).returncode
    assert rc == 0, "the launcher asked the proxy"


class ScriptedProbe:
    def __init__(self, answers):
        self.answers = list(answers)
        self.last_error = "scripted"

    def poll(self):
        from backend.serving.health import Readiness
        answer = self.answers.pop(0) if self.answers else Readiness.READY
        if isinstance(answer, Exception):
            raise answer
        return answer


class StoppingLoop:
    num_inflight = 0

    def __init__(self):
        self.shutdowns = []

    def shutdown(self, **kw):
        self.shutdowns.append(kw)


def test_only_the_server_saying_not_ready_starts_a_drain():
    from backend.serving.drain import NOT_READY_POLLS, Drain
    from backend.serving.health import Readiness

    R, N, U = Readiness.READY, Readiness.NOT_READY, Readiness.UNKNOWN
    script = [R] + [U] * 10 + [N, R] + [N, U, N, N, U]     # no "not ready" row long enough
    loop = StoppingLoop()
    drain = Drain("m", "1", loop=loop, inflight=InflightRequests(), grace_s=0, probe=ScriptedProbe(script))
    for _ in script:
        drain._poll_readiness()
    assert not drain.draining.is_set() and not loop.shutdowns, "a failed poll or one stray answer drained"
    assert drain.probe_errors == 12
    drain.probe.answers = [N] * NOT_READY_POLLS
    for _ in range(NOT_READY_POLLS):
        drain._poll_readiness()
    assert drain.draining.is_set() and len(loop.shutdowns) == 1


def test_the_watcher_survives_what_its_probe_and_health_check_raise():
    from backend.serving.drain import NOT_READY_POLLS, Drain
    from backend.serving.health import Readiness

    calls = []

    def failing_health_check():
        calls.append(1)
        raise RuntimeError("an IPC call failed")
    loop = StoppingLoop()
    probe = ScriptedProbe([Readiness.READY, http.client.HTTPException("bad reply"), OSError("no fd"),
                           Readiness.READY])
    drain = Drain("m", "1", loop=loop, inflight=InflightRequests(), grace_s=0, probe=probe,
                  on_poll=failing_health_check)
    drain.watch()
    try:
        deadline = time.monotonic() + 10
        while probe.answers and time.monotonic() < deadline:
            time.sleep(UNLOAD_POLL_S)
        time.sleep(2 * UNLOAD_POLL_S)
        assert drain.watching and not drain.draining.is_set() and drain.probe_errors == 2
        probe.answers = [Readiness.NOT_READY] * NOT_READY_POLLS     # now the server stops
        deadline = time.monotonic() + 10
        while not loop.shutdowns and time.monotonic() < deadline:
            time.sleep(UNLOAD_POLL_S)
        assert loop.shutdowns, "the real stop was not noticed"
        assert len(calls) >= 4
    finally:
        drain.close()


# ------------------------------------------------------------------ the engine's health


def test_engine_health_follows_a_loop_that_gives_up():
    from backend.engine.loop import EngineLoop, EngineLoopError
    from backend.serving.engine_health import EngineHealth
    from test_engine_loop import Collector, FakeEngine, params

    engine = FakeEngine()
    loop = EngineLoop(engine)
    health = EngineHealth(loop, engine)
    try:
        assert health.check() is None
        engine.fail_always = RuntimeError("the device is gone")
        for i in range(EngineLoop.MAX_CONSECUTIVE_FAILURES):
            with contextlib.suppress(EngineLoopError):
                loop.submit(f"r{i}", "x", params(5), Collector())
        deadline = time.monotonic() + 10
        while loop.healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        reason = health.check()
        assert reason is not None and "consecutive failing steps" in reason and "the device is gone" in reason
    finally:
        loop.shutdown(timeout_s=10)


def test_engine_health_counts_a_drafter_down_through_serving_time_only():
    from types import SimpleNamespace

    from backend.serving.engine_health import EngineHealth

    now = [0.0]
    drafter = SimpleNamespace(state="on_device")
    loop = SimpleNamespace(healthy=True, fatal=None, num_inflight=1)
    health = EngineHealth(loop, SimpleNamespace(drafter=drafter), drafter_down_s=10, clock=lambda: now[0])

    def at(t):
        now[0] = t
        return health.check()
    assert at(0) is None
    drafter.state = "failed"
    assert at(4) is None and at(6) is None
    loop.num_inflight = 0                  # idle: no restart is tried, the time does not count
    assert at(100) is None
    loop.num_inflight = 1
    drafter.state = "restarting"
    assert at(103) is None
    assert "could not be restarted" in at(106)   # 6 + 3 + 3 s of serving with it down
    drafter.state = "on_device"            # it came back
    assert at(107) is None
    drafter.state = "failed"
    assert at(110) is None, "a new outage starts from zero"
    assert EngineHealth(loop, SimpleNamespace(drafter=drafter), drafter_down_s=0).check() is None


# ------------------------------------------------------------------ through real servers


def model_ready(server) -> int:
    """HTTP status of the model's readiness, asked directly (no proxy)."""
    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", "/v2/models/nightdraft/ready")
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


FILLER = "\x7f"   # the test tokenizer's normalizer deletes it: slow to tokenize, no tokens


def filler_checkpoint(root: Path) -> Path:
    """The tiny target with a tokenizer that normalizes FILLER away."""
    from conftest import TINY_TARGET
    ckpt = root / "filler-target"
    ckpt.mkdir()
    for f in TINY_TARGET.iterdir():
        if f.name != "tokenizer.json":
            (ckpt / f.name).symlink_to(f.resolve())
    tok = json.loads((TINY_TARGET / "tokenizer.json").read_text())
    tok["normalizer"] = {"type": "Replace", "pattern": {"String": FILLER}, "content": ""}
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    return ckpt


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    """A server in an environment operators have: HTTP goes through a proxy that is not there
    (http_proxy set, no no_proxy), and Triton's log is not escaped (readable multi-line
    messages); serving the tiny target with the filler tokenizer, plain decoding."""
    from client.launcher import free_port
    from conftest import nightdraft_only_server, test_engine_config

    tmp = tmp_path_factory.mktemp("proxied")
    dead = free_port()
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy")}
    env |= {"http_proxy": f"http://127.0.0.1:{dead}", "HTTP_PROXY": f"http://127.0.0.1:{dead}",
            "TRITON_SERVER_ESCAPE_LOG_MESSAGES": "0"}
    cfg = test_engine_config() | {"target": str(filler_checkpoint(tmp)), "drafter": None, "mode": "ar",
                                  "max_prompt_bytes": 64 << 20}
    with nightdraft_only_server(tmp, cfg, env=env) as server:
        yield server


@pytest.mark.slow
def test_a_proxy_in_the_servers_environment_does_not_drain_it(proxied):
    from client.triton_client import GrpcClient
    from helpers.triton import metrics

    client = GrpcClient(proxied.grpc_url, "nightdraft", timeout_s=60)
    first = client.generate("def f(x):\n", max_tokens=4, temperature=0.0, ignore_eos=True)
    time.sleep(8 * UNLOAD_POLL_S)       # the model polls its readiness meanwhile
    second = client.generate("def f(x):\n", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert second.text == first.text and second.finish_reason == "length"
    assert model_ready(proxied) == 200
    m = metrics(proxied)
    assert m["nightdraft_model_state{state=serving}"] == 1 and m["nightdraft_model_state{state=draining}"] == 0
    assert m["nightdraft_engine_healthy"] == 1
    assert m["nightdraft_readiness_probe_errors_total"] == 0, "the probe went to the proxy"


def tokenize_seconds(ckpt: Path, text: str) -> float:
    from backend.model.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(ckpt)
    t0 = time.monotonic()
    ids = tok.encode(text)
    assert len(ids) < 16, "the filler must tokenize to nothing"
    return time.monotonic() - t0


@pytest.mark.slow
def test_a_cancellation_while_the_prompt_is_tokenized_is_not_lost(proxied):
    """The client cancels while the model tokenizes its (long, slow to tokenize) prompt: the
    request must still be aborted, not run to max_tokens holding its KV blocks."""
    import tritonclient.grpc as grpcclient
    from helpers.triton import metrics, wait_kv_free

    ckpt = Path(json.loads((proxied.model_repository / "nightdraft" / "1" / "engine.json").read_text())["target"])
    prompt = FILLER * (2 << 20) + "def f(x):\n"
    took = tokenize_seconds(ckpt, prompt)
    while took < 1.5 and len(prompt) < 48 << 20:     # long enough that the cancel lands inside it
        prompt = FILLER * (2 * len(prompt)) + "def f(x):\n"
        took = tokenize_seconds(ckpt, prompt)
    before = metrics(proxied)
    max_tokens = 900
    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    ins = []
    for name, val, dt in (("text_input", prompt.encode(), "BYTES"), ("stream", True, "BOOL"),
                          ("sampling_parameters", json.dumps(sampling).encode(), "BYTES")):
        t = grpcclient.InferInput(name, [1], dt)
        t.set_data_from_numpy(np.array([val], dtype=np.object_ if dt == "BYTES" else bool))
        ins.append(t)
    client = grpcclient.InferenceServerClient(proxied.grpc_url)
    got: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("nightdraft", ins)
    time.sleep(min(0.5, took / 3))       # the request is in the model, its prompt being tokenized
    client.stop_stream(cancel_requests=True)
    client.close()
    aborts = before["nightdraft_request_success_total{finish_reason=abort}"]
    m = wait_kv_free(proxied, timeout=took + 30,
                     until=lambda m: m["nightdraft_request_success_total{finish_reason=abort}"] > aborts
                     or m["nightdraft_request_success_total{finish_reason=length}"]
                     > before["nightdraft_request_success_total{finish_reason=length}"])
    generated = m["nightdraft_generation_tokens_total"] - before["nightdraft_generation_tokens_total"]
    assert m["nightdraft_request_success_total{finish_reason=abort}"] == aborts + 1, \
        f"the cancelled request ran on ({generated} tokens generated)"
    assert generated < max_tokens


def worker_pids(server) -> list[int]:
    from helpers.processes import drafter_workers
    return drafter_workers(server.proc.pid)


@pytest.mark.slow
def test_a_drafter_that_cannot_restart_makes_the_model_unready(tmp_path):
    """The drafter's worker dies and its checkpoint is gone, so no restart can succeed: within
    drafter_down_s of serving the engine counts as unhealthy (nightdraft_engine_healthy 0), and
    with ENABLE_VLLM_HEALTH_CHECK (on in the shipped config.pbtxt) the model unloads itself, so
    its readiness stops answering 200; the request in flight still gets its final response."""
    from conftest import TINY_DRAFTER, nightdraft_only_server, test_engine_config
    from test_shutdown import Streams, wait_streaming
    from helpers.triton import metrics

    drafter = tmp_path / "drafter"
    shutil.copytree(TINY_DRAFTER, drafter)
    cfg = test_engine_config() | {"drafter": str(drafter), "drafter_device": "cpu", "mode": "sd", "gamma": 3,
                                  "drafter_restart_s": 0.5, "drafter_timeout_s": 2.0}
    params = {"ENABLE_VLLM_HEALTH_CHECK": "true", "drafter_down_s": "2", "shutdown_grace_s": "2"}
    with nightdraft_only_server(tmp_path, cfg, parameters=params) as server:
        assert model_ready(server) == 200
        (worker,) = worker_pids(server)
        streams = Streams(server.grpc_url, [900])
        wait_streaming(streams, server, min_running=1)
        drafter.rename(tmp_path / "drafter-gone")
        os.kill(worker, signal.SIGKILL)
        saw_unhealthy, status = False, 200
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (status == 200 or not saw_unhealthy):
            with contextlib.suppress(Exception):
                m = metrics(server)
                saw_unhealthy |= m.get("nightdraft_engine_healthy") == 0
            status = model_ready(server)
            time.sleep(0.1)
        assert status != 200, "the model stayed ready with a drafter that cannot be restarted"
        assert saw_unhealthy, "nightdraft_engine_healthy never said so"
        streams.join(60)
        assert 0 in streams.results, "the request in flight got no final response"
        log = (tmp_path / "tritonserver.log").read_text()
        assert "the drafter could not be restarted" in log


@pytest.mark.slow
def test_a_client_request_id_cannot_forge_log_lines(proxied):
    """The model logs a cancelled request by the client's id; a newline in that id must not start
    a log line of the client's making (Triton escapes log messages only while
    TRITON_SERVER_ESCAPE_LOG_MESSAGES is not 0, as with this server)."""
    from client.triton_client import GrpcClient

    forged = "E1202 00:00:00.000000 1 forged.cc:1] written by a client"
    client = GrpcClient(proxied.grpc_url, "nightdraft", timeout_s=60)
    got = 0
    for chunk in client.stream("def f(x):\n", max_tokens=900, temperature=1.0, ignore_eos=True,
                               request_id=f"id\n{forged}"):
        got += bool(chunk.text)
        if got == 2:
            break          # cancels the request: the model logs it
    deadline = time.monotonic() + 15
    logged: list[str] = []
    while not logged and time.monotonic() < deadline:
        time.sleep(0.2)
        logged = [line for line in proxied.log_file.read_text(errors="replace").splitlines()
                  if "cancelled by the client" in line]
    assert logged, "the cancellation was not logged"
    lines = proxied.log_file.read_text(errors="replace").splitlines()
    assert not [line for line in lines if line.startswith(forged)], "a client forged a log line"
    assert any("id\\nE1202" in line and "written by a client" in line for line in logged), logged
