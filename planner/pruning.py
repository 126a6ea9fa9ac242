"""Fewer arms while requests wait: the ones the data never ranks first are set aside.

Under a growing queue every step the bandit spends exploring an arm that loses costs every
waiting request. With nine arms (plain decoding, sd:1-4, psd:1-4) the confidence bounds keep
re-probing arms that neither the cost model nor the measurements have ever put first. So while
pressure lasts (the offload policy's pressure level: admission leaves requests waiting, or the
KV pool is nearly full, for most of the recent steps), :class:`ArmPruner` sets aside, per
context bin, every arm

* that the cost model's prior has not ranked first in this bin since the pressure began,
* that the bandit's measured means have not ranked first there either (among arms measured at
  least ``prune_min_obs`` times),
* whose estimated loss (the bandit's, measurements and prior together) is more than
  ``prune_margin`` above the best arm's, and so is the cost model's prediction for it, and
* that is not the best of its own mode: the best plain-decoding arm, the best sequential SD
  gamma, the best PSD gamma and the best n-gram gamma always stay.

The last rule, and probes, guard against the failure an earlier attempt showed (narrowing
exploration while requests waited locked the planner onto plain decoding even where speculation
was better). Pruning only ever removes gammas that lose to another gamma of the same mode, never
a whole mode, so plain decoding is always weighed against the best speculative arm, and the
bandit's ordinary confidence bounds, not narrowed, decide between those. And a mode is never
judged on the prior alone: while pressure lasts, the best arm of every mode that has not been
measured ``prune_min_obs`` times in the bin is probed first (played alone for that many steps,
one mode at a time, at most once per mode, bin and pressure episode). That matters because the
prior's scale is calibrated to whatever was measured: with only plain decoding measured, and a
calibration that does not know a cost plain decoding pays more of (a cost per response), every
untried speculative arm is predicted worse than plain decoding, and a drafter turn-on's
switching cost keeps it untried. Nothing is pruned before the bin's best arm has been measured
``prune_min_obs`` times (a prior alone does not prune).

An arm comes back when its context changes:

* the pressure ends (every bin),
* the acceptance estimate moves by more than ``prune_alpha_shift`` from where it was when the
  first arms were pruned, or the demand (tokens per second asked for) by more than a factor
  ``prune_demand_shift`` (every bin: the arms' costs, or the load, have moved). What was
  measured of the set-aside arms is then stale: the planner cuts the bandit's evidence (as for
  a bin that comes back after a long absence) on an acceptance move, and nothing is pruned or
  probed for ``4 x prune_check_every`` steps, so the bandit's own confidence bounds re-probe
  them,
* the batch leaves the bin: pruning is per bin, so another batch size bin starts with every arm,
* the cost model's prior ranks a pruned arm first (it follows the acceptance and the measured
  serving cost).

The rule is re-evaluated every ``prune_check_every`` steps of a bin.
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Sequence

from backend.mode import Mode

Arm = tuple[str, int]
Context = Hashable


class _BinPruning:
    __slots__ = ("ranked_first", "pruned", "steps", "probe", "probe_left", "probed")

    def __init__(self):
        self.ranked_first: set[Arm] = set()   # arms ranked first since the pressure began
        self.pruned: frozenset[Arm] = frozenset()
        self.steps = 0
        self.probe: Arm | None = None      # the arm being probed, for probe_left more steps
        self.probe_left = 0
        self.probed: set[str] = set()      # modes probed (or measured enough) in this episode


class ArmPruner:
    def __init__(self, arms: Sequence[Arm], *, margin: float = 0.05, min_obs: float = 8.0,
                 check_every: int = 16, alpha_shift: float = 0.1, demand_shift: float = 1.5,
                 enabled: bool = True, on_move: Callable[[str], None] | None = None):
        """`on_move(what)`: called when the context moved ("alpha" or "demand") while arms
        were pruned (the planner cuts the bandit's stale evidence on "alpha")."""
        self.arms = tuple(arms)
        self.enabled = enabled
        self.margin = float(margin)
        self.min_obs = float(min_obs)
        self.check_every = int(check_every)
        self.alpha_shift = float(alpha_shift)
        self.demand_shift = float(demand_shift)
        self.on_move = on_move
        self._bins: dict[Context, _BinPruning] = {}
        self._alpha0: float | None = None       # the acceptance and demand when arms were
        self._demand0: float | None = None      # last pruned
        self._settle = 0                        # steps left without pruning after a move
        self.restores = 0            # times pruned arms were brought back
        self.pruned_steps = 0        # steps decided with at least one arm set aside
        self.probes = 0              # probes started

    def allowed(self, ctx: Context, *, pressure: bool, alpha: float, demand: float | None,
                measured: Callable[[], dict], estimated: Callable[[], dict],
                prior: Callable[[Arm], float] | None,
                candidates: Sequence[Arm] | None = None) -> tuple[Arm, ...] | None:
        """The arms the bandit may play this step in `ctx` (None: all of `candidates`, or of
        the arms). `measured()` and `estimated()` give the bandit's {arm: (mean loss,
        evidence)} without and with its prior; `prior(arm)` the cost model's predicted loss
        (None: no cost model); `candidates`: the arms the engine can run now."""
        if not self.enabled:
            return None
        if not pressure:
            self._restore()
            self._settle = 0
            return None
        moved = self._moved(alpha, demand)
        if moved is not None:
            self._restore()
            self._settle = 4 * self.check_every
            if self.on_move is not None:
                self.on_move(moved)
        if self._settle > 0:
            self._settle -= 1
            return None
        st = self._bins.get(ctx)
        if st is None:
            st = self._bins[ctx] = _BinPruning()
        st.steps += 1
        arms = self.arms if candidates is None else tuple(a for a in self.arms if a in candidates)
        if st.probe_left > 0 and st.probe in arms:
            st.probe_left -= 1
            return (st.probe,)
        st.probe, st.probe_left = None, 0
        check = self.check_every == 1 or st.steps % self.check_every == 1
        modes = {a[0] for a in arms}
        if check or not modes <= st.probed:
            meas, est = measured(), estimated()
            probe = self._probe(st, arms, meas, est)
            if probe is not None:
                return (probe,)
            if check:
                self._evaluate(st, arms, alpha, demand, meas, est, prior)
        if not st.pruned:
            return None
        kept = tuple(a for a in arms if a not in st.pruned)
        if not kept:
            return None
        self.pruned_steps += 1
        return kept

    def pruned(self, ctx: Context) -> frozenset:
        """The arms set aside in `ctx` now."""
        st = self._bins.get(ctx)
        return st.pruned if st is not None else frozenset()

    def _probe(self, st: _BinPruning, arms: Sequence[Arm], measured: dict,
               estimated: dict) -> Arm | None:
        """Once the bin has measured some arm enough: the best-estimated arm of a mode whose
        best has too little measured evidence there, to be played alone for ``min_obs`` steps
        (None: every mode has had its say)."""
        if not any(n >= self.min_obs for _, n in measured.values()):
            return None            # the bandit's own first choices come first
        for mode in dict.fromkeys(a[0] for a in arms):
            if mode in st.probed:
                continue
            st.probed.add(mode)
            best = min((a for a in arms if a[0] == mode),
                       key=lambda a: estimated.get(a, (math.inf, 0.0))[0])
            if measured.get(best, (0.0, 0.0))[1] < self.min_obs:
                st.probe, st.probe_left = best, max(math.ceil(self.min_obs), 1) - 1
                self.probes += 1
                return best
        return None

    def _moved(self, alpha: float, demand: float | None) -> str | None:
        """What moved since arms were pruned ("alpha", "demand"), if anything did."""
        if not any(st.pruned for st in self._bins.values()):
            return None
        if self._alpha0 is not None and abs(alpha - self._alpha0) > self.alpha_shift:
            return "alpha"
        d0 = self._demand0
        if demand is not None and d0 is not None and d0 > 0 and demand > 0 \
                and abs(math.log(demand / d0)) > math.log(self.demand_shift):
            return "demand"
        return None

    def _restore(self) -> None:
        if any(st.pruned for st in self._bins.values()):
            self.restores += 1
        self._bins.clear()
        self._alpha0 = self._demand0 = None

    def _evaluate(self, st: _BinPruning, arms: Sequence[Arm], alpha: float, demand: float | None,
                  measured: dict, estimated: dict, prior) -> None:
        p = {}
        if prior is not None:
            p = {a: prior(a) for a in arms}
            p = {a: v for a, v in p.items() if math.isfinite(v) and v > 0}
            if p:
                st.ranked_first.add(min(p, key=p.get))
        enough = {a: m for a, (m, n) in measured.items() if n >= self.min_obs and a in arms}
        if enough:
            st.ranked_first.add(min(enough, key=enough.get))
        est = {a: m for a, (m, _) in estimated.items() if math.isfinite(m) and a in arms}
        if not est:
            return
        best = min(est, key=est.get)
        if best not in enough:            # the measurements have not had their say yet
            return
        keep = set(st.ranked_first)
        for mode in {a[0] for a in arms}:          # the best of every mode stays
            of_mode = [a for a in est if a[0] == mode]
            if of_mode:
                keep.add(min(of_mode, key=est.get))
            else:                                  # none estimated: keep them all
                keep.update(a for a in arms if a[0] == mode)
        p_best = min(p.values()) if p else None

        def loses(a: Arm) -> bool:
            if a in keep or a not in est or est[a] <= est[best] * (1.0 + self.margin):
                return False
            return p_best is None or (a in p and p[a] > p_best * (1.0 + self.margin))

        pruned = frozenset(a for a in arms if loses(a))
        if st.pruned - pruned:
            self.restores += 1
        st.pruned = pruned
        if pruned and self._alpha0 is None:       # where the episode's pruning began
            self._alpha0, self._demand0 = alpha, demand

    def summary(self) -> dict:
        return {"pruned": {str(c): sorted(Mode(m).value if Mode(m) is Mode.AR else f"{Mode(m).value}:{g}"
                                          for m, g in st.pruned)
                           for c, st in self._bins.items() if st.pruned},
                "restores": self.restores, "pruned_steps": self.pruned_steps, "probes": self.probes}
