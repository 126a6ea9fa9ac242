"""Draft-ahead: the drafter pre-drafts the next round while the target verifies.

In the drafter itself (in process, to see its state): a hit serves exactly what drafting in line
from the same context would have; a miss, an interrupted pre-draft and a failed one leave the
drafter drafting exactly as before. Through the worker, in the engine: greedy output equals plain
decoding in sd and psd at several concurrencies, with hits counted; sampled output is checked
(chi-square) on a token that pre-drafts decide, against the target's own conditional.
"""
from __future__ import annotations

import pytest
import torch

from backend.engine.config import ConfigError, EngineConfig
from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from backend.speculation.drafter import Drafter
from backend.speculation.proposer import DraftRequest
from model_factory import TINY_DRAFTER, TINY_TARGET

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_IDS = [5, 17, 42, 9, 33, 7, 21, 64, 12, 3]


def load_drafter() -> Drafter:
    return Drafter.load(str(TINY_DRAFTER), device="cpu", dtype=torch.float32, kv_cache_bytes=4 << 20,
                        block_size=16, seed=0)


def fresh_proposal(context: list[int], gamma: int) -> list[int]:
    """What a drafter that has seen nothing else drafts after `context` (greedy)."""
    d = load_drafter()
    return d.propose([DraftRequest("ref", context, gamma, GREEDY, 0)])[0].tokens


@pytest.fixture(scope="module")
def reference_round():
    """The first proposal after the prompt, and the drafter's own next token after it."""
    first = fresh_proposal(PROMPT_IDS, 3)
    x = fresh_proposal(PROMPT_IDS + first, 1)[0]
    return first, x


def test_a_hit_serves_what_drafting_in_line_would_have(reference_round):
    first, x = reference_round
    d = load_drafter()
    req = DraftRequest("a", PROMPT_IDS, 3, GREEDY, 0, ahead=True)
    props = d.propose([req])
    assert props[0].tokens == first
    d.draft_ahead([req], props)
    # the verdict it bet on: every draft accepted, and the target's bonus token is x
    nxt = d.propose([DraftRequest("a", first + [x], 3, GREEDY, len(PROMPT_IDS), ahead=True)])
    assert nxt[0].tokens == fresh_proposal(PROMPT_IDS + first + [x], 3)
    st = d.ahead_summary()
    assert (st["rounds"], st["hits"]) == (1, 1) and st["by_accepted"] == {"3": {"rounds": 1, "hits": 1}}
    # and drafting goes on correctly from the state the hit left behind
    after = nxt[0].tokens[:2] + [7]
    ctx = PROMPT_IDS + first + [x] + after
    assert d.propose([DraftRequest("a", after, 3, GREEDY, len(PROMPT_IDS) + 4)])[0].tokens == \
        fresh_proposal(ctx, 3)


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_a_miss_drafts_in_line_from_the_right_context(reference_round, accepted):
    first, x = reference_round
    d = load_drafter()
    req = DraftRequest("a", PROMPT_IDS, 3, GREEDY, 0, ahead=True)
    props = d.propose([req])
    d.draft_ahead([req], props)
    # the target took `accepted` drafts, then a token the bet did not expect
    other = (x + 1) % d.vocab_size if accepted == 3 else (first[accepted] + 1) % d.vocab_size
    new = first[:accepted] + [other]
    got = d.propose([DraftRequest("a", new, 3, GREEDY, len(PROMPT_IDS))])
    assert got[0].tokens == fresh_proposal(PROMPT_IDS + new, 3)
    st = d.ahead_summary()
    assert (st["rounds"], st["hits"]) == (1, 0) and st["by_accepted"][str(accepted)]["rounds"] == 1


def test_an_interrupted_pre_draft_is_dropped_and_drafting_stays_right(reference_round):
    first, x = reference_round
    d = load_drafter()
    req = DraftRequest("a", PROMPT_IDS, 3, GREEDY, 0, ahead=True)
    props = d.propose([req])
    d.draft_ahead([req], props, should_stop=lambda: True)    # the next message is already there
    assert d.ahead_summary()["interrupted"] == 1
    got = d.propose([DraftRequest("a", first + [x], 3, GREEDY, len(PROMPT_IDS))])
    assert got[0].tokens == fresh_proposal(PROMPT_IDS + first + [x], 3)
    assert d.ahead_summary()["rounds"] == 0                   # nothing was pre-drafted to use


