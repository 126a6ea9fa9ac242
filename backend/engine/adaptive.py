"""Mode auto: the engine's side of the planner, once per step.

snapshot (the load, the drafter and the memory as the engine sees them) -> decide (the
planner) -> apply (the step's plan: mode and gamma; lend the drafter's memory to the KV pool,
or take it back) -> observe (after the step: the plan it issued and the step's result: what
actually ran, its time, what it committed). While a bandit block goes on under a quiet load
(nothing waiting, no memory pressure near, the batch in one bin), it continues without the
snapshot (``Planner.steady``).

The planner depends on these measurements only; it never sees the engine, and the engine reads
nothing of the planner but its decisions. Signals from outside the engine (a server's metrics
endpoint) come in through ``extra_signals``, a callable that fills in a snapshot.
"""
from __future__ import annotations

import time
from typing import Callable

from planner import AR, Decision, EngineSignals, LoadSignals, Planner, StepOutcome

from backend.batching.scheduler import Scheduler
from backend.batching.sequence import Sequence
from backend.engine.core_lending import CoreLending
from backend.engine.memory import ElasticMemory
from backend.mode import Mode
from backend.model.kv_cache import PagedKVCache
from backend.speculation.manager import DrafterManager
from backend.speculation.ngram import NgramShadow
from backend.speculation.placement import CpuPlacement
from backend.step import PLAIN, StepPlan, StepResult


