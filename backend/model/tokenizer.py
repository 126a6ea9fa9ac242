"""Tokenizer loading (Hugging Face tokenizer.json) and incremental detokenization.

Prompts are encoded as vLLM and transformers encode them (``tokenizer.encode(text)``): with the
special tokens of tokenizer.json's post-processor, so a checkpoint whose tokenizer adds BOS
(Llama, Mistral, Gemma) gets it and one whose tokenizer does not (GPT-2, Qwen) does not.
transformers (5.x, as vLLM uses it) takes tokenizer.json's post-processor as the truth and
ignores ``add_bos_token`` / ``add_eos_token`` in tokenizer_config.json when a tokenizer.json is
present; so does this, and it says so in the log when the two disagree (transformers 4's
LlamaTokenizerFast followed ``add_bos_token``).
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger("nightdraft.model")


_GIL_FREE_ABOVE = 4096     # characters


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, eos_token_ids: tuple[int, ...]):
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_pretrained(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        tok = _HFTokenizer.from_file(str(file))
        eos = set(eos_token_ids)
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        eos_token = cfg.get("eos_token")
        if isinstance(eos_token, dict):  # AddedToken serialisation
            eos_token = eos_token.get("content")
        if eos_token and tok.token_to_id(eos_token) is not None:
            eos.add(tok.token_to_id(eos_token))
        tokenizer = cls(tok, tuple(sorted(eos)))
        tokenizer._note_config_disagreement(cfg, path)
        return tokenizer

    @functools.cached_property
    def added_special_ids(self) -> tuple[list[int], list[int]]:
        """(prefix, suffix): the ids the post-processor puts around every prompt (BOS, EOS)."""
        bare = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        return full[:start], full[start + len(bare):]

    def _note_config_disagreement(self, cfg: dict, path: Path) -> None:
        prefix, suffix = self.added_special_ids
        for key, added in (("add_bos_token", bool(prefix)), ("add_eos_token", bool(suffix))):
            if key in cfg and bool(cfg[key]) != added:
                log.warning("%s: tokenizer_config.json says %s=%s but tokenizer.json's post-processor %s; "
                            "prompts are encoded as tokenizer.json says (as transformers 5 and vLLM do)",
                            path, key, cfg[key], "adds it" if added else "does not")

    def encode(self, text: str) -> list[int]:
        """The prompt's ids, with the special tokens the tokenizer adds (BOS where it does)."""
        if len(text) < _GIL_FREE_ABOVE:
            return self._tok.encode(text, add_special_tokens=True).ids
        # encode() holds the GIL for its whole run (3 s for 4 MB here, freezing every other
        # thread of the server); encode_batch releases it.
        return self._tok.encode_batch([text], add_special_tokens=True)[0].ids

    def encode_plain(self, text: str) -> list[int]:
        """The ids of `text` alone, without the special tokens the tokenizer adds to prompts."""
        return self._tok.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """Added tokens (special or not) by id: their text."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token: text of n bytes holds at least n / this tokens."""
        pieces = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(1, max(len(p.encode("utf-8")) for p in pieces))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def skipped_ids(self) -> frozenset[int]:
        """Ids that :meth:`decode` drops: the special tokens (it skips them by their text)."""
        special = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        by_text = (self._tok.token_to_id(content) for content in special.values())
        return frozenset(special) | frozenset(i for i in by_text if i is not None)

    @functools.lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        """One token alone, as text (what logprobs call ``decoded_token``)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    A byte-level BPE token can end in the middle of a multi-byte character; decoding it alone
    gives U+FFFD. Text is emitted once the tail decodes cleanly, and only a short window is
    decoded (from the last clean boundary), never the whole output. The work per token stays
    bounded, so a long output costs time linear in its length:

    - ids that decoding skips (special tokens: EOS generated under ``ignore_eos``) never enter
      the window (decoding without them gives the same text);
    - a window that keeps ending in U+FFFD (bytes that never make a character) is emitted up to
      its last ``KEEP_PENDING`` tokens, which are the most an unfinished character can span,
      once more than ``MAX_PENDING`` tokens wait and what comes after cannot change it;
    - the text is kept as a list of pieces (appending to one string is quadratic), read with
      :meth:`slice` near its end.

    (tokenizers' ``DecodeStream`` keeps every id since its last emission and decodes them all at
    each step, so it is quadratic on exactly these two inputs.)

    `skip_special_tokens` (vLLM's default True) leaves special tokens out of the text (False
    keeps them in the window). `spaces_between_special_tokens` False (with special tokens kept)
    spells an added token that follows another added token as its bare text, as vLLM's fast
    detokenizer does, so no space a decoder puts before it appears between the two.
    """

    MAX_PENDING = 8
    KEEP_PENDING = 4          # a UTF-8 character is at most 4 bytes, and a token at least one

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._skipped = tokenizer.skipped_ids if skip_special_tokens else frozenset()
        self._added = {} if skip_special_tokens or spaces_between_special_tokens else tokenizer.added_tokens
        self._last_added = False
        self._ids: list[int] = []   # the window: ids from the last clean boundary on
        self._read = 0              # ids of the window already reflected in the text
        self._done = ""             # decode(self._ids[:self._read])
        self._pieces: list[str] = []
        self.length = 0             # characters of text so far

    @property
    def text(self) -> str:
        """All the text so far (joins every piece: for the end of a request, not every step)."""
        return "".join(self._pieces)

    def slice(self, start: int, end: int | None = None) -> str:
        """``text[start:end]``, at the cost of the text from `start` to the end."""
        end = self.length if end is None else min(end, self.length)
        if start >= end:
            return ""
        parts, pos = [], self.length
        for piece in reversed(self._pieces):
            if pos <= start:
                break
            parts.append(piece)
            pos -= len(piece)
        return "".join(reversed(parts))[start - pos:end - pos]

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly decodable text."""
        if not self._added:
            return self._push(new_ids, final)
        start = self.length
        for tok in new_ids:
            added = tok in self._added
            if added and self._last_added:
                self._push([], final=True)            # flush what precedes it
                self._append(self._added[tok])
                # The window restarts at this token, so what follows decodes in its context.
                self._ids, self._read = [tok], 1
                self._done = self._decode(self._ids)
            else:
                self._push([tok], final)
            self._last_added = added
        if not new_ids:
            self._push([], final)
        return self.slice(start)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _push(self, new_ids: list[int], final: bool) -> str:
        before = len(self._ids)
        self._ids.extend(i for i in new_ids if i not in self._skipped)
        if len(self._ids) == before and not final:
            return ""          # nothing that decodes to text: the window is as it was
        window = self._decode(self._ids)
        if len(window) > len(self._done) and (final or not window.endswith("\ufffd")):
            return self._emit(window, len(self._ids))
        if len(self._ids) - self._read > self.MAX_PENDING:
            cut = len(self._ids) - self.KEEP_PENDING
            head = self._decode(self._ids[:cut])
            if len(head) > len(self._done) and window.startswith(head):
                return self._emit(head, cut)
        return ""

    def _emit(self, text: str, upto: int) -> str:
        """Emit `text` (the decode of the window's first `upto` ids) beyond what was emitted; the
        next window starts where this emission's ids began (a clean boundary)."""
        delta = text[len(self._done):]
        self._ids = self._ids[self._read:]
        self._read = upto - self._read
        self._done = self._decode(self._ids[:self._read])
        self._append(delta)
        return delta

    def _append(self, piece: str) -> None:
        self._pieces.append(piece)
        self.length += len(piece)
