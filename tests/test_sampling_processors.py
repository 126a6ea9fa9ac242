"""vLLM's sampling keys: penalties, min_p, logit_bias, allowed_token_ids, bad_words.

Plain decoding with each key equals a reference written here from vLLM's documented semantics
(transformers' logits for each prefix, the rule applied in plain Python, the argmax), and
speculation (SD, PSD, auto, n-gram) with the keys equals plain decoding with them, token for
token. The sampled check (chi-square against the processed distribution) is in
test_processors_exactness.py.
"""
from __future__ import annotations

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.errors import InvalidRequest
from backend.model.tokenizer import Tokenizer
from backend.sampling.params import SamplingParams
from backend.sampling.sampler import processed_probs
from model_factory import TINY_DRAFTER, TINY_TARGET

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef", "import os\nimport sys\n\n",
           "class Stack:\n    def push(self, x):\n"]
STEPS = 12


def greedy(**keys) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, **keys)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(TINY_TARGET)


@pytest.fixture(scope="module")
def plain() -> Engine:
    return Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))


@pytest.fixture(scope="module")
def hf():
    from client.bench_vllm import load_hf
    return load_hf(str(TINY_TARGET))


def outputs(engine: Engine, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [c.output_ids for c in engine.generate(prompts, params, max_concurrency=len(prompts))]


# ---- the reference: vLLM's rules, one token at a time ---------------------------------------------

def ref_process(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams,
                bad_words: list[list[int]]) -> torch.Tensor:
    """vLLM's sampler before temperature, in its order, written out token by token."""
    x = logits.clone()
    if p.allowed_token_ids is not None:
        keep = torch.full_like(x, float("-inf"))
        keep[list(p.allowed_token_ids)] = 0.0
        x = x + keep
    for word in bad_words:                        # a word's last token, where the rest is the tail
        prefix = word[:-1]
        if len(prefix) <= len(out) and (not prefix or out[len(out) - len(prefix):] == prefix):
            x[word[-1]] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(out):              # repetition: prompt and output tokens
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):                            # frequency and presence: output tokens only
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def ref_greedy(hf, prompt: list[int], p: SamplingParams, bad_words=()) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int(ref_process(logits, prompt, out, p, list(bad_words)).argmax()))
    return out


