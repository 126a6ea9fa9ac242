"""A soak through the real tritonserver: many requests of every kind, over the three pipeline
modes at once, while a drafter worker is killed. At the end every request got exactly one final
response, no valid request failed, every KV pool is free, the server's processes hold no more
memory or file descriptors than after the warm-up, and the server and its models are ready.

The mix (seeded): streaming and not, short and long prompts (up to about 700 tokens), greedy and
sampled; about 1 in 10 cancelled by its client after its first response, 1 in 10 a bad input
(an error and the final flag). One server serves three copies of the model: sd, psd and auto,
each with its drafter in a worker process.

CI runs ``NIGHTDRAFT_SOAK_REQUESTS`` requests (default 240); the long soak is documented in
docs/deployment.md ("Soak test"). ``NIGHTDRAFT_SOAK_REPORT`` names a JSON file for the figures.
"""
from __future__ import annotations

import json
import os
import queue
import random
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from helpers.processes import descendants, drafter_workers, parent
from helpers.triton import is_final, metrics, wait_kv_free
from test_triton_e2e import BAD_INPUTS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MODES = ("sd", "psd", "auto")
REQUESTS = int(os.environ.get("NIGHTDRAFT_SOAK_REQUESTS", "240"))
CONCURRENCY = 8
T = 120.0
# After the warm-up (the first third of the requests: caches, allocator arenas sized by the
# longest prompts, lazily built kernels), the end may exceed the start by this much and still
# be flat.
RSS_SLACK = (1.15, 48 << 20)       # factor, bytes
FD_SLACK = 8


def model_name(mode: str) -> str:
    return f"nightdraft_{mode}"


def soak_repository(tmp: Path) -> Path:
    from client.dynamic_server import set_model_parameter
    from conftest import test_engine_config

    repo = tmp / "model_repository"
    pbtxt = (REPO / "model_repository" / "nightdraft" / "config.pbtxt").read_text()
    for mode in MODES:
        dst = repo / model_name(mode)
        (dst / "1").mkdir(parents=True)
        text = pbtxt.replace('name: "nightdraft"', f'name: "{model_name(mode)}"', 1)
        (dst / "config.pbtxt").write_text(set_model_parameter(text, "shutdown_grace_s", "5"))
        cfg = test_engine_config() | {"mode": mode, "gamma": 3, "drafter_device": "cpu", "max_num_seqs": 16,
                                      "drafter_timeout_s": 5.0, "drafter_restart_s": 0.5,
                                      "lend_drafter_cores": False}
        (dst / "1" / "engine.json").write_text(json.dumps(cfg, indent=2))
    return repo


@dataclass
class Outcome:
    kind: str                  # "valid" | "cancel" | "bad"
    model: str
    finals: int = 0
    errors: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    responses: int = 0
    expected_error: str | None = None


def tensors(inputs: list[tuple[str, object, str]]):
    import tritonclient.grpc as grpcclient
    out = []
    for name, val, dt in inputs:
        arr = np.array([val], dtype=np.object_ if dt == "BYTES" else {"BOOL": bool, "INT32": np.int32}[dt])
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def send(url: str, outcome: Outcome, inputs, cancel_after: int | None) -> Outcome:
    """One request on a stream of its own. A cancelled one is cut by its client (the stream
    cancelled); any other is read to its final flag, and then the stream is closed normally,
    which waits for the server to end it: a response after the final one would show."""
    import tritonclient.grpc as grpcclient

    cl = grpcclient.InferenceServerClient(url)
    q: queue.SimpleQueue = queue.SimpleQueue()
    cl.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=T)
    cancelled = False

    def take(result, error) -> None:
        if error is not None:
            outcome.errors.append(error.message() if hasattr(error, "message") else str(error))
            outcome.finals += 1            # an error ends the request: its final flag comes with it
            return
        outcome.responses += 1
        if is_final(result):
            outcome.finals += 1
        out = result.as_numpy("finish_reason")
        if out is not None and out.size:
            outcome.finish_reason = out.reshape(-1)[0].decode()

    try:
        cl.async_stream_infer(outcome.model, tensors(inputs), enable_empty_final_response=True)
        deadline = time.monotonic() + T
        while time.monotonic() < deadline and outcome.finals == 0:
            try:
                take(*q.get(timeout=0.5))
            except queue.Empty:
                continue
            if cancel_after is not None and outcome.responses >= cancel_after and outcome.finals == 0:
                cancelled = True
                break
    finally:
        # (a request that never ended is cancelled too, so that the close cannot hang; it fails below)
        cl.stop_stream(cancel_requests=cancelled or outcome.finals == 0)
        cl.close()
    while not q.empty():                   # whatever came before the stream closed
        take(*q.get())
    return outcome


