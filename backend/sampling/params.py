"""Per-request sampling parameters, validated once at the door.

Clients of Triton's vLLM backend (and genai-perf) send numbers as strings, e.g.
``{"max_tokens": "8"}``, so ``from_dict`` coerces before validating.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field, fields
from typing import Any

from backend.errors import InvalidRequest
from backend.sampling.structured import LEGACY, StructuredOutputs, from_legacy, parse_structured_outputs
from backend.values import parse_json_object, short, to_bool, to_float, to_int

# Below this, temperature scaling overflows float32 logits to inf (temperature 1e-39 did, and
# the NaN it made failed the whole batched sampler). Temperature -> 0 is argmax, so such
# requests decode greedily, as vLLM's sampler does below its own epsilon.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
SEED_RANGE = (0, 2**64 - 1)          # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024         # stop strings are held back from streams: keep them short
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20                    # top-N alternatives per token (vLLM's default limit)
MAX_PENALTY = 2.0                    # presence and frequency penalties lie in [-2, 2] (OpenAI, vLLM)
MAX_LOGIT_BIAS = 100.0               # biases are clamped to [-100, 100], as vLLM does
MAX_BAD_WORDS = 128                  # vLLM's default VLLM_MAX_NUM_BAD_WORDS
MAX_BAD_WORD_CHARS = 1024
# The sampler compares probability mass against top_p in float32, where anything below about
# 7e-46 is 0 (every token masked: nothing left to sample) and subnormal values may be flushed to
# 0 on a GPU. The smallest normal float32 is the least top_p that means what it says (at that
# size, keep only the most likely token).
MIN_TOP_P = 1.1754943508222875e-38   # torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0                 # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Per-request opt-out of speculative decoding (the request still decodes, just without drafts).
    speculative: bool = True
    min_tokens: int = 0
    # Log-probabilities of each generated token (and of its `logprobs` most likely
    # alternatives; 0: the token alone); None: none.
    logprobs: int | None = None
    # vLLM's logits processors (backend.sampling.processors): penalties over the tokens so far
    # (presence and frequency: generated tokens; repetition: prompt and generated), min_p
    # (relative to the most likely token, after temperature), additive biases by token id, a
    # whitelist of token ids, and words whose last token is banned where it would complete them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, bias) pairs
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    # The bad words as token ids (with and without a leading space, as vLLM tokenizes them);
    # filled in by the engine's intake, which holds the tokenizer.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Output text: the stop string kept at the end of the text; special tokens in the text, and
    # (vLLM's fast detokenizer) whether consecutive added tokens are spelled with a space between.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # The prompt's last N tokens only (-1: as many as the context holds); None: all of it.
    truncate_prompt_tokens: int | None = None
    # The target's log-probabilities of each prompt token (and of its N most likely
    # alternatives), as logprobs are for generated tokens; None: none.
    prompt_logprobs: int | None = None
    # Constrained decoding (backend.sampling.structured): a JSON schema, regex, choice, grammar
    # or any JSON object; every token, drafted or not, is one the grammar allows.
    structured_outputs: StructuredOutputs | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        self.validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Does a processor before temperature change this request's logits? (min_p, after
        temperature, is part of the processed distribution instead.)"""
        return (self.penalised or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature > MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < MIN_TOP_P:
            raise InvalidRequest(f"top_p must be at least {MIN_TOP_P:.4g} (smaller is 0 in float32, "
                                 f"which keeps no token), got {self.top_p!r}")
        lo, hi = SEED_RANGE
        if self.seed is not None and (not isinstance(self.seed, int) or not lo <= self.seed <= hi):
            raise InvalidRequest(f"seed must be an integer in [0, 2**64 - 1], got {short(self.seed)}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop strings must be non-empty strings, got {short(s)}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(f"stop strings must be at most {MAX_STOP_STRING_CHARS} "
                                     f"characters, got one of {len(s)}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {short(self.logprobs)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise InvalidRequest(f"stop_token_ids must be non-negative integers, got {short(t)}")
        self._validate_processors()
        self._validate_output_options()

    def _validate_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {short(v)}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidRequest(f"repetition_penalty must be a finite number > 0, "
                                 f"got {short(self.repetition_penalty)}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {short(self.min_p)}")
        for pair in self.logit_bias:
            if (not isinstance(pair, tuple) or len(pair) != 2 or not _is_token_id(pair[0])
                    or not _is_number(pair[1]) or not math.isfinite(pair[1])):
                # An infinite bias on a masked token would make -inf + inf = NaN in its row.
                raise InvalidRequest(f"logit_bias must map token ids to finite numbers, got {short(pair)}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequest("allowed_token_ids must not be empty (leave it out to allow every token)")
            bad = [t for t in self.allowed_token_ids if not _is_token_id(t)]
            if bad:
                raise InvalidRequest(f"allowed_token_ids must be non-negative integers, got {short(bad[0])}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(f"at most {MAX_BAD_WORDS} bad_words, got {len(self.bad_words)}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise InvalidRequest(f"bad_words must be non-empty strings, got {short(w)}")
            if len(w) > MAX_BAD_WORD_CHARS:
                raise InvalidRequest(f"bad_words must be at most {MAX_BAD_WORD_CHARS} characters, got one of {len(w)}")

    def _validate_output_options(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
            raise InvalidRequest(f"truncate_prompt_tokens must be an integer >= 1 (or -1: as many as the "
                                 f"context holds), got {short(k)}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequest(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {short(self.prompt_logprobs)}")

    # --- parsing from the wire -------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, **overrides: Any) -> "SamplingParams":
        """Build from a JSON object as clients send it; unknown keys are refused by name."""
        values: dict[str, Any] = {}
        for key, value in {**(raw or {}), **{k: v for k, v in overrides.items() if v is not None}}.items():
            key = _ALIASES.get(key, key)
            if key in _IGNORED or (value is None and key in _NULL_IS_DEFAULT):
                continue
            if key in LEGACY:
                if "structured_outputs" in values:
                    raise InvalidRequest(f"{key} and structured_outputs: give one")
                values["structured_outputs"] = from_legacy(key, value)
                continue
            if key in ("n", "best_of"):
                if to_int(key, value) != 1:
                    raise InvalidRequest(f"{key} must be 1: one completion per request is supported")
                continue
            if key not in _COERCE:
                known = ", ".join(sorted(_COERCE))
                raise InvalidRequest(f"unknown sampling parameter {short(key)}; known: {known}")
            values[key] = _COERCE[key](key, value)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes | None, **overrides: Any) -> "SamplingParams":
        return cls.from_dict(parse_sampling_json(text), **overrides)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}


def parse_sampling_json(text: str | bytes | None) -> dict[str, Any]:
    """The `sampling_parameters` input: a JSON object (empty or absent means no settings)."""
    if not text or not str(text).strip():
        return {}
    return parse_json_object(text, "sampling_parameters")


def _to_opt_int(key: str, v: Any) -> int | None:
    return None if v is None else to_int(key, v)


def _to_stop(key: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise InvalidRequest(f"{key} must be a string or a list of strings, got {short(v)}")


def _to_token_ids(key: str, v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(to_int(key, t) for t in v)
    raise InvalidRequest(f"{key} must be a list of token ids, got {short(v)}")


def _to_logit_bias(key: str, v: Any) -> tuple[tuple[int, float], ...]:
    """vLLM's logit_bias: {token id (a JSON key, so a string): bias}, biases clamped to
    [-100, 100]."""
    if not isinstance(v, dict):
        raise InvalidRequest(f"{key} must be an object mapping token ids to biases, got {short(v)}")
    out = {}
    for token, bias in v.items():
        token_id = to_int(f"{key} key", token)
        b = to_float(f"{key}[{short(token)}]", bias)
        if b != b:
            raise InvalidRequest(f"{key}[{short(token)}] must be a number, got NaN")
        out[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b))
    return tuple(out.items())


def _to_allowed(key: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise InvalidRequest(f"{key} must be a list of token ids, got {short(v)}")
    return tuple(dict.fromkeys(to_int(key, t) for t in v))


def _to_words(key: str, v: Any) -> tuple[str, ...]:
    words = _to_stop(key, v)
    return tuple(dict.fromkeys(words))      # vLLM drops repeats


_COERCE = {
    "max_tokens": to_int,
    "min_tokens": to_int,
    "temperature": to_float,
    "top_k": to_int,
    "top_p": to_float,
    "seed": _to_opt_int,
    "stop": _to_stop,
    "ignore_eos": to_bool,
    "stop_token_ids": _to_token_ids,
    "speculative": to_bool,
    "logprobs": _to_opt_int,
    "presence_penalty": to_float,
    "frequency_penalty": to_float,
    "repetition_penalty": to_float,
    "min_p": to_float,
    "logit_bias": _to_logit_bias,
    "allowed_token_ids": _to_allowed,
    "bad_words": _to_words,
    "include_stop_str_in_output": to_bool,
    "skip_special_tokens": to_bool,
    "spaces_between_special_tokens": to_bool,
    "truncate_prompt_tokens": _to_opt_int,
    "prompt_logprobs": _to_opt_int,
    "structured_outputs": parse_structured_outputs,
}
# Keys where JSON null means the default (vLLM's SamplingParams.from_optional, and what OpenAI
# clients send for a knob they leave unset).
_NULL_IS_DEFAULT = {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                    "allowed_token_ids", "bad_words", "include_stop_str_in_output", "skip_special_tokens",
                    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "structured_outputs"}
# Spellings other front ends use for the same knob.
_ALIASES = {"max_new_tokens": "max_tokens", "random_seed": "seed", "stop_words": "stop"}
# Accepted for drop-in compatibility with vLLM-backend clients but with no effect here; listed so
# that typos are still refused. (detokenize: text is always produced.)
_IGNORED = {"stream", "detokenize"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token_id(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
