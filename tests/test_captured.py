"""Captured (compiled) steps: the same logits as the eager forward, the same tokens through the
engine, and an engine that keeps serving when compilation fails.

These are the suite's only compiled engines (the rest run with NIGHTDRAFT_COMPILE=off, see
conftest.py): compiling costs tens of seconds per model shape, once per process.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.model.attention import kernels
from backend.model.captured import CompiledStep, compiled_graphs
from backend.model.kv_cache import PagedKVCache
from backend.model.loader import load_model
from backend.model.runner import ModelRunner
from backend.sampling.params import SamplingParams
from model_factory import TINY_DRAFTER, TINY_TARGET, save_random_llama

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernels.load(), reason=f"no paged attention kernel: {kernels.error()}")]

# Compiled and eager forwards fuse and order float32 arithmetic differently; measured differences
# on the tiny pair are about 1e-5 of logits of magnitude ~10.
LOGITS_TOL = 1e-4

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def drafter_model():
    return load_model(TINY_DRAFTER, attention="paged")


def _compiled(model, freeze: bool):
    kv = PagedKVCache.for_model(model.config, 8 << 20, block_size=16)
    step = CompiledStep(model, max_query_len=5, freeze=freeze)
    step.warm_up(kv)
    return step, kv


@pytest.fixture(scope="module")
def compiled_drafter(drafter_model):
    return _compiled(drafter_model, freeze=False)


@pytest.fixture(scope="module")
def target_model():
    return load_model(TINY_TARGET, attention="paged")


@pytest.fixture(scope="module")
def compiled_target(target_model):
    """The target's step as the engine compiles it: frozen (weights pre-packed constants)."""
    return _compiled(target_model, freeze=True)


def _forward_both(model, step, kv, seq_ids, cached, new):
    """Eager and compiled logits of the same forward, each writing into its own copy of `kv`."""
    tokens = torch.randint(0, model.config.vocab_size, (sum(new),), generator=torch.Generator().manual_seed(3)).tolist()
    for sid, c, n in zip(seq_ids, cached, new):
        assert kv.ensure_capacity(sid, c + n)
    saved = kv.kv.clone()
    eager = ModelRunner(model, kv).forward(seq_ids, cached, new, tokens, list(range(sum(new))))
    after_eager = kv.kv.clone()
    kv.kv.copy_(saved)
    runner = ModelRunner(model, kv, step)
    compiled = runner.forward(seq_ids, cached, new, tokens, list(range(sum(new))))
    assert runner.captured_forwards == 1 and runner.eager_forwards == 0
    torch.testing.assert_close(kv.kv, after_eager, atol=LOGITS_TOL, rtol=0)
    return eager, compiled


@pytest.mark.parametrize("role", ["drafter", "target"])
@pytest.mark.parametrize("cached,new", [([20], [1]), ([3, 40, 17], [1, 1, 1]), ([33, 8], [5, 5]), ([15], [5])])
def test_compiled_logits_equal_eager_within_tolerance(request, role, cached, new):
    model = request.getfixturevalue(f"{role}_model")
    step, kv = request.getfixturevalue(f"compiled_{role}")
    ids = [f"s{i}" for i in range(len(cached))]
    eager, compiled = _forward_both(model, step, kv, ids, cached, new)
    for sid in ids:
        kv.free(sid)
    torch.testing.assert_close(compiled, eager, atol=LOGITS_TOL, rtol=0)
    assert (compiled.argmax(-1) == eager.argmax(-1)).all()


def test_one_graph_serves_a_step_of_one_token_and_of_many(tmp_path):
    """A one-token step (batch-1 decode) runs the graph every other token count runs. A graph of
    its own, frozen, held another packed copy of the target's weights: the bundled target's
    compiled step grew the process by 173-174 MiB that way against 126-130 with one graph
    (benchmarks/results/one-token-graph/). The model is one no other test compiles, so every
    graph counted is its own."""
    model = load_model(save_random_llama(tmp_path / "one_layer", layers=1, seed=7), attention="paged")
    kv = PagedKVCache.for_model(model.config, 4 << 20, block_size=16)
    step = CompiledStep(model, max_query_len=3, freeze=True)
    graphs = compiled_graphs()
    step.warm_up(kv)        # one token; three sequences of one token; three of three
    assert compiled_graphs() == graphs + 1
    runner = ModelRunner(model, kv, step)
    assert kv.ensure_capacity("one", 10) and kv.ensure_capacity("two", 10)
    with torch.inference_mode():        # as the engine's step
        runner.forward(["one"], [9], [1], [5])
        runner.forward(["one", "two"], [9, 7], [1, 3], [5, 6, 7, 8])
    kv.free("one")
    kv.free("two")
    assert runner.captured_forwards == 2 and compiled_graphs() == graphs + 1


