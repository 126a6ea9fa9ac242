"""The target's pass over a step's batch: one forward, then verification and commit per request.

A forward that raises is retried on each half of the batch, down to the single request(s) that
fail alone: they finish with an error, and every other request's output is what it would have
been alone.
"""
from __future__ import annotations

import logging
import time

from backend.batching.scheduler import ScheduledSeq
from backend.batching.sequence import Sequence
from backend.engine.commit import commit_decided
from backend.engine.outputs import RequestOutput
from backend.engine.requests import Requests
from backend.engine.verify import decide, score_prompts
from backend.model.kv_cache import PagedKVCache
from backend.model.runner import ModelRunner
from backend.model.tokenizer import Tokenizer
from backend.step import PassCounts

log = logging.getLogger("nightdraft.engine")


class TargetPass:
    def __init__(self, runner: ModelRunner, kv: PagedKVCache, requests: Requests, tokenizer: Tokenizer,
                 max_model_len: int, on_finish=None):
        self.runner = runner
        self.kv = kv
        self.requests = requests
        self.tokenizer = tokenizer          # (its EOS ids are read at each step)
        self.max_model_len = max_model_len
        self.on_finish = on_finish          # told of each request that ends with its tokens

    def __call__(self, batch: list[ScheduledSeq], counts: PassCounts) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self.run(batch, counts)
        counts.t_verify_s = time.perf_counter() - t0
        return outputs

    def run(self, batch: list[ScheduledSeq], counts: PassCounts) -> list[RequestOutput]:
        """Forward, verify and commit `batch`, counting in `counts`."""
        try:
            logits, rows = self.forward(batch, counts)
        except Exception as e:  # noqa: BLE001 - isolate the request(s) at fault
            if len(batch) == 1:
                log.error("request %s: the target forward failed: %s", batch[0].seq.request_id, e)
                return [self.requests.fail(batch[0].seq, f"the forward pass failed: {type(e).__name__}: {e}")]
            log.warning("a forward over %d sequences failed (%s: %s); retrying in halves",
                        len(batch), type(e).__name__, e)
            half = len(batch) // 2
            return self.run(batch[:half], counts) + self.run(batch[half:], counts)
        t0 = time.perf_counter()
        eos = self.tokenizer.eos_token_ids
        decisions = decide(batch, rows, logits, eos)
        t1 = time.perf_counter()
        outputs = [out for s, d in zip(batch, decisions)
                   if (out := commit_decided(s, d, counts, kv=self.kv, eos_token_ids=eos,
                                             max_model_len=self.max_model_len, finish=self._finish,
                                             fail=self.requests.fail)) is not None]
        counts.t_decide_s += t1 - t0
        counts.t_commit_s += time.perf_counter() - t1
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.requests.finish(seq, reason)
        if self.on_finish is not None:
            self.on_finish(seq)

    def forward(self, batch: list[ScheduledSeq], counts: PassCounts):
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
        counts.t_prepare_s += prepare
        counts.t_forward_s += time.perf_counter() - t0 - prepare
        counts.num_forward_tokens += len(input_ids)
        counts.num_context_tokens += sum(cached) + len(input_ids)
        if scored:
            score_prompts(scored, logits[len(logits_indices):])
            logits = logits[:len(logits_indices)]
        return logits, rows
