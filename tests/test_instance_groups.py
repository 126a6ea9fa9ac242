"""Instance groups: the engine goes where Triton puts each instance (backend/serving/instance.py).

KIND_GPU cannot load without a GPU, so the GPU rules run against a stated device count (these
machines have none; scripts/gpu_check.sh runs on a GPU host). Through the real server (slow):
a KIND_CPU group of two instances loads two engines that serve, and a layout that cannot work
(KIND_CPU with an engine.json on a GPU) is refused at load with the reason, the other model
serving on.
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from backend.errors import ConfigError
from backend.serving.instance import place
from conftest import start_ready, test_engine_config
from model_factory import TINY_DRAFTER, TINY_TARGET
from helpers.model_args import Pb, model_args, write


def placed(kind, device_id=0, device=None, drafter=None, vllm=None, model_json_only=False, gpus=4):
    return place(kind, device_id, engine_device=device, engine_drafter_device=drafter, vllm_device=vllm,
                 model_json_only=model_json_only, cuda_count=gpus)


def test_kind_gpu_puts_the_target_on_the_instances_gpu_and_the_drafter_relative_to_it():
    p = placed("GPU", 2, drafter="cuda:+1")
    assert (p.device, p.drafter_device) == ("cuda:2", "cuda:3")
    assert placed("GPU", 1, device="cuda", drafter="cuda:0").drafter_device == "cuda:0"   # named
    assert placed("GPU", 1, device="cuda:1").device == "cuda:1"
    assert placed("GPU", 0, drafter="cpu:1").drafter_device == "cpu:1"
    assert placed("GPU", 3).drafter_device is None                                       # in process


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="GPU", device_id=3, drafter="cuda:+1"), r"cuda:\+1.*cuda:4 for the target on cuda:3, but 4 CUDA"),
    (dict(kind="GPU", device_id=1, device="cuda:0"), r"GPU 1 \(KIND_GPU\).*says device 'cuda:0'"),
    (dict(kind="GPU", device_id=0, device="cpu"), r"KIND_GPU.*says device 'cpu'"),
    (dict(kind="GPU", device_id=0, gpus=0), r"KIND_GPU, but no CUDA device"),
    (dict(kind="CPU", device="cuda:0"), r"KIND_CPU, but the engine configuration says device 'cuda:0'"),
    (dict(kind="CPU", drafter="cuda:+1"), r"relative to the target's GPU, but the target is on cpu"),
    (dict(kind="MODEL", device="cuda:5"), r"cuda:5 is not there: 4 CUDA"),
    (dict(kind="MODEL", device="cuda:0", drafter="cuda:7"), r"'cuda:7' is cuda:7.*4 CUDA"),
])
def test_impossible_layouts_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        placed(**kwargs)


def test_kind_model_lets_the_configuration_place_the_engine():
    assert placed("MODEL", device="cuda:1").device == "cuda:1"
    assert placed("MODEL", vllm="cpu", model_json_only=True).device == "cpu"
    assert placed("MODEL", model_json_only=True).device == "cuda:0"            # vLLM's device auto
    assert placed("MODEL", model_json_only=True, gpus=0).device == "cpu"
    assert placed("MODEL").device == "cpu"                                     # engine.json's default
    assert placed("CPU").device == "cpu"


def test_each_instance_of_a_gpu_group_loads_its_own_devices(tmp_path):
    """One engine.json for a KIND_GPU group on GPUs 0 and 2 (gpus: [0, 2]), drafter beside each."""
    from backend.serving.config import load_engine_config
    d = write(tmp_path / "m", engine={"target": str(TINY_TARGET), "drafter": str(TINY_DRAFTER),
                                      "drafter_device": "cuda:+1", "mode": "psd"})
    configs = [load_engine_config(model_args(d, "GPU", gpu), "engine.json", cuda_count=4).config for gpu in (0, 2)]
    assert [(c.device, c.drafter_device) for c in configs] == [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]
    assert all(c.dtype == "bfloat16" for c in configs)
    with pytest.raises(Pb.TritonModelException, match=r"engine.json: drafter_device 'cuda:\+1' is cuda:4"):
        load_engine_config(model_args(d, "GPU", 3), "engine.json", cuda_count=4)


# ---- through the real server


def ready(server, model: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_a_cpu_group_of_two_serves_and_an_impossible_layout_is_refused_at_load(tmp_path):
    from client.launcher import LauncherError, TritonServer, find_tritonserver, free_port
    from client.triton_client import HttpClient
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")
    repo = tmp_path / "repository"
    engine = test_engine_config() | {"mode": "ar", "drafter": None}
    for name, kind, cfg in (("two", "KIND_CPU\n  count: 2", engine),
                            ("misplaced", "KIND_CPU", engine | {"device": "cuda:0"})):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "engine.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
        (repo / name / "config.pbtxt").write_text(
            f'backend: "nightdraft"\ninstance_group [ {{\n  kind: {kind}\n}} ]\n')
    log = tmp_path / "tritonserver.log"
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=log, exit_timeout_s=10,
                          extra_args=["--exit-on-error=false", "--strict-readiness=false"])
    start_ready(server, 240)
    try:
        assert ready(server, "two") == 200 and ready(server, "misplaced") != 200
        client = HttpClient(server.http_url, model="two")
        texts = [client.generate("def f(x):", max_tokens=8, temperature=0.0).text for _ in range(4)]
        assert len(set(texts)) == 1 and texts[0]
    finally:
        server.stop(timeout_s=60)
    text = log.read_text()
    assert len(re.findall(r"two: placement: KIND_CPU instance", text)) == 2, "two instances, two engines"
    assert "the instance group is KIND_CPU, but the engine configuration says device 'cuda:0'" in text
