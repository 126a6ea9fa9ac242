"""How a step speculates: plain decoding, sequential SD or batch-parallel SD, behind one interface.

A strategy chooses the sequences the step feeds and how many drafts each verifies (``schedule``),
puts the drafts in their hands (``propose``), and may keep the drafter busy with other sequences
while the target runs (``overlap``). The engine's step is the same for all three::

    batch = strategy.schedule(scheduler)
    strategy.propose(batch, step)
    with strategy.overlap(step):
        ... forward, verify, commit ...

Batch-parallel SD (MineDraft) keeps two sub-batches: while the target verifies one with the
drafts made for it during the previous step, the drafter (on its own device) drafts the other;
then they swap. A sub-batch with nothing in hand drafts in line, as sequential SD does.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

from backend.batching.scheduler import ScheduledSeq, Scheduler
from backend.batching.sequence import Sequence, Status
from backend.speculation.manager import DrafterManager
from backend.speculation.proposer import Proposal
from backend.speculation.sub_batches import SubBatches


class DraftLength:
    """How many drafts a sequence gets: ``gamma``, bounded by its remaining tokens and context."""

    def __init__(self, gamma: int, max_model_len: int):
        self.gamma = gamma
        self.max_model_len = max_model_len

    def __call__(self, seq: Sequence) -> int:
        if self.gamma == 0 or not seq.speculates:
            return 0
        room_tokens = seq.params.max_tokens - seq.num_output_tokens - 1
        room_context = self.max_model_len - len(seq) - 1
        return max(0, min(self.gamma, room_tokens, room_context))


class PlainDecoding:
    name = "ar"

    def schedule(self, scheduler: Scheduler) -> list[ScheduledSeq]:
        return scheduler.schedule(lambda seq: 0)

    def propose(self, batch: list[ScheduledSeq], step) -> None:
        pass

    @contextlib.contextmanager
    def overlap(self, step) -> Iterator[None]:
        yield

    def forget(self, seq_id: str) -> None:
        pass

    def reset(self) -> None:
        pass


class SequentialSD(PlainDecoding):
    """Draft every scheduled sequence in line, then verify all of them in one target forward."""

    def __init__(self, drafter: DrafterManager, lengths: DraftLength, draft_ahead: bool = False,
                 name: str = "sd"):
        self.name = name                    # "ngram" when its proposer is the n-gram one
        self.drafter = drafter
        self.lengths = lengths
        self.draft_ahead = draft_ahead      # the worker pre-drafts the next round meanwhile

    def schedule(self, scheduler: Scheduler) -> list[ScheduledSeq]:
        return scheduler.schedule(self.lengths)

    def propose(self, batch: list[ScheduledSeq], step) -> None:
        """Draft, now, every scheduled sequence that wants drafts and has none in hand."""
        want = [s for s in batch if s.gamma > 0 and s.drafts is None]
        if want:
            t0 = time.perf_counter()
            got = self.drafter.propose([(s.seq, s.gamma) for s in want], ahead=self.draft_ahead)
            step.t_draft_s += time.perf_counter() - t0
            for s, p in zip(want, got or ()):
                take(s.seq, p)
                if p.tokens:
                    s.drafts, s.draft_probs = p.tokens, p.probs
        for s in batch:       # no drafts (drafter down or out of room): plain decode
            s.gamma = len(s.drafts) if s.drafts else 0


class BatchParallelSD(SequentialSD):

    def __init__(self, drafter: DrafterManager, lengths: DraftLength, sub_batches: SubBatches,
                 draft_ahead: bool = False):
        super().__init__(drafter, lengths, draft_ahead, name="psd")
        self.sub_batches = sub_batches
        self._to_draft: set[str] = set()
        self._running: list[Sequence] = []

    def schedule(self, scheduler: Scheduler) -> list[ScheduledSeq]:
        self._running = scheduler.running
        self._refresh()
        _, self._to_draft = self.sub_batches.begin_step()
        return scheduler.schedule(self._draft_length, skip=self._to_draft)

    def _draft_length(self, seq: Sequence) -> int:
        # Verify what was drafted for it last step; with nothing in hand, draft in line.
        return self.sub_batches.peek_len(seq.request_id, len(seq)) or self.lengths(seq)

    def _refresh(self) -> None:
        # Only requests that speculate take turns; the others decode every step.
        decoding = {s.request_id for s in self._running if s.num_uncomputed == 1 and s.speculates}
        for side in self.sub_batches.members:
            for gone in side - decoding:
                self.sub_batches.leave(gone)
        for rid in decoding:
            self.sub_batches.join(rid)
        self.sub_batches.rebalance()

    def propose(self, batch: list[ScheduledSeq], step) -> None:
        for s in batch:
            p = self.sub_batches.take(s.seq.request_id, len(s.seq))
            if p is not None and s.gamma:
                s.drafts = p.tokens[:s.gamma]
                s.draft_probs = None if p.probs is None else p.probs[:s.gamma]
        if any(s.gamma and s.drafts is None for s in batch):
            self.sub_batches.counters.fallback_steps += 1
        super().propose(batch, step)        # the fallback: in line

    @contextlib.contextmanager
    def overlap(self, step) -> Iterator[None]:
        """The other sub-batch is drafted while the body (the target's forward) runs. Its
        proposal is collected whatever the body does, so the drafter's protocol stays in step."""
        t0 = time.perf_counter()
        in_flight = self._start_drafting()
        step.t_transport_s += time.perf_counter() - t0
        try:
            yield
        finally:
            if in_flight is not None:
                t0 = time.perf_counter()
                self._finish_drafting(*in_flight, step)
                step.t_transport_s += time.perf_counter() - t0
        self.sub_batches.end_step()

    def _start_drafting(self):
        seqs = [s for s in self._running if s.request_id in self._to_draft
                and s.status is Status.RUNNING and s.num_uncomputed == 1]
        wanted = [(s, g) for s in seqs if (g := self.lengths(s)) > 0]
        if not wanted:
            return None
        pending = self.drafter.propose_async(wanted)
        return (pending, [s for s, _ in wanted], [len(s) for s, _ in wanted]) if pending is not None else None

    def _finish_drafting(self, pending, seqs: list[Sequence], lengths: list[int], step) -> None:
        got = self.drafter.collect(pending)
        if got is None:
            return
        step.t_draft_s += self.drafter.last_propose_s   # time the worker spent, overlapped
        step.overlapped = True
        self.sub_batches.counters.overlapped_steps += 1
        for seq, length, proposal in zip(seqs, lengths, got):
            take(seq, proposal)
            if proposal.tokens:
                self.sub_batches.store(seq.request_id, length, proposal)

    def forget(self, seq_id: str) -> None:
        self.sub_batches.leave(seq_id)

    def reset(self) -> None:
        """Leaving batch-parallel mode: no sub-batches, no proposals kept (counters stay)."""
        if any(self.sub_batches.members):
            self.sub_batches.clear()


def build_strategies(drafter: DrafterManager | None, ngram: DrafterManager | None, lengths: DraftLength,
                     sub_batches: SubBatches, draft_ahead: bool = False) -> dict:
    """The engine's strategies by mode name: plain decoding always; sd and psd over the drafter
    (the n-gram proposer, when it is the only one, drafts for sd); "ngram", sequential SD over
    an n-gram proposer held beside a drafter model (mode auto chooses per step)."""
    out = {"ar": PlainDecoding()}
    if drafter is not None:
        out["sd"] = SequentialSD(drafter, lengths, draft_ahead)
        out["psd"] = BatchParallelSD(drafter, lengths, sub_batches, draft_ahead)
    if ngram is not None:
        out["ngram"] = SequentialSD(ngram, lengths, name="ngram")
    return out


def take(seq: Sequence, proposal: Proposal) -> None:
    if proposal.error is not None:
        seq.spec_disabled = True       # the drafter cannot serve it; its output is unaffected
