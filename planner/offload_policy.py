"""When the drafter's memory should become KV cache, and when it may come back (Nightjar).

Offloading the drafter (weights to host memory, its KV pool released, the target's KV pool grown
by the freed bytes) pays only while requests are short of KV blocks, and costs a reload, a
catch-up prefill and a shrink of the pool when speculation returns. So the policy acts on
*sustained* memory pressure only: the pressure level is an exponential average of the per-step
indicator "admission left requests waiting, or the pool is at least ``kv_pressure`` full" (or
the GPU's memory at ``gpu_memory_pressure``), with a window of ``offload_after_steps`` steps; it
is sustained once the level has stayed above one half for ``offload_after_s`` seconds. A request
that arrived since the last admission has not been turned away and does not count: at the start
of a burst every request waits for one step with the pool empty.

The planner asks for an offload when either

* its bandit has run plain decoding for ``offload_after_steps`` steps and ``offload_after_s``
  seconds (speculation does not pay at this batch size, so its memory is better spent on KV),
  and the indicator holds at this step, or
* under sustained pressure, plain decoding at the batch the grown pool would admit is
  predicted to beat the best speculative arm at the batch that fits now by ``offload_gain``
  or more (with KV the bottleneck, a speculative arm can win per step yet lose to the bigger
  batch). The prediction comes from what the planner measured (:meth:`MemoryRule.estimate`, the planner's
  ``offload_gain``); ``offload_gain <= 0`` offloads on sustained pressure alone.

Both roads also need demand above capacity (``offload_demand_ratio``): the tokens per second
arriving (:mod:`planner.demand`, a few seconds' average), plus the tokens the waiting requests
still ask for spread over ``backlog_clear_s``, must be at least that ratio times the tokens per
second the running arm delivers at the batch that fits now: the queue would grow, or would not
clear in time. Requests can wait and the pool be full while demand is within the running arm's
capacity (a short burst that the arm drains); an offload then only makes every request's TPOT
worse at a larger batch, so it is not taken. Unknown demand or capacity leaves the pressure
rules to decide alone.

Once offloaded, plain decoding is held while the load would not fit the drafter-on pool (a
reload then would shrink the pool under running requests and preempt them): the pressure level
must have fallen below ``clear_level`` and the used blocks below ``reload_kv_usage`` of that pool
(default: 0.8 x ``kv_pressure``, room for the running requests to grow), for ``reload_after_s``
seconds, and demand must be within the speculative arms' capacity as far as it is measured at
this batch (a lull inside a burst is not the end of the burst; weighed every ``gain_check_every``
steps). Then the bandit may choose
speculation again and the engine reloads. The thresholds
apart (a level of one half to offload, ``clear_level`` to come back; ``kv_pressure`` against
``reload_kv_usage``) are the hysteresis that keeps the drafter from bouncing. An offload taken on
the memory-aware road is checked (:class:`OffloadCheck`): if plain decoding with the grown pool
does not beat the per-token latency it was taken to beat, the hold ends early and that road stays
closed until the pressure level falls below ``clear_level``.

The parts: :class:`OffloadPolicy` (the pressure level and its thresholds), :class:`OffloadCheck`
(one offload's verdict), :class:`DrafterPlace` (where the drafter's weights are taken to be) and
:class:`MemoryRule`, which the planner calls: ``hold`` once per step before deciding (plain
decoding only?), ``wants_offload`` while plain decoding runs, ``observe_ar`` after a plain step.
"""
from __future__ import annotations

import math

from backend.mode import Mode
from planner.arms import AR
from planner.config import PlannerConfig
from planner.signals import LoadSignals


