"""How a step speculates: plain decoding, sequential SD or batch-parallel SD, behind one interface.

A strategy takes the step's plan (:class:`~backend.step.StepPlan`), chooses the sequences the
step feeds and how many drafts each verifies (``schedule``), puts the drafts in their hands
(``propose``), and may keep the drafter busy with other sequences while the target runs
(``alongside``); the last two report what their drafting did (:class:`~backend.step.Drafting`).
The engine's step is the same for all three::

    batch = strategy.schedule(scheduler, plan)
    drafting = strategy.propose(batch, plan)
    outputs, side = strategy.alongside(plan, lambda: ... forward, verify, commit ...)

Batch-parallel SD (MineDraft) keeps two sub-batches: while the target verifies one with the
drafts made for it during the previous step, the drafter (on its own device) drafts the other;
then they swap. A sub-batch with nothing in hand drafts in line, as sequential SD does.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

from backend.batching.scheduler import ScheduledSeq, Scheduler
from backend.batching.sequence import Sequence, Status
from backend.mode import Mode
from backend.speculation.manager import DrafterManager
from backend.speculation.placement import CpuPlacement
from backend.speculation.proposer import Proposal
from backend.speculation.sub_batches import SubBatches
from backend.step import Drafting, StepPlan

T = TypeVar("T")


class PlainDecoding:
    # A forward of this many tokens that feeds a prompt chunk (a sequence feeds more than a
    # decode or verification takes; any forward, where nothing is captured) runs on the
    # drafter's CPU cores too while the drafter waits: its compute dwarfs the cost of sharing a
    # core; so does a forward of any size that feeds only prompts. Not a small forward beside
    # decoding sequences: split over a core the drafter is about to use, it waits for it
    # (sequential SD at concurrency 1 ran many times slower that way). Not a decode or
    # verification step, however big: a few tokens a sequence, and where borrowing would pay
    # for one was never measured (its graph runs at any thread count, backend/model/captured.py).
    BORROW_FROM_TOKENS = 512

    def __init__(self, placement: CpuPlacement | None = None, captured_query_len: int = 0):
        """`placement`: the CPU placement whose drafter cores a big forward may borrow (None:
        never); `captured_query_len`: the most tokens a sequence feeds in a captured decode or
        verification step (0: nothing is captured)."""
        self.placement = placement
        self.captured_query_len = captured_query_len
        self._borrow = False          # this step's forward borrows the drafter's cores

    def _plan_borrowing(self, batch: list[ScheduledSeq]) -> None:
        if self.placement is None:        # nothing to borrow (a GPU, or no drafter worker)
            return
        fed = [s.num_new + (len(s.drafts) if s.drafts else 0) for s in batch]
        # A step that feeds only prompt chunks borrows at any size: nothing decodes, so nothing
        # is drafted before it or beside it, and a prefill is compute the second core halves
        # (mode auto lends for such a step whatever it plays, engine/adaptive.py). Checked last:
        # a decode or verification step stops at the first test.
        self._borrow = (bool(fed) and max(fed) > self.captured_query_len
                        and (sum(fed) >= self.BORROW_FROM_TOKENS
                             or all(s.num_new > 1 and not s.drafts for s in batch)))

    def schedule(self, scheduler: Scheduler, plan: StepPlan) -> list[ScheduledSeq]:
        return scheduler.schedule(lambda seq: 0)

    def propose(self, batch: list[ScheduledSeq], plan: StepPlan) -> Drafting:
        self._plan_borrowing(batch)
        return Drafting()

    def alongside(self, plan: StepPlan, body: Callable[[], T]) -> tuple[T, Drafting]:
        """Run `body` (the target's forward, verification and commit) and what drafting goes on
        meanwhile: nothing, here, so a big forward borrows the drafter's cores."""
        p = self.placement
        if not self._borrow or p.lent:
            return body(), Drafting()
        with p.borrowing():
            return body(), Drafting(forward_cores=p.target_cores_now())

    def forget(self, seq_id: str) -> None:
        pass

    def reset(self) -> None:
        pass


class SequentialSD(PlainDecoding):
    """Draft every scheduled sequence in line, then verify all of them in one target forward."""

    def __init__(self, drafter: DrafterManager, max_model_len: int, draft_ahead: bool = False,
                 placement: CpuPlacement | None = None, captured_query_len: int = 0):
        # With draft-ahead the worker drafts the next round while the target verifies: its
        # cores are busy then.
        super().__init__(placement if not draft_ahead else None, captured_query_len)
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.draft_ahead = draft_ahead      # the worker pre-drafts the next round meanwhile

    def schedule(self, scheduler: Scheduler, plan: StepPlan) -> list[ScheduledSeq]:
        return scheduler.schedule(lambda seq: plan.draft_length(seq, self.max_model_len))

    def propose(self, batch: list[ScheduledSeq], plan: StepPlan) -> Drafting:
        """Draft, now, every scheduled sequence that wants drafts and has none in hand."""
        want = [s for s in batch if s.gamma > 0 and s.drafts is None]
        seconds = 0.0
        if want:
            t0 = time.perf_counter()
            got = self.drafter.collect(self.drafter.propose_async([(s.seq, s.gamma) for s in want],
                                                                  ahead=self.draft_ahead))
            seconds = time.perf_counter() - t0
            for s, p in zip(want, got or ()):
                take(s.seq, p)
                if p.tokens:
                    s.drafts, s.draft_probs = p.tokens, p.probs
        for s in batch:       # no drafts (drafter down or out of room): plain decode
            s.gamma = len(s.drafts) if s.drafts else 0
        self._plan_borrowing(batch)
        return Drafting(draft_s=seconds)


class BatchParallelSD(SequentialSD):

    def __init__(self, drafter: DrafterManager, max_model_len: int, sub_batches: SubBatches,
                 draft_ahead: bool = False, placement: CpuPlacement | None = None,
                 captured_query_len: int = 0):
        super().__init__(drafter, max_model_len, draft_ahead, placement, captured_query_len)
        self.sub_batches = sub_batches
        self._to_draft: set[str] = set()
        self._running: list[Sequence] = []

    def schedule(self, scheduler: Scheduler, plan: StepPlan) -> list[ScheduledSeq]:
        self._running = scheduler.running
        self._refresh()
        _, self._to_draft = self.sub_batches.begin_step()

        def draft_length(seq: Sequence) -> int:
            # Verify what was drafted for it last step; with nothing in hand, draft in line.
            return (self.sub_batches.peek_len(seq.request_id, len(seq))
                    or plan.draft_length(seq, self.max_model_len))
        return scheduler.schedule(draft_length, skip=self._to_draft)

    def _refresh(self) -> None:
        # Only requests that speculate take turns; the others decode every step.
        decoding = {s.request_id for s in self._running if s.num_uncomputed == 1 and s.speculates}
        for side in self.sub_batches.members:
            for gone in side - decoding:
                self.sub_batches.leave(gone)
        for rid in decoding:
            self.sub_batches.join(rid)
        self.sub_batches.rebalance()

    def propose(self, batch: list[ScheduledSeq], plan: StepPlan) -> Drafting:
        for s in batch:
            p = self.sub_batches.take(s.seq.request_id, len(s.seq))
            if p is not None and s.gamma:
                s.drafts = p.tokens[:s.gamma]
                s.draft_probs = None if p.probs is None else p.probs[:s.gamma]
        if any(s.gamma and s.drafts is None for s in batch):
            self.sub_batches.counters.fallback_steps += 1
        return super().propose(batch, plan)        # the fallback: in line

    def alongside(self, plan: StepPlan, body: Callable[[], T]) -> tuple[T, Drafting]:
        """The other sub-batch is drafted while `body` (the target's forward) runs. Its proposal
        is collected whatever the body does, so the drafter's protocol stays in step. With
        nothing to draft beside it (a step of prompts after an idle engine, a sub-batch with
        nothing decoding) the drafter's cores wait, and the forward may borrow them."""
        t0 = time.perf_counter()
        in_flight = self._start_drafting(plan)
        transport_s = time.perf_counter() - t0
        if in_flight is None:
            out, side = super().alongside(plan, body)
        else:
            try:
                out = body()
            finally:
                t0 = time.perf_counter()
                side = self._finish_drafting(*in_flight)
                transport_s += time.perf_counter() - t0
        self.sub_batches.end_step()
        return out, side + Drafting(transport_s=transport_s)

    def _start_drafting(self, plan: StepPlan):
        seqs = [s for s in self._running if s.request_id in self._to_draft
                and s.status is Status.RUNNING and s.num_uncomputed == 1]
        wanted = [(s, g) for s in seqs if (g := plan.draft_length(s, self.max_model_len)) > 0]
        if not wanted:
            return None
        pending = self.drafter.propose_async(wanted)
        return (pending, [s for s, _ in wanted], [len(s) for s, _ in wanted]) if pending is not None else None

    def _finish_drafting(self, pending, seqs: list[Sequence], lengths: list[int]) -> Drafting:
        got = self.drafter.collect(pending)
        if got is None:
            return Drafting()
        self.sub_batches.counters.overlapped_steps += 1
        for seq, length, proposal in zip(seqs, lengths, got):
            take(seq, proposal)
            if proposal.tokens:
                self.sub_batches.store(seq.request_id, length, proposal)
        # the time the worker spent, overlapped
        return Drafting(draft_s=self.drafter.stats().last_propose_s, overlapped=True)

    def forget(self, seq_id: str) -> None:
        self.sub_batches.leave(seq_id)

    def reset(self) -> None:
        """Leaving batch-parallel mode: no sub-batches, no proposals kept (counters stay)."""
        if any(self.sub_batches.members):
            self.sub_batches.clear()


def build_strategies(drafter: DrafterManager | None, ngram: DrafterManager | None, max_model_len: int,
                     sub_batches: SubBatches, draft_ahead: bool = False,
                     placement: CpuPlacement | None = None, captured_query_len: int = 0
                     ) -> dict[Mode, PlainDecoding]:
    """The engine's strategies by the mode a plan names: plain decoding always; SD and PSD over
    the drafter (the n-gram proposer, when it is the only one, drafts for SD); NGRAM, sequential
    SD over an n-gram proposer held beside a drafter model (mode auto chooses per step).
    `placement`: the drafter worker's CPU cores, which a big forward borrows where nothing
    drafts meanwhile (plain decoding, sequential SD, batch-parallel SD when the other sub-batch
    has nothing to draft), if it feeds a sequence more than `captured_query_len` tokens (a
    prompt chunk)."""
    out: dict[Mode, PlainDecoding] = {Mode.AR: PlainDecoding(placement, captured_query_len)}
    if drafter is not None:
        out[Mode.SD] = SequentialSD(drafter, max_model_len, draft_ahead, placement, captured_query_len)
        out[Mode.PSD] = BatchParallelSD(drafter, max_model_len, sub_batches, draft_ahead,
                                        placement, captured_query_len)
    if ngram is not None:
        out[Mode.NGRAM] = SequentialSD(ngram, max_model_len, placement=placement,
                                       captured_query_len=captured_query_len)
    return out


def take(seq: Sequence, proposal: Proposal) -> None:
    if proposal.error is not None:
        seq.spec_disabled = True       # the drafter cannot serve it; its output is unaffected