class AdaptiveController:
    # Plain-decoding steps in a row before the drafter's CPU cores join the target's forward.
    # Moving them costs a few microseconds (affinity + thread count, measured), so from the first:
    # then the bandit's plain-decoding arm is measured as what it is, the target on every core.
    LEND_AFTER_STEPS = 1

    def __init__(self, planner: Planner, *, scheduler: Scheduler, kv: PagedKVCache,
                 drafter: DrafterManager, memory: ElasticMemory | None, batch_limit: int,
                 extra_signals: Callable[[LoadSignals], LoadSignals] | None = None,
                 placement: CpuPlacement | None = None, lending: CoreLending | None = None,
                 ngram_shadow: NgramShadow | None = None):
        """`placement`: the CPU placement whose drafter cores serve the target while the drafter
        model is idle (None: the cores stay with the drafter); `lending`: whether plain decoding
        takes them, measured (None: it always does). `ngram_shadow`: with an n-gram
        proposer beside the drafter model (the planner's NGRAM arms), what its drafts would
        have matched, measured on every step."""
        self.ngram_shadow = ngram_shadow
        self.planner = planner
        self.placement = placement
        self.lending = lending if placement is not None else None
        self._ar_steps = 0
        self._trying_cores = False     # this step runs on cores the lending choice is trying
        self._lent_before = False      # the placement and ...
        self._drafted_before = False   # ... the kind of the step before this one
        self.scheduler = scheduler
        self.kv = kv
        self.drafter = drafter
        self.memory = memory
        self.batch_limit = batch_limit
        self.extra_signals = extra_signals
        self.signals = EngineSignals(demand_tau_s=planner.config.demand_tau_s)
        self._drafter_paused = False   # the last step drafted nothing: the next drafts catch up
        self._serving: tuple[float, int] | None = None   # the last step's own work and outputs
        self._issued: Decision = AR    # the planner's decision for the step under way
        self._memory_s = 0.0           # the drafter's memory moved for the step under way
        # Steps the planner's last decision stands while the load stays quiet (Planner.steady),
        # and what quiet means for them: (the drafter's state, the KV usage line).
        self._steady_left = 0
        self._steady_load: tuple[str, float] | None = None

    def record_arrival(self, seq: Sequence) -> None:
        self.signals.record_arrivals(1, time.perf_counter(), max_tokens=seq.params.max_tokens)

    def record_finish(self, seq: Sequence) -> None:
        """How much of its budget a request really used."""
        self.signals.demand.finished(seq.num_output_tokens, seq.params.max_tokens)

    def plan(self) -> StepPlan:
        """This step's plan, with the drafter's memory moved as the planner asks."""
        self._memory_s = 0.0
        self._trying_cores = False
        if self._steady_left > 0 and self._load_quiet():
            # The planner's block goes on under a quiet load: the snapshot it would not read is
            # not taken.
            running = self.scheduler.running
            held = self.planner.decide_held(time.perf_counter(), len(running),
                                            self.drafter.lag_tokens(running))
            if held is not None:
                self._steady_left -= 1
                self._issued = held
                return self._apply(held, len(running))
        self._steady_left = 0
        signals = self._snapshot()
        decision = self._issued = self.planner.decide(signals)
        plan = self._apply(decision, signals.batch_size, signals)
        if self.extra_signals is None and not self._memory_s:
            # (a server's signals can move while the engine's load does not: decide every step)
            self._steady_left, kv_below = self.planner.steady(signals)
            self._steady_load = (self.drafter.state, kv_below)
        return plan

    def _apply(self, decision: Decision, batch_size: int, signals: LoadSignals | None = None) -> StepPlan:
        """The plan that runs `decision` with `batch_size` sequences running: the cores placed,
        the drafter's memory moved where the decision needs it. `signals`: the snapshot it was
        decided on (None for a held step, whose quiet load asks for no offload)."""
        mem = self.memory
        if decision.mode is Mode.NGRAM:
            self._lend_cores()               # n-gram drafts need no drafter model
            return StepPlan(decision.mode, decision.gamma)
        if decision.gamma > 0 and not self._any_decoding():
            # Only prompts this step: there is nothing to draft (the drafter takes the prompts
            # in its catch-up when it drafts), and the prefill runs on every core.
            self._lend_cores()
            return PLAIN
        if decision.gamma > 0:
            self._ar_steps = 0
            if self.placement is not None:
                self.placement.take_back_drafter_cores()
            if self.drafter.offloaded and mem is not None:
                self._move_memory(mem.start_reload)   # decode plainly until the weights are back
            if not self.drafter.available:
                return PLAIN
            return StepPlan(decision.mode, decision.gamma)
        if (signals is not None and mem is not None and self.drafter.available
                and self.planner.wants_offload(signals)):
            self._move_memory(mem.offload)
        self._lend_cores(batch_size if self._any_decoding() else None)
        return PLAIN

    def _load_quiet(self) -> bool:
        """Is the load still as quiet as when the planner granted its steady steps: nothing
        waiting, the drafter where it was, the KV pool under the line? (The batch's bin is the
        planner's to check.)"""
        drafter_state, kv_below = self._steady_load
        return not self.scheduler.waiting and self.drafter.state == drafter_state and self.kv.usage() < kv_below

    def _move_memory(self, move) -> None:
        """Offload the drafter (the KV pool grows) or start its reload (the pool shrinks back),
        timed: the step it comes before pays it, and it is that step's arm's cost no more than
        a switch is (a resize copies the KV pool: at a large pool, many plain steps' time)."""
        t0 = time.perf_counter()
        move()
        self._memory_s += time.perf_counter() - t0

    def reload_pending_while_idle(self) -> bool:
        """Are the drafter's weights off the device, to come back while the engine is idle?"""
        return self.memory is not None and self.drafter.state == "offloaded"

    def idle(self, idle_s: float) -> None:
        """No request for `idle_s` seconds: bring the drafter back if the planner says so."""
        if self.reload_pending_while_idle() and self.planner.reload_while_idle(idle_s):
            self.memory.start_reload()

    def _any_decoding(self) -> bool:
        """Will a running sequence decode this step (one pending token), so it could be drafted for?"""
        return any(seq.num_uncomputed == 1 for seq in self.scheduler.running)

    def _lend_cores(self, decoding_batch: int | None = None) -> None:
        """Before a step that drafts nothing. A plain-decoding step (`decoding_batch`: its
        sequences) takes the drafter's cores where lending measures faster (`lending`), and
        otherwise keeps its own threads, unpinned (`CpuPlacement.open_drafter_cores`); a step
        that only prefills or drafts by n-grams always lends."""
        self._ar_steps += 1
        if self.placement is None or self._ar_steps < self.LEND_AFTER_STEPS:
            return
        lend = decoding_batch is None or self.lending is None or self.lending.lend(decoding_batch)
        if lend:
            self.placement.lend_drafter_cores()
        else:
            self.placement.open_drafter_cores()
        self._trying_cores = (decoding_batch is not None and self.lending is not None
                              and lend != self.lending.keeps(decoding_batch))

    def _observe_lending(self, step: StepResult) -> None:
        """A plain-decoding step's cost, on the placement it ran on, for the lending choice:
        not one that fed a prompt, borrowed the cores for a big forward, followed drafting (the
        turn-off's cost) or changed the placement (the first step on new threads)."""
        lent = self.placement is not None and self.placement.lent
        if (self.lending is not None and step.mode is Mode.AR and not step.drafted and step.decoded
                and step.num_prefill_tokens == 0 and not step.forward_cores and not self._drafted_before
                and lent == self._lent_before):
            self.lending.observe(lent, step.batch_size, step.t_cycle_s, step.tokens_committed)
        self._lent_before, self._drafted_before = lent, step.drafted > 0

    def _snapshot(self) -> LoadSignals:
        mem = self.memory
        signals = self.signals.snapshot(
            batch_size=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            left_waiting=self.scheduler.num_left_waiting,
            kv_usage=self.kv.usage(), now=time.perf_counter(),
            waiting_tokens=round(self.signals.demand.used_share * sum(
                q.params.max_tokens - q.num_output_tokens for q in self.scheduler.waiting)),
            drafter_lag_tokens=self.drafter.lag_tokens(self.scheduler.running),
            drafter_offloaded=self.drafter.offloaded, batch_limit=self.batch_limit,
            kv_growth_if_offloaded=mem.growth_if_offloaded() if mem is not None else None,
            kv_usage_at_base=mem.usage_at_base() if mem is not None else None)
        return self.extra_signals(signals) if self.extra_signals is not None else signals

    def observe(self, plan: StepPlan, step: StepResult, reload_s: float | None) -> None:
        """After the step: `plan`, what this controller issued (as the engine ran it), and the
        step's result."""
        self._observe_serving(step)
        self._observe_lending(step)
        rebuild_s = 0.0
        if step.drafted and step.mode.uses_drafter:
            if self._drafter_paused:       # the drafter model's first drafts after a pause: the catch-up's cost
                rebuild_s = self.drafter.stats().last_catchup_s
            self._drafter_paused = False
        else:
            # Sequences decoded without it, or prompts fed with nothing decoding (an idle engine
            # woken): either way it falls behind. After an idle engine the planner takes plain
            # decoding as current and prices speculating on the new prompts as a turn-on, their
            # catch-up; reported as one, it is taken off the first drafting step's loss and
            # measured for that price. Left in, it was charged twice, and through the server at
            # concurrency 1, where every request starts an idle engine, one such step (a 4-token
            # warm-up request's only speculative one) ranked speculation last for good.
            self._drafter_paused = True
        # What actually ran, where it is not what was issued: no drafts verified (the drafter on
        # its way back, or nothing proposed) is plain decoding. Batch-parallel SD that drafted in
        # line (a sequence with nothing drafted for it, the other sub-batch with nothing to draft)
        # is PSD's own cost: a fixed PSD run pays those steps too, and scored to SD they left
        # PSD's mean about a tenth of its time short at batch 4 (a 2 ms token against 0.53:
        # benchmarks/results/promise-e1907d3/levels-ab/trace-c4/).
        issued = self._issued
        if not step.drafted:
            ran = AR
        elif plan.gamma == issued.gamma and (step.mode is issued.mode
                                             or (issued.mode is Mode.PSD and step.mode is Mode.SD)):
            ran = issued
        else:
            ran = Decision(step.mode, plan.gamma)
        matched, compared = (self.ngram_shadow.observe(self.scheduler.running)
                             if self.ngram_shadow is not None else (0, 0))
        self.planner.observe(issued, StepOutcome(
            step_wall_s=step.t_cycle_s, tokens_committed=step.tokens_committed, batch_size=step.batch_size,
            ran=ran if ran != issued else None, drafter_rebuild_s=rebuild_s,
            drafter_reload_s=reload_s or 0.0, memory_s=self._memory_s,
            prefill_tokens=step.num_prefill_tokens - step.num_recompute_tokens,
            forward_tokens=step.num_forward_tokens, forward_s=step.t_forward_s,
            forward_cores=step.forward_cores or (self.placement.target_cores_now() if self.placement is not None else 0),
            ngram_matched=matched, ngram_compared=compared, decoded=step.decoded,
            trying_cores=self._trying_cores and not step.forward_cores))

    def _observe_serving(self, step: StepResult) -> None:
        """The previous step's cost outside its forwards, now that it is complete: its
        scheduling and commit, and the gap from its end to this step's start (its outputs handed
        to the front end, intake, the loop's own work), against the outputs it emitted. A gap
        after idling is not its cost, and that step is not counted."""
        gap = step.t_cycle_s - step.t_step_s
        if self._serving is not None and gap > 0:
            own_s, outputs = self._serving
            self.planner.observe_serving(own_s + gap, outputs)
        # (the drafter's memory moved while scheduling is no serving cost: see _move_memory)
        self._serving = (max(step.t_schedule_s - self._memory_s, 0.0) + step.t_commit_s, step.num_outputs)
