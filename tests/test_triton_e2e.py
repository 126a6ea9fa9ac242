"""End to end against a real tritonserver (started by the ``triton_server`` fixture).

Every network call has a timeout, so a broken server fails these tests instead of hanging CI.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from client.triton_client import ClientError, GrpcClient, HttpClient, collect
from helpers.triton import is_final, metrics, short_prompts, stream_request, wait_kv_free

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
T = 60.0          # seconds: per request
MAX_TOKENS = 24

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Ünïcödé ✓ — 日本語のテキスト:\n",
]


# ------------------------------------------------------------------------------ helpers


class Ref(tuple):
    """(text, finish_reason) of the offline engine, plus the number of tokens."""

    def __new__(cls, text, reason, n):
        self = super().__new__(cls, (text, reason))
        self.n = n
        return self


@pytest.fixture(scope="session")
def offline(triton_server):
    """Greedy reference outputs from the offline engine, same configuration as the server."""
    import torch

    from backend.engine.engine import Engine
    from backend.engine.config import EngineConfig
    from backend.sampling.params import SamplingParams

    threads = torch.get_num_threads()
    try:
        engine = Engine(EngineConfig.from_dict(dict(triton_server.engine_config)))
        conc = short_prompts(16)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        out = {}
        for prompts in (PROMPTS, conc):
            for p, c in zip(prompts, engine.generate(prompts, greedy, max_concurrency=1)):
                out[p] = Ref(c.text, c.finish_reason, len(c.output_ids))
        return out
    finally:
        torch.set_num_threads(threads)


def grpc(server, model="nightdraft", schema=None):
    return GrpcClient(server.grpc_url, model, schema=schema or ("ensemble" if model == "ensemble" else "vllm"),
                      timeout_s=T)


def http(server, model="nightdraft"):
    return HttpClient(server.http_url, model, schema="ensemble" if model == "ensemble" else "vllm", timeout_s=T)


def post(server, path: str, body: dict, timeout: float = T) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# ------------------------------------------------------------------------------ streaming


@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_stream_is_incremental_and_equals_offline_greedy(triton_server, offline, prompt):
    res = grpc(triton_server).generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    text, reason = offline[prompt]
    assert res.text == text
    assert res.finish_reason == reason
    pieces = [c for c in res.chunks if c.text]
    assert len(pieces) > 1, "the text arrived in one piece, not streamed"
    assert pieces[0].t < pieces[-1].t
    assert res.chunks[-1].finished
    assert res.num_output_tokens == offline[prompt].n


def test_a_kept_grpc_stream_serves_request_after_request(triton_server, offline):
    """keep_open: one channel and one stream for all of a client's requests (what bench serve's
    workers use); each request still gets exactly its own responses, and an error ends the
    stream so that the next request opens a fresh one."""
    client = GrpcClient(triton_server.grpc_url, keep_open=True)
    try:
        first = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
        channel = client._open[0]
        second = client.generate(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0)
        assert client._open[0] is channel, "the second request opened a new channel"
        assert (first.text, second.text) == (offline[PROMPTS[0]][0], offline[PROMPTS[1]][0])
        with pytest.raises(ClientError):
            client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=-1.0)
        assert client._open is None
        again = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
        assert again.text == offline[PROMPTS[0]][0]
    finally:
        client.close()


def test_bench_serve_opens_one_channel_per_worker(triton_server):
    import argparse

    from client.bench_serve import _add_args, run_bench
    p = argparse.ArgumentParser()
    _add_args(p)
    args = p.parse_args(["--url", triton_server.grpc_url, "--concurrency", "3", "--num-prompts", "9",
                         "--max-tokens", "8", "--no-progress", "--metrics-url", triton_server.metrics_url])
    summary = run_bench(args)
    assert summary["completed"] == 9 and summary["failed"] == 0
    assert summary["clients"] == 4, "a channel per request, not per worker (and one for the warm-up)"


@pytest.mark.parametrize("prompt", PROMPTS[:2] + PROMPTS[3:])
def test_http_generate_stream_is_incremental_and_equals_offline_greedy(triton_server, offline, prompt):
    res = collect(http(triton_server).stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0))
    text, reason = offline[prompt]
    assert res.text == text
    assert res.finish_reason == reason
    assert len([c for c in res.chunks if c.text]) > 1


def test_http_generate_returns_whole_text(triton_server, offline):
    prompt = PROMPTS[0]
    text, reason = offline[prompt]
    # vLLM-backend default for a non-streamed request: the prompt is prepended.
    res = http(triton_server).generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert res.text == prompt + text
    assert res.finish_reason == reason
    assert len(res.chunks) == 1
    res = http(triton_server).generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                       exclude_input_in_output=True)
    assert res.text == text
    # plain curl-style body, request parameters instead of tensors
    status, body = post(triton_server, "/v2/models/nightdraft/generate",
                        {"text_input": prompt, "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0.0}})
    assert status == 200, body
    assert json.loads(body)["text_output"] == prompt + text
    # genai-perf style: numbers as strings inside sampling_parameters
    status, body = post(triton_server, "/v2/models/nightdraft/generate",
                        {"text_input": prompt, "exclude_input_in_output": True,
                         "sampling_parameters": json.dumps({"max_tokens": str(MAX_TOKENS), "temperature": "0"})})
    assert status == 200, body
    assert json.loads(body)["text_output"] == text


def test_exclude_input_in_output_like_the_vllm_backend(triton_server, offline):
    prompt = PROMPTS[2]
    text, _ = offline[prompt]
    c = grpc(triton_server)
    # not streamed: prompt prepended unless excluded
    assert c.generate(prompt, stream=False, max_tokens=MAX_TOKENS, temperature=0.0).text == prompt + text
    assert c.generate(prompt, stream=False, max_tokens=MAX_TOKENS, temperature=0.0,
                      exclude_input_in_output=True).text == text
    # streamed: never includes the prompt; asking for it is an error
    assert c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0).text == text
    assert c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                      exclude_input_in_output=True).text == text
    with pytest.raises(ClientError, match="exclude_input_in_output"):
        c.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, exclude_input_in_output=False)


# ------------------------------------------------------------------------------ load, cancel


def test_concurrent_streams_finish_and_free_every_kv_block(triton_server, offline):
    prompts = short_prompts(16) + PROMPTS[:4]        # 20 concurrent streams
    client = grpc(triton_server)

    def one(i, p):
        c = client if i % 2 == 0 else http(triton_server)
        if isinstance(c, HttpClient):
            return collect(c.stream(p, max_tokens=MAX_TOKENS, temperature=0.0))
        return c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0)

    before = metrics(triton_server)
    done_before = sum(before[f"nightdraft_request_success_total{{finish_reason={r}}}"] for r in ("length", "stop"))
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts)), prompts, timeout=4 * T))
    for p, r in zip(prompts, results):
        assert (r.text, r.finish_reason) == offline[p], f"prompt {p[:40]!r}"
    wait_kv_free(triton_server, until=lambda m: sum(
        m[f"nightdraft_request_success_total{{finish_reason={r}}}"] for r in ("length", "stop"))
        >= done_before + len(prompts))


def test_cancelling_a_stream_frees_its_blocks_and_server_keeps_serving(triton_server, offline):
    before = metrics(triton_server)
    c = grpc(triton_server)
    got = 0
    t0 = time.monotonic()
    max_tokens = _context_len(triton_server) - 32
    for ch in c.stream(PROMPTS[0], max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                       sampling={"speculative": False}):   # slower: cannot finish before the cancel
        got += bool(ch.text)
        if got == 3:
            break          # closes the stream: the client cancels the request
    aborts = before["nightdraft_request_success_total{finish_reason=abort}"]
    m = wait_kv_free(triton_server, until=lambda m: m["nightdraft_request_success_total{finish_reason=abort}"] > aborts)
    assert time.monotonic() - t0 < 30
    assert m["nightdraft_request_success_total{finish_reason=abort}"] == \
        before["nightdraft_request_success_total{finish_reason=abort}"] + 1
    generated = m["nightdraft_generation_tokens_total"] - before["nightdraft_generation_tokens_total"]
    assert generated < max_tokens, "the cancelled request ran to the end"
    # and the server keeps serving
    res = c.generate(PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0)
    assert (res.text, res.finish_reason) == offline[PROMPTS[1]]


def _context_len(server) -> int:
    cfg = json.loads(Path(server.engine_config["target"], "config.json").read_text())
    return int(cfg["max_position_embeddings"])


def test_non_streamed_request_can_be_cancelled_too(triton_server):
    import tritonclient.grpc as grpcclient

    before = metrics(triton_server)
    max_tokens = _context_len(triton_server) - 16
    cl = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q = queue.SimpleQueue()
    cl.start_stream(callback=lambda result, error: q.put((result, error)))
    ins = []
    sp = {"max_tokens": max_tokens, "ignore_eos": True, "speculative": False}
    for name, val, dt in (("text_input", b"def f(x):", "BYTES"), ("stream", False, "BOOL"),
                          ("sampling_parameters", json.dumps(sp).encode(), "BYTES")):
        t = grpcclient.InferInput(name, [1], dt)
        t.set_data_from_numpy(np.array([val], dtype=np.object_ if dt == "BYTES" else bool))
        ins.append(t)
    cl.async_stream_infer("nightdraft", ins)
    deadline = time.monotonic() + 10
    while metrics(triton_server).get("nightdraft_num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.02)
    cl.stop_stream(cancel_requests=True)
    cl.close()
    aborts = before["nightdraft_request_success_total{finish_reason=abort}"]
    m = wait_kv_free(triton_server, until=lambda m: m["nightdraft_request_success_total{finish_reason=abort}"] > aborts)
    assert m["nightdraft_request_success_total{finish_reason=abort}"] == \
        before["nightdraft_request_success_total{finish_reason=abort}"] + 1
    assert m["nightdraft_generation_tokens_total"] - before["nightdraft_generation_tokens_total"] < max_tokens


# ------------------------------------------------------------------------------ bad input


def _grpc_raw(server, inputs: list[tuple[str, object, str]], model="nightdraft"):
    """:func:`stream_request` with inputs given as (name, value, datatype)."""
    import tritonclient.grpc as grpcclient

    ins = []
    for name, val, dt in inputs:
        arr = np.array([val], dtype=np.object_ if dt == "BYTES" else {"BOOL": bool, "INT32": np.int32}[dt])
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        ins.append(t)
    return stream_request(server, ins, model)


LONG_PROMPT = "x = 1\n" * 3000

BAD_INPUTS = {   # each with the words of its own reason, not words any refusal would contain
    "missing text_input": ([("stream", True, "BOOL")], "missing required input 'text_input'"),
    "empty text_input": ([("text_input", b"", "BYTES")], "input 'text_input' is empty"),
    "malformed JSON": ([("text_input", b"hi", "BYTES"), ("sampling_parameters", b"{max_tokens: 8", "BYTES")],
                       "sampling_parameters is not valid JSON"),
    "JSON not an object": ([("text_input", b"hi", "BYTES"), ("sampling_parameters", b"[1, 2]", "BYTES")],
                           "sampling_parameters must be a JSON object"),
    "unknown sampling parameter": ([("text_input", b"hi", "BYTES"),
                                    ("sampling_parameters", b'{"temperatur": 0.5}', "BYTES")],
                                   "unknown sampling parameter 'temperatur'"),
    "negative temperature": ([("text_input", b"hi", "BYTES"),
                              ("sampling_parameters", b'{"temperature": "-1"}', "BYTES")],
                             "temperature must be >= 0, got -1.0"),
    "top_p out of range": ([("text_input", b"hi", "BYTES"), ("sampling_parameters", b'{"top_p": 1.5}', "BYTES")],
                           "top_p must be in (0, 1], got 1.5"),
    "max_tokens zero": ([("text_input", b"hi", "BYTES"), ("max_tokens", 0, "INT32")],
                        "max_tokens must be an integer >= 1, got 0"),
    "max_tokens not a number": ([("text_input", b"hi", "BYTES"),
                                 ("sampling_parameters", b'{"max_tokens": "many"}', "BYTES")],
                                "max_tokens must be an integer, got 'many'"),
    "prompt longer than the context": ([("text_input", LONG_PROMPT.encode(), "BYTES")],
                                       "tokens; the context holds"),
    "streaming with the prompt": ([("text_input", b"hi", "BYTES"), ("stream", True, "BOOL"),
                                   ("exclude_input_in_output", False, "BOOL")],
                                  "When streaming, `exclude_input_in_output` = False is not allowed."),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_an_error_and_the_final_flag(triton_server, case):
    inputs, needle = BAD_INPUTS[case]
    responses, errors, closed = _grpc_raw(triton_server, inputs)
    assert errors, f"no error for {case}; responses: {responses}"
    assert needle.lower() in errors[0].lower(), errors[0]
    assert closed, "the stream did not close: no final flag"


def test_bad_inputs_do_not_disturb_requests_in_flight(triton_server):
    """A good stream is under way (its first response arrived) when the bad requests come, and
    still under way when the last of them has been answered; its output is plain decoding's."""
    import torch

    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine
    from backend.sampling.params import SamplingParams

    prompt, max_tokens = PROMPTS[1], 240     # long enough to outlast the bad requests (checked)
    threads = torch.get_num_threads()
    try:
        engine = Engine(EngineConfig.from_dict(dict(triton_server.engine_config)))
        want = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    finally:
        torch.set_num_threads(threads)
    started, ended = threading.Event(), threading.Event()

    def good_stream():
        try:
            chunks = []
            for chunk in grpc(triton_server).stream(prompt, max_tokens=max_tokens, temperature=0.0):
                chunks.append(chunk)
                started.set()
            return collect(iter(chunks))
        finally:
            ended.set()
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(good_stream)
        assert started.wait(T), "the good stream never produced a response"
        for case in ("malformed JSON", "prompt longer than the context", "unknown sampling parameter"):
            _, errors, closed = _grpc_raw(triton_server, BAD_INPUTS[case][0])
            assert errors and closed
        in_flight = not ended.is_set()
        res = good.result(timeout=T)
    assert in_flight, "the good stream ended before the bad requests did: nothing was in flight"
    assert (res.text, res.finish_reason) == (want.text, want.finish_reason)