class OffloadPolicy:
    """The pressure level and the thresholds around it (the rule above), from a
    :class:`~planner.config.PlannerConfig`'s memory settings."""

    def __init__(self, cfg: PlannerConfig, *, clear_level: float = 0.2,
                 reload_kv_usage: float | None = None):
        if not 0.0 <= clear_level < 0.5:
            raise ValueError("clear_level must be in [0, 0.5)")
        self.cfg = cfg
        self.clear_level = float(clear_level)
        self.reload_kv_usage = 0.8 * cfg.kv_pressure if reload_kv_usage is None else float(reload_kv_usage)
        self.level = 0.0                       # EWMA of the pressure indicator
        self._alpha = 1.0 / cfg.offload_after_steps
        self._high_since: float | None = None  # when the level last rose above one half
        self._clear_since: float | None = None  # when the load last started to fit the base pool
        self.last_gain: float | None = None    # the last predicted gain of an offload

    def memory_pressure(self, s: LoadSignals) -> bool:
        """This step's indicator: admission left requests waiting, or the target's pool (or
        GPU) is nearly full. (Requests that arrived since the last admission wait too, but have
        not been turned away: counting them offloaded at the start of a burst, the pool empty.)"""
        if s.queued > 0 or s.kv_usage >= self.cfg.kv_pressure:
            return True
        frac = s.gpu_memory_fraction
        return frac is not None and frac >= self.cfg.gpu_memory_pressure

    def update(self, s: LoadSignals, now: float) -> None:
        """Once per step, before deciding."""
        self.level += self._alpha * (float(self.memory_pressure(s)) - self.level)
        if self.level >= 0.5:
            if self._high_since is None:
                self._high_since = now
        else:
            self._high_since = None
        usage_at_base = s.kv_usage_at_base if s.kv_usage_at_base is not None else s.kv_usage
        if self.level < self.clear_level and usage_at_base < self.reload_kv_usage:
            if self._clear_since is None:
                self._clear_since = now
        else:
            self._clear_since = None

    def quiet_below(self) -> float | None:
        """The KV usage under which a step, with nothing queued and no GPU figure, would change
        nothing here but the level's decay: the level far from any threshold (under 1 %), the
        load already fitting the base pool. None when the policy is not that quiet."""
        if self.level >= 0.01 or self._clear_since is None:
            return None
        return min(self.cfg.kv_pressure, self.reload_kv_usage)

    def quiet_step(self) -> None:
        """What :meth:`update` does for a step below :meth:`quiet_below`: the level decays."""
        self.level -= self._alpha * self.level

    def sustained(self, now: float) -> bool:
        return self._high_since is not None and now - self._high_since >= self.cfg.offload_after_s

    def gain_pays(self, gain: float | None) -> bool:
        """Is an offload worth it, given the planner's predicted gain (None: no prediction)?"""
        self.last_gain = gain
        if self.cfg.offload_gain <= 0:
            return True
        return gain is not None and gain >= self.cfg.offload_gain

    def idle(self) -> None:
        """No request runs or waits: whatever pressure there was is over."""
        self.level = 0.0
        self._high_since = None

    def may_reload(self, now: float) -> bool:
        """Would the load fit the drafter-on pool, and has it for ``reload_after_s``?"""
        return self._clear_since is not None and now - self._clear_since >= self.cfg.reload_after_s


class OffloadCheck:
    """Did a memory-aware offload pay? It was decided to beat a per-token latency: the best
    speculative arm's at the batch that fitted. After ``settle_steps`` steps (for the grown pool
    to fill), plain decoding's own per-token latency over the next ``verify_steps`` steps is the
    verdict: paid if it is lower. A prediction that missed is given back, not held through the
    whole overload."""

    def __init__(self, baseline_s_per_token: float, settle_steps: int, verify_steps: int):
        self.baseline = float(baseline_s_per_token)
        self.settle_steps = int(settle_steps)
        self.verify_steps = int(verify_steps)
        self.steps = 0
        self.counted = False           # the planner has tallied the verdict
        self._wall = 0.0
        self._tokens = 0

    def observe(self, wall_s: float, tokens: int) -> None:
        self.steps += 1
        # the window only: once given, the verdict is final (the steps after it are at whatever
        # batch the load has moved to, and must not reverse a verdict already acted on)
        if self.settle_steps < self.steps <= self.settle_steps + self.verify_steps:
            self._wall += wall_s
            self._tokens += tokens

    @property
    def delivered_s_per_token(self) -> float | None:
        return self._wall / self._tokens if self._tokens else None

    @property
    def verdict(self) -> bool | None:
        """True (paid), False (did not), None (still measuring)."""
        if self.steps < self.settle_steps + self.verify_steps or not self._tokens:
            return None
        return self.delivered_s_per_token < self.baseline


