"""Predicting AR, SD and PSD throughput from measured forward costs and acceptance.

Inputs are measurements, never engine internals: T_verify(b, n) is the time of one target forward
over b sequences feeding n tokens each, T_propose(b, gamma) the time of one proposal of gamma
draft tokens for b sequences (a call's own cost, then gamma drafter forwards of one token each:
``CostProfile.t_propose``), and alpha the per-position acceptance rate. With those (Leviathan
et al. 2023):

    tokens per target call  E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)
    AR   throughput = b / T_verify(b, 1)
    SD   throughput = b * E / (T_propose(b, gamma) + T_verify(b, gamma + 1))
    n-gram throughput = b * E / T_verify(b, gamma + 1)   (SD whose drafts cost nothing)
    PSD  throughput = (b/2) * E / max(T_propose(b/2, gamma), T_verify(b/2, gamma + 1))

PSD verifies one half of the batch while the drafter, on its own device, drafts the other half,
so a step costs the slower of the two instead of their sum; each request advances every other
step, which is why PSD helps throughput at load and cannot help a single request.

**The step's own cost.** The forwards are not all a step costs. Each step also schedules, commits
tokens into one output per sequence it advanced, and hands those outputs to whoever serves them
(through tritonserver: one response per request per step, over the stub's IPC) before the next
step starts. That is about ``per_step + per_response * responses`` seconds
(:class:`StepOverhead`, measured while the engine runs: :mod:`planner.serving_cost`), where a
step of AR, SD or n-gram SD emits ``b`` responses and a PSD step ``ceil(b/2)``; with it::

    AR   step = T_verify(b, 1) + O(b)                                  1 token per response
    SD   step = T_propose(b, gamma) + T_verify(b, gamma + 1) + O(b)    E tokens per response
    PSD  step = max(T_propose(b/2, gamma), T_verify(b/2, gamma + 1) + O(b/2))

so a per-response cost weighs 1/E per token on a speculative arm and fully on plain decoding.
Left out, the model ranks plain decoding and short gammas too well wherever responses are
expensive (docs/adaptive.md has what bench compare and bench profile show of it in process).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from backend.mode import STEP_MODES, Mode


def expected_tokens_per_call(alpha: float, gamma: int) -> float:
    if gamma <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def alpha_for_tokens_per_call(tokens_per_call: float, gamma: int) -> float:
    """The per-position acceptance alpha at which ``expected_tokens_per_call(alpha, gamma)`` is
    `tokens_per_call` (clipped to [1, gamma + 1]): what :func:`predict` takes. Not the share of
    drafted tokens accepted, which is ``(E - 1) / gamma`` and lower (at gamma 4, E = 3.48 is
    alpha 0.82 but an accepted share of 0.62)."""
    e = min(max(float(tokens_per_call), 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if expected_tokens_per_call(mid, gamma) < e:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass
class CostProfile:
    """Measured forward times, interpolated linearly in batch size (log-spaced samples work well).

    verify[(b, n)]: seconds for one target forward of b sequences x n new tokens each.
    draft[b]:       seconds each draft position adds to a proposal for b sequences.
    draft_call[b]:  seconds a proposal for b sequences costs besides its positions (its call's
                    own work: the sequences' bookkeeping, the committed tokens fed, the draft
                    distributions set up). Empty in a profile that timed one-position
                    proposals only: ``draft`` is then a whole one-position proposal, and a
                    proposal of gamma positions is priced at gamma of them.
    """
    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    draft_call: dict[int, float] = field(default_factory=dict)

    def t_verify(self, b: float, n: int) -> float:
        points = sorted((bb, t) for (bb, nn), t in self.verify.items() if nn == n)
        if not points:
            # Fall back to scaling the nearest measured token count: cost ~ linear in tokens.
            ns = sorted({nn for _, nn in self.verify})
            if not ns:
                raise ValueError("the cost profile has no target measurements")
            near = min(ns, key=lambda nn: abs(nn - n))
            return self.t_verify(b, near) * (b * n + 8) / (b * near + 8)
        return _interp(points, b)

    def t_draft(self, b: float) -> float:
        if not self.draft:
            raise ValueError("the cost profile has no drafter measurements")
        return _interp(sorted(self.draft.items()), b)

    def t_propose(self, b: float, gamma: int) -> float:
        """One proposal of `gamma` draft positions for `b` sequences."""
        call = _interp(sorted(self.draft_call.items()), b) if self.draft_call else 0.0
        return call + gamma * self.t_draft(b)

    def to_dict(self) -> dict:
        return {"verify": [[b, n, t] for (b, n), t in sorted(self.verify.items())],
                "draft": [[b, t] for b, t in sorted(self.draft.items())],
                "draft_call": [[b, t] for b, t in sorted(self.draft_call.items())]}

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        return cls({(int(b), int(n)): float(t) for b, n, t in d.get("verify", [])},
                   {int(b): float(t) for b, t in d.get("draft", [])},
                   {int(b): float(t) for b, t in d.get("draft_call", [])})


def _interp(points: list[tuple[int, float]], x: float) -> float:
    xs = [p[0] for p in points]
    if len(points) == 1:
        return points[0][1] * max(x, 1) / max(xs[0], 1) if x > xs[0] else points[0][1]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[i][1]
    lo, hi = (0, 1) if i == 0 else (len(xs) - 2, len(xs) - 1) if i >= len(xs) else (i - 1, i)
    (x0, y0), (x1, y1) = points[lo], points[hi]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 1e-9)


@dataclass(frozen=True)
class StepOverhead:
    """Seconds a step costs outside its forwards: ``per_step_s + per_response_s * responses``."""
    per_step_s: float = 0.0
    per_response_s: float = 0.0

    def seconds(self, responses: float) -> float:
        return self.per_step_s + self.per_response_s * max(responses, 0.0)

    def rounded(self, digits: int = 2) -> "StepOverhead":
        """The same to `digits` significant digits (a cache key that does not change every step)."""
        return StepOverhead(_round_sig(self.per_step_s, digits), _round_sig(self.per_response_s, digits))


def _round_sig(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}") if x > 0 else 0.0


def responses_per_step(mode: Mode | str, batch: int) -> int:
    """Outputs one step emits at `batch` running requests: one per sequence it advanced (a PSD
    step verifies half the batch)."""
    return math.ceil(batch / 2) if Mode.parse(mode, STEP_MODES) is Mode.PSD and batch >= 2 else batch


@dataclass
class Prediction:
    mode: Mode
    batch: int
    gamma: int
    tokens_per_s: float
    step_s: float
    tokens_per_call: float


def predict(mode: Mode | str, batch: int, gamma: int, alpha: float, profile: CostProfile,
            overhead: StepOverhead | None = None) -> Prediction:
    """Steady-state decode throughput (tokens/s over all requests) for `batch` running requests;
    with `overhead`, each step also pays its own cost outside the forwards (see the module)."""
    if batch < 1:
        raise ValueError("batch must be >= 1")
    mode = Mode.parse(mode, STEP_MODES)
    extra = overhead.seconds if overhead is not None else (lambda _responses: 0.0)
    if mode is Mode.AR or gamma == 0:
        step = profile.t_verify(batch, 1) + extra(batch)
        return Prediction(Mode.AR, batch, 0, batch / step, step, 1.0)
    e = expected_tokens_per_call(alpha, gamma)
    if mode is Mode.SD:
        step = profile.t_propose(batch, gamma) + profile.t_verify(batch, gamma + 1) + extra(batch)
    elif mode is Mode.NGRAM:
        step = profile.t_verify(batch, gamma + 1) + extra(batch)
    elif batch < 2:   # PSD with one sub-batch empty falls back to sequential SD
        return predict(Mode.SD, batch, gamma, alpha, profile, overhead)
    else:
        half = batch / 2
        verified = math.ceil(half)
        step = max(profile.t_propose(half, gamma), profile.t_verify(verified, gamma + 1) + extra(verified))
        return Prediction(mode, batch, gamma, half * e / step, step, e)
    return Prediction(mode, batch, gamma, batch * e / step, step, e)


def psd_speedup_bound(batch: int, gamma: int, profile: CostProfile) -> float:
    """(T_propose + T_verify) / max(T_propose, T_verify): PSD's ceiling over SD."""
    d = profile.t_propose(batch / 2, gamma)
    v = profile.t_verify(math.ceil(batch / 2), gamma + 1)
    return (d + v) / max(d, v)
