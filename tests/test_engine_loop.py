"""The background engine loop, against a scripted fake engine (no Triton, no model)."""
from __future__ import annotations

import threading
import time

import pytest

from backend.engine.loop import EngineLoop, EngineLoopError
from backend.engine.outputs import RequestOutput
from backend.sampling.params import InvalidRequest, SamplingParams

TIMEOUT = 10.0


class FakeEngine:
    """One token per request per step; token i of a request is the text f"t{i} "."""

    def __init__(self, step_delay: float = 0.0):
        self.lock = threading.Lock()
        self.reqs: dict[str, dict] = {}
        self.aborted: set[str] = set()
        self.step_delay = step_delay
        self.fail_next: list[Exception] = []   # step() raises these first, one per call
        self.fail_always: Exception | None = None
        self.drop_silently: set[str] = set()   # requests that vanish without a final output
        self.steps = 0
        self.step_threads: set[str] = set()
        self.gate = threading.Event()          # step() waits here; tests close it to line requests up
        self.gate.set()

    def prepare(self, request_id, prompt, params):
        if not prompt:
            raise InvalidRequest("prompt is empty")
        return request_id, prompt, params

    def enqueue(self, prepared):
        request_id, prompt, params = prepared
        with self.lock:
            if request_id in self.reqs:
                raise InvalidRequest(f"duplicate request id {request_id!r}")
            self.reqs[request_id] = {"n": 0, "max": params.max_tokens, "prompt": prompt}

    def abort(self, request_id):
        with self.lock:
            if request_id in self.reqs:
                self.aborted.add(request_id)

    def has_unfinished(self):
        with self.lock:
            return bool(self.reqs)

    background_polls_left = 0             # polls until work under way outside the steps ends
    background_polls = 0

    def background_pending(self):
        return self.background_polls_left > 0

    def poll_background(self):
        self.background_polls += 1
        self.background_polls_left = max(self.background_polls_left - 1, 0)

    def step(self):
        self.step_threads.add(threading.current_thread().name)
        self.steps += 1
        assert self.gate.wait(TIMEOUT)
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_next:
            raise self.fail_next.pop(0)
        if self.fail_always is not None:
            raise self.fail_always
        outs = []
        with self.lock:
            for rid, r in list(self.reqs.items()):
                if rid in self.drop_silently:
                    del self.reqs[rid]
                    continue
                if rid in self.aborted:
                    del self.reqs[rid]
                    self.aborted.discard(rid)
                    outs.append(RequestOutput(rid, [], "", True, "abort", 1, r["n"]))
                    continue
                r["n"] += 1
                done = r["n"] >= r["max"]
                outs.append(RequestOutput(rid, [r["n"]], f"t{r['n']} ", done,
                                          "length" if done else None, 1, r["n"]))
                if done:
                    del self.reqs[rid]
        return outs


class Collector:
    def __init__(self):
        self.outputs: list[RequestOutput] = []
        self.done = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, out: RequestOutput):
        # Runs on the loop thread, which logs and swallows a callback's exception: record,
        # and let `final` (on the test's thread) assert.
        self.threads.add(threading.current_thread().name)
        self.outputs.append(out)
        if out.finished:
            self.done.set()

    @property
    def text(self):
        return "".join(o.new_text for o in self.outputs)

    @property
    def final(self):
        assert self.done.wait(TIMEOUT), "no final output"
        finals = [o for o in self.outputs if o.finished]
        assert len(finals) == 1, f"{len(finals)} final outputs"
        return finals[0]


def params(n=3):
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def loop(engine):
    lp = EngineLoop(engine)
    yield lp
    lp.shutdown(timeout_s=TIMEOUT)


