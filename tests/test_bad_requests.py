"""A catalogue of bad requests through the real tritonserver: each gets an error that names its
own problem, followed by the final flag, while a well-formed stream running beside them keeps
exactly the output it has alone.

Cases come in two kinds: the ones the model answers (its parser, the engine's admission), and
the ones Triton's core rejects before the model sees them (wrong datatype or shape, an unknown
input); the latter must not disturb anything either.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers.triton import infer_raw

pytestmark = pytest.mark.slow

T = 60.0


def s(text: str | bytes) -> np.ndarray:
    return np.array([text if isinstance(text, bytes) else text.encode()], dtype=np.object_)


def sp(params) -> tuple[str, np.ndarray, str]:
    raw = params if isinstance(params, (str, bytes)) else json.dumps(params)
    return ("sampling_parameters", s(raw), "BYTES")


HI = ("text_input", s("hi"), "BYTES")
DEEP = "[" * 100_000 + "]" * 100_000

# case: (inputs, words the error must contain)
CATALOGUE = {
    # -- the prompt
    "missing text_input": ([("stream", np.array([True]), "BOOL")], "missing required input 'text_input'"),
    "empty text_input": ([("text_input", s(""), "BYTES")], "input 'text_input' is empty"),
    "text_input not UTF-8": ([("text_input", s(b"\xff\xfe\xfa"), "BYTES")], "input 'text_input' is not valid UTF-8"),
    "text_input of two strings": ([("text_input", np.array([b"a", b"b"], dtype=np.object_), "BYTES")],
                                  "unexpected shape for input 'text_input'"),
    "text_input as INT32": ([("text_input", np.array([7], dtype=np.int32), "INT32")],
                            "input 'text_input' data-type is 'INT32', but model 'nightdraft' expects 'BYTES'"),
    "prompt too long in tokens": ([("text_input", s("x = 1\n" * 3000), "BYTES")], "tokens; the context holds"),
    "prompt too long in bytes": ([("text_input", s("y" * (4 << 20)), "BYTES")], "bytes; at most"),
    "unknown input tensor": ([HI, ("temperaturee", np.array([1], dtype=np.int32), "INT32")],
                             "unexpected inference input 'temperaturee'"),
    # -- sampling_parameters as a whole
    "sampling_parameters not JSON": ([HI, sp("{max_tokens: 8")], "sampling_parameters is not valid JSON"),
    "sampling_parameters a list": ([HI, sp("[1, 2]")], "sampling_parameters must be a JSON object"),
    "sampling_parameters not UTF-8": ([HI, sp(b"\xff{}")], "input 'sampling_parameters' is not valid UTF-8"),
    "sampling_parameters nested too deep": ([HI, sp(DEEP)], "sampling_parameters is nested too deeply"),
    "a 5000-digit integer": ([HI, sp('{"max_tokens": ' + "9" * 5000 + "}")], "sampling_parameters could not be parsed"),
    "unknown sampling parameter": ([HI, sp({"temperatur": 0.5})], "unknown sampling parameter 'temperatur'"),
    # -- one value at a time
    "temperature negative": ([HI, sp({"temperature": -1})], "temperature must be >= 0, got -1.0"),
    "temperature a word": ([HI, sp({"temperature": "hot"})], "temperature must be a number, got 'hot'"),
    "temperature huge": ([HI, sp({"temperature": 1e9})], "temperature must be <= 100"),
    "temperature NaN": ([HI, sp('{"temperature": NaN}')], "temperature must be >= 0, got nan"),
    "temperature beyond a float": ([HI, sp('{"temperature": 1' + "0" * 400 + "}")], "temperature must be a number"),
    "top_p above 1": ([HI, sp({"top_p": 1.5})], "top_p must be in (0, 1], got 1.5"),
    "top_p 0 in float32": ([HI, sp({"top_p": 5e-46, "temperature": 1})], "top_p must be at least 1.175e-38"),
    "top_k negative": ([HI, sp({"top_k": -5})], "top_k must be an integer >= 0"),
    "top_k fractional": ([HI, sp({"top_k": 1.5})], "top_k must be an integer, got 1.5"),
    "max_tokens zero (tensor)": ([HI, ("max_tokens", np.array([0], dtype=np.int32), "INT32")],
                                 "max_tokens must be an integer >= 1, got 0"),
    "max_tokens negative (tensor)": ([HI, ("max_tokens", np.array([-5], dtype=np.int32), "INT32")],
                                     "max_tokens must be an integer >= 1, got -5"),
    "max_tokens a word": ([HI, sp({"max_tokens": "many"})], "max_tokens must be an integer, got 'many'"),
    "max_tokens beyond the context": ([HI, sp({"max_tokens": 10**12})], "max_tokens must be at most the context length"),
    "max_tokens as INT64": ([HI, ("max_tokens", np.array([8], dtype=np.int64), "INT64")],
                            "input 'max_tokens' data-type is 'INT64', but model 'nightdraft' expects 'INT32'"),
    "min_tokens above max_tokens": ([HI, sp({"min_tokens": 9, "max_tokens": 4})], "min_tokens must be in [0, max_tokens]"),
    "seed 2**64": ([HI, sp({"seed": 2**64, "temperature": 1})], "seed must be an integer in [0, 2**64 - 1]"),
    "seed negative": ([HI, sp({"seed": -1})], "seed must be an integer in [0, 2**64 - 1]"),
    "seed a word": ([HI, sp({"seed": "abc"})], "seed must be an integer, got 'abc'"),
    "stop a number": ([HI, sp({"stop": 5})], "stop must be a string or a list of strings, got 5"),
    "stop an empty string": ([HI, sp({"stop": [""]})], "stop strings must be non-empty strings"),
    "too many stop strings": ([HI, sp({"stop": ["a"] * 65})], "at most 64 stop strings"),
    "stop_token_ids outside the vocabulary": ([HI, sp({"stop_token_ids": [10**8]})], "stop_token_ids [100000000] outside"),
    "n above 1": ([HI, sp({"n": 2})], "n must be 1"),
    "best_of above 1": ([HI, sp({"best_of": 3})], "best_of must be 1"),
    "ignore_eos not a boolean": ([HI, sp({"ignore_eos": "maybe"})], "ignore_eos must be a boolean, got 'maybe'"),
    "speculative not a boolean": ([HI, sp({"speculative": "nope"})], "speculative must be a boolean, got 'nope'"),
    "stream not a boolean": ([HI, sp({"stream": "yes"})], "stream must be a boolean, got 'yes'"),
    "streaming with the prompt": ([HI, ("stream", np.array([True]), "BOOL"),
                                   ("exclude_input_in_output", np.array([False]), "BOOL")],
                                  "When streaming, `exclude_input_in_output` = False is not allowed."),
}


@pytest.fixture(scope="module")
def reference(triton_server):
    """The well-formed request's output from the offline engine, same configuration as the server."""
    import torch

    from backend.engine.engine import Engine
    from backend.engine.config import EngineConfig
    from backend.sampling.params import SamplingParams

    threads = torch.get_num_threads()
    try:
        engine = Engine(EngineConfig.from_dict(dict(triton_server.engine_config)))
        params = SamplingParams(max_tokens=GOOD_TOKENS, temperature=0.0, ignore_eos=True)
        return engine.generate([GOOD_PROMPT], params)[0].text
    finally:
        torch.set_num_threads(threads)


