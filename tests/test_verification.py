"""Verification is exact: what it commits follows the target distribution, whatever q proposed."""
import pytest
import torch
from scipy.stats import binomtest, chisquare

from backend.sampling.sampler import sample
from backend.sampling.verification import verify_greedy, verify_rejection

V = 6
N = 12000


def _dist(values):
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


P0 = _dist([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P1 = _dist([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])
P2 = _dist([0.16, 0.16, 0.16, 0.16, 0.16, 0.20])

DRAFTS = {
    "uniform": _dist([1] * V),
    "close": _dist([0.28, 0.27, 0.2, 0.13, 0.08, 0.04]),
    "peaked_wrong": _dist([0.01, 0.01, 0.01, 0.01, 0.01, 0.95]),
    "disjoint": _dist([0, 0, 0, 0, 0.5, 0.5]),        # shares mass with P0 only on 4, 5
    "nearly_disjoint": _dist([0, 0, 0, 0, 0.001, 0.999]),
    "equal": P0.clone(),
}


def _assert_matches(counts: torch.Tensor, p: torch.Tensor, what: str) -> None:
    expected = p * counts.sum()
    keep = expected > 0
    # Impossible outcomes must never occur.
    assert counts[~keep].sum() == 0, f"{what}: impossible tokens sampled"
    stat = chisquare(counts[keep].numpy(), expected[keep].numpy())
    assert stat.pvalue > 1e-3, f"{what}: chi-square p={stat.pvalue:.2e}, counts {counts.tolist()}"


@pytest.mark.parametrize("q_name", sorted(DRAFTS))
def test_first_and_second_committed_tokens_follow_the_target(q_name):
    q = DRAFTS[q_name]
    p = torch.stack([P0, P1, P2])
    qq = torch.stack([q, q])
    g = torch.Generator().manual_seed(1234)
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(N):
        drafts = [sample(q, g), sample(q, g)]
        out = verify_rejection(p, qq, drafts, g)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
    _assert_matches(first, P0, f"first token, q={q_name}")
    # The second token exists only after the first draft was accepted, which happens with
    # probability sum_x min(P0(x), q(x)) (372 of 12000 expected for nearly_disjoint, 12000 for
    # equal); the second is then exactly P1-distributed. Both are checked for every q: the
    # smallest expected count per category is then 0.05 x 372 = 18.6, enough for chi-square.
    accept = float(torch.minimum(P0, q).sum())
    accepted = int(second.sum())
    if accept < 1 - 1e-6:
        assert binomtest(accepted, N, accept).pvalue > 1e-3, \
            f"q={q_name}: first draft accepted {accepted} of {N} times, expected {accept * N:.0f}"
    else:
        assert accepted == N
    _assert_matches(second, P1, f"second token, q={q_name}")


def test_bonus_token_follows_the_last_target_row():
    q = P0.clone()          # p == q at position 0: always accepted, so a bonus is always drawn
    g = torch.Generator().manual_seed(7)
    bonus = torch.zeros(V)
    for _ in range(N // 2):
        out = verify_rejection(torch.stack([P0, P2]), q[None], [sample(q, g)], g)
        assert len(out) == 2
        bonus[out[1]] += 1
    _assert_matches(bonus, P2, "bonus token")


def test_rejection_test_detects_a_wrong_sampler():
    """The statistical check itself has teeth: committing the draft unverified fails it."""
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(V)
    for _ in range(4000):
        counts[sample(DRAFTS["uniform"], g)] += 1
    with pytest.raises(AssertionError):
        _assert_matches(counts, P0, "unverified drafts")


def test_greedy_verification():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]     # all accepted + bonus
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]           # first mismatch corrected
    assert verify_greedy([1, 2], [0]) == [1]
    assert verify_greedy([4], []) == [4]


def test_disjoint_supports_always_reject_and_resample_from_the_target():
    p0 = _dist([0.5, 0.3, 0.2, 0, 0, 0])
    q = _dist([0, 0, 0, 0.3, 0.3, 0.4])
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(V)
    for _ in range(N // 2):
        out = verify_rejection(torch.stack([p0, P1]), q[None], [sample(q, g)], g)
        assert len(out) == 1            # never accepted: p(draft) == 0
        counts[out[0]] += 1
    _assert_matches(counts, p0, "disjoint supports")
