"""Drafting that costs nothing: n-gram (prompt lookup) proposals.

The continuation of the most recent earlier occurrence of the sequence's last n tokens, in its
prompt and its output so far, for the longest n in [min_n, max_n] that occurs. Code edits,
retrieval answers and structured text repeat their input often; free text rarely, and then
nothing is proposed (the step decodes plainly).

Each sequence keeps an index from n-gram to where it last ended, updated with the new tokens
only (never a rescan of the context): the n-grams ending before the sequence's last token, so a
lookup of the suffix finds strictly earlier occurrences.

A sampled request gets one-hot draft distributions: rejection sampling then accepts a drafted
token x with probability p(x) and resamples from p without x, exactly the target's distribution.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from backend.speculation.proposer import (Desynchronised, Done, DraftRequest, Proposal, ProposerStats,
                                          common_prefix_len)


@dataclass
class _Index:
    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)   # n-gram -> last end position
    indexed: int = 0               # n-grams ending before this position are in `ends`

    def extend(self, new_tokens: list[int]) -> None:
        toks = self.tokens
        toks.extend(new_tokens)
        for end in range(self.indexed, len(toks) - 1):     # n-grams ending before the last token
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.ends[tuple(toks[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, len(toks) - 1)

    def lookup(self, gamma: int) -> list[int]:
        """Up to `gamma` tokens that followed the longest earlier occurrence of the suffix."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            end = self.ends.get(tuple(toks[len(toks) - n:]))
            if end is not None:
                return toks[end + 1:end + 1 + gamma]
        return []


class NgramProposer:
    """A :class:`~backend.speculation.proposer.Proposer` with no model, no device, no KV: none
    of the optional capabilities (it holds no memory to lend, no process to stop)."""

    def __init__(self, vocab_size: int, min_n: int = 1, max_n: int = 4, device: str | torch.device = "cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.vocab_size = vocab_size
        self.min_n, self.max_n = min_n, max_n
        self.device = torch.device(device)
        self._seqs: dict[str, _Index] = {}
        self._last_propose_s = 0.0

    def propose_async(self, requests: list[DraftRequest]) -> Done:
        return Done(requests, self.propose(requests))

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        t0 = time.perf_counter()
        out = []
        for req in requests:
            try:
                ix = self._sync(req)
            except Desynchronised:
                self.free(req.seq_id)
                out.append(Proposal([], None, resync=True))
                continue
            tokens = ix.lookup(req.gamma)
            probs = None
            if tokens and not req.params.greedy:
                probs = torch.zeros(len(tokens), self.vocab_size, device=self.device)
                probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            out.append(Proposal(tokens, probs))
        self._last_propose_s = time.perf_counter() - t0
        return out

    def _sync(self, req: DraftRequest) -> _Index:
        ix = self._seqs.get(req.seq_id)
        if ix is None or req.start == 0:
            ix = self._seqs[req.seq_id] = _Index(self.min_n, self.max_n)
        if req.start != len(ix.tokens):
            raise Desynchronised(f"sequence {req.seq_id!r}: tokens from position {req.start}, "
                                 f"the proposer holds {len(ix.tokens)}")
        ix.extend(req.new_tokens)
        return ix

    def free(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def stats(self) -> ProposerStats:
        return ProposerStats(last_propose_s=self._last_propose_s, num_sequences=len(self._seqs))


class NgramShadow:
    """What n-gram drafts would have matched, measured on every step whatever the step ran.

    Before a step, each speculating sequence has the proposal the n-gram lookup would make (up to
    `gamma` tokens); after it, the tokens the step committed are compared with it, position by
    position up to the first mismatch. Committed tokens follow the target's distribution whatever
    proposed them (speculation is lossless), so a drafted token matches with probability p(x), the
    chance rejection sampling accepts it: ``matched / compared`` estimates the n-gram drafts'
    per-position acceptance before any n-gram step has run. A sequence with no proposal counts as
    one compared, none matched (its n-gram step would decode it plainly)."""

    def __init__(self, gamma: int, min_n: int = 1, max_n: int = 4):
        self.gamma, self.min_n, self.max_n = gamma, min_n, max_n
        self._seqs: dict[str, tuple[_Index, list[int]]] = {}   # id -> (index, its next proposal)

    def observe(self, sequences) -> tuple[int, int]:
        """(matched, compared) positions over the tokens `sequences` (the running ones, each
        with ``request_id``, ``token_ids``, ``speculates``) committed since the last call."""
        matched = compared = 0
        seen = set()
        for seq in sequences:
            if not seq.speculates:
                continue
            sid = seq.request_id
            seen.add(sid)
            held = self._seqs.get(sid)
            toks = seq.token_ids
            if held is None or len(held[0].tokens) > len(toks):
                ix = _Index(self.min_n, self.max_n)
                ix.extend(toks)
            else:
                ix, proposal = held
                new = toks[len(ix.tokens):]
                if not new:
                    continue
                m, c = _prefix_match(proposal, new)
                matched, compared = matched + m, compared + c
                ix.extend(new)
            self._seqs[sid] = (ix, ix.lookup(self.gamma))
        for sid in [s for s in self._seqs if s not in seen]:
            del self._seqs[sid]
        return matched, compared


def _prefix_match(proposal: list[int], committed: list[int]) -> tuple[int, int]:
    """(matched, compared): positions compared up to and including the first mismatch (or as
    far as both reach), of them matched."""
    if not proposal:
        return 0, 1
    m = common_prefix_len(proposal, committed)
    return m, m + 1 if m < min(len(proposal), len(committed)) else m
