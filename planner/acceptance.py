"""The drafter's acceptance as the planner measures it, and the cost model's prior for the bandit.

* :class:`AcceptanceEstimate` — an EWMA, per gamma, of the tokens a speculative step (SD, or PSD
  after a step of the same arm) commits per sequence, starting from the prior's, which weighs
  ``prior_sequences`` sequences; inverting ``E(alpha, gamma)``
  (:func:`~planner.cost_model.expected_tokens_per_call`) gives the per-position acceptance
  alpha, averaged over the gammas seen (``alpha_prior`` until a speculative step is seen;
  recomputed every 8 of them: the cost model's prior follows it). A speculative step is scored
  by its tokens shrunk towards its gamma's EWMA (``expected_tokens``): at batch 1 they are one
  sequence's luck.
* :class:`MatchRate` — the n-gram drafts' per-position acceptance, from what they would have
  matched on every step (the engine's shadow lookup), discounted so that it follows the text.
* :class:`CostModelPrior` — with a :class:`~planner.cost_model.CostProfile`, an arm's predicted
  per-token latency at a context's reference batch, at the estimated alpha, each step charged
  the serving path's measured cost outside the forwards (:mod:`planner.serving_cost`): the
  bandit's warm start (only its ordering of the arms has to be right; the bandit calibrates its
  scale, which a cost per response, paid once per token by plain decoding and once per E tokens
  by speculation, would otherwise skew).
"""
from __future__ import annotations

from typing import Callable, Hashable

from backend.mode import Mode
from planner.contexts import ContextBins
from planner.cost_model import (CostProfile, StepOverhead, alpha_for_tokens_per_call,
                                 expected_tokens_per_call, predict)
from planner.step_costs import ewma


class AcceptanceEstimate:
    """`prior_sequences`: the weight of ``alpha_prior`` in each gamma's estimate, in sequences
    advanced, so that one step at batch 1 (one sequence's luck) does not set a gamma's estimate:
    a low acceptance makes the prior rank the long gammas below the short ones (near 0, every
    drafter arm last), and only speculation at those gammas measures it again. One step of a
    large batch outweighs it. `scoring_sequences`: the weight, in sequences, of a gamma's
    estimate in the tokens a step is scored by (:meth:`expected_tokens`)."""

    def __init__(self, alpha_prior: float = 0.6, prior_sequences: float = 8.0,
                 scoring_sequences: float = 4.0):
        self.alpha_prior = alpha_prior
        self.prior_sequences = prior_sequences
        self.scoring_sequences = scoring_sequences
        self._e_hat: dict[int, float] = {}      # tokens per sequence per step, per gamma
        self._seen: dict[int, float] = {}       # sequences advanced at each gamma
        self._alpha_of: dict[int, float] = {}   # its inversion, per gamma (dropped when it moves)
        self._cache: tuple[float, int] = (alpha_prior, -1)
        self.steps = 0

    def observe_step(self, gamma: int, tokens_committed: int, batch_size: int) -> None:
        """One speculative step that verified drafts of `gamma` tokens and advanced
        `batch_size` sequences."""
        seen = self._seen.get(gamma, 0.0) + batch_size
        self._seen[gamma] = seen
        # the prior's weight, then the data's, until the EWMA's own rate takes over
        rate = max(batch_size / (self.prior_sequences + seen), 0.05)
        old = self._e_hat.get(gamma, expected_tokens_per_call(self.alpha_prior, gamma))
        self._e_hat[gamma] = ewma(old, tokens_committed / batch_size, rate)
        self._alpha_of.pop(gamma, None)
        self.steps += 1

    def expected_tokens(self, gamma: int, tokens_committed: int, batch_size: int) -> float:
        """The tokens a speculative step of `batch_size` sequences at `gamma` is scored by: what
        it committed, shrunk towards ``batch_size`` times this gamma's estimate so far (before
        its first step, ``E(alpha, gamma)`` at the estimated alpha), which weighs
        ``scoring_sequences`` sequences. At batch 1 a step's tokens are one sequence's luck (1 to
        gamma + 1), several times the cost differences the bandit ranks the arms by, and a few
        unlucky drafts at one gamma would rank its mode below plain decoding for good; the
        estimate starts from the prior and follows that gamma's yield, so the shrinkage costs no
        bias once it has. A large batch's own tokens outweigh it."""
        b = max(int(batch_size), 1)
        e = self._e_hat.get(gamma)
        if e is None:
            e = expected_tokens_per_call(self.alpha(), gamma)
        w = self.scoring_sequences
        return b * (tokens_committed + w * e) / (b + w)

    def alpha(self) -> float:
        alpha, at = self._cache
        if at >= 0 and self.steps - at < 8:
            return alpha
        alpha = self._alpha_uncached()
        self._cache = (alpha, self.steps)
        return alpha

    def _alpha_uncached(self) -> float:
        if not self._e_hat:
            return self.alpha_prior
        vals = []
        for g, e in self._e_hat.items():
            if g not in self._alpha_of:
                self._alpha_of[g] = alpha_for_tokens_per_call(e, g)
            vals.append(self._alpha_of[g])
        return min(max(sum(vals) / len(vals), 0.01), 0.99)


