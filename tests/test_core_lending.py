"""Resources follow the planner's choice: while plain decoding runs, the drafter worker's CPU
cores join the target's forward where that measures faster (backend/engine/core_lending.py);
before the drafter drafts again they go back to it."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from planner import Decision

from backend.engine.config import ConfigError, EngineConfig
from backend.engine.core_lending import CoreLending
from backend.engine.engine import Engine
from backend.engine.loop import EngineLoop
from backend.model.linear import ROW_LADDER, Linear
from backend.sampling.params import SamplingParams
from backend.batching.scheduler import ScheduledSeq
from backend.speculation.placement import CpuPlacement
from backend.speculation.strategies import PlainDecoding
from backend.step import PLAIN
from model_factory import TINY_DRAFTER, TINY_TARGET

# the engine tests start drafter worker processes (slow), on a core of their own
needs_worker = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one for the drafter")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(3):\n"]


def auto_engine(modes: list[str], **kw) -> Engine:
    return Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                               drafter_device="cpu", num_threads=1, kv_cache_bytes=16 << 20,
                               planner={"modes": modes}, planner_cost_profile="off", **kw))


@pytest.mark.slow
@needs_worker
def test_plain_decoding_borrows_the_drafter_cores_and_speculation_gives_them_back():
    all_cores = os.sched_getaffinity(0)
    e = auto_engine(["ar", "sd"])
    place, ctl = e._placement, e.adaptive
    try:
        target_cores = set(place.target_cores)
        assert torch.get_num_threads() == 1
        # its kernels' verdicts for the lent cores' thread count too (backend.model.linear)
        lin = next(m for m in e.target.modules() if isinstance(m, Linear))
        assert set(lin._by_threads) == {len(all_cores)} and len(lin._use_packed) == len(ROW_LADDER)
        seen = []
        decisions = iter(["ar"] * (ctl.LEND_AFTER_STEPS + 8) + ["sd"] * 3)
        real_decide = e.adaptive.planner.decide

        def scripted(signals):      # the planner's choice, scripted; the rest is the real path
            real_decide(signals)
            mode = next(decisions, "sd")
            return Decision("ar", 0) if mode == "ar" else Decision("sd", 2)
        ctl.planner.decide = scripted
        reported = []               # the cores each step's outcome tells the planner
        real_observe = ctl.planner.observe
        ctl.planner.observe = lambda issued, o: (reported.append(o.forward_cores), real_observe(issued, o))
        out = e.generate(PROMPTS, GREEDY, on_step=lambda _: seen.append(
            (e.stats().last_step.drafted, place.lent, frozenset(os.sched_getaffinity(0)), torch.get_num_threads())))
        assert reported == [len(all_cores) if s[1] else len(target_cores) for s in seen]
        lent = [s for s in seen if s[1]]
        assert lent, "the cores were never lent during plain decoding"
        assert all(s[0] == 0 for s in lent), "drafted while the target held the drafter's cores"
        assert all(s[2] == all_cores and s[3] == 2 for s in lent)
        drafted = [s for s in seen if s[0] > 0]
        assert drafted and all(not s[1] and s[2] == target_cores and s[3] == 1 for s in drafted)
        ar = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
        assert [c.output_ids for c in out] == [c.output_ids for c in ar.generate(PROMPTS, GREEDY)]
    finally:
        e.close()
    assert os.sched_getaffinity(0) == all_cores


@pytest.mark.slow
@needs_worker
def test_lending_can_be_turned_off():
    e = auto_engine(["ar"], lend_drafter_cores=False)
    try:
        e.generate(PROMPTS, GREEDY)
        assert not e._placement.lent and torch.get_num_threads() == 1
    finally:
        e.close()


@pytest.mark.slow
@needs_worker
def test_a_step_that_only_prefills_runs_on_the_drafter_cores_even_when_the_planner_speculates():
    """With nothing decoding there is nothing to draft: a speculative plan would only halve the
    prefill's cores."""
    all_cores = os.sched_getaffinity(0)
    e = auto_engine(["sd"])        # every decision the planner can make is speculative
    place = e._placement
    try:
        seen = []
        out = e.generate(PROMPTS, GREEDY, on_step=lambda _: seen.append(
            (e.stats().last_step, place.lent, torch.get_num_threads(), e.adaptive._issued)))
        prefill_only = [s for s in seen if s[0].num_prefill_tokens > 0 and not s[0].decoded]
        assert prefill_only, "no step fed only prompts"
        assert all(issued.speculative for *_, issued in prefill_only), "the planner did not speculate"
        assert all(lent and threads == 2 and not st.drafted for st, lent, threads, _ in prefill_only)
        drafted = [s for s in seen if s[0].drafted]
        assert drafted and all(not lent and threads == 1 for _, lent, threads, _ in drafted)
        ar = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
        assert [c.output_ids for c in out] == [c.output_ids for c in ar.generate(PROMPTS, GREEDY)]
    finally:
        e.close()
    assert os.sched_getaffinity(0) == all_cores


