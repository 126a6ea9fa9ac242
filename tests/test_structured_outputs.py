"""Structured outputs: every output of a constrained request parses or matches, speculation with
a grammar decodes what plain decoding with it does, and bad forms are refused at the door."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from scipy import stats as scipy_stats

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.errors import InvalidRequest
from backend.sampling.params import SamplingParams
from helpers.exactness import P_MIN
from model_factory import TINY_DRAFTER, TINY_TARGET

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef", "import os\nimport sys\n\n",
           "class Stack:\n    def push(self, x):\n", "# answer:", "x = {", "print("]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "size"],
          "properties": {"ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "string", "pattern": "^[a-z]{1,4}$"}}}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'root ::= "x=" [0-9] [0-9]? ";"'


def check_json(text: str) -> None:
    obj = json.loads(text)
    assert list(obj) == ["ok", "color", "size"], "the fields come in the schema's order"
    assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")
    assert re.fullmatch("[a-z]{1,4}", obj["size"])


FORMS = {
    # (Whitespace between JSON tokens would be unbounded: a code model likes newlines.)
    "json": ({"json": SCHEMA, "disable_any_whitespace": True}, check_json),
    "json as a string": ({"json": json.dumps(SCHEMA), "disable_any_whitespace": True}, check_json),
    "regex": ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(f"{t!r}")),
    "choice": ({"choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(f"{t!r}")),
    "grammar": ({"grammar": GRAMMAR}, lambda t: re.fullmatch(r"x=[0-9][0-9]?;", t) or pytest.fail(f"{t!r}")),
}


def params(form: dict, temperature: float = 0.0, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams.from_dict({"structured_outputs": form, "max_tokens": 64, "temperature": temperature,
                                     "seed": seed, **kw})


@pytest.fixture(scope="module")
def plain() -> Engine:
    return Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))


@pytest.mark.parametrize("form", list(FORMS))
def test_every_output_of_a_constrained_request_parses(form, plain):
    spec, check = FORMS[form]
    ps = [params(spec)] * len(PROMPTS) + [params(spec, temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    outs = plain.generate(PROMPTS * 2, ps)
    for o in outs:
        assert o.finish_reason == "stop", (form, o.text)
        check(o.text)


def test_json_object_gives_a_json_object(plain):
    outs = plain.generate(PROMPTS, params({"json_object": True, "disable_any_whitespace": True}, max_tokens=96))
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done, "no output finished within max_tokens"
    for o in done:
        assert isinstance(json.loads(o.text), dict)
    for o in outs:               # one still running is a prefix of an object
        assert o.text.lstrip().startswith("{")


def test_without_a_grammar_the_output_does_not_parse(plain):
    """The checks have power: the same prompts unconstrained do not match."""
    outs = plain.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
    assert not any(re.fullmatch(REGEX, o.text) or o.text in CHOICES for o in outs)


ENGINES = {
    "sd": dict(drafter=str(TINY_DRAFTER), mode="sd", gamma=4),
    "psd": dict(drafter=str(TINY_DRAFTER), mode="psd", gamma=3, drafter_device="cpu"),   # a worker process
    "auto": dict(drafter=str(TINY_DRAFTER), mode="auto", gamma_max=4, planner={"modes": ("sd",)}),
    "ngram": dict(proposer="ngram", mode="sd", gamma=4),
}


# Where EOS competes with more letters (EOS biased up so that every length is common): the
# drafter's EOS is verified like any draft. With drafts cut where the grammar terminated (the old
# code) speculation ended outputs later: N = 700, plain 91/57/135/417 outputs of 1/2/3/4 letters,
# speculation 54/38/107/501, p = 2e-5.
COMPETING = {"structured_outputs": {"regex": "[a-c]{1,4}"}, "logit_bias": {"0": 6.0}, "max_tokens": 8}
N_SAMPLED = 700


def output_lengths(engine: Engine) -> Counter:
    ps = [SamplingParams.from_dict({**COMPETING, "temperature": 1.0, "seed": s}) for s in range(N_SAMPLED)]
    outs = engine.generate(["x = '"] * N_SAMPLED, ps, max_concurrency=64)
    assert all(o.finish_reason == "stop" and re.fullmatch("[a-c]{1,4}", o.text) for o in outs)
    return Counter(len(o.text) for o in outs)


@pytest.mark.slow
def test_sampled_speculation_under_a_grammar_ends_outputs_where_plain_sampling_does(plain):
    """SD vs plain constrained sampling: chi-square (two samples) of the outputs' lengths, i.e.
    of where the grammar's EOS was sampled."""
    want = output_lengths(plain)
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, **ENGINES["sd"]))
    try:
        got = output_lengths(engine)
        assert engine.stats().drafted_tokens > 0
    finally:
        engine.close()
    lengths = sorted(set(want) | set(got))
    assert len(lengths) >= 3, f"EOS does not compete: {want}"
    p = scipy_stats.chi2_contingency([[want[k] for k in lengths], [got[k] for k in lengths]]).pvalue
    assert p > P_MIN, f"output lengths: plain {dict(want)}, speculation {dict(got)}, p={p:.2g}"


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "psd" else k for k in ENGINES])
def test_greedy_speculation_under_a_grammar_equals_plain_decoding(kind, plain):
    forms = [FORMS["json"][0], FORMS["regex"][0], FORMS["grammar"][0]]
    ps = [params(f) for f in forms for _ in PROMPTS[:3]]
    prompts = PROMPTS[:3] * len(forms)
    want = [o.output_ids for o in plain.generate(prompts, ps)]
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20, **ENGINES[kind]))
    try:
        got = engine.generate(prompts, ps, max_concurrency=4)
        assert [o.output_ids for o in got] == want
        assert engine.stats().drafted_tokens > 0
    finally:
        engine.close()


@pytest.mark.parametrize("form, words", [
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "could not be compiled"),
    ({"regex": "([a-z"}, "could not be compiled"),
    ({"grammar": "root ::= undefined_rule"}, "could not be compiled"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "choice": ["b"]}, "needs exactly one of"),
    ({}, "needs exactly one of"),
    ({"jsonn": {}}, "unknown key 'jsonn'"),
    ({"whitespace_pattern": " ", "regex": "a"}, "whitespace_pattern is not supported"),
])
def test_forms_that_cannot_be_used_are_refused_with_why(form, words, plain):
    with pytest.raises(InvalidRequest) as e:
        plain.prepare("r", "hi", SamplingParams.from_dict({"structured_outputs": form}))
    assert words in str(e.value)


def test_compiled_grammars_are_cached_per_form(plain):
    for _ in range(3):
        plain.prepare("r", "hi", params({"regex": "[0-9]{3}"}))
    n = plain.intake._grammars.cached
    plain.prepare("r", "hi", params({"regex": "[0-9]{3}"}))
    assert plain.intake._grammars.cached == n
    plain.prepare("r", "hi", params({"regex": "[0-9]{4}"}))
    assert plain.intake._grammars.cached == n + 1


def test_guided_keys_of_older_vllm_are_the_same_forms():
    assert SamplingParams.from_dict({"guided_regex": "a+"}).structured_outputs == \
        SamplingParams.from_dict({"structured_outputs": {"regex": "a+"}}).structured_outputs