class SettledPlain:
    """Plain decoding's cost per context from its *settled* steps: issued as plain decoding, and
    more than ``plain_settle_steps`` after the last step issued with the drafter. The steps right after drafting are slower (on a
    2-core CPU host through tritonserver, a plain forward's first four steps after drafting took
    1.3-1.4x a settled one's, the next three 1.2x: the caches the drafter's forwards displaced),
    and where the bandit plays plain decoding in short blocks between drafting ones, most of its
    mean is that transient. An offload holds plain decoding for the whole overload, so its gain
    is weighed on the settled cost. A discounted mean of the bandit's losses (rescaled to the
    context's reference batch), weighted as the bandit weighs them."""

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self._sums: dict = {}     # context -> [weighted loss, weight, samples]

    def observe(self, ctx, loss: float, weight: float) -> None:
        """`loss`: a finite step loss, as :class:`~planner.contexts.StepLoss` makes them."""
        s = self._sums.get(ctx)
        if s is None:
            s = self._sums[ctx] = [0.0, 0.0, 0]
        f = self.forget
        s[0] = f * s[0] + weight * loss
        s[1] = f * s[1] + weight
        s[2] += 1

    def loss(self, ctx, min_samples: float) -> float | None:
        s = self._sums.get(ctx)
        if s is None or s[2] < min_samples or s[1] <= 0:
            return None
        return s[0] / s[1]


