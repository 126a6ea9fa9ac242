"""The engine end to end, in-process: lossless speculation, batching, preemption, no leaks."""
import pytest

from backend.engine.engine import Engine
from backend.engine.config import ConfigError, EngineConfig
from backend.sampling.params import InvalidRequest, SamplingParams
from helpers.engines import assert_no_leaks, block_bytes
from model_factory import TINY_DRAFTER, TINY_TARGET, save_random_llama, truncated_copy

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_CUTS = (16, 20, 37, 400)      # the conftest's `prompts` and `ar_outputs`: mixed lengths


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    # A target whose layers 2.. add nothing: its first two layers are an exact drafter (alpha = 1).
    exact_target = save_random_llama(root / "exact_target", layers=4, zero_layers_from=2, seed=1)
    exact_drafter = truncated_copy(exact_target, root / "exact_drafter", 2)
    unrelated = save_random_llama(root / "unrelated", layers=1, seed=99)
    return {"exact_target": exact_target, "exact_drafter": exact_drafter, "unrelated": unrelated}


def make_engine(target=TINY_TARGET, drafter=TINY_DRAFTER, **kw) -> Engine:
    kw.setdefault("kv_cache_bytes", 16 << 20)
    kw.setdefault("mode", "sd" if drafter else "ar")
    return Engine(EngineConfig(target=str(target), drafter=str(drafter) if drafter else None, **kw))


@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_sd_equals_ar(gamma, prompts, ar_outputs):
    engine = make_engine(gamma=gamma)
    batch = [1, 3, 8, 16][gamma % 4]
    out = engine.generate(prompts, GREEDY, max_concurrency=batch)
    assert [c.output_ids for c in out] == ar_outputs
    stats = engine.stats()
    assert stats.drafted_tokens > 0
    assert 0.0 < stats.acceptance_rate < 1.0   # partial acceptance exercises the rollback
    assert stats.mean_tokens_per_target_call > 1.0
    assert_no_leaks(engine)


def test_gamma_changing_every_step_including_zero(prompts, ar_outputs):
    engine = make_engine(gamma=3)
    schedule = [0, 8, 1, 0, 5, 2, 8, 3, 0]
    ids = [f"r{i}" for i in range(len(prompts))]
    tokens = {i: [] for i in ids}
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, GREEDY)
    seen = set()
    step = 0
    while engine.has_unfinished():
        gamma = schedule[step % len(schedule)]
        step += 1
        seen.add(gamma)
        engine.set_gamma(gamma)
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    assert {0, 8} <= seen
    assert [tokens[i] for i in ids] == ar_outputs
    assert_no_leaks(engine)


def test_exact_drafter_accepts_everything(ckpts):
    engine = make_engine(ckpts["exact_target"], ckpts["exact_drafter"], gamma=4)
    ar = make_engine(ckpts["exact_target"], None)
    prompts = ["def f(x):\n", "import os\nimport sys\n", "x = 1\n" * 9]
    params = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    sd_out = engine.generate(prompts, params)
    assert [c.output_ids for c in sd_out] == [c.output_ids for c in ar.generate(prompts, params)]
    stats = engine.stats()
    assert stats.acceptance_rate == 1.0
    assert stats.mean_tokens_per_target_call == pytest.approx(5.0)   # gamma + 1 every call
    assert_no_leaks(engine)


def test_unrelated_drafter_is_still_lossless(ckpts):
    target = ckpts["exact_target"]
    engine = make_engine(target, ckpts["unrelated"], gamma=5)
    ar = make_engine(target, None)
    prompts = ["class A:\n", "for i in range(10):\n    ", "return"]
    assert ([c.output_ids for c in engine.generate(prompts, GREEDY)]
            == [c.output_ids for c in ar.generate(prompts, GREEDY)])
    assert engine.stats().acceptance_rate < 0.2
    assert_no_leaks(engine)


def test_per_request_opt_out_of_speculation(prompts, ar_outputs):
    engine = make_engine(gamma=4)
    opted_out = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    out = engine.generate(prompts[:4], [GREEDY, opted_out, GREEDY, opted_out])
    assert [c.output_ids for c in out] == ar_outputs[:4]
    assert out[1].drafted == 0 and out[3].drafted == 0
    assert out[0].drafted > 0


