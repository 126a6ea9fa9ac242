"""`nightdraft bench levels`: its summary, and a short real run in process and through tritonserver."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from client.bench_compare import FullLoad, engine_config, planner_variant
from client.bench_levels import ENGINE_COUNTERS, format_table, summarise


def _run(path, config, level, rep, tok):
    return {"path": path, "config": config, "concurrency": level, "repeat": rep, "tokens_per_s": tok}


def test_the_best_fixed_configuration_includes_plain_decoding_on_every_core():
    runs = [_run("server", "ar-1dev", 16, k, 100.0) for k in (0, 1)] + \
           [_run("server", "ar-2dev", 16, k, t) for k, t in ((0, 190.0), (1, 210.0))] + \
           [_run("server", "psd", 16, k, 150.0) for k in (0, 1)] + \
           [_run("server", "auto", 16, k, t) for k, t in ((0, 171.0), (1, 189.0))]
    (row,) = summarise(runs)
    assert row["best_fixed"] == "ar-2dev"
    assert row["tokens_per_s"]["ar-2dev"] == pytest.approx(200.0)        # the median of the repeats
    assert row["range"]["ar-2dev"] == [190.0, 210.0]
    assert row["auto_over_best_fixed"] == pytest.approx(180.0 / 200.0)
    assert sorted(row["auto_over_best_fixed_by_repeat"]) == pytest.approx([0.9, 0.9])
    assert row["auto_over_ar_all_cores"] == pytest.approx(0.9)


def test_rows_are_kept_apart_by_path_and_concurrency():
    runs = [_run(p, c, lvl, 0, t) for p in ("in-process", "server") for lvl in (1, 4)
            for c, t in (("sd", 10.0 * lvl), ("auto", 12.0 * lvl if p == "server" else 8.0 * lvl))]
    rows = summarise(runs)
    assert [(r["path"], r["concurrency"]) for r in rows] == [("in-process", 1), ("in-process", 4),
                                                              ("server", 1), ("server", 4)]
    assert [round(r["auto_over_best_fixed"], 6) for r in rows] == [0.8, 0.8, 1.2, 1.2]
    assert all("auto_over_ar_all_cores" not in r for r in rows)     # no ar-2dev ran
    table = format_table(rows)
    assert "auto/best" in table and "server" in table and "0.80" in table and "1.20" in table


def test_auto_arm_shares_add_up_the_steps_of_its_repeats():
    runs = [_run("in-process", "sd", 4, 0, 10.0),
            _run("in-process", "auto", 4, 0, 9.0) | {"arm_steps": {"ar": 30, "sd:4": 10}},
            _run("in-process", "auto", 4, 1, 9.5) | {"arm_steps": {"ar": 10, "psd:2": 50}}]
    (row,) = summarise(runs)
    assert row["auto_arm_shares"] == pytest.approx({"psd:2": 0.5, "ar": 0.4, "sd:4": 0.1})
    assert list(row["auto_arm_shares"]) == ["psd:2", "ar", "sd:4"]        # the most played first
    assert "auto played psd:2:50% ar:40% sd:4:10%" in format_table([row])


def test_a_planner_variant_is_weighed_against_auto_repeat_by_repeat_and_is_never_best_fixed():
    runs = [_run("in-process", "ar-2dev", 4, k, t) for k, t in ((0, 100.0), (1, 80.0))] + \
           [_run("in-process", "auto", 4, k, t) for k, t in ((0, 90.0), (1, 60.0))] + \
           [_run("in-process", "auto@prune=false", 4, k, t) | {"arm_steps": {"ar": 3, "sd:2": 1}}
            for k, t in ((0, 99.0), (1, 63.0))]
    (row,) = summarise(runs)
    assert row["best_fixed"] == "ar-2dev"             # 81.0 median: above it, still not fixed
    v = row["variants"]["auto@prune=false"]
    assert v["over_auto_by_repeat"] == pytest.approx([1.1, 1.05])
    assert v["over_auto"] == pytest.approx(1.075)
    assert v["over_best_fixed"] == pytest.approx(81.0 / 90.0)
    assert v["arm_shares"] == pytest.approx({"ar": 0.75, "sd:2": 0.25})
    assert row["auto_over_best_fixed"] == pytest.approx(75.0 / 90.0)
    assert "auto@prune=false: / auto 1.075 (by repeat 1.100 1.050), / best fixed 0.90, played ar:75% sd:2:25%" \
        in format_table([row])


def test_a_planner_variant_names_its_settings_and_a_bad_one_fails_before_anything_loads():
    args = SimpleNamespace(target="t", drafter="d", device="cpu", dtype="float32", kv_cache_mb=64, gamma=4,
                           attention="auto")
    assert planner_variant("auto") is None and planner_variant("sd") is None
    assert planner_variant("auto@plain_settle_steps=3+prune=false+offload_gain=1.1") == {
        "plain_settle_steps": 3, "prune": False, "offload_gain": 1.1}
    with pytest.raises(ValueError, match="auto@KEY=VALUE"):
        planner_variant("auto@prune")
    cfg, _ = engine_config("auto@prune=false", args)
    base, _ = engine_config("auto", args)
    assert cfg == base | {"planner": {"prune": False}}
    # a key that names one of the engine's settings is the engine's
    cfg, _ = engine_config("auto@lend_drafter_cores=false+prune=false", args)
    assert cfg == base | {"lend_drafter_cores": False, "planner": {"prune": False}}
    for bad, why in (("auto@no_such_setting=1", "unknown setting"), ("auto@prune=3", "prune: must be true or false"),
                     ("auto@lend_drafter_cores=sometimes", "lend_drafter_cores: true, false")):
        out = subprocess.run([sys.executable, "-m", "client.cli", "bench", "levels", "--configs", f"ar-2dev,{bad}",
                              "--paths", "in-process", "--json", "/dev/null"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode != 0 and why in out.stderr and "loading" not in out.stderr, out.stderr[-2000:]


def test_a_levels_warm_up_is_left_out_of_its_figures_and_reported_apart():
    warm = {"repeat": -1, "warmup": True}
    runs = [_run("in-process", "ar-2dev", 4, -1, 50.0) | warm,
            _run("in-process", "auto", 4, -1, 20.0) | warm | {"arm_steps": {"sd:2": 30, "ar": 10}},
            _run("in-process", "ar-2dev", 4, 0, 100.0),
            _run("in-process", "auto", 4, 0, 99.0) | {"arm_steps": {"ar": 40}}]
    (row,) = summarise(runs)
    assert row["tokens_per_s"] == {"ar-2dev": 100.0, "auto": 99.0}
    assert row["range"]["auto"] == [99.0, 99.0]
    assert row["auto_over_best_fixed"] == pytest.approx(0.99)
    assert row["auto_arm_shares"] == {"ar": 1.0}
    assert row["warmup_auto_over_best_fixed"] == pytest.approx(0.4)     # auto's first pass at this load
    assert row["auto_warmup_arm_shares"] == pytest.approx({"sd:2": 0.75, "ar": 0.25})
    assert "warm-up: auto/best 0.40, played sd:2:75% ar:25%" in format_table([row])


def _outputs(tokens: int, finished: int, running: int):
    return [SimpleNamespace(new_token_ids=[7] * tokens, finished=i < finished) for i in range(running)]


def test_full_load_ends_when_fewer_requests_than_the_concurrency_are_left():
    """8 requests at concurrency 4, one token a step each: requests finish at different steps
    (as speculation lets them), and the run's throughput at full load ends with the step after
    which fewer than 4 are left to finish; the drain's slower steps after it are not counted."""
    load = FullLoad(requests=8, concurrency=4)
    load.observe(_outputs(1, finished=0, running=4), now=1.0)
    load.observe(_outputs(1, finished=2, running=4), now=2.0)     # two finish, two take their place
    load.observe(_outputs(1, finished=2, running=4), now=3.0)     # four left: still the full load
    assert load.until is None
    load.observe(_outputs(1, finished=1, running=4), now=4.0)     # three left: the drain begins
    load.observe(_outputs(1, finished=1, running=3), now=9.0)     # a slow step of the drain
    assert (load.until, load.tokens, load.finished) == (4.0, 16, 5)
    assert load.tokens_per_s(start=0.0) == pytest.approx(4.0)