def test_bad_input_over_http(triton_server):
    # missing required input: refused by the server itself over HTTP
    status, body = post(triton_server, "/v2/models/nightdraft/generate", {"parameters": {"max_tokens": 4}})
    assert status == 400 and b"text_input" in body
    status, body = post(triton_server, "/v2/models/nightdraft/generate",
                        {"text_input": "hi", "sampling_parameters": "{oops"})
    assert status == 400 and b"not valid JSON" in body
    # generate_stream answers the error as an event and then closes the stream
    with pytest.raises(ClientError, match=r"temperature must be >= 0, got -3\.0"):
        collect(http(triton_server).stream("hi", temperature=-3.0))
    with pytest.raises(ClientError, match="tokens; the context holds"):
        collect(http(triton_server).stream(LONG_PROMPT))


# ------------------------------------------------------------------------------ metrics


FAMILIES = [
    "nightdraft_time_to_first_token_seconds", "nightdraft_time_per_output_token_seconds",
    "nightdraft_e2e_request_latency_seconds", "nightdraft_prompt_tokens_total",
    "nightdraft_generation_tokens_total", "nightdraft_request_success_total",
    "nightdraft_num_requests_running", "nightdraft_num_requests_waiting",
    "nightdraft_kv_cache_usage_ratio", "nightdraft_kv_cache_free_blocks", "nightdraft_kv_cache_total_blocks",
    "nightdraft_spec_decode_draft_tokens_total", "nightdraft_spec_decode_accepted_tokens_total",
    "nightdraft_spec_decode_acceptance_rate", "nightdraft_spec_decode_gamma", "nightdraft_pipeline_mode",
    "nightdraft_drafter_state", "nightdraft_psd_overlap_ratio",
]