def test_preemption_by_recompute_loses_nothing(prompts):
    # A pool a third the size of what all 16 sequences need at once: they must take turns, and
    # sequences admitted while there was room get preempted as the others grow (they grow by 96
    # tokens, well past the room admission leaves them).
    long = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    ar = make_engine(drafter=None)
    expected = [c.output_ids for c in ar.generate(prompts, long)]
    need = [-(-(len(ar.tokenizer.encode(p)) + long.max_tokens) // 16) for p in prompts]
    blocks = max(max(need) + 2, sum(need) // 3)
    engine = make_engine(gamma=4, kv_cache_bytes=blocks * block_bytes(), block_size=16)
    out = engine.generate(prompts, long)
    assert [c.output_ids for c in out] == expected
    assert engine.stats().preemptions > 0
    assert_no_leaks(engine)


def test_a_preempted_sequence_leaves_the_drafters_pool_too(prompts):
    # Its blocks go back to the target's pool, which admits others in its place. The drafter's
    # pool holds as many tokens as the target's: when it kept the preempted sequence's copy it
    # had no room left for some newcomers and drafted nothing for them
    # (benchmarks/results/preempted-drafter-copy/).
    long = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    ar = make_engine(drafter=None)
    expected = [c.output_ids for c in ar.generate(prompts, long)]
    need = [-(-(len(ar.tokenizer.encode(p)) + long.max_tokens) // 16) for p in prompts]
    engine = make_engine(gamma=4, kv_cache_bytes=max(max(need) + 2, sum(need) // 3) * block_bytes(),
                         block_size=16)
    held_beyond_running = []

    def after_step(_outputs):
        held_beyond_running.append(engine.drafter.stats().num_sequences - len(engine.scheduler.running))

    out = engine.generate(prompts, long, on_step=after_step)
    assert [c.output_ids for c in out] == expected
    assert engine.stats().preemptions > 0
    assert max(held_beyond_running) <= 0, "the drafter kept sequences the target no longer runs"
    assert_no_leaks(engine)


def test_admission_leaves_running_sequences_room_to_grow():
    from backend.model.kv_cache import PagedKVCache
    from backend.batching.sequence import Sequence
    from backend.batching.scheduler import GROWTH_HEADROOM_TOKENS, Scheduler
    from backend.model.config import ModelConfig
    kv = PagedKVCache.for_model(ModelConfig.from_pretrained(TINY_TARGET), 8 * block_bytes(), block_size=16)
    assert kv.num_blocks == 8
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=4096)
    seqs = [Sequence(request_id=str(i), token_ids=list(range(1, 31)), num_prompt_tokens=30,
                     params=GREEDY, detokenizer=None) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule(lambda s: 0)
    # each needs 2 blocks for its 30 tokens and 1 more for its headroom (30 + 16 > 32). After two
    # are admitted 4 blocks are free: a third would need 2, plus the running two's headroom (2),
    # plus the watermark (1): it waits (admitting while any block is free would have taken it)
    assert GROWTH_HEADROOM_TOKENS == 16
    assert [s.seq.request_id for s in batch] == ["0", "1"]
    assert kv.num_free_blocks == 4 and len(sched.waiting) == 2


def test_abort_frees_blocks_and_others_carry_on(prompts, ar_outputs):
    engine = make_engine(gamma=4)
    for i, p in enumerate(prompts[:6]):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens = {f"r{i}": [] for i in range(6)}
    finals = {}
    step = 0
    while engine.has_unfinished():
        if step == 3:
            engine.abort("r2")
            engine.abort("r4")
            engine.abort("no-such-request")     # harmless
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.request_id not in finals, "two final outputs for one request"
                finals[o.request_id] = o.finish_reason
        step += 1
    assert finals == {"r0": "length", "r1": "length", "r2": "abort", "r3": "length",
                      "r4": "abort", "r5": "length"}
    for i in (0, 1, 3, 5):
        assert tokens[f"r{i}"] == ar_outputs[i]
    assert_no_leaks(engine)


def test_abort_while_waiting(prompts):
    engine = make_engine(gamma=2, max_num_seqs=1)
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    engine.step()
    engine.abort("b")
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert reasons == {"a": "length", "b": "abort"}
    assert_no_leaks(engine)


def test_stop_string_and_streamed_text(prompts, ar_outputs):
    ar = make_engine(drafter=None)
    full = ar.tokenizer.decode(ar_outputs[5])
    stop = full[10:14]
    assert stop and stop in full
    expected = full[: full.index(stop)]
    for engine in (ar, make_engine(gamma=6)):
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        engine.add_request("s", prompts[5], params)
        text, reason = "", None
        while engine.has_unfinished():
            for o in engine.step():
                text += o.new_text
                reason = o.finish_reason if o.finished else reason
        assert text == expected
        assert reason == "stop"
        assert_no_leaks(engine)


def test_streamed_deltas_concatenate_to_the_decoded_output(prompts, ar_outputs):
    engine = make_engine(gamma=4)
    out = engine.generate(prompts[:8], GREEDY)
    for c, ids in zip(out, ar_outputs[:8]):
        assert c.text == engine.tokenizer.decode(ids)


def test_eos_stops_generation(ckpts):
    engine = make_engine(drafter=None)
    probe = engine.generate(["def f():\n"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    first = probe[0].output_ids[2]
    # Pretend the third generated token is an end of sequence.
    engine.tokenizer.eos_token_ids = (first,)
    out = engine.generate(["def f():\n"], SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].finish_reason == "stop"
    assert out[0].output_ids == probe[0].output_ids[: probe[0].output_ids.index(first) + 1]


def test_seeded_sampling_is_reproducible(prompts):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    for mode in ("ar", "sd"):
        runs = [make_engine(drafter=None if mode == "ar" else TINY_DRAFTER).generate(prompts[:3], params)
                for _ in range(2)]
        assert [c.output_ids for c in runs[0]] == [c.output_ids for c in runs[1]]


def test_bad_requests_are_refused_and_nothing_else_is_affected(prompts, ar_outputs):
    engine = make_engine(gamma=4, max_model_len=256)
    engine.add_request("good", prompts[0], GREEDY)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("e", "", GREEDY)
    with pytest.raises(InvalidRequest, match="context"):
        engine.add_request("long", "x = 1\n" * 400, GREEDY)
    with pytest.raises(InvalidRequest, match="already in flight"):
        engine.add_request("good", prompts[1], GREEDY)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request("ids", [1, 2, 10**9], GREEDY)
    tokens = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
    assert tokens == ar_outputs[0]
    assert_no_leaks(engine)


@pytest.mark.parametrize("raw, message", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_k": -3}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"bogus": 1}, "unknown sampling parameter 'bogus'"),
    ({"n": 2}, "n must be 1"),
    ({"stop": [1, 2]}, "stop"),
])
def test_sampling_params_validation(raw, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams.from_dict(raw)


@pytest.mark.parametrize("top_p", [5e-46, "1e-46", 1e-40])
def test_a_top_p_float32_cannot_hold_is_refused_at_the_door(top_p):
    # 5e-46 is 0 in float32: every token masked, and the request failed inside the step with
    # "sampling failed" instead of being refused; 1e-40 is subnormal (0 where flushed)
    with pytest.raises(InvalidRequest, match="top_p must be at least"):
        SamplingParams.from_dict({"top_p": top_p, "temperature": 1.0})


def test_the_smallest_top_p_accepted_keeps_the_most_likely_token(prompts):
    from backend.sampling.params import MIN_TOP_P
    engine = make_engine(drafter=None)
    tiny_p = SamplingParams(max_tokens=8, temperature=1.0, top_p=MIN_TOP_P, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = engine.generate([prompts[0], prompts[0]], [tiny_p, greedy])
    assert out[0].finish_reason == "length" and out[0].output_ids == out[1].output_ids


def test_sampling_params_accept_strings_as_sent_by_genai_perf():
    p = SamplingParams.from_json('{"max_tokens": "8", "temperature": "0", "top_k": "-1", "ignore_eos": "true"}')
    assert (p.max_tokens, p.temperature, p.top_k, p.ignore_eos) == (8, 0.0, 0, True)
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        SamplingParams.from_json("{max_tokens: 8")


def test_engine_config_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="unknown engine config key"):
        EngineConfig.from_dict({"target": str(TINY_TARGET), "gama": 4})
    with pytest.raises(ConfigError, match="gamma"):
        EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), gamma=9, gamma_max=8)
    with pytest.raises(ConfigError, match="needs a drafter"):
        EngineConfig(target=str(TINY_TARGET), mode="sd")
    with pytest.raises(ConfigError, match="no config.json"):
        EngineConfig(target=str(tmp_path))
