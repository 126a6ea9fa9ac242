"""Structured outputs as vLLM's ``StructuredOutputsParams`` spells them (what clients of Triton's
vLLM backend put under ``structured_outputs`` in ``sampling_parameters``): exactly one of
``json`` (a JSON schema, as an object or a string), ``regex``, ``choice`` (a list of strings),
``grammar`` (EBNF) or ``json_object`` (true: any JSON object), and ``disable_any_whitespace``.

This module only reads and checks the request; :mod:`backend.sampling.grammar` compiles it.
The older vLLM spellings ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar`` are read as the same forms.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backend.errors import InvalidRequest
from backend.values import short, to_bool

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace",)
# vLLM accepts these and nightdraft's grammar library has no equivalent: refused by name.
UNSUPPORTED = ("disable_additional_properties", "whitespace_pattern", "structural_tag")
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
MAX_SPEC_CHARS = 64 * 1024


@dataclass(frozen=True)
class StructuredOutputs:
    kind: str                  # one of KINDS
    spec: str                  # the schema (canonical JSON), regex, choices (JSON list) or grammar
    any_whitespace: bool = True

    @property
    def key(self) -> tuple[str, str, bool]:
        """What a compiled grammar is cached by."""
        return (self.kind, self.spec, self.any_whitespace)


def parse_structured_outputs(key: str, value: Any) -> StructuredOutputs:
    """``sampling_parameters.structured_outputs`` (an object, or its JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequest(f"{key} must be a JSON object, got {short(value)}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{key} must be an object with one of {', '.join(KINDS)}, got {short(value)}")
    unknown = [k for k in value if k not in KINDS and k not in OPTIONS]
    for k in unknown:
        if k in UNSUPPORTED:
            raise InvalidRequest(f"{key}.{k} is not supported")
        raise InvalidRequest(f"{key}: unknown key {short(k)}; known: {', '.join(KINDS + OPTIONS)}")
    forms = [k for k in KINDS if value.get(k) is not None]
    if len(forms) != 1:
        raise InvalidRequest(f"{key} needs exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(forms) if forms else 'none'}")
    kind = forms[0]
    any_ws = not to_bool(f"{key}.disable_any_whitespace", value.get("disable_any_whitespace", False))
    return StructuredOutputs(kind, _spec(f"{key}.{kind}", kind, value[kind]), any_ws)


def from_legacy(key: str, value: Any) -> StructuredOutputs:
    """``guided_json`` and friends: the value is the form's own."""
    kind = LEGACY[key]
    return StructuredOutputs(kind, _spec(key, kind, value))


def _spec(what: str, kind: str, v: Any) -> str:
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise InvalidRequest(f"{what} is not valid JSON: {e}") from None
        if not isinstance(v, (dict, bool)):
            raise InvalidRequest(f"{what} must be a JSON schema (an object), got {short(v)}")
        spec = json.dumps(v, separators=(",", ":"))     # key order kept: properties come in it
    elif kind == "json_object":
        if to_bool(what, v) is not True:
            raise InvalidRequest(f"{what} must be true (leave it out otherwise)")
        spec = ""
    elif kind == "choice":
        if (not isinstance(v, list) or not v
                or not all(isinstance(c, str) and c for c in v)):
            raise InvalidRequest(f"{what} must be a non-empty list of non-empty strings, got {short(v)}")
        spec = json.dumps(v)
    else:                                   # regex, grammar
        if not isinstance(v, str) or not v:
            raise InvalidRequest(f"{what} must be a non-empty string, got {short(v)}")
        if "\x00" in v:
            raise InvalidRequest(f"{what} must not contain a NUL character")
        spec = v
    if len(spec) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"{what} is {len(spec)} characters; at most {MAX_SPEC_CHARS} are accepted")
    return spec
