"""Mode auto's warm start: the cost profile the planner starts from is measured at load (or read
from a file, or left out), over the batch sizes and draft lengths the planner can choose."""
from __future__ import annotations

import json

import pytest

from backend.engine.config import ConfigError, EngineConfig
from backend.engine.engine import Engine
from model_factory import TINY_DRAFTER, TINY_TARGET


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
        # 80 tokens in one forward cost more than 1: a measurement, not a constant
        assert p.t_verify(16, 5) > p.t_verify(1, 1)
    finally:
        e.close()


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
