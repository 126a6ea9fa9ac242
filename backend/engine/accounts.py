"""The engine's accounts: each step's result added to the running totals, and the snapshot of
engine-wide statistics a front end reads (its metrics, its health, a bench's report)."""
from __future__ import annotations

import time

from backend.engine.outputs import EngineStats
from backend.model.captured import compiled_graphs
from backend.step import Drafting, PassCounts, StepPlan, StepResult, ran


class Accounts:
    def __init__(self):
        self.stats = EngineStats()
        self._prev_busy_end: float | None = None    # end of the last step that left work to do

    def record(self, plan: StepPlan, batch_size: int, counts: PassCounts, drafting: Drafting,
               t_start: float, t_schedule_s: float, still_busy: bool, num_outputs: int = 0) -> StepResult:
        """The step's result, from its plan, the target pass's counts and its drafting; added to
        the totals."""
        t_end = time.perf_counter()
        t_step_s = t_end - t_start
        # From the previous busy step's end: what the caller does with each step's outputs
        # (streaming them out, one message per request) is a cost per step too.
        t_cycle_s = t_end - self._prev_busy_end if self._prev_busy_end is not None else t_step_s
        self._prev_busy_end = t_end if still_busy else None
        result = StepResult(
            **vars(counts), plan=plan, mode=ran(plan, counts.drafted, drafting.overlapped), gamma=plan.gamma,
            batch_size=batch_size, t_schedule_s=t_schedule_s, t_draft_s=drafting.draft_s,
            t_transport_s=drafting.transport_s, t_step_s=t_step_s, t_cycle_s=t_cycle_s,
            overlapped=drafting.overlapped, forward_cores=drafting.forward_cores, num_outputs=num_outputs)
        st = self.stats
        st.steps += 1
        st.last_step = result
        st.drafted_tokens += result.drafted
        st.accepted_tokens += result.accepted
        st.generation_tokens += result.tokens_committed
        st.target_calls += counts.target_calls
        st.decode_tokens += counts.decode_tokens
        per_pos = st.accepted_per_position
        for drafted, accepted in counts.verified:
            if len(per_pos) < drafted:
                per_pos.extend([0] * (drafted - len(per_pos)))
            for pos in range(accepted):
                per_pos[pos] += 1
            st.num_drafts += 1
        return result

    def snapshot(self, engine) -> EngineStats:
        """The totals with the engine's parts' current state filled in."""
        s = self.stats
        scheduler, kv = engine.scheduler, engine.kv
        s.num_running = len(scheduler.running)
        s.num_waiting = len(scheduler.waiting)
        s.kv_total_blocks = kv.num_blocks
        s.kv_free_blocks = kv.num_free_blocks
        s.kv_usage = kv.usage()
        s.mode = engine.plan.mode
        s.gamma = engine.plan.gamma
        s.preemptions = scheduler.num_preemptions
        d = engine.drafter
        if d is not None:
            ps = d.stats()
            s.drafter_kv_usage, s.drafter_state = ps.kv_usage, d.state
            s.drafter_failures, s.drafter_restarts = d.failures, d.restarts
            s.drafter_restart_failures, s.drafter_next_restart_s = d.restart_failures, d.next_restart_in_s
            s.drafter_request_failures = d.request_failures
            s.drafter_catchup_tokens = d.retired.catchup_tokens + ps.catchup_tokens   # every drafter's
            s.drafter_cpu_s = d.retired.cpu_s + ps.cpu_s
            s.draft_ahead = dict(ps.ahead)
        runner = engine.runner     # a tensor-parallel target counts its group's failures
        s.tensor_parallel_failures = getattr(runner, "failures", 0)
        s.tensor_parallel_restarts = getattr(runner, "restarts", 0)
        memory = engine.memory
        if memory is not None:
            s.offloads, s.reloads = memory.offloads, memory.reloads
            s.offload_failures, s.reload_failures = memory.failed_offloads, memory.failed_reloads
        if engine.planner is not None:
            s.planner_switches = engine.planner.switches
        s.compiled_graphs = compiled_graphs()
        c = engine.sub_batches.counters
        s.psd_steps, s.psd_fallback_steps = c.steps, c.fallback_steps
        s.psd_unbalanced_steps, s.psd_overlapped_steps = c.unbalanced_steps, c.overlapped_steps
        return s
