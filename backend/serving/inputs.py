"""Reading a request's inputs: tensors, ``sampling_parameters`` and request parameters.

The conversions themselves are ``backend.values``' (one set of rules, one set of messages, for
JSON, request parameters and tensors alike); this module only knows where Triton keeps a value.
Every value returned is a Python value (numpy scalars are unwrapped).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from backend.errors import InvalidRequest
from backend.sampling.params import parse_sampling_json
from backend.values import parse_json_object, to_int, to_str


# sampling_parameters and request parameters are small JSON objects; larger ones are refused
# before they are parsed.
MAX_PARAMETERS_BYTES = 1 << 20


def check_size(what: str, value: Any, limit: int, setting: str = "") -> None:
    """Refuse a str or bytes value longer than ``limit`` bytes (a str counts its characters
    first: they are never more than its UTF-8 bytes)."""
    if isinstance(value, (bytes, str)) and len(value) > limit:
        raise InvalidRequest(f"{what} has {'at least ' if isinstance(value, str) else ''}{len(value)} bytes; "
                             f"at most {limit} are accepted{f' ({setting})' if setting else ''}")


def scalar(tensor: Any, name: str) -> Any:
    """The one value of an input tensor (any shape holding exactly one element)."""
    flat = np.asarray(tensor.as_numpy()).reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"input {name!r} must hold exactly one value, got {flat.size}")
    v = flat[0]
    return v.item() if isinstance(v, np.generic) else v


def optional_scalar(pb: Any, request: Any, name: str) -> Any | None:
    """The value of an optional input, or None when the request does not carry it."""
    t = pb.get_input_tensor_by_name(request, name)
    return None if t is None else scalar(t, name)


def input_str(pb: Any, request: Any, name: str) -> str | None:
    v = optional_scalar(pb, request, name)
    return None if v is None else to_str(f"input {name!r}", v)


def input_int(pb: Any, request: Any, name: str) -> int | None:
    v = optional_scalar(pb, request, name)
    return None if v is None else to_int(f"input {name!r}", v)


def sampling_parameters(pb: Any, request: Any) -> dict[str, Any]:
    """The ``sampling_parameters`` input (JSON; absent or empty means no settings)."""
    raw = optional_scalar(pb, request, "sampling_parameters")
    if raw is None:
        return {}
    check_size("sampling_parameters", raw, MAX_PARAMETERS_BYTES)
    return parse_sampling_json(to_str("input 'sampling_parameters'", raw))


def request_parameters(request: Any) -> dict[str, Any]:
    """Request parameters (what ``/generate`` puts under ``"parameters"``), as a dict."""
    try:
        raw = request.parameters()
    except Exception:   # a stub without request parameters
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    check_size("the request parameters", raw, MAX_PARAMETERS_BYTES)
    return parse_json_object(raw, "request parameters") if raw else {}