def test_plain_decoding_in_lockstep_runs_at_full_load_to_its_last_step():
    load = FullLoad(requests=8, concurrency=4)
    for step in range(6):
        load.observe(_outputs(1, finished=4 if step in (2, 5) else 0, running=4), now=step + 1.0)
    assert load.until == 6.0 and load.tokens == 24
    fewer = FullLoad(requests=2, concurrency=4)       # fewer requests than the concurrency: the first to finish ends it
    fewer.observe(_outputs(1, finished=1, running=2), now=1.0)
    assert fewer.until == 1.0 and fewer.tokens == 2


@pytest.mark.slow
def test_bench_levels_runs_auto_beside_the_fixed_modes_on_both_paths(tmp_path, tritonserver_runnable):
    out = tmp_path / "levels.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client.cli", "bench", "levels", "--configs", "ar-2dev,sd,auto",
         "--concurrency", "2", "--repeats", "1", "--max-tokens", "6", "--requests-per-level", "4",
         "--pa-window-s", "1", "--json", str(out)],     # perf_analyzer, run once per configuration
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] is True
    # each configuration warmed at the level's concurrency first (4 requests), then measured once
    assert sorted((r["path"], r["config"], r.get("warmup", False)) for r in report["runs"]) == sorted(
        (p, c, w) for p in ("in-process", "server") for c in ("ar-2dev", "sd", "auto") for w in (True, False))
    assert all(r["tokens_per_s"] > 0 for r in report["runs"])
    # in process at full load (bench_compare.FullLoad), the whole run's beside it
    assert all(r["tokens_per_s_whole_run"] > 0 and 0 < r["full_load_token_share"] <= 1
               for r in report["runs"] if r["path"] == "in-process")
    assert all(r["tokens_per_s"] == r["tokens_per_s_whole_run"]      # a warm-up is one wave: measured whole
               for r in report["runs"] if r["path"] == "in-process" and r.get("warmup"))
    # measured by perf_analyzer; a warm-up is a fixed number of requests from gRPC streams
    assert {(r["client"], r.get("warmup", False)) for r in report["runs"] if r["path"] == "server"} == {
        ("perf_analyzer", False), ("python", True)}
    # the engine's counters around each run, on both paths: what ran, and what else used the cores
    # (the drafter's worker; recompilation, which cannot happen here: the suite compiles nothing)
    runs = report["runs"]
    assert all(set(r["engine"]) == set(ENGINE_COUNTERS) for r in runs)
    assert all(r["engine"]["steps"] > 0 for r in runs)
    assert all(r["engine"]["draft_tokens"] > 0 and r["engine"]["drafter_cpu_s"] > 0
               for r in runs if r["config"] == "sd")
    assert all(r["engine"]["draft_tokens"] == 0 and r["engine"]["drafter_cpu_s"] == 0
               for r in runs if r["config"] == "ar-2dev")
    assert all(r["engine"]["compiled_graphs"] == 0 for r in runs)
    for row in report["rows"]:
        tok = row["tokens_per_s"]
        best = max(("ar-2dev", "sd"), key=tok.get)
        assert row["best_fixed"] == best
        assert row["auto_over_best_fixed"] == pytest.approx(tok["auto"] / tok[best])
    (auto_row,) = [r for r in report["rows"] if r["path"] == "in-process"]
    assert sum(auto_row["auto_arm_shares"].values()) == pytest.approx(1.0)   # its steps were counted
    # the cost profile auto's planner started from (its calibration at startup), for reading
    # its exploration against; the fixed configurations have none
    assert list(report["planner_cost_profiles"]) == ["auto"]
    assert report["planner_cost_profiles"]["auto"]["verify"] and report["planner_cost_profiles"]["auto"]["draft"]
    assert "auto/best" in proc.stdout
    assert out.with_suffix(".png").is_file()


