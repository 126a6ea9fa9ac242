"""The profile and what it stands on: the linear kernels' choice and the forward's floor."""
import json

import pytest
import torch

from backend.model.floor import forward_floor
from backend.model.linear import ROW_LADDER, Linear, drop_packed, pack_linears, packing_supported
from backend.model.loader import load_model
from model_factory import TINY_DRAFTER


@pytest.fixture(scope="module")
def drafter():
    return load_model(TINY_DRAFTER, device="cpu", dtype=torch.float32)


def test_both_kernels_compute_the_same_linear(drafter, tmp_path, monkeypatch):
    if not packing_supported(drafter.layers[0].mlp.down_proj.weight):
        pytest.skip("oneDNN is not available in this torch build")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lin = drafter.layers[0].mlp.down_proj
    x = torch.randn(5, lin.in_features)
    with torch.inference_mode():
        plain = lin(x)
        verdict = pack_linears(drafter)                 # timed, and the verdict cached
        assert set(verdict) == set(ROW_LADDER) and set(verdict.values()) <= {"packed", "mkl"}
    cached = list((tmp_path / "nightdraft" / "kernels").glob("*.json"))
    assert len(cached) == 1 and len(json.loads(cached[0].read_text())) == len(ROW_LADDER)
    # Whatever the timing chose: a cached verdict of "packed" everywhere puts the packed kernel
    # on every row count, and it computes what F.linear computes; "mkl" everywhere drops it.
    cached[0].write_text(json.dumps([True] * len(ROW_LADDER)))
    with torch.inference_mode():
        assert set(pack_linears(drafter).values()) == {"packed"} and lin.packed is not None
        assert torch.allclose(lin(x), plain, atol=1e-5, rtol=1e-5)
    cached[0].write_text(json.dumps([False] * len(ROW_LADDER)))
    with torch.inference_mode():
        assert set(pack_linears(drafter).values()) == {"mkl"} and lin.packed is None
        assert torch.equal(lin(x), plain)
    drop_packed(drafter)
    assert all(m.packed is None for m in drafter.modules() if isinstance(m, Linear))


def test_each_thread_count_runs_the_kernels_measured_at_that_count(drafter, tmp_path, monkeypatch):
    """A target packed at one thread and also run on the drafter's lent cores (two threads)
    uses, on each forward, the verdicts of the thread count in force: one thread's verdicts for
    the bundled target chose MKL for most row counts, two threads' the packed kernel for all
    (benchmarks/results/lent-kernels/)."""
    from backend.model.linear import add_thread_verdicts
    if not packing_supported(drafter.layers[0].mlp.down_proj.weight):
        pytest.skip("oneDNN is not available in this torch build")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels = tmp_path / "nightdraft" / "kernels"
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    lin, x = drafter.layers[0].mlp.down_proj, torch.randn(4, drafter.layers[0].mlp.down_proj.in_features)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            kernels.mkdir(parents=True)
            pack_linears(drafter, reps=1)                      # measured, then set: MKL at one thread
            (one,) = kernels.glob("*.json")
            one.write_text(json.dumps([False] * len(ROW_LADDER)))
            assert set(pack_linears(drafter).values()) == {"mkl"} and lin.packed is None
            torch.set_num_threads(2)
            add_thread_verdicts(drafter, reps=1)               # measured at two threads, then set: packed
            (two,) = set(kernels.glob("*.json")) - {one}
            two.write_text(json.dumps([True] * len(ROW_LADDER)))
            assert set(add_thread_verdicts(drafter).values()) == {"packed"} and lin.packed is not None
            plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
            calls.clear()                                      # (the measurements called it too)
            assert torch.allclose(lin(x), plain, atol=1e-5, rtol=1e-5) and len(calls) == 1
            torch.set_num_threads(1)
            assert torch.equal(lin(x), plain) and len(calls) == 1      # one thread: MKL, as measured
    finally:
        torch.set_num_threads(threads)
        drop_packed(drafter)


def test_the_floor_is_below_a_real_forward(drafter):
    from backend.model.kv_cache import PagedKVCache
    kv = PagedKVCache.for_model(drafter.config, 1 << 20, block_size=16)
    assert kv.ensure_capacity("s", 40)
    floor = forward_floor(drafter, rows=8)
    import time
    with torch.inference_mode():
        ids = torch.randint(0, drafter.config.vocab_size, (8,))
        times = []
        for _ in range(5):
            meta = drafter.prepare(kv, ["s"], [32], [8])
            t0 = time.perf_counter()
            drafter(ids, meta, kv.kv)
            times.append(time.perf_counter() - t0)
    assert 0 < floor < min(times), "the matmuls alone took longer than the whole forward"


@pytest.mark.slow
def test_bench_profile_reports_every_phase_beside_its_floor(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "client.cli", "bench", "profile", "--configs", "ar,sd", "--concurrency", "1,4",
           "--max-tokens", "12", "--requests-per-level", "2", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["config"], r["concurrency"]) for r in rows} == {("ar", 1), ("ar", 4), ("sd", 1), ("sd", 4)}
    for r in rows:
        assert r["steady_steps"] > 0 and r["target_floor_ms"] > 0
        assert r["step_over_floor"] > 1.0, "a step faster than its matmuls: the floor is wrong"
        assert set(r["phases_ms"]) == {"schedule", "draft", "prepare", "forward", "verify", "commit", "other"}
        assert abs(sum(r["phases_ms"].values()) - r["step_ms"]) < 0.25 * r["step_ms"]
    assert all(r["drafter_step_over_floor"] > 1.0 for r in rows if r["config"] == "sd")
    assert out.with_suffix(".png").is_file()
    assert "| ar | 1 |" in res.stdout


@pytest.mark.slow
def test_bench_profile_drives_the_server_with_perf_analyzer(tmp_path):
    """--server-client perf_analyzer: the C++ load generator drives a real tritonserver and the
    throughput comes from the model's own token counters around its run."""
    import subprocess
    import sys
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "client.cli", "bench", "profile", "--configs", "ar", "--concurrency", "2",
           "--max-tokens", "8", "--requests-per-level", "2", "--server", "--server-client", "perf_analyzer",
           "--pa-window-s", "1", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    served = [r for r in json.loads(out.read_text())["rows"] if r.get("server")]
    assert len(served) == 1 and served[0]["client"] == "perf_analyzer"
    assert served[0]["tokens_per_s"] > 0 and served[0]["mean_step_ms"] > 0
    assert out.with_suffix(".pa-c2.json").is_file(), "perf_analyzer's own export is kept beside the result"


def test_perf_analyzer_failures_of_a_too_short_window_are_told_from_others():
    """What the driver retries with a longer window: perf_analyzer's own words (as it printed
    them at concurrency 64 on this host) for a window in which no request finished, or in which
    some window saw none finish; anything else (a server down, a bad flag) fails at once."""
    from client.profile_server import window_too_short
    assert window_too_short("Thread [0] had error: No valid requests recorded within time interval. "
                            "Please use a larger time window.")
    assert window_too_short("Failed to obtain stable measurement within 3 measurement windows for "
                            "concurrency 64. Please try to increase the --measurement-interval.")
    assert not window_too_short("failed to get model metadata: HTTP client failed: Couldn't connect to server")
    assert not window_too_short("unrecognized option '--measurement-intervall'")