@pytest.mark.slow
@needs_worker
def test_a_step_that_only_prefills_runs_on_the_drafter_cores_where_plain_decoding_keeps_its_own():
    """The lending choice is plain decoding's, at its batch size: a step with nothing decoding
    (after an idle engine the planner issues plain decoding for it) feeds only prompts and runs
    on every core, where plain decoding at batch 1 keeps the target's own thread, unpinned (a
    pinned thread waits whenever a front end runs on its core)."""
    all_cores = frozenset(os.sched_getaffinity(0))
    e = auto_engine(["ar"])
    place = e._placement
    try:
        for _ in range(8):               # at batch 1 the own core measures 10x faster
            e.adaptive.lending.observe(True, 1, 0.010, 1)
            e.adaptive.lending.observe(False, 1, 0.001, 1)
        assert not e.adaptive.lending.lend(1)
        seen = []
        out = e.generate(PROMPTS[:1], GREEDY, on_step=lambda _: seen.append(
            (e.stats().last_step, place.lent, torch.get_num_threads(), frozenset(os.sched_getaffinity(0)))))
        first, *decoding = seen
        assert first[0].num_prefill_tokens > 0 and not first[0].decoded
        assert first[1] and first[2] == 2, "the prompt ran on the target's core alone"
        assert decoding and all(not lent and threads == 1 for _, lent, threads, _ in decoding)
        assert all(cores == all_cores for *_, cores in decoding), "plain decoding pinned to the target's core"
        ar = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
        assert out[0].output_ids == ar.generate(PROMPTS[:1], GREEDY)[0].output_ids
    finally:
        e.close()


@pytest.mark.slow
@needs_worker
def test_a_big_forward_borrows_the_waiting_drafter_cores_and_only_for_its_own_time():
    """Sequential SD: the drafter waits while the target verifies, so the forward of a step that
    feeds a long prompt beside the drafted sequences runs on the drafter's cores too, and the
    planner is told so; the drafting and the small verifies keep to the target's cores."""
    all_cores = os.sched_getaffinity(0)
    e = auto_engine(["sd"])        # every decision the planner can make is speculative
    place, ctl = e._placement, e.adaptive
    target_cores = frozenset(place.target_cores)
    forwards = []                   # each target forward: (tokens, its thread's cores, threads)
    real_forward = e.runner.forward

    def spy_forward(ids, cached, num_new, *args, **kw):
        forwards.append((sum(num_new), frozenset(os.sched_getaffinity(0)), torch.get_num_threads()))
        return real_forward(ids, cached, num_new, *args, **kw)
    e.runner.forward = spy_forward
    told = []                       # the cores each step's outcome gave the planner
    real_observe = ctl.planner.observe
    ctl.planner.observe = lambda issued, o: (told.append(o.forward_cores), real_observe(issued, o))
    long_prompt = list(range(5, 5 + 600))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}                    # request -> the tokens it was sent

    def step():
        for out in e.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    try:
        for i, prompt in enumerate(PROMPTS[:2]):
            e.add_request(f"short{i}", prompt, params)
        while not e.stats().drafted_tokens:
            step()
        e.add_request("long", long_prompt, params)
        step()
        big_step = e.stats().last_step
        assert big_step.num_prefill_tokens == len(long_prompt) and big_step.drafted > 0
        assert big_step.forward_cores == len(all_cores) and told[-1] == len(all_cores)
        assert not place.lent and os.sched_getaffinity(0) == target_cores and torch.get_num_threads() == 1
        while e.has_unfinished():
            step()
        big = [f for f in forwards if f[0] >= PlainDecoding.BORROW_FROM_TOKENS]
        assert len(big) == 1 and big[0][1:] == (all_cores, 2)
        # (the first step fed only the short prompts: lent, as nothing could be drafted)
        small = [f for f in forwards[1:] if f[0] < PlainDecoding.BORROW_FROM_TOKENS]
        assert small and all(f[1:] == (target_cores, 1) for f in small)
        assert e.stats().drafted_tokens > big_step.drafted, "no drafting after the borrowed forward"
    finally:
        e.close()
    ar = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
    plain = ar.generate([PROMPTS[0], PROMPTS[1], long_prompt], params)
    assert [outputs["short0"], outputs["short1"], outputs["long"]] == [c.output_ids for c in plain]
    assert os.sched_getaffinity(0) == all_cores


