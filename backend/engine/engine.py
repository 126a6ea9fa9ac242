"""The engine: continuous batching over a paged KV cache, with lossless speculative decoding.

One `step()` reads like the algorithm: plan -> schedule -> propose -> forward -> verify ->
commit. Each step runs one frozen plan (:mod:`backend.step`: the mode and gamma) from the fixed
configuration or, in mode auto, the adaptive controller; the plan's mode names the strategy
(:mod:`backend.speculation.strategies`: plain decoding, sequential SD, batch-parallel SD), and
the step's result (tokens, counts, timings) goes to the accounts and the planner.

`add_request` (= `enqueue(prepare(...))`) and `abort` may be called from any thread; `step` from
one thread only. `prepare` (validation, tokenization) touches no engine state, so a front end can
run it outside any lock it holds.

A failure inside a batched step does not spread: a forward that raises is retried on each half of
the batch until the request(s) that fail alone are found (:mod:`backend.engine.forward`);
verification and commit run per request; the drafter's faults are the drafter manager's. Requests at fault finish with
``finish_reason="error"``; every other request's output is what it would have been alone.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch

from planner import LoadSignals, Planner, PlannerConfig

from backend.batching.scheduler import Scheduler
from backend.batching.sequence import Sequence
from backend.engine.accounts import Accounts
from backend.engine.adaptive import AdaptiveController
from backend.engine.calibration import planner_cost_profile
from backend.engine.config import EngineConfig
from backend.engine.core_lending import MEASURED, CoreLending
from backend.engine.forward import TargetPass
from backend.engine.intake import Intake, Limits, context_limit
from backend.engine.memory import ElasticMemory
from backend.engine.offline import Completion, generate
from backend.engine.outputs import EngineStats, RequestOutput
from backend.engine.prompt_limit import default_max_prompt_bytes
from backend.engine.requests import Requests
from backend.engine.step_trace import StepTrace
from backend.mode import Mode, ProposerKind
from backend.model.kv_cache import PagedKVCache
from backend.model.linear import add_thread_verdicts
from backend.model.parallel import build_target_runner
from backend.model.tokenizer import Tokenizer
from backend.sampling.params import SamplingParams
from backend.speculation.manager import DrafterManager
from backend.speculation.ngram import NgramShadow
from backend.speculation.placement import CpuPlacement
from backend.speculation.strategies import build_strategies
from backend.speculation.sub_batches import SubBatches
from backend.step import PLAIN, Drafting, StepPlan, PassCounts

log = logging.getLogger("nightdraft.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["Completion", "Engine"]


class Engine:
    def __init__(self, config: EngineConfig,
                 extra_signals: Callable[[LoadSignals], LoadSignals] | None = None):
        """`extra_signals` (mode auto): fills in what the engine cannot see itself (a server's
        metrics) in each load snapshot the planner gets."""
        self.config = config
        self._placement = CpuPlacement.for_config(config.drafter_device, config.num_threads)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]

        # One device, or a tensor-parallel group whose driver this process is (backend.model.parallel).
        self.runner = build_target_runner(config, self.dtype)
        self.target, self.kv = self.runner.model, self.runner.kv
        if (self._placement is not None and config.tensor_parallel_size == 1
                and config.linear_kernels == "auto"):
            # Forwards on the drafter's lent or borrowed cores run on more threads than the target
            # was built at: its kernels' verdicts for that count (prompts, a big forward, any step
            # run op by op), made now on those cores, before the worker starts there. (Its
            # compiled step needs nothing more: one graph serves every thread count,
            # backend/model/captured.py.)
            with self._placement.borrowing():
                add_thread_verdicts(self.target)
        mc = self.target.config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.target, eos_token_ids=mc.eos_token_ids)
        self.max_model_len = context_limit(config.max_model_len, mc.max_position_embeddings,
                                           self.kv.num_blocks, self.kv.block_size)
        # Longer text is refused before it is tokenized (see prompt_limit).
        self.max_prompt_bytes = config.max_prompt_bytes or \
            default_max_prompt_bytes(self.max_model_len, self.tokenizer.max_token_bytes)
        self.intake = Intake(self.tokenizer, Limits(
            vocab_size=mc.vocab_size, max_model_len=self.max_model_len, max_prompt_bytes=self.max_prompt_bytes,
            max_waiting=config.max_waiting, max_waiting_bytes=config.max_waiting_bytes), self.device)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.drafter = self._load_drafter(config) \
            if config.drafter is not None or config.proposer is ProposerKind.NGRAM else None
        # proposer "both": an n-gram proposer beside the drafter model, for mode auto to choose
        self.ngram = self._load_drafter(config.ngram_only()) if config.proposer is ProposerKind.BOTH else None
        # Elastic memory lends a drafter model's bytes; an n-gram proposer holds none.
        self.memory = None
        if config.drafter is not None and config.offload:
            weights = sum(p.numel() * p.element_size() for p in self.target.parameters())
            self.memory = ElasticMemory(self.kv, self.drafter, self.scheduler,
                                        PagedKVCache.bytes_per_block(mc, config.block_size, self.dtype), weights)

        # The plan steps run until told otherwise: the configured mode and gamma (mode auto
        # starts from SD; its controller issues a plan every step).
        self._fixed_mode = Mode.SD if config.mode is Mode.AUTO else config.mode
        self.plan: StepPlan = PLAIN
        self.set_gamma(config.gamma if config.mode is not Mode.AR else 0)
        self.sub_batches = SubBatches()
        lending = self._placement if config.lend_drafter_cores is not False else None
        captured = getattr(self.runner, "captured", None)
        self._strategies = build_strategies(self.drafter, self.ngram, self.max_model_len, self.sub_batches,
                                            config.draft_ahead, lending,
                                            captured.max_query_len if captured is not None else 0)
        self._strategy = self._strategies[Mode.AR]
        self.adaptive: AdaptiveController | None = None
        if config.mode is Mode.AUTO:
            planner = Planner(PlannerConfig.from_dict(config.planner), gamma_max=config.gamma_max,
                              psd_available=self.drafter.remote, seed=config.seed,
                              ngram_available=self.ngram is not None,
                              cost_profile=planner_cost_profile(config, self.runner, self.dtype, lending))
            shadow = (NgramShadow(config.gamma_max, config.ngram_min, config.ngram_max)
                      if self.ngram is not None else None)
            self.adaptive = AdaptiveController(planner, scheduler=self.scheduler, kv=self.kv,
                                               drafter=self.drafter, memory=self.memory,
                                               batch_limit=config.max_num_seqs, extra_signals=extra_signals,
                                               placement=lending, ngram_shadow=shadow,
                                               lending=CoreLending() if config.lend_drafter_cores == MEASURED else None)
        self._accounts = Accounts()
        proposers = [p for p in (self.drafter, self.ngram) if p is not None]
        # A preempted sequence gives its blocks back to the target's pool, which admits others
        # in its place; a drafter that kept its copy would be short of room for those (its pool
        # holds as many tokens as the target's) and stop drafting for some of them. It re-reads
        # the sequence when it runs again, as after any resync.
        def forget_preempted(seq_id: str) -> None:
            for p in proposers:
                p.free(seq_id)
        self.scheduler.on_preempt = forget_preempted
        self.requests = Requests(
            self.intake, self.scheduler, self._accounts.stats,
            forget=[s.forget for s in self._strategies.values()] + [p.free for p in proposers],
            on_arrival=self.adaptive.record_arrival if self.adaptive is not None else None)
        # forward -> verify -> commit
        self.target_pass = TargetPass(self.runner, self.kv, self.requests, self.tokenizer,
                                      self.max_model_len,
                                      on_finish=self.adaptive.record_finish if self.adaptive is not None else None)
        self._reload_s: float | None = None         # a reload's duration, not yet reported
        self._last_work_at = time.perf_counter()     # the end of the last step that had work
        self._trace = StepTrace.from_env()           # NIGHTDRAFT_STEP_TRACE: every step, to a file
        if self._placement is not None:     # each step pins the thread that runs it, not this one
            self._placement.release_thread()

    def _load_drafter(self, config: EngineConfig) -> DrafterManager:
        return DrafterManager.for_target(config, self.target.config, self.kv.num_blocks, self.dtype,
                                         cores=self._placement.drafter_cores if self._placement else None)

    @property
    def planner(self) -> Planner | None:
        return self.adaptive.planner if self.adaptive is not None else None

    @property
    def gamma(self) -> int:
        return self.plan.gamma

    def close(self) -> None:
        """Stop the drafter worker; give the process its cores back. Unusable afterwards."""
        for proposer in (self.drafter, self.ngram):
            if proposer is not None:
                proposer.close()
        self.runner.close()
        if self._trace is not None:
            self._trace.flush()
        if self._placement is not None:
            self._placement.restore()

    # ---- the public, thread-safe side ------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.enqueue(self.prepare(request_id, prompt, params))

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validate and tokenize (InvalidRequest says what is wrong); any thread, no lock."""
        return self.intake.prepare(request_id, prompt, params)

    def enqueue(self, seq: Sequence) -> None:
        """Admit a prepared request (ServerBusy when the queue is full)."""
        self.intake.enqueue(seq)

    def abort(self, request_id: str) -> None:
        self.intake.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.intake.has_unfinished()

    def set_gamma(self, gamma: int) -> None:
        """Speculation length for the coming steps (0 = plain decoding). In mode auto the
        planner sets it every step, overriding this."""
        if not 0 <= gamma <= self.config.gamma_max:
            raise ValueError(f"gamma must be in [0, {self.config.gamma_max}]")
        speculates = gamma and self.drafter is not None and self._fixed_mode is not Mode.AR
        self.plan = StepPlan(self._fixed_mode, gamma) if speculates else PLAIN

    def stats(self) -> EngineStats:
        return self._accounts.snapshot(self)

    def background_pending(self) -> bool:
        """Is the drafter's weights' return, or a replacement drafter's start, or the target's
        tensor-parallel group's restart under way, or (mode auto) are the drafter's weights off
        the device, to come back while idle? Only :meth:`poll_background` does the drafter's,
        so an idle loop must keep calling that; and when none is left, the loop's hook reports
        the engine's state as it is now."""
        if self.drafter is not None and self.drafter.state in ("reloading", "restarting"):
            return True
        if getattr(self.runner, "down_reason", None) is not None:
            return True
        return self.adaptive is not None and self.adaptive.reload_pending_while_idle()

    def poll_background(self) -> None:
        """For an idle loop: while no request runs or waits, start the offloaded drafter's
        return when the planner says so; then take in what finished outside the steps."""
        if self.adaptive is not None and not self.has_unfinished():
            self.adaptive.idle(time.perf_counter() - self._last_work_at)
        self._take_in_background()

    def _take_in_background(self) -> None:
        """A replacement drafter after a failure, the drafter's weights back on the device (its
        seconds reported with the next busy step). Every step does this first."""
        if self.drafter is not None:
            self.drafter.poll()
        if self.memory is not None:
            self._reload_s = self.memory.poll() or self._reload_s

    # ---- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self.requests.admit()
        self._take_in_background()
        if not self.scheduler.has_work():
            return outputs
        reload_s, self._reload_s = self._reload_s, None     # reported with the next busy step
        if self._placement is not None:
            self._placement.place()                            # this thread on the target's cores
        plan = self._next_plan()                               # plan
        strategy = self._strategy_for(plan)
        batch = strategy.schedule(self.scheduler, plan)        # schedule
        if self.intake.any_queued:
            self.intake.started([s.seq.request_id for s in batch])
        if not batch:
            return outputs + self.requests.fail_unfittable()
        t_schedule_s = time.perf_counter() - t0
        drafting = strategy.propose(batch, plan)               # propose
        counts = PassCounts()                                  # forward -> verify -> commit
        committed, side = strategy.alongside(plan, lambda: self.target_pass(batch, counts))
        result = self._accounts.record(plan, len(batch), counts, drafting + side, t0, t_schedule_s,
                                       still_busy=self.scheduler.has_work(),
                                       num_outputs=len(outputs) + len(committed))
        if self.adaptive is not None:
            self.adaptive.observe(plan, result, reload_s)
        if self._trace is not None:
            self._trace.record(result, self._placement)
        self._last_work_at = time.perf_counter()
        return outputs + committed

    def _next_plan(self) -> StepPlan:
        """This step's plan: the planner's in mode auto, else the configured one; plain decoding
        while there is no drafter to propose, and sequential SD while the drafter cannot run
        beside the target."""
        if self.adaptive is not None:
            self.plan = self.adaptive.plan()
        plan = self.plan
        if plan.mode is Mode.AR or self.drafter is None:
            return PLAIN
        if plan.mode is Mode.PSD and not self.drafter.available:
            return StepPlan(Mode.SD, plan.gamma)
        return plan

    def _strategy_for(self, plan: StepPlan):
        strategy = self._strategies[plan.mode]
        if strategy is not self._strategy:
            self._strategy.reset()
            self._strategy = strategy
        return strategy

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams],
                 on_step: Callable[[list[RequestOutput]], None] | None = None,
                 max_concurrency: int | None = None) -> list[Completion]:
        """Run prompts to completion in this thread (see backend.engine.offline)."""
        return generate(self, prompts, params, on_step=on_step, max_concurrency=max_concurrency)
