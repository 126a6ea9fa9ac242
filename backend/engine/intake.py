"""Admission: a request checked, tokenized and queued for the step thread.

``prepare`` reads no state that changes (any thread may call it, outside any lock: tokenizing a
long prompt must not hold anything up); ``enqueue`` admits it within the queue limits and hands
it to the step thread through an inbox. The step thread drains the inbox and reports when a
request starts running and when it ends, which is what the queue limits count.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, replace

import torch

from backend.batching.sequence import Sequence
from backend.engine.config import ConfigError
from backend.errors import InvalidRequest, ServerBusy
from backend.model.tokenizer import IncrementalDetokenizer, Tokenizer
from backend.sampling.params import SamplingParams
from backend.sampling.processors import bad_words_token_ids
from backend.sampling.sampler import make_generator

log = logging.getLogger("nightdraft.engine")


def context_limit(requested: int | None, model_max: int, pool_blocks: int, block_size: int) -> int:
    """max_model_len: at most the model's positions and what the KV pool holds with the
    drafter on the device, so every admitted request can run to its end in that pool (the pool
    may shrink back to it at any time; see backend.engine.memory)."""
    pool_tokens = pool_blocks * block_size
    if requested is not None:
        if requested > pool_tokens:
            raise ConfigError(
                f"max_model_len: {requested} tokens do not fit the KV pool ({pool_blocks} blocks "
                f"of {block_size} = {pool_tokens} tokens); raise kv_cache_bytes or lower max_model_len")
        return min(requested, model_max)
    if pool_tokens < model_max:
        log.info("max_model_len %d: what the KV pool holds (the model takes %d)", pool_tokens, model_max)
    return min(model_max, pool_tokens)


@dataclass(frozen=True)
class Limits:
    """What a request may be, and how many may wait."""
    vocab_size: int
    max_model_len: int          # prompt + generated tokens
    max_prompt_bytes: int       # prompt text, checked before tokenizing
    max_waiting: int            # requests accepted and not yet running
    max_waiting_bytes: int      # their prompt text


class Intake:
    def __init__(self, tokenizer: Tokenizer, limits: Limits, device: torch.device):
        self.tokenizer = tokenizer
        self.limits = limits
        self.device = device    # where a sampled request's random generator lives
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()          # ids accepted and not yet finished
        self._queued: dict[str, int] = {}     # ids accepted and not yet running -> prompt bytes
        self._queued_bytes = 0
        self._grammars = None                 # compiles structured outputs (on first use)
        self._grammars_lock = threading.Lock()

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validate and tokenize a request (InvalidRequest says what is wrong)."""
        num_bytes = 0
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            # chars <= UTF-8 bytes: the cheap test first, then the exact one
            cheap = len(prompt) > self.limits.max_prompt_bytes
            num_bytes = len(prompt) if cheap else len(prompt.encode("utf-8"))
            if num_bytes > self.limits.max_prompt_bytes:
                raise InvalidRequest(f"the prompt has {'at least ' if cheap else ''}{num_bytes} bytes; "
                                     f"at most {self.limits.max_prompt_bytes} are accepted (the context holds "
                                     f"{self.limits.max_model_len} tokens)")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise InvalidRequest(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.limits.vocab_size})")
            num_bytes = 4 * len(prompt_ids)
        prompt_ids = self._truncate(prompt_ids, params.truncate_prompt_tokens)
        self._check(prompt_ids, params)
        params = self._for_model(params)
        return Sequence(
            request_id=request_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
            params=params, detokenizer=IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens),
            generator=None if params.greedy else make_generator(params.seed, self.device),
            prompt_bytes=num_bytes,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            grammar=self._grammar(params),
        )

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= self.limits.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; the context holds "
                                 f"{self.limits.max_model_len}, leaving no room to generate")
        if params.max_tokens > self.limits.max_model_len:
            raise InvalidRequest(f"max_tokens must be at most the context length "
                                 f"({self.limits.max_model_len} tokens), got {params.max_tokens}")
        bad = [t for t in params.stop_token_ids if t >= self.limits.vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad[:5]} outside the vocabulary [0, {self.limits.vocab_size})")
        vocab = self.limits.vocab_size
        for key, ids in (("allowed_token_ids", params.allowed_token_ids or ()),
                         ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequest(f"{key}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")

    def _truncate(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens, as vLLM does it: the last `keep` tokens (-1: as many as the
        context holds), special tokens included."""
        if keep is None:
            return prompt_ids
        keep = self.limits.max_model_len if keep == -1 else keep
        return prompt_ids[-keep:]

    def _grammar(self, params: SamplingParams):
        """A matcher of the request's structured output (its grammar compiled once per form and
        cached); InvalidRequest when it does not compile."""
        if params.structured_outputs is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                from backend.sampling.grammar import GrammarCompiler
                self._grammars = GrammarCompiler(self.tokenizer, self.limits.vocab_size)
        return self._grammars.matcher(params.structured_outputs)

    def _for_model(self, params: SamplingParams) -> SamplingParams:
        """What needs the tokenizer: the bad words as token ids."""
        if not params.bad_words:
            return params
        ids = bad_words_token_ids(params.bad_words, self.tokenizer.encode_plain, self.limits.vocab_size)
        return replace(params, bad_words_token_ids=ids)

    def enqueue(self, seq: Sequence) -> None:
        """Admit a prepared request. ServerBusy when the queue is full."""
        with self._lock:
            if seq.request_id in self._live:
                raise InvalidRequest(f"request id {seq.request_id!r} is already in flight")
            if len(self._queued) >= self.limits.max_waiting:
                raise ServerBusy(f"server busy: {len(self._queued)} requests are waiting "
                                 f"(max_waiting {self.limits.max_waiting}); retry later")
            if self._queued and self._queued_bytes + seq.prompt_bytes > self.limits.max_waiting_bytes:
                raise ServerBusy(f"server busy: {self._queued_bytes} bytes of prompts are waiting "
                                 f"(max_waiting_bytes {self.limits.max_waiting_bytes}); retry later")
            self._live.add(seq.request_id)
            self._queued[seq.request_id] = seq.prompt_bytes
            self._queued_bytes += seq.prompt_bytes
        self._inbox.put(("add", seq))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    # ---- the step thread's side

    def drain(self) -> list[tuple[str, Sequence | str]]:
        """What arrived since the last call: ("add", sequence) and ("abort", request id)."""
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    @property
    def any_queued(self) -> bool:
        return bool(self._queued)

    def started(self, request_ids) -> None:
        """These requests left the queue (they run now)."""
        with self._lock:
            for rid in request_ids:
                self._queued_bytes -= self._queued.pop(rid, 0)

    def finished(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)
            self._queued_bytes -= self._queued.pop(request_id, 0)
