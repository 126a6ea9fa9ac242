"""Per-request sampling parameters, validated once at the door.

Clients of Triton's vLLM backend (and genai-perf) send numbers as strings, e.g.
``{"max_tokens": "8"}``, so ``from_dict`` coerces before validating.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from backend.errors import InvalidRequest
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
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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

    # --- parsing from the wire -------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, **overrides: Any) -> "SamplingParams":
        """Build from a JSON object as clients send it; unknown keys are refused by name."""
        values: dict[str, Any] = {}
        for key, value in {**(raw or {}), **{k: v for k, v in overrides.items() if v is not None}}.items():
            key = _ALIASES.get(key, key)
            if key in _IGNORED:
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
}
# Spellings other front ends use for the same knob.
_ALIASES = {"max_new_tokens": "max_tokens", "random_seed": "seed", "stop_words": "stop"}
# Accepted for drop-in compatibility with vLLM-backend clients but with no effect here; listed so
# that typos are still refused.
_IGNORED = {"stream", "detokenize", "skip_special_tokens",
            "spaces_between_special_tokens"}