def request_mix(rng: random.Random, prompts: list[str], long_prompts: list[str], i: int):
    """(outcome, inputs, cancel_after) for request i."""
    model = model_name(MODES[i % len(MODES)])
    roll = rng.random()
    if roll < 0.1:
        case = rng.choice(sorted(BAD_INPUTS))
        inputs, needle = BAD_INPUTS[case]
        return Outcome("bad", model, expected_error=needle), inputs, None
    prompt = rng.choice(long_prompts if rng.random() < 0.2 else prompts)
    stream = rng.random() < 0.5
    params = {"max_tokens": rng.randint(1, 24), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        params |= {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 30)}
    else:
        params["temperature"] = 0.0
    inputs = [("text_input", prompt.encode(), "BYTES"), ("stream", stream, "BOOL"),
              ("sampling_parameters", json.dumps(params).encode(), "BYTES"),
              ("return_finish_reason", True, "BOOL")]
    if roll < 0.2 and stream:
        params["max_tokens"] = 200
        inputs[2] = ("sampling_parameters", json.dumps(params | {"ignore_eos": True}).encode(), "BYTES")
        return Outcome("cancel", model), inputs, 1
    return Outcome("valid", model), inputs, None


def choose_worker(workers: list[int], rng: random.Random) -> int:
    """A drafter worker of the sd or psd model (they draft for every request, so its death is
    noticed at once; auto's planner may decode plainly for a while), else any."""
    def stub_cmdline(p: int) -> bytes:
        """The command line of the backend stub above the worker (its parent is the fork server)."""
        for _ in range(4):
            p = parent(p)
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes() if p is not None else b""
            except OSError:     # gone meanwhile
                return b""
            if b"triton_python_backend_stub" in cmd:
                return cmd
        return b""
    fixed = [p for p in workers if any(model_name(m).encode() in stub_cmdline(p) for m in ("sd", "psd"))]
    assert len(fixed) == 2, f"the sd and psd models' workers not found among {workers}"
    return rng.choice(fixed or workers)


def process_figures(pid: int) -> dict[int, dict]:
    """RSS (bytes) and open descriptors of tritonserver and its backend stubs (the drafter
    workers are left out: one is killed and replaced on purpose)."""
    out = {}
    for p in [pid] + sorted(descendants(pid)):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            if p != pid and b"triton_python_backend_stub" not in cmd:
                continue
            rss = int(next(line.split()[1] for line in Path(f"/proc/{p}/status").read_text().splitlines()
                           if line.startswith("VmRSS:"))) * 1024
            out[p] = {"rss": rss, "fds": len(os.listdir(f"/proc/{p}/fd"))}
        except (OSError, StopIteration):
            continue
    return out


