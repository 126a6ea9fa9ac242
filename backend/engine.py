"""The engine: continuous batching over a paged KV cache, with lossless speculative decoding.

One `step()` = schedule -> (draft) -> one batched target forward -> sample or verify -> commit.
`add_request` (= `enqueue(prepare(...))`) and `abort` may be called from any thread; `step` from
one thread only. `prepare` (validation, tokenization) touches no engine state, so a front end
can run it outside any lock it holds.

A failure inside a batched step does not spread: a forward that raises is retried on each half
of the batch until the request(s) that fail alone are found; sampling, verification and commit
run per request; the drafter's faults are the drafter manager's. Requests at fault finish with
``finish_reason="error"``; every other request's output is what it would have been alone.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .drafter import Proposal
from .drafter_manager import DrafterManager
from .engine_config import ConfigError, EngineConfig
from .errors import InvalidRequest, ServerBusy
from .kv_cache import PagedKVCache
from planner.planner import Decision, Planner
from planner.signals import EngineSignals, TritonMetricsSignals

from .loader import load_model
from .memory import ElasticMemory
from .model_config import ModelConfig
from .outputs import EngineStats, RequestOutput, StepStats
from .request import Sequence, Status
from .sampler import make_generator, processed_probs, sample
from .sampling_params import SamplingParams
from .scheduler import ScheduledSeq, Scheduler
from .stopping import banned_tokens, stop_reason, visible_end
from .sub_batches import SubBatches
from .tokenizer import IncrementalDetokenizer, Tokenizer
from .verification import verify_greedy, verify_rejection

log = logging.getLogger("nightdraft.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Completion:
    """A finished request, as `generate` returns it."""
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str | None
    drafted: int
    accepted: int
    latency_s: float = 0.0         # arrival to finish
    ttft_s: float = 0.0            # arrival to first token


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._drafter_cores = DrafterManager.place_cpu_worker(config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]

        self.target = load_model(config.target, device=config.device, dtype=self.dtype)
        mc = self.target.config
        self.tokenizer = Tokenizer.from_pretrained(config.target, eos_token_ids=mc.eos_token_ids)
        self.kv = PagedKVCache.for_model(mc, config.kv_cache_bytes, block_size=config.block_size,
                                         dtype=self.dtype, device=config.device)
        self.max_model_len = self._context_limit(config, mc.max_position_embeddings)
        # Any text longer than this tokenizes into more than max_model_len tokens (no token
        # spells more than max_token_bytes), so it is refused before tokenizing; 2x for
        # normalisers that shorten text.
        self.max_prompt_bytes = config.max_prompt_bytes or \
            2 * self.max_model_len * self.tokenizer.max_token_bytes + 1024
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.drafter: DrafterManager | None = None
        if config.drafter is not None:
            self.drafter = self._load_drafter(config)

        self.mode = config.mode                 # as configured: ar | sd | psd | auto
        self.active_mode = "sd" if config.mode == "auto" else config.mode   # what steps run now
        self.gamma = config.gamma if config.mode != "ar" else 0
        self.sub_batches = SubBatches()
        self.memory = self._init_memory() if self.drafter is not None and config.offload else None
        self.planner = None
        if config.mode == "auto":
            self._init_planner(config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()          # ids accepted and not yet finished
        self._queued: dict[str, int] = {}     # ids accepted and not yet running -> prompt bytes
        self._queued_bytes = 0
        self._seqs: dict[str, Sequence] = {}  # ids the step thread knows about
        self._stats = EngineStats()
        self._pending_completions: dict[str, Completion] = {}   # generate()'s own requests
        self._prev_busy_end: float | None = None    # end of the last step that left work to do
        self._reload_s: float | None = None         # a reload's duration, not yet reported

    def _context_limit(self, config: EngineConfig, model_max: int) -> int:
        """max_model_len: at most the model's positions and what the KV pool holds with the
        drafter on the device, so every admitted request can run to its end in that pool
        (the pool may shrink back to it at any time; see backend.memory)."""
        pool_tokens = self.kv.num_blocks * self.kv.block_size
        if config.max_model_len is not None:
            if config.max_model_len > pool_tokens:
                raise ConfigError(
                    f"max_model_len: {config.max_model_len} tokens do not fit the KV pool "
                    f"({self.kv.num_blocks} blocks of {self.kv.block_size} = {pool_tokens} "
                    f"tokens); raise kv_cache_bytes or lower max_model_len")
            return min(config.max_model_len, model_max)
        if pool_tokens < model_max:
            log.info("max_model_len %d: the KV pool holds %d tokens (the model %d)",
                     pool_tokens, pool_tokens, model_max)
        return min(model_max, pool_tokens)

    def _load_drafter(self, config: EngineConfig) -> DrafterManager:
        dcfg = ModelConfig.from_pretrained(config.drafter)
        if dcfg.vocab_size != self.target.config.vocab_size:
            raise ConfigError(f"drafter vocab ({dcfg.vocab_size}) differs from the target's "
                              f"({self.target.config.vocab_size}); they must share a tokenizer")
        budget = config.drafter_kv_cache_bytes
        if budget is None:  # as many tokens as the target's pool holds
            budget = self.kv.num_blocks * PagedKVCache.bytes_per_block(dcfg, config.block_size, self.dtype)
        return DrafterManager(config, vocab_size=dcfg.vocab_size, kv_cache_bytes=budget,
                              max_rows=config.max_num_seqs * config.gamma_max, dtype=self.dtype,
                              cores=self._drafter_cores)

    def _init_planner(self, config: EngineConfig) -> None:
        self.planner = Planner(gamma_max=config.gamma_max, psd_available=self.drafter.remote,
                               seed=config.seed, **(config.planner or {}))
        self._engine_signals = EngineSignals()
        self._triton_signals = TritonMetricsSignals(config.metrics_url) if config.metrics_url else None
        self._spec_off_since_step: int | None = None   # when the drafter last stopped drafting

    def _init_memory(self) -> ElasticMemory:
        """Elastic memory (mode auto's planner drives it; in fixed modes it stays idle unless
        an operator or a test calls it)."""
        mc = self.target.config
        weights = sum(p.numel() * p.element_size() for p in self.target.parameters())
        return ElasticMemory(self.kv, self.drafter, self.scheduler,
                             PagedKVCache.bytes_per_block(mc, self.config.block_size, self.dtype), weights)

    def close(self) -> None:
        """Stop the drafter worker and the metrics scraper, if any. The engine is unusable afterwards."""
        if self.drafter is not None:
            self.drafter.close()
        if self._drafter_cores is not None:
            DrafterManager.unpin()
        if self.planner is not None and self._triton_signals is not None:
            self._triton_signals.close()

    # ---- the public, thread-safe side ------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.enqueue(self.prepare(request_id, prompt, params))

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validate and tokenize a request (InvalidRequest says what is wrong). Reads no engine
        state that changes, so any thread may call it, outside any lock."""
        num_bytes = 0
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            # chars <= UTF-8 bytes: the cheap test first, then the exact one
            cheap = len(prompt) > self.max_prompt_bytes
            num_bytes = len(prompt) if cheap else len(prompt.encode("utf-8"))
            if num_bytes > self.max_prompt_bytes:
                raise InvalidRequest(f"the prompt has {'at least ' if cheap else ''}{num_bytes} bytes; "
                                     f"at most {self.max_prompt_bytes} are accepted (the context holds "
                                     f"{self.max_model_len} tokens)")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            vocab = self.target.config.vocab_size
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
            num_bytes = 4 * len(prompt_ids)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                                 f"{self.max_model_len}, leaving no room to generate")
        if params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"max_tokens must be at most the context length "
                                 f"({self.max_model_len} tokens), got {params.max_tokens}")
        vocab = self.target.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return Sequence(
            request_id=request_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
            params=params, detokenizer=IncrementalDetokenizer(self.tokenizer),
            generator=None if params.greedy else make_generator(params.seed, self.device),
            prompt_bytes=num_bytes,
        )

    def enqueue(self, seq: Sequence) -> None:
        """Hand a prepared request to the step thread. ServerBusy when the queue is full."""
        cfg = self.config
        with self._lock:
            if seq.request_id in self._live:
                raise InvalidRequest(f"request id {seq.request_id!r} is already in flight")
            if len(self._queued) >= cfg.max_waiting:
                raise ServerBusy(f"server busy: {len(self._queued)} requests are waiting "
                                 f"(max_waiting {cfg.max_waiting}); retry later")
            if self._queued and self._queued_bytes + seq.prompt_bytes > cfg.max_waiting_bytes:
                raise ServerBusy(f"server busy: {self._queued_bytes} bytes of prompts are waiting "
                                 f"(max_waiting_bytes {cfg.max_waiting_bytes}); retry later")
            self._live.add(seq.request_id)
            self._queued[seq.request_id] = seq.prompt_bytes
            self._queued_bytes += seq.prompt_bytes
        self._inbox.put(("add", seq))

    def _started(self, request_ids) -> None:
        """These requests left the queue (running, or finished before they ran)."""
        with self._lock:
            for rid in request_ids:
                self._queued_bytes -= self._queued.pop(rid, 0)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    def set_gamma(self, gamma: int) -> None:
        """Speculation length for the coming steps (0 = plain decoding). With mode "auto" the
        planner sets it every step, overriding this."""
        if not 0 <= gamma <= self.config.gamma_max:
            raise ValueError(f"gamma must be in [0, {self.config.gamma_max}]")
        self.gamma = gamma if self.drafter is not None else 0

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
        s.drafter_kv_usage = d.kv_usage if d else 0.0
        s.drafter_state = d.state if d else "none"
        s.drafter_failures = d.failures if d else 0
        s.drafter_restarts = d.restarts if d else 0
        s.drafter_request_failures = d.request_failures if d else 0
        s.drafter_catchup_tokens = d.catchup_tokens if d else 0
        if self.memory is not None:
            s.offloads, s.reloads = self.memory.offloads, self.memory.reloads
        if self.planner is not None:
            s.planner_switches = self.planner.bandit.switches   # stats() builds a report; too heavy here
        c = self.sub_batches.counters
        s.psd_steps, s.psd_fallback_steps = c.steps, c.fallback_steps
        s.psd_unbalanced_steps, s.psd_overlapped_steps = c.unbalanced_steps, c.overlapped_steps
        return s

    # ---- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._drain_inbox()
        if self.drafter is not None:
            self.drafter.poll()          # a replacement after a failure comes in here
        if self.memory is not None:      # (also while idle: weights may arrive meanwhile)
            self._reload_s = self.memory.poll() or self._reload_s
        if not self.scheduler.has_work():
            return outputs
        reload_s, self._reload_s = self._reload_s, None     # reported with the next busy step
        if self.planner is not None:
            self._plan()

        psd = self._psd_active()
        to_draft: set[str] = set()
        if psd:
            self._refresh_sub_batches()
            _, to_draft = self.sub_batches.begin_step()
        batch = self.scheduler.schedule(self._psd_gamma_for if psd else self._gamma_for, skip=to_draft)
        if self._queued:
            self._started([s.seq.request_id for s in batch])
        if not batch:
            return outputs + self._fail_unfittable()

        step = StepStats(gamma=self.gamma, batch_size=len(batch))
        if psd:
            self._proposals_in_hand(batch)
        self._draft_in_line(batch, step)      # sequential SD (and PSD's fallback)
        in_flight = self._start_drafting(to_draft) if psd else None
        try:
            t1 = time.perf_counter()
            outputs += self._run(batch, step)
            step.t_verify_s = time.perf_counter() - t1
            self._stats.drafted_tokens += step.drafted
            self._stats.accepted_tokens += step.accepted
            self._stats.generation_tokens += step.tokens_committed
        finally:
            # Whatever happened, the other sub-batch's proposal is collected: the drafter
            # protocol stays in step.
            if in_flight is not None:
                self._finish_drafting(*in_flight, step)
        if psd:
            self.sub_batches.end_step()
        step.mode = "psd" if in_flight is not None else "sd" if step.drafted else "ar"
        t_end = time.perf_counter()
        step.t_step_s = t_end - t0
        # From the previous busy step's end: what the caller does with each step's outputs
        # (streaming them out, one message per request) is a cost per step too.
        step.t_cycle_s = t_end - self._prev_busy_end if self._prev_busy_end is not None else step.t_step_s
        self._prev_busy_end = t_end if self.scheduler.has_work() else None
        self._stats.steps += 1
        self._stats.last_step = step
        if self.planner is not None:
            self._observe(step, reload_s)
        return outputs

    # ---- the planner's loop: decide before the step, report after ---------------------------

    def _plan(self) -> None:
        now = time.perf_counter()
        mem = self.memory
        signals = self._engine_signals.snapshot(
            batch_size=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage(), now=now,
            drafter_lag_tokens=self.drafter.lag_tokens(self.scheduler.running),
            drafter_offloaded=self.drafter.offloaded, batch_limit=self.config.max_num_seqs,
            kv_growth_if_offloaded=mem.growth_if_offloaded() if mem is not None else None,
            kv_usage_at_base=mem.usage_at_base() if mem is not None else None)
        if self._triton_signals is not None:
            signals = self._triton_signals.merge(signals)
        decision = self.planner.decide(signals)
        if decision.gamma > 0:
            if self.drafter.offloaded and self.memory is not None:
                self.memory.start_reload()          # decode plainly until the weights are back
            ready = self.drafter.available
            self.gamma = decision.gamma if ready else 0
            self.active_mode = decision.mode if ready else "ar"
        else:
            self.gamma = 0
            self.active_mode = "ar"
            if (self.memory is not None and self.drafter.available
                    and self.planner.wants_offload(signals)):
                self.memory.offload()
        if self.active_mode != "psd" and any(self.sub_batches.members):
            self.sub_batches.clear()

    def _observe(self, step: StepStats, reload_s: float | None) -> None:
        rebuild_s = 0.0
        if step.drafted:
            if self._spec_off_since_step is not None:   # first drafts after a pause: catch-up
                rebuild_s = self.drafter.last_catchup_s
            self._spec_off_since_step = None
        elif self._spec_off_since_step is None:
            self._spec_off_since_step = self._stats.steps
        # Score what actually ran (the drafter may still have been on its way back).
        ran = Decision(step.mode, self.gamma) if step.drafted else Decision("ar", 0)
        self.planner.observe(ran, step_wall_s=step.t_cycle_s,
                             tokens_committed=step.tokens_committed, drafter_rebuild_s=rebuild_s,
                             drafter_reload_s=reload_s or 0.0, batch_size=step.batch_size,
                             prefill_tokens=step.num_prefill_tokens - step.num_recompute_tokens,
                             forward_tokens=step.num_forward_tokens, forward_s=step.t_forward_s)

    def _psd_active(self) -> bool:
        return (self.active_mode == "psd" and self.gamma > 0 and self.drafter is not None
                and self.drafter.available)

    def _gamma_for(self, seq: Sequence) -> int:
        if self.gamma == 0 or not seq.speculates:
            return 0
        room_tokens = seq.params.max_tokens - seq.num_output_tokens - 1
        room_context = self.max_model_len - len(seq) - 1
        return max(0, min(self.gamma, room_tokens, room_context))

    def _psd_gamma_for(self, seq: Sequence) -> int:
        # Verify what was drafted for it last step; with nothing in hand, draft in line.
        return self.sub_batches.peek_len(seq.request_id, len(seq)) or self._gamma_for(seq)

    def _refresh_sub_batches(self) -> None:
        # Only requests that speculate take turns; the others decode every step.
        decoding = {s.request_id for s in self.scheduler.running
                    if s.num_uncomputed == 1 and s.speculates}
        for side in self.sub_batches.members:
            for gone in side - decoding:
                self.sub_batches.leave(gone)
        for rid in decoding:
            self.sub_batches.join(rid)
        self.sub_batches.rebalance()

    def _proposals_in_hand(self, batch: list[ScheduledSeq]) -> None:
        for s in batch:
            p = self.sub_batches.take(s.seq.request_id, len(s.seq))
            if p is not None and s.gamma:
                s.proposal = Proposal(p.tokens[:s.gamma], None if p.probs is None else p.probs[:s.gamma])
        if any(s.gamma and s.proposal is None for s in batch):
            self.sub_batches.counters.fallback_steps += 1

    def _draft_in_line(self, batch: list[ScheduledSeq], step: StepStats) -> None:
        """Draft, now, every scheduled sequence that wants drafts and has none in hand."""
        want = [s for s in batch if s.gamma > 0 and s.proposal is None]
        if want and self.drafter is not None:
            t0 = time.perf_counter()
            got = self.drafter.propose([(s.seq, s.gamma) for s in want])
            step.t_draft_s += time.perf_counter() - t0
            for s, p in zip(want, got or ()):
                self._take_proposal(s.seq, p)
                if p.tokens:
                    s.proposal = p
        for s in batch:       # no drafts (drafter down or out of room): plain decode
            s.gamma = len(s.proposal.tokens) if s.proposal is not None else 0

    def _take_proposal(self, seq: Sequence, proposal: Proposal) -> None:
        if proposal.error is not None:
            seq.spec_disabled = True       # the drafter cannot serve it; its output is unaffected

    def _start_drafting(self, to_draft: set[str]):
        seqs = [self._seqs[rid] for rid in to_draft
                if rid in self._seqs and self._seqs[rid].status is Status.RUNNING
                and self._seqs[rid].num_uncomputed == 1]
        wanted = [(s, g) for s in seqs if (g := self._gamma_for(s)) > 0]
        if not wanted:
            return None
        pending = self.drafter.propose_async(wanted)
        return (pending, [s for s, _ in wanted], [len(s) for s, _ in wanted]) if pending is not None else None

    def _finish_drafting(self, pending, seqs: list[Sequence], lengths: list[int], step: StepStats) -> None:
        got = self.drafter.collect(pending) if self.drafter is not None else None
        if got is None:
            return
        step.t_draft_s += self.drafter.last_propose_s   # time the worker spent, overlapped
        self.sub_batches.counters.overlapped_steps += 1
        for seq, length, proposal in zip(seqs, lengths, got):
            self._take_proposal(seq, proposal)
            if proposal.tokens:
                self.sub_batches.store(seq.request_id, length, proposal)

    def _run(self, batch: list[ScheduledSeq], step: StepStats) -> list[RequestOutput]:
        """Forward and commit `batch`. A forward that raises is retried on each half, down to
        the single request(s) that fail alone: they finish with an error, the rest commit."""
        try:
            t0 = time.perf_counter()
            logits, rows = self._target_forward(batch, step)
            step.t_forward_s += time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - isolate the request(s) at fault
            log.warning("a forward over %d sequences failed (%s: %s); retrying in halves",
                        len(batch), type(e).__name__, e) if len(batch) > 1 else None
            if len(batch) == 1:
                log.error("request %s: the target forward failed: %s", batch[0].seq.request_id, e)
                return [self._fail(batch[0].seq, f"the forward pass failed: {type(e).__name__}: {e}")]
            half = len(batch) // 2
            return self._run(batch[:half], step) + self._run(batch[half:], step)
        return self._commit_all(batch, logits, rows, step)

    def _target_forward(self, batch: list[ScheduledSeq], step: StepStats):
        """One forward over every scheduled sequence; logits only where tokens are decided."""
        input_ids: list[int] = []
        num_new: list[int] = []
        rows: list[tuple[int, int]] = []     # per scheduled seq: (first logits row, row count)
        logits_indices: list[int] = []
        for s in batch:
            seq = s.seq
            fed = seq.token_ids[seq.num_computed:seq.num_computed + s.num_new]
            if s.gamma:
                fed = fed + s.proposal.tokens
            start = len(input_ids)
            input_ids += fed
            num_new.append(len(fed))
            if s.completes:
                rows.append((len(logits_indices), s.gamma + 1))
                logits_indices += range(start + len(fed) - s.gamma - 1, start + len(fed))
            else:
                rows.append((len(logits_indices), 0))
        meta = self.kv.prepare([s.seq.request_id for s in batch],
                               [s.seq.num_computed for s in batch], num_new)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        idx = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        logits = self.target(ids, meta, self.kv, idx)
        if logits.is_cuda:       # the forward is asynchronous there; time it, not its launch
            torch.cuda.current_stream(self.device).synchronize()
        step.num_forward_tokens += len(input_ids)
        return logits, rows

    def _mask_banned(self, batch, rows, logits: torch.Tensor) -> None:
        """Tokens a request may not generate yet (EOS and stop tokens before min_tokens) get
        probability 0 in the distribution that decides them (greedy and sampled alike)."""
        cells_r, cells_t = [], []
        eos = self.tokenizer.eos_token_ids
        for s, (first, n) in zip(batch, rows):
            if n and s.seq.params.min_tokens > s.seq.num_output_tokens:
                for j in range(n):
                    for t in banned_tokens(s.seq, eos, ahead=j):
                        cells_r.append(first + j)
                        cells_t.append(t)
        if cells_r:
            logits[torch.tensor(cells_r, device=logits.device),
                   torch.tensor(cells_t, device=logits.device)] = float("-inf")

    def _sampling_probs(self, batch, rows, logits: torch.Tensor) -> dict[int, torch.Tensor | Exception]:
        """Per batch index of a sampled request: its rows' distributions [n, V] (or the error
        computing them raised, which fails that request alone)."""
        sampled = [(i, first, n) for i, (s, (first, n)) in enumerate(zip(batch, rows))
                   if n and not s.seq.params.greedy]
        if not sampled:
            return {}
        row_ids = [r for _, first, n in sampled for r in range(first, first + n)]
        row_params = [batch[i].seq.params for i, _, n in sampled for _ in range(n)]
        try:
            p = processed_probs(logits[row_ids], row_params)
        except Exception:  # noqa: BLE001 - one request's parameters: compute them one by one
            out: dict[int, torch.Tensor | Exception] = {}
            for i, first, n in sampled:
                try:
                    out[i] = processed_probs(logits[first:first + n], [batch[i].seq.params] * n)
                except Exception as e:  # noqa: BLE001
                    out[i] = e
            return out
        out, k = {}, 0
        for i, _, n in sampled:
            out[i] = p[k:k + n]
            k += n
        return out

    def _commit_all(self, batch, logits, rows, step: StepStats) -> list[RequestOutput]:
        # Rows the model made non-finite fail their request alone (checked before masking,
        # which writes -inf on purpose).
        finite = torch.isfinite(logits).all(dim=-1) if logits.numel() else None
        finite = finite.tolist() if finite is not None and not bool(finite.all()) else None
        self._mask_banned(batch, rows, logits)
        # Argmax for every row at once; distributions only for rows of sampled requests.
        argmax = logits.argmax(dim=-1).tolist() if logits.numel() else []
        probs = self._sampling_probs(batch, rows, logits)

        outputs = []
        now = time.perf_counter()
        for i, (s, (first, n)) in enumerate(zip(batch, rows)):
            seq = s.seq
            if s.num_new > 1 or not s.completes:   # (asked before num_computed moves on)
                step.num_prefill_tokens += s.num_new
                if seq.num_preemptions:        # recomputing what a preemption threw away
                    step.num_recompute_tokens += s.num_new
            seq.num_computed += s.num_new
            if not n:
                continue
            try:
                if finite is not None and not all(finite[first:first + n]):
                    raise FloatingPointError("the model produced non-finite logits")
                new_tokens = self._decide(s, argmax[first:first + n], probs.get(i))
                out = self._commit(seq, new_tokens, now)
            except Exception as e:  # noqa: BLE001 - this request alone
                log.error("request %s failed in sampling/commit: %s", seq.request_id, e)
                outputs.append(self._fail(seq, f"sampling failed: {type(e).__name__}: {e}"))
                continue
            drafts = s.proposal.tokens if s.gamma else []
            if drafts:
                accepted = len(new_tokens) - 1
                seq.drafted += len(drafts)
                seq.accepted += accepted
                step.drafted += len(drafts)
                step.accepted += accepted
            if s.num_new == 1:            # a decode/verify call (prefill's first token excluded)
                step.target_calls += 1
                self._stats.target_calls += 1
                self._stats.decode_tokens += len(new_tokens)
            outputs.append(out)
            step.tokens_committed += len(new_tokens)
        return outputs

    def _decide(self, s: ScheduledSeq, argmax: list[int], probs) -> list[int]:
        """The tokens this step commits for one sequence: verified drafts plus one of the target's."""
        seq = s.seq
        drafts = s.proposal.tokens if s.gamma else []
        if seq.params.greedy:
            return verify_greedy(argmax, drafts)
        if isinstance(probs, Exception):
            raise probs
        if drafts:
            return verify_rejection(probs, s.proposal.probs.to(probs.device), drafts, seq.generator)
        return [sample(probs[0], seq.generator)]

    def _commit(self, seq: Sequence, new_tokens: list[int], now: float) -> RequestOutput:
        """Append tokens one at a time, stopping exactly where plain decoding would stop."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        committed: list[int] = []
        reason = None
        for tok in new_tokens:
            seq.token_ids.append(tok)
            committed.append(tok)
            before = len(seq.detokenizer.text)
            seq.detokenizer.push([tok])
            reason = stop_reason(seq, tok, len(seq.detokenizer.text) - before,
                                 self.tokenizer.eos_token_ids, self.max_model_len)
            if reason:
                break
        # K/V of rejected drafts (and of the last token, the next input) is not kept.
        seq.num_computed = len(seq) - 1
        if reason:
            self._finish(seq, reason)
        else:
            self.kv.truncate(seq.request_id, seq.num_computed)
        return self._output(seq, committed)

    def _output(self, seq: Sequence, new_ids: list[int], error: str | None = None) -> RequestOutput:
        if seq.is_finished:
            seq.detokenizer.push([], final=True)
        end = visible_end(seq)
        delta = seq.detokenizer.text[seq.emitted_text_len:end]
        seq.emitted_text_len = max(seq.emitted_text_len, end)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=delta,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_drafted=seq.drafted, num_accepted=seq.accepted, error=error,
            **({"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                "finish_time": seq.finish_time} if seq.is_finished else {}),
        )

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error (its resources freed); the step goes on without it."""
        self._stats.request_errors += 1
        if not seq.is_finished:
            self._finish(seq, "error")
        return self._output(seq, [], error=message)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.sub_batches.leave(seq.request_id)
        if self.drafter is not None:
            self.drafter.free(seq.request_id)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self._seqs.pop(seq.request_id, None)
        with self._lock:
            self._live.discard(seq.request_id)
            self._queued_bytes -= self._queued.pop(seq.request_id, 0)

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                self._seqs[item.request_id] = item
                self._stats.prompt_tokens += item.num_prompt_tokens
                if self.planner is not None:
                    self._engine_signals.record_arrivals(1, time.perf_counter())
                self.scheduler.add(item)
            else:
                seq = self._seqs.get(item)
                if seq is not None:
                    self._finish(seq, "abort")
                    outputs.append(self._output(seq, []))

    def _fail_unfittable(self) -> list[RequestOutput]:
        """Nothing could be scheduled: the head of the queue cannot fit even into an empty cache
        (max_model_len is capped at the pool's size, so this should not happen)."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        log.error("request %s needs more KV blocks than the cache has; failing it", seq.request_id)
        return [self._fail(seq, "the request needs more KV cache than the server has")]

    # ---- offline convenience ----------------------------------------------------------------

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams],
                 on_step: Callable[[list[RequestOutput]], None] | None = None,
                 max_concurrency: int | None = None) -> list[Completion]:
        """Run prompts to completion (at most `max_concurrency` in flight); results in input order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        done: dict[str, Completion] = {}
        limit = max_concurrency or len(prompts)
        next_i = 0
        while len(done) < len(prompts):
            while next_i < len(prompts) and next_i - len(done) < limit:
                prompt = prompts[next_i]
                prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                done_or_new = Completion(ids[next_i], prompt_ids, [], "", None, 0, 0)
                self.add_request(ids[next_i], prompt_ids, plist[next_i])
                self._pending_completions[ids[next_i]] = done_or_new
                next_i += 1
            outs = self.step()
            for o in outs:
                c = self._pending_completions.get(o.request_id)
                if c is None:
                    continue
                c.output_ids += o.new_token_ids
                c.text += o.new_text
                if o.finished:
                    c.finish_reason, c.drafted, c.accepted = o.finish_reason, o.num_drafted, o.num_accepted
                    c.latency_s = o.finish_time - o.arrival_time
                    c.ttft_s = (o.first_token_time or o.finish_time) - o.arrival_time
                    done[o.request_id] = self._pending_completions.pop(o.request_id)
            if on_step:
                on_step(outs)
        return [done[i] for i in ids]