class OffloadWeighing:
    """How one sustained overload was weighed for a memory-aware offload, so a report can say why
    the drafter stayed (or when it left): how many weighs, the predicted gains, the demand ratios,
    and what fell short each time (no estimate, the gain, the demand)."""

    def __init__(self, since: float):
        self.since = float(since)          # the first weigh (the planner's clock)
        self.ended = False                 # the pressure ended, the road closed, or the drafter left
        self.weighs = 0
        self.short = {"no_estimate": 0, "gain": 0, "demand": 0}
        self.gains: list[float] = []       # the predicted gains, in order (at most 64 kept)
        self.demand_ratio_max: float | None = None
        self.paid_after_s: float | None = None   # since the first weigh, to the first that paid
        self.probed = False                # a settled probe ran (MemoryRule._probe_due)

    def add(self, now: float, gain: float | None, gain_pays: bool, demand: bool | None,
            demand_ratio: float | None) -> None:
        self.weighs += 1
        if gain is None:
            self.short["no_estimate"] += 1
        elif len(self.gains) < 64:
            self.gains.append(float(gain))
        if gain is not None and not gain_pays:
            self.short["gain"] += 1
        if demand is False:
            self.short["demand"] += 1
        if demand_ratio is not None and demand is not None:
            self.demand_ratio_max = max(demand_ratio, self.demand_ratio_max or 0.0)
        if gain_pays and demand is not False and self.paid_after_s is None:
            self.paid_after_s = now - self.since
            self.ended = True              # the offload is asked for: this weighing is over

    def summary(self) -> dict:
        g = sorted(self.gains)
        return {"since": self.since, "weighs": self.weighs, "short": dict(self.short),
                "gain_min": g[0] if g else None, "gain_median": g[len(g) // 2] if g else None,
                "gain_max": g[-1] if g else None, "demand_ratio_max": self.demand_ratio_max,
                "probed": self.probed, "paid_after_s": self.paid_after_s}


class DrafterPlace:
    """Where the planner takes the drafter's weights to be: the engine's word when its signals
    report it (``drafter_offloaded``), else the planner's own bookkeeping of the offloads it
    asked for and the reloads it was told of."""

    def __init__(self):
        self.offloaded = False
        self.engine_reports = False
        self.offload_wanted = False     # an offload was asked for and no reload seen since

    def report(self, offloaded: bool | None) -> None:
        if offloaded is not None:
            self.engine_reports = True
            self.offloaded = bool(offloaded)

    def offload_asked(self) -> None:
        self.offload_wanted = True
        if not self.engine_reports:
            self.offloaded = True

    def reloaded(self) -> None:
        if not self.engine_reports:
            self.offloaded = False
            self.offload_wanted = False


class MemoryRule:
    """The planner's side of elastic memory: when to ask for an offload (:meth:`wants_offload`),
    when to hold plain decoding (:meth:`hold`), what an offload would gain (:meth:`estimate`,
    from the bandit's own means), and whether a memory-aware offload delivered
    (:class:`OffloadCheck`)."""

    def __init__(self, cfg: PlannerConfig, bandit, bins, forward_cost, drafter: DrafterPlace,
                 *, has_ar: bool, serving=None):
        """`serving`: the serving path's measured cost outside the forwards (a
        :class:`~planner.serving_cost.ServingCost`; None: not known)."""
        self.cfg = cfg
        self._serving = serving
        self.policy = OffloadPolicy(cfg)
        self.drafter = drafter
        self._bandit = bandit            # a ContextualBandit: means(), interrupt()
        self._bins = bins                # a ContextBins: context(), norm()
        self._forward_cost = forward_cost
        self._ar_cores: int | None = None   # the placement plain decoding last ran on
        self._has_ar = has_ar
        self.offload_requests = 0
        self.hold_steps = 0
        self.for_kv = False              # the memory-aware rule wants the drafter's bytes as KV
        self.holding_ar = False          # offloaded, and the load does not fit the base pool
        self._claim: tuple[float, float] | None = None   # (gain, per-token latency) to beat
        self.claims: list[dict] = []     # the memory-aware offloads: promised and delivered
        self.check: OffloadCheck | None = None
        self._road_closed = False        # an offload did not pay: not again in this overload
        self.verdicts = {"paid": 0, "missed": 0}
        self.last_demand_ratio: float | None = None   # demand / the arm's capacity, last asked
        self._demand_verdict: bool | None = None      # offloaded: demand over capacity, last weighed
        self.weighings: list[OffloadWeighing] = []    # the last sustained overloads, as weighed
        self.settled_plain = SettledPlain()
        self._probe_left = 0              # steps of plain decoding left in a settled probe
        self.probing = False              # this step is one of them
        self.probe_steps = 0

    def hold(self, s: LoadSignals, now: float, step: int) -> bool:
        """Once per step, before deciding: must this step decode plainly? (While the drafter's
        memory serves, or is about to serve, as KV cache.)"""
        pol = self.policy
        pol.update(s, now)
        if not self._has_ar:
            return False
        if pol.level < pol.clear_level:
            self._road_closed = False           # that overload is over
        if self.drafter.offloaded:
            self.for_kv = False
            hold = (not pol.may_reload(now) or self._demand_holds(s, step)) and not self._missed(step)
        else:
            self.check = None
            self._demand_verdict = None
            hold = self.for_kv = self._weigh(s, now, step)
        probing = self.probing = not hold and self._probe_left > 0 and not self.drafter.offloaded
        if probing:                      # a settled probe: plain decoding, to be measured
            self._probe_left -= 1
            self.probe_steps += 1
        elif hold:
            self.hold_steps += 1
        if not (hold or probing) and self.holding_ar:
            self._bandit.interrupt()     # the hold ends: decide afresh, not by an old AR block
        self.holding_ar = hold or probing
        return hold or probing

    def _demand_holds(self, s: LoadSignals, step: int) -> bool:
        """Offloaded, with room to reload: does demand still exceed the speculative arms'
        capacity? Weighed when first asked and then every ``gain_check_every`` steps, as the
        offload's gain is: it reads every arm's estimate from the bandit (tenths of a millisecond
        on a CPU, a tenth of a small batch's step), and demand moves over seconds, not steps."""
        if self._demand_verdict is None or step % self.cfg.gain_check_every == 0:
            self._demand_verdict = self.demand_over(s, speculative=True) is True
        return self._demand_verdict

    def _weigh(self, s: LoadSignals, now: float, step: int) -> bool:
        """Does the memory-aware road want the drafter's bytes as KV cache now?"""
        if not self.policy.sustained(now) or self._road_closed:
            self._weighing_ends()
            return False
        if self.for_kv or s.kv_growth_if_offloaded is None or step % self.cfg.gain_check_every:
            return self.for_kv
        means = self._bandit.means(self._bins.context(s))    # every arm's estimate, read once
        est = self.estimate(s, means)
        gain_pays = self.policy.gain_pays(est[0] if est else None)
        weighing = self._weighing(now)
        probe = not gain_pays and self._probe_due(s, est, weighing)
        demand = self.demand_over(s, speculative=True, means=means) if gain_pays or probe else None
        pays = gain_pays and demand is not False
        weighing.add(now, est[0] if est else None, gain_pays, demand, self.last_demand_ratio)
        self._claim = est if est and pays else None
        if probe and demand is not False:
            self._probe_left = self.cfg.plain_settle_steps + math.ceil(self.cfg.gain_min_obs) + 1
            weighing.probed = True
        return pays

    def _probe_due(self, s: LoadSignals, est: tuple[float, float] | None, weighing: OffloadWeighing) -> bool:
        """A gain near the line, weighed on plain decoding's mean with its turn-off transients
        (no settled steps measured in this context), with no probe yet in this overload: run
        plain decoding for ``plain_settle_steps`` + ``gain_min_obs`` + 1 steps (if demand is not
        below the gate), so the next weigh reads its settled cost (:class:`SettledPlain`)."""
        floor = self.cfg.settled_probe_floor
        if weighing.probed or est is None or floor <= 0 or est[0] < floor * self.cfg.offload_gain:
            return False
        return self.settled_plain.loss(self._bins.context(s), self.cfg.gain_min_obs) is None

    def _weighing(self, now: float) -> OffloadWeighing:
        """The record of this sustained overload's weighing (begun at its first weigh)."""
        w = self.weighings[-1] if self.weighings else None
        if w is None or w.ended:
            w = OffloadWeighing(now)
            self.weighings = self.weighings[-7:] + [w]
        return w

    def _weighing_ends(self) -> None:
        if self.weighings:
            self.weighings[-1].ended = True

    def _missed(self, step: int) -> bool:
        """Has the running memory-aware offload been measured not to pay? Then the hold ends
        (speculation may come back, preempting what the smaller pool cannot keep) and the
        memory-aware road stays closed until this overload is over."""
        if self._claim is not None and self.check is None:
            n = self.cfg.offload_after_steps
            gain, baseline = self._claim
            self.check = OffloadCheck(baseline, settle_steps=n, verify_steps=2 * n)
            self.claims = self.claims[-15:] + [
                {"step": step, "predicted_gain": gain, "baseline_s_per_token": baseline}]
            self._claim = None
        chk = self.check
        if chk is None or chk.verdict is None:
            return False
        if not chk.counted:
            chk.counted = True
            self.verdicts["paid" if chk.verdict else "missed"] += 1
            self.claims[-1].update(delivered_s_per_token=chk.delivered_s_per_token, paid=chk.verdict)
            if not chk.verdict:
                self._road_closed = True
        return not chk.verdict

    def reload_while_idle(self, idle_s: float) -> bool:
        """The engine has had no request for `idle_s` seconds, its drafter offloaded: bring the
        weights back now? An idle engine has no memory pressure and no request that a smaller
        pool could preempt, so once it has been idle for ``reload_after_s`` the weights return:
        the next arrival need not decode plainly while they travel, nor does the server report
        them away from an idle device. A burst after that offloads again by the usual rules."""
        if idle_s < self.cfg.reload_after_s:
            return False
        self.policy.idle()
        self._road_closed = False
        return True

    def observe_ar(self, wall_s: float, tokens: int, forward_cores: int = 0,
                   settled_in=None, loss: float | None = None, weight: float = 1.0) -> None:
        """A plain-decoding step's wall time, for the running offload's check, and the cores
        its forward ran on (whose cost line predicts plain decoding at a bigger batch);
        `settled_in`: its context when it was issued as plain decoding and came more than
        ``plain_settle_steps`` after the last step issued with the drafter (its `loss` and
        `weight` then go to :class:`SettledPlain`)."""
        self._ar_cores = forward_cores
        if self.check is not None and math.isfinite(wall_s):
            self.check.observe(wall_s, tokens)
        if settled_in is not None and loss is not None:
            self.settled_plain.observe(settled_in, loss, weight)

    def wants_offload(self, s: LoadSignals, now: float, step: int, ar_since: tuple[int, float]) -> bool:
        """Plain decoding has run since `ar_since` (step, time): is this the time to offload?"""
        step0, t0 = ar_since
        sustained = (step - step0 + 1 >= self.cfg.offload_after_steps
                     and now - t0 >= self.cfg.offload_after_s)
        want = (sustained and self.policy.memory_pressure(s)
                and self.demand_over(s, speculative=False) is not False) or (
            self.for_kv and not self.drafter.offloaded)
        if want and not self.drafter.offload_wanted:
            self.offload_requests += 1
        if want:
            self.drafter.offload_asked()
        return want

    def demand_over(self, s: LoadSignals, *, speculative: bool, means: dict | None = None) -> bool | None:
        """Is demand (arrivals, and the backlog over ``backlog_clear_s``) at least
        ``offload_demand_ratio`` x the capacity of the best measured speculative arm (or of plain
        decoding) at this batch? None when the gate is off or either side is not known yet.
        `means`: the bandit's means in this bin, where the caller has them already."""
        ratio = self.cfg.offload_demand_ratio
        if ratio <= 0 or s.demand_tok_s is None:
            return None
        demand = s.demand_tok_s + (s.waiting_tokens or 0) / self.cfg.backlog_clear_s
        s_per_token = self._best_s_per_token(s, speculative, means)
        if s_per_token is None:
            return None
        self.last_demand_ratio = demand * s_per_token       # demand / capacity
        return self.last_demand_ratio >= ratio

    def _best_s_per_token(self, s: LoadSignals, speculative: bool, means: dict | None = None) -> float | None:
        """Seconds per token of the best arm measured (``gain_min_obs``) in this bin at this
        batch: speculative arms, or plain decoding; None when none is."""
        ctx = self._bins.context(s)
        if means is None:
            means = self._bandit.means(ctx)
        best = [m for a, (m, n) in means.items()
                if Mode(a[0]).speculative == speculative and n >= self.cfg.gain_min_obs]
        return min(best) / self._bins.norm(ctx, max(int(s.batch_size), 1)) if best else None

    def estimate(self, s: LoadSignals, means: dict | None = None) -> tuple[float, float] | None:
        """(gain, the best speculative arm's per-token latency now). The gain is the predicted
        per-token speed-up of plain decoding with the drafter offloaded (at the batch
        the grown pool would admit) over the best speculative arm now (at the batch that fits):
        > 1 means the drafter's memory is worth more as KV cache. From what was measured: the
        arms' means in this bin, AR's taken to the bigger batch by the target forward's cost
        line for the forward's share, by the serving path's measured cost per step and per
        response for its share (through a server, one response per request per step does not
        amortise; the speculative arm's mean already pays it once per E tokens) and as it is for
        the rest of its per-token time (:meth:`~planner.step_costs.ForwardCost.per_token_at`);
        until the line is known, AR's mean in the bin
        of the bigger batch, or this bin's rescaled like the losses are). None when the engine
        cannot grow the pool or too little is measured yet. `means`: the bandit's means in this
        bin, where the caller has them already."""
        g = s.kv_growth_if_offloaded
        b = max(int(s.batch_size), 1)
        if g is None or g <= 1.0 or s.queued <= 0:
            return None                   # nobody would be admitted by a bigger pool
        b2 = min(b * g, b + s.queued)
        if s.batch_limit:
            b2 = min(b2, float(s.batch_limit))
        if b2 < b + 1:
            return None
        bins = self._bins
        ctx = bins.context(s)
        if means is None:
            means = self._bandit.means(ctx)
        spec_now = self._best_s_per_token(s, True, means)
        if spec_now is None:
            return None
        b2i = int(round(b2))
        ar_here = self._plain_loss(ctx, means)
        if ar_here is not None:
            overhead = self._serving.estimate() if self._serving is not None else None
            ar_at_b2 = self._forward_cost.per_token_at(b, b2, ar_here / bins.norm(ctx, b), overhead,
                                                       cores=self._ar_cores)
            if ar_at_b2 is not None:
                return spec_now / ar_at_b2, spec_now
        ctx2 = bins.context(LoadSignals(batch_size=b2i, waiting=s.waiting))
        for c, m in ((ctx2, self._plain_loss(ctx2)), (ctx, ar_here)):
            if m is not None:
                return spec_now / (m / bins.norm(c, b2i)), spec_now
        return None

    def _plain_loss(self, ctx, means: dict | None = None) -> float | None:
        """Plain decoding's loss in `ctx` as an offload would hold it, run after run: its
        settled steps' (:class:`SettledPlain`) where enough were measured, else the bandit's
        mean of all its steps, the turn-off's transient in them (None: too little measured)."""
        min_obs = self.cfg.gain_min_obs
        settled = self.settled_plain.loss(ctx, min_obs)
        if settled is not None:
            return settled
        m = (means if means is not None else self._bandit.means(ctx)).get(AR.arm)
        return m[0] if m is not None and m[1] >= min_obs else None

    def summary(self) -> dict:
        return {"pressure_level": self.policy.level, "last_offload_gain": self.policy.last_gain,
                "settled_probe_steps": self.probe_steps,
                "last_demand_ratio": self.last_demand_ratio,
                "offload_verdicts": dict(self.verdicts), "offload_claims": [dict(c) for c in self.claims],
                "offload_weighings": [w.summary() for w in self.weighings]}