def test_one_graph_serves_every_thread_count(tmp_path):
    """A step compiled at one thread runs at two (the drafter's lent cores) without compiling
    again: its loops read the thread count at run time, and the compiler's guard on it is
    dropped. A second graph of the frozen target held another packed copy of its weights
    (benchmarks/results/one-graph-all-threads/). The model's shape is one no other test
    compiles, so every graph counted is its own; the logits at two threads are the eager
    forward's."""
    model = load_model(save_random_llama(tmp_path / "three_layers", layers=3, seed=11), attention="paged")
    kv = PagedKVCache.for_model(model.config, 4 << 20, block_size=16)
    threads = torch.get_num_threads()
    graphs = compiled_graphs()
    try:
        torch.set_num_threads(1)
        step = CompiledStep(model, max_query_len=3, freeze=True)
        step.warm_up(kv)
        assert compiled_graphs() == graphs + 1
        torch.set_num_threads(2)
        with torch.inference_mode():        # as the engine's step
            eager, compiled = _forward_both(model, step, kv, ["a", "b"], [20, 30], [3, 1])
    finally:
        torch.set_num_threads(threads)
        for sid in ("a", "b"):
            kv.free(sid)
    assert compiled_graphs() == graphs + 1, "the step compiled again at two threads"
    torch.testing.assert_close(compiled, eager, atol=LOGITS_TOL, rtol=0)


def test_weights_packed_after_the_compile_do_not_compile_the_step_again(tmp_path):
    """Where one thread's kernel verdicts pack nothing (MKL wins every row count, as on a host
    without AVX-512), the target is compiled with no packed weights, and the lent cores'
    verdicts may pack them afterwards (`add_thread_verdicts`). The compiled step never reads
    `packed`, so it does not compile again at the first lent step (it did: a guard on
    `packed is None`)."""
    from backend.model.linear import ROW_LADDER, Linear, _pack

    model = load_model(save_random_llama(tmp_path / "two_layers", layers=2, seed=12), attention="paged")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(lin.packed is None for lin in layers)
    kv = PagedKVCache.for_model(model.config, 4 << 20, block_size=16)
    step = CompiledStep(model, max_query_len=3, freeze=True)
    step.warm_up(kv)
    graphs = compiled_graphs()
    _pack(layers)                                   # as the lent cores' verdicts pack them
    for lin in layers:
        lin._use_packed = (True,) * len(ROW_LADDER)
    try:
        with torch.inference_mode():
            eager, compiled = _forward_both(model, step, kv, ["a", "b"], [20, 30], [3, 1])
    finally:
        for sid in ("a", "b"):
            kv.free(sid)
    assert compiled_graphs() == graphs, "packing the weights after the compile compiled the step again"
    torch.testing.assert_close(compiled, eager, atol=LOGITS_TOL, rtol=0)


@pytest.mark.parametrize("cached,new", [([0], [40]), ([0], [300]), ([16, 0], [1, 23]), ([0, 30, 9], [70, 5, 1])])
def test_the_target_graph_runs_prompt_chunks_as_the_eager_forward_does(target_model, compiled_target, cached, new):
    """Prompt chunks, alone and beside decoding and verifying sequences, run the frozen target's
    graph (compiled at build for a few tokens a sequence) without compiling again, with the eager
    forward's logits and cache writes."""
    step, kv = compiled_target
    ids = [f"p{i}" for i in range(len(cached))]
    graphs = compiled_graphs()
    with torch.inference_mode():        # as the engine's step
        try:
            eager, compiled = _forward_both(target_model, step, kv, ids, cached, new)
        finally:
            for sid in ids:
                kv.free(sid)
    assert compiled_graphs() == graphs, "a prompt chunk compiled the step again"
    torch.testing.assert_close(compiled, eager, atol=LOGITS_TOL, rtol=0)
    assert (compiled.argmax(-1) == eager.argmax(-1)).all()


