"""Errors a front end turns into client-facing responses (their messages are safe to return),
and the one an operator gets for a configuration that cannot work."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input from a client; the message says what is wrong (INVALID_ARG, HTTP 400)."""


class ServerBusy(RuntimeError):
    """The request is valid but the server's queue is full; retry later (UNAVAILABLE)."""


class ConfigError(ValueError):
    """An engine configuration that cannot work; the message names the key."""
