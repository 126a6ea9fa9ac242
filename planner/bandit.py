"""A contextual bandit over a fixed set of arms, for a cost (lower loss is better).

Used by the planner with the running batch size (binned) as the context and (mode, gamma) as the
arms, but it knows nothing about either: arms and contexts are any hashable values, and the loss
is whatever the caller measures (the planner: per-token latency of one engine step).

The rule, per context bin (every statistic below is kept separately for each bin):

* **Optimism for a cost.** Each arm's index is a lower confidence bound,
  ``mean - explore * sigma * sqrt(2 ln N / n)``: the discounted mean loss, ``n`` its discounted
  number of observations (plus ``prior_weight`` pseudo-observations when a ``prior`` is given),
  ``N`` their sum over arms, ``sigma`` the pooled noise of the bin (floored at a fraction of the
  best mean, so the rule is scale-free). Untried arms without a prior are tried first.
* **Prior warm start.** ``prior(context, arm)`` (e.g. the cost model's predicted per-token
  latency) enters each arm's mean as ``prior_weight`` pseudo-observations, after calibrating its
  scale to what was measured in that bin (the geometric mean ratio observed/predicted over the
  arms tried), so only the prior's *ordering* has to be right. With ``prior_group`` (e.g. an
  arm's mode), each group is calibrated on its own measured arms, so one arm measured in a group
  carries the prior's error for that group to the group's untried arms (a prior that misses one
  mode's cost by 2x is corrected for all its gammas at once, not one play each); a group with
  nothing measured in the bin takes the bin's overall ratio. With ``prior_inputs`` (what the
  prior is computed from, now: e.g. the acceptance and the serving cost, rounded), a bin reads
  the prior again only when those change; a decision then costs the calibration alone.
* **Unimodal groups** (``unimodal``, with ``prior_group``). The arms of a group, in the order
  they were given, are taken to have a unimodal loss along that order (a mode's gammas: a longer
  speculation gains accepted tokens and pays more drafting and verification, so the per-token
  cost falls, then rises). Only each group's *leader* (its lowest estimated mean) and the
  leader's two neighbours are candidates; the rest wait until the leader moves next to them.
  Exploration then costs a few arms per group instead of all of them, and a wrong prior is
  walked off one position at a time (the unimodal bandits' leader-neighbourhood rule, as in
  Combes and Proutiere's OSUB). A group with no arm known yet is not restricted.
* **Blocks.** A chosen arm is held for a block of steps in that bin. Block length is
  ``(block_growth - 1) * n`` clipped to ``[initial_block, max_block]``: every time an arm wins
  again its block multiplies its sample count by ``block_growth`` (UCB2-style exponential
  epochs). Fresh or long-unplayed arms get short probes (explore early), a well-measured winner
  gets long blocks (settle later). A block paused by a context change resumes when the bin comes
  back, if the engine still runs that arm.
* **Switching cost.** ``switch_cost(from, to)`` (in loss units: the extra *summed* loss the
  switch costs) is added to a challenger's index, amortised over the steps the bandit expects to
  stay in the bin (an average of past visit lengths, capped at ``switch_horizon``; a visit ends
  when the bin is left for more than ``visit_gap`` steps, so a batch size flapping across a bin
  edge does not cut it short): a switch pays off only if the challenger's advantage over the stay
  outweighs it. ``hysteresis`` (a fraction of the running arm's mean loss) must be beaten by any
  challenger, so near-equal arms do not alternate when the context flaps between two bins, and
  ``min_hold`` enforces a minimum number of steps between any two switches.
* **Non-stationarity.** Statistics are discounted by ``discount`` per step of the bin, so an
  unplayed arm's confidence interval widens again and it is re-probed (a change in an arm the
  bandit does not play is found that way). A change in the arm it does play is detected directly:
  when the arm's recent average (an EWMA) leaves its long-run mean by more than
  ``detect_sigmas`` standard errors and ``detect_rel`` of the mean, the bin's evidence is cut to
  ``shift_keep`` observations per arm (the changed arm: ``shrink_to`` observations at its recent
  level), so blocks are short again and the bin re-explores. A bin not seen for ``stale_after``
  steps is shrunk to ``shrink_to`` observations per arm when it comes back.

Settings: :class:`~planner.config.BanditConfig` (validated there). Inspection:
``best(context)``, ``means(context)``, ``context_stats(context)`` (a :class:`ContextStats`: best
and held arm, steps, blocks, shifts, plays, means), ``stats()``, ``arm_counts()``, and the
counters ``switches``, ``shifts``, ``stale_resets``.

``select(context)`` is called once per step and returns the arm to run; ``update(context, arm,
loss)`` reports the step's loss for the arm actually run. Both are cheap (an update about 7 µs,
a decision over 17 arms with a prior about 0.12 ms on a 2-core CPU), and a decision is made only
when a block ends. ``select(context, allowed=...)`` restricts the
choice to the arms the caller can run now (the planner: only plain decoding while the drafter's
memory is lent to the KV pool); a held block of another arm ends, and ``interrupt()`` ends every
held block, so that the first unrestricted step decides afresh.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from planner.config import BanditConfig, replace_settings

Arm = Hashable
Context = Hashable


def _clipped_ratio(sum_w_log: float, sum_w: float) -> float:
    return min(max(math.exp(float(sum_w_log) / float(sum_w)), 0.1), 10.0)


class _Bin:
    """Statistics and block state of one context bin."""

    __slots__ = ("_n", "_s", "_ss", "_scale", "plays", "chosen", "ewma", "ewma_w", "ewma_n", "t",
                 "last_seen", "block_arm", "block_left", "dwell", "visit_start", "blocks", "shifts",
                 "prior_read")

    # Below this, the stored sums are rescaled (a bin's discount reaches it after ~700,000 of
    # its steps at 0.9995: far from a float's underflow either way).
    _MIN_SCALE = 1e-150

    def __init__(self, k: int, dwell: float):
        # The discounted sums per arm: counts, sums of losses, sums of squared losses; stored
        # divided by `_scale`, the discount applied since the last rescale, so that a step
        # discounts every arm with one multiplication. Python floats, not numpy: an update runs
        # right after the step's forward, with cold caches, where numpy's per-call cost was most
        # of it (19 µs in place against 2 µs in a loop).
        self._n = [0.0] * k
        self._s = [0.0] * k
        self._ss = [0.0] * k
        self._scale = 1.0
        self.plays = [0] * k          # steps each arm ran here (not discounted)
        self.chosen = [0] * k         # blocks started per arm
        self.ewma = [0.0] * k         # recent loss level per arm (change detection): EWMAs of
        self.ewma_w = [0.0] * k       # weight x loss and of weight, weighted like the means
        self.ewma_n = [0] * k
        self.t = 0                    # steps observed in this bin
        self.last_seen = 0            # global step of the last visit
        self.block_arm: int | None = None
        self.block_left = 0
        self.dwell = dwell            # average length of a visit (steps from arrival to leaving)
        self.visit_start = 0          # global step the current visit began
        self.blocks = 0
        self.shifts = 0
        self.prior_read: tuple | None = None   # (the prior's inputs, its values) last read here

    def sums(self) -> tuple[list, list, list]:
        """(counts, sums of losses, sums of squared losses) per arm, discounted."""
        c = self._scale
        return [x * c for x in self._n], [x * c for x in self._s], [x * c for x in self._ss]

    def count(self, i: int) -> float:
        return self._n[i] * self._scale

    def discount(self, factor: float) -> None:
        self._scale *= factor
        if self._scale < self._MIN_SCALE:
            self._n, self._s, self._ss = self.sums()
            self._scale = 1.0

    def add(self, i: int, w: float, loss: float) -> tuple[float, float, float]:
        """One observation of arm `i`; its sums after it."""
        c = self._scale
        wl = w * loss
        n, s, ss = self._n[i] * c + w, self._s[i] * c + wl, self._ss[i] * c + wl * loss
        self._n[i], self._s[i], self._ss[i] = n / c, s / c, ss / c
        return n, s, ss

    def set(self, i: int, n: float, s: float, ss: float) -> None:
        c = self._scale
        self._n[i], self._s[i], self._ss[i] = n / c, s / c, ss / c

    def shrink(self, keep: float) -> None:
        """Keep every arm's means, with at most `keep` observations of evidence."""
        c = self._scale
        for i, ni in enumerate(self._n):
            if ni * c > keep:
                f = keep / (ni * c)
                self._n[i], self._s[i], self._ss[i] = ni * f, self._s[i] * f, self._ss[i] * f


