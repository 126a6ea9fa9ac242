"""Tensor parallelism of the target: two ranks (gloo, two processes on this CPU) against one.

Tolerance: the ranks sum partial products in another order than one device does, so logits may
differ in the last bits; float32 logits of TP 2 stay within LOGITS_ATOL of TP 1's (measured here:
about 4e-6). Greedy output must be equal token for token, in every mode.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.errors import ConfigError
from backend.model.config import ModelConfig
from backend.model.loader import load_model
from backend.model.parallel.shard import load_shard, shard_config
from backend.sampling.params import SamplingParams
from helpers.engines import assert_no_leaks, tiny_engine
from model_factory import TINY_TARGET

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_CUTS = (6, 12, 41, 300)      # the conftest's `prompts` and `ar_outputs`
LOGITS_ATOL = 1e-4
# Every in-flight request's final response after a rank is killed: the monitor's poll, the step
# in flight, and failing each request (no collective waits on the dead rank).
KILL_BOUND_S = 5.0


def tp_engine(mode: str = "ar", **kw) -> Engine:
    return tiny_engine(mode, tensor_parallel_size=2, compile="off", **kw)


# ---- configuration and loading (no processes) -------------------------------------------------

def test_tensor_parallel_sizes_that_do_not_split_the_model_or_the_devices_are_refused():
    target = str(TINY_TARGET)
    cfg = ModelConfig.from_pretrained(TINY_TARGET)      # 8 heads, 4 kv heads
    with pytest.raises(ConfigError, match="does not divide the target's kv heads"):
        EngineConfig(target=target, tensor_parallel_size=8)
    with pytest.raises(ConfigError, match="does not divide the target's attention heads"):
        EngineConfig(target=target, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be an integer >= 1"):
        EngineConfig(target=target, tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="tensor_parallel_devices: a list of tensor_parallel_size"):
        EngineConfig(target=target, tensor_parallel_size=2, tensor_parallel_devices=["cpu"])
    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match="needs cuda:0..cuda:1"):
            EngineConfig(target=target, device="cuda", tensor_parallel_size=2)
    assert EngineConfig(target=target, tensor_parallel_size=2).tensor_parallel_size == 2
    assert cfg.num_kv_heads % 2 == 0


def test_every_cpu_rank_is_given_its_cores(monkeypatch):
    """A rank forked from the fork server would inherit the server's affinity, not the engine's:
    its cores are always named, an equal share each where there are enough, else all of them."""
    from backend.model.parallel import build
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {2, 5})
    assert build._cpu_shares(2, None) == ([[2], [5]], 1)
    assert build._cpu_shares(4, None) == ([[2, 5]] * 4, 1)


def test_model_json_tensor_parallel_size_becomes_the_engine_key(tmp_path):
    from backend.engine.vllm_args import engine_keys_from_vllm
    out = engine_keys_from_vllm({"model": str(TINY_TARGET), "tensor_parallel_size": 2},
                                base_dir=tmp_path, device="cpu")
    assert out.engine["tensor_parallel_size"] == 2
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size"):
        engine_keys_from_vllm({"model": str(TINY_TARGET), "speculative_config": {
            "model": str(TINY_TARGET), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}},
            base_dir=tmp_path, device="cpu")


def test_a_model_folder_with_model_json_asks_for_a_tensor_parallel_target(tmp_path):
    """What the Triton model does with its folder: model.json's tensor_parallel_size reaches the
    engine configuration (a KIND_CPU instance: the ranks on this host's cores)."""
    from backend.serving.config import load_engine_config
    from helpers.model_args import model_args, write
    d = write(tmp_path / "m", model={"model": str(TINY_TARGET), "tensor_parallel_size": 2})
    config = load_engine_config(model_args(d, "CPU"), str(d / "1" / "engine.json"), cuda_count=0).config
    assert config.tensor_parallel_size == 2 and config.device == "cpu"


def test_each_rank_loads_its_slice_and_the_slices_make_the_whole_model():
    whole = load_model(TINY_TARGET)
    full = whole.config
    parts = [load_shard(TINY_TARGET, r, 2) for r in range(2)]
    assert parts[0].config == shard_config(full, 2)
    h, kvh, d = full.num_heads // 2, full.num_kv_heads // 2, full.head_dim
    for i in (0, full.num_layers - 1):
        qkv = [p.layers[i].self_attn.qkv_proj.weight for p in parts]
        assert qkv[0].shape == ((h + 2 * kvh) * d, full.hidden_size)
        w = whole.layers[i].self_attn.qkv_proj.weight
        q, k, v = w.split([2 * h * d, 2 * kvh * d, 2 * kvh * d])
        assert torch.equal(torch.cat([x[:h * d] for x in qkv]), q)
        assert torch.equal(torch.cat([x[h * d:(h + kvh) * d] for x in qkv]), k)
        assert torch.equal(torch.cat([x[(h + kvh) * d:] for x in qkv]), v)
        assert torch.equal(torch.cat([p.layers[i].self_attn.o_proj.weight for p in parts], 1),
                           whole.layers[i].self_attn.o_proj.weight)
        gate_up = [p.layers[i].mlp.gate_up_proj.weight.chunk(2) for p in parts]
        g, u = whole.layers[i].mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(torch.cat([x[0] for x in gate_up]), g)
        assert torch.equal(torch.cat([x[1] for x in gate_up]), u)
        assert torch.equal(torch.cat([p.layers[i].mlp.down_proj.weight for p in parts], 1),
                           whole.layers[i].mlp.down_proj.weight)
    assert torch.equal(parts[1].embed_tokens.weight, whole.embed_tokens.weight)   # replicated


def test_the_kubernetes_tensor_parallel_layout_gives_the_pod_every_gpu_its_engine_uses(tmp_path):
    """docker/k8s-tensor-parallel: the base manifests, 3 GPUs a pod, target ranks on cuda:0 and
    cuda:1, the drafter on cuda:2; its engine.json loads."""
    import json

    import yaml

    from conftest import REPO
    overlay = REPO / "docker" / "k8s-tensor-parallel"
    kz = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kz["resources"] == ["../k8s"]
    assert all((overlay / p["path"]).is_file() for p in kz["patches"])
    (container,) = yaml.safe_load((overlay / "gpus.yaml").read_text())["spec"]["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus == 3
    engine = json.loads(yaml.safe_load((overlay / "engine.yaml").read_text())["data"]["engine.json"])
    used = engine["tensor_parallel_devices"] + [engine["drafter_device"]]
    assert sorted(int(d.split(":")[1]) for d in used) == list(range(gpus))
    for key in ("target", "drafter"):          # paths inside the pod: stand-ins here
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text((TINY_TARGET / "config.json").read_text())
        engine[key] = str(tmp_path / key)
    cfg = EngineConfig.from_dict(engine)
    assert cfg.tensor_parallel_size == 2 and cfg.mode == "psd"


# ---- two ranks against one ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp2():
    engine = tp_engine("sd")
    yield engine
    engine.close()


@pytest.mark.slow
def test_tp2_logits_equal_tp1_within_tolerance(tp2, prompts):
    one = tiny_engine("ar", drafter=None, compile="off")
    try:
        ids = [one.tokenizer.encode(p) for p in prompts[:4]]
        got = []
        for engine in (one, tp2):
            seqs = [f"logits-{i}" for i in range(len(ids))]
            for s, t in zip(seqs, ids):
                assert engine.kv.ensure_capacity(s, len(t))
            flat = [t for x in ids for t in x]
            logits = engine.runner.forward(seqs, [0] * len(ids), [len(x) for x in ids], flat,
                                           list(range(len(flat))))
            got.append(logits.clone())
            for s in seqs:
                engine.kv.free(s)
    finally:
        one.close()
    assert got[0].shape == got[1].shape == (sum(map(len, ids)), tp2.target.config.vocab_size)
    assert (got[0] - got[1]).abs().max().item() < LOGITS_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "sd", "psd", "auto"])
