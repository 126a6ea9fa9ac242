"""A drop-in for clients of Triton's vLLM backend, through the real tritonserver: every
combination of its output flags x stream x logprobs, its metric families under their names,
labels, buckets and observation counts, and its error texts.

The flag matrix follows the vLLM backend's own output-flags test: for each of stream (2),
return_finish_reason, return_cumulative_logprob, return_logprobs, return_num_input_tokens,
return_num_output_tokens (None / True / False each) and sampling_parameters' logprobs
(None / 0 / 2): 1458 requests, each checked response by response.
"""
from __future__ import annotations

import itertools
import json
import queue
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers.triton import settled, wait_kv_free

pytestmark = pytest.mark.slow

PROMPT = "def main(argv):\n"
MAX_TOKENS = 12
SAMPLING = {"temperature": "0", "top_p": "1", "max_tokens": MAX_TOKENS, "ignore_eos": True}
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
         "return_num_input_tokens", "return_num_output_tokens")


def stream_infer(url: str, inputs: list, model: str = "nightdraft", timeout: float = 60.0) -> list:
    """[(result, error)] of one request on its own stream, up to and with its final response."""
    import tritonclient.grpc as grpcclient

    q: queue.SimpleQueue = queue.SimpleQueue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, e = q.get(timeout=timeout)
            got.append((r, e))
            if e is not None or r.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return got


def make_inputs(stream: bool, sampling: dict, flags: dict) -> list:
    import tritonclient.grpc as grpcclient

    def tensor(name, arr, dt):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        return t
    ins = [tensor("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
           tensor("stream", np.array([stream]), "BOOL"),
           tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES")]
    ins += [tensor(k, np.array([v]), "BOOL") for k, v in flags.items() if v is not None]
    return ins


def check(responses: list, stream: bool, logprobs, flags: dict) -> list[str]:
    """What is wrong with one request's responses (empty: nothing)."""
    wrong = []
    results = [r for r, e in responses if r is not None and e is None]
    if any(e is not None for _, e in responses):
        return [f"an error: {[str(e) for _, e in responses if e is not None]}"]
    sent = [r for r in results if r.as_numpy("text_output") is not None]
    text = "".join(r.as_numpy("text_output")[0].decode() for r in sent)
    prev_cum = 0.0
    for i, r in enumerate(sent):
        final = i == len(sent) - 1
        for flag, output in (("return_finish_reason", "finish_reason"), ("return_cumulative_logprob", "cumulative_logprob"),
                             ("return_logprobs", "logprobs"), ("return_num_input_tokens", "num_input_tokens"),
                             ("return_num_output_tokens", "num_output_tokens")):
            if (r.as_numpy(output) is not None) != bool(flags[flag]):
                wrong.append(f"{output} present={r.as_numpy(output) is not None} with {flag}={flags[flag]}")
        if flags["return_finish_reason"]:
            reason = r.as_numpy("finish_reason")[0].decode()
            if reason != ("length" if final else "None"):
                wrong.append(f"finish_reason {reason!r} on response {i}")
        if flags["return_cumulative_logprob"]:
            cum = float(r.as_numpy("cumulative_logprob")[0])
            if not cum <= prev_cum or (final and not cum < 0):   # a sum of logprobs only falls
                wrong.append(f"cumulative_logprob {cum} after {prev_cum}")
            prev_cum = cum
        if flags["return_num_input_tokens"] and not 0 < int(r.as_numpy("num_input_tokens")[0]) <= len(PROMPT):
            wrong.append("num_input_tokens out of range")
        if flags["return_logprobs"]:
            wrong += check_logprobs(r, stream, logprobs, flags)
    if not stream and len(sent) != 1:
        wrong.append(f"{len(sent)} responses for a request that does not stream")
    if not (text.startswith(PROMPT) if not stream else text):
        wrong.append("text_output is wrong")
    return wrong


def check_logprobs(r, stream: bool, logprobs, flags: dict) -> list[str]:
    lp = json.loads(r.as_numpy("logprobs")[0].decode())
    if logprobs is None:
        return [] if lp is None else ["logprobs given though sampling_parameters asked for none"]
    wrong, spelled = [], ""
    if flags["return_num_output_tokens"] and len(lp) != int(r.as_numpy("num_output_tokens")[0]):
        wrong.append("one logprobs entry per output token expected")
    for entry in lp:
        if not 1 <= len(entry) <= logprobs + 1:
            wrong.append(f"{len(entry)} alternatives for logprobs={logprobs}")
        ranks = [d["rank"] for d in entry.values()]
        if ranks.count(1) != 1 or not all(isinstance(t, str) and set(d) == {"logprob", "rank", "decoded_token"}
                                          and isinstance(d["logprob"], float) for t, d in entry.items()):
            wrong.append(f"malformed entry {entry}")
            continue
        spelled += next(d["decoded_token"] for d in entry.values() if d["rank"] == 1)
    text = r.as_numpy("text_output")[0].decode()
    if (spelled if stream else PROMPT + spelled) != text:       # greedy: the rank-1 tokens spell it
        wrong.append(f"rank-1 tokens spell {spelled!r}, the text is {text!r}")
    return wrong


def test_every_output_flag_combination(triton_server):
    cases = [(stream, lp, dict(zip(FLAGS, values)))
             for stream in (True, False) for lp in (None, 0, 2)
             for values in itertools.product((None, True, False), repeat=len(FLAGS))]
    assert len(cases) == 1458

    def run(case):
        stream, lp, flags = case
        sampling = SAMPLING | ({} if lp is None else {"logprobs": lp})
        return case, check(stream_infer(triton_server.grpc_url, make_inputs(stream, sampling, flags)), stream, lp, flags)
    with ThreadPoolExecutor(8) as pool:
        failures = [(c, w) for c, w in pool.map(run, cases) if w]
    assert not failures, f"{len(failures)} of 1458 combinations fail; first: {failures[:3]}"


def vllm_samples(server) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:[a-z0-9_:]+)\{([^}]*)\}\s+(\S+)$', line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2))))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(samples, name: str, **match) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all((k, str(val)) in labels for k, val in match.items()))