@pytest.mark.slow
@needs_worker
@pytest.mark.parametrize("mode", ["sd", "psd"])
def test_fixed_speculation_feeds_a_step_of_prompts_on_the_drafter_cores_too(mode):
    """Fixed sequential or batch-parallel SD with the drafter on a core of its own: a step that
    feeds only prompts (nothing to draft, before it or beside it) runs its forward on both
    cores, the steps that draft keep to the target's, and the tokens are plain decoding's."""
    all_cores = os.sched_getaffinity(0)
    e = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode=mode, gamma=2,
                            drafter_device="cpu", num_threads=1, kv_cache_bytes=16 << 20))
    steps = []
    try:
        target_cores = frozenset(e._placement.target_cores)
        got = [c.output_ids for c in e.generate(PROMPTS[:2], GREEDY, max_concurrency=2,
                                                on_step=lambda _: steps.append(e.stats().last_step))]
        assert os.sched_getaffinity(0) == target_cores and torch.get_num_threads() == 1
        if mode == "psd":     # one sub-batch drafted while the other verified
            assert e.stats().psd_overlapped_steps > 0
    finally:
        e.close()
    first = steps[0]
    assert not first.decoded and first.num_prefill_tokens > 0
    assert first.num_prefill_tokens < PlainDecoding.BORROW_FROM_TOKENS       # not for its size
    assert first.forward_cores == len(all_cores)
    drafting = [s for s in steps if s.drafted]
    assert drafting and all(s.forward_cores == 0 for s in drafting)
    ar = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
    try:
        assert got == [c.output_ids for c in ar.generate(PROMPTS[:2], GREEDY)]
    finally:
        ar.close()


@needs_worker
def test_only_a_forward_of_prompts_or_a_big_one_op_by_op_borrows_the_drafter_cores():
    """A small forward beside decoding sequences would wait for the drafter's core, and a
    captured step (every sequence feeds at most its query length) keeps the target's; a
    forward of prompts alone borrows at any size, as nothing decodes."""
    all_cores = os.sched_getaffinity(0)
    place = CpuPlacement("cpu", 1)
    try:
        place.place()
        target = (frozenset(place.target_cores), 1)
        plain = PlainDecoding(place, captured_query_len=9)
        ran_on = []

        def body():
            ran_on.append((frozenset(os.sched_getaffinity(0)), torch.get_num_threads()))
            return "outputs"
        def verifying(drafts):     # a decoding sequence's token and its drafts
            return ScheduledSeq(None, 1, gamma=drafts, drafts=[0] * drafts)
        for batch, borrows in [([ScheduledSeq(None, 600), verifying(0), verifying(0)], True),  # a long prompt
                               ([ScheduledSeq(None, 300), verifying(0)], False),   # under the size, beside decoding
                               ([ScheduledSeq(None, 300), ScheduledSeq(None, 40)], True),   # prompts only
                               ([ScheduledSeq(None, 40), ScheduledSeq(None, 1)], False),   # a one-token chunk
                               ([verifying(4)] * 120, False)]:        # 600 tokens a captured step takes
            plain.propose(batch, PLAIN)
            out, drafting = plain.alongside(PLAIN, body)
            assert out == "outputs"
            assert ran_on[-1] == ((frozenset(all_cores), 2) if borrows else target)
            assert drafting.forward_cores == (len(all_cores) if borrows else 0)
            assert not place.lent and (frozenset(os.sched_getaffinity(0)), torch.get_num_threads()) == target
    finally:
        place.restore()
    assert os.sched_getaffinity(0) == all_cores