GOOD_PROMPT = "def parse(argv):\n"
# Long enough to be still streaming when the last bad request has been answered (checked).
GOOD_TOKENS = 900
GOOD_INPUTS = [("text_input", s(GOOD_PROMPT), "BYTES"), ("stream", np.array([True]), "BOOL"),
               sp({"max_tokens": GOOD_TOKENS, "temperature": 0, "ignore_eos": True})]


def test_every_bad_request_gets_its_own_error_and_spares_a_stream_in_flight(triton_server, reference):
    good: dict = {}
    started = threading.Event()
    t = threading.Thread(target=lambda: good.update(out=infer_raw(
        triton_server, GOOD_INPUTS, on_response=lambda _r: started.set())), daemon=True)
    t.start()
    assert started.wait(T), "the good stream never produced a response"
    wrong = {}
    with ThreadPoolExecutor(8) as pool:         # (8 at a time: all of them while the good one runs)
        answers = dict(zip(CATALOGUE, pool.map(lambda c: infer_raw(triton_server, c[0]), CATALOGUE.values())))
    for case, (_, words) in CATALOGUE.items():
        _, errors, final = answers[case]
        if not errors or words.lower() not in errors[0].lower() or not final:
            wrong[case] = (errors[:1], final)
    in_flight = t.is_alive()      # the good stream ran through every bad request
    t.join(T)
    assert not wrong, "cases without their specific error or final flag:\n" + "\n".join(
        f"  {c}: {e}, final={f}" for c, (e, f) in wrong.items())
    assert in_flight, (f"the good stream ({GOOD_TOKENS} tokens) ended before the last bad request: "
                       "the test did not test a stream in flight")
    text, errors, final = good["out"]
    assert not errors and final
    assert text == reference, "a bad request changed another request's output"
    # and the server goes on: the same request again, alone
    assert infer_raw(triton_server, GOOD_INPUTS)[0] == reference