@dataclass(frozen=True)
class ContextStats:
    """One bin, as :meth:`ContextualBandit.context_stats` reports it."""
    best: Arm | None                         # lowest estimated loss
    held: Arm | None                         # the arm of the block held (or paused) there
    steps: int                               # steps observed in the bin
    blocks: int                              # blocks started there
    shifts: int                              # loss changes detected there
    plays: dict                              # {arm: steps it ran there}
    blocks_per_arm: dict                     # {arm: blocks started with it}
    means: dict                              # {arm: (estimated mean loss, evidence)}


class ContextualBandit:
    """``ContextualBandit(arms, config, seed=..., switch_cost=..., prior=...)``; keyword
    ``settings`` override fields of ``config`` (default :class:`~planner.config.BanditConfig`),
    e.g. ``ContextualBandit(arms, discount=1.0)``."""

    def __init__(self, arms: Sequence[Arm], config: BanditConfig | None = None, *, seed: int = 0,
                 switch_cost: Callable[[Arm, Arm], float] | None = None,
                 prior: Callable[[Context, Arm], float] | None = None,
                 prior_group: Callable[[Arm], Hashable] | None = None,
                 prior_inputs: Callable[[], Hashable] | None = None, **settings):
        if not arms:
            raise ValueError("the bandit needs at least one arm")
        if len(set(arms)) != len(arms):
            raise ValueError("arms must be distinct")
        self.config = cfg = replace_settings(config or BanditConfig(), settings)
        self.arms = list(arms)
        self._index = {a: i for i, a in enumerate(self.arms)}
        self.switch_cost = switch_cost
        self.prior = prior
        self.prior_weight = cfg.prior_weight if prior is not None else 0.0
        self.prior_inputs = prior_inputs
        # each arm's group of arms that share a calibration of the prior (by position)
        groups = [prior_group(a) for a in self.arms] if prior_group is not None else []
        numbering = {g: j for j, g in enumerate(dict.fromkeys(groups))}
        self._group_of = [numbering[g] for g in groups]
        self._n_groups = len(numbering)
        # each group's arms in order (the unimodal rule walks along them)
        self._members = [[i for i, g in enumerate(self._group_of) if g == j]
                         for j in range(self._n_groups)]
        self._unimodal = cfg.unimodal and any(len(m) > 2 for m in self._members)
        self._rng = random.Random(seed)
        self._bins: dict[Context, _Bin] = {}
        self._last_ctx: Context | None = None
        self._has_last = False
        self.current: Arm | None = None   # the arm the last select() returned
        self.step = 0                     # select() calls
        self.switches = 0
        self.shifts = 0                   # detected loss changes
        self.stale_resets = 0
        self._last_switch_step = -(10 ** 9)
        self._plays_total = [0] * len(self.arms)

    # ------------------------------------------------------------------ bins

    def _bin(self, context: Context) -> _Bin:
        b = self._bins.get(context)
        if b is None:
            b = self._bins[context] = _Bin(len(self.arms), float(self.config.switch_horizon))
        return b

    def _shrink(self, b: _Bin, keep: float) -> None:
        """Keep the means, cut the evidence to at most `keep` observations per arm."""
        b.shrink(keep)
        b.block_left = 0

    # ------------------------------------------------------------------ estimates

    # The estimates below run over Python floats: with tens of arms, numpy's cost per call is
    # most of a decision's (about 2 microseconds an operation on a busy CPU, 30 of them).

    def _priors(self, context: Context, b: _Bin, n: list, s: list) -> list | None:
        """Every arm's prior, its scale calibrated to this bin's measurements: observed over
        predicted loss of the measured arms (a geometric mean weighted by their evidence,
        clipped to [0.1, 10]), per group where the group has a measured arm, else overall."""
        if self.prior is None:
            return None
        p = self._read_prior(context, b)
        groups = self._group_of
        tot_wlog = tot_w = 0.0
        g_wlog, g_w = [0.0] * self._n_groups, [0.0] * self._n_groups
        for i, (ni, pi) in enumerate(zip(n, p)):
            if ni > 1e-9 and pi == pi and s[i] > 0:        # measured, with a prior (not nan)
                wlog = ni * math.log(s[i] / ni / pi)
                tot_wlog += wlog
                tot_w += ni
                if groups:
                    g_wlog[groups[i]] += wlog
                    g_w[groups[i]] += ni
        if tot_w == 0:
            return p
        overall = _clipped_ratio(tot_wlog, tot_w)
        ratio = [_clipped_ratio(g_wlog[g], g_w[g]) if g_w[g] > 0 else overall
                 for g in range(self._n_groups)]
        if groups:
            return [pi * ratio[g] for pi, g in zip(p, groups)]
        return [pi * overall for pi in p]

    def _read_prior(self, context: Context, b: _Bin) -> list:
        """The prior of every arm in this bin (nan where it has none), read again only when its
        inputs changed."""
        inputs = self.prior_inputs() if self.prior_inputs is not None else None
        if inputs is not None and b.prior_read is not None and b.prior_read[0] == inputs:
            return b.prior_read[1]
        p = []
        for a in self.arms:
            v = float(self.prior(context, a))
            p.append(v if math.isfinite(v) and v > 0 else math.nan)
        if inputs is not None:
            b.prior_read = (inputs, p)
        return p

    def _estimates(self, context: Context, b: _Bin):
        """(means, counts, sigma, known) for every arm of the bin (lists, in the arms' order)."""
        n, s, ss = b.sums()
        p = self._priors(context, b, n, s)
        if p is not None:
            w0 = self.prior_weight
            cnt = [ni + w0 if pi == pi else ni for ni, pi in zip(n, p)]
            tot = [si + w0 * pi if pi == pi else si for si, pi in zip(s, p)]
        else:
            cnt, tot = n, s
        known = [c > 0 for c in cnt]
        means = [t / c if c > 0 else math.inf for t, c in zip(tot, cnt)]
        # pooled noise of the bin, shrunk towards `noise_prior` x best mean while evidence is thin
        best = min((m for m, k in zip(means, known) if k), default=1.0)
        scale = abs(best) if math.isfinite(best) and best != 0 else 1.0
        resid = dof = 0.0
        for ni, si, ssi in zip(n, s, ss):
            if ni > 1e-9:
                resid += max(ssi - si * si / ni, 0.0)
                dof += ni - 1.0
        k0 = 2.0
        var = (resid + k0 * (self.config.noise_prior * scale) ** 2) / (max(dof, 0.0) + k0)
        sigma = max(math.sqrt(var), self.config.noise_floor * scale)
        return means, cnt, sigma, known

    def _near_leaders(self, means: list, known: list) -> frozenset[int]:
        """The unimodal rule's candidates: each group's leader and its neighbours in the
        group's order (every arm of a group with none known)."""
        near: list[int] = []
        for members in self._members:
            ranked = [j for j, i in enumerate(members) if known[i]]
            if not ranked:
                near += members
                continue
            lead = min(ranked, key=lambda j: means[members[j]])
            near += members[max(lead - 1, 0):lead + 2]
        return frozenset(near)

    def _block_len(self, b: _Bin, i: int) -> int:
        L = math.ceil((self.config.block_growth - 1.0) * b.count(i))
        return int(min(max(L, self.config.initial_block), self.config.max_block))

    def _decide(self, context: Context, b: _Bin, allowed: frozenset[int] | None = None) -> int:
        means, cnt, sigma, known = self._estimates(context, b)
        k = len(self.arms)
        if self._unimodal:
            near = self._near_leaders(means, known)
            allowed = near if allowed is None else (allowed & near) or allowed
        candidates = range(k) if allowed is None else sorted(allowed)
        untried = [i for i in candidates if not known[i]]
        if untried:
            return self._rng.choice(untried)
        spread = 2.0 * math.log(max(sum(cnt), math.e))
        width = self.config.explore * sigma
        index = [m - width * math.sqrt(spread / max(c, 1e-300)) for m, c in zip(means, cnt)]
        if allowed is not None:
            index = [x if i in allowed else math.inf for i, x in enumerate(index)]
        cur = self._index.get(self.current) if self.current is not None else None
        if cur is not None and self.config.hysteresis > 0 and math.isfinite(means[cur]):
            index[cur] -= self.config.hysteresis * abs(means[cur])
        if self.switch_cost is not None and cur is not None:
            stay = max(b.dwell, float(self.step - b.visit_start + 1))
            horizon = max(min(stay, float(self.config.switch_horizon)), 1.0)
            for i, a in enumerate(self.arms):
                if i != cur:
                    c = float(self.switch_cost(self.current, a))
                    if c > 0:
                        index[i] += c / horizon
        best = min(index)
        tie = best + 1e-15 * max(abs(best), 1e-300)
        ties = [i for i, x in enumerate(index) if x <= tie and (allowed is None or i in allowed)]
        if cur is not None and cur in ties:
            return cur
        return ties[0]

    # ------------------------------------------------------------------ API

    def select(self, context: Context, allowed: Sequence[Arm] | None = None) -> Arm:
        """The arm to run for this step (part of the block held for this context), among
        `allowed` when given."""
        allow = None
        if allowed is not None:
            allow = frozenset(self._index[a] for a in allowed)
            if not allow:
                raise ValueError("select() needs at least one allowed arm")
        self.step += 1
        b = self._bin(context)
        entering = not self._has_last or context != self._last_ctx
        if entering:
            gap = self.step - b.last_seen
            if b.last_seen == 0 or gap > self.config.visit_gap:
                # a new visit (short excursions to a neighbouring bin do not end one)
                if b.last_seen > 0:
                    b.dwell = 0.7 * b.dwell + 0.3 * (b.last_seen - b.visit_start + 1)
                b.visit_start = self.step
            if b.t > 0 and gap > self.config.stale_after:
                self._shrink(b, self.config.shrink_to)
                b.dwell = float(self.config.switch_horizon)
                self.stale_resets += 1
            self._last_ctx, self._has_last = context, True
        b.last_seen = self.step
        cur = self._index.get(self.current) if self.current is not None else None

        if allow is not None and b.block_arm is not None and b.block_arm not in allow:
            b.block_left = 0
        if b.block_left > 0 and b.block_arm is not None and (not entering or b.block_arm == cur):
            b.block_left -= 1
            return self._play(b.block_arm)

        i = self._decide(context, b, allow)
        if i == b.block_arm and b.block_left > 0:      # the paused block wins again: resume it
            b.block_left -= 1
            return self._play(i)
        if (cur is not None and i != cur and (allow is None or cur in allow)
                and self.step - self._last_switch_step < self.config.min_hold):
            b.block_left = 0                            # too soon to switch again; decide next step
            return self._play(cur)
        L = self._block_len(b, i)
        b.block_arm, b.block_left = i, L - 1
        b.blocks += 1
        b.chosen[i] += 1
        return self._play(i)

    def block_left(self, context: Context) -> int:
        """Steps left in the block held for `context`, when that is the bin of the last
        :meth:`select` and its block is the running arm's (else 0): for those steps,
        ``select(context)`` with the same `allowed` returns the same arm without deciding."""
        b = self._bins.get(context)
        if (b is None or not self._has_last or context != self._last_ctx or b.block_arm is None
                or self.arms[b.block_arm] != self.current):
            return 0
        return b.block_left

    def refresh(self) -> None:
        """The arms' costs moved (the caller knows why): cut every bin's evidence to
        ``shrink_to`` observations per arm, keeping the means, as for a stale bin, so blocks are
        short again and the confidence bounds re-probe what was not played lately."""
        for b in self._bins.values():
            self._shrink(b, self.config.shrink_to)
        self.stale_resets += 1

    def assume_current(self, arm: Arm) -> None:
        """`arm` runs now, whichever this bandit chose last (after the engine idled, plain
        decoding): the next choice prices its switches from it, and enters its context afresh,
        so a block held there goes on only if it is `arm`'s."""
        self.current = arm
        self._has_last = False

    def interrupt(self) -> None:
        """End every held block: the next select() of each bin decides afresh."""
        for b in self._bins.values():
            b.block_left = 0

    def _play(self, i: int) -> Arm:
        arm = self.arms[i]
        if self.current is not None and arm != self.current:
            self.switches += 1
            self._last_switch_step = self.step
        self.current = arm
        return arm

    def update(self, context: Context, arm: Arm, loss: float, weight: float = 1.0) -> None:
        """Report the loss of one step run with `arm` in `context`. With a `weight` (about 1 on
        average) the means are weighted: the planner weights a per-token loss by the step's
        tokens, so an arm's mean is its total time over its total tokens, not the mean of the
        steps' ratios (which favours arms whose steps commit few tokens at a time)."""
        loss, w = float(loss), float(weight)
        if not math.isfinite(loss) or not (w > 0 and math.isfinite(w)):
            return
        self.count_play(context, arm)
        i = self._index[arm]
        b = self._bin(context)
        if self.config.discount < 1.0:
            b.discount(self.config.discount)
        n, s, ss = b.add(i, w, loss)
        # change detection on the arm that ran
        a = self.config.detect_alpha
        if b.ewma_n[i] == 0:
            b.ewma[i], b.ewma_w[i] = w * loss, w
        else:
            b.ewma[i] += a * (w * loss - b.ewma[i])
            b.ewma_w[i] += a * (w - b.ewma_w[i])
        b.ewma_n[i] += 1
        if b.ewma_n[i] >= 2.0 / a and n >= self.config.detect_min_n:
            m = s / n
            sd = math.sqrt(max(ss / n - m * m, 0.0))
            thr = max(self.config.detect_sigmas * sd * math.sqrt(a / (2.0 - a)), self.config.detect_rel * abs(m))
            if abs(b.ewma[i] / b.ewma_w[i] - m) > thr:
                self._on_shift(b, i)

    def count_play(self, context: Context, arm: Arm) -> None:
        """A step run with `arm` in `context`, counted as played (``update`` does this too);
        alone, for a step whose time was not the arm's own (it carried a switch's cost, priced
        apart): played, not measured."""
        i = self._index[arm]
        b = self._bin(context)
        b.t += 1
        b.plays[i] += 1
        self._plays_total[i] += 1

    def _on_shift(self, b: _Bin, i: int) -> None:
        level = float(b.ewma[i] / b.ewma_w[i])
        self._shrink(b, self.config.shift_keep)
        # the changed arm: its old mean is wrong; believe the recent level, weakly
        k = self.config.shrink_to
        b.set(i, k, k * level, k * level * level)
        b.ewma_n = [0] * len(self.arms)
        b.shifts += 1
        self.shifts += 1

    # ------------------------------------------------------------------ inspection

    def best(self, context: Context) -> Arm | None:
        """The arm with the lowest estimated loss in `context` (None if never seen)."""
        b = self._bins.get(context)
        if b is None:
            return None
        return self._best_of(*self._estimates(context, b))

    def _best_of(self, means, _cnt, _sigma, known) -> Arm | None:
        if not any(known):
            return None
        return self.arms[min(range(len(self.arms)), key=means.__getitem__)]

    def means(self, context: Context) -> dict:
        """{arm: (estimated mean loss, evidence)} for the arms known in `context`."""
        b = self._bins.get(context)
        if b is None:
            return {}
        return self._means_of(*self._estimates(context, b))

    def measured(self, context: Context) -> dict:
        """{arm: (mean measured loss, evidence)} for the arms measured in `context`, without
        the prior: what the data alone says (discounted like the means)."""
        b = self._bins.get(context)
        if b is None:
            return {}
        n, s, _ = b.sums()
        return {a: (s[i] / n[i], n[i]) for i, a in enumerate(self.arms) if n[i] > 1e-9}

    def raw_prior(self, context: Context) -> dict:
        """{arm: the prior's loss for it as last read in `context`, before its scale is
        calibrated to the bin's measurements} (empty where no prior was read there)."""
        b = self._bins.get(context)
        if b is None or b.prior_read is None:
            return {}
        return {a: v for a, v in zip(self.arms, b.prior_read[1]) if v == v}

    def _means_of(self, means, cnt, _sigma, known) -> dict:
        return {a: (float(means[i]), float(cnt[i])) for i, a in enumerate(self.arms) if known[i]}

    @property
    def contexts(self) -> list:
        return list(self._bins)

    def arm_counts(self) -> dict:
        return {a: int(self._plays_total[i]) for i, a in enumerate(self.arms) if self._plays_total[i]}

    def context_stats(self, context: Context) -> ContextStats | None:
        """What the bandit knows and does in one bin (None if never seen)."""
        b = self._bins.get(context)
        if b is None:
            return None
        est = self._estimates(context, b)
        return ContextStats(
            best=self._best_of(*est), held=self.arms[b.block_arm] if b.block_arm is not None else None,
            steps=int(b.t), blocks=b.blocks, shifts=b.shifts,
            plays={a: int(b.plays[i]) for i, a in enumerate(self.arms) if b.plays[i]},
            blocks_per_arm={a: int(b.chosen[i]) for i, a in enumerate(self.arms) if b.chosen[i]},
            means=self._means_of(*est))

    def stats(self) -> dict:
        per = {}
        for ctx in self._bins:
            cs = self.context_stats(ctx)
            per[ctx] = {"best": cs.best, "held": cs.held, "steps": cs.steps, "blocks": cs.blocks,
                        "shifts": cs.shifts, "plays": cs.plays, "blocks_per_arm": cs.blocks_per_arm}
        return {"steps": self.step, "switches": self.switches, "shifts": self.shifts,
                "stale_resets": self.stale_resets, "current": self.current,
                "arm_counts": self.arm_counts(), "contexts": per}
