"""The requests the step thread holds, from admission to their end.

New requests come in from the intake's inbox and join the scheduler; a request ends (stop,
length, abort, error) by leaving the scheduler, every strategy and proposer that knows it, and
the intake's count of what runs.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from backend.batching.scheduler import Scheduler
from backend.batching.sequence import Sequence
from backend.engine.commit import output_of
from backend.engine.intake import Intake
from backend.engine.outputs import EngineStats, RequestOutput

log = logging.getLogger("nightdraft.engine")


class Requests:
    def __init__(self, intake: Intake, scheduler: Scheduler, stats: EngineStats,
                 forget: list[Callable[[str], None]], on_arrival: Callable[[Sequence], None] | None = None):
        """`forget`: what must drop a finished request's state (strategies, proposers);
        `on_arrival`: told of each admitted request (mode auto's demand estimate)."""
        self.intake = intake
        self.scheduler = scheduler
        self.stats = stats
        self._forget = forget
        self._on_arrival = on_arrival
        self._seqs: dict[str, Sequence] = {}  # ids the step thread knows about

    def admit(self) -> list[RequestOutput]:
        """Take in what arrived: new requests join the scheduler, aborted ones finish."""
        outputs = []
        for kind, item in self.intake.drain():
            if kind == "add":
                self._seqs[item.request_id] = item
                self.stats.prompt_tokens += item.num_prompt_tokens
                if self._on_arrival is not None:
                    self._on_arrival(item)
                self.scheduler.add(item)
            elif (seq := self._seqs.get(item)) is not None:
                self.finish(seq, "abort")
                outputs.append(output_of(seq, []))
        return outputs

    def finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        for forget in self._forget:
            forget(seq.request_id)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self._seqs.pop(seq.request_id, None)
        self.intake.finished(seq.request_id)

    def fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End one request with an error (its resources freed); the step goes on without it."""
        self.stats.request_errors += 1
        if not seq.is_finished:
            self.finish(seq, "error")
        return output_of(seq, [], error=message)

    def fail_unfittable(self) -> list[RequestOutput]:
        """Nothing could be scheduled: the head of the queue cannot fit even into an empty cache
        (max_model_len is capped at the pool's size, so this should not happen)."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        log.error("request %s needs more KV blocks than the cache has; failing it", seq.request_id)
        return [self.fail(seq, "the request needs more KV cache than the server has")]
