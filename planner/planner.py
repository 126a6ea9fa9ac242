"""The adaptive planner: per step, plain decoding, sequential SD or batch-parallel SD, and gamma.

The engine calls, around every step::

    d = planner.decide(signals)               # LoadSignals -> Decision(mode, gamma)
    ... run the step as d says (or as close as it can: pass what it actually ran) ...
    planner.observe(ran, step_wall_s=..., tokens_committed=..., batch_size=...,
                    drafter_rebuild_s=..., drafter_reload_s=...)
    if planner.wants_offload(signals): ...    # move the drafter's weights to host memory

Arms are ``("ar", 0)``, ``("sd", g)`` for g in 1..gamma_max and, when a drafter has its own
device, ``("psd", g)``; the context is the running batch size in power-of-two bins (optionally
times a waiting-queue bucket). A :class:`~planner.bandit.ContextualBandit` picks the arm.

Loss: the step's per-token latency, ``step_wall_s / tokens_committed``, rescaled to the bin's
reference batch size (with a cost profile, by the ratio of predicted AR per-token latencies; else
by ``(b / b_ref) ** batch_exponent``) so batch-size drift *inside* a bin does not look like a change
of the arms. The rescaling is common to all arms of a bin, so it does not bias their comparison.

Switching cost, measured: when the drafter comes back after a gamma = 0 period the engine
reports the catch-up prefill time (``drafter_rebuild_s``) and, if its weights had been offloaded,
the reload time (``drafter_reload_s``). The planner keeps running averages of the rebuild time
per token the drafter missed (``LoadSignals.drafter_lag_tokens`` when the engine reports it,
else the tokens committed while the drafter was off) and of the reload time, and charges
``rebuild_per_token * lag + reload (if offloaded)`` seconds to any ar -> sd/psd switch, in loss
units (divided by the tokens a step of that bin commits). Before the first measurement the
rebuild estimate is the cost profile's drafter time per token at its largest measured batch
(an upper bound of a prefill's per-token cost) or the constructor's value, else zero.
``step_wall_s`` may include the catch-up done inside the step (``wall_includes_rebuild=True``,
the default: it is subtracted, so the arm's loss is its steady-state cost and the catch-up is
charged once, as the switching cost); the weight reload runs in the background and is never
subtracted. ``batch_size`` in ``observe`` is the number of sequences the step advanced (for PSD the
verified sub-batch); the bin and the loss rescaling use the running batch size of ``decide``.

Elastic memory (:mod:`planner.offload_policy`): under sustained memory pressure the planner asks
for the drafter to be offloaded, when its bandit has settled on plain decoding or when plain
decoding at the batch the grown KV pool would admit is predicted to beat the best speculative
arm at the batch that fits now (:meth:`Planner.offload_gain`, from the bandit's own
measurements); while the drafter is offloaded and the load would not fit the drafter-on pool,
only plain decoding is allowed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Hashable

from .bandit import ContextualBandit
from .cost_model import CostProfile, expected_tokens_per_call, predict
from .offload_policy import OffloadCheck, OffloadPolicy
from .step_costs import ForwardCost
from .signals import LoadSignals

MODES = ("ar", "sd", "psd")


@dataclass(frozen=True)
class Decision:
    mode: str    # "ar" | "sd" | "psd"
    gamma: int   # 0 iff mode == "ar"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if (self.gamma == 0) != (self.mode == "ar") or self.gamma < 0:
            raise ValueError(f"gamma must be 0 iff mode is 'ar' (got {self.mode!r}, {self.gamma})")

    @property
    def arm(self) -> tuple[str, int]:
        return (self.mode, self.gamma)

    @property
    def speculative(self) -> bool:
        return self.mode != "ar"

    def __str__(self) -> str:
        return "ar" if self.mode == "ar" else f"{self.mode}:{self.gamma}"


AR = Decision("ar", 0)


def batch_bin(b: int) -> tuple[int, int]:
    """Power-of-two bin [lo, hi] holding batch size b (b < 1 counts as 1)."""
    b = max(int(b), 1)
    k = b.bit_length()
    return 1 << (k - 1), (1 << k) - 1


def _waiting_bucket(w: int) -> tuple[int, int | None]:
    if w <= 0:
        return 0, 0
    k = (int(w).bit_length() + 1) // 2          # 1-3, 4-15, 16-63, ...: powers of four
    lo = 1 if k == 1 else 4 ** (k - 1)
    return lo, 4 ** k - 1


def _ewma(old: float | None, x: float, a: float) -> float:
    return x if old is None else old + a * (x - old)


class Planner:
    def __init__(self, *, gamma_max: int, psd_available: bool,
                 cost_profile: CostProfile | None = None, alpha_prior: float = 0.6,
                 context_bins: str | Callable[[LoadSignals], Hashable] = "batch",
                 min_hold_steps: int = 4, seed: int = 0,
                 gamma_min: int = 1, modes: tuple[str, ...] | None = None,
                 explore: float = 1.0, initial_block: int = 1, block_growth: float = 2.0,
                 max_block: int = 256, discount: float = 0.9995, prior_weight: float = 2.0,
                 offload_after_steps: int = 50, offload_after_s: float = 1.0,
                 kv_pressure: float = 0.9, gpu_memory_pressure: float = 0.95,
                 offload_gain: float = 1.05, reload_after_s: float = 1.0,
                 gain_check_every: int = 8, gain_min_obs: float = 3.0,
                 rebuild_s_per_token: float | None = None, reload_s: float | None = None,
                 reload_weight: float = 1.0, lag_cap_steps: int = 256,
                 hysteresis: float = 0.03, wall_includes_rebuild: bool = True,
                 cost_ewma: float = 0.3, batch_exponent: float = 0.5,
                 timeline_max: int = 4096, timeline_every: int = 25,
                 clock: Callable[[], float] = time.monotonic, **bandit_kw):
        if gamma_max < 0:
            raise ValueError("gamma_max must be >= 0")
        modes = tuple(modes) if modes is not None else MODES
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown modes {bad}; known: {MODES}")
        arms: list[tuple[str, int]] = []
        if "ar" in modes or gamma_max == 0:
            arms.append(("ar", 0))
        if "sd" in modes:
            arms += [("sd", g) for g in range(max(gamma_min, 1), gamma_max + 1)]
        if psd_available and "psd" in modes:
            arms += [("psd", g) for g in range(max(gamma_min, 1), gamma_max + 1)]
        if not arms:
            raise ValueError("no arms: check gamma_max, gamma_min and modes")
        if not 0.0 < alpha_prior < 1.0:
            raise ValueError("alpha_prior must be in (0, 1)")
        self.arms = arms
        self.gamma_max = gamma_max
        self.psd_available = psd_available
        self.cost_profile = cost_profile
        self.alpha_prior = float(alpha_prior)
        self.offload_after_steps = int(offload_after_steps)
        self.offload_after_s = float(offload_after_s)
        self.offload_policy = OffloadPolicy(
            offload_after_steps=offload_after_steps, offload_after_s=offload_after_s,
            kv_pressure=kv_pressure, gpu_memory_pressure=gpu_memory_pressure,
            offload_gain=offload_gain, reload_after_s=reload_after_s)
        self.gain_check_every = max(int(gain_check_every), 1)
        self.forward_cost = ForwardCost()
        self.gain_min_obs = float(gain_min_obs)
        self.reload_weight = float(reload_weight)
        self.wall_includes_rebuild = bool(wall_includes_rebuild)
        self.cost_ewma = float(cost_ewma)
        self.batch_exponent = float(batch_exponent)
        self.timeline_max = max(int(timeline_max), 16)
        self.timeline_every = max(int(timeline_every), 1)
        self._clock = clock
        self._decisions = {a: Decision(*a) for a in arms}
        self._no_psd_arms = tuple(a for a in arms if a[0] != "psd") or None

        if callable(context_bins):
            self._ctx_fn = context_bins
        elif context_bins in ("batch", "batch_waiting"):
            self._ctx_fn = None
            self._with_waiting = context_bins == "batch_waiting"
        else:
            raise ValueError("context_bins must be 'batch', 'batch_waiting' or a callable")
        self._labels: dict = {}
        self._ref_batch: dict[Hashable, float] = {}
        self._norm_cache: dict = {}

        # measured switching cost
        self._rebuild_per_tok: float | None = rebuild_s_per_token
        if self._rebuild_per_tok is None and cost_profile is not None and cost_profile.draft:
            bmax = max(cost_profile.draft)
            self._rebuild_per_tok = cost_profile.t_draft(bmax) / bmax
        self._reload_s: float | None = reload_s
        self.rebuild_samples = 0
        self.reload_samples = 0
        self._lag_tokens = 0          # tokens committed while the drafter was off
        self._off_steps = 0           # ar steps since the drafter last drafted
        self.lag_cap_steps = int(lag_cap_steps)
        self._lag_at_turn_on: int | None = None
        self._engine_lag: int | None = None
        self._offloaded = False
        self._engine_reports_offload = False

        # acceptance (for the prior): EWMA of tokens per sequence per SD step, per gamma
        self._e_hat: dict[int, float] = {}
        self._alpha_cache: tuple[float, int] = (self.alpha_prior, -1)
        self._sd_obs = 0
        self._prior_cache: dict = {}
        self._tokens_per_step: dict[Hashable, float] = {}

        self.bandit = ContextualBandit(
            arms, switch_cost=self._switch_cost, explore=explore, seed=seed,
            initial_block=initial_block, block_growth=block_growth,
            prior=self._prior if cost_profile is not None else None, prior_weight=prior_weight,
            max_block=max_block, min_hold=min_hold_steps, discount=discount, hysteresis=hysteresis,
            **bandit_kw)

        self.steps = 0
        self._t0: float | None = None
        self._ctx: Hashable = None
        self._batch = 1
        self._waiting = 0
        self._current: Decision | None = None
        self._ar_since: tuple[int, float] | None = None   # (step, time) the current ar run began
        self.mode_switches = 0        # ar <-> speculative
        self.drafter_turn_ons = 0
        self.offload_requests = 0
        self._wanted_offload = False
        self._offload_for_kv = False     # the memory-aware rule wants the drafter's bytes as KV
        self._holding_ar = False         # offloaded, and the load does not fit the base pool
        self._claim: tuple[float, float] | None = None   # (gain, per-token latency) an offload is to beat
        self.offload_claims: list[dict] = []    # the memory-aware offloads: promised and delivered
        self.offload_check: OffloadCheck | None = None
        self._gain_road_closed = False   # an offload did not pay: not again in this overload
        self.offload_verdicts = {"paid": 0, "missed": 0}
        self.ar_hold_steps = 0
        self._timeline: list[tuple] = []
        self._timeline_stride = 1
        self._last_tl_step = -10 ** 9

    # ------------------------------------------------------------------ contexts

    def _context(self, s: LoadSignals) -> Hashable:
        if self._ctx_fn is not None:
            ctx = self._ctx_fn(s)
            self._ref_batch.setdefault(ctx, float(max(s.batch_size, 1)))
            return ctx
        lo, hi = batch_bin(s.batch_size)
        key = (lo, _waiting_bucket(s.waiting)[0] if self._with_waiting else None)
        label = self._labels.get(key)
        if label is None:
            label = f"b{lo}" if lo == hi else f"b{lo}-{hi}"
            if self._with_waiting:
                wlo, whi = _waiting_bucket(s.waiting)
                label += "|w0" if whi == 0 else f"|w{wlo}-{whi}"
            self._labels[key] = label
            self._ref_batch[label] = math.sqrt(lo * hi)
        return label

    def _norm(self, ctx: Hashable, b: int) -> float:
        """Factor taking a per-token latency at batch b to the bin's reference batch."""
        b = max(int(b), 1)
        key = (ctx, b)
        f = self._norm_cache.get(key)
        if f is None:
            f = self._norm_cache[key] = self._norm_uncached(ctx, b)
            if len(self._norm_cache) > 50_000:
                self._norm_cache.clear()
        return f

    def _norm_uncached(self, ctx: Hashable, b: int) -> float:
        ref = self._ref_batch.get(ctx)
        if ref is None or abs(b - ref) < 1e-9:
            return 1.0
        if self.cost_profile is not None and self.cost_profile.verify:
            try:
                at_b = self.cost_profile.t_verify(b, 1) / b
                at_ref = self.cost_profile.t_verify(ref, 1) / ref
                if at_b > 0 and at_ref > 0:
                    return at_ref / at_b
            except ValueError:
                pass
        return (b / ref) ** self.batch_exponent

    # ------------------------------------------------------------------ prior and acceptance

    def alpha_estimate(self) -> float:
        """Per-position acceptance, inverted from tokens committed per sequence in SD steps
        (recomputed at most every 64 SD observations)."""
        alpha, at = self._alpha_cache
        if at >= 0 and self._sd_obs - at < 64:
            return alpha
        alpha = self._alpha_uncached()
        self._alpha_cache = (alpha, self._sd_obs)
        return alpha

    def _alpha_uncached(self) -> float:
        if not self._e_hat:
            return self.alpha_prior
        vals = []
        for g, e in self._e_hat.items():
            e = min(max(e, 1.0), g + 1.0)
            lo, hi = 0.0, 1.0
            for _ in range(30):
                mid = 0.5 * (lo + hi)
                if expected_tokens_per_call(mid, g) < e:
                    lo = mid
                else:
                    hi = mid
            vals.append(0.5 * (lo + hi))
        return min(max(sum(vals) / len(vals), 0.01), 0.99)

    def _prior(self, ctx: Hashable, arm: tuple[str, int]) -> float:
        """Predicted per-token latency of `arm` at the bin's reference batch (cost model)."""
        alpha = round(self.alpha_estimate(), 2)
        key = (ctx, arm, alpha)
        v = self._prior_cache.get(key)
        if v is None:
            b = max(int(round(self._ref_batch.get(ctx, 1.0))), 1)
            try:
                p = predict(arm[0], b, arm[1], alpha, self.cost_profile)
                v = 1.0 / p.tokens_per_s if p.tokens_per_s > 0 else float("nan")
            except ValueError:
                v = float("nan")
            if len(self._prior_cache) > 50_000:
                self._prior_cache.clear()
            self._prior_cache[key] = v
        return v

    # ------------------------------------------------------------------ switching cost

    def lag_tokens(self) -> int:
        """Tokens the drafter would have to catch up on if turned on now: the engine's count
        (``LoadSignals.drafter_lag_tokens``) when it reports one, else an estimate: the tokens
        committed while it was off, at most ``batch x lag_cap_steps`` (sequences that finished
        while it was off need no catch-up; a sequence rarely runs longer than the cap)."""
        if self._engine_lag is not None:
            return self._engine_lag
        per_step = self._lag_tokens / max(self._off_steps, 1)
        return int(min(self._lag_tokens, per_step * min(self._off_steps, self.lag_cap_steps)))

    def estimated_switch_cost_s(self, offloaded: bool | None = None) -> float:
        """Seconds a drafter turn-on would cost now (catch-up + reload if offloaded)."""
        c = (self._rebuild_per_tok or 0.0) * self.lag_tokens()
        off = self._offloaded if offloaded is None else offloaded
        if off:
            c += self.reload_weight * (self._reload_s or 0.0)
        return c

    def _switch_cost(self, a_from, a_to) -> float:
        """In loss units (summed per-token latencies): the measured drafter turn-on cost for
        ar -> sd/psd, spread over the tokens a step of this bin commits; other switches are free
        (the bandit's ``hysteresis`` keeps near-equal arms from alternating)."""
        if a_from[0] != "ar" or a_to[0] == "ar":
            return 0.0
        c = self.estimated_switch_cost_s()
        if c <= 0:
            return 0.0
        tps = self._tokens_per_step.get(self._ctx) or float(max(self._batch, 1))
        return c / tps * self._norm(self._ctx, self._batch)

    # ------------------------------------------------------------------ the step API

    def decide(self, signals: LoadSignals) -> Decision:
        now = signals.now if signals.now is not None else self._clock()
        if self._t0 is None:
            self._t0 = now
        self.steps += 1
        ctx = self._context(signals)
        self._ctx, self._batch, self._waiting = ctx, max(signals.batch_size, 1), signals.waiting
        if signals.drafter_offloaded is not None:
            self._engine_reports_offload = True
            self._offloaded = bool(signals.drafter_offloaded)
        if signals.drafter_lag_tokens is not None:
            self._engine_lag = int(signals.drafter_lag_tokens)
        d = self._decisions[self.bandit.select(ctx, allowed=self._restriction(signals, now))]
        prev = self._current
        if prev is None or d.speculative != prev.speculative:
            if prev is not None:
                self.mode_switches += 1
            if d.speculative:
                self._ar_since = None
                if prev is not None:
                    self.drafter_turn_ons += 1
                    self._lag_at_turn_on = self.lag_tokens()
            else:
                self._ar_since = (self.steps, now)
        if d != prev or self.steps - self._last_tl_step >= self.timeline_every * self._timeline_stride:
            self._record(now, d, signals.batch_size)
        self._current = d
        return d

    def _restriction(self, s: LoadSignals, now: float) -> tuple | None:
        """The arms allowed this step: None (all); plain decoding only while the drafter's
        memory serves, or is about to serve, as KV cache; no batch-parallel arm with a single
        running sequence (the engine runs it as sequential SD, so the arm would never be
        scored and, untried, it would be picked again and again)."""
        pol = self.offload_policy
        pol.update(s, now)
        allowed = self._no_psd_arms if s.batch_size < 2 and self.psd_available else None
        if AR.arm in self._decisions:
            if pol.level < pol.clear_level:
                self._gain_road_closed = False           # that overload is over
            if self._offloaded:
                self._offload_for_kv = False
                hold = not pol.may_reload(now) and not self._offload_missed()
            else:
                self.offload_check = None
                if not pol.sustained(now) or self._gain_road_closed:
                    self._offload_for_kv = False
                elif (not self._offload_for_kv and s.kv_growth_if_offloaded is not None
                      and self.steps % self.gain_check_every == 0):
                    est = self._offload_estimate(s)
                    self._offload_for_kv = pol.gain_pays(est[0] if est else None)
                    self._claim = est if est and self._offload_for_kv else None
                hold = self._offload_for_kv
            if hold:
                allowed = (AR.arm,)
                self.ar_hold_steps += 1
            elif self._holding_ar:
                self.bandit.interrupt()      # the hold ends: decide afresh, not by an old AR block
            self._holding_ar = hold
        return allowed

    def _offload_missed(self) -> bool:
        """Has the running memory-aware offload been measured not to pay? Then the hold ends
        (speculation may come back, preempting what the smaller pool cannot keep) and the
        memory-aware road stays closed until this overload is over."""
        if self._claim is not None and self.offload_check is None:
            n = self.offload_after_steps
            gain, baseline = self._claim
            self.offload_check = OffloadCheck(baseline, settle_steps=n, verify_steps=2 * n)
            self.offload_claims = self.offload_claims[-15:] + [
                {"step": self.steps, "predicted_gain": gain, "baseline_s_per_token": baseline}]
            self._claim = None
        chk = self.offload_check
        if chk is None or chk.verdict is None:
            return False
        if not chk.counted:
            chk.counted = True
            self.offload_verdicts["paid" if chk.verdict else "missed"] += 1
            self.offload_claims[-1].update(delivered_s_per_token=chk.delivered_s_per_token,
                                           paid=chk.verdict)
            if not chk.verdict:
                self._gain_road_closed = True
        return not chk.verdict

    def offload_gain(self, s: LoadSignals) -> float | None:
        est = self._offload_estimate(s)
        return est[0] if est is not None else None

    def _offload_estimate(self, s: LoadSignals) -> tuple[float, float] | None:
        """(gain, the best speculative arm's per-token latency now). The gain is the predicted
        per-token speed-up of plain decoding with the drafter offloaded (at the batch
        the grown pool would admit) over the best speculative arm now (at the batch that fits):
        > 1 means the drafter's memory is worth more as KV cache. From what was measured: the
        arms' means in this bin, AR's taken to the bigger batch by the target forward's cost
        line (:class:`~planner.step_costs.ForwardCost`; until it is known, AR's mean in the bin
        of the bigger batch, or this bin's rescaled like the losses are). None when the engine
        cannot grow the pool or too little is measured yet."""
        g = s.kv_growth_if_offloaded
        b = max(int(s.batch_size), 1)
        if g is None or g <= 1.0 or s.waiting <= 0:
            return None                   # nobody would be admitted by a bigger pool
        b2 = min(b * g, b + s.waiting)
        if s.batch_limit:
            b2 = min(b2, float(s.batch_limit))
        if b2 < b + 1:
            return None
        ctx = self._context(s)
        spec = [m for a, (m, n) in self.bandit.means(ctx).items()
                if a[0] != "ar" and n >= self.gain_min_obs]
        if not spec:
            return None
        spec_now = min(spec) / self._norm(ctx, b)
        b2i = int(round(b2))
        ar_here = self.bandit.means(ctx).get(AR.arm)
        ratio = self.forward_cost.per_token_ratio(b, b2)
        if ratio is not None and ar_here is not None and ar_here[1] >= self.gain_min_obs:
            return spec_now / (ar_here[0] / self._norm(ctx, b) * ratio), spec_now
        ctx2 = self._context(LoadSignals(batch_size=b2i, waiting=s.waiting))
        for c in (ctx2, ctx):
            m = self.bandit.means(c).get(AR.arm)
            if m is not None and m[1] >= self.gain_min_obs:
                return spec_now / (m[0] / self._norm(c, b2i)), spec_now
        return None

    def _record(self, now: float, d: Decision, batch: int) -> None:
        self._timeline.append((round(now - (self._t0 or now), 6), self.steps, d.mode, d.gamma, int(batch)))
        self._last_tl_step = self.steps
        if len(self._timeline) > self.timeline_max:   # keep the whole run, at half the resolution
            self._timeline = self._timeline[::2]
            self._timeline_stride *= 2

    def observe(self, decision: Decision, *, step_wall_s: float, tokens_committed: int,
                drafter_rebuild_s: float = 0.0, drafter_reload_s: float = 0.0,
                batch_size: int, prefill_tokens: int = 0, forward_tokens: int = 0,
                forward_s: float = 0.0) -> None:
        """Feed back one step: the decision the engine actually ran (not the one asked for, when
        e.g. the drafter was still reloading), its wall time, the tokens it committed over all
        sequences, the sequences it advanced, and the drafter's catch-up / reload times when
        speculation resumed after a gamma = 0 period. With ``prefill_tokens`` (prompt tokens fed
        this step) and the target forward's size and time (``forward_tokens``, ``forward_s``),
        the prefill's share of the wall time is estimated (:mod:`planner.step_costs`) and not
        charged to the arm."""
        ctx = self._ctx
        if ctx is None:        # observe before any decide: bin by the batch size we are given
            ctx = self._context(LoadSignals(batch_size=batch_size))
        tokens = max(int(tokens_committed), 1)
        tps = self._tokens_per_step.get(ctx)
        self._tokens_per_step[ctx] = tps = _ewma(tps, float(tokens), 0.1)
        wall = float(step_wall_s)
        self.forward_cost.observe(forward_tokens, forward_s)
        if self.wall_includes_rebuild and drafter_rebuild_s > 0:
            wall = max(wall - drafter_rebuild_s, 0.05 * wall)
        if prefill_tokens > 0:
            wall = max(wall - self.forward_cost.prefill_seconds(prefill_tokens), 0.1 * wall)
        if wall > 0 and math.isfinite(wall) and decision.arm in self._decisions:
            running = self._batch if self._ctx is not None else batch_size
            weight = min(max(tokens / tps, 0.1), 10.0)    # time over tokens, not mean of ratios
            self.bandit.update(ctx, decision.arm, wall / tokens * self._norm(ctx, running), weight)

        if self.offload_check is not None and decision.mode == "ar" and math.isfinite(wall):
            self.offload_check.observe(wall, tokens)
        if decision.mode == "ar":
            self._lag_tokens += int(tokens_committed)
            self._off_steps += 1
        else:
            if decision.mode == "sd" and batch_size > 0 and tokens_committed > 0:
                g = decision.gamma
                self._e_hat[g] = _ewma(self._e_hat.get(g), tokens_committed / batch_size, 0.05)
                self._sd_obs += 1
            if drafter_rebuild_s > 0:
                lag = self._lag_at_turn_on if self._lag_at_turn_on is not None else self.lag_tokens()
                if lag and lag > 0:
                    self._rebuild_per_tok = (drafter_rebuild_s / lag if self.rebuild_samples == 0
                                             else _ewma(self._rebuild_per_tok, drafter_rebuild_s / lag,
                                                        self.cost_ewma))
                    self.rebuild_samples += 1
            self._lag_tokens = 0
            self._off_steps = 0
            self._lag_at_turn_on = None
        if drafter_reload_s > 0:
            self._reload_s = (drafter_reload_s if self.reload_samples == 0
                              else _ewma(self._reload_s, drafter_reload_s, self.cost_ewma))
            self.reload_samples += 1
            if not self._engine_reports_offload:
                self._offloaded = False
                self._wanted_offload = False

    def memory_pressure(self, s: LoadSignals) -> bool:
        return self.offload_policy.memory_pressure(s)

    def wants_offload(self, signals: LoadSignals) -> bool:
        """True when plain decoding runs and either it has run for at least
        ``offload_after_steps`` steps and ``offload_after_s`` seconds with memory under pressure
        now, or the memory-aware rule asked for the offload (sustained pressure, and the bigger
        KV pool predicted to pay): the engine may then move the drafter's weights to host memory
        (the planner then counts a reload into the cost of turning speculation back on)."""
        if self._current is None or self._current.speculative or self._ar_since is None:
            return False
        now = signals.now if signals.now is not None else self._clock()
        step0, t0 = self._ar_since
        sustained = (self.steps - step0 + 1 >= self.offload_after_steps
                     and now - t0 >= self.offload_after_s)
        want = (sustained and self.memory_pressure(signals)) or (
            self._offload_for_kv and not self._offloaded)
        if want and not self._wanted_offload:
            self.offload_requests += 1
        if want:
            self._wanted_offload = True
            if not self._engine_reports_offload:
                self._offloaded = True
        return want

    # ------------------------------------------------------------------ reporting

    @property
    def current(self) -> Decision | None:
        return self._current

    @property
    def drafter_offloaded(self) -> bool:
        return self._offloaded

    def timeline(self) -> list[tuple]:
        """[(t_s since the first decision, step, mode, gamma, batch_size)] at every decision
        change and every ``timeline_every`` steps (thinned to stay under ``timeline_max``)."""
        return list(self._timeline)

    def summary(self) -> dict:
        """The counters of :meth:`stats`, without the per-bin detail and the timeline: small
        enough for a log line."""
        b = self.bandit
        return {
            "steps": self.steps,
            "switches": b.switches,
            "mode_switches": self.mode_switches,
            "drafter_turn_ons": self.drafter_turn_ons,
            "offload_requests": self.offload_requests,
            "ar_hold_steps": self.ar_hold_steps,
            "memory": {"pressure_level": self.offload_policy.level,
                       "last_offload_gain": self.offload_policy.last_gain,
                       "offload_verdicts": dict(self.offload_verdicts),
                       "offload_claims": [dict(c) for c in self.offload_claims]},
            "current": str(self._current) if self._current is not None else None,
            "arm_counts": {_arm_str(a): n for a, n in b.arm_counts().items()},
            "switch_cost": {
                "rebuild_s_per_token": self._rebuild_per_tok,
                "reload_s": self._reload_s,
                "rebuild_samples": self.rebuild_samples,
                "reload_samples": self.reload_samples,
                "lag_tokens": self.lag_tokens(),
                "turn_on_cost_s_now": self.estimated_switch_cost_s(),
                "drafter_offloaded": self._offloaded,
            },
            "alpha_estimate": self.alpha_estimate(),
            "forward_s_per_token": self.forward_cost.seconds_per_token,
        }

    def stats(self) -> dict:
        """:meth:`summary`, plus the bandit's shift counters, per-bin detail and the timeline."""
        b = self.bandit
        per = {}
        for ctx in b.contexts:
            best = b.best(ctx)
            means = b.means(ctx)
            bs = b._bins[ctx]
            per[str(ctx)] = {
                "best": _arm_str(best) if best is not None else None,
                "held": _arm_str(b.arms[bs.block_arm]) if bs.block_arm is not None else None,
                "steps": int(bs.t),
                "shifts": bs.shifts,
                "plays": {_arm_str(a): int(bs.plays[i]) for i, a in enumerate(b.arms) if bs.plays[i]},
                "mean_loss": {_arm_str(a): m for a, (m, _) in means.items()},
            }
        return self.summary() | {"shifts": b.shifts, "stale_resets": b.stale_resets,
                                 "per_context": per, "timeline": self.timeline()}

def _arm_str(arm) -> str:
    return "ar" if arm[0] == "ar" else f"{arm[0]}:{arm[1]}"
