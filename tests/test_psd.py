"""Batch-parallel SD with the drafter in its own worker process (on CPU: its own core)."""
import random

import pytest

from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from helpers.engines import assert_no_leaks, tiny_engine

pytestmark = pytest.mark.slow   # starts worker processes

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_CUTS = (12, 15, 41, 300)      # the conftest's `prompts` and `ar_outputs`


def make_engine(mode="psd", **kw) -> Engine:
    kw.setdefault("gamma", 3)
    return tiny_engine(mode, drafter_device="cpu", **kw)


@pytest.fixture(scope="module")
def psd():
    engine = make_engine()
    yield engine
    engine.close()


def run_staggered(engine: Engine, prompts, params, *, abort=(), check_invariants=False, seed=0):
    """Requests arrive a few steps apart; some are aborted mid-flight. Returns tokens per id."""
    rng = random.Random(seed)
    arrivals = sorted((rng.randint(0, 12), i) for i in range(len(prompts)))
    tokens = {i: [] for i in range(len(prompts))}
    finals = {}
    last_advance = {}
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            engine.add_request(str(i), prompts[i], params)
        if step == 6:
            for i in abort:
                engine.abort(str(i))
        decoding_before = _decoding(engine)
        finished_now = 0
        for o in engine.step():
            i = int(o.request_id)
            tokens[i] += o.new_token_ids
            if o.new_token_ids:
                last_advance[i] = step
            if o.finished:
                finals[i] = o.finish_reason
                finished_now += 1
        if check_invariants:
            _check_sub_batches(engine, last_advance, step, finished_now, decoding_before)
        step += 1
    return tokens, finals


def _decoding(engine: Engine) -> set[str]:
    """Requests that decode with speculation now (what the step about to run splits in two)."""
    return {s.request_id for s in engine.scheduler.running if s.num_uncomputed == 1 and s.speculates}


def _check_sub_batches(engine: Engine, last_advance: dict, step: int, finished_now: int,
                       decoding_before: set[str]) -> None:
    a, b = engine.sub_batches.members
    assert not (a & b), "a request sits in both sub-batches"
    # Every request that decoded when the step began, and still runs, is in exactly one
    # sub-batch, and nothing else is (membership is refreshed as a step begins, so requests that
    # started decoding during this step join at the next one; finished ones have left).
    running = {s.request_id for s in engine.scheduler.running}
    assert a | b == decoding_before & running, \
        f"sub-batches {sorted(a | b)} against decoding {sorted(decoding_before & running)}"
    # Balanced at the start of the step; requests finishing during it may tip it until the next.
    assert abs(len(a) - len(b)) <= 1 + finished_now
    for rid in a | b:                    # none starved: each advances at least every other step
        i = int(rid)
        assert step - last_advance.get(i, step) <= 2, f"request {rid} starved"


def test_greedy_psd_equals_ar_with_staggered_arrivals_and_aborts(psd, prompts, ar_outputs):
    tokens, finals = run_staggered(psd, prompts, GREEDY, abort=(3, 7), check_invariants=True)
    for i, out in tokens.items():
        if i in (3, 7) and finals[i] == "abort":
            assert out == ar_outputs[i][: len(out)]
        else:
            assert finals[i] == "length"
            assert out == ar_outputs[i]
    stats = psd.stats()
    assert stats.psd_overlapped_steps > 0, "no step overlapped drafting with verification"
    assert stats.accepted_tokens > 0
    assert_no_leaks(psd)


def test_greedy_psd_equals_ar_at_once(psd, prompts, ar_outputs):
    out = psd.generate(prompts, GREEDY)
    assert [c.output_ids for c in out] == ar_outputs
    assert_no_leaks(psd)


def test_sequential_sd_with_the_drafter_in_a_worker(prompts, ar_outputs):
    engine = make_engine(mode="sd", gamma=4)
    try:
        out = engine.generate(prompts, GREEDY, max_concurrency=5)
        assert [c.output_ids for c in out] == ar_outputs
        assert engine.stats().psd_steps == 0
        assert engine.stats().acceptance_rate > 0
        assert_no_leaks(engine)
    finally:
        engine.close()


