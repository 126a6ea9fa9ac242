"""A small client for the nightdraft Triton models.

Two transports, one shape of result:

- :class:`GrpcClient`: gRPC bidirectional streaming through ``tritonclient.grpc`` (the only way
  to call a decoupled model over gRPC). Closing the iterator early (``break``, an exception,
  ``.close()``) cancels the request on the server, which aborts it in the engine.
- :class:`HttpClient`: HTTP ``/v2/models/<m>/generate_stream`` (server-sent events) and
  ``/generate`` (one JSON answer), with the standard library only.

Both speak the request schema of Triton's vLLM backend (``text_input``, ``stream``,
``sampling_parameters``, ``exclude_input_in_output``, ``return_*``), which the ``nightdraft``
model implements, and the TensorRT-LLM ensemble's (``text_input``, ``max_tokens``, ``stream``
plus sampling scalars) with ``schema="ensemble"``.
"""
from __future__ import annotations

import json
import queue
import socket
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np


class ClientError(RuntimeError):
    """The server answered with an error (bad input, cancelled, internal), or did not answer."""


@dataclass
class Chunk:
    """One response of a stream."""
    text: str
    t: float                                  # time.monotonic() when it arrived
    finished: bool = False
    finish_reason: str | None = None
    num_output_tokens: int | None = None
    num_input_tokens: int | None = None


@dataclass
class Result:
    """A whole generation, with the client-side timings a benchmark needs."""
    text: str = ""
    chunks: list[Chunk] = field(default_factory=list)
    finish_reason: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    num_output_tokens: int | None = None
    num_input_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        first = next((c for c in self.chunks if c.text), None)
        return None if first is None else first.t - self.t_start

    @property
    def e2e(self) -> float:
        return self.t_end - self.t_start


def collect(chunks: Iterator[Chunk], t_start: float | None = None) -> Result:
    res = Result(t_start=time.monotonic() if t_start is None else t_start)
    parts = []
    for c in chunks:
        res.chunks.append(c)
        parts.append(c.text)
        if c.finish_reason not in (None, "None"):
            res.finish_reason = c.finish_reason
        if c.num_output_tokens is not None:
            res.num_output_tokens = (res.num_output_tokens or 0) + c.num_output_tokens
        if c.num_input_tokens is not None:
            res.num_input_tokens = c.num_input_tokens
    res.t_end = time.monotonic()
    res.text = "".join(parts)
    return res


def _host_port(url: str, default_port: int) -> str:
    url = url.strip()
    for prefix in ("http://", "https://", "grpc://"):
        if url.startswith(prefix):
            url = url[len(prefix):]
    url = url.rstrip("/")
    return url if ":" in url else f"{url}:{default_port}"


def _sampling(temperature=None, top_p=None, top_k=None, seed=None, stop=None, ignore_eos=None,
              extra: dict | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                 ("stop", stop), ("ignore_eos", ignore_eos)):
        if v is not None:
            out[k] = v
    out.update(extra or {})
    return out


# --------------------------------------------------------------------------------------- gRPC


