"""`nightdraft bench dynamic`: its accounting, and short real runs in-process and via tritonserver."""
from __future__ import annotations

import json

import pytest

from client.dynamic_report import Record, RunResult, median_summary, noise, regret, summarise

KEYS = {"throughput_tok_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "e2e_mean_s", "e2e_p99_s"}


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


def _summary(tp, ttft, e2e):
    row = {"requests": 1, "failed": 0, "throughput_tok_s": tp, "ttft_mean_s": ttft, "ttft_p99_s": ttft,
           "tpot_mean_s": 0.01, "e2e_mean_s": e2e, "e2e_p99_s": e2e}
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


def _check_report(report, names):
    assert set(report["configs"]) == set(names)
    n_req = sum(p["requests"] for p in report["phases"])
    assert n_req > 0
    for name in names:
        res = report["configs"][name]
        assert len(res["phases"]) == 3 and all(set(p) >= KEYS for p in res["phases"])
        assert set(res["overall"]) >= KEYS
        assert res["overall"]["requests"] == n_req and res["overall"]["failed"] == 0
        assert res["overall"]["throughput_tok_s"] > 0 and res["overall"]["ttft_mean_s"] > 0
    p = report["planner"]
    assert {"switches", "offloads", "reloads", "timeline"} <= set(p)
    assert p["timeline"] and {"t", "mode", "gamma", "drafter"} <= set(p["timeline"][0])


@pytest.mark.slow
def test_bench_dynamic_in_process(tmp_path):
    report, out = _run_cli(tmp_path, "--configs", "ar,adaptive", "--repeats", "2")
    _check_report(report, ["ar", "adaptive"])
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
