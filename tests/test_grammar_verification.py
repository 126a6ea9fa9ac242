"""Sampled verification under a grammar, without a model: synthetic logits over a two-token
vocabulary (EOS, "a") and xgrammar's real matcher. A draft is verified whatever its value (a draft
that ends the grammar, or one the grammar refuses, included): cutting drafts because of their
value changes the distribution of the token at their position."""
from __future__ import annotations

from collections import Counter

import torch
from scipy import stats as scipy_stats

from backend.batching.scheduler import ScheduledSeq
from backend.batching.sequence import Sequence
from backend.engine.verify import decide
from backend.sampling.grammar import Matcher
from backend.sampling.params import SamplingParams
from helpers.exactness import P_MIN

EOS, A = 0, 1
RUNS = 5000


def _matchers(regex: str, n: int) -> list[Matcher]:
    import xgrammar as xgr
    info = xgr.TokenizerInfo(["<eos>", "a"], vocab_type=xgr.VocabType.RAW, vocab_size=2, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_regex(regex)
    return [Matcher(xgr.GrammarMatcher(compiled)) for _ in range(n)]


def _first_tokens(regex: str, p: list[float], q: list[float], greedy: bool = False) -> Counter:
    return Counter(d.tokens[0] for d in _decide(regex, p, q, greedy))


def _decide(regex: str, p: list[float], q: list[float], greedy: bool = False, runs: int = RUNS,
            min_tokens: int = 0) -> list:
    """`runs` sequences, one step each: one draft drawn from q, verified against p at every row."""
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=4, min_tokens=min_tokens)
    draws = torch.Generator().manual_seed(0)
    batch, rows = [], []
    for i, m in enumerate(_matchers(regex, runs)):
        seq = Sequence(f"r{i}", [A], 1, params, detokenizer=None,
                       generator=torch.Generator().manual_seed(1000 + i), grammar=m)
        draft = int(torch.multinomial(torch.tensor(q), 1, generator=draws))
        batch.append(ScheduledSeq(seq, num_new=2, gamma=1, drafts=[draft], draft_probs=torch.tensor([q])))
        rows.append((2 * i, 2))
    logits = torch.tensor(p).log().repeat(2 * runs, 1)
    return decide(batch, rows, logits, (EOS,))


def test_a_drafted_eos_the_grammar_allows_is_verified_not_cut():
    """The grammar allows EOS or "a" first; the drafter likes EOS (q = .9) more than the target
    (p = .5). Cutting the drafted EOS (the grammar terminates at it) and sampling its position
    from p gives EOS .45, "a" .55; verification gives .5/.5."""
    got = _first_tokens("a{0,3}", p=[0.5, 0.5], q=[0.9, 0.1])
    pvalue = scipy_stats.chisquare([got[EOS], got[A]], [RUNS / 2, RUNS / 2]).pvalue
    assert pvalue > P_MIN, f"first token under the grammar: {dict(got)} of {RUNS}, chi-square p={pvalue:.2g}"


def test_a_draft_the_grammar_refuses_is_never_accepted():
    """The grammar allows only "a" first; drafts are mostly EOS (q = .9): each is verified
    against a row where the grammar gives it probability 0, so it is rejected surely and the
    position drawn from what is left ("a")."""
    assert _first_tokens("a{1,3}", p=[0.5, 0.5], q=[0.9, 0.1]) == Counter({A: RUNS})


def test_greedy_under_the_grammar_takes_the_argmax_whatever_was_drafted():
    assert _first_tokens("a{0,3}", p=[0.3, 0.7], q=[0.9, 0.1], greedy=True) == Counter({A: RUNS})
    assert _first_tokens("a{0,3}", p=[0.7, 0.3], q=[0.1, 0.9], greedy=True) == Counter({EOS: RUNS})


def test_a_row_that_allows_nothing_keeps_the_drafts_before_it():
    """Regex "a" then EOS, with EOS banned by min_tokens: after the draft "a" no token is allowed.
    Plain decoding commits "a" and fails one step later: the step commits the draft and nothing
    decided at the empty row."""
    for greedy in (False, True):
        decided = _decide("a", p=[0.5, 0.5], q=[0.0, 1.0], greedy=greedy, runs=50, min_tokens=2)
        assert [d.tokens for d in decided] == [[A]] * 50
        assert [d.accepted for d in decided] == [1] * 50, "the draft was accepted"
