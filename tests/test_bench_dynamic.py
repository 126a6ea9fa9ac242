"""`nightdraft bench dynamic`: its accounting, and short real runs in-process and via tritonserver."""
from __future__ import annotations

import collections
import json

import pytest

from client.dynamic_report import (METRICS, Record, RunResult, Targets, format_table, goals, median_summary, mode_shares,
                                   noise, regret, summarise)
from client.load_shapes import SHAPES, phases, schedule

KEYS = {"throughput_tok_s", "goodput_tok_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s",
        "tpot_p50_s", "tpot_p99_s", "e2e_mean_s", "e2e_p99_s", "mode_shares"}


def test_requests_count_in_the_phase_they_arrived_in():
    bounds = [(0.0, 10.0), (10.0, 20.0)]
    records = [Record(0, 1.0, 1.5, 3.0, 10), Record(0, 9.0, 9.5, 12.0, 10),    # finishes in phase 1
               Record(1, 11.0, 13.0, 25.0, 40), Record(1, 12.0, None, None, 0, error="boom")]
    s = summarise(RunResult(records, bounds))
    low, high = s["phases"]
    assert low["requests"] == 2 and low["failed"] == 0
    assert low["throughput_tok_s"] == pytest.approx(20 / 12.0)        # until its last request ended
    assert low["ttft_mean_s"] == pytest.approx(0.5)
    assert low["e2e_mean_s"] == pytest.approx((2.0 + 3.0) / 2)
    assert low["tpot_mean_s"] == pytest.approx((1.5 / 9 + 2.5 / 9) / 2)
    assert high["requests"] == 1 and high["failed"] == 1
    assert high["throughput_tok_s"] == pytest.approx(40 / 15.0)
    assert s["overall"]["throughput_tok_s"] == pytest.approx(60 / 24.0)
    assert set(s["overall"]) >= KEYS


def test_goodput_counts_only_requests_that_met_both_targets():
    records = [Record(0, 0.0, 0.2, 1.2, 11),        # TTFT 0.2, TPOT 0.1: meets both
               Record(0, 0.0, 0.9, 1.9, 11),        # TTFT 0.9: too late
               Record(0, 0.0, 0.1, 4.1, 11),        # TPOT 0.4: too slow
               Record(0, 0.0, 0.3, 0.3, 1)]         # one token: no TPOT, its TTFT meets the target
    m = summarise(RunResult(records, [(0.0, 2.0)]), Targets(ttft_s=0.5, tpot_s=0.2))["phases"][0]
    assert m["throughput_tok_s"] == pytest.approx(34 / 4.1)
    assert m["goodput_tok_s"] == pytest.approx(12 / 4.1)
    assert m["tpot_p50_s"] == pytest.approx(0.1) and m["tpot_p99_s"] == pytest.approx(0.4)
    assert summarise(RunResult(records, [(0.0, 2.0)]))["phases"][0]["goodput_tok_s"] == m["throughput_tok_s"]


def test_each_quarter_of_a_phase_reports_the_share_of_its_arrivals_that_met_the_targets():
    targets = Targets(ttft_s=0.5, tpot_s=0.2)
    records = [Record(0, 0.5, 0.7, 1.7, 11),        # 1st quarter: meets both
               Record(0, 1.0, 1.9, 2.9, 11),        # 1st quarter: TTFT 0.9, too late
               Record(0, 2.5, 2.6, 3.6, 11),        # 2nd quarter: meets both
               Record(0, 7.9, None, None, 0, error="boom")]   # 4th quarter: failed
    s = summarise(RunResult(records, [(0.0, 8.0)]), targets)
    assert s["phases"][0]["met_by_quarter"] == [0.5, 1.0, None, 0.0]


