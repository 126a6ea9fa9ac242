"""A request in flight, from ``execute`` to its final response, and the registry of them.

Each request schema is a subclass (``text_request.TextRequest``, ``token_request.TokenRequest``,
as Triton's vLLM backend has one request class per schema): its constructor parses the inputs
(``InvalidRequest`` names what is wrong) into ``prompt``, ``params`` and ``stream``, and its two
response methods turn the engine's outputs into that schema's responses. What is common to all
of them lives here: the response sender, cancellation, and the timing the metrics report.
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

from backend.engine.outputs import RequestOutput
from backend.sampling.params import SamplingParams


# A client's request id is logged at most this long (escaped: it is the client's text).
MAX_LOGGED_ID = 128


@dataclass(frozen=True)
class RequestLimits:
    """What a request may hold, checked before any work in proportion to its size is done."""
    max_prompt_bytes: int          # a text prompt, checked before it is decoded and tokenized
    max_prompt_tokens: int         # a token prompt, checked before its ids are converted
    vocab_size: int

    @classmethod
    def of_engine(cls, engine: Any) -> "RequestLimits":
        return cls(max_prompt_bytes=engine.max_prompt_bytes, max_prompt_tokens=engine.max_model_len - 1,
                   vocab_size=engine.target.config.vocab_size)


class ServedRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False

    def __init__(self, pb: Any, request: Any, sender: Any = None, arrival: float = 0.0,
                 token_text: Any = None, limits: RequestLimits | None = None):
        """``token_text(token_id) -> str``: the model's tokenizer, for outputs that spell tokens;
        ``limits``: sizes refused before parsing (None: the engine checks them alone)."""
        self.pb = pb
        self.token_text = token_text
        self.limits = limits
        self.request = request
        self.sender = sender
        self.arrival = arrival
        self.id = uuid.uuid4().hex                # the engine's id (clients' ids may repeat)
        self.client_id = _client_id(request)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.cancelled = False
        self.final_sent = False
        # Triton's Python backend frees a request's response factory when its final flag is
        # sent, so asking the sender about cancellation after that reads freed memory and takes
        # the server down (a segfault in TRITONBACKEND_ResponseFactoryIsCancelled). The final
        # flag goes out on the response thread, or on the execute thread when admission fails;
        # this lock keeps the question and the flag apart.
        self._final_lock = threading.Lock()

    # ---- the schema's side

    def partial_response(self, out: RequestOutput) -> Any | None:
        """The response for a non-final output, or None when it sends nothing now."""
        raise NotImplementedError

    def final_response(self, out: RequestOutput) -> Any:
        """The final response of a request that finished normally (stop or length)."""
        raise NotImplementedError

    def tensor(self, name: str, array: Any) -> Any:
        return self.pb.Tensor(name, array)

    # ---- common to every schema

    def track(self, out: RequestOutput, t_first: float, t_last: float) -> None:
        """Note an output's times (of its first and last merged part) and counts."""
        if out.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = t_first
            self.last_token_at = t_last
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens or self.num_output_tokens

    def latencies(self) -> tuple[float | None, float | None]:
        """(time to first token, mean time per output token after the first)."""
        if self.first_token_at is None:
            return None, None
        tpot = None
        if self.num_output_tokens > 1:
            tpot = (self.last_token_at - self.first_token_at) / (self.num_output_tokens - 1)
        return self.first_token_at - self.arrival, tpot

    def mark_final(self) -> None:
        """Its final flag is about to be sent: its cancellation is not asked from here on
        (waits for a question already under way)."""
        with self._final_lock:
            self.final_sent = True

    def client_cancelled(self) -> bool:
        """Has the client cancelled it? False once its final flag is on its way."""
        with self._final_lock:
            if self.final_sent:
                return False
            try:
                return bool(self.sender.is_cancelled())
            except AttributeError:     # a stub whose response sender cannot tell
                try:
                    return bool(self.request.is_cancelled())
                except Exception:
                    return False
            except Exception:
                return False

    @property
    def label(self) -> str:
        """How the request is named in the log: the client's id escaped (a newline in it must not
        start a log line of its own), or ours."""
        if not self.client_id:
            return self.id
        shown = self.client_id[:MAX_LOGGED_ID].encode("unicode_escape").decode("ascii")
        return shown + ("..." if len(self.client_id) > MAX_LOGGED_ID else "")


def _client_id(request: Any) -> str:
    try:
        return request.request_id() or ""
    except Exception:
        return ""


class InflightRequests:
    """The requests that have not had their final response yet; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, ServedRequest] = {}

    def add(self, r: ServedRequest) -> None:
        with self._lock:
            self._by_id[r.id] = r

    def remove(self, r: ServedRequest) -> None:
        with self._lock:
            self._by_id.pop(r.id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def watched(self) -> list[ServedRequest]:
        """Those whose cancellation is still worth polling."""
        with self._lock:
            return [r for r in self._by_id.values() if not r.cancelled and not r.final_sent]

    def take_all(self) -> list[ServedRequest]:
        with self._lock:
            left = list(self._by_id.values())
            self._by_id.clear()
        return left
