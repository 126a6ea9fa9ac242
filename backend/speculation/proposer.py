"""One interface for whatever proposes drafts: the in-process drafter, the drafter worker on its
own device and the n-gram proposer all implement :class:`Proposer` (propose, free, stats), so the
manager and the strategies above them never ask which one they hold. What only some can do is a
capability of its own, which the manager asks for before using it: :class:`DeviceResident` (a
drafter model's device memory, lent and taken back) and :class:`Remote` (a process to refresh
stats from and to stop).

The protocol is deliberately narrow so that a proposer can live in another process or on another
device: each request carries, per sequence, only the tokens committed since its previous request
and where they start; the proposer keeps its own copy of every sequence, and says so
(``Proposal.resync``) when it lacks one, instead of drafting from a wrong context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from backend.sampling.params import SamplingParams


@dataclass
class DraftRequest:
    seq_id: str
    new_tokens: list[int]          # committed since this sequence's previous DraftRequest
    gamma: int
    params: SamplingParams
    start: int = 0                 # position of new_tokens[0] in the sequence
    ahead: bool = False            # after proposing, pre-draft the next round (a worker does;
                                   # in line it would only delay the step: see draft_ahead.py)
    num_prompt_tokens: int = 0     # where the output begins (the penalties tell them apart)


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None     # [len(tokens), V] draft distributions; None for greedy requests
    error: str | None = None       # the proposer could not serve this request (and forgot it)
    resync: bool = False           # the proposer lacks this sequence's tokens: send them all again


def common_prefix_len(drafted: list[int], committed: list[int]) -> int:
    """How many leading drafted tokens the committed ones confirm (up to the shorter of the two)."""
    n = 0
    for d, c in zip(drafted, committed):
        if d != c:
            break
        n += 1
    return n


class Desynchronised(RuntimeError):
    """A request's tokens do not continue what the proposer holds for that sequence."""


class Pending(Protocol):
    """Proposals on their way: ``result()`` blocks until they are here."""
    requests: list[DraftRequest]

    def result(self) -> list[Proposal]: ...


class Done:
    """Proposals computed in line: ``result()`` just returns them."""

    def __init__(self, requests: list[DraftRequest], proposals: list[Proposal]):
        self.requests = requests
        self._proposals = proposals

    def result(self) -> list[Proposal]:
        return self._proposals


@dataclass(frozen=True)
class ProposerStats:
    """What a proposer reports of itself, in one reading."""
    last_propose_s: float = 0.0    # time the last proposal took (on the proposer's device)
    last_catchup_s: float = 0.0    # of it, the catch-up forward for tokens it had not seen
    catchup_tokens: int = 0        # tokens re-fed to rebuild its KV cache (the switching cost)
    num_sequences: int = 0         # sequences it holds
    kv_usage: float = 0.0          # of its KV pool (0 for a proposer without one)
    ahead: dict = field(default_factory=dict)   # draft-ahead counters (AheadStats.as_dict); {} if none
    cpu_s: float = 0.0             # CPU seconds of the proposer's own process (0: it runs in the engine's)


@runtime_checkable
class Proposer(Protocol):
    """What every proposer does: propose, forget a sequence, report."""

    def propose_async(self, requests: list[DraftRequest]) -> Pending: ...
    def free(self, seq_id: str) -> None: ...
    def stats(self) -> ProposerStats: ...


@runtime_checkable
class DeviceResident(Protocol):
    """A proposer whose weights and KV pool hold device memory, which it can lend and take back."""

    def loaded_bytes(self) -> int:
        """Bytes it holds on its device with its weights there (weights + KV pool)."""
    def offload(self) -> int:
        """Weights to host memory, KV pool released; returns the bytes freed on its device."""
    def reload_async(self):
        """Weights back; a future whose ``done()`` never blocks and ``result()`` is the seconds
        the reload took."""


@runtime_checkable
class Remote(Protocol):
    """A proposer in a process of its own: its stats arrive with its replies (or on asking),
    and it has a process to stop."""

    def refresh_stats(self) -> None: ...
    def close(self, timeout_s: float = 5.0) -> None: ...