def test_mode_shares_are_time_weighted_within_the_phase():
    tl = [{"t": 0.0, "mode": "sd", "gamma": 3}, {"t": 1.0, "mode": "ar", "gamma": 0},
          {"t": 4.0, "mode": "psd", "gamma": 2}]
    assert mode_shares(tl, 0.0, 5.0) == pytest.approx({"ar": 0.6, "psd2": 0.2, "sd3": 0.2})
    assert mode_shares(tl, 2.0, 4.0) == {"ar": 1.0}
    assert mode_shares([], 0.0, 1.0) == {}


@pytest.mark.parametrize("shape", SHAPES)
def test_load_shapes_ask_for_the_demand_they_declare(shape):
    # demand in tokens: each phase's arrivals ask for rate_x x capacity x max_tokens tokens per second
    capacity, max_tokens, base = 40.0, 32, 30.0
    arrivals, bounds, plan = schedule(shape, ["a", "b"], capacity, max_tokens, base, seed=1)
    assert [round(hi - lo, 6) for lo, hi in bounds] == [round(base * ph.length_x, 6) for ph in plan]
    assert all(a.t < b.t for a, b in zip(arrivals, arrivals[1:]))
    for i, (ph, (lo, hi)) in enumerate(zip(plan, bounds)):
        mine = [a for a in arrivals if a.phase == i]
        assert all(lo <= a.t < hi for a in mine)
        asked = sum(a.max_tokens for a in mine) / (hi - lo)
        want = ph.rate_x * capacity * max_tokens
        assert asked == pytest.approx(want, rel=0.3 if want * (hi - lo) > 5000 else 0.6), ph
        assert {a.max_tokens for a in mine} <= {max(1, round(x * max_tokens)) for x, _ in ph.lengths}
    if shape == "mixed":
        lengths = collections.Counter(a.max_tokens for a in arrivals)
        assert set(lengths) == {8, 64}
        assert lengths[8] / len(arrivals) == pytest.approx(0.75, abs=0.06)
    if shape == "bursty":
        assert [ph.name for ph in plan] == ["off", "on"] * 3
        assert phases("bursty", seed=1) == plan and phases("bursty", seed=2) != plan
    if shape == "ramp":
        assert [ph.rate_x for ph in plan] == sorted(ph.rate_x for ph in plan)


def test_unknown_load_shape_is_refused():
    with pytest.raises(ValueError, match="unknown load shape 'sine'.*steps"):
        phases("sine")


def test_goal_rows():
    def cfg(good_phases, e2e):
        rows = [{"throughput_tok_s": g, "goodput_tok_s": g, "ttft_mean_s": e2e / 4, "e2e_mean_s": e2e}
                for g in good_phases]
        return {"phases": rows, "overall": {"throughput_tok_s": sum(good_phases), "goodput_tok_s": sum(good_phases),
                                            "ttft_mean_s": e2e / 4, "e2e_mean_s": e2e}}
    configs = {"ar": cfg([10, 50], 2.0), "sd": cfg([20, 30], 1.0), "adaptive": cfg([19, 55], 0.8),
               "adaptive_no_offload": cfg([19, 40], 0.7)}
    report = {"configs": configs, "regret": regret(configs, 2)}
    g = goals(report)
    assert g["adaptive"]["goodput_vs_best_fixed"] == pytest.approx(74 / 60)      # vs ar's 60
    assert g["adaptive"]["worst_phase_goodput_vs_best_fixed"] == pytest.approx(19 / 20)
    assert g["adaptive"]["e2e_vs_sd"] == pytest.approx(0.8)
    assert g["offload_worst_phase"]["e2e_mean_s"] == pytest.approx(0.8 / 0.7)
    assert g["offload_worst_phase"]["offloads"] is None          # not recorded