def test_killed_worker_degrades_to_plain_decoding_and_restarts(prompts, ar_outputs):
    engine = make_engine(drafter_restart_s=0.0)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        tokens = {i: [] for i in range(len(prompts))}
        finals = {}
        step = 0
        killed_pid = None
        while engine.has_unfinished():
            if step == 4:
                killed_pid = engine.drafter.drafter.pid
                counted_by_the_killed = engine.drafter.drafter.stats()   # as its last reply had them
                engine.drafter.drafter.kill()
            for o in engine.step():
                tokens[int(o.request_id)] += o.new_token_ids
                if o.finished:
                    finals[int(o.request_id)] = o.finish_reason
            step += 1
        assert set(finals.values()) == {"length"}
        assert [tokens[i] for i in range(len(prompts))] == ar_outputs
        stats = engine.stats()
        assert stats.drafter_failures == 1
        # A replacement came up in the background; wait for it and check it drafts again.
        import time
        deadline = time.monotonic() + 120
        while engine.drafter.drafter is None and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.2)
        assert engine.drafter.drafter is not None and engine.drafter.drafter.pid != killed_pid
        before = engine.stats().drafted_tokens
        out = engine.generate(prompts[:4], GREEDY)
        assert [c.output_ids for c in out] == ar_outputs[:4]
        assert engine.stats().drafted_tokens > before
        # The engine's totals keep what the killed worker had counted (the metrics are counters)
        dead, alive, total = counted_by_the_killed, engine.drafter.drafter.stats(), engine.stats()
        assert dead.cpu_s > 0 and alive.cpu_s > 0          # each worker's own process's CPU time
        assert total.drafter_cpu_s == pytest.approx(dead.cpu_s + alive.cpu_s)
        assert total.drafter_catchup_tokens == dead.catchup_tokens + alive.catchup_tokens
        assert_no_leaks(engine)
    finally:
        engine.close()


def test_worker_and_target_run_on_different_cores(psd, prompts):
    import os
    if len(os.sched_getaffinity(psd.drafter.drafter.pid) | os.sched_getaffinity(0)) < 2:
        pytest.skip("one core only: nothing to separate")
    psd.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))   # a step pins its thread
    worker = os.sched_getaffinity(psd.drafter.drafter.pid)
    target = os.sched_getaffinity(0)
    assert worker and target and not (worker & target), (worker, target)


def test_sampling_through_the_worker_runs_and_frees_everything(psd, prompts):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)
    out = psd.generate(prompts[:6], params)
    assert all(len(c.output_ids) == 16 for c in out)
    assert_no_leaks(psd)


def test_requests_that_opt_out_of_speculation_decode_every_step(psd, prompts):
    """They sit in no sub-batch: a request with speculative=false advances on every step it is
    scheduled, while the others take turns being drafted and verified."""
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative=False)
    for i, p in enumerate(prompts[:4]):
        psd.add_request(f"spec{i}", p, GREEDY)
    psd.add_request("plain", prompts[4], plain)
    steps_running = advanced = 0
    while psd.has_unfinished():
        running = any(s.request_id == "plain" and s.num_computed > 0 for s in psd.scheduler.running)
        outs = {o.request_id: o for o in psd.step()}
        if running:
            steps_running += 1
            advanced += bool(outs.get("plain") and outs["plain"].new_token_ids)
    assert psd.stats().psd_overlapped_steps > 0, "PSD never overlapped: nothing was tested"
    assert steps_running >= plain.max_tokens - 1
    assert advanced == steps_running, f"advanced on {advanced} of {steps_running} steps"
    assert_no_leaks(psd)


def test_the_tensor_transport_carries_draft_probabilities(prompts):
    """The CUDA path's transport (probabilities as tensors through torch's reductions), run on
    CPU tensors: sampled SD decides exactly what it decides with the shared buffer (the same
    seeds, so the same draws: any difference in the probabilities that arrived changes
    acceptances), which the sampled exactness tests cover."""
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    got = {}
    for transport in ("tensor", "shared_buffer"):
        engine = make_engine(mode="sd", drafter_probs_transport=transport)
        try:
            got[transport] = [c.output_ids for c in engine.generate(prompts[:4], sampled)]
            st = engine.stats()
            assert st.drafted_tokens > 0 and 0 < st.acceptance_rate < 1 and st.drafter_failures == 0
            assert (engine.drafter.drafter._probs is None) == (transport == "tensor"), transport
        finally:
            engine.close()
    assert all(len(o) == 16 for o in got["tensor"])
    assert got["tensor"] == got["shared_buffer"]