def test_metrics_endpoint_shows_custom_families_with_plausible_values(triton_server):
    c = grpc(triton_server)
    for p in PROMPTS[:2]:
        c.generate(p, max_tokens=MAX_TOKENS, temperature=1.0, seed=1)
    def settled(m):  # a scrape can fall between the updates of related metrics
        d = m.get("nightdraft_spec_decode_draft_tokens_total", 0)
        return (m.get("nightdraft_e2e_request_latency_seconds_count", 0) >= 2 and d > 0 and
                abs(m["nightdraft_spec_decode_acceptance_rate"]
                    - m["nightdraft_spec_decode_accepted_tokens_total"] / d) < 1e-9)
    m = wait_kv_free(triton_server, until=settled)
    with urllib.request.urlopen(triton_server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    for fam in FAMILIES:
        assert f"# TYPE {fam} " in text, f"family {fam} missing"
    assert "# TYPE nightdraft_time_to_first_token_seconds histogram" in text
    n = m["nightdraft_time_to_first_token_seconds_count"]
    assert n >= 2
    assert 0 < m["nightdraft_time_to_first_token_seconds_sum"] / n < 30
    assert m["nightdraft_time_per_output_token_seconds_count"] >= 2
    assert 0 < m["nightdraft_time_per_output_token_seconds_sum"] / m["nightdraft_time_per_output_token_seconds_count"] < 5
    assert m["nightdraft_e2e_request_latency_seconds_count"] >= n
    assert m["nightdraft_e2e_request_latency_seconds_bucket{le=+Inf}"] == m["nightdraft_e2e_request_latency_seconds_count"]
    assert m["nightdraft_prompt_tokens_total"] > 0
    assert m["nightdraft_generation_tokens_total"] >= 2
    assert m["nightdraft_kv_cache_total_blocks"] > 0 and m["nightdraft_kv_cache_usage_ratio"] == 0
    drafted = m["nightdraft_spec_decode_draft_tokens_total"]
    accepted = m["nightdraft_spec_decode_accepted_tokens_total"]
    assert drafted > 0 and 0 <= accepted <= drafted
    assert m["nightdraft_spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted, rel=1e-6)
    assert 0 <= m["nightdraft_spec_decode_gamma"] <= triton_server.engine_config.get("gamma_max", 8)
    assert m["nightdraft_pipeline_mode{mode=sd}"] == 1
    assert m["nightdraft_pipeline_mode{mode=ar}"] + m["nightdraft_pipeline_mode{mode=psd}"] == 0
    assert m["nightdraft_drafter_state{state=on_device}"] == 1
    assert 0 <= m["nightdraft_psd_overlap_ratio"] <= 1


# ------------------------------------------------------------------------------ ensemble


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ensemble_streams_the_same_text_as_the_direct_model(triton_server, offline, prompt):
    text, _ = offline[prompt]
    res = grpc(triton_server, "ensemble").generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert res.text == text
    assert len([c for c in res.chunks if c.text]) > 1, "the ensemble did not stream"
    res = collect(http(triton_server, "ensemble").stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0))
    assert res.text == text


def test_ensemble_non_streaming_and_its_tokens_model_frees_blocks(triton_server, offline):
    prompt = PROMPTS[2]
    text, _ = offline[prompt]
    res = http(triton_server, "ensemble").generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    assert res.text == text
    wait_kv_free(triton_server, "nightdraft_tokens")


# ------------------------------------------------------------------------------ perf_analyzer


@pytest.fixture(scope="module")
def perf_analyzer_bin() -> str:
    venv_pa = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "perf_analyzer"
    pa = os.environ.get("PERF_ANALYZER") or shutil.which("perf_analyzer") or (str(venv_pa) if venv_pa.exists() else None)
    if pa is None:
        pytest.skip("perf_analyzer binary not found (it comes with tritonclient[all]==2.51.0)")
    return pa


def test_perf_analyzer_short_streaming_run(triton_server, tmp_path, perf_analyzer_bin):
    script = REPO / "scripts" / "perf_analyzer.sh"
    export = tmp_path / "pa.json"
    export.write_text("")       # a previous run's export (or an empty one perf_analyzer left) is replaced
    env = dict(os.environ, PERF_ANALYZER=perf_analyzer_bin)

    def run():
        proc = subprocess.run(
            [str(script), "-u", triton_server.grpc_url, "-c", "2", "-n", "8", "-o", str(export), "--",
             "--measurement-mode", "count_windows", "--measurement-request-count", "8",
             "--max-trials", "3", "--stability-percentage", "999"],
            capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
        return proc, proc.stdout + proc.stderr
    proc, out = run()
    if "wrote no profile export" in out:     # perf_analyzer's own lapse (the script says so): once more
        proc, out = run()
    if proc.returncode == 3:
        pytest.skip(f"perf_analyzer cannot run here: {out.strip().splitlines()[-1]}")
    assert proc.returncode == 0, out[:2000] + "\n[...]\n" + out[-2000:]   # perf_analyzer's reason comes first, its usage after
    assert "Throughput" in out
    assert "TTFT" in out, out[-3000:]
    data = json.loads(export.read_text())
    reqs = data["experiments"][0]["requests"]
    assert reqs and all(len(r["response_timestamps"]) > 1 for r in reqs), "responses were not streamed"


def test_perf_analyzer_runs_again_with_a_longer_window_when_no_request_finished_in_it(
        triton_server, tmp_path, perf_analyzer_bin, monkeypatch, capsys):
    """The benchmarks' perf_analyzer driver: a window far shorter than one request (5 ms for 128
    tokens) records nothing; the driver doubles the window until requests finish inside it, and
    gives up with perf_analyzer's reason when its retries run out."""
    from types import SimpleNamespace

    from client.profile_server import NOTHING_RECORDED, drive_perf_analyzer
    monkeypatch.setenv("PERF_ANALYZER", perf_analyzer_bin)
    args = SimpleNamespace(json=str(tmp_path / "levels.json"), pa_window_s=0.005, max_tokens=128, temperature=0.0)
    with pytest.raises(RuntimeError, match=NOTHING_RECORDED):
        drive_perf_analyzer(triton_server.grpc_url, 1, args, retries=0)
    assert drive_perf_analyzer(triton_server.grpc_url, 1, args, retries=10) > 0
    err = capsys.readouterr().err
    assert "again with a 0.01 s window" in err
    assert (tmp_path / "levels.pa-c1.json").is_file(), "the successful run's export is kept"
    wait_kv_free(triton_server, "nightdraft")
