"""vLLM's output options: include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, truncate_prompt_tokens and prompt_logprobs."""
from __future__ import annotations

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.model.tokenizer import IncrementalDetokenizer, Tokenizer
from backend.sampling.params import SamplingParams
from model_factory import TINY_DRAFTER, TINY_TARGET

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef"


def greedy(**keys) -> SamplingParams:
    keys.setdefault("max_tokens", 16)
    return SamplingParams(temperature=0.0, ignore_eos=True, **keys)


@pytest.fixture(scope="module")
def plain() -> Engine:
    return Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))


def one(engine: Engine, params: SamplingParams, prompt=PROMPT):
    return engine.generate([prompt], params)[0]


def test_include_stop_str_in_output_keeps_the_stop_string(plain):
    text = one(plain, greedy()).text
    stop = text[5:8]
    assert stop and text.find(stop) == 5
    cut = one(plain, greedy(stop=[stop]))
    kept = one(plain, greedy(stop=[stop], include_stop_str_in_output=True))
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert cut.text == text[:5]
    assert kept.text == text[:8]


def test_include_stop_str_in_output_streams_the_same_text(plain):
    """Streamed deltas (no text held back when the stop string is kept) add up to the text."""
    text = one(plain, greedy()).text
    stop = text[6:9]
    assert stop and text.find(stop) == 6
    params = greedy(stop=[stop], include_stop_str_in_output=True)
    plain.add_request("s", PROMPT, params)
    deltas = []
    while plain.has_unfinished():
        deltas += [o.new_text for o in plain.step() if o.request_id == "s"]
    assert "".join(deltas) == text[:9]


def test_skip_special_tokens_decides_whether_eos_is_in_the_text(plain):
    eos = plain.tokenizer.eos_token_ids[0]
    eos_text = plain.tokenizer.token_text(eos)
    forced = dict(logit_bias={eos: 100.0}, max_tokens=3)        # EOS every step (ignore_eos)
    skipped = one(plain, greedy(**forced))
    kept = one(plain, greedy(skip_special_tokens=False, **forced))
    assert skipped.output_ids == kept.output_ids == [eos] * 3
    assert skipped.text == ""
    assert kept.text == eos_text * 3


def wordlevel_tokenizer() -> Tokenizer:
    """A tokenizer whose decoder puts a space between tokens (no decoder: tokens joined by
    spaces), with two added special tokens."""
    from tokenizers import AddedToken, Tokenizer as HF
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    hf = HF(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = Whitespace()
    hf.add_special_tokens([AddedToken("<x>", special=True), AddedToken("<y>", special=True)])
    return Tokenizer(hf, eos_token_ids=())


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens():
    tok = wordlevel_tokenizer()
    x, y = tok._tok.token_to_id("<x>"), tok._tok.token_to_id("<y>")
    ids = [0, x, y, 1]
    spaced = IncrementalDetokenizer(tok, skip_special_tokens=False)
    joined = IncrementalDetokenizer(tok, skip_special_tokens=False, spaces_between_special_tokens=False)
    for t in ids:
        spaced.push([t])
        joined.push([t])
    spaced.push([], final=True)
    joined.push([], final=True)
    assert spaced.text == tok.decode(ids, skip_special_tokens=False) == "a <x> <y> b"
    assert joined.text == "a <x><y> b"


def test_truncate_prompt_tokens_keeps_the_last_tokens(plain):
    ids = plain.tokenizer.encode(PROMPT)
    k = 6
    truncated = one(plain, greedy(truncate_prompt_tokens=k))
    direct = one(plain, greedy(), prompt=ids[-k:])
    assert truncated.output_ids == direct.output_ids
    plain.add_request("t", PROMPT, greedy(truncate_prompt_tokens=k, max_tokens=1))
    outs = []
    while plain.has_unfinished():
        outs += plain.step()
    assert outs[-1].num_prompt_tokens == k


def reference_prompt_logprobs(ids: list[int], top: int):
    from client.bench_vllm import load_hf
    hf = load_hf(str(TINY_TARGET))
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [(lp[p, ids[p + 1]].item(), torch.topk(lp[p], top)) for p in range(len(ids) - 1)]


@pytest.mark.parametrize("kind", ["plain, chunked prefill", "sd"])
def test_prompt_logprobs_are_the_targets_logprobs_of_the_prompt(kind):
    cfg = dict(target=str(TINY_TARGET), kv_cache_bytes=16 << 20)
    if kind == "sd":
        cfg |= dict(drafter=str(TINY_DRAFTER), mode="sd", gamma=3)
    else:
        cfg |= dict(max_num_batched_tokens=8)       # the prompt is scored in several chunks
    engine = Engine(EngineConfig(**cfg))
    try:
        got = one(engine, greedy(prompt_logprobs=2, max_tokens=4))
    finally:
        engine.close()
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) > 8
    ref = reference_prompt_logprobs(ids, 2)
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(ids)
    assert got.prompt_logprobs[0] is None
    for entry, tok, (lp, top) in zip(got.prompt_logprobs[1:], ids[1:], ref):
        assert entry.token == tok
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert [t for t, _ in entry.top] == top.indices.tolist()


def test_no_prompt_logprobs_unless_asked(plain):
    assert one(plain, greedy(max_tokens=2)).prompt_logprobs is None
