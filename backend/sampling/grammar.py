"""Structured outputs compiled and enforced with xgrammar (vLLM's, SGLang's and TensorRT-LLM's
default grammar library): a compiled grammar per distinct request form (cached), a matcher per
request that follows its committed tokens, and token masks as xgrammar's packed bitmasks
(int32 words, bit t of row r set where token t is allowed).

Under speculation the matcher fills one mask per verified position: at the committed state, then
after each draft it accepts, and is rolled back to the committed state afterwards. Every draft is
verified, whatever its value: a draft the grammar refuses gets probability 0 at its row, so
verification rejects it and draws its position from the residual distribution, exactly as for any
draft the target would not produce. (Dropping such drafts, or the draft that terminates the
grammar, and sampling their position from the target instead would bias the output: the cut would
depend on the draft's value.) Rows that can never be used, after a refused draft or after the
terminating one, allow every token.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Sequence

import torch

from backend.errors import InvalidRequest
from backend.sampling.structured import StructuredOutputs

CACHE_SIZE = 128          # compiled grammars kept (by request form)


def _xgr():
    import xgrammar
    return xgrammar


class GrammarCompiler:
    """Compiles the structured-output forms for one tokenizer; any thread may call it."""

    def __init__(self, tokenizer, vocab_size: int, threads: int = 1):
        xgr = _xgr()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(_encoded_vocab(tokenizer, vocab_size), vocab_type=_vocab_type(xgr, tokenizer),
                                 vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids),
                                 add_prefix_space=_adds_prefix_space(tokenizer))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputs):
        with self._lock:
            hit = self._cache.get(so.key)
            if hit is not None:
                self._cache.move_to_end(so.key)
                return hit
        try:
            compiled = self._compile(so)
        except InvalidRequest:
            raise
        except Exception as e:  # noqa: BLE001 - the library's own message says what it refused
            detail = str(e).strip().splitlines()
            raise InvalidRequest(f"structured_outputs.{so.kind} could not be compiled: "
                                 f"{detail[0] if detail else type(e).__name__}") from None
        with self._lock:
            self._cache[so.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, so: StructuredOutputs):
        c = self._compiler
        if so.kind == "json":
            return c.compile_json_schema(so.spec, any_whitespace=so.any_whitespace)
        if so.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=so.any_whitespace)
        if so.kind == "regex":
            return c.compile_regex(so.spec)
        if so.kind == "choice":
            return c.compile_grammar(_choice_grammar(json.loads(so.spec)))
        return c.compile_grammar(so.spec)

    def matcher(self, so: StructuredOutputs) -> "Matcher":
        return Matcher(_xgr().GrammarMatcher(self.compile(so)))

    @property
    def cached(self) -> int:
        return len(self._cache)


class Matcher:
    """One request's grammar state: where its committed tokens have taken the grammar."""

    def __init__(self, matcher):
        self._m = matcher

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """What may come next, into row `row` of `bitmask`."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def fill_rows(self, drafts: Sequence[int], bitmask: torch.Tensor, start: int) -> int:
        """Masks for the committed state and after each draft, into rows ``start`` ..
        ``start + len(drafts)`` of `bitmask`; returns how many rows it filled (every draft's
        and the bonus's: no draft is dropped for its value, which would change the distribution
        of the token at its position). A draft the grammar refuses has probability 0 at its own
        row, so verification rejects it and draws that position from the residual; rows that can
        then never be used (after a refused draft, or after the draft that terminates the grammar,
        where commit stops) allow every token. The state is the committed one again afterwards."""
        m = self._m
        m.fill_next_token_bitmask(bitmask, start)
        filled, consumed = 1, 0
        for d in drafts:
            if not m.accept_token(d):
                break
            consumed += 1
            if m.is_terminated():       # a stop token: commit ends the request at it
                break
            m.fill_next_token_bitmask(bitmask, start + filled)
            filled += 1
        bitmask[start + filled:start + len(drafts) + 1].fill_(-1)     # never used: any token
        if consumed:
            m.rollback(consumed)
        return len(drafts) + 1


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] packed bits -> [R, vocab_size] booleans."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _choice_grammar(choices: list[str]) -> str:
    """One of the strings, exactly (EBNF string literals, JSON escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _tokenizer_json(tokenizer) -> dict:
    return json.loads(tokenizer._tok.to_str())


def _vocab_type(xgr, tokenizer):
    """How the vocabulary spells bytes: byte-level BPE (GPT-2, Llama 3, Qwen), byte fallback
    (sentencepiece: Llama 2, Mistral), or raw."""
    dec = json.dumps(_tokenizer_json(tokenizer).get("decoder") or {})
    if '"ByteLevel"' in dec:
        return xgr.VocabType.BYTE_LEVEL
    if '"ByteFallback"' in dec:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _adds_prefix_space(tokenizer) -> bool:
    """Metaspace tokenizers put a space before the text (sentencepiece's "▁")."""
    t = _tokenizer_json(tokenizer)
    pre = json.dumps(t.get("pre_tokenizer") or {}) + json.dumps(t.get("normalizer") or {})
    return '"Metaspace"' in pre and '"prepend_scheme": "never"' not in pre or '"Prepend"' in pre


def _encoded_vocab(tokenizer, vocab_size: int) -> list[str]:
    """Each id's token as the vocabulary spells it ("" for ids the tokenizer lacks)."""
    tok = tokenizer._tok
    return [tok.id_to_token(i) or "" for i in range(vocab_size)]


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
    """Each of `rows` of `logits` keeps only what its matcher allows next (in place)."""
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = allocate_bitmask(len(rows), vocab)
    for k, m in enumerate(matchers):
        m.fill(bitmask, k)
    allowed = allowed_tokens(bitmask, vocab).to(logits.device)
    idx = torch.as_tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