def test_the_drafter_runs_a_prefill_chunk_eagerly(drafter_model, compiled_drafter):
    """The drafter's graph (weights not pre-packed) tied its model op by op on prompts: it keeps
    to decode and verification."""
    step, kv = compiled_drafter
    runner = ModelRunner(drafter_model, kv, step)
    assert kv.ensure_capacity("p", 40)
    runner.forward(["p"], [0], [40], list(range(40)))
    kv.free("p")
    assert runner.eager_forwards == 1 and runner.captured_forwards == 0


def test_a_compilation_failure_falls_back_to_eager(drafter_model, compiled_drafter, caplog):
    step, kv = compiled_drafter
    runner = ModelRunner(drafter_model, kv, step)
    assert kv.ensure_capacity("f", 10)

    def refuse(*_a, **_k):
        raise torch._dynamo.exc.Unsupported("a shape the compiler gives up on")
    original = step._fn
    step._fn = refuse
    try:
        with caplog.at_level(logging.ERROR, logger="nightdraft.runner"):
            logits = runner.forward(["f"], [9], [1], [5])
    finally:
        step._fn = original
        kv.free("f")
    assert logits.shape == (1, drafter_model.config.vocab_size)
    assert runner.captured is None and runner.eager_forwards == 1
    assert "running op by op" in caplog.text


def _engine(**kw):
    base = dict(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), kv_cache_bytes=16 << 20, num_threads=1,
                max_num_seqs=8, seed=0, attention="paged")
    return Engine(EngineConfig(**(base | kw)))


PROMPT_CUTS = (6, 60, 37, 200)      # the conftest's `prompts`


@pytest.fixture(scope="module")
def plain_eager_tokens(prompts):
    engine = _engine(mode="ar", drafter=None, compile="off")
    try:
        return [c.output_ids for c in engine.generate(prompts, GREEDY, max_concurrency=3)]
    finally:
        engine.close()


# auto keeps to its speculative arms here: whether plain decoding pays is the machine's timing
# (a slower machine's planner played it throughout and never drafted), and this test is about the
# drafter's compiled step doing the drafting.
@pytest.mark.parametrize("mode,extra", [("ar", {"drafter": None}), ("sd", {}),
                                        ("auto", {"planner": {"modes": ("sd",)}}),
                                        ("psd", {"drafter_device": "cpu"})])
def test_compiled_engines_decode_what_plain_eager_decoding_does(prompts, plain_eager_tokens, mode, extra):
    """Greedy output of every mode with everything compiled (target and drafter) equals plain
    eager decoding token for token; the compiled steps did the decoding."""
    engine = _engine(mode=mode, compile="on", **extra)
    try:
        got = [c.output_ids for c in engine.generate(prompts, GREEDY, max_concurrency=3)]
        # every target forward, the prompts' (up to 200 tokens) too, ran the compiled step
        assert engine.runner.captured is not None and engine.runner.captured_forwards > 0
        assert engine.runner.eager_forwards == 0
        if mode in ("sd", "auto"):       # (psd's drafter compiles in its worker process)
            drafter_runner = engine.drafter.drafter.runner
            assert drafter_runner.captured is not None and drafter_runner.captured_forwards > 0
        if mode != "ar":
            assert engine.stats().drafted_tokens > 0
    finally:
        engine.close()
    assert got == plain_eager_tokens


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one for the drafter")
def test_plain_decoding_on_the_lent_cores_runs_the_graph_made_at_build(prompts, plain_eager_tokens):
    """Mode auto lends the drafter's core to plain decoding: the target's compiled step then runs
    on two threads, where it was compiled at one. It runs the same graph: a compile at the first
    lent step stalled every running request 16.7 s with a fresh compile cache
    (benchmarks/results/lent-kernels/lend_stall.txt)."""
    engine = _engine(mode="auto", compile="on", drafter_device="cpu", planner={"modes": ("ar",)},
                     planner_cost_profile="off", lend_drafter_cores=True)
    try:
        graphs = compiled_graphs()
        lent = []
        got = [c.output_ids for c in engine.generate(prompts, GREEDY, max_concurrency=3,
                                                     on_step=lambda _: lent.append(engine._placement.lent))]
        assert sum(lent) > len(lent) // 2 and engine.runner.captured_forwards > 0
        assert compiled_graphs() == graphs, "a graph was compiled while requests ran"
    finally:
        engine.close()
    assert got == plain_eager_tokens


