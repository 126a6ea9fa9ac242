"""Streaming detokenization: the deltas add up to the full decode, and the work per token stays
bounded, over runs of EOS (``ignore_eos``) and over tokens whose text ends in U+FFFD as well.

Costs are counted in operations (token ids passed to decode, characters read back), never
timed."""
from __future__ import annotations

import random

import pytest

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.model.tokenizer import IncrementalDetokenizer, Tokenizer
from backend.sampling.params import SamplingParams
from model_factory import TINY_TARGET

MIXED = "naïve café — 東京で 🚀🚀 Ωmega ∑x² «quoted» \u200d👩‍💻 done.\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(TINY_TARGET, eos_token_ids=(0,))


@pytest.fixture(scope="module")
def lone_bytes(tok) -> list[int]:
    """Ids whose text alone is U+FFFD: bytes that start or continue a character, alone."""
    ids = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    assert len(ids) >= 16
    return ids


def incremental(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None) -> str:
    d = IncrementalDetokenizer(tok)
    out, i = [], 0
    for n in chunks or [1] * len(ids):
        out.append(d.push(ids[i:i + n]))
        i += n
    out.append(d.push(ids[i:]))
    out.append(d.push([], final=True))
    return "".join(out)


def cases(tok: Tokenizer, lone_bytes: list[int]) -> dict[str, list[int]]:
    from client.prompts import load_prompts
    rng = random.Random(0)
    eos = tok.eos_token_ids[0]
    out = {f"prompt {i}": tok.encode(p) for i, p in enumerate(load_prompts(n=8))}
    out |= {f"prose {i}": tok.encode(p) for i, p in enumerate(load_prompts("prose", n=4))}
    out["multi-byte characters"] = tok.encode(MIXED * 3)
    text = tok.encode(MIXED + load_prompts(n=1)[0])
    with_eos = []
    for t in text:
        with_eos.append(t)
        if rng.random() < 0.2:
            with_eos += [eos] * rng.randint(1, 30)
    out["EOS runs between tokens"] = with_eos
    garbled = []
    for t in text:
        garbled.append(t)
        if rng.random() < 0.2:
            garbled += rng.choices(lone_bytes, k=rng.randint(1, 40))
    out["runs of lone bytes between tokens"] = garbled
    out["lone bytes only"] = rng.choices(lone_bytes, k=300)
    return out


def test_the_deltas_add_up_to_the_full_decode(tok, lone_bytes):
    rng = random.Random(1)
    for name, ids in cases(tok, lone_bytes).items():
        full = tok.decode(ids)
        assert incremental(tok, ids) == full, name
        chunks = [rng.randint(1, 6) for _ in range(len(ids) // 3)]     # several tokens a step
        assert incremental(tok, ids, chunks) == full, name


def test_no_delta_splits_a_character(tok):
    ids = tok.encode(MIXED * 4)
    full = tok.decode(ids)
    assert "\ufffd" not in full and "東京" in full
    d = IncrementalDetokenizer(tok)
    deltas = [d.push([t]) for t in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) + d.push([], final=True) == full


def decode_cost(tok: Tokenizer, ids: list[int]) -> int:
    """Token ids handed to decode() while streaming `ids` one at a time."""
    counted = {"ids": 0}
    decode = tok.decode

    def counting(ids, *args, **kwargs):
        counted["ids"] += len(ids)
        return decode(ids, *args, **kwargs)
    tok.decode = counting
    try:
        incremental(tok, ids)
    finally:
        del tok.decode
    return counted["ids"]


@pytest.mark.parametrize("tail", ["eos", "a lone byte repeated", "another lone byte repeated"])
def test_streaming_cost_is_linear_in_the_output(tok, lone_bytes, tail):
    text = tok.encode(MIXED)

    def output(n: int) -> list[int]:
        if tail == "eos":            # ignore_eos: EOS after EOS
            return text + [tok.eos_token_ids[0]] * n
        # A byte repeated never makes a character (a lead byte needs continuation bytes after
        # it, a continuation byte a lead before it): the text ends in U+FFFD after every token.
        byte = lone_bytes[0] if tail == "a lone byte repeated" else lone_bytes[-1]
        return text + [byte] * n
    small, large = decode_cost(tok, output(500)), decode_cost(tok, output(2000))
    # linear: 4x the tokens, about 4x the work (quadratic was 16x: 2000 EOS cost 2 million ids)
    assert large <= 4.5 * small, (small, large)
    assert large <= 40 * 2000, (small, large)


def test_text_is_read_near_its_end_only(monkeypatch):
    """A long output with stop strings (held back, looked for at every token): what commit and
    streaming read of the text stays proportional to what was generated."""
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True, stop=["@@never@@", "§§"])
    read = {"chars": 0}
    original = IncrementalDetokenizer.slice

    def counting(self, start, end=None):
        s = original(self, start, end)
        read["chars"] += len(s)
        return s
    monkeypatch.setattr(IncrementalDetokenizer, "slice", counting)
    engine.add_request("long", "def main():\n", params)
    pieces = []
    while engine.has_unfinished():
        pieces += [o.new_text for o in engine.step()]
    text = "".join(pieces)
    assert len(text) >= 150
    # per token: the stop-string window (about twice the longest stop string) and the delta
    assert read["chars"] <= 30 * len(text), (read["chars"], len(text))
