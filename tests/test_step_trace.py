"""NIGHTDRAFT_STEP_TRACE: every engine step as a line of JSON, in process and from inside a real
tritonserver's stub, and the script that sums the lines up."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from backend.engine import step_trace
from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from model_factory import TINY_DRAFTER, TINY_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import step_trace_summary  # noqa: E402

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n"]


def read_lines(folder: Path) -> tuple[list[Path], list[dict]]:
    files = sorted(folder.glob("steps-*.jsonl"))
    return files, [json.loads(line) for f in files for line in f.read_text().splitlines()]


def test_every_busy_step_is_written_in_batches_and_the_rest_when_the_engine_closes(tmp_path, monkeypatch):
    monkeypatch.setenv(step_trace.VARIABLE, str(tmp_path / "trace"))
    monkeypatch.setattr(step_trace.StepTrace, "FLUSH_EVERY", 5)
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, num_threads=1))
    steps = []
    try:
        done = engine.generate(PROMPTS, PARAMS, on_step=lambda _: steps.append(engine.stats().last_step))
        files, before_close = read_lines(tmp_path / "trace")
        assert [f.name for f in files] == [f"steps-{os.getpid()}.jsonl"]
        assert len(before_close) == len(steps) // 5 * 5, "not flushed in batches of FLUSH_EVERY"
    finally:
        engine.close()
    _, lines = read_lines(tmp_path / "trace")
    assert len(lines) == len(steps)
    assert [(x["batch_size"], x["tokens_committed"], x["t_cycle_s"]) for x in lines] == \
        [(s.batch_size, s.tokens_committed, s.t_cycle_s) for s in steps]
    assert sum(x["tokens_committed"] for x in lines) == sum(len(c.output_ids) for c in done)
    assert {x["mode"] for x in lines} == {"ar"} and all(x["threads"] == 1 for x in lines)
    assert {x["pid"] for x in lines} == {os.getpid()}
    assert all(x["cores"] == sorted(os.sched_getaffinity(0)) for x in lines)

    rows = step_trace_summary.summarize(lines)
    decoding = [x for x in lines if x["num_forward_tokens"] > x["num_prefill_tokens"]]
    assert decoding and sum(r["steps"] for r in rows) == len(decoding)
    assert {(r["mode"], r["placement"]) for r in rows} == {("ar", "none")}
    for r in rows:       # each row's median batch lies in its bucket, its context is the prompts' and more
        lo, _, hi = r["batch"].partition("-")
        assert int(lo) <= r["batch_median"] <= int(hi or lo) and r["context_per_seq"] > 1
    assert step_trace_summary.main([str(tmp_path / "trace"), "--json", str(tmp_path / "rows.json")]) == 0
    assert json.loads((tmp_path / "rows.json").read_text()) == rows


def test_a_trace_written_before_lines_named_their_process_and_engine_is_still_summed_up(tmp_path):
    """Lines of an older trace have no `pid` and no `engine`: the file's name gives the process."""
    line = {"mode": "ar", "placement": "none", "batch_size": 2, "num_forward_tokens": 2,
            "num_prefill_tokens": 0, "num_context_tokens": 40, "tokens_committed": 2, "t_cycle_s": 0.004,
            "t_forward_s": 0.003, "threads": 1, "cores": [0]}
    (tmp_path / "steps-4242.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(line) + "\n")
    (row,) = step_trace_summary.summarize(step_trace_summary.read([tmp_path]))
    assert (row["pid"], row["engine"], row["steps"]) == (4242, 0, 2)


def test_the_engines_one_process_builds_are_told_apart_in_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv(step_trace.VARIABLE, str(tmp_path))
    built = []
    for prompts in (PROMPTS[:1], PROMPTS):
        engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, num_threads=1))
        try:
            steps = []
            engine.generate(prompts, PARAMS, on_step=lambda _: steps.append(engine.stats().last_step))
            built.append((engine._trace.engine, steps))
        finally:
            engine.close()
    (first, first_steps), (second, second_steps) = built
    assert second == first + 1
    files, lines = read_lines(tmp_path)
    assert len(files) == 1
    assert [x["engine"] for x in lines] == [first] * len(first_steps) + [second] * len(second_steps)
    rows = step_trace_summary.summarize(lines)
    assert {r["engine"] for r in rows} == {first, second}
    assert max(r["batch"] for r in rows if r["engine"] == first) == "1"