def test_bad_requests_over_http_get_4xx_with_the_reason(triton_server):
    def post(path: str, body: bytes):
        req = urllib.request.Request(f"http://{triton_server.http_url}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=T) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    gen = "/v2/models/nightdraft/generate"
    # A body that is not JSON never reaches the model: Triton 2.51's core answers it (with 500).
    status, text = post(gen, b"{text_input: 1")
    assert status >= 400 and "failed to parse the request JSON buffer" in text
    cases = {
        "parameters with a bad value": (json.dumps({"text_input": "hi", "parameters": {"temperature": "x"}}).encode(),
                                        "temperature must be a number, got 'x'"),
        "sampling_parameters a list": (json.dumps({"text_input": "hi", "sampling_parameters": "[1]"}).encode(),
                                       "sampling_parameters must be a JSON object"),
        "seed 2**64": (json.dumps({"text_input": "hi", "sampling_parameters": json.dumps({"seed": 2**64})}).encode(),
                       "seed must be an integer in [0, 2**64 - 1]"),
    }
    for case, (body, words) in cases.items():
        status, text = post(gen, body)
        assert 400 <= status < 500 and words.lower() in text.lower(), f"{case}: {status} {text}"


def test_the_largest_seed_through_the_ensemble_is_served(triton_server):
    """The ensemble's UINT64 random_seed reaches the engine's seeding (and its drafter's)."""
    from client.triton_client import GrpcClient

    ens = GrpcClient(triton_server.grpc_url, "ensemble", schema="ensemble", timeout_s=T)
    direct = GrpcClient(triton_server.grpc_url, "nightdraft", timeout_s=T)
    for seed in (2**64 - 1, 2**63):
        a = ens.generate("def f(x):\n", max_tokens=12, temperature=1.0, seed=seed)
        b = ens.generate("def f(x):\n", max_tokens=12, temperature=1.0, seed=seed)
        assert a.text and a.text == b.text, "a seeded request is reproducible"
        c = direct.generate("def f(x):\n", max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        assert c.finish_reason == "length"


def test_sizes_are_checked_before_the_work_on_every_entry_point(triton_server):
    """An input too large for the context is refused before the work that grows with it: the
    ensemble's preprocessing (one instance for every client) before tokenizing, nightdraft before
    decoding the text, nightdraft_tokens before converting the ids; sampling_parameters before
    parsing. The limits are the ones docs/configuration.md states."""
    import re

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    huge = b"x = 1\n" * (2 << 20)     # 12 MiB: seconds of tokenizing, for a prompt that cannot fit
    limit_re = r"the prompt has (\d+) bytes; at most (\d+) are accepted \(max_prompt_bytes\)"
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(s(huge))
    with pytest.raises(InferenceServerException) as refused:
        client.infer("preprocessing", [t], client_timeout=T)
    m = re.search(limit_re, str(refused.value))
    assert m and int(m.group(1)) == len(huge), str(refused.value)
    preprocessing_limit = int(m.group(2))

    for model in ("ensemble", "nightdraft"):
        _, errors, final = infer_raw(triton_server, [("text_input", s(huge), "BYTES")], model=model)
        assert errors and final, model
        m = re.search(limit_re, errors[0])
        assert m and int(m.group(2)) == preprocessing_limit, errors[0]

    ids = (np.arange(2_000_000) % 50 + 10).astype(np.int32)
    _, errors, final = infer_raw(triton_server, [("input_ids", ids, "INT32")], model="nightdraft_tokens")
    assert errors and final and "input 'input_ids' has 2000000 ids; the context holds" in errors[0], errors

    params = json.dumps({"max_tokens": 4, "stop": ["x" * (2 << 20)]}).encode()
    _, errors, final = infer_raw(triton_server, [HI, ("sampling_parameters", s(params), "BYTES")])
    assert errors and final and f"sampling_parameters has {len(params)} bytes; at most 1048576" in errors[0]