@pytest.mark.slow
def test_a_failure_through_the_server_keeps_the_runs_measured_before_it(tmp_path, tritonserver_runnable):
    """The result file is rewritten after every run: when the server path fails (here
    perf_analyzer is missing), the runs already measured are on disk, marked incomplete."""
    out = tmp_path / "levels.json"
    proc = subprocess.run(
        [sys.executable, "-m", "client.cli", "bench", "levels", "--configs", "ar-2dev",
         "--concurrency", "2", "--repeats", "1", "--max-tokens", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
        env=os.environ | {"PERF_ANALYZER": str(tmp_path / "no-perf-analyzer")})
    assert proc.returncode != 0
    assert "perf_analyzer failed" in proc.stderr
    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert [(r["path"], r["config"], r.get("warmup", False)) for r in report["runs"]] == [
        ("in-process", "ar-2dev", True), ("in-process", "ar-2dev", False),
        ("server", "ar-2dev", True)]         # the server's warm-up (gRPC streams) ran before it failed
    assert report["rows"][0]["tokens_per_s"]["ar-2dev"] > 0


def test_no_planner_setting_shares_a_name_with_an_engine_setting():
    """`split_variant` sends a variant's key to the engine when the engine has a setting of that
    name: a planner setting of the same name could never be set from `bench levels`."""
    from dataclasses import fields

    from backend.engine.config import EngineConfig
    from planner import PlannerConfig
    assert not {f.name for f in fields(EngineConfig)} & {f.name for f in fields(PlannerConfig)}
