"""Verify: from one forward's logits to the tokens each sequence commits this step.

Tokens a request may not produce yet (EOS and stop tokens before ``min_tokens``) are masked
first, then what its grammar forbids (structured outputs) and what its logits processors do
(penalties, biases, bans: :mod:`backend.sampling.processors`), at every row: the row after k
drafts as plain decoding would see it had those drafts been committed. Greedy requests take
the argmax, sampled ones draw from their processed distribution, and drafts are accepted
exactly (:mod:`backend.sampling.verification`), all sampled requests of a step in one batch.
Each request's decision stands alone: one whose logits are not finite, or whose sampling
raises, gets its exception back instead of tokens, and the others are decided as if it were not
there.

A request that asks for logprobs gets them from the target's rows that decided its tokens, also
for drafts it accepted (speculation does not change them): the processed distribution it sampled
from, or, for a greedy request, the log-softmax of its (masked, processed) logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.batching.scheduler import ScheduledSeq
from backend.engine.commit import banned_tokens
from backend.engine.outputs import TokenLogprob
from backend.sampling.processors import Context, Row, process_logits
from backend.sampling.sampler import processed_probs
from backend.sampling.verification import verify_greedy, verify_sampled

Rows = list[tuple[int, int]]      # per scheduled sequence: (first logits row, row count)


@dataclass
class Decided:
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None     # when the request asked for them
    # The tokens end with one verification drew (the bonus, or the one after a rejected draft);
    # False when the step stops at an accepted draft, before a row that allows no token.
    drawn_last: bool = True

    @property
    def accepted(self) -> int:
        """Drafts this step accepted."""
        return len(self.tokens) - 1 if self.drawn_last else len(self.tokens)


def decide(batch: list[ScheduledSeq], rows: Rows, logits: torch.Tensor,
           eos_token_ids: tuple[int, ...]) -> list[Decided | Exception | None]:
    """Per scheduled sequence: the tokens it commits, the exception that stopped it, or None when
    this step decides nothing for it (a prefill chunk that does not reach its end)."""
    if not logits.numel():
        return [None] * len(batch)
    # Rows the model made non-finite fail their request (checked before masking, which writes
    # -inf on purpose). A row's sum is inf or NaN when any entry is: one reduction. The flags and
    # the greedy tokens reach the host together, in one transfer.
    finite = torch.isfinite(logits.sum(dim=-1))
    _mask_banned(batch, rows, logits, eos_token_ids)
    out: list = [None] * len(batch)
    _mask_grammar(batch, rows, logits, out)
    _process(batch, rows, logits, out)
    # After the masks, a row must leave some token possible (a grammar, allowed_token_ids,
    # bad_words and min_tokens together can ban every one).
    possible = torch.isfinite(logits.amax(dim=-1))
    finite, possible, argmax = torch.stack((finite.long(), possible.long(), logits.argmax(dim=-1))).tolist()
    todo = []
    ends_before: dict[int, int] = {}     # request -> its first row that allows no token
    for i, (first, n) in enumerate(rows):
        if not n or out[i] is not None:
            continue
        if not all(finite[first:first + n]):
            out[i] = FloatingPointError("the model produced non-finite logits")
        elif not possible[first]:
            out[i] = ValueError("no token is allowed at this position: structured_outputs, "
                                "allowed_token_ids, bad_words and min_tokens together exclude every token")
        else:
            if not all(possible[first:first + n]):
                # Row j (after drafts d_1..d_j) allows nothing: plain decoding would commit
                # d_1..d_j and fail one step later. The drafts stay verified (dropping them for
                # their value would bias the rows before); the empty rows get a placeholder, and
                # whatever is decided at row j or later is dropped, so the next step meets the
                # empty row at its start and fails as plain decoding does.
                ends_before[i] = possible[first:first + n].index(0)
                empty = [first + j for j in range(n) if not possible[first + j]]
                logits[torch.as_tensor(empty, device=logits.device)] = 0.0
            todo.append(i)
    greedy = [i for i in todo if batch[i].seq.params.greedy]
    if greedy:
        for i in greedy:
            first, n = rows[i]
            out[i] = verify_greedy(argmax[first:first + n], batch[i].drafts if batch[i].gamma else [])
    greedy_set = set(greedy)
    probs = _sample_all(batch, rows, logits, [i for i in todo if i not in greedy_set], out)
    for i, j in list(ends_before.items()):
        if isinstance(out[i], list) and len(out[i]) > j:
            out[i] = out[i][:j]
        else:
            del ends_before[i]
    for i in todo:
        if isinstance(out[i], list):
            want = batch[i].seq.params.logprobs
            tokens = out[i]
            try:
                out[i] = Decided(tokens, None if want is None else
                                 _logprobs(logits[rows[i][0]:rows[i][0] + len(tokens)], probs.get(i), tokens, want),
                                 drawn_last=i not in ends_before)
            except Exception as e:  # noqa: BLE001 - this request alone
                out[i] = e
    return out


def _sample_all(batch, rows: Rows, logits: torch.Tensor, sampled: list[int], out: list) -> dict[int, torch.Tensor]:
    """Decide every sampled request (into `out`) in one batch: their processed distributions,
    then exact verification of their drafts (plain sampling is the case without drafts). If the
    batch raises, each request is decided alone, so that an error fails only its own request;
    each draws its random numbers once, before, so that the retry does not change them.
    Returns each request's distributions (for logprobs)."""
    if not sampled:
        return {}
    uniforms = {i: torch.rand(len(batch[i].drafts if batch[i].gamma else ()) + 1, generator=batch[i].seq.generator,
                              device=logits.device) for i in sampled}
    try:
        return _sample_batch(batch, rows, logits, sampled, uniforms, out)
    except Exception:  # noqa: BLE001 - one request's parameters or drafts: isolate it
        probs = {}
        for i in sampled:
            try:
                probs |= _sample_batch(batch, rows, logits, [i], uniforms, out)
            except Exception as e:  # noqa: BLE001
                out[i] = e
        return probs