def test_runs_requests_on_the_loop_thread(engine, loop):
    cols = [Collector() for _ in range(5)]
    for i, c in enumerate(cols):
        loop.submit(f"r{i}", "hello", params(i + 1), c)
    for i, c in enumerate(cols):
        assert c.final.finish_reason == "length"
        assert c.text == "".join(f"t{k} " for k in range(1, i + 2))
        assert c.threads == {"nightdraft-engine-loop"}
    assert engine.step_threads == {"nightdraft-engine-loop"}
    assert loop.num_inflight == 0


def test_idle_loop_does_not_spin(engine, loop):
    c = Collector()
    loop.submit("a", "x", params(2), c)
    c.final
    time.sleep(0.05)
    steps = engine.steps
    time.sleep(0.3)
    assert engine.steps == steps, "the loop stepped with no work"
    c2 = Collector()   # and wakes up for new work
    loop.submit("b", "x", params(2), c2)
    assert c2.final.finish_reason == "length"


def test_an_idle_loop_looks_for_the_drafters_return_and_then_sleeps(engine):
    """Work that ends outside the steps (the drafter's weights coming back) is polled for while
    the loop is idle, the step hook runs once when it is over (the metrics refresh there), and
    then the idle loop polls no more."""
    hooks = []
    engine.background_polls_left = 3
    loop = EngineLoop(engine, on_step=hooks.append)
    try:
        deadline = time.monotonic() + TIMEOUT
        while engine.background_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.background_pending(), "the idle loop never polled"
        time.sleep(0.3)
        assert engine.background_polls == 3, "the loop kept polling after the work ended"
        assert hooks == [[]] and engine.steps == 0
    finally:
        loop.shutdown(timeout_s=TIMEOUT)


def test_validation_errors_reach_the_caller(loop):
    with pytest.raises(InvalidRequest, match="empty"):
        loop.submit("a", "", params(), Collector())
    assert loop.num_inflight == 0
    c = Collector()
    loop.submit("b", "x", params(50), c)
    with pytest.raises(InvalidRequest, match="duplicate"):
        loop.submit("b", "x", params(), Collector())
    loop.abort("b")
    assert c.final.finish_reason == "abort"


def test_abort_gives_one_final_output_and_is_idempotent():
    engine = FakeEngine(step_delay=0.005)
    loop = EngineLoop(engine)
    try:
        c = Collector()
        loop.submit("a", "x", params(10_000), c)
        time.sleep(0.05)
        loop.abort("a")
        loop.abort("a")
        assert c.final.finish_reason == "abort"
        loop.abort("a")            # after the end: ignored
        loop.abort("never-seen")
        assert not engine.reqs
    finally:
        loop.shutdown(timeout_s=TIMEOUT)


def test_shutdown_aborts_inflight_and_joins():
    engine = FakeEngine(step_delay=0.002)
    loop = EngineLoop(engine)
    cols = [Collector() for _ in range(4)]
    for i, c in enumerate(cols):
        loop.submit(f"r{i}", "x", params(100_000), c)
    time.sleep(0.05)
    loop.shutdown(timeout_s=TIMEOUT)
    assert not loop._thread.is_alive()
    for c in cols:
        assert c.done.is_set()
        assert c.final.finish_reason == "abort"
    with pytest.raises(EngineLoopError, match="shutting down"):
        loop.submit("late", "x", params(), Collector())
    loop.shutdown()   # twice is fine


def test_shutdown_can_drain():
    engine = FakeEngine(step_delay=0.001)
    loop = EngineLoop(engine)
    c = Collector()
    loop.submit("a", "x", params(20), c)
    loop.shutdown(abort_inflight=False, timeout_s=TIMEOUT)
    assert c.final.finish_reason == "length"
    assert len(c.text.split()) == 20


