"""Mode "auto" behind a real tritonserver: the planner's gauges move as it decides.

A server of its own (the ``nightdraft`` model only, laid out by the dynamic benchmark's
``write_repository``) runs mode "auto" with a tight KV pool and an eager offload policy. A client
sends a trickle, a burst and a trickle again while a thread scrapes ``/metrics``: the gamma,
pipeline-mode, drafter-state and KV-pool gauges must show speculation at low load, plain decoding
with the drafter offloaded and a grown pool under the burst, and the drafter back afterwards;
every answer must equal plain greedy decoding, and every KV block must be free at the end.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.serving.metrics import DRAFTER_STATES
from client.triton_client import GrpcClient
from conftest import TEST_BLOCK_SIZE, TINY_TARGET, _kv_bytes_per_block, nightdraft_only_server, test_engine_config
from helpers.triton import metrics, short_prompts, wait_kv_free

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
KV_BLOCKS = 24


def auto_engine_config() -> dict:
    return test_engine_config() | {
        "mode": "auto", "gamma_max": 4, "max_num_seqs": 32,
        "kv_cache_bytes": KV_BLOCKS * _kv_bytes_per_block(TINY_TARGET, TEST_BLOCK_SIZE),
        # offload on sustained pressure alone, and come back as soon as the load fits
        "planner": {"offload_after_steps": 3, "offload_after_s": 0.0, "offload_gain": 0.0,
                    "offload_demand_ratio": 0.0, "reload_after_s": 0.0}}


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory):
    with nightdraft_only_server(tmp_path_factory.mktemp("triton-auto"), auto_engine_config()) as server:
        yield server


class GaugeWatcher(threading.Thread):
    """Scrapes the model's metrics every few tens of milliseconds and keeps what it saw."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server = server
        self.samples: list[dict[str, float]] = []
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            try:
                self.samples.append(metrics(self.server))
            except OSError:
                pass
            self._halt.wait(0.025)

    def stop(self):
        self._halt.set()
        self.join(10)

    def seen(self, key: str) -> set[float]:
        return {m[key] for m in self.samples if key in m}

    def latest(self, key: str) -> float:
        return next((m[key] for m in reversed(self.samples) if key in m), 0.0)

    def drafter_timeline(self) -> list[tuple]:
        """Each change of the drafter's state, with the offload, reload and failure counters
        then: what a failure message needs to tell a slow reload from a second offload."""
        changes, last = [], None
        for m in self.samples:
            seen = drafter_picture(m)
            if seen != last:
                changes.append(seen)
                last = seen
        return changes


def drafter_picture(m: dict[str, float]) -> tuple:
    state = next((s for s in DRAFTER_STATES if m.get(f"nightdraft_drafter_state{{state={s}}}") == 1), "?")
    return (state, *(int(m.get(f"nightdraft_drafter_{c}_total", 0)) for c in ("offloads", "reloads", "failures")))


def test_planner_gauges_move_with_the_load(auto_server):
    import torch

    from backend.engine.engine import Engine
    from backend.engine.config import EngineConfig
    from backend.sampling.params import SamplingParams

    trickle = short_prompts(24)[:3]
    burst = short_prompts(40)[24:40]
    tail = short_prompts(60)[40:52]
    threads = torch.get_num_threads()
    try:    # what plain greedy decoding gives
        ar = Engine(EngineConfig.from_dict(auto_engine_config() | {"mode": "ar", "drafter": None}))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        expected = {p: c.text for p, c in zip(trickle + burst + tail,
                                              ar.generate(trickle + burst + tail, params))}
    finally:
        torch.set_num_threads(threads)

    client = GrpcClient(auto_server.grpc_url, "nightdraft", timeout_s=120)

    def ask(p: str) -> str:
        return client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).text

    base_blocks = metrics(auto_server)["nightdraft_kv_cache_total_blocks"]
    watch = GaugeWatcher(auto_server)
    watch.start()
    try:
        got = {p: ask(p) for p in trickle}                        # low load: speculation
        with ThreadPoolExecutor(len(burst)) as pool:              # a burst: KV pressure
            got |= dict(zip(burst, pool.map(ask, burst)))
        for p in tail:                                            # low load again
            got[p] = ask(p)
            if watch.latest("nightdraft_drafter_reloads_total") >= 1 and len(got) >= len(trickle) + len(burst) + 3:
                break
        time.sleep(0.3)
    finally:
        watch.stop()

    assert all(got[p] == expected[p] for p in got), "auto mode changed a greedy answer"
    gammas = watch.seen("nightdraft_spec_decode_gamma")
    assert 0 in gammas and any(g > 0 for g in gammas), f"gamma gauge never moved: {gammas}"
    assert 1.0 in watch.seen("nightdraft_pipeline_mode{mode=ar}")
    assert 1.0 in watch.seen("nightdraft_pipeline_mode{mode=sd}")
    assert 1.0 in watch.seen("nightdraft_drafter_state{state=offloaded}"), (
        f"never offloaded (state, offloads, reloads, failures as scraped: {watch.drafter_timeline()})")
    assert 1.0 in watch.seen("nightdraft_drafter_state{state=on_device}")
    assert max(watch.seen("nightdraft_kv_cache_total_blocks")) > base_blocks, "the KV pool never grew"
    assert watch.latest("nightdraft_drafter_offloads_total") >= 1
    assert watch.latest("nightdraft_drafter_reloads_total") >= 1, "the drafter never came back"
    assert watch.latest("nightdraft_planner_switches_total") >= 2
    idle_deadline = time.monotonic() + 10
    # Idle, the drafter comes back: it can be off, or on its way back, when the last request
    # ends (an offload late in the burst, a reload still travelling), and the idle engine
    # finishes the reload, or starts it once idle for reload_after_s.
    m = wait_kv_free(auto_server, until=lambda m: m["nightdraft_drafter_state{state=on_device}"] == 1
                     or time.monotonic() > idle_deadline)
    assert m["nightdraft_drafter_state{state=on_device}"] == 1, \
        f"idle, drafter {drafter_picture(m)} (state, offloads, reloads, failures); under load: {watch.drafter_timeline()}"
    assert m["nightdraft_kv_cache_total_blocks"] == base_blocks    # given back with the drafter


def test_the_planner_summary_is_written_at_unload(auto_server):
    # At unload the model writes what the planner did over its life to its planner_summary_file,
    # which `bench dynamic --server` reads back. The test drives traffic of its own (so it does
    # not depend on the test above having run first) and checks that the summary agrees with the
    # counters the model exported just before the unload.
    from client.dynamic_server import read_planner_summary

    client = GrpcClient(auto_server.grpc_url, "nightdraft", timeout_s=120)
    prompts = short_prompts(4)
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), prompts))
    m = wait_kv_free(auto_server)
    auto_server.stop(timeout_s=60)
    summary = read_planner_summary(auto_server.model_repository)
    assert summary, "no planner summary written at unload"
    assert summary["steps"] >= MAX_TOKENS // (1 + 4), "fewer planner decisions than the requests needed steps"
    assert sum(summary["arm_counts"].values()) > 0
    assert summary["switches"] >= m["nightdraft_planner_switches_total"]     # (the gauge may lag)
    # the serving path's own cost, measured from the running loop behind the server
    serving = summary["serving_cost"]
    assert serving["steps"] > 0 and serving["per_response_s"] is not None
    print("serving cost through tritonserver:", serving)
