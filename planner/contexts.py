"""Context binning and the loss the bandit is fed.

**Contexts.** The running batch size in power-of-two bins, labelled ``"b1"``, ``"b2-3"``,
``"b4-7"``, ... (``context_bins="batch_waiting"`` adds the waiting queue in powers of four:
``"b4-7|w0"``, ``"b4-7|w1-3"``, ``"b4-7|w4-15"``, ...), or whatever a callable makes of the
:class:`~planner.signals.LoadSignals`. Each bin has a reference batch: the geometric middle of
its range (for a callable, the first batch size seen in it).

**Loss.** A step's per-token latency, ``step_wall_s / tokens_committed``, rescaled to the bin's
reference batch (with a cost profile, by the ratio of predicted AR per-token latencies; else by
``(b / b_ref) ** batch_exponent``) so batch-size drift *inside* a bin does not look like a change
of the arms. The rescaling is common to all arms of a bin, so it does not bias their comparison.
``step_wall_s`` may include the drafter's catch-up done inside the step
(``wall_includes_rebuild=True``, the default: it is subtracted, so the arm's loss is its
steady-state cost and the catch-up is charged once, as the switching cost), and the prefill's
share of the target forward, priced at the cheapest placement's rate
(:class:`~planner.step_costs.ForwardCost`), is taken off: an arm whose forward runs on fewer
cores keeps the extra its prefill costs there. Until that line is fitted (an engine's first
steps) a step that fed prompts has no price for them: its time is not its arm's
(``StepCost.prefill_unpriced``), and the planner counts it as played, not measured.
Each step is weighted by its tokens over the bin's usual tokens per step, so an arm's mean is its
total time over its total tokens.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, NamedTuple

from planner.cost_model import CostProfile
from planner.signals import LoadSignals
from planner.step_costs import ForwardCost, ewma

Context = Hashable


def batch_bin(b: int) -> tuple[int, int]:
    """Power-of-two bin [lo, hi] holding batch size b (b < 1 counts as 1)."""
    b = max(int(b), 1)
    k = b.bit_length()
    return 1 << (k - 1), (1 << k) - 1


def waiting_bucket(w: int) -> tuple[int, int | None]:
    """[lo, hi] of the waiting-queue bucket holding w: 0, 1-3, 4-15, 16-63, ..."""
    if w <= 0:
        return 0, 0
    k = (int(w).bit_length() + 1) // 2          # 1-3, 4-15, 16-63, ...: powers of four
    lo = 1 if k == 1 else 4 ** (k - 1)
    return lo, 4 ** k - 1


class ContextBins:
    """Signals -> context label, and the factor taking a per-token latency at batch b to the
    reference batch of a context."""

    def __init__(self, context_bins: str | Callable[[LoadSignals], Context] = "batch",
                 cost_profile: CostProfile | None = None, batch_exponent: float = 0.5):
        self._fn = context_bins if callable(context_bins) else None
        self._with_waiting = context_bins == "batch_waiting"
        self._profile = cost_profile
        self._exponent = batch_exponent
        self._labels: dict = {}
        self._ref_batch: dict[Context, float] = {}
        self._norm_cache: dict = {}

    @property
    def by_load_counts(self) -> bool:
        """Is a context the batch size's bin (and the waiting queue's) alone, not a callable's
        reading of any signal?"""
        return self._fn is None

    def context(self, s: LoadSignals) -> Context:
        if self._fn is not None:
            ctx = self._fn(s)
            self._ref_batch.setdefault(ctx, float(max(s.batch_size, 1)))
            return ctx
        lo, hi = batch_bin(s.batch_size)
        key = (lo, waiting_bucket(s.waiting)[0] if self._with_waiting else None)
        label = self._labels.get(key)
        if label is None:
            label = f"b{lo}" if lo == hi else f"b{lo}-{hi}"
            if self._with_waiting:
                wlo, whi = waiting_bucket(s.waiting)
                label += "|w0" if whi == 0 else f"|w{wlo}-{whi}"
            self._labels[key] = label
            self._ref_batch[label] = math.sqrt(lo * hi)
        return label

    def ref_batch(self, ctx: Context, default: float | None = None) -> float | None:
        return self._ref_batch.get(ctx, default)

    def norm(self, ctx: Context, b: int) -> float:
        """Factor taking a per-token latency at batch b to the context's reference batch."""
        b = max(int(b), 1)
        key = (ctx, b)
        f = self._norm_cache.get(key)
        if f is None:
            f = self._norm_cache[key] = self._norm_uncached(ctx, b)
            if len(self._norm_cache) > 50_000:
                self._norm_cache.clear()
        return f

    def _norm_uncached(self, ctx: Context, b: int) -> float:
        ref = self._ref_batch.get(ctx)
        if ref is None or abs(b - ref) < 1e-9:
            return 1.0
        if self._profile is not None and self._profile.verify:
            try:
                at_b = self._profile.t_verify(b, 1) / b
                at_ref = self._profile.t_verify(ref, 1) / ref
                if at_b > 0 and at_ref > 0:
                    return at_ref / at_b
            except ValueError:
                pass
        return (b / ref) ** self._exponent


class StepCost(NamedTuple):
    wall_s: float           # the step's wall time, less the catch-up and the prefill's share
    tokens: float           # tokens committed (at least 1; a speculative step's, as scored)
    loss: float | None      # rescaled per-token latency (None: no usable wall time)
    weight: float           # the step's weight in the arm's mean
    prefill_unpriced: bool = False   # it fed prompts before the forward's line could price them


class StepLoss:
    """Turns what the engine reports of one step into the bandit's loss (see the module)."""

    def __init__(self, bins: ContextBins, forward_cost: ForwardCost, wall_includes_rebuild: bool = True):
        self.bins = bins
        self.forward_cost = forward_cost
        self.wall_includes_rebuild = wall_includes_rebuild
        self._tokens_per_step: dict[Context, float] = {}

    def tokens_per_step(self, ctx: Context) -> float | None:
        """The usual tokens a step of this context commits (an EWMA), None before the first."""
        return self._tokens_per_step.get(ctx)

    def measure(self, ctx: Context, running: int, *, step_wall_s: float, tokens_committed: float,
                drafter_rebuild_s: float, prefill_tokens: int, forward_tokens: int,
                forward_s: float, forward_cores: int = 0, settling: bool = False) -> StepCost:
        """`settling`: a plain step in the turn-off's transient (planner.offload_policy.SettledPlain),
        whose forward runs slower than the forward's line is to predict: the line does not learn
        from it."""
        tokens = max(float(tokens_committed), 1.0)
        tps = self._tokens_per_step[ctx] = ewma(self._tokens_per_step.get(ctx), tokens, 0.1)
        wall = float(step_wall_s)
        if not settling:
            self.forward_cost.observe(forward_tokens, forward_s, forward_cores)
        if self.wall_includes_rebuild and drafter_rebuild_s > 0:
            wall = max(wall - drafter_rebuild_s, 0.05 * wall)
        unpriced = False
        if prefill_tokens > 0:
            prefill_s = self.forward_cost.prefill_seconds(prefill_tokens)
            unpriced = prefill_s is None
            if not unpriced:
                wall = max(wall - prefill_s, 0.1 * wall)
        loss = None
        if wall > 0 and math.isfinite(wall):
            loss = wall / tokens * self.bins.norm(ctx, running)
        weight = min(max(tokens / tps, 0.1), 10.0)    # time over tokens, not mean of ratios
        return StepCost(wall, tokens, loss, weight, unpriced)
