"""Drafter workers with a bug planted, for negative controls that go through the real engine.

The worker is a spawned process, so a monkeypatch in the test's process does not reach it. A
test replaces ``backend.speculation.worker._worker_main`` (the process's target, looked up when a
worker starts) by one of these; the spawned child imports this module by name, plants the bug in
its own Drafter, then runs the real worker loop.
"""
from __future__ import annotations


def worker_main_serving_pre_drafts_off_by_one(conn, spec, probs_buffer) -> None:
    """A pre-draft hit is served with its draft distributions one position early: draft e_j is
    reported with the row the drafter drew the token before it from (for e_1: the bet's x)."""
    from backend.speculation import worker
    from backend.speculation.drafter import Drafter

    real_draft, real_use = Drafter._draft, Drafter._use_pre_draft

    def recording_draft(self, requests, active, proposals, *args, **kw):
        out = real_draft(self, requests, active, proposals, *args, **kw)
        rows = self.__dict__.setdefault("_rows_drafted", {})     # seq id -> its latest draft rows
        for i in active:
            if proposals[i].probs is not None:
                rows[requests[i].seq_id] = proposals[i].probs
        return out

    def served_off_by_one(self, req, pre, proposals, i):
        served = real_use(self, req, pre, proposals, i)
        if served and pre.probs is not None:
            bet_rows = self._rows_drafted[req.seq_id]     # x, e_1, ..., e_gamma: the pre-draft's
            assert bet_rows.shape[0] == len(pre.tokens) + 1, "not the pre-draft's rows"
            proposals[i].probs = bet_rows[:req.gamma]
        return served
    Drafter._draft, Drafter._use_pre_draft = recording_draft, served_off_by_one
    worker._worker_main(conn, spec, probs_buffer)