def test_the_offload_row_says_when_the_planner_never_offloaded():
    def cfg(ttft, offloads=None):
        row = {"throughput_tok_s": 10.0, "goodput_tok_s": 10.0, "ttft_mean_s": ttft, "e2e_mean_s": 2 * ttft,
               "ttft_p99_s": ttft, "tpot_mean_s": 0.01, "tpot_p99_s": 0.01, "e2e_p99_s": 2 * ttft}
        c = {"phases": [dict(row)], "overall": dict(row)}
        if offloads is not None:
            c["offloads"] = offloads
        return c

    def offload_line(offloads):
        configs = {"sd": cfg(0.1), "adaptive": cfg(0.13, offloads), "adaptive_no_offload": cfg(0.1, [0, 0])}
        report = {"configs": configs, "regret": regret(configs, 1), "phases": [{"name": "low"}]}
        assert goals(report)["offload_worst_phase"]["offloads"] == sum(offloads)
        return next(line for line in format_table(report).splitlines() if line.startswith("offloading"))

    assert offload_line([0, 0]) == ("offloading, worst phase against not offloading: no offload in any "
                                    "repeat, nothing to compare (TTFT x1.30, e2e x1.30 is the runs' noise)")
    assert offload_line([1, 0]).endswith("TTFT x1.30, e2e x1.30 (<= 1)")


def test_the_report_says_how_each_overload_was_weighed_for_an_offload():
    from planner.offload_policy import OffloadWeighing
    stayed, left = OffloadWeighing(100.0), OffloadWeighing(200.0)
    for t, gain in ((100.0, None), (100.2, 0.8), (100.4, 0.9)):
        stayed.add(t, gain, False, False, 0.9)
    left.add(200.0, 0.95, False, True, 1.3)
    left.probed = True
    left.add(200.5, 1.2, True, True, 1.4)
    report = {"configs": {}, "regret": regret({}, 1), "phases": [{"name": "low"}],
              "planner": {"config": "adaptive", "switches": 3, "offloads": 1, "reloads": 0,
                          "offload_weighings": [[stayed.summary()], [left.summary()]]}}
    lines = [line for line in format_table(report).splitlines() if "weighed for an offload" in line]
    assert lines == [
        "  repeat 1, an overload weighed for an offload: 3 weighs, predicted gain 0.80 / 0.90 / 0.90 "
        "(min / median / max), demand / capacity up to 0.90; short of: no_estimate 1, gain 2, demand 3; "
        "the drafter stayed",
        "  repeat 2, an overload weighed for an offload: 2 weighs, predicted gain 0.95 / 1.20 / 1.20 "
        "(min / median / max), demand / capacity up to 1.40; short of: gain 1; plain decoding probed "
        "settled; offloaded 0.50 s after the first weigh"]


def _summary(tp, ttft, e2e):
    row = {"requests": 1, "failed": 0, "throughput_tok_s": tp, "goodput_tok_s": tp, "ttft_mean_s": ttft,
           "ttft_p50_s": ttft, "ttft_p99_s": ttft, "tpot_mean_s": 0.01, "tpot_p50_s": 0.01,
           "tpot_p99_s": 0.01, "e2e_mean_s": e2e, "e2e_p99_s": e2e}
    return {"phases": [dict(row), dict(row)], "overall": dict(row)}


def test_medians_noise_and_regret():
    runs = {"ar": [_summary(100, 1.0, 2.0), _summary(110, 1.2, 2.2), _summary(90, 0.8, 1.8)],
            "sd": [_summary(120, 0.5, 1.0), _summary(120, 0.5, 1.0)],
            "adaptive": [_summary(130, 0.4, 0.9)]}
    med = {n: median_summary(rs) for n, rs in runs.items()}
    assert med["ar"]["phases"][0]["throughput_tok_s"] == 100
    assert med["ar"]["overall"]["ttft_mean_s"] == 1.0
    # relative spreads: ar 0.2 (tok/s, e2e) and 0.4 (TTFT) per part, sd 0: the median of all
    assert noise(runs) == pytest.approx(0.1, abs=0.02)
    assert noise({"ar": runs["ar"][:1]}) is None
    r = regret(med, 2)["adaptive"]
    assert r["per_phase"][0]["throughput_tok_s"] == {"best_fixed": "sd", "ratio": pytest.approx(130 / 120)}
    assert r["per_phase"][1]["ttft_mean_s"]["ratio"] == pytest.approx(0.8)
    assert r["overall_vs"]["ar"]["e2e_mean_s"] == pytest.approx(0.45)


