"""The Triton adapter (backend.serving) without a server: request parsing, responses through
execute and the response thread, metrics plumbing and the launcher's layout, against fakes of
``triton_python_backend_utils``."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from backend.engine.outputs import RequestOutput
from backend.sampling.params import InvalidRequest
from backend.serving.metrics import TritonMetrics, psd_overlap
from backend.serving.text_request import TextRequest
from backend.serving.token_request import TokenRequest


class FakeTensor:
    def __init__(self, name, value):
        self.name = name
        self._v = np.asarray(value)

    def as_numpy(self):
        return self._v


class FakeRequest:
    def __init__(self, tensors: dict, parameters: str = "{}"):
        self.tensors = {k: FakeTensor(k, v) for k, v in tensors.items()}
        self._params = parameters

    def parameters(self):
        return self._params


class FakePb:
    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.tensors.get(name)


def text(**kw):
    params = kw.pop("_params", "{}")
    t = {}
    for k, v in kw.items():
        if isinstance(v, str):
            v = np.array([v.encode()], dtype=np.object_)
        elif isinstance(v, bool):
            v = np.array([v])
        elif isinstance(v, int):
            v = np.array([v], dtype=np.int32)
        t[k] = v
    return TextRequest(FakePb, FakeRequest(t, params))


def test_text_request_defaults_follow_the_vllm_backend():
    p = text(text_input="hello")
    assert p.prompt == "hello" and not p.stream and p.prepend_input
    assert p.params.max_tokens == 16
    p = text(text_input="hello", stream=True)
    assert p.stream and not p.prepend_input
    p = text(text_input="hello", exclude_input_in_output=True)
    assert not p.prepend_input
    with pytest.raises(InvalidRequest, match="exclude_input_in_output"):
        text(text_input="hello", stream=True, exclude_input_in_output=False)


def test_sampling_sources_and_precedence():
    # request parameters < sampling_parameters < max_tokens tensor
    p = text(text_input="x", _params=json.dumps({"temperature": 0.5, "max_tokens": 3, "stream": True}),
             sampling_parameters=json.dumps({"temperature": "0", "top_k": "5", "max_tokens": "7"}))
    assert p.params.temperature == 0.0 and p.params.top_k == 5 and p.params.max_tokens == 7
    assert p.stream   # a flag from the request parameters
    p = text(text_input="x", sampling_parameters=json.dumps({"max_tokens": "7"}), max_tokens=9)
    assert p.params.max_tokens == 9
    p = text(text_input="x", sampling_parameters=json.dumps({"ignore_eos": False}), ignore_eos=True)
    assert p.params.ignore_eos   # genai-perf --extra-inputs ignore_eos:true
    p = text(text_input="x", _params=json.dumps({"return_finish_reason": "true"}), return_num_output_tokens=True)
    assert p.return_finish_reason and p.return_num_output_tokens and not p.return_num_input_tokens


@pytest.mark.parametrize("kw,needle", [
    ({}, "text_input"),
    ({"text_input": ""}, "empty"),
    ({"text_input": "x", "sampling_parameters": "{nope"}, "not valid JSON"),
    ({"text_input": "x", "sampling_parameters": "[1]"}, "JSON object"),
    ({"text_input": "x", "sampling_parameters": '{"temprature": 1}'}, "temprature"),
    ({"text_input": "x", "sampling_parameters": '{"top_p": 0}'}, "top_p"),
    ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "x", "_params": '{"stream": "sometimes"}'}, "stream"),
])
def test_bad_text_requests_name_the_problem(kw, needle):
    with pytest.raises(InvalidRequest, match=needle):
        text(**kw)


def test_text_input_must_be_utf8_and_single():
    with pytest.raises(InvalidRequest, match="UTF-8"):
        TextRequest(FakePb, FakeRequest({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}))
    with pytest.raises(InvalidRequest, match="exactly one"):
        TextRequest(FakePb, FakeRequest({"text_input": np.array([b"a", b"b"], dtype=np.object_)}))
    p = TextRequest(FakePb, FakeRequest({"text_input": np.array([[b"2-d"]], dtype=np.object_)}))
    assert p.prompt == "2-d"


def test_tokens_request():
    req = FakeRequest({"input_ids": np.array([5, 6, 7, 0], dtype=np.int32),
                       "input_lengths": np.array([3], dtype=np.int32),
                       "request_output_len": np.array([4], dtype=np.int32),
                       "streaming": np.array([True]),
                       "temperature": np.array([0.0], dtype=np.float32),
                       "random_seed": np.array([3], dtype=np.uint64)})
    p = TokenRequest(FakePb, req)
    assert p.prompt == [5, 6, 7] and p.stream
    assert p.params.max_tokens == 4 and p.params.temperature == 0.0 and p.params.seed == 3
    with pytest.raises(InvalidRequest, match="input_ids"):
        TokenRequest(FakePb, FakeRequest({}))
    with pytest.raises(InvalidRequest, match="empty"):
        TokenRequest(FakePb, FakeRequest({"input_ids": np.array([], dtype=np.int32)}))


@pytest.mark.parametrize("options", [{"skip_special_tokens": False}, {"spaces_between_special_tokens": False},
                                     {"prompt_logprobs": 2}])
def test_the_token_model_refuses_text_options_it_cannot_honour(options):
    import json
    req = FakeRequest({"input_ids": np.array([5, 6, 7], dtype=np.int32),
                       "sampling_parameters": np.array([json.dumps(options).encode()], dtype=np.object_)})
    with pytest.raises(InvalidRequest, match=next(iter(options))):
        TokenRequest(FakePb, req)


# ------------------------------------------------------------------------------ metrics


class FakeMetric:
    def __init__(self, fam, labels, buckets=None):
        self.fam, self.labels, self.buckets = fam, labels, buckets
        self.value = 0.0
        self.observed = []

    def increment(self, v):
        assert self.fam.kind == "COUNTER" and v >= 0
        self.value += v

    def set(self, v):
        assert self.fam.kind == "GAUGE"
        self.value = v

    def observe(self, v):
        assert self.fam.kind == "HISTOGRAM" and self.buckets
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"
    registry: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.registry[name] = self

    def Metric(self, labels, buckets=None):
        m = FakeMetric(self, labels, buckets)
        self.metrics.append(m)
        return m


class FakePbMetrics:
    MetricFamily = FakeFamily


def test_metrics_counters_follow_engine_totals_and_gauges_track_state():
    from backend.engine.outputs import EngineStats
    from backend.mode import Mode
    from backend.step import StepResult
    tm = TritonMetrics(FakePbMetrics, {"model": "m", "version": "1"}, min_update_interval_s=0.0)
    s = EngineStats(num_running=3, num_waiting=1, kv_total_blocks=100, kv_free_blocks=40, kv_usage=0.6,
                    mode="psd", gamma=4, drafter_state="on_device", prompt_tokens=50,
                    generation_tokens=20, drafted_tokens=16, accepted_tokens=12,
                    last_step=StepResult(mode=Mode.PSD, t_draft_s=0.01, t_verify_s=0.03, t_step_s=0.032))
    tm.update_from_stats(s, force=True)
    s.generation_tokens, s.drafted_tokens, s.accepted_tokens = 30, 24, 16
    tm.update_from_stats(s, force=True)
    m = tm.metrics
    assert m["generation_tokens"].value == 30 and m["prompt_tokens"].value == 50
    assert m["drafted"].value == 24 and m["accepted"].value == 16
    assert m["acceptance"].value == pytest.approx(16 / 24)
    assert m["running"].value == 3 and m["waiting"].value == 1 and m["kv_free"].value == 40
    assert m["mode:psd"].value == 1 and m["mode:sd"].value == 0
    assert m["drafter:on_device"].value == 1 and m["drafter:offloaded"].value == 0
    assert m["overlap"].value == pytest.approx((0.01 + 0.03 - 0.032) / 0.01)
    tm.observe_request(ttft_s=0.1, tpot_s=0.01, e2e_s=0.5, finish_reason="length")
    assert m["ttft"].observed == [0.1] and m["finished:length"].value == 1
    # every family a dashboard needs is registered
    for name in ("nightdraft_time_to_first_token_seconds", "nightdraft_time_per_output_token_seconds",
                 "nightdraft_e2e_request_latency_seconds", "nightdraft_kv_cache_usage_ratio",
                 "nightdraft_spec_decode_acceptance_rate", "nightdraft_pipeline_mode",
                 "nightdraft_drafter_state"):
        assert name in FakeFamily.registry


def test_metrics_updates_are_throttled_unless_forced():
    from backend.engine.outputs import EngineStats
    tm = TritonMetrics(FakePbMetrics, {"model": "m"}, min_update_interval_s=60.0)
    assert tm.update_from_stats(EngineStats(), force=True)
    assert not tm.update_from_stats(EngineStats(num_running=5))
    assert tm.metrics["running"].value == 0
    assert tm.update_from_stats(EngineStats(num_running=5), force=True)
    assert tm.metrics["running"].value == 5


def test_psd_overlap_is_zero_outside_psd():
    from backend.engine.outputs import EngineStats
    from backend.mode import Mode
    from backend.step import StepResult
    assert psd_overlap(EngineStats(last_step=StepResult(mode=Mode.SD, t_draft_s=1, t_verify_s=1, t_step_s=1))) == 0


# ------------------------------------------------------------------------------ launcher


def test_launcher_lays_out_a_python_backend_and_environment(tmp_path, monkeypatch):
    from client import launcher
    try:
        inst = launcher.find_tritonserver()
    except launcher.LauncherError as e:
        pytest.skip(str(e))
    if inst.source == "pytriton":
        assert (inst.backend_dir / "python" / "libtriton_python.so").is_file()
        stub = inst.backend_dir / "python" / "triton_python_backend_stub"
        assert stub.is_file() and os.access(stub, os.X_OK)
        assert any(p.name == "nvidia_pytriton.libs" for p in inst.lib_dirs)
    env = launcher.server_env(inst, {"PATH": "/usr/bin"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.prefix) / "bin")
    assert Path(env["NIGHTDRAFT_ROOT"], "backend", "__init__.py").is_file()
    if inst.source == "pytriton":
        assert all(str(p) in env["LD_LIBRARY_PATH"] for p in inst.lib_dirs)
    srv = launcher.TritonServer(tmp_path, http_port=1, grpc_port=2, metrics_port=3, host="127.0.0.1")
    cmd = srv.command()
    assert f"--model-repository={tmp_path.resolve()}" in cmd and "--http-port=1" in cmd
    assert srv.metrics_url == "http://127.0.0.1:3/metrics"


def test_the_backend_runs_the_checkout_nightdraft_root_names_ahead_of_an_installed_copy(tmp_path):
    """The server runs the code of the tree that started it (the launcher sets NIGHTDRAFT_ROOT
    to it), even where another checkout is installed in the stub's environment: otherwise a
    benchmark run from a second checkout would measure the installed code on the server side."""
    import subprocess
    from client.backend_dir import BACKEND_MODEL
    other = tmp_path / "checkout"
    (other / "backend" / "serving").mkdir(parents=True)
    (other / "backend" / "__init__.py").write_text("")
    (other / "backend" / "serving" / "__init__.py").write_text("")
    (other / "backend" / "serving" / "python_backend.py").write_text(
        "def backend_model(pb):\n    return 'the other checkout'\n")
    stub_utils = tmp_path / "stub"
    stub_utils.mkdir()
    (stub_utils / "triton_python_backend_utils.py").write_text("")
    code = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); "
            "print(runpy.run_path(sys.argv[2])['TritonPythonModel'])")
    run = subprocess.run([sys.executable, "-c", code, str(stub_utils), str(BACKEND_MODEL)], capture_output=True,
                         text=True, env=os.environ | {"NIGHTDRAFT_ROOT": str(other)}, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "the other checkout"
    # without it, the installed package (this checkout, in the test's environment)
    env = {k: v for k, v in os.environ.items() if k != "NIGHTDRAFT_ROOT"}
    run = subprocess.run([sys.executable, "-c", code, str(stub_utils), str(BACKEND_MODEL)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0 and "the other checkout" not in run.stdout, run.stderr[-2000:]


def test_launcher_refuses_a_missing_binary(tmp_path):
    from client import launcher
    with pytest.raises(launcher.LauncherError, match="not an executable"):
        launcher.find_tritonserver(tmp_path / "nope")


def test_cli_parsers_wire_up():
    import argparse

    from client.bench_serve import add_bench_serve_parser
    from client.launcher import add_serve_parser, serve_main
    from client.triton_client import add_complete_parser, complete_main
    from client.bench_serve import bench_serve_main
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    add_serve_parser(sub)
    add_complete_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command")
    add_bench_serve_parser(bench)
    a = p.parse_args(["serve", "--http-port", "9000"])
    assert a.func is serve_main and a.http_port == 9000
    a = p.parse_args(["complete", "hi", "--protocol", "http", "--max-tokens", "5", "--no-stream"])
    assert a.func is complete_main and a.protocol == "http" and not a.stream
    a = p.parse_args(["bench", "serve", "--request-rate", "4", "--num-prompts", "8", "--json", "x.json"])
    assert a.func is bench_serve_main and a.request_rate == 4
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "serve", "--request-rate", "4", "--concurrency", "2"])


def test_metrics_export_drafter_health_and_psd_counters():
    from backend.engine.outputs import EngineStats
    tm = TritonMetrics(FakePbMetrics, {"model": "m"}, min_update_interval_s=0.0)
    s = EngineStats(drafter_state="restarting", drafter_failures=2, drafter_restarts=1, psd_steps=10,
                    psd_overlapped_steps=7)
    tm.update_from_stats(s, force=True)
    assert tm.metrics["drafter:restarting"].value == 1 and tm.metrics["drafter:on_device"].value == 0
    assert tm.metrics["psd_steps"].value == 10 and tm.metrics["psd_overlapped_steps"].value == 7
    assert tm.metrics["drafter_failures"].value == 2 and tm.metrics["drafter_restarts"].value == 1


def test_queued_outputs_of_a_request_are_merged_in_order():
    from backend.engine.outputs import RequestOutput
    from backend.serving.responses import coalesce
    a1 = RequestOutput("a", [1], "x")
    b1 = RequestOutput("b", [7], "p")
    a2 = RequestOutput("a", [2, 3], "yz", num_output_tokens=3)
    b2 = RequestOutput("b", [8], "q", finished=True, finish_reason="length", num_output_tokens=2)
    a3 = RequestOutput("a", [], "", finished=True, finish_reason="stop", num_output_tokens=3)
    merged = coalesce([a1, b1, a2, b2, a3])
    assert [(o.request_id, o.new_token_ids, o.new_text, o.finished, first) for o, first in merged] == [
        ("a", [1, 2, 3], "xyz", True, 0), ("b", [7, 8], "pq", True, 1)]
    assert merged[0][0].finish_reason == "stop" and merged[0][0].num_output_tokens == 3
    assert merged[1][0].finish_reason == "length"
    assert coalesce([]) == []
    # a single output per request passes through untouched
    assert coalesce([a1, b1]) == [(a1, 0), (b1, 1)]


# ------------------------------------------------------------------------------ the adapter, end to end


class FakeError:
    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "CANCELLED", "INTERNAL"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class FakePbFull(FakePb):
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    TritonError = FakeError

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.tensors = {t.name: t.array for t in output_tensors}
            self.error = error


class FakeSender:
    """As Triton's Python backend's response sender, which frees the request's response factory
    with the final flag: a question about cancellation after it is counted (the real server
    reads freed memory there and crashes)."""

    def __init__(self):
        self.sent = []          # (response or None, flags)
        self.cancelled = False
        self.asked_after_final = 0

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        if self.finals():
            self.asked_after_final += 1
        return self.cancelled

    def finals(self):
        return [r for r, f in self.sent if f == FakePbFull.TRITONSERVER_RESPONSE_COMPLETE_FINAL]


class FakeServedRequest(FakeRequest):
    def __init__(self, tensors, parameters="{}"):
        super().__init__(tensors, parameters)
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return "client-1"


class ScriptedLoop:
    """An engine loop that answers each request at once with the outputs `script(prompt)` gives."""

    def __init__(self, script):
        self.script, self.aborted, self.healthy, self.num_inflight = script, [], True, 0

    def submit(self, request_id, prompt, params, callback):
        for new_ids, text, finished, reason in self.script(prompt, params):
            callback(RequestOutput(request_id, list(new_ids), text, finished=finished, finish_reason=reason,
                                   num_prompt_tokens=2, num_output_tokens=3 if finished else 0))

    def abort(self, request_id):
        self.aborted.append(request_id)


def served_model(request_class, script, *, pb=None, loop=None, metrics=None):
    """A generation model with its threads and a scripted loop instead of an engine."""
    import threading
    from types import SimpleNamespace

    from backend.serving.model import generation_model
    from backend.serving.request import InflightRequests
    from backend.serving.responses import ResponseThread
    pb = pb or FakePbFull
    model = generation_model(pb, request_class)()
    model.model_name, model.metrics = "m", metrics
    model.inflight, model.loop = InflightRequests(), loop or ScriptedLoop(script)
    model.drain = SimpleNamespace(served=threading.Event())
    model.responses = ResponseThread(pb, "m", loop=model.loop, inflight=model.inflight, metrics=metrics,
                                     abort_message=lambda: ("stopping", "UNAVAILABLE"))
    return model


def run(model, *requests):
    model.execute(list(requests))
    model.responses.stop()
    return [r.sender for r in requests]



def test_a_streamed_text_request_through_execute_and_the_response_thread():
    def script(prompt, params):
        return [([5], "he", False, None), ([6], "", False, None), ([7], "llo", True, "length")]
    model = served_model(TextRequest, script)
    req = FakeServedRequest({"text_input": np.array([b"hi"], dtype=np.object_), "stream": np.array([True]),
                             "return_num_output_tokens": np.array([True]),
                             "return_finish_reason": np.array([True])})
    (sender,) = run(model, req)
    texts = [r.tensors["text_output"][0].decode() for r, _ in sender.sent]
    assert "".join(texts) == "hello"                    # deltas, whatever the thread merged
    assert sum(int(r.tensors["num_output_tokens"][0]) for r, _ in sender.sent) == 3
    assert len(sender.finals()) == 1 and sender.sent[-1][1] == 1, "exactly one final flag, last"
    assert sender.sent[-1][0].tensors["finish_reason"][0] == b"length"
    assert len(model.inflight) == 0


def test_a_whole_text_answer_starts_with_the_prompt():
    model = served_model(TextRequest, lambda p, _: [([5], " wor", False, None), ([6], "ld", True, "stop")])
    (sender,) = run(model, FakeServedRequest({"text_input": np.array([b"hello"], dtype=np.object_)}))
    assert [f for _, f in sender.sent] == [1]
    assert sender.sent[0][0].tensors["text_output"][0] == b"hello world"


def test_token_windows_carry_what_was_sent_before():
    script = lambda p, _: [([1, 2], "ab", False, None), ([3], "", False, None), ([4], "c", True, "length")]
    model = served_model(TokenRequest, script)
    streamed = FakeServedRequest({"input_ids": np.array([9, 9], dtype=np.int32), "streaming": np.array([True])})
    whole = FakeServedRequest({"input_ids": np.array([9, 9], dtype=np.int32)})
    s1, s2 = run(model, streamed, whole)
    new = []
    for r, _ in s1.sent:
        window, offset = list(r.tensors["output_ids"]), int(r.tensors["output_offset"][0])
        new += window[offset:]
    assert new == [1, 2, 3, 4] and len(s1.finals()) == 1
    (final,) = [r for r, _ in s2.sent]
    assert list(final.tensors["output_ids"]) == [1, 2, 3, 4] and int(final.tensors["output_offset"][0]) == 0


def test_bad_and_refused_requests_get_an_error_and_the_final_flag():
    from backend.errors import ServerBusy

    def script(prompt, params):
        if prompt == "busy":
            raise ServerBusy("server busy: retry later")
        if prompt == "boom":
            raise RuntimeError("a bug")
        return [([], "", True, "error")]
    model = served_model(TextRequest, script)
    reqs = [FakeServedRequest({}), FakeServedRequest({"text_input": np.array([b"busy"], dtype=np.object_)}),
            FakeServedRequest({"text_input": np.array([b"boom"], dtype=np.object_)}),
            FakeServedRequest({"text_input": np.array([b"x"], dtype=np.object_)})]
    senders = run(model, *reqs)
    errors = [[(r.error.message, r.error.code) for r, _ in s.sent] for s in senders]
    assert errors == [[("missing required input 'text_input'", "INVALID_ARG")],
                      [("server busy: retry later", "UNAVAILABLE")],
                      [("internal error: RuntimeError: a bug", "INTERNAL")],
                      [("internal engine error", "INTERNAL")]]
    assert all(len(s.finals()) == 1 for s in senders) and len(model.inflight) == 0


def test_the_error_builder_serves_stubs_without_error_codes():
    from backend.serving.responses import error_response

    class OldError:
        def __init__(self, message):
            self.message = message

    class OldPb(FakePbFull):
        TritonError = OldError
    r = error_response(OldPb, "no code here", "INVALID_ARG")
    assert r.error.message == "no code here" and r.tensors == {}
    assert error_response(FakePbFull, "x", "CANCELLED").error.code == "CANCELLED"


def fake_model_args(tmp_path, **params):
    from backend.serving.config import ModelArgs

    class Pb:
        class TritonModelException(Exception):
            pass
    config = {"name": "m", "parameters": {k: {"string_value": v} for k, v in params.items()}}
    return ModelArgs(Pb, {"model_config": json.dumps(config), "model_version": "1",
                          "model_repository": str(tmp_path)}), Pb


def test_the_metrics_scraper_is_a_model_parameter_of_mode_auto(tmp_path):
    from backend.serving.planner_io import server_signals
    margs, _ = fake_model_args(tmp_path, metrics_url="")
    assert server_signals(margs, "auto") is None                      # empty = off
    margs, pb = fake_model_args(tmp_path, metrics_url="localhost:8002/metrics")
    with pytest.raises(pb.TritonModelException, match="metrics_url must be an http"):
        server_signals(margs, "auto")
    margs, _ = fake_model_args(tmp_path, metrics_url="http://127.0.0.1:9/metrics")
    assert server_signals(margs, "sd") is None                        # only the planner reads it
    scraper = server_signals(margs, "auto")
    try:
        assert scraper.url == "http://127.0.0.1:9/metrics" and callable(scraper.merge)
    finally:
        scraper.close()


def test_the_planner_summary_is_exported_as_a_file(tmp_path):
    from backend.serving.planner_io import SUMMARY_FILE, export_summary

    from planner import AR, LoadSignals, Planner, PlannerConfig, StepOutcome
    planner = Planner(PlannerConfig(modes=("ar", "sd")), gamma_max=2, psd_available=False)
    for step in range(3):
        planner.decide(LoadSignals(batch_size=4, now=0.01 * step))
        planner.observe(AR, StepOutcome(step_wall_s=0.004, tokens_committed=4, batch_size=4))
    margs, _ = fake_model_args(tmp_path, **{SUMMARY_FILE: "out/summary.json"})
    path = margs.path(SUMMARY_FILE)
    assert path == tmp_path / "1" / "out" / "summary.json"           # relative to the version dir
    export_summary("m", planner, path)
    written = json.loads(path.read_text())
    assert written["steps"] == 3 and written["arm_counts"]["ar"] >= 1   # the summary's counters ...
    assert written.keys() >= planner.summary().keys()
    per_bin = written["per_context"]                                      # ... and what each arm measured
    assert any("ar" in b["mean_loss"] for b in per_bin.values()), per_bin
    assert fake_model_args(tmp_path)[0].path(SUMMARY_FILE) is None     # unset: no file


def test_the_benchmark_sets_the_summary_file_in_its_repository(tmp_path):
    from client.dynamic_server import planner_summary_path, read_planner_summary, set_model_parameter, write_repository
    repo = write_repository(tmp_path, {"target": "t"})
    pbtxt = (repo / "nightdraft" / "config.pbtxt").read_text()
    assert f'string_value: "{planner_summary_path(repo).resolve()}"' in pbtxt
    assert pbtxt.count('key: "planner_summary_file"') == 1
    assert sorted(p.name for p in (repo / "nightdraft").rglob("*") if p.is_file()) == ["config.pbtxt", "engine.json"]
    assert read_planner_summary(repo) == {}
    assert 'key: "x"\n  value: { string_value: "y" }' in set_model_parameter("name: \"m\"\n", "x", "y")


# ------------------------------------------------------------------ races and failures


def test_the_response_thread_outlives_failures_and_every_client_gets_its_final_flag():
    """An error response that cannot be built, or metrics that raise, must not end the response
    thread: the request at fault still gets its final flag, and every other request is served."""

    class BrokenError(FakeError):
        def __init__(self, message, code=None):
            if message.startswith("internal"):
                raise RuntimeError("the stub refused the error")
            super().__init__(message, code)

    class BrokenPb(FakePbFull):
        TritonError = BrokenError

    class RaisingMetrics:
        def __getattr__(self, name):
            def fail(*args, **kw):
                raise RuntimeError(f"metrics.{name} failed (an IPC call)")
            return fail

    def script(prompt, params):
        if prompt == "fails":
            return [([], "", True, "error")]      # its error response cannot be built
        return [([5], "o", False, None), ([6], "k", True, "length")]
    for pb, metrics in ((BrokenPb, None), (FakePbFull, RaisingMetrics())):
        model = served_model(TextRequest, script, pb=pb, metrics=metrics)
        reqs = [FakeServedRequest({"text_input": np.array([p], dtype=np.object_)})
                for p in (b"fails", b"hi", b"fails", b"there")]
        senders = run(model, *reqs)
        assert all(len(s.finals()) == 1 for s in senders), [s.sent for s in senders]
        for s, prompt in zip(senders, (None, "hi", None, "there")):
            if prompt is not None:
                assert s.sent[-1][0].tensors["text_output"][0] == f"{prompt}ok".encode()
        assert len(model.inflight) == 0


def test_a_cancellation_while_the_request_is_tokenized_still_aborts_it():
    """The client cancels while ``submit`` tokenizes the prompt: the response thread's abort goes
    to an id the engine does not know yet (ignored, as EngineLoop does); the request must still
    be aborted once submit has registered it."""
    import threading
    import time

    from backend.serving.responses import CANCEL_POLL_S

    class TokenizingLoop:
        healthy, num_inflight = True, 0

        def __init__(self):
            self.known, self.aborted, self.callbacks = set(), [], {}
            self.lock = threading.Lock()

        def submit(self, request_id, prompt, params, callback):
            time.sleep(6 * CANCEL_POLL_S)     # tokenizing, while the response thread polls
            with self.lock:
                self.known.add(request_id)
                self.callbacks[request_id] = callback

        def abort(self, request_id):
            with self.lock:
                if request_id not in self.known:
                    return                     # unknown ids are ignored
                self.aborted.append(request_id)
                callback = self.callbacks.pop(request_id, None)
            if callback is not None:
                callback(RequestOutput(request_id, [], "", finished=True, finish_reason="abort"))

    loop = TokenizingLoop()
    model = served_model(TextRequest, None, loop=loop)
    req = FakeServedRequest({"text_input": np.array([b"a long prompt"], dtype=np.object_)})
    req.sender.cancelled = True
    model.execute([req])
    deadline = time.monotonic() + 5
    while not req.sender.finals() and time.monotonic() < deadline:
        time.sleep(0.01)
    model.responses.stop()
    assert len(loop.aborted) == 1, "the cancellation was lost: the request runs on"
    (final,) = req.sender.finals()
    assert (final.error.message, final.error.code) == ("request cancelled by the client", "CANCELLED")


def test_a_request_refused_inside_submit_is_not_asked_about_cancellation_after_its_final_flag():
    """Admission fails inside ``submit`` (the prompt is too long once tokenized) while the
    response thread polls the requests in flight, this one among them: execute sends its error
    with the final flag, and the poll must not ask its sender about cancellation afterwards
    (Triton frees the response factory with the final flag; the question crashed tritonserver
    under the soak)."""
    import threading

    in_submit, asking, answered = threading.Event(), threading.Event(), threading.Event()

    class SlowSender(FakeSender):
        def is_cancelled(self):          # the running request's question takes a while
            asking.set()
            answered.wait(5)
            return super().is_cancelled()

    class RefusingLoop(ScriptedLoop):
        def submit(self, request_id, prompt, params, callback):
            if prompt != "too long":
                return super().submit(request_id, prompt, params, callback)
            in_submit.set()
            asking.wait(5)                # refused while the poll asks about the running one
            raise InvalidRequest("the prompt has 2000 tokens; the context holds 1024")

    model = served_model(TextRequest, None, loop=RefusingLoop(lambda p, _: []))
    model.responses.stop()               # the poll runs below, at the moment that matters
    running = FakeServedRequest({"text_input": np.array([b"running"], dtype=np.object_)})
    running.sender = SlowSender()
    refused = FakeServedRequest({"text_input": np.array([b"too long"], dtype=np.object_)})
    model.execute([running])

    def execute_then_answer():
        model.execute([refused])
        answered.set()
    t = threading.Thread(target=execute_then_answer)
    t.start()
    assert in_submit.wait(5)
    model.responses.poll_cancelled()     # both in flight when it starts; the running one first
    t.join(5)
    assert answered.is_set() and asking.is_set()
    (final,) = refused.sender.finals()
    assert final.error.code == "INVALID_ARG"
    assert refused.sender.asked_after_final == 0, "asked about cancellation after its final flag"
    assert [r.request for r in model.inflight.watched()] == [running]


def test_a_client_request_id_is_logged_escaped():
    """A newline in the client's request id must not start a log line of its own."""
    import logging
    import time

    class IdRequest(FakeServedRequest):
        def request_id(self):
            return "abc\nE1202 00:00:00.000000 1 forged.cc:1] forged line"

    req = IdRequest({"text_input": np.array([b"hi"], dtype=np.object_)})
    loop = ScriptedLoop(lambda p, _: [([5], "x", False, None)])
    model = served_model(TextRequest, None, loop=loop)
    req.sender.cancelled = True
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("nightdraft.triton")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model.execute([req])
        deadline = time.monotonic() + 5
        while not loop.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        model.responses.stop()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [line for rec in records if "cancelled by the client" in rec.getMessage()
             for line in rec.getMessage().splitlines()]
    assert lines and not any(line.startswith("E1202") for line in lines), lines
    assert "abc\\nE1202" in lines[0]


def test_logprobs_are_strict_json():
    """Alternatives the processed distribution rules out (beyond top_k) have logprob -inf: they
    are sent as -9999.0, since strict JSON has no -Infinity."""
    from backend.engine.outputs import TokenLogprob

    req = text(text_input="hi", sampling_parameters=json.dumps({"logprobs": 3}), return_logprobs=True)
    req.pb, req.token_text = FakePbFull, lambda t: f"<{t}>"
    lp = TokenLogprob(token=7, logprob=-0.5, rank=1, top=[(7, -0.5), (8, -1.0), (9, float("-inf"))])
    out = RequestOutput(req.id, [7], "x", finished=True, finish_reason="length", logprobs=[lp],
                        num_prompt_tokens=1, num_output_tokens=1)
    req.track(out, 0.0, 0.0)
    raw = req.final_response(out).tensors["logprobs"][0].decode()

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    (entry,) = json.loads(raw, parse_constant=refuse)
    assert entry["9"]["logprob"] == -9999.0 and entry["7"]["logprob"] == -0.5
