"""Commit: a step's tokens appended to a sequence, when it stops, what it may not generate
before then, and which of its text a client may see yet (the output it hands out).

Rules (vLLM's): until `min_tokens` tokens are out, EOS (unless `ignore_eos`) and
`stop_token_ids` are masked out of the distribution and stop strings are not looked for. A stop
string is looked for only where it would end in the text the newest token added, so a stop
string that `min_tokens` let through earlier never triggers later; the text is cut where the
stop string begins (where it ends, with `include_stop_str_in_output`). While a request runs,
the last `len(longest stop string) - 1` characters are held back: they may turn out to be the
start of a stop string that is cut off.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from backend.batching.scheduler import ScheduledSeq
from backend.batching.sequence import Sequence
from backend.engine.outputs import RequestOutput, TokenLogprob
from backend.step import PassCounts

log = logging.getLogger("nightdraft.engine")


def commit_tokens(seq: Sequence, tokens: list[int], eos_token_ids: tuple[int, ...],
                  max_model_len: int) -> tuple[list[int], str | None]:
    """Append tokens one at a time, stopping exactly where plain decoding would stop: (the
    tokens committed, why the sequence stops or None)."""
    committed: list[int] = []
    reason = None
    for tok in tokens:
        seq.token_ids.append(tok)
        committed.append(tok)
        before = seq.detokenizer.length
        seq.detokenizer.push([tok])
        reason = stop_reason(seq, tok, seq.detokenizer.length - before, eos_token_ids, max_model_len)
        if seq.grammar is not None and not reason:
            reason = _advance_grammar(seq, tok)
        if reason:
            break
    return committed, reason


def banned_tokens(seq: Sequence, eos_token_ids: tuple[int, ...], ahead: int = 0) -> tuple[int, ...]:
    """Token ids the sequence's next token (`ahead` = 0) or a later one may not be, because
    min_tokens is not reached before it."""
    p = seq.params
    if seq.num_output_tokens + ahead >= p.min_tokens:
        return ()
    return (() if p.ignore_eos else eos_token_ids) + p.stop_token_ids


def stop_reason(seq: Sequence, token: int, new_chars: int, eos_token_ids: tuple[int, ...],
                max_model_len: int) -> str | None:
    """Why the sequence stops after `token` (just appended, `new_chars` characters of text),
    or None. Sets `seq.stop_text_at` when a stop string ends it."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        if (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if p.stop and new_chars:
            # Only where a stop string would end in the new text: read just that end.
            start = max(0, seq.detokenizer.length - new_chars - max(map(len, p.stop)) + 1)
            tail = seq.detokenizer.slice(start)
            hits = [(i, s) for i, s in ((tail.find(s, max(0, len(tail) - new_chars - len(s) + 1)), s)
                                        for s in p.stop) if i >= 0]
            if hits:
                i, s = min(hits, key=lambda h: h[0])
                at = start + i
                seq.stop_text_at = at + len(s) if p.include_stop_str_in_output else at
                return "stop"
    if seq.num_output_tokens >= p.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None


def visible_end(seq: Sequence) -> int:
    """How much of the sequence's text a client may have now."""
    text_len = seq.detokenizer.length
    if seq.is_finished:
        return seq.stop_text_at if seq.stop_text_at is not None else text_len
    p = seq.params
    # (A stop string kept in the output needs no holding back: what precedes its end is output.)
    hold = max(map(len, p.stop)) - 1 if p.stop and not p.include_stop_str_in_output else 0
    return max(seq.emitted_text_len, text_len - hold)


def output_of(seq: Sequence, new_ids: list[int], error: str | None = None,
              logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """The step's news for one request: its new tokens and the text it may see now."""
    if seq.is_finished:
        seq.detokenizer.push([], final=True)
    end = visible_end(seq)
    delta = seq.detokenizer.slice(seq.emitted_text_len, end)
    seq.emitted_text_len = max(seq.emitted_text_len, end)
    return RequestOutput(
        request_id=seq.request_id, new_token_ids=new_ids, new_text=delta,
        finished=seq.is_finished, finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
        num_drafted=seq.drafted, num_accepted=seq.accepted, error=error,
        logprobs=logprobs if seq.params.logprobs is not None else None,
        cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
        prompt_logprobs=_prompt_logprobs_once(seq),
        **({"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
            "finish_time": seq.finish_time} if seq.is_finished else {}),
    )


def _prompt_logprobs_once(seq: Sequence) -> list | None:
    """The prompt's logprobs, on the request's first output (they are complete by then: its
    prefill has run)."""
    if (seq.prompt_logprobs is None or seq.prompt_logprobs_sent
            or len(seq.prompt_logprobs) < seq.num_prompt_tokens):     # (a request ended before them)
        return None
    seq.prompt_logprobs_sent = True
    return seq.prompt_logprobs


def _advance_grammar(seq: Sequence, token: int) -> str | None:
    """Structured outputs: the grammar follows the committed token. It ends the request where it
    has taken a stop token (also one that ignore_eos lets through: nothing may follow it)."""
    if not seq.grammar.accept(token):
        # Masks allow only what the grammar accepts: a bug, not the client's doing. The request
        # ends (its output would no longer follow the grammar); the step goes on.
        log.error("request %s: the grammar refused token %d, which its mask allowed", seq.request_id, token)
        return "error"
    return "stop" if seq.grammar.terminated else None


def commit_decided(s: ScheduledSeq, decided, counts: PassCounts, *, kv, eos_token_ids: tuple[int, ...],
                   max_model_len: int, finish: Callable[[Sequence, str], None],
                   fail: Callable[[Sequence, str], RequestOutput]) -> RequestOutput | None:
    """Commit one scheduled sequence's decided tokens (or `fail` it with the error that stopped
    it; `finish` it where it stops), counting them in the step's `counts`."""
    seq = s.seq
    if s.num_new > 1 or not s.completes:   # (asked before num_computed moves on)
        counts.num_prefill_tokens += s.num_new
        if seq.num_preemptions:        # recomputing what a preemption threw away
            counts.num_recompute_tokens += s.num_new
    seq.num_computed += s.num_new
    if decided is None:
        return None
    if isinstance(decided, Exception):
        log.error("request %s failed in sampling/verification: %s", seq.request_id, decided)
        return fail(seq, f"sampling failed: {type(decided).__name__}: {decided}")
    if seq.first_token_time is None:
        seq.first_token_time = time.perf_counter()
    tokens = decided.tokens
    committed, reason = commit_tokens(seq, tokens, eos_token_ids, max_model_len)
    # K/V of rejected drafts (and of the last token, the next input) is not kept.
    seq.num_computed = len(seq) - 1
    if reason:
        finish(seq, reason)
    else:
        kv.truncate(seq.request_id, seq.num_computed)
    if s.gamma:
        seq.drafted += s.gamma
        seq.accepted += decided.accepted
        counts.drafted += s.gamma
        counts.accepted += decided.accepted
        counts.verified.append((s.gamma, decided.accepted))
    if s.num_new == 1:            # a decode/verify call (prefill's first token excluded)
        counts.target_calls += 1
        counts.decode_tokens += len(tokens)
    counts.tokens_committed += len(tokens)
    logprobs = decided.logprobs[:len(committed)] if decided.logprobs is not None else None
    if logprobs is not None:
        seq.cumulative_logprob += sum(t.logprob for t in logprobs)
    return output_of(seq, committed, logprobs=logprobs)
