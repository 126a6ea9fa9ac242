"""The step contract: mode names parsed once at the boundary, a frozen plan down, a result up,
and proposers that implement only what they can do."""
from __future__ import annotations

import dataclasses

import pytest

from backend.engine.config import EngineConfig
from backend.errors import ConfigError
from backend.mode import CONFIGURED_MODES, STEP_MODES, Mode, ProposerKind
from backend.speculation.ngram import NgramProposer
from backend.speculation.proposer import DeviceResident, Proposer, Remote
from backend.step import PLAIN, StepPlan, ran
from helpers.engines import tiny_engine
from model_factory import TINY_DRAFTER, TINY_TARGET
from planner import Decision


def test_configuration_names_become_members_and_unknown_ones_are_refused():
    cfg = EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="sd", proposer="drafter")
    assert cfg.mode is Mode.SD and cfg.proposer is ProposerKind.DRAFTER
    assert EngineConfig(target=str(TINY_TARGET)).mode is Mode.AR          # no drafter: plain decoding
    with pytest.raises(ConfigError, match=r"^mode: must be one of \['ar', 'sd', 'psd', 'auto'\], got 'SD'"):
        EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="SD")
    with pytest.raises(ConfigError, match=r"^mode: .* got 'ngram'"):    # a step's mode, not an engine's
        EngineConfig(target=str(TINY_TARGET), proposer="ngram", mode="ngram")
    with pytest.raises(ConfigError, match=r"^proposer: must be one of"):
        EngineConfig(target=str(TINY_TARGET), proposer="lookup")
    assert Mode.AUTO in CONFIGURED_MODES and Mode.AUTO not in STEP_MODES
    assert Decision("psd", 2).mode is Mode.PSD and f"{Decision('psd', 2)}" == "psd:2"


def test_a_plan_is_frozen_and_its_gamma_is_zero_exactly_for_plain_decoding():
    plan = StepPlan("sd", 3)
    assert plan.mode is Mode.SD
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.gamma = 4
    for mode, gamma in ((Mode.AR, 2), (Mode.SD, 0), (Mode.PSD, -1)):
        with pytest.raises(ValueError):
            StepPlan(mode, gamma)
    with pytest.raises(ValueError):
        StepPlan(Mode.AUTO, 2)                  # auto is configured, never run by a step


def test_the_result_names_what_ran_not_what_was_planned():
    assert ran(StepPlan(Mode.PSD, 2), drafted=6, overlapped=True) is Mode.PSD
    assert ran(StepPlan(Mode.PSD, 2), drafted=6, overlapped=False) is Mode.SD
    assert ran(StepPlan(Mode.SD, 2), drafted=0, overlapped=False) is Mode.AR
    assert ran(StepPlan(Mode.NGRAM, 2), drafted=3, overlapped=False) is Mode.NGRAM


def test_the_ngram_proposer_is_a_proposer_without_the_optional_capabilities():
    p = NgramProposer(vocab_size=32)
    assert isinstance(p, Proposer)
    assert not isinstance(p, DeviceResident) and not isinstance(p, Remote)
    assert p.stats().num_sequences == 0 and p.stats().kv_usage == 0.0


def test_each_step_reports_the_plan_it_ran_and_set_gamma_changes_the_next_plan():
    engine = tiny_engine("sd", gamma=3)
    try:
        from backend.sampling.params import SamplingParams
        engine.add_request("a", "def f(x):", SamplingParams(max_tokens=12, temperature=0.0))
        results = []
        while engine.has_unfinished():
            engine.step()
            results.append(engine.stats().last_step)
            if len(results) == 3:
                engine.set_gamma(0)
        assert results[1].plan == StepPlan(Mode.SD, 3) and results[1].mode is Mode.SD
        assert results[1].drafted == 3 and results[1].tokens_committed == results[1].accepted + 1
        assert all(r.plan == PLAIN and r.mode is Mode.AR and r.drafted == 0 for r in results[3:])
        assert engine.stats().mode is Mode.AR and engine.stats().gamma == 0
    finally:
        engine.close()