class GrpcClient:
    """Streams requests over gRPC. By default each request opens its own channel and stream;
    with ``keep_open`` one channel and one stream serve this client's requests one after another
    (a load generator's worker: a channel per request costs the client more CPU than the
    request's tokens do)."""

    def __init__(self, url: str = "localhost:8001", model: str = "nightdraft", *,
                 schema: str = "vllm", timeout_s: float = 600.0, keep_open: bool = False):
        self.url = _host_port(url, 8001)
        self.model = model
        self.schema = schema
        self.timeout_s = timeout_s
        self.keep_open = keep_open
        self._open = None            # (InferenceServerClient, its response queue) when kept open

    def _connection(self, timeout_s: float):
        """A client with a started stream and the queue its responses arrive on."""
        import tritonclient.grpc as grpcclient
        if self._open is not None:
            return self._open
        q: queue.SimpleQueue = queue.SimpleQueue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: q.put((result, error, time.monotonic())),
                            stream_timeout=None if self.keep_open else timeout_s)
        if self.keep_open:
            self._open = (client, q)
        return client, q

    def _release(self, client, finished: bool, clean: bool = False) -> None:
        """Done with one request: a kept stream stays open after a final response; after an
        error, or leaving early (which cancels the request), it ends (a new one opens next)."""
        if self.keep_open and clean:
            return
        self._open = None
        try:
            client.stop_stream(cancel_requests=not finished)
        except Exception:
            pass
        try:
            client.close()
        except Exception:
            pass

    def close(self) -> None:
        if self._open is not None:
            self._release(self._open[0], finished=True)

    def _inputs(self, prompt: str, stream: bool, max_tokens, sampling: dict, exclude_input_in_output,
                return_extras: bool):
        import tritonclient.grpc as grpcclient

        def tensor(name, value, dtype):
            arr = np.array([value], dtype=dtype)
            t = grpcclient.InferInput(name, list(arr.shape), {np.object_: "BYTES", np.bool_: "BOOL",
                                                             np.int32: "INT32", np.float32: "FP32",
                                                             np.uint64: "UINT64"}[dtype])
            t.set_data_from_numpy(arr)
            return t

        ins = [tensor("text_input", prompt.encode("utf-8"), np.object_), tensor("stream", stream, np.bool_)]
        if self.schema == "ensemble":
            if max_tokens is not None:
                ins.append(tensor("max_tokens", int(max_tokens), np.int32))
            for key, name, dt in (("temperature", "temperature", np.float32), ("top_k", "top_k", np.int32),
                                  ("top_p", "top_p", np.float32), ("seed", "random_seed", np.uint64)):
                if key in sampling:
                    ins.append(tensor(name, sampling[key], dt))
            return ins
        sp = dict(sampling)
        if max_tokens is not None:
            sp["max_tokens"] = int(max_tokens)
        if sp:
            ins.append(tensor("sampling_parameters", json.dumps(sp).encode(), np.object_))
        if exclude_input_in_output is not None:
            ins.append(tensor("exclude_input_in_output", bool(exclude_input_in_output), np.bool_))
        if return_extras:
            for name in ("return_finish_reason", "return_num_output_tokens", "return_num_input_tokens"):
                ins.append(tensor(name, True, np.bool_))
        return ins

    def stream(self, prompt: str, *, max_tokens: int | None = None, stream: bool = True,
               temperature=None, top_p=None, top_k=None, seed=None, stop=None, ignore_eos=None,
               sampling: dict | None = None, exclude_input_in_output: bool | None = None,
               return_extras: bool = True, request_id: str | None = None,
               timeout_s: float | None = None) -> Iterator[Chunk]:
        """Yield the responses of one request as they arrive. Raises :class:`ClientError` for
        an error response. Leaving the loop early cancels the request on the server."""
        from tritonclient.utils import InferenceServerException

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        sp = _sampling(temperature, top_p, top_k, seed, stop, ignore_eos, sampling)
        inputs = self._inputs(prompt, stream, max_tokens, sp, exclude_input_in_output,
                              return_extras and self.schema != "ensemble")
        client, q = self._connection(timeout_s)
        finished = clean = False     # the request ended; it ended with its final response
        request_id = request_id or uuid.uuid4().hex
        try:
            client.async_stream_infer(self.model, inputs, request_id=request_id,
                                      enable_empty_final_response=True)
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClientError(f"no final response within {timeout_s:.0f} s")
                try:
                    result, error, t = q.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                if error is not None:
                    finished = True
                    msg = error.message() if isinstance(error, InferenceServerException) else str(error)
                    raise ClientError(msg)
                if result.get_response().id != request_id:
                    continue        # (a kept stream: never another request's, but be sure)
                chunk = self._chunk(result, t)
                finished = clean = chunk.finished
                if chunk.text or chunk.finished or chunk.num_output_tokens:
                    yield chunk
                if finished:
                    return
        finally:
            self._release(client, finished, clean)

    @staticmethod
    def _chunk(result: Any, t: float) -> Chunk:
        resp = result.get_response()
        final = False
        if "triton_final_response" in resp.parameters:
            final = resp.parameters["triton_final_response"].bool_param
        names = {o.name for o in resp.outputs}
        text = ""
        if "text_output" in names:
            arr = result.as_numpy("text_output")
            if arr is not None and arr.size:
                text = "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                               for x in arr.reshape(-1))
        reason = None
        if "finish_reason" in names:
            arr = result.as_numpy("finish_reason")
            if arr is not None and arr.size:
                v = arr.reshape(-1)[0]
                reason = v.decode() if isinstance(v, bytes) else str(v)
                if reason == "None":
                    reason = None
        n_out = n_in = None
        if "num_output_tokens" in names:
            n_out = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
        if "num_input_tokens" in names:
            n_in = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
        return Chunk(text=text, t=t, finished=final, finish_reason=reason,
                     num_output_tokens=n_out, num_input_tokens=n_in)

    def generate(self, prompt: str, **kw) -> Result:
        t0 = time.monotonic()
        return collect(self.stream(prompt, **kw), t_start=t0)