def test_a_failing_pre_draft_costs_nothing(reference_round, monkeypatch):
    first, x = reference_round
    d = load_drafter()
    req = DraftRequest("a", PROMPT_IDS, 3, GREEDY, 0, ahead=True)
    props = d.propose([req])
    with monkeypatch.context() as m:
        m.setattr(d, "_draft", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        d.draft_ahead([req], props)
    got = d.propose([DraftRequest("a", first + [x], 3, GREEDY, len(PROMPT_IDS))])
    assert got[0].tokens == fresh_proposal(PROMPT_IDS + first + [x], 3)


def test_only_requests_that_ask_are_drafted_ahead():
    d = load_drafter()
    req = DraftRequest("a", PROMPT_IDS, 3, GREEDY, 0)          # ahead=False
    first = d.propose([req])
    d.draft_ahead([req], first)
    d.propose([DraftRequest("a", first[0].tokens, 3, GREEDY, len(PROMPT_IDS))])
    assert d.ahead_summary()["rounds"] == 0


def test_draft_ahead_needs_a_drafter_on_its_own_device():
    with pytest.raises(ConfigError, match="draft_ahead: needs a drafter model on its own device"):
        EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="sd", draft_ahead=True)


# ------------------------------------------------------------------------------- in the engine

def make_engine(mode: str, **kw) -> Engine:
    kw.setdefault("gamma", 3)
    return Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode=mode,
                               drafter_device="cpu", kv_cache_bytes=16 << 20, draft_ahead=True, **kw))


@pytest.fixture(scope="module")
def prompts():
    from client.prompts import load_prompts
    return [p[: 15 + 41 * i % 300] for i, p in enumerate(load_prompts(n=8))]


@pytest.fixture(scope="module")
def ar_outputs(prompts):
    ar = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
    return [c.output_ids for c in ar.generate(prompts, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sd", "psd"])
def test_greedy_output_with_draft_ahead_equals_plain_decoding(mode, prompts, ar_outputs):
    engine = make_engine(mode)
    try:
        for concurrency in (1, 3):
            out = engine.generate(prompts, GREEDY, max_concurrency=concurrency)
            assert [c.output_ids for c in out] == ar_outputs, f"{mode} at concurrency {concurrency}"
        st = engine.stats().draft_ahead
        assert st["rounds"] > 0 and st["hits"] > 0, st      # pre-drafts were made and used
        assert st["hidden_s"] > 0
    finally:
        engine.close()


@pytest.mark.slow
def test_sampled_tokens_decided_by_pre_drafts_follow_the_target():
    # gamma 1, 5 tokens: step 1 drafts d1 and pre-drafts (x, e1); when d1 is accepted and the
    # target's bonus is x, step 2 verifies e1, which decides the 4th token. Every run's 4th token
    # must follow the target's conditional distribution given that run's first three: the
    # randomised probability integral transform u = F(t4 - 1) + V p(t4), V uniform, is then
    # exactly uniform (Kolmogorov-Smirnov over all runs).
    scipy_stats = pytest.importorskip("scipy.stats")
    from test_sampling_exactness import PROMPT, load_target_hf, next_probs
    from backend.model.tokenizer import Tokenizer
    engine = make_engine("sd", gamma=1, gamma_max=1)
    try:
        params = [SamplingParams(max_tokens=5, temperature=1.0, seed=s, ignore_eos=True) for s in range(1500)]
        runs = [c.output_ids for c in engine.generate([PROMPT] * len(params), params, max_concurrency=4)]
        hits = engine.stats().draft_ahead["hits"]
    finally:
        engine.close()
    assert hits >= 100, f"only {hits} pre-drafts used: the test would not test them"
    ids = Tokenizer.from_pretrained(str(TINY_TARGET)).encode(PROMPT)
    p4 = next_probs(load_target_hf(), [ids + r[:3] for r in runs])           # [runs, V]
    t4 = torch.tensor([r[3] for r in runs])
    below = torch.cumsum(p4, dim=1).gather(1, t4[:, None])[:, 0] - p4.gather(1, t4[:, None])[:, 0]
    u = below + torch.rand(len(runs), generator=torch.Generator().manual_seed(0)) * p4.gather(1, t4[:, None])[:, 0]
    p = scipy_stats.kstest(u.numpy(), "uniform").pvalue
    assert p > 1e-3, f"4th tokens against the target's conditionals: KS p={p:.2g} over {len(runs)} runs"
