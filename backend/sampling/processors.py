"""vLLM's logits processors, for a batch of rows at once, on the logits' device.

What a request's sampling keys do to its logits before temperature, in the order of vLLM's
sampler (``vllm/v1/sample/sampler.py``): ``allowed_token_ids`` (every other token gets -inf),
``bad_words`` (the last token of a word, where the tokens before it complete the rest of the
word), ``min_tokens`` (the engine's verify masks those), ``logit_bias`` (added), then the
penalties: ``repetition_penalty`` divides a positive logit and multiplies a negative one of every
token seen in the prompt or the output, ``frequency_penalty`` subtracts penalty x count of each
token in the output, ``presence_penalty`` subtracts the penalty once from every token in the
output. All of these change greedy decoding too. ``min_p`` comes after temperature and is part
of the processed distribution (:func:`backend.sampling.sampler.processed_probs`).

Under speculation each row is one position: the output it sees is the request's committed
output followed by the drafts before that position (``Row.extra``), exactly what plain decoding
would have seen had those drafts been its tokens. The target's verification, the drafter's
proposals and plain decoding all go through :func:`process_logits`, so the distribution that
verification checks drafts against is the one plain decoding samples from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from backend.errors import InvalidRequest
from backend.sampling.params import SamplingParams


@dataclass
class Context:
    """One request as the processors see it: ``tokens`` is its prompt followed by the output
    committed so far (the list itself, not a copy)."""
    params: SamplingParams
    tokens: Sequence[int]
    num_prompt: int


@dataclass
class Row:
    """One row of logits: whose it is and the drafts before its position."""
    context: int                 # index into the contexts
    extra: Sequence[int] = ()


def process_logits(logits: torch.Tensor, row_ids: list[int], contexts: list[Context], rows: list[Row]) -> None:
    """Apply every processor the rows' requests ask for to ``logits[row_ids]`` (in place)."""
    if not row_ids:
        return
    dev = logits.device
    idx = torch.as_tensor(row_ids, device=dev)
    x = logits[idx].float()
    _allowed(x, contexts, rows)
    _bad_words(x, contexts, rows)
    _logit_bias(x, contexts, rows)
    _penalties(x, contexts, rows)
    logits[idx] = x.to(logits.dtype)


def _allowed(x: torch.Tensor, contexts: list[Context], rows: list[Row]) -> None:
    r_idx, t_idx = [], []
    for r, row in enumerate(rows):
        allowed = contexts[row.context].params.allowed_token_ids
        if allowed is not None:
            r_idx += [r] * len(allowed)
            t_idx += allowed
    if not r_idx:
        return
    dev = x.device
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[torch.as_tensor(r_idx, device=dev), torch.as_tensor(t_idx, device=dev)] = True
    has = torch.zeros(x.shape[0], dtype=torch.bool, device=dev)
    has[torch.as_tensor(r_idx, device=dev)] = True
    x.masked_fill_(has[:, None] & ~keep, float("-inf"))


def _tail_matches(ctx: Context, extra: Sequence[int], prefix: Sequence[int]) -> bool:
    """Does the row's output (committed output, then `extra`) end with `prefix`?"""
    k = len(prefix)
    if not k:
        return True
    n_extra = len(extra)
    n_out = len(ctx.tokens) - ctx.num_prompt
    if k > n_out + n_extra:
        return False
    from_extra = min(k, n_extra)
    from_out = k - from_extra
    tail = list(ctx.tokens[len(ctx.tokens) - from_out:]) if from_out else []
    tail += list(extra[n_extra - from_extra:])
    return tail == list(prefix)


def _bad_words(x: torch.Tensor, contexts: list[Context], rows: list[Row]) -> None:
    """vLLM's rule: a word's last token is banned when the output ends with the rest of it
    (a one-token word is always banned); only the output counts, never the prompt."""
    r_idx, t_idx = [], []
    for r, row in enumerate(rows):
        ctx = contexts[row.context]
        for word in ctx.params.bad_words_token_ids:
            if _tail_matches(ctx, row.extra, word[:-1]):
                r_idx.append(r)
                t_idx.append(word[-1])
    if r_idx:
        x[torch.as_tensor(r_idx, device=x.device), torch.as_tensor(t_idx, device=x.device)] = float("-inf")