def test_tp2_greedy_output_equals_plain_decoding_in_every_mode(mode, tp2, prompts, ar_outputs):
    if mode == "sd":
        engine = tp2
    else:
        engine = tp_engine(mode, drafter=None) if mode == "ar" else tp_engine(mode)
    try:
        got = [c.output_ids for c in engine.generate(prompts, GREEDY, max_concurrency=4)]
        assert_no_leaks(engine)
        if mode == "sd":
            assert engine.stats().accepted_tokens > 0
    finally:
        if engine is not tp2:
            engine.close()
    assert got == ar_outputs


@pytest.mark.slow
def test_a_kv_pool_resize_that_moves_blocks_is_mirrored_on_every_rank(tp2, prompts, ar_outputs):
    """Requests whose blocks sit high in the pool keep decoding the same tokens after the pool
    shrinks under them (their blocks moved down on the driver and on the rank alike), and after
    it grows again."""
    engine, kv = tp2, tp2.kv
    base = kv.num_blocks
    assert kv.ensure_capacity("low", 40 * kv.block_size)       # the lowest blocks, freed below
    for i, p in enumerate(prompts[:3]):
        engine.add_request(str(i), p, GREEDY)
    out = {str(i): [] for i in range(3)}
    for _ in range(4):
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    kv.free("low")
    highest = max(b for s in kv.seq_ids() for b in kv.block_table(s))
    assert highest >= 40
    kv.resize(kv.num_used_blocks + 8)                          # below `highest`: blocks move
    assert max(b for s in kv.seq_ids() for b in kv.block_table(s)) < kv.num_blocks < highest
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    kv.resize(base)
    assert [out[str(i)] for i in range(3)] == ar_outputs[:3]
    assert [c.output_ids for c in engine.generate(prompts[:2], GREEDY)] == ar_outputs[:2]


