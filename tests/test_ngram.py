"""The n-gram (prompt lookup) proposer: what it proposes, that its index grows with the new tokens
only, and that the engine with it decodes exactly as plain decoding, greedy and sampled."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from backend.engine.config import ConfigError, EngineConfig
from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from backend.speculation.ngram import NgramProposer, NgramShadow
from backend.speculation.proposer import DraftRequest
from helpers import exactness
from helpers.arms import StepModes, force_arms
from model_factory import TINY_DRAFTER, TINY_TARGET

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SAMPLED_RUNS = 1200
# Code that repeats itself, as edits and refactors do; and prose the code model has no copy of.
COPY_PROMPTS = [
    "def area(w, h):\n    return w * h\n\n\ndef area(w, h):\n",
    "for i in range(10):\n    total += i\nfor i in range(10):\n",
    "import os\nimport sys\nimport re\n\nimport os\nimport",
]
FREE_PROMPTS = ["The weather today", "class Stack:\n    def push(self, x):\n"]


def ask(p: NgramProposer, seq: str, new: list[int], start: int, gamma: int = 3, params=GREEDY):
    return p.propose([DraftRequest(seq, new, gamma, params, start=start)])[0]


def test_proposes_the_continuation_of_the_longest_latest_match():
    p = NgramProposer(vocab_size=100, min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # suffix (6, 7) occurs twice earlier, ending at 2 and 6: the latest (-> 9, 2) wins ...
    assert ask(p, "a", toks, 0).tokens == [9, 2, 6]
    # ... but a longer match beats a later one: (5, 6, 7) ends only at 2, so 8, 1 follows.
    q = NgramProposer(vocab_size=100, min_n=1, max_n=3)
    assert ask(q, "b", [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7], 0, gamma=2).tokens == [8, 1]


def test_no_match_proposes_nothing_and_min_n_is_respected():
    p = NgramProposer(vocab_size=100, min_n=2, max_n=3)
    assert ask(p, "a", [1, 2, 3, 4, 3], 0).tokens == []        # only a 1-gram (3) repeats
    p1 = NgramProposer(vocab_size=100, min_n=1, max_n=3)
    assert ask(p1, "a", [1, 2, 3, 4, 3], 0).tokens == [4, 3]


def test_the_index_grows_with_the_new_tokens_only():
    p = NgramProposer(vocab_size=1000, min_n=1, max_n=4)
    writes = Counter()

    class CountingDict(dict):
        def __setitem__(self, key, value):
            writes["n"] += 1
            super().__setitem__(key, value)

    toks = list(range(200))
    ask(p, "s", toks, 0)
    p._seqs["s"].ends = CountingDict(p._seqs["s"].ends)
    for step in range(50):                        # one committed token per step, as decoding does
        writes["n"] = 0
        ask(p, "s", [900 + step], len(toks))
        toks.append(900 + step)
        assert writes["n"] <= 4, f"step {step}: {writes['n']} index writes for one new token"


def test_a_gap_in_the_tokens_asks_for_a_resync_and_a_restart_rebuilds():
    p = NgramProposer(vocab_size=100)
    ask(p, "s", [1, 2, 3, 1, 2], 0)
    assert ask(p, "s", [9], 7).resync                  # tokens 5..6 were never sent
    assert p.stats().num_sequences == 0                      # forgotten, not drafted from a wrong context
    assert ask(p, "s", [1, 2, 3, 1, 2], 0).tokens == [3, 1, 2]


def test_sampled_requests_get_one_hot_draft_distributions():
    p = NgramProposer(vocab_size=50)
    prop = ask(p, "s", [1, 2, 3, 1, 2], 0, params=SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    assert prop.tokens == [3, 1, 2]
    assert prop.probs.shape == (3, 50)
    assert prop.probs.sum(dim=1).tolist() == [1.0, 1.0, 1.0]
    assert prop.probs.argmax(dim=1).tolist() == [3, 1, 2]


def _seq(sid: str, tokens: list[int], speculates: bool = True):
    return SimpleNamespace(request_id=sid, token_ids=list(tokens), speculates=speculates)


def test_the_shadow_counts_what_the_lookups_drafts_would_have_matched():
    sh = NgramShadow(gamma=3, min_n=1, max_n=3)
    a = _seq("a", [1, 2, 3, 1, 2])
    assert sh.observe([a]) == (0, 0)          # first sight: the proposal (3, 1, 2) is made
    a.token_ids += [3, 1, 9]                   # two drafted tokens match, the third does not
    assert sh.observe([a]) == (2, 3)
    a.token_ids += [9]                         # 9 never occurred before: there was no proposal
    assert sh.observe([a]) == (0, 1)
    a.token_ids += [9, 5]                      # the last 9 was followed by 9: proposal [9], matched
    assert sh.observe([a]) == (1, 1)           # (and nothing further to compare it with)


def test_the_shadow_counts_no_proposal_as_a_miss_and_skips_what_does_not_speculate():
    sh = NgramShadow(gamma=2, min_n=2, max_n=2)
    b = _seq("b", [1, 2, 3])                   # the bigram (2, 3) never occurred before
    off = _seq("off", [5, 6, 5, 6], speculates=False)
    sh.observe([b, off])
    b.token_ids += [4]
    off.token_ids += [5]
    assert sh.observe([b, off]) == (0, 1)      # b: one compared, none matched; off: not counted
    # a sequence that left the batch is forgotten; seen again, it is indexed afresh first
    sh.observe([])
    b.token_ids += [2, 3]
    assert sh.observe([b]) == (0, 0)


def test_config_rejects_what_ngram_cannot_do():
    base = dict(target=str(TINY_TARGET), proposer="ngram", kv_cache_bytes=8 << 20)
    assert EngineConfig(**base).mode == "sd"                    # speculates by default, no drafter
    with pytest.raises(ConfigError, match="no drafter"):
        EngineConfig(**base, drafter=str(TINY_DRAFTER))
    with pytest.raises(ConfigError, match="psd"):
        EngineConfig(**base, mode="psd", drafter_device="cpu")
    with pytest.raises(ConfigError, match="ngram_min"):
        EngineConfig(**base, ngram_min=3, ngram_max=2)
    with pytest.raises(ConfigError, match="proposer"):
        EngineConfig(target=str(TINY_TARGET), proposer="eagle")


def generate(engine: Engine, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [c.output_ids for c in engine.generate(prompts, [params] * len(prompts), max_concurrency=4)]


@pytest.fixture(scope="module")
def plain_greedy():
    e = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=16 << 20))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    return generate(e, COPY_PROMPTS + FREE_PROMPTS, params)


@pytest.mark.parametrize("mode", ["sd", "auto"])
def test_ngram_greedy_output_equals_plain_decoding(mode, plain_greedy):
    """auto: its arms forced in turn (plain decoding, then n-gram drafts), so both kinds of step run."""
    e = Engine(EngineConfig(target=str(TINY_TARGET), proposer="ngram", mode=mode, gamma=4,
                            kv_cache_bytes=16 << 20))
    try:
        if mode == "auto":
            force_arms(e, [("ar", 0), ("sd", 4)], hold=2)
        modes = StepModes(e)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = COPY_PROMPTS + FREE_PROMPTS
        out = [c.output_ids for c in e.generate(prompts, [params] * len(prompts), max_concurrency=4, on_step=modes)]
        assert out == plain_greedy
        st = e.stats()
        assert st.drafted_tokens > 0 and st.accepted_tokens > 0, "n-gram drafts were never used"
        assert st.target_calls < sum(len(o) for o in plain_greedy), "speculation saved no target calls"
        if mode == "auto":
            assert modes["ar"] > 0 and modes["sd"] > 0, modes
    finally:
        e.close()


def test_proposer_both_needs_a_drafter_and_mode_auto():
    with pytest.raises(ConfigError, match="proposer 'both'"):
        EngineConfig(target=str(TINY_TARGET), proposer="both", mode="sd", drafter=str(TINY_DRAFTER))
    with pytest.raises(ConfigError, match="needs a drafter checkpoint"):
        EngineConfig(target=str(TINY_TARGET), proposer="both", mode="auto")


@pytest.mark.slow
def test_the_planner_chooses_between_drafter_ngram_and_none_per_step(plain_greedy):
    # proposer "both": the drafter model in its worker and an n-gram proposer in one engine; the
    # planner's arms are ar, sd:g, psd:g and ngram:g, scored by what they deliver. Greedy output
    # stays plain decoding's, and over text that copies its prompt and then sampled code every
    # kind of arm runs. The n-gram drafts' shadow match rate (measured on every step, whatever
    # ran) is high on the copying text and low on the held-out code: it is what sends the
    # planner to the n-gram arms before they have run (the choice itself: test_planner.py).
    from client.prompts import load_prompts
    e = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), proposer="both",
                            mode="auto", gamma=3, gamma_max=3, drafter_device="cpu",
                            kv_cache_bytes=16 << 20))

    def plays() -> Counter:
        out = Counter()
        for arm, n in e.planner.summary()["arm_counts"].items():
            out[arm.split(":")[0]] += n
        return out
    try:
        assert {a[0] for a in e.planner.arms} == {"ar", "sd", "psd", "ngram"}
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        modes = Counter()
        prompts = COPY_PROMPTS + FREE_PROMPTS
        out = [c.output_ids for c in e.generate(prompts, [params] * len(prompts), max_concurrency=4,
                                               on_step=lambda _o: modes.update([e.stats().last_step.mode]))]
        assert out == plain_greedy
        copying = e.planner.summary()["ngram_alpha_estimate"]
        sampled = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, ignore_eos=True) for i in range(16)]
        e.generate(load_prompts(n=16), sampled, max_concurrency=4,        # held-out code
                   on_step=lambda _o: modes.update([e.stats().last_step.mode]))
        total = plays()
        assert copying > 0.3 and e.planner.summary()["ngram_alpha_estimate"] < 0.15
        assert total["sd"] + total["psd"] > 0 and total["ngram"] > 0 and total["ar"] > 0, total
        assert modes["ngram"] > 0 and modes["sd"] + modes["psd"] > 0, modes   # ran what it chose
    finally:
        e.close()


def test_a_request_that_opts_out_gets_no_ngram_drafts():
    e = Engine(EngineConfig(target=str(TINY_TARGET), proposer="ngram", gamma=4, kv_cache_bytes=16 << 20))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    generate(e, COPY_PROMPTS, params)
    assert e.stats().drafted_tokens == 0
    e.close()


SAMPLED_PROMPT = "import os\nimport sys\nimport os\nimport sys\nimport "


@pytest.mark.slow
def test_ngram_sampled_tokens_follow_the_target():
    """The engine-level exactness check (tests/helpers/exactness.py) with n-gram drafts: a prompt
    that repeats itself, so that after its likely first tokens the 2nd and 3rd are drafted from
    the prompt (and sometimes rejected)."""
    e = Engine(EngineConfig(target=str(TINY_TARGET), proposer="ngram", ngram_min=1, gamma=3,
                            kv_cache_bytes=32 << 20))
    try:
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(SAMPLED_RUNS)]
        runs = [c.output_ids for c in e.generate([SAMPLED_PROMPT] * len(params), params, max_concurrency=48)]
        st = e.stats()
        assert st.drafted_tokens > 0 and 0 < st.acceptance_rate < 1, "the test needs drafts, some rejected"
    finally:
        e.close()
    exactness.assert_exact(exactness.load_target_hf(), exactness.prompt_ids(SAMPLED_PROMPT), runs, "ngram")


@pytest.mark.slow
def test_proposer_both_sampled_tokens_follow_the_target():
    """The same check with the planner moving between the drafter model, n-gram drafts and plain
    decoding inside each request's tokens. A cold start (no cost profile) makes the bandit try
    every untried arm first; the step counts by mode show that every kind of step ran."""
    e = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), proposer="both",
                            mode="auto", gamma=2, gamma_max=2, planner_cost_profile="off",
                            kv_cache_bytes=32 << 20))
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(SAMPLED_RUNS)]
    try:
        modes = StepModes(e)
        runs = [c.output_ids for c in e.generate([SAMPLED_PROMPT] * len(params), params, max_concurrency=48,
                                                on_step=modes)]
        assert modes["ngram"] > 0 and modes["sd"] > 0 and modes["ar"] > 0, modes
        assert e.stats().drafted_tokens > 0 and 0 < e.stats().acceptance_rate < 1
    finally:
        e.close()
    exactness.assert_exact(exactness.load_target_hf(), exactness.prompt_ids(SAMPLED_PROMPT), runs, "both")


@pytest.mark.slow
def test_ngram_through_tritonserver_serves_plain_decodings_text(tmp_path):
    """engine.json with `"proposer": "ngram"` behind a real tritonserver: concurrent gRPC streams
    get plain greedy decoding's text, and the model's counters show n-gram drafts accepted."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    from client.triton_client import GrpcClient
    from conftest import nightdraft_only_server, test_engine_config
    from helpers.triton import wait_kv_free
    config = test_engine_config() | {"drafter": None, "proposer": "ngram", "mode": "sd"}
    prompts = COPY_PROMPTS + FREE_PROMPTS
    threads = torch.get_num_threads()
    try:
        ar = Engine(EngineConfig.from_dict(config | {"proposer": "drafter", "mode": "ar"}))
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        expected = [c.text for c in ar.generate(prompts, params)]
        ar.close()
    finally:
        torch.set_num_threads(threads)

    with nightdraft_only_server(tmp_path, config) as server:
        client = GrpcClient(server.grpc_url, "nightdraft", timeout_s=120)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: client.generate(p, max_tokens=32, temperature=0.0,
                                                          ignore_eos=True).text, prompts))
        assert got == expected
        m = wait_kv_free(server)
        assert m["nightdraft_spec_decode_draft_tokens_total"] > 0
        assert m["nightdraft_spec_decode_accepted_tokens_total"] > 0
