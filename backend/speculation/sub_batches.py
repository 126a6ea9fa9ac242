"""Batch-parallel SD's bookkeeping: two sub-batches that take turns being verified.

Each decoding request belongs to exactly one of two sub-batches. Each step the target verifies
the sub-batch whose turn it is, using the proposals drafted for it during the previous step,
while the drafter (on its own device) drafts the other one; then the roles swap. A request joins
the smaller sub-batch when it starts decoding and leaves when it finishes, is aborted or is
preempted, so neither side starves and the two stay balanced.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.speculation.drafter import Proposal


@dataclass
class PsdCounters:
    steps: int = 0
    fallback_steps: int = 0        # the verified sub-batch had no proposals: drafted in line (SD)
    unbalanced_steps: int = 0      # one sub-batch empty while the other held two or more
    overlapped_steps: int = 0      # a draft of the other sub-batch ran during the verify


@dataclass
class _Pending:
    length: int                    # the sequence's length the proposal was drafted from
    proposal: Proposal


@dataclass
class SubBatches:
    members: tuple[set[str], set[str]] = field(default_factory=lambda: (set(), set()))
    turn: int = 0
    counters: PsdCounters = field(default_factory=PsdCounters)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def clear(self) -> None:
        """Leaving batch-parallel mode: forget members and proposals, keep the counters."""
        self.members[0].clear()
        self.members[1].clear()
        self._pending.clear()

    def side_of(self, seq_id: str) -> int | None:
        for side in (0, 1):
            if seq_id in self.members[side]:
                return side
        return None

    def join(self, seq_id: str) -> int:
        """Put a newly decoding request into the smaller sub-batch."""
        side = self.side_of(seq_id)
        if side is None:
            side = 0 if len(self.members[0]) <= len(self.members[1]) else 1
            self.members[side].add(seq_id)
        return side

    def leave(self, seq_id: str) -> None:
        self.members[0].discard(seq_id)
        self.members[1].discard(seq_id)
        self._pending.pop(seq_id, None)

    def begin_step(self) -> tuple[set[str], set[str]]:
        """(to verify, to draft) for this step; an empty turn passes to the other side."""
        a, b = self.members[self.turn], self.members[1 - self.turn]
        if not a and b:
            self.turn = 1 - self.turn
            a, b = b, a
        self.counters.steps += 1
        if (not a or not b) and len(a) + len(b) >= 2:
            self.counters.unbalanced_steps += 1
        return set(a), set(b)

    def end_step(self) -> None:
        self.turn = 1 - self.turn

    def store(self, seq_id: str, length: int, proposal: Proposal) -> None:
        if self.side_of(seq_id) is not None:
            self._pending[seq_id] = _Pending(length, proposal)

    def take(self, seq_id: str, length: int) -> Proposal | None:
        """The proposal drafted for this sequence at its current length, if any."""
        pending = self._pending.pop(seq_id, None)
        if pending is None or pending.length != length:
            return None
        return pending.proposal

    def peek_len(self, seq_id: str, length: int) -> int:
        pending = self._pending.get(seq_id)
        return len(pending.proposal.tokens) if pending and pending.length == length else 0

    def rebalance(self) -> None:
        """Move requests from the larger side to the smaller one when they differ by two or more
        (requests that finish unevenly would otherwise leave one side to do all the work)."""
        big = 0 if len(self.members[0]) > len(self.members[1]) else 1
        while len(self.members[big]) - len(self.members[1 - big]) >= 2:
            # Prefer a request without a proposal in hand, so no drafted work is wasted.
            movable = sorted(self.members[big], key=lambda s: s in self._pending)
            moved = movable[0]
            self.members[big].discard(moved)
            self.members[1 - big].add(moved)
            self._pending.pop(moved, None)
