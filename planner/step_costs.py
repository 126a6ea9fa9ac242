"""The target forward's cost against the tokens it is fed: a line the planner fits to its own
measurements, and uses twice.

* **Prefill out of an arm's loss.** Under load nearly every step carries prefill chunks (new
  arrivals, requests recomputed after a preemption) next to its decodes; in the dynamic
  benchmark about half the tokens a step feeds the target are prompt tokens. Their cost has
  nothing to do with the arm that ran, yet it varies from step to step by several times the
  arms' differences. The forward's time is close to affine in the tokens fed, so the line's
  slope times the prefill tokens is taken off a step's wall time before the arm is scored.
* **What a bigger batch buys.** Plain decoding at batch b feeds b tokens; the line predicts how
  the forward's share of its per-token latency changes from batch b to b2 (the rest of a step's
  time per token is carried over: it does not amortise), which is what an offload would buy: the
  planner uses it to weigh the drafter's memory as KV cache.

The line is fitted over every step, whatever the arm (a speculative step feeds more tokens per
sequence, a prefill many more), so it is known early and spans a wide range of sizes. It is a
running least-squares fit with exponential forgetting, so it follows slow drift.

**One line per placement.** Where the target's forward runs on a number of cores that depends on
the arm (on CPU, plain decoding borrows the drafter's cores, a speculative step leaves them to
the drafter), prefill does not cost the same under every arm: the prompts an arm feeds on fewer
cores take it longer. So each placement (the cores the forward ran on, as the engine reports
it) has its own line, and a step's prefill is taken off at the *cheapest* placement's rate, the
cost of feeding those prompts that no arm can avoid; what a slower placement adds to it stays in
the arm's loss. With one placement (a GPU, or no lending) there is a single line.
"""
from __future__ import annotations

from planner.cost_model import StepOverhead


def ewma(old: float | None, x: float, a: float) -> float:
    """An exponentially weighted moving average's next value (the first sample as it is)."""
    return x if old is None else old + a * (x - old)


class RunningLine:
    """y ~ intercept + slope * x, by least squares over the points added so far, each weighted
    ``forget ** age``."""

    def __init__(self, forget: float = 0.995, min_points: int = 16, min_rel_spread: float = 0.0):
        if not 0.0 < forget <= 1.0:
            raise ValueError("forget must be in (0, 1]")
        self.forget = float(forget)
        self.min_points = int(min_points)
        self.min_rel_spread = float(min_rel_spread)
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.points = 0

    def add(self, x: float, y: float) -> None:
        f, x, y = self.forget, float(x), float(y)
        self._n = f * self._n + 1.0
        self._sx = f * self._sx + x
        self._sy = f * self._sy + y
        self._sxx = f * self._sxx + x * x
        self._sxy = f * self._sxy + x * y
        self.points += 1

    def means(self) -> tuple[float, float] | None:
        """(mean x, mean y) of the points, weighted as the fit weighs them (None before any)."""
        if self._n <= 0:
            return None
        return self._sx / self._n, self._sy / self._n

    def fit(self) -> tuple[float, float] | None:
        """(intercept, slope), or None until enough points with enough spread in x were seen."""
        if self.points < self.min_points:
            return None
        mx, my = self._sx / self._n, self._sy / self._n
        var = self._sxx / self._n - mx * mx
        if var <= 1e-12 or var < (self.min_rel_spread * mx) ** 2:
            return None
        slope = (self._sxy / self._n - mx * my) / var
        return my - slope * mx, slope


class ForwardCost:
    """Seconds of the target's forward against the tokens it is fed, one line per placement
    (``cores``: the cores the forward ran on; 0 where the engine does not tell)."""

    def __init__(self):
        self.lines: dict[int, RunningLine] = {}

    def observe(self, tokens_fed: int, forward_s: float, cores: int = 0) -> None:
        if tokens_fed > 0 and forward_s > 0:
            line = self.lines.get(cores)
            if line is None:
                line = self.lines[cores] = RunningLine(forget=0.995, min_points=16, min_rel_spread=0.1)
            line.add(tokens_fed, forward_s)

    def _fit(self, cores: int | None) -> tuple[float, float] | None:
        """The line of placement `cores`; with None, the fitted line of the lowest slope."""
        if cores is not None:
            line = self.lines.get(cores)
            return line.fit() if line is not None else None
        fits = [f for f in (line.fit() for line in self.lines.values()) if f is not None]
        return min(fits, key=lambda f: f[1]) if fits else None

    @property
    def seconds_per_token(self) -> float | None:
        """The cheapest placement's seconds per token fed (None before any line is fitted)."""
        fit = self._fit(None)
        return max(fit[1], 0.0) if fit is not None else None

    def prefill_seconds(self, prefill_tokens: int) -> float | None:
        """The share of a step's forward that `prefill_tokens` prompt tokens take at the cheapest
        placement's rate: what feeding them costs whichever arm runs (None: no line is fitted
        yet, so the prompts have no price)."""
        slope = self.seconds_per_token
        return slope * prefill_tokens if slope is not None else None

    def per_token_at(self, b: float, b2: float, wall_per_token: float,
                     overhead: StepOverhead | None = None, cores: int | None = None) -> float | None:
        """Plain decoding's per-token *wall* time at batch b2, from its measured `wall_per_token`
        at batch b: the forward's share follows the line of placement `cores`, where plain
        decoding runs (None: the cheapest) (its fixed cost amortises over a bigger batch); with
        the serving path's measured `overhead` (:mod:`planner.serving_cost`), its cost per step
        amortises too and its cost per response stays one per token; the rest of a step's time
        per token (sampling, and whatever neither accounts for) is carried over as it is. None
        until the line is known."""
        fit = (self._fit(cores) if cores is not None else None) or self._fit(None)
        if fit is None:
            return None
        a, c = fit[0], max(fit[1], 0.0)
        fwd_b, fwd_b2 = (a + c * b) / b, (a + c * b2) / b2
        if fwd_b <= 0 or fwd_b2 <= 0:
            return None
        if overhead is not None:
            fwd_b += overhead.seconds(b) / b
            fwd_b2 += overhead.seconds(b2) / b2
        rest = wall_per_token - fwd_b
        if rest < 0:            # the wall time measured below the line: scale it as the line does
            return wall_per_token * fwd_b2 / fwd_b
        return fwd_b2 + rest
