"""One bad request never hurts another, in-process: values checked at the door, failures inside
a batched step kept to the request(s) at fault, stopping rules, memory and queue limits."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.config import ConfigError
from backend.engine.loop import EngineLoop
from backend.errors import InvalidRequest, ServerBusy
from backend.sampling.params import SamplingParams
from helpers.engines import block_bytes, tiny_engine
from model_factory import TINY_DRAFTER, TINY_TARGET, save_random_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n"]


def make_engine(mode="sd", drafter=TINY_DRAFTER, **kw) -> Engine:
    return tiny_engine(mode, drafter, **kw)


def run(engine: Engine, requests: dict[str, tuple]) -> dict[str, dict]:
    """Add (prompt, params) or a prepared Sequence per id, step to the end; per id: tokens,
    text, finish reason, error."""
    res = {rid: {"ids": [], "text": "", "reason": None, "error": None} for rid in requests}
    for rid, req in requests.items():
        if isinstance(req, tuple):
            engine.add_request(rid, *req)
        else:
            engine.enqueue(req)
    while engine.has_unfinished():
        for o in engine.step():
            r = res[o.request_id]
            r["ids"] += o.new_token_ids
            r["text"] += o.new_text
            if o.finished:
                r["reason"], r["error"] = o.finish_reason, o.error
    return res


def alone(engine: Engine, prompt: str, params: SamplingParams) -> list[int]:
    return run(engine, {"alone": (prompt, params)})["alone"]["ids"]


@pytest.fixture(scope="module")
def sd():
    engine = make_engine()
    yield engine
    engine.close()


# ---- values the kernels would not take are settled at the door -----------------------------------

def test_a_tiny_temperature_decodes_greedily_and_spares_the_batch(sd):
    bad = SamplingParams(max_tokens=12, temperature=1e-39, ignore_eos=True)
    assert bad.greedy, "a temperature this close to 0 is argmax"
    got = run(sd, {"good": (PROMPTS[0], GREEDY), "tiny-t": (PROMPTS[1], bad)})
    assert got["good"]["reason"] == got["tiny-t"]["reason"] == "length"
    assert got["good"]["ids"] == alone(sd, PROMPTS[0], GREEDY)
    assert got["tiny-t"]["ids"] == alone(sd, PROMPTS[1], GREEDY)


def test_the_largest_seed_is_served_and_spares_the_batch(sd):
    top = SamplingParams(max_tokens=12, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    got = run(sd, {"good": (PROMPTS[0], GREEDY), "top-seed": (PROMPTS[1], top)})
    assert got["good"]["reason"] == got["top-seed"]["reason"] == "length"
    assert got["good"]["ids"] == alone(sd, PROMPTS[0], GREEDY)
    assert got["top-seed"]["ids"] == alone(sd, PROMPTS[1], top), "a seeded request is reproducible"
    assert sd.stats().drafter_request_failures == 0


@pytest.mark.parametrize("raw, words", [
    ({"seed": 2**64}, "seed must be an integer in [0, 2**64 - 1]"),
    ({"seed": str(2**70)}, "seed must be an integer in [0, 2**64 - 1]"),
    ({"seed": -1}, "seed must be an integer in [0, 2**64 - 1]"),
    ({"temperature": 10**400}, "temperature must be a number"),
    ({"temperature": "1e400"}, "temperature must be <= 100"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
    ({"stop": ["x"] * 65}, "at most 64 stop strings"),
    ({"stop": ["y" * 1025]}, "at most 1024 characters"),
    ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative"),
])
def test_values_the_kernels_cannot_take_are_invalid_arguments(raw, words):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(raw)
    assert words in str(e.value)


def test_a_json_integer_of_5000_digits_is_an_invalid_argument():
    text = '{"max_tokens": ' + "7" * 5000 + "}"
    with pytest.raises(InvalidRequest, match="sampling_parameters could not be parsed"):
        SamplingParams.from_json(text)
    with pytest.raises(InvalidRequest, match=r"max_tokens must be an integer, got '7777.*\(5002 characters\)"):
        SamplingParams.from_dict({"max_tokens": "7" * 5000})


def test_max_tokens_beyond_the_context_is_refused(sd):
    with pytest.raises(InvalidRequest, match=r"max_tokens must be at most the context length \(1024 tokens\)"):
        sd.add_request("huge", PROMPTS[0], SamplingParams(max_tokens=10**12))
    assert not sd.has_unfinished()


def test_stop_token_ids_outside_the_vocabulary_are_refused(sd):
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        sd.add_request("bad-stop", PROMPTS[0], SamplingParams(stop_token_ids=[10**9]))


# ---- what still fails inside a step fails alone ------------------------------------------------------

def forced(params: SamplingParams, **fields) -> SamplingParams:
    """Parameters that got past validation with a value the kernels reject (the safety net
    below validation: a bug, or a value validation did not foresee)."""
    for k, v in fields.items():
        object.__setattr__(params, k, v)
    return params


def test_a_request_the_sampler_rejects_fails_alone(sd):
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    bad = forced(SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True), temperature=1e-39)
    got = run(sd, {"greedy": (PROMPTS[0], GREEDY), "seeded": (PROMPTS[2], seeded), "bad": (PROMPTS[1], bad)})
    assert got["bad"]["reason"] == "error" and "sampling failed" in got["bad"]["error"]
    assert got["greedy"]["reason"] == got["seeded"]["reason"] == "length"
    assert got["greedy"]["ids"] == alone(sd, PROMPTS[0], GREEDY)
    assert got["seeded"]["ids"] == alone(sd, PROMPTS[2], seeded)
    assert sd.kv.num_free_blocks == sd.kv.num_blocks
    assert run(sd, {"after": (PROMPTS[0], GREEDY)})["after"]["ids"] == got["greedy"]["ids"], \
        "the engine serves on afterwards"


def test_a_request_the_forward_rejects_fails_alone(sd):
    broken = sd.prepare("broken", PROMPTS[1], GREEDY)
    broken.token_ids[-1] = sd.target.config.vocab_size + 7     # an embedding lookup that raises
    reqs = {f"ok{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    got = run(sd, {**reqs, "broken": broken})
    assert got["broken"]["reason"] == "error" and "forward pass failed" in got["broken"]["error"]
    for i, p in enumerate(PROMPTS):
        assert got[f"ok{i}"]["reason"] == "length"
        assert got[f"ok{i}"]["ids"] == alone(sd, p, GREEDY)
    assert sd.kv.num_free_blocks == sd.kv.num_blocks


def test_a_request_the_drafter_cannot_serve_decodes_without_drafts(tmp_path):
    # A drafter with a shorter context than the target's: its forward raises for the long
    # request only. That request decodes plainly (same tokens: speculation is lossless); the
    # other keeps its drafts.
    short = save_random_llama(tmp_path / "short-drafter", max_positions=64, seed=3)
    engine = make_engine(drafter=short, gamma=3)
    ar = make_engine(mode="ar", drafter=None)
    long_prompt = "def f(x):\n" + "    x = x + 1\n" * 12
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert len(engine.tokenizer.encode(long_prompt)) > 64
    got = run(engine, {"long": (long_prompt, params), "short": (PROMPTS[0], params)})
    assert got["long"]["ids"] == alone(ar, long_prompt, params)
    assert got["short"]["ids"] == alone(ar, PROMPTS[0], params)
    assert engine.stats().drafter_request_failures == 1
    assert engine.stats().drafted_tokens > 0, "the short request lost its drafts too"
    assert engine.drafter.stats().num_sequences == 0


# ---- stopping ------------------------------------------------------------------------------------

def reference_stop(tok, ids: list[int], stop: str, min_tokens: int) -> str:
    """vLLM's rule on a finished greedy run: look for the stop string only where it ends in the
    text the k-th token added, from token min_tokens on; cut where it begins."""
    prev = ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if k >= min_tokens:
            i = text.find(stop, max(0, len(prev) - len(stop) + 1))
            if i >= 0:
                return text[:i]
        prev = text
    raise AssertionError("the stop string never occurs after min_tokens")


def test_a_stop_string_suppressed_by_min_tokens_does_not_stop_later(sd):
    prompt = "import os\n"            # the tiny target repeats "import os" lines
    plain = run(sd, {"plain": (prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))})
    text, ids = plain["plain"]["text"], plain["plain"]["ids"]
    stop = "os\n"
    first = text.index(stop)
    # min_tokens reached while the first occurrence is still within a stop string's length
    min_tokens = next(k for k in range(1, len(ids)) if len(sd.tokenizer.decode(ids[:k])) > first + len(stop))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop],
                            min_tokens=min_tokens)
    want = reference_stop(sd.tokenizer, ids, stop, min_tokens)
    got = run(sd, {"stopped": (prompt, params)})["stopped"]
    assert got["reason"] == "stop"
    assert got["text"] == want
    assert got["text"].count(stop) == want.count(stop)


def test_min_tokens_masks_eos(sd):
    from client import bench_vllm
    prompt = 'if __name__ == "__main__":\n    main()\n'     # the tiny target ends files here
    eos = sd.tokenizer.eos_token_ids
    first = run(sd, {"p": (prompt, SamplingParams(max_tokens=4, temperature=0.0))})["p"]
    assert first["reason"] == "stop" and first["ids"][0] in eos, "this prompt should end at once"
    params = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6)
    ids = sd.tokenizer.encode(prompt)
    hf = bench_vllm.load_hf(str(TINY_TARGET))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, min_new_tokens=6, max_new_tokens=12,
                          eos_token_id=list(eos), pad_token_id=eos[0])[0, len(ids):].tolist()
    ref = [t for t in ref if t not in eos] if len(ref) < 12 else ref
    for mode in ("ar", "sd"):
        engine = sd if mode == "sd" else make_engine(mode="ar", drafter=None)
        got = run(engine, {mode: (prompt, params)})[mode]
        assert not set(got["ids"][:6]) & set(eos), f"{mode}: EOS before min_tokens"
        assert [t for t in got["ids"] if t not in eos] == ref, mode


# ---- memory, queue and input limits -------------------------------------------------------------

def test_max_model_len_is_what_the_pool_holds():
    small = make_engine(mode="ar", drafter=None, kv_cache_bytes=20 * block_bytes())
    assert small.max_model_len == 20 * 16
    with pytest.raises(ConfigError, match="max_model_len: 400 tokens do not fit the KV pool"):
        make_engine(mode="ar", drafter=None, kv_cache_bytes=20 * block_bytes(), max_model_len=400)


def test_a_request_admitted_while_the_pool_is_lent_is_never_cut_short(sd):
    from backend.engine.memory import ElasticMemory
    base = 12
    engine = make_engine(gamma=3, kv_cache_bytes=base * block_bytes(), offload=True)
    weights = sum(p.numel() * p.element_size() for p in engine.target.parameters())
    memory = ElasticMemory(engine.kv, engine.drafter, engine.scheduler, block_bytes(), weights)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    engine.set_gamma(0)
    memory.offload()
    assert engine.kv.num_blocks > base
    # Too long for the pool with the drafter back: refused now rather than cut short later.
    with pytest.raises(InvalidRequest, match="the context holds 192"):
        engine.add_request("too-long", "x = 1\n" * 200, params)
    prompts = [p * 4 for p in PROMPTS] * 2
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    tokens = {str(i): [] for i in range(len(prompts))}
    reasons = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 6:
            assert engine.kv.num_used_blocks > base, "the lent pool was not used"
            memory.start_reload()                   # shrink back: preempt, never truncate
            assert engine.kv.num_blocks == base and memory.agrees()
        if engine.drafter.state == "reloading" and memory.poll() is not None:
            engine.set_gamma(3)
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        steps += 1
    assert set(reasons.values()) == {"length"}
    assert all(len(t) == params.max_tokens for t in tokens.values())
    ar = make_engine(mode="ar", drafter=None)
    assert [tokens[str(i)] for i in range(len(prompts))] == [c.output_ids for c in ar.generate(prompts, params)]


def test_an_oversize_prompt_is_refused_before_it_is_tokenized(sd):
    huge = "x" * (4 << 20)
    with pytest.raises(InvalidRequest, match=rf"the prompt has at least {4 << 20} bytes; at most {sd.max_prompt_bytes}"):
        sd.add_request("huge", huge, GREEDY)
    assert sd.max_prompt_bytes < 1 << 20
    # Just under the limit: tokenized, then refused for its token count (nothing in between).
    with pytest.raises(InvalidRequest, match="tokens; the context holds"):
        sd.add_request("long", "x " * (sd.max_prompt_bytes // 2), GREEDY)


def test_the_default_prompt_limit_stays_small_for_long_contexts_and_long_tokens(sd):
    """2 x context x the longest token reached 32 MiB at a 128k context with 128-byte tokens:
    seconds of tokenizing for a prompt that is then refused. The default caps the average."""
    from backend.engine.prompt_limit import default_max_prompt_bytes
    assert default_max_prompt_bytes(131072, 128) == (4 << 20) + 1024
    assert default_max_prompt_bytes(1024, 3) == 6 * 1024 + 1024        # short tokens: the exact bound
    assert sd.max_prompt_bytes == default_max_prompt_bytes(sd.max_model_len, sd.tokenizer.max_token_bytes)


def test_tokenizing_a_long_prompt_does_not_stall_other_streams():
    """While one request's prompt is being tokenized (outside the engine's lock), the loop keeps
    stepping: the tokenizer is held inside its encode until a stream in flight has produced five
    more tokens, which it cannot if tokenizing blocked the loop. Events and deadlines, no timing."""
    engine = make_engine(mode="ar", drafter=None, max_prompt_bytes=8 << 20)
    loop = EngineLoop(engine)
    arrived = threading.Condition()
    count = [0]
    done = threading.Event()
    big = "def f(x):\n    return x\n" * 170_000      # 4 MB: refused for its length once tokenized
    real_encode = engine.tokenizer.encode
    during: list[int] = []

    def on_output(out):
        with arrived:
            count[0] += len(out.new_token_ids)
            arrived.notify_all()
        if out.finished:
            done.set()

    def wait_for_tokens(n: int) -> bool:
        with arrived:
            return arrived.wait_for(lambda: count[0] >= n, timeout=30)

    def encode(text, *a, **k):
        if len(text) == len(big):      # hold this tokenization until the stream moved on
            before = count[0]
            wait_for_tokens(before + 5)
            during.append(count[0] - before)
        return real_encode(text, *a, **k)
    engine.tokenizer.encode = encode
    try:
        loop.submit("stream", PROMPTS[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                    on_output)
        assert wait_for_tokens(5), "the stream did not start"
        with pytest.raises(InvalidRequest, match="tokens; the context holds"):
            loop.submit("big", big, GREEDY, lambda o: None)
        assert during and during[0] >= 5, f"the stream produced {during} tokens while a prompt was tokenized"
        assert done.wait(60)
    finally:
        loop.shutdown()


def test_the_waiting_queue_is_bounded():
    engine = make_engine(mode="ar", drafter=None, max_waiting=3, max_waiting_bytes=1000)
    for i in range(3):
        engine.add_request(f"q{i}", PROMPTS[0], GREEDY)
    with pytest.raises(ServerBusy, match=r"server busy: 3 requests are waiting \(max_waiting 3\)"):
        engine.add_request("q3", PROMPTS[0], GREEDY)
    engine.step()                       # they start running: the queue has room again
    engine.add_request("q3", PROMPTS[0], GREEDY)
    engine.add_request("big", "y" * 900, GREEDY)
    with pytest.raises(ServerBusy, match="bytes of prompts are waiting"):
        engine.add_request("big2", "z" * 900, GREEDY)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("later", PROMPTS[0], GREEDY)   # nothing leaked from the accounting
    engine.add_request("later2", "z" * 900, GREEDY)


def test_sampling_generators_live_on_the_engine_device(sd):
    seq = sd.prepare("g", PROMPTS[0], SamplingParams(temperature=1.0, seed=1))
    assert seq.generator.device == sd.device
    # the drafter's per-sequence generators, looked at while the request is in flight (they are
    # freed with it)
    sd.add_request("g", PROMPTS[0], SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True))
    devices, reasons = [], []
    while sd.has_unfinished():
        for o in sd.step():
            if o.finished:
                reasons.append(o.finish_reason)
        devices += [st.generator.device for st in sd.drafter.drafter._seqs.values()]
    assert reasons == ["length"]
    assert devices and all(d == sd.drafter.drafter.device for d in devices)


def test_json_parsing_errors_name_what_is_wrong():
    from backend.values import parse_json_object
    with pytest.raises(InvalidRequest, match="request parameters is nested too deeply"):
        parse_json_object("[" * 100_000 + "]" * 100_000, "request parameters")
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        parse_json_object(json.dumps([1, 2]), "sampling_parameters")