class MatchRate:
    """``matched / compared`` over the positions the n-gram lookup's drafts were checked against
    the committed tokens, both discounted by `discount` per observed step (None until
    `min_compared` positions were seen)."""

    def __init__(self, discount: float = 0.98, min_compared: float = 16.0):
        self.discount, self.min_compared = discount, min_compared
        self._matched = self._compared = 0.0

    def observe(self, matched: int, compared: int) -> None:
        if compared <= 0:
            return
        self._matched = self._matched * self.discount + matched
        self._compared = self._compared * self.discount + compared

    def alpha(self) -> float | None:
        if self._compared < self.min_compared:
            return None
        return min(max(self._matched / self._compared, 0.01), 0.99)


class CostModelPrior:
    """``prior(ctx, arm)``: predicted per-token latency of `arm` at the context's reference batch.
    An n-gram arm is predicted at the n-gram drafts' measured match rate (`ngram`), its drafts
    free; before that is measured, as plain decoding (not tried first for want of a prior, nor
    favoured)."""

    def __init__(self, profile: CostProfile, acceptance: AcceptanceEstimate, bins: ContextBins,
                 ngram: MatchRate | None = None,
                 overhead: Callable[[], StepOverhead | None] | None = None):
        """`overhead`: the serving path's measured cost outside the forwards, now (None while
        unknown: the forwards alone)."""
        self._profile = profile
        self._acceptance = acceptance
        self._ngram = ngram
        self._bins = bins
        self._overhead = overhead
        self._cache: dict = {}

    def inputs(self) -> tuple:
        """What the predictions are computed from now, rounded so that it changes only when a
        prediction could: the acceptance, the n-gram match rate and the serving cost. (A cache
        key, here and in the bandit, which reads the prior again only when this changes.)"""
        ngram = self._ngram.alpha() if self._ngram is not None else None
        overhead = self._overhead() if self._overhead is not None else None
        return (round(self._acceptance.alpha(), 2), round(ngram, 2) if ngram is not None else None,
                overhead.rounded() if overhead is not None else None)

    def __call__(self, ctx: Hashable, arm: tuple[Mode, int]) -> float:
        alpha, ngram_alpha, overhead = inputs = self.inputs()
        key = (ctx, arm, inputs)
        v = self._cache.get(key)
        if v is None:
            mode, gamma = Mode(arm[0]), arm[1]
            if mode is Mode.NGRAM:
                alpha = ngram_alpha
                if alpha is None:
                    mode, gamma, alpha = Mode.AR, 0, 0.0
            b = max(int(round(self._bins.ref_batch(ctx, 1.0))), 1)
            try:
                p = predict(mode, b, gamma, alpha, self._profile, overhead)
                v = 1.0 / p.tokens_per_s if p.tokens_per_s > 0 else float("nan")
            except ValueError:
                v = float("nan")
            if len(self._cache) > 50_000:
                self._cache.clear()
            self._cache[key] = v
        return v