def test_vllm_metric_families_count_as_vllm_does(triton_server):
    from client.triton_client import GrpcClient
    from backend.model.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(triton_server.engine_config["target"])
    prompts = ["def f(x):\n", "import os\n", "class A:\n", "for i in range(3):\n", "x = [1, 2]\n", "# note\n"]
    wait_kv_free(triton_server)                # nothing in flight
    before = settled(lambda: vllm_samples(triton_server))
    client = GrpcClient(triton_server.grpc_url, "nightdraft", timeout_s=60)
    for p in prompts:
        list(client.stream(p, max_tokens=16, temperature=0.0, ignore_eos=True))
    n, gen, prompt = len(prompts), 16 * len(prompts), sum(len(tok.encode(p)) for p in prompts)

    def change(sample, name, **match):
        match.setdefault("model", "nightdraft")
        return total(sample, name, **match) - total(before, name, **match)

    def moved(sample):
        return (change(sample, "vllm:e2e_request_latency_seconds_count") >= n
                and change(sample, "vllm:generation_tokens_total") >= gen
                and change(sample, "vllm:time_per_output_token_seconds_count") >= n * 15)
    # The counters follow the engine when it goes idle, a moment after the last response: poll
    # until the last of them has moved and no update is half done (or a deadline), then check
    # every one exactly.
    after = settled(lambda: vllm_samples(triton_server), until=moved)

    def delta(name, **match):
        return change(after, name, **match)
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == gen
    assert delta("vllm:time_to_first_token_seconds_count") == n
    assert delta("vllm:time_per_output_token_seconds_count") == n * 15, "once per output token after the first"
    assert delta("vllm:e2e_request_latency_seconds_count") == n
    assert delta("vllm:request_prompt_tokens_sum") == prompt and delta("vllm:request_prompt_tokens_count") == n
    assert delta("vllm:request_generation_tokens_sum") == gen
    assert delta("vllm:request_params_n_sum") == n
    drafts, drafted, accepted = (delta(f"vllm:spec_decode_num_{k}_total") for k in ("drafts", "draft_tokens", "accepted_tokens"))
    assert drafts > 0 and 0 < accepted < drafted
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p)
               for p in range(triton_server.engine_config.get("gamma_max", 8))]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    labels = {labels for (name, labels) in after if name == "vllm:generation_tokens_total"}
    assert labels == {(("model", m), ("version", "1")) for m in ("nightdraft", "nightdraft_tokens")}
    labels = {(("model", "nightdraft"), ("version", "1"))}
    ttft_le = sorted(float(dict(lb)["le"]) for (name, lb) in after
                     if name == "vllm:time_to_first_token_seconds_bucket" and dict(lb)["le"] != "+Inf"
                     and dict(lb)["model"] == "nightdraft")
    assert ttft_le == [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
    assert delta("vllm:num_requests_running") == 0 and ("vllm:gpu_cache_usage_perc", labels.pop()) in after


def test_generate_with_stream_true_says_to_use_generate_stream(triton_server):
    """The model cannot tell /generate from /generate_stream (both send it the same request), so
    as with the vLLM backend Triton answers: one response expected, use generate_stream."""
    body = json.dumps({"text_input": "def f():", "stream": True, "parameters": {"max_tokens": 4}}).encode()
    req = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/nightdraft/generate", data=body,
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = r.read().decode()
    assert "use generate stream" in answer


def test_logprobs_beyond_top_k_are_strict_json(triton_server):
    """With more alternatives asked for than top_k keeps, the extra ones have probability 0: a
    strict JSON parser (JavaScript's, Go's, serde) must read the logprobs; OpenAI's -9999.0
    stands for them."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    sampling = {"max_tokens": 4, "temperature": 1.0, "top_k": 5, "seed": 3, "logprobs": 10, "ignore_eos": True}
    for stream in (False, True):
        got = stream_infer(triton_server.grpc_url, make_inputs(stream, sampling, {"return_logprobs": True}))
        assert all(e is None for _, e in got), got
        entries = [entry for r, _ in got if r.as_numpy("logprobs") is not None
                   for entry in json.loads(r.as_numpy("logprobs")[0].decode(), parse_constant=refuse)]
        assert len(entries) == 4
        for entry in entries:
            values = sorted((d["logprob"] for d in entry.values()), reverse=True)
            assert len(values) >= 10
            assert values[5:] == [-9999.0] * len(values[5:]) and all(v > -9999.0 for v in values[:5])
