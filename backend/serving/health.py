"""Ask the tritonserver this model runs in whether the model is ready, over its HTTP endpoint.

The Python backend stub is started by tritonserver itself, so the server's own command line
(its parent's) says where its HTTP endpoint listens. Readiness is false once the server stops
(its state is "exiting") or the model is being unloaded.

The answer has three values, not two. Not ready is what the server itself says: HTTP 400, 404 or
503 (what Triton answers for a model that is not ready), or a refused connection: nothing
listens on the endpoint any more, and Triton 2.51 closes its endpoints first when it stops (a
SIGTERM is seen that way, within a poll). A poll that gets no answer (a timeout, no file
descriptor left, a malformed reply) or an answer that is not about readiness (403 when an
operator restricted the health API) is ``UNKNOWN``: the caller must not take it for a stop. The
probe talks to the endpoint directly with ``http.client``, never through ``urllib``'s proxy
handling: with ``http_proxy`` set and no ``no_proxy`` for loopback, urllib sends the request to
the proxy, whose refusal or error page would read as "not ready".
"""
from __future__ import annotations

import enum
import http.client
import os
from pathlib import Path

# Triton's HTTP endpoint answers a model readiness request with 200 (ready), 400 (not ready),
# 404 (no such model: unloaded) or 503 (the server is not ready: it is exiting).
NOT_READY_STATUSES = (400, 404, 503)


class Readiness(enum.Enum):
    READY = "ready"
    NOT_READY = "not_ready"
    UNKNOWN = "unknown"      # no answer about readiness; why is in ReadinessProbe.last_error


def _flag(args: list[str], name: str) -> str | None:
    """The value of --name=value or --name value in a command line (the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
        elif a == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
    return value


def server_http_address(cmdline: list[str]) -> tuple[str, int] | None:
    """(host, port) of tritonserver's HTTP endpoint, as this machine reaches it, from its
    command line; None when it has none (--allow-http=false)."""
    if (_flag(cmdline, "allow-http") or "true").lower() in ("false", "0", "no"):
        return None
    host = _flag(cmdline, "http-address") or "0.0.0.0"
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::", "[::]") else host.strip("[]")
    return host, int(_flag(cmdline, "http-port") or "8000")


class ReadinessProbe:
    def __init__(self, host: str, port: int, path: str, timeout_s: float = 2.0):
        self.host, self.port, self.path = host, port, path
        self.timeout_s = timeout_s
        self.last_error: str | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    @classmethod
    def for_this_server(cls, model: str, version: str) -> "ReadinessProbe | None":
        try:
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        except OSError:
            return None
        args = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
        if not args or "tritonserver" not in Path(args[0]).name:
            return None
        address = server_http_address(args[1:])
        if address is None:
            return None
        return cls(*address, f"/v2/models/{model}/versions/{version}/ready")

    def poll(self) -> Readiness:
        """What the server says; UNKNOWN (``last_error`` says why) when it said nothing about
        readiness. Never raises."""
        conn = None
        try:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            conn.request("GET", self.path)
            response = conn.getresponse()
            response.read()
            status = response.status
        except ConnectionRefusedError as e:   # nothing listens: the endpoint was closed
            self.last_error = f"{type(e).__name__}: {e}"
            return Readiness.NOT_READY
        except Exception as e:  # noqa: BLE001 - OSError, HTTPException, anything: no answer
            self.last_error = f"{type(e).__name__}: {e}"
            return Readiness.UNKNOWN
        finally:
            if conn is not None:
                conn.close()
        if status == 200:
            self.last_error = None
            return Readiness.READY
        if status in NOT_READY_STATUSES:
            self.last_error = None
            return Readiness.NOT_READY
        self.last_error = f"HTTP {status} from {self.url}"
        return Readiness.UNKNOWN

    def ready(self) -> bool:
        """True only when the server says the model is ready."""
        return self.poll() is Readiness.READY
