"""Continuous batching: who runs this step, with how many tokens, and who waits.

Every step each running sequence feeds the tokens the target has not cached yet: a prefill
chunk, the one pending decode token, or that token plus `gamma` drafts to verify. Admission is by
free KV blocks, and a request is admitted only with room for all of its tokens (they are
reserved at once, however many chunks its prefill takes), so a prefill never stops halfway for
want of blocks. When a running sequence cannot grow, speculation is dropped first, then the most
recently admitted sequence is preempted by recompute (its blocks freed, its tokens re-prefilled
later, nothing it generated lost).

A waiting request that does not fit does not hold back the ones behind it that do: they may pass
it, a bounded number of times (``max_head_bypass``), after which admission waits for it, so a long
prompt is delayed, never starved.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from backend.model.kv_cache import PagedKVCache
from backend.batching.sequence import Sequence, Status

# Admission leaves the running sequences room to grow this many tokens each (16 decode steps, or
# a few verify steps) before anyone has to be preempted. Preemption by recompute throws work
# away: in the dynamic benchmark's overloaded phase, admitting while any block was free had a
# third of the requests preempted and re-prefilled; with this headroom about one in ten.
GROWTH_HEADROOM_TOKENS = 16
# How many later requests may be admitted ahead of a waiting request that does not fit, before
# admission stops and waits for it; and how far down the queue admission looks for them.
MAX_HEAD_BYPASS = 32
BYPASS_SCAN = 64


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int          # uncached tokens of seq.token_ids fed this step
    gamma: int = 0        # drafts to verify after them (only for a pure decode step)
    drafts: list[int] | None = None        # once drafted: the tokens (then gamma = their number)
    draft_probs: object | None = None      # and their draft distributions [gamma, V] (sampling)

    @property
    def completes(self) -> bool:
        """True when this step feeds the sequence's last token, so it produces a new token."""
        return self.seq.num_computed + self.num_new == len(self.seq)


class Scheduler:
    def __init__(self, kv_cache: PagedKVCache, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_head_bypass: int = MAX_HEAD_BYPASS):
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_head_bypass = max_head_bypass
        self.num_bypasses = 0          # admissions ahead of an older request that did not fit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # called with a preempted sequence's id once its blocks are freed (the engine: the
        # proposers let go of their copy too)
        self.on_preempt: Callable[[str], None] | None = None
        # Requests the last schedule left waiting (no KV blocks, batch slot or token budget for
        # them, or a preemption this step). One that arrived since has not been offered
        # admission yet: it is not evidence of a queue.
        self.num_left_waiting = 0
        # Keep a few blocks free at admission so running sequences can grow a little before
        # anyone has to be preempted.
        self.watermark_blocks = max(1, kv_cache.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and give back its KV blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, gamma_for: Callable[[Sequence], int],
                 skip: set[str] | frozenset = frozenset()) -> list[ScheduledSeq]:
        """This step's batch. Decoding sequences named in `skip` sit the step out (batch-parallel
        SD is drafting them); they hold their blocks but are not grown."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False

        i = 0
        while i < len(self.running):
            seq = self.running[i]
            num_new = seq.num_uncomputed
            if num_new == 1 and seq.request_id in skip:
                i += 1
                continue
            if num_new > 1:                       # a prefill (or recompute) still in progress
                num_new = min(num_new, budget)
                if num_new == 0:
                    i += 1
                    continue
            gamma = gamma_for(seq) if num_new == 1 else 0
            while True:
                if self.kv.ensure_capacity(seq.request_id, seq.num_computed + num_new + gamma):
                    break
                if gamma > 0:                     # speculation is optional; memory is not
                    gamma = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:  # preempted itself
                continue
            scheduled.append(ScheduledSeq(seq, num_new, gamma))
            budget -= num_new
            i += 1

        if not preempted:
            self._admit(scheduled, budget)
        self.num_left_waiting = len(self.waiting)
        return scheduled

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        """Admit waiting requests in order while they fit. The first that does not fit is
        `blocked`; the ones behind it that fit may pass it until it has been passed
        `max_head_bypass` times."""
        growth: dict[int, int] = {}     # headroom tokens -> blocks the running need for it
        blocked: Sequence | None = None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if blocked is not None and (blocked.times_bypassed >= self.max_head_bypass or i > BYPASS_SCAN):
                break
            seq = self.waiting[i]
            if not self._fits(seq, growth):
                blocked = blocked or seq
                i += 1
                continue
            del self.waiting[i]
            if blocked is not None:
                blocked.times_bypassed += 1
                self.num_bypasses += 1
            seq.times_bypassed = 0
            seq.status = Status.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_uncomputed, budget)
            scheduled.append(ScheduledSeq(seq, num_new, 0))
            budget -= num_new
            for headroom in growth:
                growth[headroom] += self.kv.blocks_needed(seq.request_id, len(seq) + headroom)

    def _fits(self, seq: Sequence, growth: dict[int, int]) -> bool:
        """Is there room for all of `seq`'s tokens, and, while it prefills, for the running
        sequences to grow? If so its blocks are reserved now. (With nothing running, room for
        its tokens is enough.)"""
        needed = self.kv.blocks_needed(seq.request_id, len(seq))
        if self.running:
            # The running grow by a token or more each step its prefill takes.
            headroom = GROWTH_HEADROOM_TOKENS + -(-seq.num_uncomputed // self.max_num_batched_tokens)
            if headroom not in growth:
                growth[headroom] = sum(self.kv.blocks_needed(s.request_id, len(s) + headroom)
                                       for s in self.running)
            if needed + self.watermark_blocks + growth[headroom] > self.kv.num_free_blocks:
                return False
        return self.kv.ensure_capacity(seq.request_id, len(seq))

    def preempt_until(self, max_used_blocks: int) -> int:
        """Preempt the most recently admitted sequences until at most `max_used_blocks` blocks are
        in use (the KV pool is about to shrink); returns how many were preempted."""
        n = 0
        while self.kv.num_used_blocks > max_used_blocks and self.running:
            self._preempt(self.running[-1])
            n += 1
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq.request_id)
