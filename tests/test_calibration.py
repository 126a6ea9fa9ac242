"""Mode auto's warm start: the cost profile the planner starts from is measured at load (or read
from a file, or left out), over the batch sizes and draft lengths the planner can choose."""
from __future__ import annotations

import json
import time

import pytest
import torch

from backend.engine.calibration import measure_cost_profile
from backend.engine.config import ConfigError, EngineConfig
from backend.engine.engine import Engine
from backend.speculation.proposer import Proposal
from model_factory import TINY_DRAFTER, TINY_TARGET
from planner.cost_model import CostProfile, predict


def auto_engine(**kw) -> Engine:
    return Engine(EngineConfig(target=str(TINY_TARGET), mode="auto", kv_cache_bytes=8 << 20,
                               max_num_seqs=16, gamma_max=4, num_threads=1, **kw))


def test_calibration_at_load_covers_the_planners_choices():
    e = auto_engine(drafter=str(TINY_DRAFTER))
    try:
        p = e.adaptive.planner.cost_profile
        assert p is not None
        assert {b for b, _ in p.verify} == {1, 4, 16}
        assert {n for _, n in p.verify} == {1, 2, 3, 5}            # up to gamma_max + 1
        assert set(p.draft) == {1, 4, 16} and all(t > 0 for t in p.draft.values())
        # a proposal's own cost, apart from its positions', from proposals of 1 and 4 positions
        assert set(p.draft_call) == {1, 4, 16} and all(t >= 0 for t in p.draft_call.values())
        # 80 tokens in one forward cost more than 1: a measurement, not a constant
        assert p.t_verify(16, 5) > p.t_verify(1, 1)
    finally:
        e.close()


class TimedProposer:
    """Proposals that take `call_s` plus `per_position_s` per draft position (asleep): what the
    calibration should recover."""

    def __init__(self, call_s: float, per_position_s: float):
        self.call_s, self.per_position_s = call_s, per_position_s

    def propose(self, requests):
        time.sleep(self.call_s + self.per_position_s * max(r.gamma for r in requests))
        return [Proposal([], None) for _ in requests]

    def free(self, seq_id):
        pass


def test_calibration_splits_a_proposal_into_its_calls_cost_and_each_positions():
    e = Engine(EngineConfig(target=str(TINY_TARGET), mode="ar", kv_cache_bytes=8 << 20, num_threads=1))
    try:
        profile = measure_cost_profile(e.runner, TimedProposer(0.008, 0.002), batches=[1], token_counts=[1],
                                       device="cpu", dtype=torch.float32, reps=3, longest_proposal=5)
        assert profile.draft_call[1] == pytest.approx(0.008, abs=0.002)
        assert profile.draft[1] == pytest.approx(0.002, abs=0.0006)
        assert profile.t_propose(1, 5) == pytest.approx(0.018, rel=0.15)
        # timed at one position only: the whole proposal, gamma of them per proposal (as before)
        one = measure_cost_profile(e.runner, TimedProposer(0.008, 0.002), batches=[1], token_counts=[1],
                                   device="cpu", dtype=torch.float32, reps=3)
        assert not one.draft_call and one.t_propose(1, 5) == pytest.approx(5 * 0.010, rel=0.15)
    finally:
        e.close()


def test_a_proposals_call_is_paid_once_so_the_prior_ranks_longer_gammas_ahead_at_batch_1():
    verify = {(1, n): 0.0035 + 0.00005 * n for n in range(1, 10)}
    # at batch 1 most of a one-position proposal (1.6 ms) is its call's own cost (1.0 ms)
    split = CostProfile(verify, {1: 0.0006}, {1: 0.0010})
    whole = CostProfile(verify, {1: 0.0016})          # the same proposal, timed whole
    assert split.t_propose(1, 1) == pytest.approx(whole.t_propose(1, 1))

    def best_gamma(profile):
        return min(range(1, 9), key=lambda g: 1.0 / predict("sd", 1, g, 0.85, profile).tokens_per_s)

    assert best_gamma(whole) <= 3      # a proposal of gamma priced as gamma calls: short drafts
    assert best_gamma(split) >= 5      # its call paid once: the longer drafts win
    assert CostProfile.from_dict(split.to_dict()) == split


def test_an_ngram_planner_is_calibrated_with_nearly_free_drafts():
    e = auto_engine(proposer="ngram")
    try:
        p = e.adaptive.planner.cost_profile
        assert p.verify and set(p.draft) == {1, 4, 16}
        # a lookup in a dict per sequence: far cheaper than the forward it saves
        assert p.t_draft(16) < p.t_verify(16, 1) / 10
    finally:
        e.close()


def test_a_profile_file_is_read_and_off_starts_cold(tmp_path):
    path = tmp_path / "compare.json"     # the shape `bench compare` writes
    path.write_text(json.dumps({"profile": {"verify": [[1, 1, 0.004], [1, 5, 0.006], [8, 1, 0.009]],
                                            "draft": [[1, 0.001]]}}))
    e = auto_engine(drafter=str(TINY_DRAFTER), planner_cost_profile=str(path))
    try:
        assert e.adaptive.planner.cost_profile.verify[(8, 1)] == 0.009
    finally:
        e.close()
    e = auto_engine(drafter=str(TINY_DRAFTER), planner_cost_profile="off")
    try:
        assert e.adaptive.planner.cost_profile is None
    finally:
        e.close()


def test_a_missing_profile_file_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="planner_cost_profile"):
        EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                     planner_cost_profile=str(tmp_path / "nope.json"))


def test_engine_json_paths_are_relative_to_the_file(tmp_path):
    (tmp_path / "profile.json").write_text(json.dumps({"verify": [[1, 1, 0.004]], "draft": [[1, 0.001]]}))
    cfg = EngineConfig.from_dict({"target": str(TINY_TARGET), "planner_cost_profile": "profile.json"},
                                 base_dir=tmp_path)
    assert cfg.planner_cost_profile == str((tmp_path / "profile.json").resolve())
    assert EngineConfig.from_dict({"target": str(TINY_TARGET)}, base_dir=tmp_path).planner_cost_profile == "calibrate"


def test_a_file_that_is_not_a_profile_fails_the_load_with_its_name(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"verify": [[1, 1]]}')          # a point without its time
    with pytest.raises(ConfigError, match="planner_cost_profile: .*bad.json"):
        auto_engine(drafter=str(TINY_DRAFTER), planner_cost_profile=str(bad))