def ref_bad_words(tok: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: the word, and the word after a space where that is a
    different first token of the same length."""
    out = []
    for w in words:
        plain = tok._tok.encode(w.lstrip(), add_special_tokens=False).ids
        spaced = tok._tok.encode(" " + w.lstrip(), add_special_tokens=False).ids
        out.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


CASES = {
    "presence_penalty": dict(presence_penalty=2.0),
    "frequency_penalty": dict(frequency_penalty=1.5),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "logit_bias": dict(logit_bias={30: 25.0, 12: 10.0}),
    "allowed_token_ids": dict(allowed_token_ids=list(range(200, 260))),
    "all at once": dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3,
                        logit_bias={30: 2.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_processor_decodes_as_vllms_rule_says(case, plain, hf, tok):
    params = greedy(**CASES[case])
    got = outputs(plain, params)
    base = outputs(plain, greedy())
    assert got != base, f"{case} changed nothing: the test would not see it missing"
    for prompt, ids in zip(PROMPTS, got):
        assert ids == ref_greedy(hf, tok.encode(prompt), params), case


def test_bad_words_ban_the_word_where_its_start_is_the_tail(plain, hf, tok):
    base = outputs(plain, greedy())
    # Words the model does produce: the decoded text of a two-token stretch and one token.
    words = [tok.decode(base[0][2:4]), tok.decode(base[1][1:2])]
    params = greedy(bad_words=words)
    got = outputs(plain, params)
    assert got != base
    ref_words = ref_bad_words(tok, words)
    assert any(len(w) > 1 for w in ref_words), "the test needs a multi-token word"
    for prompt, ids in zip(PROMPTS, got):
        assert ids == ref_greedy(hf, tok.encode(prompt), params, ref_words)


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.5, min_p=0.1), SamplingParams(temperature=1.0, min_p=0.5)]
    got = processed_probs(logits, params)
    for row, p in zip(range(2), params):
        probs = torch.softmax(logits[row] / p.temperature, dim=-1)     # after temperature
        keep = probs >= p.min_p * probs.max()
        want = torch.where(keep, probs, torch.zeros_like(probs))
        torch.testing.assert_close(got[row], want / want.sum())
    assert got[0, 2:].sum() == 0 and got[0, 1] > 0, "the first row keeps two tokens"


# ---- speculation keeps the processed output -------------------------------------------------------

SPEC_PARAMS = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4,
                   logit_bias={30: 1.5})


@pytest.fixture(scope="module")
def plain_processed(plain, tok):
    base = outputs(plain, greedy())
    words = [tok.decode(base[0][2:4])]
    params = greedy(bad_words=words, **SPEC_PARAMS)
    return params, outputs(plain, params)


ENGINES = {
    "sd": dict(drafter=str(TINY_DRAFTER), mode="sd", gamma=4),
    "psd": dict(drafter=str(TINY_DRAFTER), mode="psd", gamma=3, drafter_device="cpu"),   # a worker process
    "auto": dict(drafter=str(TINY_DRAFTER), mode="auto", gamma_max=4, planner={"modes": ("sd",)}),
    "ngram": dict(proposer="ngram", mode="sd", gamma=4),
}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "psd" else k for k in ENGINES])
def test_greedy_speculation_with_processors_equals_plain_decoding(kind, plain_processed):
    params, want = plain_processed
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, **ENGINES[kind]))
    try:
        assert outputs(engine, params) == want
        st = engine.stats()
        assert st.drafted_tokens > 0, "nothing was drafted"
        if kind != "ngram":
            assert st.accepted_tokens > 0
    finally:
        engine.close()


def test_the_drafter_proposes_from_its_processed_distribution():
    """Drafts see the same penalties and bans as the target's verification, so acceptance with
    strong processors stays near its value without them (a drafter blind to them proposes the
    repeated tokens the target penalises)."""
    strong = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=2.0,
                            presence_penalty=2.0, frequency_penalty=1.0)

    def acceptance(p: SamplingParams) -> float:
        e = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="sd", gamma=4,
                                kv_cache_bytes=16 << 20))
        try:
            outputs(e, p)
            return e.stats().acceptance_rate
        finally:
            e.close()

    without = acceptance(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    with_procs = acceptance(strong)
    assert with_procs > 0.6 * without, f"acceptance {with_procs:.2f} with penalties, {without:.2f} without"


# ---- at the door ------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, words", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": "-3"}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": "inf"}, "repetition_penalty must be a finite number > 0"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"logit_bias": [1, 2]}, "logit_bias must be an object"),
    ({"logit_bias": {"x": 1}}, "logit_bias key must be an integer"),
    ({"logit_bias": {"5": "nan"}}, "must be a number, got NaN"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids must be non-negative"),
    ({"bad_words": [""]}, "bad_words must be non-empty strings"),
    ({"bad_words": 5}, "bad_words must be a string or a list of strings"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be an integer in [0, 20]"),
])
def test_bad_values_are_refused_with_what_is_wrong(raw, words):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(raw)
    assert words in str(e.value)


def test_null_means_the_default_and_biases_are_clamped():
    p = SamplingParams.from_dict({"presence_penalty": None, "frequency_penalty": "0.5",
                                  "logit_bias": {"7": 500, "8": -1e9}})
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.5
    assert dict(p.logit_bias) == {7: 100.0, 8: -100.0}


@pytest.mark.parametrize("bias", [float("inf"), float("-inf"), float("nan")])
def test_a_bias_that_is_not_finite_is_refused_through_the_python_api(bias):
    """(JSON biases are clamped to [-100, 100]; an infinite one on a masked token would give NaN.)"""
    with pytest.raises(InvalidRequest, match="logit_bias must map token ids to finite numbers"):
        SamplingParams(logit_bias={5: bias})


@pytest.mark.parametrize("raw, words", [
    ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids: token id(s) [1000000] outside the vocabulary"),
    ({"logit_bias": {"4096": 1.0}}, "logit_bias: token id(s) [4096] outside the vocabulary"),
])
def test_token_ids_outside_the_vocabulary_are_refused(raw, words, plain):
    with pytest.raises(InvalidRequest) as e:
        plain.prepare("r", "hi", SamplingParams.from_dict(raw))
    assert words in str(e.value)


def test_a_row_that_allows_no_token_fails_its_request_alone(plain):
    """allowed_token_ids = [EOS] with min_tokens masking EOS leaves nothing to sample."""
    eos = plain.tokenizer.eos_token_ids[0]
    stuck = SamplingParams(max_tokens=4, min_tokens=2, temperature=0.0, allowed_token_ids=[eos])
    fine = greedy()
    outs = plain.generate(PROMPTS[:2], [stuck, fine])
    assert outs[0].finish_reason == "error"
    assert outs[1].output_ids == outputs(plain, fine, PROMPTS[1:2])[0]
