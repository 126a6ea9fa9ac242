"""Client values, turned into Python ones or refused with a message that names them.

One set of rules for every way a value arrives: JSON (numbers may come as strings, as
genai-perf sends them), Triton request parameters, and tensor inputs (numpy scalars, bytes).
"""
from __future__ import annotations

import json
import math
from typing import Any

from backend.errors import InvalidRequest


def short(v: Any, limit: int = 40) -> str:
    """repr(v), cut: a client's 4000-digit number is not worth echoing back whole."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def _plain(v: Any) -> Any:
    """numpy scalars -> Python values; bytes stay bytes."""
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    return v


def to_str(what: str, v: Any) -> str:
    v = _plain(v)
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{what} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise InvalidRequest(f"{what} must be a string, got {type(v).__name__}")


def _text(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def to_int(key: str, v: Any) -> int:
    v = _text(_plain(v))
    if isinstance(v, bool):
        raise InvalidRequest(f"{key} must be an integer, got {v!r}")
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:   # not a number, or more digits than Python will convert
            pass
    raise InvalidRequest(f"{key} must be an integer, got {short(v)}")


def to_float(key: str, v: Any) -> float:
    v = _text(_plain(v))
    if isinstance(v, bool):
        raise InvalidRequest(f"{key} must be a number, got {v!r}")
    try:
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            return float(v.strip())
    except (ValueError, OverflowError):   # not a number; an integer too large for a float
        pass
    raise InvalidRequest(f"{key} must be a number, got {short(v)}")


def to_bool(key: str, v: Any) -> bool:
    v = _text(_plain(v))
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
        return v.strip().lower() in ("true", "1")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise InvalidRequest(f"{key} must be a boolean, got {short(v)}")


def parse_json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """A JSON object from a client, or InvalidRequest naming `what` and the problem."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{what} is not valid JSON: {e}") from None
    except ValueError as e:   # e.g. an integer of more than 4300 digits
        raise InvalidRequest(f"{what} could not be parsed: {e}") from None
    except RecursionError:
        raise InvalidRequest(f"{what} is nested too deeply") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{what} must be a JSON object")
    return raw
