"""Verify: from one forward's logits to the tokens each sequence commits this step.

Tokens a request may not produce yet (EOS and stop tokens before ``min_tokens``) are masked
first; greedy requests take the argmax, sampled ones draw from their processed distribution, and
drafts are accepted exactly (:mod:`backend.sampling.verification`). Each request's decision
stands alone: one whose logits are not finite, or whose sampling raises, gets its exception back
instead of tokens, and the others are decided as if it were not there.

A request that asks for logprobs gets them from the target's rows that decided its tokens, also
for drafts it accepted (speculation does not change them): the processed distribution it sampled
from, or, for a greedy request, the log-softmax of its (masked) logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.batching.scheduler import ScheduledSeq
from backend.engine.commit import banned_tokens
from backend.engine.outputs import TokenLogprob
from backend.sampling.sampler import processed_probs, sample
from backend.sampling.verification import verify_greedy, verify_rejection

Rows = list[tuple[int, int]]      # per scheduled sequence: (first logits row, row count)


@dataclass
class Decided:
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None     # when the request asked for them


def decide(batch: list[ScheduledSeq], rows: Rows, logits: torch.Tensor,
           eos_token_ids: tuple[int, ...]) -> list[Decided | Exception | None]:
    """Per scheduled sequence: the tokens it commits, the exception that stopped it, or None when
    this step decides nothing for it (a prefill chunk that does not reach its end)."""
    if not logits.numel():
        return [None] * len(batch)
    # Rows the model made non-finite fail their request (checked before masking, which writes
    # -inf on purpose). A row's sum is inf or NaN when any entry is: one reduction.
    finite = torch.isfinite(logits.sum(dim=-1))
    finite = finite.tolist() if not bool(finite.all()) else None
    _mask_banned(batch, rows, logits, eos_token_ids)
    argmax = logits.argmax(dim=-1).tolist()
    probs = _sampling_probs(batch, rows, logits)
    out: list[Decided | Exception | None] = []
    for i, (s, (first, n)) in enumerate(zip(batch, rows)):
        if not n:
            out.append(None)
            continue
        try:
            if finite is not None and not all(finite[first:first + n]):
                raise FloatingPointError("the model produced non-finite logits")
            tokens = _verify(s, argmax[first:first + n], probs.get(i))
            want = s.seq.params.logprobs
            out.append(Decided(tokens, None if want is None else
                               _logprobs(logits[first:first + len(tokens)], probs.get(i), tokens, want)))
        except Exception as e:  # noqa: BLE001 - this request alone
            out.append(e)
    return out


def _verify(s: ScheduledSeq, argmax: list[int], probs) -> list[int]:
    seq = s.seq
    drafts = s.drafts if s.gamma else []
    if seq.params.greedy:
        return verify_greedy(argmax, drafts)
    if isinstance(probs, Exception):
        raise probs
    if drafts:
        return verify_rejection(probs, s.draft_probs.to(probs.device), drafts, seq.generator)
    return [sample(probs[0], seq.generator)]


def _logprobs(logits: torch.Tensor, probs: torch.Tensor | None, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """Per decided token: its logprob and rank, and the top_n most likely, from the distribution
    that decided it (the rows of `probs` for a sampled request, else the logits' log-softmax)."""
    lp = torch.log_softmax(logits.float(), dim=-1) if probs is None else probs[:len(tokens)].log()
    idx = torch.tensor(tokens, device=lp.device)
    chosen = lp[torch.arange(len(tokens), device=lp.device), idx]
    ranks = ((lp > chosen[:, None]).sum(dim=-1) + 1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n:
        values, indices = torch.topk(lp, top_n, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return [TokenLogprob(tok, lp_j, rank, top_j)
            for tok, lp_j, rank, top_j in zip(tokens, chosen.tolist(), ranks, top)]


def _mask_banned(batch, rows: Rows, logits: torch.Tensor, eos: tuple[int, ...]) -> None:
    """Banned tokens get probability 0 in the distribution that decides them (greedy too)."""
    cells_r, cells_t = [], []
    for s, (first, n) in zip(batch, rows):
        if n and s.seq.params.min_tokens > s.seq.num_output_tokens:
            for j in range(n):
                for t in banned_tokens(s.seq, eos, ahead=j):
                    cells_r.append(first + j)
                    cells_t.append(t)
    if cells_r:
        logits[torch.tensor(cells_r, device=logits.device),
               torch.tensor(cells_t, device=logits.device)] = float("-inf")


def _sampling_probs(batch, rows: Rows, logits: torch.Tensor) -> dict[int, torch.Tensor | Exception]:
    """Per batch index of a sampled request: its rows' distributions [n, V], computed in one
    batch (or one request at a time, if the batch raises: its error fails that request alone)."""
    sampled = [(i, first, n) for i, (s, (first, n)) in enumerate(zip(batch, rows))
               if n and not s.seq.params.greedy]
    if not sampled:
        return {}
    row_ids = [r for _, first, n in sampled for r in range(first, first + n)]
    row_params = [batch[i].seq.params for i, _, n in sampled for _ in range(n)]
    try:
        p = processed_probs(logits[row_ids], row_params)
    except Exception:  # noqa: BLE001 - one request's parameters: compute them one by one
        out: dict[int, torch.Tensor | Exception] = {}
        for i, first, n in sampled:
            try:
                out[i] = processed_probs(logits[first:first + n], [batch[i].seq.params] * n)
            except Exception as e:  # noqa: BLE001
                out[i] = e
        return out
    out, k = {}, 0
    for i, _, n in sampled:
        out[i] = p[k:k + n]
        k += n
    return out