def test_step_exception_fails_requests_and_loop_survives(engine, loop, caplog):
    engine.fail_next = [RuntimeError("boom")]
    c1, c2 = Collector(), Collector()
    # Hold the engine so both requests are in flight when the failing step runs.
    engine.gate.clear()
    loop.submit("a", "x", params(5), c1)
    loop.submit("b", "x", params(5), c2)
    engine.gate.set()
    for c in (c1, c2):
        f = c.final
        assert f.finish_reason == "error"
        assert "boom" in f.error
    assert "engine.step() failed" in caplog.text
    assert loop.step_errors == 1
    # failed requests were aborted in the engine (blocks freed) ...
    deadline = time.monotonic() + TIMEOUT
    while engine.reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.reqs
    # ... and the loop keeps serving
    c3 = Collector()
    loop.submit("c", "x", params(3), c3)
    assert c3.final.finish_reason == "length"
    assert loop.healthy


def test_exception_naming_requests_fails_only_those(engine, loop):
    err = RuntimeError("bad request b")
    err.request_ids = ["b"]
    engine.fail_next = [err]
    c1, c2 = Collector(), Collector()
    engine.gate.clear()
    loop.submit("a", "x", params(4), c1)
    loop.submit("b", "x", params(4), c2)
    engine.gate.set()
    assert c2.final.finish_reason == "error"
    assert c1.final.finish_reason == "length"
    assert c1.text == "t1 t2 t3 t4 "


def test_persistent_failure_marks_loop_unhealthy(engine, loop):
    engine.fail_always = RuntimeError("broken for good")
    c = Collector()
    loop.submit("a", "x", params(5), c)
    assert c.final.finish_reason == "error"
    deadline = time.monotonic() + TIMEOUT
    while loop.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loop.healthy
    with pytest.raises(EngineLoopError, match="broken for good"):
        loop.submit("b", "x", params(), Collector())
    steps = engine.steps
    time.sleep(0.2)
    assert engine.steps == steps, "a broken engine must not be stepped in a hot loop"


def test_an_engine_failing_every_step_is_unhealthy_even_with_requests_to_fail(engine, loop):
    engine.fail_always = RuntimeError("every step fails")
    for i in range(EngineLoop.MAX_CONSECUTIVE_FAILURES):
        c = Collector()
        try:
            loop.submit(f"r{i}", "x", params(5), c)
        except EngineLoopError:
            break
        assert c.final.finish_reason == "error"
    deadline = time.monotonic() + TIMEOUT
    while loop.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loop.healthy, "a loop whose every step fails still reports healthy"
    with pytest.raises(EngineLoopError, match="every step fails"):
        loop.submit("late", "x", params(), Collector())


def test_dropped_request_is_failed_not_hung(engine, loop):
    engine.drop_silently.add("a")
    c = Collector()
    loop.submit("a", "x", params(5), c)
    f = c.final
    assert f.finish_reason == "error" and "dropped" in f.error


def test_callback_exception_aborts_only_that_request(engine, loop):
    def bad(out):
        raise ValueError("consumer gone")
    good = Collector()
    engine.gate.clear()
    loop.submit("bad", "x", params(100), bad)
    loop.submit("good", "x", params(5), good)
    engine.gate.set()
    assert good.final.finish_reason == "length"
    deadline = time.monotonic() + TIMEOUT
    while engine.reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.reqs and loop.num_inflight == 0


def test_on_step_hook_runs_and_its_errors_are_contained(engine):
    seen = []

    def hook(outputs):
        seen.append(len(outputs))
        raise RuntimeError("hook bug")

    loop = EngineLoop(engine, on_step=hook)
    try:
        c = Collector()
        loop.submit("a", "x", params(3), c)
        assert c.final.finish_reason == "length"
        assert seen[:3] == [1, 1, 1]
    finally:
        loop.shutdown(timeout_s=TIMEOUT)


def test_concurrent_submitters(engine, loop):
    cols = {}
    errors = []

    def worker(k):
        try:
            for j in range(20):
                c = Collector()
                cols[f"{k}-{j}"] = c
                loop.submit(f"{k}-{j}", "x", params(1 + j % 4), c)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors
    for rid, c in cols.items():
        j = int(rid.split("-")[1])
        assert c.final.finish_reason == "length"
        assert len(c.text.split()) == 1 + j % 4