# --------------------------------------------------------------------------------------- HTTP


class HttpClient:
    def __init__(self, url: str = "localhost:8000", model: str = "nightdraft", *,
                 schema: str = "vllm", timeout_s: float = 600.0):
        self.base = "http://" + _host_port(url, 8000)
        self.model = model
        self.schema = schema
        self.timeout_s = timeout_s

    def _body(self, prompt, stream, max_tokens, sp, exclude_input_in_output, return_extras) -> dict:
        body: dict[str, Any] = {"text_input": prompt, "stream": stream}
        if self.schema == "ensemble":
            if max_tokens is not None:
                body["max_tokens"] = int(max_tokens)
            for key, name in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                              ("seed", "random_seed")):
                if key in sp:
                    body[name] = sp[key]
            return body
        sp = dict(sp)
        if max_tokens is not None:
            sp["max_tokens"] = int(max_tokens)
        if sp:
            body["sampling_parameters"] = json.dumps(sp)
        if exclude_input_in_output is not None:
            body["exclude_input_in_output"] = bool(exclude_input_in_output)
        if return_extras:
            body.update(return_finish_reason=True, return_num_output_tokens=True,
                        return_num_input_tokens=True)
        return body

    def _post(self, path: str, body: dict, timeout_s: float):
        req = urllib.request.Request(f"{self.base}/v2/models/{self.model}/{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=timeout_s)
        except urllib.error.HTTPError as e:
            raise ClientError(_error_text(e.read())) from None
        except (urllib.error.URLError, socket.timeout, ConnectionError) as e:
            raise ClientError(f"{self.base}: {e}") from None

    @staticmethod
    def _chunk(obj: dict, t: float, final: bool) -> Chunk:
        if "error" in obj:
            raise ClientError(str(obj["error"]))
        text = obj.get("text_output", "")
        if isinstance(text, list):
            text = "".join(map(str, text))
        reason = obj.get("finish_reason")
        if isinstance(reason, list):
            reason = reason[0] if reason else None
        if reason == "None":
            reason = None

        def num(key):
            v = obj.get(key)
            if isinstance(v, list):
                v = v[0] if v else None
            return None if v is None else int(v)
        return Chunk(text=text, t=t, finished=final, finish_reason=reason,
                     num_output_tokens=num("num_output_tokens"), num_input_tokens=num("num_input_tokens"))

    def stream(self, prompt: str, *, max_tokens: int | None = None, stream: bool = True,
               temperature=None, top_p=None, top_k=None, seed=None, stop=None, ignore_eos=None,
               sampling: dict | None = None, exclude_input_in_output: bool | None = None,
               return_extras: bool = True, timeout_s: float | None = None) -> Iterator[Chunk]:
        """POST ``generate_stream`` and yield one chunk per server-sent event."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        sp = _sampling(temperature, top_p, top_k, seed, stop, ignore_eos, sampling)
        body = self._body(prompt, stream, max_tokens, sp, exclude_input_in_output, return_extras)
        resp = self._post("generate_stream", body, timeout_s)
        try:
            with resp:
                for raw in resp:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    t = time.monotonic()
                    payload = line[5:].strip()
                    try:
                        obj = json.loads(payload)
                    except json.JSONDecodeError:
                        raise ClientError(f"malformed event from the server: {payload[:200]!r}") from None
                    yield self._chunk(obj, t, final=False)
        except (socket.timeout, ConnectionError) as e:
            raise ClientError(f"{self.base}: stream broken: {e}") from None
        # SSE events do not carry Triton's final flag; the end of the body is the end.
        yield Chunk(text="", t=time.monotonic(), finished=True)

    def generate(self, prompt: str, *, max_tokens: int | None = None, temperature=None, top_p=None,
                 top_k=None, seed=None, stop=None, ignore_eos=None, sampling: dict | None = None,
                 exclude_input_in_output: bool | None = None, return_extras: bool = True,
                 timeout_s: float | None = None) -> Result:
        """POST ``generate`` (not streamed): one response with the whole text."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        sp = _sampling(temperature, top_p, top_k, seed, stop, ignore_eos, sampling)
        body = self._body(prompt, False, max_tokens, sp, exclude_input_in_output, return_extras)
        with self._post("generate", body, timeout_s) as resp:
            obj = json.loads(resp.read())
        return collect(iter([self._chunk(obj, time.monotonic(), final=True)]), t_start=t0)


def _error_text(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        if isinstance(obj, dict) and "error" in obj:
            return str(obj["error"])
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    return raw.decode("utf-8", "replace")


def make_client(url: str | None = None, protocol: str = "grpc", model: str = "nightdraft",
                schema: str | None = None, timeout_s: float = 600.0, keep_open: bool = False):
    """A client for `protocol`; `keep_open` (gRPC): one channel and stream for all its requests."""
    schema = schema or ("ensemble" if model == "ensemble" else "vllm")
    if protocol == "grpc":
        return GrpcClient(url or "localhost:8001", model, schema=schema, timeout_s=timeout_s,
                          keep_open=keep_open)
    if protocol == "http":
        return HttpClient(url or "localhost:8000", model, schema=schema, timeout_s=timeout_s)
    raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")


# --------------------------------------------------------------------------------------- CLI


def add_complete_parser(subparsers):
    """``nightdraft complete "prompt"``: stream a completion from a running server."""
    import argparse
    p = subparsers.add_parser("complete", help="stream a completion from a running server",
                              description="Send one prompt to a running nightdraft server and print "
                                          "the text as it arrives (timings go to stderr).")
    p.add_argument("prompt", help="the prompt ('-' reads it from stdin)")
    p.add_argument("--url", default=None,
                   help="server address (default: localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--model", default="nightdraft", help="nightdraft (default) or ensemble")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the text as it is generated (default on); --no-stream waits for all of it")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--no-speculation", action="store_true",
                   help="opt this request out of speculative decoding")
    p.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quiet", "-q", action="store_true", help="no timings on stderr")
    p.set_defaults(func=complete_main)
    return p


def complete_main(args) -> int:
    import sys
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    client = make_client(args.url, args.protocol, args.model, timeout_s=args.timeout)
    extra = {"speculative": False} if args.no_speculation else None
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
              top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
              sampling=extra)
    if client.schema == "ensemble":
        for k in ("stop", "ignore_eos", "sampling"):
            if kw.get(k):
                print(f"nightdraft complete: --{k.replace('_', '-')} is not supported by the ensemble",
                      file=sys.stderr)
            kw.pop(k)
    if args.echo:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    t0 = time.monotonic()
    try:
        if args.stream:
            def printing():
                for ch in client.stream(prompt, **kw):
                    if ch.text:
                        sys.stdout.write(ch.text)
                        sys.stdout.flush()
                    yield ch
            res = collect(printing(), t_start=t0)
        elif isinstance(client, HttpClient) and client.schema != "ensemble":
            res = client.generate(prompt, exclude_input_in_output=True, **kw)
            sys.stdout.write(res.text)
        else:
            if client.schema != "ensemble":
                kw["exclude_input_in_output"] = True
            res = collect(client.stream(prompt, stream=False, **kw), t_start=t0)
            sys.stdout.write(res.text)
    except ClientError as e:
        print(f"\nnightdraft complete: server error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the stream cancels the request on the server
        print("\nnightdraft complete: cancelled", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        n = res.num_output_tokens
        ttft = res.ttft
        parts = [f"{n} tokens" if n is not None else f"{len(res.chunks)} responses",
                 f"finish {res.finish_reason or '-'}",
                 f"TTFT {ttft * 1000:.0f} ms" if ttft is not None else None,
                 f"total {res.e2e * 1000:.0f} ms"]
        if n and n > 1 and ttft is not None and sum(1 for c in res.chunks if c.text) > 1:
            parts.append(f"TPOT {(res.e2e - ttft) / (n - 1) * 1000:.1f} ms")
        print("[" + ", ".join(p for p in parts if p) + "]", file=sys.stderr)
    return 0
