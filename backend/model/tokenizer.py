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

    @functools.lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        """One token alone, as text (what logprobs call ``decoded_token``)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    A byte-level BPE token can end in the middle of a multi-byte character; decoding it alone
    gives U+FFFD. We only emit text once the tail decodes cleanly, and we decode a short window
    (from the last clean boundary) rather than the whole output every step.

    `skip_special_tokens` (vLLM's default True) leaves special tokens out of the text.
    `spaces_between_special_tokens` False (with special tokens kept) spells an added token that
    follows another added token as its bare text, as vLLM's fast detokenizer does, so no space a
    decoder puts before it appears between the two.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._added = {} if skip_special_tokens or spaces_between_special_tokens else tokenizer.added_tokens
        self._last_added = False
        self._ids: list[int] = []
        self._prefix = 0   # start of the decode window (a clean boundary)
        self._read = 0     # ids before this are already reflected in self.text
        self.text = ""

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly decodable text."""
        if not self._added:
            return self._push(new_ids, final)
        start = len(self.text)
        for tok in new_ids:
            added = tok in self._added
            if added and self._last_added:
                self._push([], final=True)            # flush what precedes it
                self._ids.append(tok)
                self.text += self._added[tok]
                # The window restarts at this token, so what follows decodes in its context.
                self._prefix, self._read = len(self._ids) - 1, len(self._ids)
            else:
                self._push([tok], final)
            self._last_added = added
        if not new_ids:
            self._push([], final)
        return self.text[start:]

    def _push(self, new_ids: list[int], final: bool) -> str:
        self._ids.extend(new_ids)
        window = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        done = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        if len(window) <= len(done) or (window.endswith("\ufffd") and not final):
            return ""
        delta = window[len(done):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
