"""Ask the tritonserver this model runs in whether the model is ready, over its HTTP endpoint.

The Python backend stub is started by tritonserver itself, so the server's own command line
(its parent's) says where its HTTP endpoint listens. Readiness is false once the server stops
(its state is "exiting") or the model is being unloaded.
"""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path


def _flag(args: list[str], name: str) -> str | None:
    """The value of --name=value or --name value in a command line (the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
        elif a == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
    return value


def server_http_base(cmdline: list[str]) -> str | None:
    """http://host:port of tritonserver's HTTP endpoint from its command line, or None when it
    has none (--allow-http=false)."""
    if (_flag(cmdline, "allow-http") or "true").lower() in ("false", "0", "no"):
        return None
    host = _flag(cmdline, "http-address") or "0.0.0.0"
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::", "[::]") else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{_flag(cmdline, 'http-port') or '8000'}"


class ReadinessProbe:
    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url
        self.timeout_s = timeout_s

    @classmethod
    def for_this_server(cls, model: str, version: str) -> "ReadinessProbe | None":
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        except OSError:
            return None
        args = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
        if not args or "tritonserver" not in Path(args[0]).name:
            return None
        base = server_http_base(args[1:])
        return cls(f"{base}/v2/models/{model}/versions/{version}/ready") if base else None

    def ready(self) -> bool:
        """True when the server says so; False when it says not ready or cannot be reached."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False