def _logit_bias(x: torch.Tensor, contexts: list[Context], rows: list[Row]) -> None:
    r_idx, t_idx, b = [], [], []
    for r, row in enumerate(rows):
        for token, bias in contexts[row.context].params.logit_bias:
            r_idx.append(r)
            t_idx.append(token)
            b.append(bias)
    if r_idx:
        dev = x.device
        x.index_put_((torch.as_tensor(r_idx, device=dev), torch.as_tensor(t_idx, device=dev)),
                     torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)


def _penalties(x: torch.Tensor, contexts: list[Context], rows: list[Row]) -> None:
    """vLLM's ``apply_penalties``: token counts of each row's output (its committed output once
    per request, then its drafts added per row) and a mask of its prompt's tokens, on the device."""
    pen = [r for r, row in enumerate(rows) if contexts[row.context].params.penalised]
    if not pen:
        return
    dev = x.device
    vocab = x.shape[1]
    owners = sorted({rows[r].context for r in pen})
    slot = {c: i for i, c in enumerate(owners)}
    out_tok, out_own, prm_tok, prm_own = [], [], [], []
    for c in owners:
        ctx = contexts[c]
        n_out = len(ctx.tokens) - ctx.num_prompt
        out_tok += ctx.tokens[ctx.num_prompt:]
        out_own += [slot[c]] * n_out
        if ctx.params.repetition_penalty != 1.0:
            prm_tok += ctx.tokens[:ctx.num_prompt]
            prm_own += [slot[c]] * ctx.num_prompt
    base = torch.zeros(len(owners), vocab, dtype=x.dtype, device=dev)
    if out_tok:
        base.index_put_((torch.as_tensor(out_own, device=dev), torch.as_tensor(out_tok, device=dev)),
                        torch.ones(len(out_tok), dtype=x.dtype, device=dev), accumulate=True)
    prompt = torch.zeros(len(owners), vocab, dtype=torch.bool, device=dev)
    if prm_tok:
        prompt[torch.as_tensor(prm_own, device=dev), torch.as_tensor(prm_tok, device=dev)] = True
    row_slot = torch.as_tensor([slot[rows[r].context] for r in pen], device=dev)
    counts = base[row_slot]
    seen_in_prompt = prompt[row_slot]
    d_row = [i for i, r in enumerate(pen) for _ in rows[r].extra]
    if d_row:
        d_tok = [t for r in pen for t in rows[r].extra]
        counts.index_put_((torch.as_tensor(d_row, device=dev), torch.as_tensor(d_tok, device=dev)),
                          torch.ones(len(d_tok), dtype=x.dtype, device=dev), accumulate=True)
    params = [contexts[rows[r].context].params for r in pen]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
    in_output = counts > 0
    idx = torch.as_tensor(pen, device=dev)
    y = x[idx]
    scale = torch.where(seen_in_prompt | in_output, rep, torch.ones_like(rep))
    y = torch.where(y > 0, y / scale, y * scale)
    y = y - freq * counts - pres * in_output.to(x.dtype)
    x[idx] = y


def bad_words_token_ids(words: Sequence[str], encode, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``SamplingParams.update_from_tokenizer``: each word as tokens, without and with a
    leading space (the word at the start of the text and in the middle of it); the spaced form
    only where it is a different first token of the same length. `encode` tokenizes without
    special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise InvalidRequest(f"bad_words entry {word!r} tokenizes to no tokens")
        out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = sorted({t for w in out for t in w if not 0 <= t < vocab_size})
    if bad:
        raise InvalidRequest(f"bad_words tokenize to token id(s) {bad[:5]} outside the model's "
                             f"vocabulary [0, {vocab_size})")
    return tuple(out)
