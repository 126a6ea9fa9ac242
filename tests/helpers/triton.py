"""Talking to a real tritonserver in tests: raw gRPC streams, the model's metrics, short prompts."""
from __future__ import annotations

import queue
import re
import threading
import time
import urllib.request

T = 60.0          # seconds: per request


def short_prompts(n: int) -> list[str]:
    from client.prompts import load_prompts
    return [p[:160] for p in load_prompts(n=n)]


def metrics(server, model: str = "nightdraft") -> dict[str, float]:
    """nightdraft_* samples of one model (labels other than model/version kept in the key)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(nightdraft_[a-z0-9_]+)\{([^}]*)\}\s+(\S+)$', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.pop("model", None) != model:
            continue
        labels.pop("version", None)
        key = m.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                            if labels else "")
        out[key] = float(m.group(3))
    return out


def wait_kv_free(server, model: str = "nightdraft", timeout: float = 15.0,
                 until=lambda m: True) -> dict[str, float]:
    """Poll the metrics until no request runs or waits and every KV block is free (and
    ``until(metrics)`` holds: per-request counters are updated when the final response goes
    out, which can be a moment after the engine freed the blocks)."""
    deadline = time.monotonic() + timeout
    m = {}
    while time.monotonic() < deadline:
        m = metrics(server, model)
        total = m.get("nightdraft_kv_cache_total_blocks", 0)
        if (total > 0 and m.get("nightdraft_kv_cache_free_blocks") == total
                and m.get("nightdraft_num_requests_running") == 0
                and m.get("nightdraft_num_requests_waiting") == 0 and until(m)):
            return m
        time.sleep(0.1)
    raise AssertionError(f"KV blocks not all free after {timeout} s: "
                         f"{ {k: v for k, v in m.items() if 'kv' in k or 'requests_' in k} }")


def settled(scrape, until=lambda sample: True, timeout: float = 15.0, pause: float = 0.2):
    """A scrape equal to the one `pause` seconds before it, for which ``until`` holds (or the
    last one at the deadline). The model sets its metrics one IPC call at a time, so a scrape
    taken during an update can see one counter advanced and a related one not yet."""
    deadline = time.monotonic() + timeout
    previous = scrape()
    while True:
        time.sleep(pause)
        current = scrape()
        if (current == previous and until(current)) or time.monotonic() > deadline:
            return current
        previous = current


def stream_request(server, ins: list, model: str = "nightdraft", on_response=None):
    """Send one request (a list of InferInput) on a fresh stream; return (responses, errors,
    closed_in_time). The stream closes only after the model sent the final flag, so
    closed_in_time proves the flag came. `on_response(result)` is called as each response comes."""
    import tritonclient.grpc as grpcclient

    cl = grpcclient.InferenceServerClient(server.grpc_url)
    q = queue.SimpleQueue()
    cl.start_stream(callback=lambda result, error: q.put((result, error)), stream_timeout=T)
    responses, errors = [], []
    try:
        cl.async_stream_infer(model, ins, enable_empty_final_response=True)
        deadline = time.monotonic() + T
        while time.monotonic() < deadline:
            try:
                result, error = q.get(timeout=1.0)
            except queue.Empty:
                continue
            if error is not None:
                errors.append(error.message() if hasattr(error, "message") else str(error))
                break
            responses.append(result)
            if on_response is not None:
                on_response(result)
            if is_final(result):
                break
    finally:
        closer = threading.Thread(target=cl.stop_stream, kwargs={"cancel_requests": False}, daemon=True)
        closer.start()
        closer.join(15)
        closed = not closer.is_alive()
        if closed:
            cl.close()
    return responses, errors, closed


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def infer_raw(server, inputs, model: str = "nightdraft", on_response=None):
    """One request on its own stream; (text of the responses, error messages, final flag seen:
    an error ends the request, its final flag comes with it)."""
    import tritonclient.grpc as grpcclient

    ins = []
    for name, arr, dt in inputs:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        ins.append(t)
    responses, errors, closed = stream_request(server, ins, model, on_response)
    texts = [x.decode() for r in responses if (out := r.as_numpy("text_output")) is not None
             for x in out.reshape(-1)]
    final = bool(errors) or bool(responses) and is_final(responses[-1])
    return "".join(texts), errors, final and closed

