"""Draft-ahead (PEARL's post-verify drafting): the drafter drafts the next round while the target
verifies this one, for the outcome it bets on.

After a proposal d_1..d_gamma has been sent, the drafter worker (on its own device, otherwise
idle until the verdict) goes on as if every draft will be accepted: it feeds d_gamma, takes its
own next token x as its guess of the target's bonus token, and drafts gamma more tokens after x.
When the next request for that sequence arrives with exactly d_1..d_gamma, x as its new tokens,
the pre-draft is the proposal, with no drafter forward on the critical path (a hit); with any
other outcome it is dropped and the drafter drafts in line as before (a miss). A pre-draft is
only a proposal, verified like any other, so the output distribution does not change; its
draws come from the sequence's own generator, independent of the target's. The K/V the
pre-draft wrote stays as a speculative tail: whatever prefix of it the verdict confirms is kept
(the drafter's usual rule), the rest is truncated.

With acceptance alpha per position, a hit needs all gamma drafts accepted and the bonus
guessed: about alpha ** (gamma + 1). :class:`AheadStats` counts tries and hits by accepted
length, and the drafter seconds that hits took off the critical path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.speculation.proposer import common_prefix_len


@dataclass
class PreDraft:
    start: int                      # position of expect[0] in the sequence
    expect: list[int]               # the new tokens the bet is on: d_1..d_gamma, x
    tokens: list[int]               # the next round's drafts, after x
    probs: torch.Tensor | None      # their draft distributions (None: greedy)
    seconds: float                  # what drafting them took

    def matches(self, start: int, new_tokens: list[int], gamma: int) -> bool:
        return start == self.start and new_tokens == self.expect and 0 < gamma <= len(self.tokens)

    def accepted(self, start: int, new_tokens: list[int]) -> int | None:
        """How many of the bet-on drafts the verdict accepted (None: not this round's verdict)."""
        if start != self.start:
            return None
        return common_prefix_len(self.expect[:-1], new_tokens[:-1])


@dataclass
class AheadStats:
    rounds: int = 0                 # verdicts that met a pre-draft
    hits: int = 0
    interrupted: int = 0            # pre-drafts cut short by the next message
    hidden_s: float = 0.0           # drafter seconds of the pre-drafts that were used
    by_accepted: dict[int, list[int]] = field(default_factory=dict)   # k -> [rounds, hits]

    def record(self, accepted: int, hit: bool, seconds: float) -> None:
        self.rounds += 1
        row = self.by_accepted.setdefault(accepted, [0, 0])
        row[0] += 1
        if hit:
            self.hits += 1
            row[1] += 1
            self.hidden_s += seconds

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "hits": self.hits, "interrupted": self.interrupted,
                "hit_rate": self.hits / self.rounds if self.rounds else None,
                "hidden_s": self.hidden_s,
                "by_accepted": {str(k): {"rounds": n, "hits": h}
                                for k, (n, h) in sorted(self.by_accepted.items())}}
