"""`nightdraft bench compare` end to end on a tiny run: the n-gram rows beside plain decoding."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_compare(tmp_path, *args) -> tuple[dict, subprocess.CompletedProcess]:
    """`nightdraft bench compare` at concurrency 1, one request per level: its rows by config."""
    out = tmp_path / "compare.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client.cli", "bench", "compare", "--concurrency", "1",
         "--requests-per-level", "1", "--json", str(out), *args],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {r["config"]: r for r in json.loads(out.read_text())["rows"]}, proc


def test_bench_compare_puts_ngram_beside_plain_decoding(tmp_path):
    rows, proc = run_compare(tmp_path, "--configs", "ar-1dev,ngram,ngram-auto", "--prompts", "edit",
                             "--max-tokens", "16")
    assert set(rows) == {"ar-1dev", "ngram", "ngram-auto"}
    assert rows["ar-1dev"]["over_ar-1dev"] == 1.0
    # greedy edits repeat their prompt: n-gram drafts are made and some accepted
    assert rows["ngram"]["acceptance_rate"] > 0 and rows["ngram"]["tokens_per_target_call"] > 1
    assert rows["ngram"]["over_ar-1dev"] == rows["ngram"]["tokens_per_s"] / rows["ar-1dev"]["tokens_per_s"]
    assert "x ar1" in proc.stdout and "ngram-auto" in proc.stdout
    assert (tmp_path / "compare.png").is_file()


def test_bench_compare_puts_draft_ahead_beside_sd(tmp_path):
    rows, _ = run_compare(tmp_path, "--configs", "sd,sd-ahead", "--max-tokens", "24", "--gamma", "2")
    ahead = rows["sd-ahead"]
    assert ahead["over_without_ahead"] == ahead["tokens_per_s"] / rows["sd"]["tokens_per_s"]
    assert 0 < ahead["ahead_hit_rate"] <= 1 and ahead["ahead_by_accepted"]
    assert sum(r["rounds"] for r in ahead["ahead_by_accepted"].values()) > 0
    assert rows["sd"].get("ahead_hit_rate") is None        # sd itself never drafts ahead
    # the prediction's profile is calibrated as the planner's is: a proposal's call priced once
    profile = json.loads((tmp_path / "compare.json").read_text())["profile"]
    assert {b for b, _ in profile["draft_call"]} == {b for b, _ in profile["draft"]} == {1, 2}


def test_every_worker_gets_the_drafter_core_however_many_engines_share_the_process():
    # Each engine with a worker pins this process to the target's cores; an engine built after it
    # used to plan its worker from that one core, onto the target's own.
    import argparse
    import os
    from client.bench_compare import build_engines
    from model_factory import TINY_DRAFTER, TINY_TARGET
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    args = argparse.Namespace(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), device="cpu",
                              dtype="float32", kv_cache_mb=16, gamma=2)
    engines = build_engines(args, ["sd", "psd", "sd-ahead"])
    try:
        for name, (engine, _) in engines.items():
            place = engine._placement
            assert place.drafter_cores == cores[-1:] and cores[-1] not in place.target_cores, name
    finally:
        for engine, _ in engines.values():
            engine.close()
        os.sched_setaffinity(0, cores)


def test_cores_are_not_lent_when_the_drafter_has_none_of_its_own():
    import os
    import torch
    from backend.speculation.placement import CpuPlacement
    cores = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, cores[:1])            # one core: drafter and target share it
        place = CpuPlacement("cpu", 1)
        assert place.drafter_cores == place.target_cores == cores[:1]
        place.lend_drafter_cores()
        assert torch.get_num_threads() == 1 and not place.lent   # no second thread on the same core
        place.restore()
    finally:
        os.sched_setaffinity(0, cores)


def test_the_prediction_takes_the_alpha_that_gives_the_measured_tokens_per_call():
    # The share of drafted tokens accepted is not the per-position alpha the cost model takes
    # (at gamma 4, 3.48 tokens per call is alpha 0.82 but an accepted share of 0.62).
    from client.bench_compare import summarise
    from planner.cost_model import CostProfile, expected_tokens_per_call, predict
    profile = CostProfile({(b, n): 1e-3 * (1 + 0.1 * b * n) for b in (1, 4) for n in (1, 5)},
                          {b: 2e-4 * (1 + 0.1 * b) for b in (1, 4)})
    e = expected_tokens_per_call(0.82, 4)
    run = {"tokens_per_s": 100.0, "acceptance_rate": (e - 1) / 4, "tokens_per_target_call": e}
    rows = {r["config"]: r for r in summarise({"sd": {1: [run]}}, profile, 4, [1])}
    assert rows["sd"]["predicted_tokens_per_s"] == pytest.approx(predict("sd", 1, 4, 0.82, profile).tokens_per_s,
                                                                rel=1e-6)
    assert rows["sd"]["predicted_tokens_per_s"] != pytest.approx(
        predict("sd", 1, 4, (e - 1) / 4, profile).tokens_per_s, rel=1e-3)