def test_a_folder_that_cannot_be_made_is_named_and_a_failed_write_ends_the_trace_not_the_step(
        tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(step_trace.VARIABLE, str(blocker / "trace"))
    with pytest.raises(ValueError, match=step_trace.VARIABLE):
        Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, num_threads=1))

    monkeypatch.setenv(step_trace.VARIABLE, str(tmp_path / "trace"))
    monkeypatch.setattr(step_trace.StepTrace, "FLUSH_EVERY", 2)
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, num_threads=1))
    try:
        engine._trace.path = tmp_path / "missing" / "steps.jsonl"      # its folder is gone: every write fails
        done = engine.generate(PROMPTS, PARAMS)
    finally:
        engine.close()
    assert [len(c.output_ids) for c in done] == [PARAMS.max_tokens] * len(PROMPTS)
    assert "tracing no more steps" in caplog.text


def test_no_file_is_written_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(step_trace.VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, num_threads=1))
    try:
        engine.generate(PROMPTS[:1], PARAMS)
        assert engine._trace is None
    finally:
        engine.close()
    assert list(tmp_path.rglob("steps-*.jsonl")) == []


@pytest.mark.slow
def test_a_tritonserver_started_with_the_variable_traces_its_engine_steps(tmp_path, monkeypatch):
    """The variable reaches the engine inside the server's Python stub (a process of its own),
    whose speculative steps are written before the server exits; summed up with another
    process's trace in the same folder, the two stay apart."""
    from conftest import nightdraft_only_server, test_engine_config
    from client.triton_client import GrpcClient

    trace = tmp_path / "trace"
    with nightdraft_only_server(tmp_path, test_engine_config(),
                                env=dict(os.environ, **{step_trace.VARIABLE: str(trace)})) as server:
        client = GrpcClient(server.grpc_url)
        results = [client.generate(p, max_tokens=PARAMS.max_tokens, temperature=0.0, ignore_eos=True)
                   for p in PROMPTS[:2]]
    files, lines = read_lines(trace)
    assert files and all(f.name != f"steps-{os.getpid()}.jsonl" for f in files)
    assert sum(x["tokens_committed"] for x in lines) == PARAMS.max_tokens * len(results)
    assert any(x["mode"] == "sd" and x["drafted"] > 0 for x in lines)
    stubs = {x["pid"] for x in lines}
    assert stubs == {int(f.stem.removeprefix("steps-")) for f in files} and os.getpid() not in stubs

    # Another process's engine number 0, running what the stub ran (SD, one sequence, no
    # placement): only the process tells their rows apart.
    monkeypatch.setenv(step_trace.VARIABLE, str(trace))
    monkeypatch.setattr(step_trace.StepTrace, "_engines", 0)
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="sd", gamma=4,
                                 kv_cache_bytes=16 << 20, num_threads=1))
    try:
        engine.generate(PROMPTS[:1], PARAMS)
    finally:
        engine.close()
    everything = step_trace_summary.read([trace])
    rows = step_trace_summary.summarize(everything)
    assert {r["pid"] for r in rows} == stubs | {os.getpid()}
    for pid in stubs | {os.getpid()}:
        decoded = [x for x in everything if x["pid"] == pid and x["num_forward_tokens"] > x["num_prefill_tokens"]]
        assert sum(r["steps"] for r in rows if r["pid"] == pid) == len(decoded)
