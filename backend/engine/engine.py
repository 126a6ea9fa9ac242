"""The engine: continuous batching over a paged KV cache, with lossless speculative decoding.

One `step()` reads like the algorithm: schedule -> propose -> forward -> verify -> commit. How
it speculates is the step's strategy (:mod:`backend.speculation.strategies`: plain decoding,
sequential SD, batch-parallel SD); in mode auto the adaptive controller picks it every step.

`add_request` (= `enqueue(prepare(...))`) and `abort` may be called from any thread; `step` from
one thread only. `prepare` (validation, tokenization) touches no engine state, so a front end can
run it outside any lock it holds.

A failure inside a batched step does not spread: a forward that raises is retried on each half of
the batch until the request(s) that fail alone are found; verification and commit run per
request; the drafter's faults are the drafter manager's. Requests at fault finish with
``finish_reason="error"``; every other request's output is what it would have been alone.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch

from planner import LoadSignals, Planner, PlannerConfig

from backend.batching.scheduler import ScheduledSeq, Scheduler
from backend.batching.sequence import Sequence
from backend.engine.adaptive import AdaptiveController
from backend.engine.calibration import planner_cost_profile
from backend.engine.commit import commit_tokens, output_of
from backend.engine.config import EngineConfig
from backend.engine.intake import Intake, Limits, context_limit
from backend.engine.memory import ElasticMemory
from backend.engine.offline import Completion, generate
from backend.engine.outputs import EngineStats, RequestOutput, StepStats
from backend.engine.prompt_limit import default_max_prompt_bytes
from backend.engine.verify import decide, score_prompts
from backend.model.kv_cache import PagedKVCache
from backend.model.parallel import build_target_runner
from backend.model.tokenizer import Tokenizer
from backend.sampling.params import SamplingParams
from backend.speculation.manager import DrafterManager
from backend.speculation.ngram import NgramShadow
from backend.speculation.placement import CpuPlacement
from backend.speculation.strategies import DraftLength, build_strategies
from backend.speculation.sub_batches import SubBatches

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
        self.drafter = self._load_drafter(config) if config.drafter is not None or config.proposer == "ngram" else None
        # proposer "both": an n-gram proposer beside the drafter model, for mode auto to choose
        self.ngram = self._load_drafter(config.ngram_only()) if config.proposer == "both" else None
        # Elastic memory lends a drafter model's bytes; an n-gram proposer holds none.
        self.memory = self._init_memory() if config.drafter is not None and config.offload else None

        self.mode = config.mode                 # as configured: ar | sd | psd | auto
        self.active_mode = "sd" if config.mode == "auto" else config.mode   # what steps run now
        self._lengths = DraftLength(config.gamma if config.mode != "ar" else 0, self.max_model_len)
        self.sub_batches = SubBatches()
        self._strategies = build_strategies(self.drafter, self.ngram, self._lengths, self.sub_batches,
                                            config.draft_ahead)
        self._strategy = self._strategies["ar"]
        self.adaptive: AdaptiveController | None = None
        if config.mode == "auto":
            lending = self._placement if config.lend_drafter_cores else None
            planner = Planner(PlannerConfig.from_dict(config.planner), gamma_max=config.gamma_max,
                              psd_available=self.drafter.remote, seed=config.seed,
                              ngram_available=self.ngram is not None,
                              cost_profile=planner_cost_profile(config, self.runner, self.dtype, lending))
            shadow = (NgramShadow(config.gamma_max, config.ngram_min, config.ngram_max)
                      if self.ngram is not None else None)
            self.adaptive = AdaptiveController(planner, scheduler=self.scheduler, kv=self.kv,
                                               drafter=self.drafter, memory=self.memory,
                                               batch_limit=config.max_num_seqs, extra_signals=extra_signals,
                                               placement=lending, ngram_shadow=shadow)
        self._seqs: dict[str, Sequence] = {}  # ids the step thread knows about
        self._stats = EngineStats()
        self._prev_busy_end: float | None = None    # end of the last step that left work to do
        self._reload_s: float | None = None         # a reload's duration, not yet reported

    def _load_drafter(self, config: EngineConfig) -> DrafterManager:
        return DrafterManager.for_target(config, self.target.config, self.kv.num_blocks, self.dtype,
                                         cores=self._placement.drafter_cores if self._placement else None)

    def _init_memory(self) -> ElasticMemory:
        """Elastic memory (mode auto's planner drives it; in fixed modes it stays idle unless
        an operator or a test calls it)."""
        mc = self.target.config
        weights = sum(p.numel() * p.element_size() for p in self.target.parameters())
        return ElasticMemory(self.kv, self.drafter, self.scheduler,
                             PagedKVCache.bytes_per_block(mc, self.config.block_size, self.dtype), weights)

    @property
    def planner(self) -> Planner | None:
        return self.adaptive.planner if self.adaptive is not None else None

    @property
    def gamma(self) -> int:
        return self._lengths.gamma

    def close(self) -> None:
        """Stop the drafter worker; give the process its cores back. Unusable afterwards."""
        for proposer in (self.drafter, self.ngram):
            if proposer is not None:
                proposer.close()
        self.runner.close()
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
        """Speculation length for the coming steps (0 = plain decoding). With mode "auto" the
        planner sets it every step, overriding this."""
        if not 0 <= gamma <= self.config.gamma_max:
            raise ValueError(f"gamma must be in [0, {self.config.gamma_max}]")
        self._lengths.gamma = gamma if self.drafter is not None else 0

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.kv_total_blocks = self.kv.num_blocks
        s.kv_free_blocks = self.kv.num_free_blocks
        s.kv_usage = self.kv.usage()
        s.mode = self.active_mode if self.gamma else "ar"
        s.gamma = self.gamma
        s.preemptions = self.scheduler.num_preemptions
        d = self.drafter
        if d is not None:
            s.drafter_kv_usage, s.drafter_state = d.kv_usage, d.state
            s.drafter_failures, s.drafter_restarts = d.failures, d.restarts
            s.drafter_restart_failures, s.drafter_next_restart_s = d.restart_failures, d.next_restart_in_s
            s.drafter_request_failures, s.drafter_catchup_tokens = d.request_failures, d.catchup_tokens
            s.draft_ahead = d.ahead_summary()
        if self.memory is not None:
            s.offloads, s.reloads = self.memory.offloads, self.memory.reloads
            s.offload_failures, s.reload_failures = self.memory.failed_offloads, self.memory.failed_reloads
        if self.planner is not None:
            s.planner_switches = self.planner.switches
        c = self.sub_batches.counters
        s.psd_steps, s.psd_fallback_steps = c.steps, c.fallback_steps
        s.psd_unbalanced_steps, s.psd_overlapped_steps = c.unbalanced_steps, c.overlapped_steps
        return s

    # ---- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._admit()
        self._poll_drafter()
        if not self.scheduler.has_work():
            return outputs
        reload_s, self._reload_s = self._reload_s, None     # reported with the next busy step
        strategy = self._choose_strategy()

        batch = strategy.schedule(self.scheduler)
        if self.intake.any_queued:
            self.intake.started([s.seq.request_id for s in batch])
        if not batch:
            return outputs + self._fail_unfittable()
        step = StepStats(gamma=self.gamma, batch_size=len(batch), t_schedule_s=time.perf_counter() - t0)
        strategy.propose(batch, step)
        with strategy.overlap(step):
            t1 = time.perf_counter()
            outputs += self._run(batch, step)           # forward -> verify -> commit
            step.t_verify_s = time.perf_counter() - t1
        step.num_outputs = len(outputs)
        self._account(step, t0, reload_s)
        return outputs

    def _choose_strategy(self):
        """This step's strategy: the planner's choice in mode auto, else the configured mode's
        (plain decoding while there is no drafter to propose)."""
        if self.adaptive is not None:
            self.active_mode, self._lengths.gamma = self.adaptive.plan()
        mode = self.active_mode if self.gamma and self.drafter is not None else "ar"
        if mode == "psd" and not self.drafter.available:
            mode = "sd"
        strategy = self._strategies[mode]
        if strategy is not self._strategy:
            self._strategy.reset()
            self._strategy = strategy
        return strategy

    def _poll_drafter(self) -> None:
        if self.drafter is not None:
            self.drafter.poll()          # a replacement after a failure comes in here
        if self.memory is not None:      # (also while idle: weights may arrive meanwhile)
            self._reload_s = self.memory.poll() or self._reload_s

    def _account(self, step: StepStats, t0: float, reload_s: float | None) -> None:
        step.mode = "psd" if step.overlapped else \
            ("ngram" if self._strategy.name == "ngram" else "sd") if step.drafted else "ar"
        t_end = time.perf_counter()
        step.t_step_s = t_end - t0
        # From the previous busy step's end: what the caller does with each step's outputs
        # (streaming them out, one message per request) is a cost per step too.
        step.t_cycle_s = t_end - self._prev_busy_end if self._prev_busy_end is not None else step.t_step_s
        self._prev_busy_end = t_end if self.scheduler.has_work() else None
        st = self._stats
        st.steps += 1
        st.last_step = step
        st.drafted_tokens += step.drafted
        st.accepted_tokens += step.accepted
        st.generation_tokens += step.tokens_committed
        if self.adaptive is not None:
            self.adaptive.observe(step, self.gamma, reload_s)

    def _run(self, batch: list[ScheduledSeq], step: StepStats) -> list[RequestOutput]:
        """Forward, verify and commit `batch`. A forward that raises is retried on each half,
        down to the single request(s) that fail alone: they finish with an error."""
        try:
            logits, rows = self._forward(batch, step)
        except Exception as e:  # noqa: BLE001 - isolate the request(s) at fault
            if len(batch) == 1:
                log.error("request %s: the target forward failed: %s", batch[0].seq.request_id, e)
                return [self._fail(batch[0].seq, f"the forward pass failed: {type(e).__name__}: {e}")]
            log.warning("a forward over %d sequences failed (%s: %s); retrying in halves",
                        len(batch), type(e).__name__, e)
            half = len(batch) // 2
            return self._run(batch[:half], step) + self._run(batch[half:], step)
        t0 = time.perf_counter()
        decisions = decide(batch, rows, logits, self.tokenizer.eos_token_ids)
        t1 = time.perf_counter()
        outputs = [out for s, d in zip(batch, decisions) if (out := self._commit(s, d, step)) is not None]
        step.t_decide_s += t1 - t0
        step.t_commit_s += time.perf_counter() - t1
        return outputs

    def _forward(self, batch: list[ScheduledSeq], step: StepStats):
        """One forward over every scheduled sequence; logits only where tokens are decided (and
        at the prompt positions of requests that ask for prompt_logprobs, which are scored here).
        (On CUDA the forward is asynchronous: t_forward_s times its launch, and the wait for it
        falls into verification, which reads the logits.)"""
        t0 = time.perf_counter()
        input_ids: list[int] = []
        num_new: list[int] = []
        rows: list[tuple[int, int]] = []     # per scheduled seq: (first logits row, row count)
        logits_indices: list[int] = []
        scored: list[tuple[Sequence, int, int]] = []   # (seq, first prompt position, count)
        scored_indices: list[int] = []
        for s in batch:
            seq = s.seq
            fed = seq.token_ids[seq.num_computed:seq.num_computed + s.num_new]
            if s.gamma:
                fed = fed + s.drafts
            start = len(input_ids)
            input_ids += fed
            num_new.append(len(fed))
            if s.completes:
                rows.append((len(logits_indices), s.gamma + 1))
                logits_indices += range(start + len(fed) - s.gamma - 1, start + len(fed))
            else:
                rows.append((len(logits_indices), 0))
            if seq.prompt_logprobs is not None:
                # Positions p whose next token is a prompt token not scored yet (a preempted
                # request's recompute scores nothing twice).
                first = max(seq.num_computed, len(seq.prompt_logprobs) - 1)
                end = min(seq.num_computed + s.num_new, seq.num_prompt_tokens - 1)
                if end > first:
                    scored.append((seq, first, end - first))
                    scored_indices += range(start + first - seq.num_computed, start + end - seq.num_computed)
        t1 = time.perf_counter()
        cached = [s.seq.num_computed for s in batch]
        logits = self.runner.forward([s.seq.request_id for s in batch], cached, num_new, input_ids,
                                     logits_indices + scored_indices)
        prepare = t1 - t0 + self.runner.last_prepare_s
        step.t_prepare_s += prepare
        step.t_forward_s += time.perf_counter() - t0 - prepare
        step.num_forward_tokens += len(input_ids)
        step.num_context_tokens += sum(cached) + len(input_ids)
        if scored:
            score_prompts(scored, logits[len(logits_indices):])
            logits = logits[:len(logits_indices)]
        return logits, rows

    def _commit(self, s: ScheduledSeq, decided, step: StepStats) -> RequestOutput | None:
        """Commit one sequence's decided tokens (or fail it with the error that stopped it)."""
        seq = s.seq
        if s.num_new > 1 or not s.completes:   # (asked before num_computed moves on)
            step.num_prefill_tokens += s.num_new
            if seq.num_preemptions:        # recomputing what a preemption threw away
                step.num_recompute_tokens += s.num_new
        seq.num_computed += s.num_new
        if decided is None:
            return None
        if isinstance(decided, Exception):
            log.error("request %s failed in sampling/verification: %s", seq.request_id, decided)
            return self._fail(seq, f"sampling failed: {type(decided).__name__}: {decided}")
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        tokens = decided.tokens
        committed, reason = commit_tokens(seq, tokens, self.tokenizer.eos_token_ids, self.max_model_len)
        # K/V of rejected drafts (and of the last token, the next input) is not kept.
        seq.num_computed = len(seq) - 1
        if reason:
            self._finish(seq, reason)
            if self.adaptive is not None:      # how much of its budget a request really used
                self.adaptive.record_finish(seq.num_output_tokens, seq.params.max_tokens)
        else:
            self.kv.truncate(seq.request_id, seq.num_computed)
        if s.gamma:
            self._count_drafts(seq, s.gamma, decided.accepted, step)
        if s.num_new == 1:            # a decode/verify call (prefill's first token excluded)
            step.target_calls += 1
            self._stats.target_calls += 1
            self._stats.decode_tokens += len(tokens)
        step.tokens_committed += len(tokens)
        logprobs = decided.logprobs[:len(committed)] if decided.logprobs is not None else None
        if logprobs is not None:
            seq.cumulative_logprob += sum(t.logprob for t in logprobs)
        return output_of(seq, committed, logprobs=logprobs)

    def _count_drafts(self, seq: Sequence, drafted: int, accepted: int, step: StepStats) -> None:
        seq.drafted += drafted
        seq.accepted += accepted
        step.drafted += drafted
        step.accepted += accepted
        per_pos = self._stats.accepted_per_position
        if len(per_pos) < drafted:
            per_pos.extend([0] * (drafted - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1
        self._stats.num_drafts += 1

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error (its resources freed); the step goes on without it."""
        self._stats.request_errors += 1
        if not seq.is_finished:
            self._finish(seq, "error")
        return output_of(seq, [], error=message)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        for strategy in self._strategies.values():
            strategy.forget(seq.request_id)
        for proposer in (self.drafter, self.ngram):
            if proposer is not None:
                proposer.free(seq.request_id)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self._seqs.pop(seq.request_id, None)
        self.intake.finished(seq.request_id)

    def _admit(self) -> list[RequestOutput]:
        """Take in what arrived: new requests join the scheduler, aborted ones finish."""
        outputs = []
        for kind, item in self.intake.drain():
            if kind == "add":
                self._seqs[item.request_id] = item
                self._stats.prompt_tokens += item.num_prompt_tokens
                if self.adaptive is not None:
                    self.adaptive.record_arrival(item.params.max_tokens)
                self.scheduler.add(item)
            elif (seq := self._seqs.get(item)) is not None:
                self._finish(seq, "abort")
                outputs.append(output_of(seq, []))
        return outputs

    def _fail_unfittable(self) -> list[RequestOutput]:
        """Nothing could be scheduled: the head of the queue cannot fit even into an empty cache
        (max_model_len is capped at the pool's size, so this should not happen)."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        log.error("request %s needs more KV blocks than the cache has; failing it", seq.request_id)
        return [self._fail(seq, "the request needs more KV cache than the server has")]

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams],
                 on_step: Callable[[list[RequestOutput]], None] | None = None,
                 max_concurrency: int | None = None) -> list[Completion]:
        """Run prompts to completion in this thread (see backend.engine.offline)."""
        return generate(self, prompts, params, on_step=on_step, max_concurrency=max_concurrency)