def ready(server, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def test_soak(tmp_path):
    from client.launcher import LauncherError, TritonServer, find_tritonserver, free_port
    from client.prompts import load_prompts
    from conftest import start_ready

    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")
    repo = soak_repository(tmp_path)
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=tmp_path / "server.log", exit_timeout_s=20,
                          models=[model_name(m) for m in MODES])
    start_ready(server, 300)
    rng = random.Random(23)
    prompts = [p[:200] for p in load_prompts(n=12)]
    # about 500-600 tokens each (with max_tokens, within the tiny target's 1024)
    long_prompts = ["".join(load_prompts(n=12))[i * 700:i * 700 + 1500] for i in range(3)]
    plan = [request_mix(rng, prompts, long_prompts, i) for i in range(REQUESTS)]
    warm_up = max(REQUESTS // 3, 2 * CONCURRENCY)
    report: dict = {"requests": REQUESTS}
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            done = [f.result(T * 2) for f in [pool.submit(send, server.grpc_url, *r) for r in plan[:warm_up]]]
            for m in MODES:
                wait_kv_free(server, model_name(m), timeout=60)
            start = process_figures(server.proc.pid)
            futures = [pool.submit(send, server.grpc_url, *r) for r in plan[warm_up:]]
            killed = None
            while any(not f.done() for f in futures):
                finished = sum(f.done() for f in futures)
                if killed is None and finished >= len(futures) // 3:
                    workers = drafter_workers(server.proc.pid)
                    assert len(workers) == len(MODES), f"drafter workers: {workers}"
                    killed = choose_worker(workers, rng)
                    os.kill(killed, signal.SIGKILL)
                time.sleep(0.2)
            done += [f.result() for f in futures]
        assert killed is not None, "the drafter worker was never killed"

        by_kind: dict[str, list[Outcome]] = {}
        for o in done:
            by_kind.setdefault(o.kind, []).append(o)
        report["kinds"] = {k: len(v) for k, v in by_kind.items()}
        for o in done:
            if o.kind != "cancel":
                assert o.finals == 1, f"{o.kind} request to {o.model}: {o.finals} final responses"
        for o in by_kind["valid"]:
            assert not o.errors, f"a valid request to {o.model} failed: {o.errors}"
            assert o.finish_reason in ("length", "stop"), o
        for o in by_kind["bad"]:
            assert o.errors and o.expected_error.lower() in o.errors[0].lower(), o
        for o in by_kind.get("cancel", []):
            assert not o.errors or "cancel" in o.errors[0].lower(), o

        restarts = 0
        for m in MODES:
            final = wait_kv_free(server, model_name(m), timeout=60)
            restarts += final.get("nightdraft_drafter_restarts_total", 0)
            assert final["nightdraft_engine_healthy"] == 1
        # The killed worker is noticed when its engine next talks to it: a few more requests.
        deadline = time.monotonic() + 90
        while restarts < 1 and time.monotonic() < deadline:
            for m in MODES:
                o = send(server.grpc_url, Outcome("valid", model_name(m)),
                         [("text_input", prompts[0].encode(), "BYTES"),
                          ("sampling_parameters", b'{"max_tokens": 8, "temperature": 0}', "BYTES")], None)
                assert o.finals == 1 and not o.errors, o
            time.sleep(0.5)
            restarts = sum(metrics(server, model_name(m)).get("nightdraft_drafter_restarts_total", 0)
                           for m in MODES)
        assert restarts >= 1, "the killed drafter worker was not replaced"
        for m in MODES:
            wait_kv_free(server, model_name(m), timeout=60)
        end = process_figures(server.proc.pid)
        report["processes"] = {str(p): {"start": start[p], "end": end.get(p)} for p in start}
        for p, s in start.items():
            e = end.get(p)
            assert e is not None, f"process {p} is gone"
            assert e["rss"] <= s["rss"] * RSS_SLACK[0] + RSS_SLACK[1], f"process {p}: RSS {s} -> {e}"
            assert e["fds"] <= s["fds"] + FD_SLACK, f"process {p}: descriptors {s} -> {e}"
        assert ready(server, "/v2/health/ready")
        for m in MODES:
            assert ready(server, f"/v2/models/{model_name(m)}/ready"), f"{model_name(m)} not ready"
    finally:
        out = os.environ.get("NIGHTDRAFT_SOAK_REPORT")
        if out:
            Path(out).write_text(json.dumps(report, indent=1))
        print(f"\nsoak: {json.dumps(report)}")
        server.stop(timeout_s=60)
