"""The vLLM backend's own sample model repository, moved to nightdraft by changing one line.

Triton's vLLM backend ships ``samples/model_repository/vllm_model`` (triton-inference-server/
vllm_backend, main as of 2026-12): a config.pbtxt that says ``backend: "vllm"`` and declares
nothing else but an instance group (the backend's auto-complete fills in the rest), and a
``1/model.json`` of vLLM engine arguments. Here it is, with ``backend: "nightdraft"`` and the model
pointed at a local checkpoint (a random Llama whose tokenizer adds BOS), and nothing else changed,
through a real tritonserver: it loads, the request from the vLLM backend's README gets the prompt
followed by transformers' greedy continuation of it (BOS included in the prompt, as vLLM encodes
it), and a streamed gRPC request gets the same text.
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import start_ready
from model_factory import save_random_llama

pytestmark = pytest.mark.slow

# samples/model_repository/vllm_model/config.pbtxt, without its license header.
SAMPLE_CONFIG = '''# Note: You do not need to change any fields in this configuration.

backend: "vllm"

# The usage of device is deferred to the vLLM engine
instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
'''
# samples/model_repository/vllm_model/1/model.json
SAMPLE_MODEL_JSON = {"model": "facebook/opt-125m", "gpu_memory_utilization": 0.1, "enforce_eager": True}
# The request of the vLLM backend's README ("Sending Your First Inference").
PROMPT = "What is Triton Inference Server?"
README_REQUEST = {"text_input": PROMPT, "parameters": {"stream": False, "temperature": 0}}


@pytest.fixture(scope="module")
def sample_server(tmp_path_factory):
    from client.launcher import LauncherError, TritonServer, find_tritonserver, free_port
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")
    tmp = tmp_path_factory.mktemp("vllm-sample")
    checkpoint = save_random_llama(tmp / "checkpoint", hidden=64, layers=2, seed=5, adds_bos=True)
    model = tmp / "model_repository" / "vllm_model"
    (model / "1").mkdir(parents=True)
    config = SAMPLE_CONFIG.replace('backend: "vllm"', 'backend: "nightdraft"')
    assert [a for a, b in zip(SAMPLE_CONFIG.splitlines(), config.splitlines()) if a != b] == ['backend: "vllm"']
    (model / "config.pbtxt").write_text(config)
    (model / "1" / "model.json").write_text(json.dumps(SAMPLE_MODEL_JSON | {"model": str(checkpoint)}))
    server = TritonServer(model.parent, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=tmp / "tritonserver.log", exit_timeout_s=10)
    start_ready(server, 240)
    yield server, checkpoint
    server.stop(timeout_s=60)


def transformers_continuation(checkpoint, prompt: str, max_new_tokens: int = 16) -> str:
    """Greedy generate as vLLM's defaults ask (16 tokens, stop at EOS), decoded without specials."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id, "the checkpoint's tokenizer adds BOS"
    with torch.inference_mode():
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens)
    return tok.decode(y[0, len(ids):].tolist(), skip_special_tokens=True)


def test_the_readme_request_gets_the_prompt_and_its_greedy_continuation(sample_server):
    server, checkpoint = sample_server
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/vllm_model/generate",
                                 data=json.dumps(README_REQUEST).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    assert answer["model_name"] == "vllm_model"
    expected = transformers_continuation(checkpoint, PROMPT)
    assert expected and answer["text_output"] == PROMPT + expected


def test_auto_complete_made_it_the_vllm_backends_model(sample_server):
    server, _ = sample_server
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/vllm_model/config", timeout=30) as r:
        config = json.loads(r.read())
    assert config["backend"] == "nightdraft" and config["model_transaction_policy"] == {"decoupled": True}
    assert config["max_batch_size"] == 0
    inputs = {i["name"] for i in config["input"]}
    assert {"text_input", "stream", "sampling_parameters", "exclude_input_in_output", "return_finish_reason",
            "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
            "return_num_output_tokens"} <= inputs
    # The vLLM backend's outputs, and prompt_logprobs (vLLM's prompt_logprobs; that backend has none).
    assert {o["name"] for o in config["output"]} == {"text_output", "finish_reason", "cumulative_logprob",
                                                     "logprobs", "num_input_tokens", "num_output_tokens",
                                                     "prompt_logprobs"}


def test_a_streamed_grpc_request_gets_the_same_text(sample_server):
    from client.triton_client import GrpcClient, collect
    server, checkpoint = sample_server
    client = GrpcClient(server.grpc_url, model="vllm_model")
    from transformers import AutoTokenizer
    result = collect(client.stream(PROMPT, temperature=0.0))
    assert result.text == transformers_continuation(checkpoint, PROMPT)
    assert result.num_input_tokens == len(AutoTokenizer.from_pretrained(str(checkpoint)).encode(PROMPT))   # BOS counted