@pytest.mark.slow
@needs_worker
def test_only_the_thread_that_steps_is_pinned_not_the_threads_a_front_end_starts():
    """The engine's constructing thread gets its cores back once the engine is built, so the
    threads a front end starts after it (a server's intake and response sending) may run on the
    drafter's core while the forward holds the target's; the loop's thread, which steps, is
    pinned to the target's cores."""
    all_cores = os.sched_getaffinity(0)
    e = auto_engine(["sd"], lend_drafter_cores=False)
    target_cores = set(e._placement.target_cores)
    front_end = {}                  # a thread the front end starts after the engine: its cores

    def front_end_thread():
        front_end["cores"] = os.sched_getaffinity(0)
    loop = EngineLoop(e)
    finished = threading.Semaphore(0)
    stepping = {}                   # the loop thread's cores while it steps

    def on_output(out):
        stepping.setdefault("cores", os.sched_getaffinity(0))
        if out.finished:
            finished.release()
    try:
        assert os.sched_getaffinity(0) == all_cores, "the constructing thread kept the target's cores"
        t = threading.Thread(target=front_end_thread)
        t.start()
        t.join()
        assert front_end["cores"] == all_cores
        loop.submit("r0", PROMPTS[0], GREEDY, on_output)
        assert finished.acquire(timeout=120)
        assert stepping["cores"] == target_cores != all_cores
        assert e.stats().drafted_tokens > 0, "the drafter never drafted: its core was not in use"
    finally:
        loop.shutdown()
        e.close()


# ---------------------------------------------------------------------------------------------
# the choice, measured: plain decoding lends the cores where that measures faster

def play(choice: CoreLending, batch: int, steps: int, per_token: dict, tokens: int = 4) -> list[bool]:
    """`steps` plain-decoding steps of `batch` sequences whose seconds per token are
    `per_token[lent]`: what the choice lent on each."""
    sides = []
    for _ in range(steps):
        lent = choice.lend(batch)
        choice.observe(lent, batch, per_token[lent] * tokens, tokens)
        sides.append(lent)
    return sides


def test_the_lending_choice_tries_both_sides_then_keeps_the_faster_per_batch_size():
    choice = CoreLending(min_steps=8, probe_every=64, probe_steps=4, probe_every_max=64)
    slower_lent = play(choice, 4, 8 + 8 + 10 * 64 + 4, {True: 0.002, False: 0.001})
    assert slower_lent[:16] == [True] * 8 + [False] * 8            # each side tried, lent first
    rest = slower_lent[16:]
    assert rest[:68] == [False] * 64 + [True] * 4                  # then only the probes lend:
    assert rest.count(True) == 4 * 10                               # 4 steps every 64
    # another batch size is its own bin: there lending is the faster
    faster_lent = play(choice, 16, 16 + 10 * 64 + 4, {True: 0.0005, False: 0.001})
    assert faster_lent[16:].count(False) == 4 * 10
    summary = choice.summary()
    assert summary["4"]["lends"] is False and summary["16"]["lends"] is True
    assert summary["4"]["own_s_per_token"] == pytest.approx(0.001)
    assert summary["16"]["lent_s_per_token"] == pytest.approx(0.0005)


