"""The adaptive planner: per step, plain decoding, sequential SD or batch-parallel SD, and gamma.

The engine's one controller. It is built once, from the settings and what the engine knows of
itself::

    planner = Planner(PlannerConfig.from_dict(engine_json.get("planner")),
                      gamma_max=8, psd_available=drafter_has_own_device, seed=seed,
                      ngram_available=engine_also_holds_an_ngram_proposer)

and called around every step (snapshot -> decide -> apply -> observe)::

    signals = engine_signals.snapshot(...)    # LoadSignals
    d = planner.decide(signals)               # -> Decision(mode, gamma)
    ... run the step as d says (or as close as it can: the outcome says what it actually ran) ...
    if not d.speculative and planner.wants_offload(signals): ...   # drafter weights to host
    planner.observe(d, StepOutcome(step_wall_s=..., tokens_committed=..., batch_size=...,
                                   ran=...,  # only where the step could not run d
                                   drafter_rebuild_s=..., drafter_reload_s=...))
    planner.observe_serving(seconds, responses)   # a step's cost outside its forwards

Reports: :meth:`summary` (counters, small enough for a log line), :meth:`stats` (plus per-context
detail and the timeline), :attr:`switches`, :attr:`current`, :attr:`drafter_offloaded`.

The parts it composes, one concept each:

* :mod:`planner.config` — ``PlannerConfig`` / ``BanditConfig``: the settings, validated
* :mod:`planner.arms` — ``Decision``, ``AR`` and the arms (mode, gamma)
* :mod:`planner.outcome` — ``StepOutcome``: what a step cost and committed, observed with its decision
* :mod:`planner.contexts` — context bins and the loss (per-token latency, rescaled in a bin)
* :mod:`planner.bandit` — the contextual bandit that picks the arm per context
* :mod:`planner.acceptance` — the acceptance estimate and the cost model's prior for the bandit
* :mod:`planner.switch_cost` — the measured price of turning the drafter back on
* :mod:`planner.offload_policy` — elastic memory: pressure, offload, hold, reload, verdicts
* :mod:`planner.step_costs` — the target forward's cost line (prefill's share, bigger batches)
* :mod:`planner.cost_model` — AR / SD / PSD throughput from measured forward costs
* :mod:`planner.serving_cost` — the serving path's cost per step and per response, measured
* :mod:`planner.pruning` — the arms set aside while requests wait, and what brings them back
* :mod:`planner.policy_check` — plain decoding against the bandit's choice over whole stretches
* :mod:`planner.signals` — ``LoadSignals`` and where they come from
* :mod:`planner.timeline` — the bounded record of decisions

The switching cost reaches the bandit in loss units: a turn-on's seconds spread over the tokens
a step of the current bin commits, rescaled like the losses; other switches are free (the
bandit's ``hysteresis`` keeps near-equal arms from alternating). ``batch_size`` in ``observe``
is the number of sequences the step advanced (for PSD the verified sub-batch); the bin and the
loss rescaling use the running batch size of ``decide``.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable

from planner.acceptance import AcceptanceEstimate, CostModelPrior, MatchRate
from planner.arms import AR, Arm, Decision, arm_mode, arm_str, make_arms
from planner.bandit import ContextualBandit
from backend.mode import Mode
from planner.config import PlannerConfig
from planner.contexts import ContextBins, StepLoss, batch_bin
from planner.cost_model import CostProfile
from planner.offload_policy import DrafterPlace, MemoryRule, OffloadPolicy
from planner.policy_check import PolicyCheck
from planner.pruning import ArmPruner
from planner.serving_cost import ServingCost
from planner.outcome import StepOutcome
from planner.signals import LoadSignals
from planner.step_costs import ForwardCost
from planner.switch_cost import SwitchCost
from planner.timeline import Timeline

__all__ = ["AR", "Decision", "Planner", "StepOutcome"]


class Planner:
    def __init__(self, config: PlannerConfig | None = None, *, gamma_max: int, psd_available: bool,
                 seed: int = 0, cost_profile: CostProfile | None = None,
                 clock: Callable[[], float] = time.monotonic, ngram_available: bool = False):
        cfg = self.config = config if config is not None else PlannerConfig()
        if not isinstance(cfg, PlannerConfig):
            raise TypeError(f"config must be a PlannerConfig, not {type(cfg).__name__} "
                            "(use PlannerConfig.from_dict for a dict of settings)")
        self.arms: list[Arm] = make_arms(gamma_max, psd_available, cfg.modes, cfg.gamma_min,
                                         ngram_available)
        self.gamma_max = gamma_max
        self.psd_available = psd_available
        self.cost_profile = cost_profile
        self._clock = clock
        self._decisions = {a: Decision(*a) for a in self.arms}
        self._no_psd_arms = tuple(a for a in self.arms if a[0] is not Mode.PSD) or None
        self._psd_arms = frozenset(a for a in self.arms if a[0] is Mode.PSD)

        self.bins = ContextBins(cfg.context_bins, cost_profile, cfg.batch_exponent)
        self.forward_cost = ForwardCost()
        self._loss = StepLoss(self.bins, self.forward_cost, cfg.wall_includes_rebuild)
        self._acceptance = AcceptanceEstimate(cfg.alpha_prior)
        self._ngram_matches = MatchRate()
        self._switch = SwitchCost(cfg, cost_profile)
        self.serving_cost = ServingCost()
        self._prior = (CostModelPrior(cost_profile, self._acceptance, self.bins, self._ngram_matches,
                                      overhead=self.serving_cost.estimate)
                       if cost_profile is not None else None)
        self.bandit = ContextualBandit(self.arms, cfg.bandit, seed=seed,
                                       switch_cost=self._switch_cost, prior=self._prior,
                                       prior_group=arm_mode,
                                       prior_inputs=self._prior.inputs if self._prior else None)
        self._drafter_arms = frozenset(a for a in self.arms if Mode(a[0]).uses_drafter)
        self._prices: tuple[int, tuple[float, float, float]] = (-1, (0.0, 0.0, 0.0))   # (step, _switch_prices())
        self._ran_last: Decision | None = None   # what the last step that decoded ran (None: idle since)
        # steps without the drafter since the last that drafted (an engine that never drafted
        # starts settled)
        self._plain_run = cfg.plain_settle_steps
        self._drafter = DrafterPlace()
        self._memory = MemoryRule(cfg, self.bandit, self.bins, self.forward_cost, self._drafter,
                                  has_ar=AR.arm in self._decisions, serving=self.serving_cost)
        self._pruner = ArmPruner(self.arms, enabled=cfg.prune, margin=cfg.prune_margin,
                                 min_obs=cfg.prune_min_obs, check_every=cfg.prune_check_every,
                                 alpha_shift=cfg.prune_alpha_shift,
                                 demand_shift=cfg.prune_demand_shift, on_move=self._context_moved)
        self._policy = PolicyCheck(cfg.policy_check and AR.arm in self._decisions,
                                   min_batch=cfg.policy_check_min_batch, margin=cfg.policy_check_margin,
                                   first_after=cfg.policy_check_after_steps,
                                   max_interval=cfg.policy_check_max_interval,
                                   seq_tokens=cfg.policy_check_seq_tokens, settle=cfg.plain_settle_steps)
        self._policy_plain = False    # the last decision was restricted to plain decoding by it
        self._timeline = Timeline(cfg.timeline_max, cfg.timeline_every)

        self.steps = 0
        self.held_steps = 0           # of those, decided by decide_held (a steady block, no snapshot)
        self.mode_switches = 0        # ar <-> speculative
        self.drafter_turn_ons = 0     # to a drafter arm from one without (ar, ngram)
        self._ctx: Hashable = None
        self._batch = 1
        self._current: Decision | None = None
        self._ar_since: tuple[int, float] | None = None   # (step, time) the current ar run began
        self._allowed: tuple | None = None   # the arms the last decision was restricted to
        self._steady_bin = (0, -1)           # the batch sizes of the context steady() last granted

    # ------------------------------------------------------------------ the step API

    def decide(self, signals: LoadSignals) -> Decision:
        """The decision for the step about to run."""
        now = signals.now if signals.now is not None else self._clock()
        self.steps += 1
        ctx = self.bins.context(signals)
        self._ctx, self._batch = ctx, max(signals.batch_size, 1)
        self._drafter.report(signals.drafter_offloaded)
        if signals.drafter_lag_tokens is not None:
            self._switch.engine_lag = int(signals.drafter_lag_tokens)
        if signals.batch_size == 0 and AR.arm in self._decisions:
            # Nothing running (the engine was idle): this step only feeds prompts, so it runs
            # plain and no arm is chosen for it. After it plain decoding is current, and the
            # drafter is behind by the new prompts: speculating next pays their catch-up as a
            # turn-on, where plain decoding pays nothing.
            d = AR
            self.bandit.assume_current(AR.arm)
        else:
            self._allowed = self._restriction(ctx, signals, now)
            d = self._decisions[self.bandit.select(ctx, allowed=self._allowed)]
        if signals.batch_size == 0:
            self._ran_last = None           # nothing was drafting: no turn-off to price
        prev = self._current
        if prev is None or d.speculative != prev.speculative:
            self._mode_changed(prev, d, now)
        if prev is not None and d.uses_drafter and not prev.uses_drafter:
            self.drafter_turn_ons += 1
            self._switch.turned_on()
        self._timeline.note(now, self.steps, d.mode, d.gamma, signals.batch_size, changed=d != prev)
        self._current = d
        return d

    # Steps a decision may stand unread (see steady()): a whole snapshot is read at least this often.
    STEADY_MAX = 32

    def steady(self, signals: LoadSignals) -> tuple[int, float]:
        """After :meth:`decide` on `signals`: for how many of the next steps its decision stands
        while the load stays quiet (nothing waiting, the drafter where it was, the KV pool's
        usage under the second value) and the running batch in the same bin: for those steps
        the caller may skip the snapshot and call :meth:`decide_held`. A decision held in a
        bandit block qualifies, with no memory pressure anywhere near, the drafter on its device
        and the context the batch's bin: then nothing a decision reads can move but the block's
        count and the batch inside its bin, and :meth:`decide_held` returns what :meth:`decide`
        would, at a fraction of its cost (at concurrency 1 on a CPU the whole controller is
        several per cent of a step). (0, 0.0): decide every step."""
        if (self._current is None or signals.batch_size <= 0 or signals.waiting
                or signals.gpu_memory_fraction is not None or self._drafter.offloaded
                or self._memory.holding_ar or not self.bins.by_load_counts):
            return 0, 0.0
        kv_below = self._memory.policy.quiet_below()
        if kv_below is None or signals.kv_usage >= kv_below:
            return 0, 0.0
        self._steady_bin = batch_bin(signals.batch_size)
        return min(self.bandit.block_left(self._ctx), self._policy.steps_left(), self.STEADY_MAX), kv_below

    def decide_held(self, now: float, batch_size: int,
                    drafter_lag_tokens: int | None = None) -> Decision | None:
        """The decision for a step whose load the caller saw quiet since :meth:`decide`, within
        the steps :meth:`steady` granted, with `batch_size` sequences running: what
        :meth:`decide` would return (the bandit's block goes on, the pressure level decays as a
        step without pressure decays it, the step is counted and noted as :meth:`decide`
        counts and notes it). None, with nothing changed, when the batch has left the bin or the
        policy check has taken up or given up plain decoding since: the caller then decides on
        a snapshot."""
        lo, hi = self._steady_bin
        if not lo <= batch_size <= hi or self._policy.plain_only() != self._policy_plain:
            return None
        self.steps += 1
        self.held_steps += 1
        self._batch = batch_size
        if drafter_lag_tokens is not None:
            self._switch.engine_lag = int(drafter_lag_tokens)
        self._memory.policy.quiet_step()
        self._acceptance.alpha()            # as the restriction reads it: its cache ages the same
        d = self._decisions[self.bandit.select(self._ctx, allowed=self._allowed)]
        self._timeline.note(now, self.steps, d.mode, d.gamma, batch_size, changed=d != self._current)
        self._current = d
        return d

    def _mode_changed(self, prev: Decision | None, d: Decision, now: float) -> None:
        if prev is not None:
            self.mode_switches += 1
        if d.speculative:
            self._ar_since = None
        else:
            self._ar_since = (self.steps, now)

    def _restriction(self, ctx: Hashable, s: LoadSignals, now: float) -> tuple | None:
        """The arms allowed this step: None (all); plain decoding only while the drafter's
        memory serves, or is about to serve, as KV cache; no batch-parallel arm with a single
        running sequence (the engine runs it as sequential SD, so the arm would never be
        scored and, untried, it would be picked again and again); plain decoding only while the
        policy check holds it or tries it (:mod:`planner.policy_check`); under sustained
        pressure, not the arms the data never ranks first in this bin (:mod:`planner.pruning`)."""
        self._policy.note_queue(s.queued > 0)     # it stands aside while requests queue
        if self._memory.hold(s, now, self.steps):
            if self._memory.probing:
                # plain decoding to measure, not chosen: its run does not count as the bandit's
                # plain decoding (the offload's plain-decoding road) until the probe is over
                self._ar_since = (self.steps + 1, now)
            return (AR.arm,)
        plain_only, was = self._policy.plain_only(), self._policy_plain
        self._policy_plain = plain_only
        if plain_only:
            return (AR.arm,)      # plain decoding held, or on trial, over a whole stretch
        if was:
            self.bandit.interrupt()   # decide afresh, not by the block the forced plays grew
        base = self._no_psd_arms if s.batch_size < 2 and self.psd_available else None
        prior = self._prior
        kept = self._pruner.allowed(
            ctx, pressure=self._memory.policy.level >= 0.5, alpha=self._acceptance.alpha(),
            demand=s.demand_tok_s, measured=lambda: self.bandit.measured(ctx),
            estimated=lambda: self.bandit.means(ctx),
            prior=(lambda a: prior(ctx, a)) if prior is not None else None, candidates=base)
        if kept is None:
            return base
        if base is None:
            return kept
        return tuple(a for a in kept if a in base) or base

    def observe(self, issued: Decision, outcome: StepOutcome) -> None:
        """Feed back one step: the decision this planner issued for it and the step's outcome
        (:class:`~planner.outcome.StepOutcome`): what actually ran (scored in place of the issued
        decision when it differs, e.g. while the drafter was still reloading), its wall time,
        the tokens it committed over all sequences, the sequences it advanced, and the drafter's
        catch-up / reload times when speculation resumed after a gamma = 0 period, and the time
        the drafter's memory took to move before it (an offload, a reload's pool shrink: no
        arm's cost, taken off). With the
        prefill tokens and the target forward's size and time, the prefill's share of the wall
        time is estimated (:mod:`planner.step_costs`) and not charged to the arm (a step with
        prompts before that line is fitted is counted as played, not measured); a speculative
        step's tokens are scored shrunk towards its gamma's estimated yield
        (:meth:`~planner.acceptance.AcceptanceEstimate.expected_tokens`). A step that
        fed only prompts (``decoded`` false) is no arm's sample (whatever was issued, nothing
        could be drafted, and what is left of its time after the prefill's estimated share is
        noise that would land on plain decoding): only the forward's cost line learns from it.
        The n-gram match counts (whatever ran) are the n-gram arms' prior."""
        o = outcome
        decision = o.ran if o.ran is not None else issued
        if self._policy.enabled:
            self._policy.observe(max(o.step_wall_s - o.memory_s, 0.0), o.tokens_committed,
                                 o.batch_size, decision.speculative, priced=not o.trying_cores)
        self._ngram_matches.observe(o.ngram_matched, o.ngram_compared)
        if o.drafter_reload_s > 0:
            self._switch.observe_reload(o.drafter_reload_s)
            self._drafter.reloaded()
        if not o.decoded:       # only prompts: the forward's cost line learns from it, no arm does
            self.forward_cost.observe(o.forward_tokens, o.forward_s, o.forward_cores)
            return
        ctx = self._ctx
        if ctx is None:        # observe before any decide: bin by the batch size we are given
            ctx = self.bins.context(LoadSignals(batch_size=o.batch_size))
        # A PSD step verifies what was drafted for its sub-batch the step before: at this
        # gamma only if that step ran the same arm.
        psd_drafted_here = decision.mode is Mode.PSD and self._ran_last == decision
        measures_acceptance = ((decision.mode is Mode.SD or psd_drafted_here)
                               and o.batch_size > 0 and o.tokens_committed > 0)
        # Plain steps since the last one issued with the drafter: the first plain_settle_steps
        # are the turn-off's transient (SettledPlain), and a plain step issued as speculation (the
        # drafter away: reloading, restarting) is not plain decoding as the planner would run it;
        # neither the forward's line nor the offload's estimate learns from those.
        drafting = decision.uses_drafter or issued.uses_drafter
        self._plain_run = 0 if drafting else self._plain_run + 1
        settling = decision.mode is Mode.AR and (drafting or self._plain_run <= self.config.plain_settle_steps)
        tokens = o.tokens_committed
        if measures_acceptance:
            tokens = self._acceptance.expected_tokens(decision.gamma, o.tokens_committed, o.batch_size)
        cost = self._loss.measure(
            ctx, self._batch if self._ctx is not None else o.batch_size,
            step_wall_s=max(o.step_wall_s - o.memory_s, 0.0),
            tokens_committed=tokens, drafter_rebuild_s=o.drafter_rebuild_s,
            prefill_tokens=o.prefill_tokens, forward_tokens=o.forward_tokens, forward_s=o.forward_s,
            forward_cores=o.forward_cores, settling=settling)
        # The first plain step after a drafting one carries the turn-off: the switch's cost,
        # not plain decoding's (SwitchCost.turn_off).
        turning_off = (decision.mode is Mode.AR and self._ran_last is not None
                       and self._ran_last.uses_drafter)
        # Likewise the first PSD step after another mode carries the pipeline's fill (its
        # sub-batch drafted in line): the switch's cost, not PSD's (SwitchCost.psd_fill).
        filling = decision.mode is Mode.PSD and (self._ran_last is None or self._ran_last.mode is not Mode.PSD)
        # A step on cores the engine is only trying (its lending choice) is not plain
        # decoding's cost as it runs. Nor is a step whose prompts the forward's line cannot
        # price yet: in an engine's first steps, a prompt fed beside a few drafts can cost
        # several times the step without it, and set its mode's level above plain decoding's
        # for as long as the bounds take to reopen.
        trying = decision.mode is Mode.AR and o.trying_cores
        unpriced = cost.prefill_unpriced
        if cost.loss is not None and decision.arm in self._decisions:
            if turning_off or filling or trying or unpriced:
                self.bandit.count_play(ctx, decision.arm)
            else:
                self.bandit.update(ctx, decision.arm, cost.loss, cost.weight)
        self._ran_last = decision
        if not decision.uses_drafter:       # the drafter falls behind by what this step committed
            self._switch.observe_off(o.tokens_committed)
        if decision.mode is Mode.AR and not trying and not unpriced:
            self._memory.observe_ar(cost.wall_s, cost.tokens, o.forward_cores,
                                    settled_in=None if settling else ctx, loss=cost.loss, weight=cost.weight)
            self._switch.turn_off.observe(cost.wall_s, cost.tokens, first=turning_off)
        elif decision.uses_drafter:
            if decision.mode is Mode.PSD and not unpriced:
                # in committed tokens: the fill step's are not scored, so neither are the others'
                self._switch.psd_fill.observe(cost.wall_s, o.tokens_committed, first=filling)
            # Counting PSD keeps the acceptance (and the pruner's guard on it) measured while
            # the planner plays PSD alone.
            if measures_acceptance:
                self._acceptance.observe_step(decision.gamma, o.tokens_committed, o.batch_size)
            self._switch.observe_on(o.drafter_rebuild_s)

    def _context_moved(self, what: str) -> None:
        """The pruner saw the acceptance (or the demand) move: what the bandit measured of the
        speculative arms under the old acceptance is stale."""
        if what == "alpha":
            self.bandit.refresh()

    def observe_serving(self, seconds: float, responses: int) -> None:
        """One busy step's cost outside its forwards, as the serving path paid it: its
        scheduling and commit and the time from its end to the next step's start (the outputs
        handed to the front end, intake), and the outputs (responses) it emitted. Fitted per
        step and per response (:mod:`planner.serving_cost`), it is added to every step the cost
        model's prior and the offload's gain estimate predict."""
        self.serving_cost.observe(seconds, responses)

    def wants_offload(self, signals: LoadSignals) -> bool:
        """True when plain decoding runs and either it has run for at least
        ``offload_after_steps`` steps and ``offload_after_s`` seconds with memory under pressure
        now, or the memory-aware rule asked for the offload (sustained pressure, and the bigger
        KV pool predicted to pay): the engine may then move the drafter's weights to host memory
        (the planner then counts a reload into the cost of turning speculation back on)."""
        if self._current is None or self._current.speculative or self._ar_since is None:
            return False
        now = signals.now if signals.now is not None else self._clock()
        return self._memory.wants_offload(signals, now, self.steps, self._ar_since)

    def reload_while_idle(self, idle_s: float) -> bool:
        """Asked while the engine has had no request for `idle_s` seconds and its drafter is
        offloaded (an offload in the last step is not yet in any snapshot): should the weights
        come back now (:meth:`MemoryRule.reload_while_idle`)?"""
        self._drafter.report(True)
        return self._memory.reload_while_idle(idle_s)

    def pruned_arms(self, signals: LoadSignals) -> frozenset:
        """The arms set aside in the bin of `signals` while pressure lasts (empty: none)."""
        return self._pruner.pruned(self.bins.context(signals))

    def memory_pressure(self, s: LoadSignals) -> bool:
        """This step's pressure indicator: admission left requests waiting, or the KV pool (or
        GPU) is nearly full."""
        return self._memory.policy.memory_pressure(s)

    def offload_gain(self, s: LoadSignals) -> float | None:
        """The predicted per-token speed-up of an offload now (see
        :meth:`~planner.offload_policy.MemoryRule.estimate`); None when it cannot be told."""
        est = self._memory.estimate(s)
        return est[0] if est is not None else None

    # ------------------------------------------------------------------ estimates

    def alpha_estimate(self) -> float:
        """Per-position acceptance, inverted from tokens committed per sequence in speculative steps."""
        return self._acceptance.alpha()

    def lag_tokens(self) -> int:
        """Tokens the drafter would have to catch up on if turned on now."""
        return self._switch.lag_tokens()

    def estimated_switch_cost_s(self, offloaded: bool | None = None) -> float:
        """Seconds a drafter turn-on would cost now (catch-up + reload if offloaded)."""
        return self._switch.estimate_s(self._drafter.offloaded if offloaded is None else offloaded)

    def _switch_cost(self, a_from: Arm, a_to: Arm) -> float:
        """The bandit's switching cost, in loss units (summed per-token latencies): the
        drafter's catch-up (and reload) when a drafter arm follows one without, the first PSD
        step's extra (the pipeline's fill) when a PSD arm follows one of another mode, and the
        first plain step's extra when plain decoding follows a drafter arm. One value per step
        for every arm (the bandit asks for each)."""
        turn_on, fill, turn_off = self._switch_prices()
        if a_from in self._drafter_arms and a_to == AR.arm:
            return turn_off
        cost = fill if a_to in self._psd_arms and a_from not in self._psd_arms else 0.0
        if a_to in self._drafter_arms and a_from not in self._drafter_arms:
            cost += turn_on
        return cost

    def _switch_prices(self) -> tuple[float, float, float]:
        """This step's turn-on, PSD fill and turn-off prices in loss units, computed once a step
        (they are the same for every arm the bandit weighs)."""
        step, prices = self._prices
        if step != self.steps:
            prices = (self._as_loss(self.estimated_switch_cost_s()),
                      self._as_loss(self._switch.psd_fill.charge_s),
                      self._as_loss(self._switch.turn_off.charge_s))
            self._prices = (self.steps, prices)
        return prices

    def _as_loss(self, seconds: float) -> float:
        """Seconds of one step, in this bin's loss units (summed per-token latencies)."""
        if seconds <= 0:
            return 0.0
        tps = self._loss.tokens_per_step(self._ctx) or float(max(self._batch, 1))
        return seconds / tps * self.bins.norm(self._ctx, self._batch)

    # ------------------------------------------------------------------ reporting

    @property
    def current(self) -> Decision | None:
        """The last decision (None before the first)."""
        return self._current

    @property
    def drafter_offloaded(self) -> bool:
        """Are the drafter's weights in host memory (as the engine reports, or as asked)?"""
        return self._drafter.offloaded

    @property
    def switches(self) -> int:
        """Decisions that changed mode or gamma (cheap: for a per-step gauge)."""
        return self.bandit.switches

    @property
    def offload_policy(self) -> OffloadPolicy:
        """The pressure level and its thresholds (``level``, ``last_gain``)."""
        return self._memory.policy

    def timeline(self) -> list[tuple]:
        """[(t_s since the first decision, step, mode, gamma, batch_size)] at every decision
        change and every ``timeline_every`` steps (thinned to stay under ``timeline_max``)."""
        return self._timeline.entries()

    def summary(self) -> dict:
        """The counters of :meth:`stats`, without the per-bin detail and the timeline: small
        enough for a log line."""
        return {
            "steps": self.steps,
            "held_steps": self.held_steps,
            "switches": self.bandit.switches,
            "mode_switches": self.mode_switches,
            "drafter_turn_ons": self.drafter_turn_ons,
            "offload_requests": self._memory.offload_requests,
            "ar_hold_steps": self._memory.hold_steps,
            "memory": self._memory.summary(),
            "current": str(self._current) if self._current is not None else None,
            "arm_counts": {arm_str(a): n for a, n in self.bandit.arm_counts().items()},
            "switch_cost": self._switch.summary(self._drafter.offloaded),
            "alpha_estimate": self.alpha_estimate(),
            "ngram_alpha_estimate": self._ngram_matches.alpha(),
            "forward_s_per_token": self.forward_cost.seconds_per_token,
            "serving_cost": self.serving_cost.summary(),
            "pruning": self._pruner.summary(),
            "policy_check": self._policy.summary(),
        }

    def stats(self) -> dict:
        """:meth:`summary`, plus the bandit's shift counters, per-bin detail and the timeline."""
        b = self.bandit
        per = {}
        for ctx in b.contexts:
            cs = b.context_stats(ctx)
            per[str(ctx)] = {
                "best": arm_str(cs.best) if cs.best is not None else None,
                "held": arm_str(cs.held) if cs.held is not None else None,
                "steps": cs.steps,
                "shifts": cs.shifts,
                "plays": {arm_str(a): n for a, n in cs.plays.items()},
                "mean_loss": {arm_str(a): m for a, (m, _) in cs.means.items()},
                # what the means are made of: each arm's measurements alone (mean, evidence)
                # and the cost model's prior before the bin's calibration
                "measured_loss": {arm_str(a): [m, n] for a, (m, n) in b.measured(ctx).items()},
                "prior_loss": {arm_str(a): v for a, v in b.raw_prior(ctx).items()},
            }
        return self.summary() | {"shifts": b.shifts, "stale_resets": b.stale_resets,
                                 "policy_check": self._policy.stats(),
                                 "per_context": per, "timeline": self.timeline()}
