"""Resources follow the planner's choice: while plain decoding runs, the drafter worker's CPU
cores join the target's forward; before the drafter drafts again they go back to it."""
from __future__ import annotations

import os

import pytest
import torch

from planner import Decision

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from model_factory import TINY_DRAFTER, TINY_TARGET

pytestmark = [pytest.mark.slow,    # drafter worker processes
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one for the drafter")]

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(3):\n"]


def auto_engine(modes: list[str], **kw) -> Engine:
    return Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                               drafter_device="cpu", num_threads=1, kv_cache_bytes=16 << 20,
                               planner={"modes": modes}, planner_cost_profile="off", **kw))


def test_plain_decoding_borrows_the_drafter_cores_and_speculation_gives_them_back():
    all_cores = os.sched_getaffinity(0)
    e = auto_engine(["ar", "sd"])
    place, ctl = e._placement, e.adaptive
    try:
        target_cores = set(place.target_cores)
        assert os.sched_getaffinity(0) == target_cores and torch.get_num_threads() == 1
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


def test_lending_can_be_turned_off():
    e = auto_engine(["ar"], lend_drafter_cores=False)
    try:
        e.generate(PROMPTS, GREEDY)
        assert not e._placement.lent and torch.get_num_threads() == 1
    finally:
        e.close()


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