def _run_cli(tmp_path, *extra):
    from client.cli import main
    out = tmp_path / "dyn.json"
    rc = main(["bench", "dynamic", "--scale", "0.05", "--capacity", "6", "--max-tokens", "12",
               "--kv-blocks", "24", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text()), out


def _check_report(report, names, n_phases=3):
    assert set(report["configs"]) == set(names)
    n_req = sum(p["requests"] for p in report["phases"])
    assert n_req > 0
    for name in names:
        res = report["configs"][name]
        assert len(res["phases"]) == n_phases and all(set(p) >= KEYS for p in res["phases"])
        # every request got the tokens its arrival asked for
        assert res["overall"]["tokens"] == sum(p["tokens_asked"] for p in report["phases"])
        assert set(res["overall"]) >= KEYS
        assert res["overall"]["requests"] == n_req and res["overall"]["failed"] == 0
        assert res["overall"]["throughput_tok_s"] > 0 and res["overall"]["ttft_mean_s"] > 0
    p = report["planner"]
    assert {"switches", "offloads", "reloads", "timeline"} <= set(p)
    assert p["timeline"] and {"t", "mode", "gamma", "drafter"} <= set(p["timeline"][0])


@pytest.mark.slow
def test_bench_dynamic_in_process(tmp_path):
    names = ["ar", "adaptive", "adaptive@policy_check=false"]
    report, out = _run_cli(tmp_path, "--configs", ",".join(names), "--repeats", "2", "--shape", "mixed")
    _check_report(report, names, n_phases=2)
    # the variant ran with its setting, adaptive with the default, and both are weighed against the fixed
    assert [s["policy_check"]["enabled"] for s in report["configs"]["adaptive@policy_check=false"]
            ["planner_summaries"]] == [False, False]
    assert [s["policy_check"]["enabled"] for s in report["configs"]["adaptive"]["planner_summaries"]] == [True] * 2
    assert set(report["regret"]) == {"adaptive", "adaptive@policy_check=false"}
    assert report["shape"] == "mixed" and {"ttft_s", "tpot_s"} == set(report["targets"])
    assert sum(report["configs"]["adaptive"]["overall"]["mode_shares"].values()) == pytest.approx(1.0)
    assert "adaptive" in report["goals"]
    assert report["where"] == "in-process" and report["repeats"] == 2
    assert len(report["configs"]["ar"]["runs"]) == 2
    assert report["noise"] is not None
    assert out.with_suffix(".png").is_file()


@pytest.mark.slow
def test_bench_dynamic_through_tritonserver(tmp_path):
    from client.launcher import LauncherError, find_tritonserver
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")
    report, _ = _run_cli(tmp_path, "--configs", "sd,adaptive", "--server")
    _check_report(report, ["sd", "adaptive"])
    assert report["where"] == "server"
    # the server's gauges were followed: the fixed sd config speculated throughout
    tl = report["configs"]["sd"]["timeline"]
    assert any(e["mode"] == "sd" and e["gamma"] == 3 for e in tl)


def test_plain_decoding_on_every_core_is_a_fixed_baseline(tmp_path):
    # A user without a drafter runs plain decoding on all cores: it must count as a fixed
    # configuration adaptive is compared with, configured with one thread per core.
    import argparse
    import os
    from client.bench_dynamic import engine_config
    from model_factory import TINY_DRAFTER, TINY_TARGET
    args = argparse.Namespace(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), kv_blocks=64, seed=0,
                              gamma=3, gamma_max=4, planner=None)
    cores = sorted(os.sched_getaffinity(0))
    cfg = engine_config("ar_all_cores", args, cores)
    assert cfg["mode"] == "ar" and cfg["num_threads"] == len(cores)
    assert engine_config("ar", args, cores)["num_threads"] == 1

    def cfg_with(goodput):
        phase = {"throughput_tok_s": goodput, "goodput_tok_s": goodput, "ttft_mean_s": 1.0, "e2e_mean_s": 1.0}
        return {"phases": [phase], "overall": dict(phase)}
    configs = {"ar": cfg_with(50.0), "ar_all_cores": cfg_with(90.0), "sd": cfg_with(60.0),
               "adaptive": cfg_with(81.0)}
    r = regret(configs, 1)["adaptive"]
    assert r["goodput_vs_best_fixed"] == {"best_fixed": "ar_all_cores", "ratio": pytest.approx(0.9)}
    assert r["per_phase"][0]["goodput_tok_s"]["best_fixed"] == "ar_all_cores"


