"""Shutdown is a drain, through a real tritonserver: with long streams in flight, a SIGTERM (to
tritonserver itself, or to `nightdraft serve`) lets the requests that can finish within the grace
period finish, ends the others with a final error that says the server is stopping, stops the
engine and the drafter worker, and exits 0. Also: a drafter worker killed under a running
server, and the server's own view of it.

Each test starts its own server (it is stopped on purpose), with a short grace period.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from client.triton_client import GrpcClient
from helpers.processes import descendants, drafter_workers, is_fork_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
GRACE_S = 6
STREAMS = 16


def repository(tmp_path: Path, **engine) -> Path:
    from conftest import test_engine_config

    repo = tmp_path / "model_repository"
    shutil.copytree(REPO / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cfg = test_engine_config() | {"max_num_seqs": 32} | engine
    (repo / "nightdraft" / "1" / "engine.json").write_text(json.dumps(cfg))
    pbtxt = repo / "nightdraft" / "config.pbtxt"
    pbtxt.write_text(re.sub(r'(key: "shutdown_grace_s"\s*value: \{ string_value: )"\d+"',
                            rf'\1"{GRACE_S}"', pbtxt.read_text()))
    assert f'string_value: "{GRACE_S}"' in pbtxt.read_text()
    return repo


def start_server(repo: Path, log: Path):
    from client.launcher import TritonServer, free_port

    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=log, exit_timeout_s=30, models=["nightdraft"])
    server.start()
    server.wait_ready(240)
    return server


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Streams:
    """Streaming requests on threads; each records how it ended."""

    def __init__(self, url: str, lengths: list[int]):
        self.results: dict[int, tuple] = {}
        self.threads = [threading.Thread(target=self._run, args=(url, i, n), daemon=True)
                        for i, n in enumerate(lengths)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int, max_tokens: int) -> None:
        client = GrpcClient(url, "nightdraft", timeout_s=120)
        text = []
        try:
            for chunk in client.stream(f"def handler_{i}(event):\n", max_tokens=max_tokens,
                                       temperature=0.0, ignore_eos=True):
                text.append(chunk.text)
            self.results[i] = ("done", "".join(text))
        except Exception as e:  # noqa: BLE001 - recorded and checked
            self.results[i] = ("error", "".join(text), str(e))

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


def wait_streaming(streams: Streams, server, min_running: int) -> None:
    from helpers.triton import metrics
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if metrics(server).get("nightdraft_num_requests_running", 0) >= min_running:
            return
        time.sleep(0.1)
    raise AssertionError("the streams did not start")


def check_drained(streams: Streams, lengths: list[int]) -> None:
    assert sorted(streams.results) == list(range(len(lengths))), "a client got no final response"
    for i, n in enumerate(lengths):
        res = streams.results[i]
        if n <= 40:
            assert res[0] == "done", f"a short request did not finish within the grace period: {res}"
        elif res[0] == "error":
            assert "the server is stopping" in res[2] and "grace period" in res[2], res[2]


def test_sigterm_to_tritonserver_drains_and_exits_cleanly(tmp_path):
    repo = repository(tmp_path, drafter_device="cpu", mode="psd", gamma=3)
    server = start_server(repo, tmp_path / "server.log")
    family = descendants(server.proc.pid)
    servers = {p for p in family if is_fork_server(p)}
    assert len(drafter_workers(server.proc.pid)) == 1 and len(servers) == 1, \
        "expected the Python backend stub, the fork server and the drafter worker"
    lengths = [24] * 4 + [900] * (STREAMS - 4)      # short ones finish, long ones cannot
    streams = Streams(server.grpc_url, lengths)
    try:
        wait_streaming(streams, server, min_running=STREAMS // 2)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(GRACE_S + 40)
        took = time.monotonic() - t0
        streams.join(30)
        log = (tmp_path / "server.log").read_text()
        assert rc == 0, f"tritonserver exited with {rc}:\n{log[-3000:]}"
        assert took < GRACE_S + 15, f"shutdown took {took:.0f} s"
        check_drained(streams, lengths)
        assert any(r[0] == "error" for r in streams.results.values()), "no long stream was cut: nothing tested"
        assert "drained" in log and "finalized" in log
        time.sleep(0.5)
        assert not [p for p in family - servers if alive(p)], "a stub or the drafter worker outlived the server"
        # The fork server the worker came from holds no request or device memory; it tears its
        # imported torch down a second or two after the stub that started it is gone.
        deadline = time.monotonic() + 10
        while [p for p in servers if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in servers if alive(p)], "the fork server outlived the server by 10 s"
    finally:
        server.stop(timeout_s=10)


def test_sigterm_to_nightdraft_serve_drains(tmp_path):
    from client.launcher import free_port

    repo = repository(tmp_path)
    ports = [free_port() for _ in range(3)]
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--model-repository", str(repo),
                             "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
                             "--metrics-port", str(ports[2]), "--model", "nightdraft",
                             "--log-file", str(log)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.25)
        lengths = [24] * 2 + [900] * 6
        streams = Streams(f"127.0.0.1:{ports[1]}", lengths)

        class S:
            metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"
        wait_streaming(streams, S, min_running=4)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(GRACE_S + 45)
        streams.join(30)
        out = proc.stdout.read().decode()
        assert rc == 0, out
        assert "tritonserver stopped (exit code 0)" in out, out
        check_drained(streams, lengths)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_shutdown_after_a_request_the_core_rejected_is_quick(tmp_path):
    import numpy as np
    from helpers.triton import infer_raw

    server = start_server(repository(tmp_path), tmp_path / "server.log")
    try:
        _, errors, final = infer_raw(server, [("text_input", np.array([7], dtype=np.int32), "INT32")])
        assert errors and final
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(60)
        assert rc == 0 and time.monotonic() - t0 < 15, f"exit {rc} after {time.monotonic() - t0:.0f} s"
    finally:
        server.stop(timeout_s=10)


def test_a_killed_worker_under_a_running_server(tmp_path):
    """The stream in flight completes with plain decoding's output, the server stays ready (it
    serves, degraded), its metrics show the failure and the restart, and speculation resumes."""
    from helpers.triton import metrics

    repo = repository(tmp_path, drafter_device="cpu", mode="sd", gamma=3, drafter_timeout_s=2.0)
    server = start_server(repo, tmp_path / "server.log")
    try:
        from conftest import test_engine_config
        from backend.engine.engine import Engine
        from backend.engine.config import EngineConfig
        from backend.sampling.params import SamplingParams
        import torch

        threads = torch.get_num_threads()
        ar = Engine(EngineConfig.from_dict(test_engine_config() | {"mode": "ar", "drafter": None}))
        torch.set_num_threads(threads)
        prompt = "def handler_0(event):\n"
        want = ar.generate([prompt], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))[0].text
        workers = drafter_workers(server.proc.pid)
        assert len(workers) == 1, "expected one drafter worker"
        streams = Streams(server.grpc_url, [300])
        wait_streaming(streams, server, min_running=1)
        os.kill(workers[0], signal.SIGKILL)
        streams.join(120)
        assert streams.results[0] == ("done", want)
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as r:
            assert r.status == 200
        deadline = time.monotonic() + 60
        m = metrics(server)
        while time.monotonic() < deadline and not (m.get("nightdraft_drafter_restarts_total", 0) >= 1
                                                   and m.get("nightdraft_drafter_state{state=on_device}") == 1):
            time.sleep(0.2)
            GrpcClient(server.grpc_url, "nightdraft", timeout_s=60).generate("x = 1\n", max_tokens=4)
            m = metrics(server)
        assert m["nightdraft_drafter_failures_total"] >= 1 and m["nightdraft_drafter_restarts_total"] >= 1
        assert m["nightdraft_engine_healthy"] == 1
        before = m["nightdraft_spec_decode_draft_tokens_total"]
        GrpcClient(server.grpc_url, "nightdraft", timeout_s=60).generate(prompt, max_tokens=40, temperature=0.0)
        time.sleep(0.3)
        assert metrics(server)["nightdraft_spec_decode_draft_tokens_total"] > before, "no drafts after the restart"
    finally:
        server.stop(timeout_s=30)


def test_a_full_queue_answers_busy_and_serves_on(tmp_path):
    """Beyond max_waiting queued requests the server answers UNAVAILABLE "server busy", and
    serves every request it accepted."""
    repo = repository(tmp_path, max_num_seqs=1, max_waiting=2)
    server = start_server(repo, tmp_path / "server.log")
    try:
        # One runs, two wait: the running one as long as the context allows, so that the queue
        # stays full while the requests below are refused (the waiting ones' length does not
        # matter, they wait behind it). The first starts alone: three sent at once can all
        # arrive before the engine takes one in, and then the third is the one refused (the
        # queue holds two).
        accepted = Streams(server.grpc_url, [1000])
        wait_streaming(accepted, server, min_running=1)
        waiting = Streams(server.grpc_url, [24, 24])
        deadline = time.monotonic() + 30
        from helpers.triton import metrics
        seen = []     # (s, running, waiting, generated tokens): what the failure message shows
        while time.monotonic() < deadline:
            m = metrics(server)
            seen.append((round(time.monotonic() - deadline + 30, 2), m.get("nightdraft_num_requests_running"),
                         m.get("nightdraft_num_requests_waiting"), m.get("nightdraft_generation_tokens_total")))
            if seen[-1][2] == 2:
                break
            time.sleep(0.05)
        assert seen[-1][2] == 2, f"the queue never filled; (s, running, waiting, tokens) seen: {seen[:5]} ... {seen[-5:]}"
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/nightdraft/generate",
                                     data=json.dumps({"text_input": "hi", "parameters": {"max_tokens": 4}}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raise AssertionError(f"a request beyond max_waiting was accepted: {r.status}")
        except urllib.error.HTTPError as e:   # (Triton's /generate answers model errors with 400)
            assert e.code == 400 and "server busy: 2 requests are waiting" in e.read().decode()
        import numpy as np
        from helpers.triton import infer_raw
        _, errors, final = infer_raw(server, [("text_input", np.array([b"hi"], dtype=np.object_), "BYTES")])
        assert final and errors and "server busy" in errors[0]
        accepted.join(120)
        waiting.join(120)
        ends = [accepted.results.get(0), waiting.results.get(0), waiting.results.get(1)]
        assert [e and e[0] for e in ends] == ["done"] * 3, f"an accepted request did not finish: {ends}"
    finally:
        server.stop(timeout_s=30)
