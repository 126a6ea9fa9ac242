"""vLLM's sampling keys through a real tritonserver, over gRPC streaming and HTTP streaming: the
text is what the offline engine gives with the same keys (the server speculates: mode sd), a
constrained output parses, and a bad value is an error response that names it."""
from __future__ import annotations

import json
import re

import pytest

from client.triton_client import ClientError, GrpcClient, HttpClient, collect

pytestmark = pytest.mark.slow

T = 60.0
PROMPT = "class Stack:\n    def push(self, x):\n"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}}}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"

KEYS = {
    "penalties": {"presence_penalty": 1.0, "frequency_penalty": "0.5", "repetition_penalty": 1.3,
                  "logit_bias": {"30": 3.0}, "bad_words": ["self"], "min_p": 0.05},
    "allowed ids": {"allowed_token_ids": list(range(100, 400))},
    "json": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    "regex": {"structured_outputs": {"regex": REGEX}},
    "truncated prompt": {"truncate_prompt_tokens": 5},
}


def sampling(keys: dict) -> dict:
    return {"max_tokens": 40, "temperature": 0, **keys}


@pytest.fixture(scope="module")
def reference(triton_server):
    """The offline engine's text for each case, configured as the server's."""
    import torch

    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine
    from backend.sampling.params import SamplingParams

    threads = torch.get_num_threads()
    engine = Engine(EngineConfig.from_dict(dict(triton_server.engine_config)))
    try:
        return {case: engine.generate([PROMPT], SamplingParams.from_dict(sampling(keys)))[0].text
                for case, keys in KEYS.items()}
    finally:
        engine.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("case", list(KEYS))
def test_sampling_keys_through_the_server(case, transport, triton_server, reference):
    client = (GrpcClient(triton_server.grpc_url, timeout_s=T) if transport == "grpc"
              else HttpClient(triton_server.http_url, timeout_s=T))
    res = collect(client.stream(PROMPT, sampling=sampling(KEYS[case])))
    assert res.text == reference[case]
    if case == "json":
        assert json.loads(res.text)["color"] in ("red", "green", "blue")
    if case == "regex":
        assert re.fullmatch(REGEX, res.text)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_bad_value_is_an_error_that_names_it(transport, triton_server):
    client = (GrpcClient(triton_server.grpc_url, timeout_s=T) if transport == "grpc"
              else HttpClient(triton_server.http_url, timeout_s=T))
    with pytest.raises(ClientError, match=r"presence_penalty must be in \[-2, 2\]"):
        collect(client.stream(PROMPT, sampling={"presence_penalty": 3}))
    with pytest.raises(ClientError, match="could not be compiled"):
        collect(client.stream(PROMPT, sampling={"structured_outputs": {"regex": "([a-z"}}))


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_come_with_the_first_response(stream, triton_server):
    import numpy as np

    from test_vllm_compat import PROMPT as COMPAT_PROMPT, make_inputs, stream_infer
    flags = {"return_prompt_logprobs": True, "return_num_input_tokens": True}
    got = stream_infer(triton_server.grpc_url,
                       make_inputs(stream, {"max_tokens": 4, "temperature": 0, "prompt_logprobs": 1}, flags))
    assert all(e is None for _, e in got)
    sent = [r for r, _ in got if r.as_numpy("prompt_logprobs") is not None]
    values = [json.loads(r.as_numpy("prompt_logprobs")[0]) for r in sent]
    first = values[0]
    assert all(v is None for v in values[1:]), "prompt logprobs are sent once"
    n = int(np.asarray(sent[0].as_numpy("num_input_tokens")).ravel()[0])
    assert len(first) == n and first[0] is None and COMPAT_PROMPT
    for entry in first[1:]:
        assert 1 <= len(entry) <= 2          # the prompt token, and the most likely one
        for v in entry.values():
            assert v["logprob"] <= 0 and v["rank"] >= 1 and isinstance(v["decoded_token"], str)