@pytest.mark.slow
def test_elastic_memory_grows_and_shrinks_the_pool_on_every_rank(prompts, ar_outputs):
    """An offload of the in-process drafter lends its bytes to the pool (every rank takes the new
    block count), a reload takes them back, with requests running across both; outputs stay
    plain decoding's."""
    engine = tp_engine("sd", kv_cache_bytes=64 * 2 * 8 * 2 * 32 * 16 * 4)   # 64 blocks a rank
    try:
        memory = engine.memory
        base = engine.kv.num_blocks
        for i, p in enumerate(prompts[:3]):
            engine.add_request(str(i), p, GREEDY)
        out = {str(i): [] for i in range(3)}

        def steps(n):
            for _ in range(n):
                for o in engine.step():
                    out[o.request_id] += o.new_token_ids

        steps(3)
        engine.set_gamma(0)
        memory.offload()
        assert memory.offloads == 1 and engine.kv.num_blocks > base
        steps(4)
        memory.start_reload()
        assert engine.kv.num_blocks == base
        while memory.poll() is None:
            time.sleep(0.01)
        engine.set_gamma(4)
        while engine.has_unfinished():
            steps(1)
        assert [out[str(i)] for i in range(3)] == ar_outputs[:3]
        assert_no_leaks(engine)
    finally:
        engine.close()


# ---- faults --------------------------------------------------------------------------------------

def _serve_until_killed(engine: Engine, prompts, kill) -> dict:
    """Requests streamed through an EngineLoop; `kill()` once every request has tokens. Returns
    per request its final output and when it came (after the kill)."""
    from backend.engine.loop import EngineLoop
    loop = EngineLoop(engine)
    finals, first, done = {}, threading.Event(), threading.Event()
    started: set = set()
    killed_at: list[float] = []

    def on_output(o):
        if o.new_token_ids:
            started.add(o.request_id)
            if len(started) == len(prompts):
                first.set()
        if o.finished:
            finals[o.request_id] = (o, time.monotonic())
            if len(finals) == len(prompts):
                done.set()

    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    try:
        for i, p in enumerate(prompts):
            loop.submit(str(i), p, params, on_output)
        assert first.wait(60), "requests did not start"
        killed_at.append(time.monotonic())
        kill()
        assert done.wait(60), f"only {len(finals)} of {len(prompts)} requests got a final response"
    finally:
        loop.shutdown(timeout_s=10)
    return {rid: (o, t - killed_at[0]) for rid, (o, t) in finals.items()}


