"""The engine: continuous batching over a paged KV cache, with lossless speculative decoding.

One `step()` = schedule -> (draft) -> one batched target forward -> sample or verify -> commit.
`add_request` and `abort` may be called from any thread; `step` from one thread only.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .drafter import DraftRequest, Proposal
from .drafter_manager import DrafterManager
from .engine_config import ConfigError, EngineConfig
from .kv_cache import PagedKVCache
from planner.planner import Decision, Planner
from planner.signals import EngineSignals, TritonMetricsSignals

from .loader import load_model
from .memory import ElasticMemory
from .model_config import ModelConfig
from .outputs import EngineStats, RequestOutput, StepStats
from .request import Sequence, Status
from .sampler import make_generator, processed_probs, sample
from .sampling_params import InvalidRequest, SamplingParams
from .scheduler import ScheduledSeq, Scheduler
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
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.kv = PagedKVCache.for_model(mc, config.kv_cache_bytes, block_size=config.block_size,
                                         dtype=self.dtype, device=config.device)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.drafter: DrafterManager | None = None
        if config.drafter is not None:
            self.drafter = self._load_drafter(config)

        self.mode = config.mode                 # as configured: ar | sd | psd | auto
        self.active_mode = "sd" if config.mode == "auto" else config.mode   # what steps run now
        self.gamma = config.gamma if config.mode != "ar" else 0
        self.sub_batches = SubBatches()
        self.memory: ElasticMemory | None = None
        self.planner = None
        if config.mode == "auto":
            self._init_planner(config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()          # ids accepted and not yet finished
        self._seqs: dict[str, Sequence] = {}  # ids the step thread knows about
        self._stats = EngineStats()
        self._pending_completions: dict[str, Completion] = {}   # generate()'s own requests
        self._prev_busy_end: float | None = None    # end of the last step that left work to do

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
        if config.offload:
            mc = self.target.config
            weights = sum(p.numel() * p.element_size() for p in self.target.parameters())
            self.memory = ElasticMemory(self.kv, self.drafter, self.scheduler,
                                        PagedKVCache.bytes_per_block(mc, config.block_size, self.dtype),
                                        weights)
        self._spec_off_since_step: int | None = None   # when the drafter last stopped drafting

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
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.target.config.vocab_size]
            if bad:
                raise InvalidRequest(f"token id(s) {bad[:5]} outside the vocabulary "
                                     f"[0, {self.target.config.vocab_size})")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                                 f"{self.max_model_len}, leaving no room to generate")
        blocks = -(-(len(prompt_ids) + 1) // self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise InvalidRequest(f"the prompt needs {blocks} KV blocks; the cache has "
                                 f"{self.kv.num_blocks} in all")
        seq = Sequence(
            request_id=request_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
            params=params, detokenizer=IncrementalDetokenizer(self.tokenizer),
            generator=None if params.greedy else make_generator(params.seed),
        )
        with self._lock:
            if request_id in self._live:
                raise InvalidRequest(f"request id {request_id!r} is already in flight")
            self._live.add(request_id)
        self._inbox.put(("add", seq))

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
        if self.drafter is not None and self.drafter.poll():
            for seq in self._seqs.values():   # a fresh worker knows no sequence yet
                seq.drafter_synced = 0
        if not self.scheduler.has_work():
            return outputs
        reload_s = self.memory.poll() if self.memory is not None else None
        if self.planner is not None:
            self._plan()

        psd = self._psd_active()
        to_draft: set[str] = set()
        if psd:
            self._refresh_sub_batches()
            _, to_draft = self.sub_batches.begin_step()
        batch = self.scheduler.schedule(self._psd_gamma_for if psd else self._gamma_for, skip=to_draft)
        if not batch:
            return outputs + self._fail_unfittable()

        step = StepStats(gamma=self.gamma, batch_size=len(batch))
        proposals = self._proposals_in_hand(batch) if psd else {}
        self._draft_in_line(batch, proposals, step)      # sequential SD (and PSD's fallback)
        in_flight = self._start_drafting(to_draft) if psd else None

        t1 = time.perf_counter()
        logits, rows = self._target_forward(batch, proposals, step)
        step.t_forward_s = time.perf_counter() - t1
        outputs += self._commit_all(batch, proposals, logits, rows, step)
        step.t_verify_s = time.perf_counter() - t1

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
        lag = sum(len(s) - s.drafter_synced for s in self.scheduler.running)
        mem = self.memory
        signals = self._engine_signals.snapshot(
            batch_size=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage(), now=now, drafter_lag_tokens=lag,
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
        if self.gamma == 0 or not seq.params.speculative:
            return 0
        room_tokens = seq.params.max_tokens - seq.num_output_tokens - 1
        room_context = self.max_model_len - len(seq) - 1
        return max(0, min(self.gamma, room_tokens, room_context))

    def _psd_gamma_for(self, seq: Sequence) -> int:
        # Verify what was drafted for it last step; with nothing in hand, draft in line.
        return self.sub_batches.peek_len(seq.request_id, len(seq)) or self._gamma_for(seq)

    def _refresh_sub_batches(self) -> None:
        decoding = {s.request_id for s in self.scheduler.running if s.num_uncomputed == 1}
        for side in self.sub_batches.members:
            for gone in side - decoding:
                self.sub_batches.leave(gone)
        for rid in decoding:
            self.sub_batches.join(rid)
        self.sub_batches.rebalance()

    def _proposals_in_hand(self, batch: list[ScheduledSeq]) -> dict[int, Proposal]:
        found = {}
        for i, s in enumerate(batch):
            p = self.sub_batches.take(s.seq.request_id, len(s.seq))
            if p is not None and s.gamma:
                found[i] = Proposal(p.tokens[:s.gamma], None if p.probs is None else p.probs[:s.gamma])
        if any(s.gamma and i not in found for i, s in enumerate(batch)):
            self.sub_batches.counters.fallback_steps += 1
        return found

    def _draft_request(self, seq: Sequence, gamma: int) -> DraftRequest:
        request = DraftRequest(seq.request_id, seq.token_ids[seq.drafter_synced:], gamma, seq.params)
        seq.drafter_synced = len(seq)
        return request

    def _draft_in_line(self, batch: list[ScheduledSeq], proposals: dict[int, Proposal],
                       step: StepStats) -> None:
        """Draft, now, every scheduled sequence that wants drafts and has none in hand."""
        want = [i for i, s in enumerate(batch) if s.gamma > 0 and i not in proposals]
        if want and self.drafter is not None:
            t0 = time.perf_counter()
            got = self.drafter.propose([self._draft_request(batch[i].seq, batch[i].gamma) for i in want])
            step.t_draft_s += time.perf_counter() - t0
            if got is not None:
                proposals.update((i, p) for i, p in zip(want, got) if p.tokens)
        for i, s in enumerate(batch):       # no drafts (drafter down or out of room): plain decode
            s.gamma = len(proposals[i].tokens) if i in proposals else 0

    def _start_drafting(self, to_draft: set[str]):
        seqs = [self._seqs[rid] for rid in to_draft
                if rid in self._seqs and self._seqs[rid].status is Status.RUNNING
                and self._seqs[rid].num_uncomputed == 1]
        seqs = [s for s in seqs if self._gamma_for(s) > 0]
        if not seqs:
            return None
        pending = self.drafter.propose_async([self._draft_request(s, self._gamma_for(s)) for s in seqs])
        return (pending, seqs, [len(s) for s in seqs]) if pending is not None else None

    def _finish_drafting(self, pending, seqs: list[Sequence], lengths: list[int], step: StepStats) -> None:
        got = self.drafter.collect(pending) if self.drafter is not None else None
        if got is None:
            return
        step.t_draft_s += self.drafter.last_propose_s   # time the worker spent, overlapped
        self.sub_batches.counters.overlapped_steps += 1
        for seq, length, proposal in zip(seqs, lengths, got):
            if proposal.tokens:
                self.sub_batches.store(seq.request_id, length, proposal)

    def _target_forward(self, batch: list[ScheduledSeq], proposals: dict[int, Proposal],
                        step: StepStats):
        """One forward over every scheduled sequence; logits only where tokens are decided."""
        input_ids: list[int] = []
        num_new: list[int] = []
        rows: list[tuple[int, int]] = []     # per scheduled seq: (first logits row, row count)
        logits_indices: list[int] = []
        for i, s in enumerate(batch):
            seq = s.seq
            fed = seq.token_ids[seq.num_computed:seq.num_computed + s.num_new]
            if s.gamma:
                fed = fed + proposals[i].tokens
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
        step.num_forward_tokens = len(input_ids)
        return logits, rows

    def _commit_all(self, batch, proposals, logits, rows, step: StepStats) -> list[RequestOutput]:
        # Argmax for every row at once; distributions only for rows of sampled requests.
        argmax = logits.argmax(dim=-1).tolist() if logits.numel() else []
        sampled_rows = [r for s, (first, n) in zip(batch, rows) if n and not s.seq.params.greedy
                        for r in range(first, first + n)]
        probs = {}
        if sampled_rows:
            row_params = [s.seq.params for s, (first, n) in zip(batch, rows)
                          if n and not s.seq.params.greedy for _ in range(n)]
            p = processed_probs(logits[sampled_rows], row_params)
            probs = {r: p[k] for k, r in enumerate(sampled_rows)}

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
            drafts = proposals[i].tokens if s.gamma else []
            if seq.params.greedy:
                new_tokens = verify_greedy(argmax[first:first + n], drafts)
            elif drafts:
                p = torch.stack([probs[r] for r in range(first, first + n)])
                new_tokens = verify_rejection(p, proposals[i].probs, drafts, seq.generator)
            else:
                new_tokens = [sample(probs[first], seq.generator)]
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
            outputs.append(self._commit(seq, new_tokens, now))
            step.tokens_committed += len(new_tokens)
        self._stats.drafted_tokens += step.drafted
        self._stats.accepted_tokens += step.accepted
        self._stats.generation_tokens += step.tokens_committed
        return [o for o in outputs if o is not None]

    def _commit(self, seq: Sequence, new_tokens: list[int], now: float) -> RequestOutput | None:
        """Append tokens one at a time, stopping exactly where plain decoding would stop."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        committed: list[int] = []
        reason = None
        for tok in new_tokens:
            seq.token_ids.append(tok)
            committed.append(tok)
            seq.detokenizer.push([tok])
            reason = self._stop_reason(seq, tok)
            if reason:
                break
        # K/V of rejected drafts (and of the last token, the next input) is not kept.
        seq.num_computed = len(seq) - 1
        if reason:
            self._finish(seq, reason)
        else:
            self.kv.truncate(seq.request_id, seq.num_computed)
        return self._output(seq, committed)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        n_out = seq.num_output_tokens
        if not p.ignore_eos and tok in self.tokenizer.eos_token_ids and n_out >= p.min_tokens:
            return "stop"
        if p.stop and n_out >= p.min_tokens:
            text = seq.detokenizer.text
            window = text[max(0, seq.emitted_text_len - max(map(len, p.stop))):]
            if any(s in window for s in p.stop):
                return "stop"
        if n_out >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        if seq.is_finished:
            seq.detokenizer.push([], final=True)
        text = seq.detokenizer.text
        if seq.is_finished:
            end = len(text)
            if seq.finish_reason == "stop" and seq.params.stop:
                hits = [h for h in (text.find(s, seq.emitted_text_len) for s in seq.params.stop)
                        if h >= 0]
                if hits:
                    end = min(hits)
        else:
            # Hold back a possible stop-string prefix so clients never see text we retract.
            hold = max(map(len, seq.params.stop)) - 1 if seq.params.stop else 0
            end = max(seq.emitted_text_len, len(text) - hold)
        delta = text[seq.emitted_text_len:end]
        seq.emitted_text_len = max(seq.emitted_text_len, end)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=delta,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_drafted=seq.drafted, num_accepted=seq.accepted,
            **({"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                "finish_time": seq.finish_time} if seq.is_finished else {}),
        )

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
        """Nothing could be scheduled: the head of the queue cannot fit even into an empty cache."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        log.warning("request %s needs more KV blocks than the cache has; finishing it", seq.request_id)
        self._finish(seq, "length")
        return [self._output(seq, [])]

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