def test_an_adaptive_variant_carries_its_settings_and_is_weighed_like_adaptive_never_as_a_fixed_baseline():
    import argparse
    import subprocess
    import sys
    from client.bench_dynamic import engine_config
    from model_factory import TINY_DRAFTER, TINY_TARGET
    args = argparse.Namespace(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), kv_blocks=64, seed=0,
                              gamma=3, gamma_max=4, planner='{"prune": false}')
    base = engine_config("adaptive", args, [0, 1])
    cfg = engine_config("adaptive@policy_check=true+lend_drafter_cores=false", args, [0, 1])
    assert cfg == base | {"lend_drafter_cores": False, "planner": {"prune": False, "policy_check": True}}
    no_offload = engine_config("adaptive_no_offload@policy_check=true", args, [0, 1])
    assert no_offload["offload"] is False and no_offload["planner"]["policy_check"] is True
    with pytest.raises(ValueError, match="unknown config"):
        engine_config("sd@policy_check=true", args, [0, 1])

    def cfg_with(goodput):
        phase = dict.fromkeys(METRICS, 1.0) | {"throughput_tok_s": goodput, "goodput_tok_s": goodput}
        return {"phases": [phase], "overall": dict(phase)}
    configs = {"sd": cfg_with(60.0), "adaptive": cfg_with(54.0), "adaptive@policy_check=true": cfg_with(90.0)}
    report = {"configs": configs, "regret": regret(configs, 1), "phases": [{"name": "high"}]}
    g = goals(report)
    # the variant is above sd, yet sd stays adaptive's best fixed configuration
    assert g["adaptive"]["goodput_vs_best_fixed"] == pytest.approx(0.9)
    assert g["adaptive@policy_check=true"]["goodput_vs_best_fixed"] == pytest.approx(1.5)
    assert "goals, adaptive@policy_check=true: goodput x1.50" in format_table(report)
    # a bad setting fails before any capacity probe or run
    for bad, why in (("adaptive@no_such_setting=1", "unknown setting"), ("adaptive@prune=3", "prune: must be true")):
        out = subprocess.run([sys.executable, "-m", "client.cli", "bench", "dynamic", "--configs", f"ar,{bad}",
                              "--json", "/dev/null"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and why in out.stderr and "capacity" not in out.stderr, out.stderr[-2000:]


def test_a_server_started_from_a_pinned_thread_runs_on_the_cores_it_is_given(tmp_path, tritonserver_runnable):
    # bench dynamic pins its own thread to the target's core before it starts a server per
    # configuration: a child inherits that one core unless the launcher is given the machine's,
    # and then target, drafter worker and front end would all share it.
    import os
    from client.launcher import TritonServer, free_port
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores to pin one")
    (tmp_path / "repo").mkdir()

    def started(**kw):
        return TritonServer(tmp_path / "repo", http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), models=[], log_file=tmp_path / "log", **kw).start()
    os.sched_setaffinity(0, cores[:1])
    try:
        given, inherited = started(cores=cores), started()
    finally:
        os.sched_setaffinity(0, cores)
    try:
        assert sorted(os.sched_getaffinity(given.proc.pid)) == cores
        assert sorted(os.sched_getaffinity(inherited.proc.pid)) == cores[:1]
    finally:
        given.stop(timeout_s=20)
        inherited.stop(timeout_s=20)