def _wait_recovered(engine: Engine, timeout_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while engine.runner.down_reason is not None:
        assert time.monotonic() - t0 < timeout_s, "the tensor-parallel group did not come back"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_that_dies_or_hangs_fails_the_requests_in_flight_then_the_group_comes_back(
        how, prompts, ar_outputs):
    """SIGKILL (a crash) or SIGSTOP (a hang: only the collective timeout sees it) a rank while
    requests stream: each request gets its final response, an error naming the group, within the
    bound; the engine reports itself unhealthy; the group restarts and serves the same tokens."""
    from backend.serving.engine_health import EngineHealth
    timeout_s = 3.0
    engine = tp_engine("ar", drafter=None, tensor_parallel_timeout_s=timeout_s)
    try:
        rank = engine.runner.group.pids[0]
        health = EngineHealth(loop=type("L", (), {"healthy": True, "num_inflight": 0})(), engine=engine)
        reasons = []

        def kill():
            os.kill(rank, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            deadline = time.monotonic() + timeout_s + KILL_BOUND_S
            while time.monotonic() < deadline and not reasons:
                if (why := health.check()) is not None:
                    reasons.append(why)
                time.sleep(0.02)

        finals = _serve_until_killed(engine, prompts[:4], kill)
        bound = KILL_BOUND_S + (timeout_s if how == "stopped" else 0.0)
        for rid, (o, after) in finals.items():
            assert o.finish_reason == "error" and "tensor-parallel group" in o.error, (rid, o)
            assert after < bound, f"request {rid} got its final response {after:.1f} s after the fault"
        assert reasons and "tensor-parallel rank failed" in reasons[0]
        if how == "killed":
            assert "rank 1 died (exit code -9)" in reasons[0]
        _wait_recovered(engine)
        assert health.check() is None
        assert engine.runner.group.pids[0] != rank
        stats = engine.stats()
        assert (stats.tensor_parallel_failures, stats.tensor_parallel_restarts) == (1, 1)
        assert [c.output_ids for c in engine.generate(prompts, GREEDY)] == ar_outputs
        assert_no_leaks(engine)
    finally:
        engine.close()
        try:
            os.kill(rank, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- through the real server ---------------------------------------------------------------------

@pytest.mark.slow
def test_tp2_through_tritonserver_serves_plain_decodings_text_and_comes_back_after_a_rank_is_killed(
        tmp_path, prompts, ar_outputs):
    """engine.json with tensor_parallel_size 2 (sd, the drafter in the driver's process) behind a
    real tritonserver: concurrent streams get plain greedy decoding's text. Then the rank process
    is SIGKILLed while streams run: each stream ends with an error within the bound, the model
    counts the group's failure and its restart (nightdraft_tensor_parallel_{failures,restarts}_total:
    the outage can be shorter than the 0.25 s poll of nightdraft_engine_healthy), is healthy
    again, and the same text is served again."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    from backend.model.tokenizer import Tokenizer
    from client.triton_client import ClientError, GrpcClient
    from conftest import nightdraft_only_server, test_engine_config
    from helpers.triton import metrics, wait_kv_free

    config = test_engine_config() | {"tensor_parallel_size": 2, "mode": "sd", "compile": "off",
                                     "tensor_parallel_timeout_s": 5.0}
    tokenizer = Tokenizer.from_pretrained(TINY_TARGET)
    expected = [tokenizer.decode(ids) for ids in ar_outputs]
    kw = dict(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
    # ENABLE_VLLM_HEALTH_CHECK off: on, the model would unload itself while the group is down
    # (as for any unhealthy engine), and only a reload would bring it back.
    with nightdraft_only_server(tmp_path, config, parameters={"ENABLE_VLLM_HEALTH_CHECK": "false"}) as server:
        client = GrpcClient(server.grpc_url, "nightdraft", timeout_s=120)
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda p: client.generate(p, **kw).text, prompts)) == expected
        log = (tmp_path / "tritonserver.log").read_text()
        rank = int(re.search(r"tensor-parallel group of 2 .*ranks \[(\d+)\]", log).group(1))

        started = threading.Barrier(len(prompts) + 1)
        ended: dict[int, tuple[str, float]] = {}

        def stream(i: int) -> None:
            first = True
            try:
                for _ in client.stream(prompts[i], max_tokens=1000, temperature=0.0, ignore_eos=True):
                    if first:
                        first = False
                        started.wait(60)
                ended[i] = ("finished", time.monotonic())
            except ClientError as e:
                ended[i] = (str(e), time.monotonic())
                if first:
                    started.abort()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        started.wait(60)
        before = metrics(server)
        killed_at = time.monotonic()
        os.kill(rank, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = metrics(server)
            if (m["nightdraft_tensor_parallel_restarts_total"] > before["nightdraft_tensor_parallel_restarts_total"]
                    and m.get("nightdraft_engine_healthy") == 1):
                break
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        assert len(ended) == len(prompts)
        for i, (why, at) in ended.items():
            assert "tensor-parallel group" in why, (i, why)
            assert at - killed_at < KILL_BOUND_S, f"stream {i} ended {at - killed_at:.1f} s after the kill"
        m = metrics(server)
        assert [m[f"nightdraft_tensor_parallel_{k}_total"] - before[f"nightdraft_tensor_parallel_{k}_total"]
                for k in ("failures", "restarts")] == [1, 1], "the group's failure and restart were not counted"
        assert metrics(server).get("nightdraft_engine_healthy") == 1, "the group did not come back"
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda p: client.generate(p, **kw).text, prompts)) == expected
        wait_kv_free(server)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "psd", "auto"])
def test_tp2_through_tritonserver_serves_plain_decodings_text_in_every_mode(mode, tmp_path, prompts, ar_outputs):
    """The other modes (sd is above) through a real tritonserver: psd and auto with the drafter a
    worker on its own core, beside the target's group."""
    from concurrent.futures import ThreadPoolExecutor

    from backend.model.tokenizer import Tokenizer
    from client.triton_client import GrpcClient
    from conftest import nightdraft_only_server, test_engine_config
    from helpers.triton import wait_kv_free

    config = test_engine_config() | {"tensor_parallel_size": 2, "mode": mode, "compile": "off"}
    if mode == "ar":
        config["drafter"] = None
    else:
        config["drafter_device"] = "cpu"
    tokenizer = Tokenizer.from_pretrained(TINY_TARGET)
    kw = dict(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
    with nightdraft_only_server(tmp_path, config) as server:
        client = GrpcClient(server.grpc_url, "nightdraft", timeout_s=120)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: client.generate(p, **kw).text, prompts))
        wait_kv_free(server)
    assert got == [tokenizer.decode(ids) for ids in ar_outputs]


def test_a_rank_that_dies_before_it_connects_fails_the_start_at_once():
    # Pinned to a core that does not exist, rank 1 dies before it reaches the store; the driver
    # must say so at once instead of waiting out the connect timeout (two minutes).
    from backend.model.parallel.group import GroupFailed, RankGroup, RankSpec
    specs = [RankSpec(path=str(TINY_TARGET), size=2, device="cpu", dtype="float32", attention="sdpa",
                      block_size=16, num_blocks=8, pack_linears=False, port=0, timeout_s=5.0,
                      backend="gloo", cores=cores, threads=1)
             for cores in (None, [10_000])]
    t0 = time.monotonic()
    with pytest.raises(GroupFailed, match="rank 1 exited before it started"):
        RankGroup(specs, start_timeout_s=60.0)
    assert time.monotonic() - t0 < 30.0