def test_the_lending_choice_follows_a_change_within_one_probe():
    choice = CoreLending(min_steps=8, probe_every=64, probe_steps=4, probe_every_max=64)
    play(choice, 8, 200, {True: 0.002, False: 0.001})
    assert choice.lend(8) is False
    # the host changes: now lending is 4x faster; the next probe measures it and the choice turns
    after = play(choice, 8, 200, {True: 0.00025, False: 0.001})
    first_lent = after.index(True)
    assert first_lent < 64
    tail = after[first_lent:]
    assert tail.count(False) <= 4 * (len(tail) // 64 + 1)           # own cores only in probes
    assert choice.summary()["8"]["lends"] is True


def test_probes_that_confirm_the_choice_come_less_often_and_one_that_turns_it_resets_them():
    choice = CoreLending(min_steps=8, probe_every=64, probe_steps=4, probe_every_max=512)
    sides = play(choice, 8, 16 + 64 + 128 + 256 + 512 + 512, {True: 0.0005, False: 0.001})
    starts = [i - 16 for i in range(17, len(sides)) if not sides[i] and sides[i - 1]]
    # probe starts, counted in measured steps: the interval doubles up to its cap
    assert starts == [64, 64 + 128, 64 + 128 + 256, 64 + 128 + 256 + 512], starts
    assert sides[16:].count(False) == 4 * 4
    assert choice.summary()["8"]["probe_interval"] == 512
    # the host changes: the side not running is now the faster, which only a probe can see;
    # the next one (at most 512 steps on) turns the choice, and the interval is back at its
    # start, so a change back is followed as fast as before
    after = play(choice, 8, 600, {True: 0.0005, False: 0.0002})
    probe = after.index(False)
    assert probe <= 512 and after[probe:probe + 4] == [False] * 4
    lent_after = [i - probe for i, lent in enumerate(after) if lent and i > probe]
    assert lent_after == [s + j for s in (64, 64 + 128, 64 + 128 + 256) for j in range(4)], lent_after
    assert choice.lend(8) is False
    # the running side growing slower turns the choice by itself, and resets the interval too
    play(choice, 8, 8 * 64, {True: 0.0005, False: 0.0002})
    assert choice.summary()["8"]["probe_interval"] == 512
    play(choice, 8, 40, {True: 0.0005, False: 0.002})
    assert choice.lend(8) is True and choice.summary()["8"]["probe_interval"] == 64


def test_lend_drafter_cores_takes_true_false_or_measured():
    for ok in (True, False, "measured"):
        EngineConfig(target=str(TINY_TARGET), lend_drafter_cores=ok)
    assert EngineConfig(target=str(TINY_TARGET)).lend_drafter_cores == "measured"
    with pytest.raises(ConfigError, match="lend_drafter_cores"):
        EngineConfig(target=str(TINY_TARGET), lend_drafter_cores="sometimes")


@pytest.mark.slow
@needs_worker
def test_plain_decoding_keeps_to_its_own_cores_where_lending_measures_slower():
    """A front end that works on the loop's thread while the engine steps, and costs more while
    the drafter's cores are lent (as tritonserver's threads contend with a forward spread over
    every core): the engine measures both sides and plain decoding stops lending; the outputs
    are plain decoding's."""
    e = auto_engine(["ar"])
    place = e._placement
    told = []                   # (ran on the drafter's cores, told the planner it was a try)
    real_observe = e.adaptive.planner.observe
    e.adaptive.planner.observe = lambda issued, o: (told.append((place.lent, o.trying_cores)),
                                                    real_observe(issued, o))
    loop = EngineLoop(e)
    finished = threading.Semaphore(0)
    outs: dict[str, list[int]] = {}

    def on_output(out):
        if place.lent:
            time.sleep(0.004)          # a contended front end: 4 ms a response while lent
        outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finished.release()
    try:
        prompts, params = PROMPTS * 4, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            loop.submit(f"r{i}", p, params, on_output)
        for _ in prompts:
            assert finished.acquire(timeout=120)
        summary = e.adaptive.lending.summary()
        measured = {b: s for b, s in summary.items() if s["lent_steps"] >= 8 and s["own_steps"] >= 8}
        assert measured, f"no batch size measured on both sides: {summary}"
        for b, s in measured.items():
            assert s["lends"] is False and s["own_s_per_token"] < s["lent_s_per_token"], (b, s)
        # the steps on the cores it only tried are not plain decoding's cost to the planner:
        # its first steps on its own cores (lent is kept until both sides are measured) were
        # tries; once it keeps to its own cores, those steps are not
        own = [trying for lent, trying in told if not lent]
        assert any(own[:8]) and not any(own[-10:]), own
        ar = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
        plain = [c.output_ids for c in ar.generate(prompts, params)]
        assert [outs[f"r{i}"] for i in range(len(prompts))] == plain
    finally:
        loop.shutdown()
        e.close()


def test_the_side_plain_decoding_will_keep_is_judged_from_each_sides_first_steps():
    """Where plain decoding is played rarely its tries take long: the side it will keep, whose
    steps the planner takes as plain decoding's cost, is the faster from each side's first 2."""
    choice = CoreLending(min_steps=8)
    assert choice.keeps(4) is True                          # nothing known: lent, as without it
    play(choice, 4, 8 + 1, {True: 0.002, False: 0.001})     # 8 lent, 1 own
    assert choice.keeps(4) is True                          # one own step is not enough to judge
    play(choice, 4, 1, {True: 0.002, False: 0.001})
    assert choice.keeps(4) is False                         # 2 own steps, faster: own it is
    assert choice.lend(4) is False                          # (and its remaining tries are own)


@needs_worker
def test_a_borrowed_forward_gives_back_the_placement_it_found():
    """Plain decoding on its own side is unpinned; a big forward borrows the drafter's cores
    (one more thread) and then returns to that, not to the target's core alone."""
    all_cores = frozenset(os.sched_getaffinity(0))
    place = CpuPlacement("cpu", 1)
    try:
        place.open_drafter_cores()
        with place.borrowing():
            assert place.lent and torch.get_num_threads() == 2
        assert place.open and not place.lent
        assert frozenset(os.sched_getaffinity(0)) == all_cores and torch.get_num_threads() == 1
        place.take_back_drafter_cores()
        with place.borrowing():
            pass
        assert frozenset(os.sched_getaffinity(0)) == frozenset(place.target_cores)
    finally:
        place.restore()
    assert frozenset(os.sched_getaffinity(0)) == all_cores