def _sample_batch(batch, rows: Rows, logits: torch.Tensor, sampled: list[int], uniforms: dict, out: list) -> dict[int, torch.Tensor]:
    row_ids = [r for i in sampled for r in range(rows[i][0], rows[i][0] + rows[i][1])]
    p = processed_probs(logits[row_ids], [batch[i].seq.params for i in sampled for _ in range(rows[i][1])])
    drafts = [batch[i].drafts if batch[i].gamma else [] for i in sampled]
    q_parts = [batch[i].draft_probs.to(p.device) for i, d in zip(sampled, drafts) if d]
    firsts, first = [], 0
    for i in sampled:
        firsts.append(first)
        first += rows[i][1]
    decided = verify_sampled(p, firsts, torch.cat(q_parts) if q_parts else None, drafts,
                             torch.cat([uniforms[i] for i in sampled]))
    for i, tokens in zip(sampled, decided):
        out[i] = tokens
    return {i: p[f:f + rows[i][1]] for i, f in zip(sampled, firsts)}


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


def _process(batch, rows: Rows, logits: torch.Tensor, out: list) -> None:
    """The logits processors (penalties, biases, bans) of the requests that ask for them, at
    each of their rows: row j of a request sees its output followed by its first j drafts, as
    plain decoding would had they been committed. A request whose processing fails fails alone
    (its exception in `out`)."""
    todo = [i for i, (s, (_, n)) in enumerate(zip(batch, rows)) if n and s.seq.params.processes_logits]
    if not todo:
        return
    try:
        _process_rows(batch, rows, logits, todo)
    except Exception:  # noqa: BLE001 - isolate the request at fault
        for i in todo:
            try:
                _process_rows(batch, rows, logits, [i])
            except Exception as e:  # noqa: BLE001
                out[i] = e


def _process_rows(batch, rows: Rows, logits: torch.Tensor, which: list[int]) -> None:
    contexts, row_ids, procs = [], [], []
    for i in which:
        s = batch[i]
        first, n = rows[i]
        drafts = s.drafts if s.gamma and s.drafts else []
        contexts.append(Context(s.seq.params, s.seq.token_ids, s.seq.num_prompt_tokens))
        for j in range(n):
            row_ids.append(first + j)
            procs.append(Row(len(contexts) - 1, drafts[:j]))
    process_logits(logits, row_ids, contexts, procs)


def score_prompts(scored: list, logits: torch.Tensor) -> None:
    """prompt_logprobs: ``scored`` lists (sequence, first position, count); `logits` holds those
    positions' rows in that order. Position p scores prompt token p + 1 under the target's own
    distribution (its log-softmax: no sampling parameter applies to a prompt), as vLLM does."""
    row = 0
    for seq, first, n in scored:
        tokens = seq.token_ids[first + 1:first + 1 + n]
        seq.prompt_logprobs += _logprobs(logits[row:row + n], None, tokens, seq.params.prompt_logprobs)
        row += n


def _mask_grammar(batch, rows: Rows, logits: torch.Tensor, out: list) -> None:
    """Structured outputs: every row of a constrained request gets its grammar's mask (the row
    after each draft, from the matcher with that draft accepted: the bonus row too). Every draft
    is verified: one the grammar refuses has target probability 0 at its row, so verification
    rejects it and draws its position from the residual, as for any draft (cutting drafts for
    their value, and sampling their position from the target, would bias sampled outputs)."""
    todo = [i for i, (s, (_, n)) in enumerate(zip(batch, rows)) if n and s.seq.grammar is not None]
    if not todo:
        return
    from backend.sampling.grammar import allocate_bitmask, allowed_tokens
    vocab = logits.shape[1]
    bitmask = allocate_bitmask(sum(rows[i][1] for i in todo), vocab)
    row_ids: list[int] = []
    for i in todo:
        s = batch[i]
        first, n = rows[i]
        try:
            filled = s.seq.grammar.fill_rows(s.drafts if s.gamma and s.drafts else [], bitmask, len(row_ids))
            assert filled == n, f"{filled} grammar masks for {n} rows"
        except Exception as e:  # noqa: BLE001 - this request's grammar alone
            out[i] = e
            continue
        row_ids += range(first, first + n)
    if row_ids:
        allowed = allowed_tokens(bitmask[:len(row_ids)], vocab).to(logits.device)
        idx = torch.as_tensor(row_ids, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