def test_a_compiled_drafter_survives_offload_and_reload(prompts, plain_eager_tokens):
    """Offloading moves the weights and drops the KV pool; the compiled step takes the reloaded
    weights and the new pool as they are (no recompilation, same tokens)."""
    engine = _engine(mode="sd", compile="auto")
    try:
        drafter = engine.drafter.drafter
        assert drafter.runner.captured is not None and not drafter.runner.captured.frozen
        assert engine.runner.captured is not None and engine.runner.captured.frozen
        first = [c.output_ids for c in engine.generate(prompts[:3], GREEDY, max_concurrency=3)]
        graphs = engine.stats().compiled_graphs
        assert graphs >= 2         # the target's and the drafter's
        drafter.offload()
        drafter.reload()
        before = drafter.runner.captured_forwards
        second = [c.output_ids for c in engine.generate(prompts[:3], GREEDY, max_concurrency=3)]
        assert drafter.runner.captured_forwards > before and drafter.runner.captured is not None
        assert engine.stats().compiled_graphs == graphs
    finally:
        engine.close()
    assert first == second == plain_eager_tokens[:3]


def test_the_server_compiles_its_steps_and_decodes_what_plain_eager_decoding_does(tmp_path, prompts,
                                                                                  plain_eager_tokens):
    """Through a real tritonserver: the model compiles its drafter's step inside the backend stub
    (an embedded interpreter whose locale the compiler once could not read its files in: the
    model then loaded without it) and streams the same greedy text as plain eager decoding."""
    from conftest import nightdraft_only_server, test_engine_config
    from client.triton_client import GrpcClient
    from backend.model.tokenizer import Tokenizer

    config = test_engine_config() | {"compile": "auto", "attention": "paged", "mode": "sd"}
    tokenizer = Tokenizer.from_pretrained(TINY_TARGET)
    with nightdraft_only_server(tmp_path, config) as server:
        client = GrpcClient(server.grpc_url)
        texts = [client.generate(p, max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True).text
                 for p in prompts[:3]]
        log = (tmp_path / "tritonserver.log").read_text()
    assert "compiled the drafter's decode and verification step" in log, log[-3000:]
    assert "compiled the target's decode and verification step" in log, log[-3000:]
    assert "could not compile" not in log
    assert texts == [tokenizer.decode(ids) for ids in plain_eager_tokens[:3]]


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("role", ["drafter", "target"])
def test_a_pool_resized_inside_a_step_is_served_without_compiling_again(request, role):
    """Elastic memory resizes the target's pool from inside the engine's step (inference mode),
    while the first pool was made outside it. The compiled step guards on its inputs' dispatch
    keys, so a pool of the other kind would compile the whole graph again on the next forward
    (measured: 10-15 s on this CPU, a stall every running request waits through)."""
    model = request.getfixturevalue(f"{role}_model")
    step, _ = request.getfixturevalue(f"compiled_{role}")
    kv = PagedKVCache.for_model(model.config, 4 << 20, block_size=16)
    runner = ModelRunner(model, kv, step)
    assert kv.ensure_capacity("r", 21)
    # Every forward in inference mode, as the engine's step. The first may compile (the engine
    # tests before this one leave another thread count than the fixture's); it is not counted.
    with torch.inference_mode():
        runner.forward(["r"], [20], [1], [5], [0])
    compiled = _graphs_compiled()
    for blocks in (2 * kv.num_blocks, kv.num_blocks // 2):      # an offload's growth, a reload's shrink
        with torch.inference_mode():
            kv.resize(blocks)
            runner.forward(["r"], [20], [1], [5], [0])
            runner.forward(["r"], [20], [1], [5], [0])
    kv.free("r")
    assert runner.captured_forwards == 5 and runner.eager_forwards == 0
    assert _graphs_compiled() == compiled
