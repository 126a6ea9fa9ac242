"""nightdraft as a Triton Python-based backend: ``backend: "nightdraft"`` and model folders that
hold configuration only.

Unit tests: the backend's config auto-complete (what the vLLM backend's sample config.pbtxt
leaves out), the roles, refusing an input a role does not read, the backend's model.py finding
an uninstalled checkout, and laying the backend out (install-backend, the pytriton wheel's
layout, an overlay for a server whose backend directory lacks it). Through the real server
(slow): the bundled ``model_repository/nightdraft`` folder, copied alone into an empty
repository, loads and serves what the engine generates in process.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import start_ready

REPO = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO / "model_repository"


class FakeAutoCompleteConfig:
    """What Triton's Python backend hands ``auto_complete_config``."""

    def __init__(self, config: dict):
        self.config = json.loads(json.dumps(config))
        self.config.setdefault("input", [])
        self.config.setdefault("output", [])

    def as_dict(self):
        return self.config

    def add_input(self, spec):
        self.config["input"].append(spec)

    def add_output(self, spec):
        self.config["output"].append(spec)

    def set_model_transaction_policy(self, policy):
        self.config["model_transaction_policy"] = policy

    def set_max_batch_size(self, n):
        self.config["max_batch_size"] = n


def read_pbtxt(path: Path) -> dict:
    """config.pbtxt as the dict Triton's Python backend sees (dims as ints)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2
    message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    config = json_format.MessageToDict(message, preserving_proto_field_name=True)
    for io in config.get("input", []) + config.get("output", []):
        io["dims"] = [int(d) for d in io["dims"]]
        io.setdefault("optional", False)
    return config


def specs(ios: list[dict]) -> dict[str, tuple]:
    return {io["name"]: (io["data_type"], list(io["dims"]), bool(io.get("optional", False))) for io in ios}


def test_auto_complete_fills_in_what_the_vllm_sample_config_leaves_out():
    from backend.serving.python_backend import ROLES, auto_complete
    sample = {"backend": "nightdraft", "instance_group": [{"count": 1, "kind": "KIND_MODEL"}]}
    done = auto_complete(FakeAutoCompleteConfig(sample)).as_dict()
    assert specs(done["input"]) == specs(ROLES["text"]["inputs"])
    assert specs(done["output"]) == specs(ROLES["text"]["outputs"])
    assert done["model_transaction_policy"] == {"decoupled": True} and done["max_batch_size"] == 0
    # What config.pbtxt declares stays as declared.
    own = {"input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
           "parameters": {"role": {"string_value": "text"}}}
    assert [i["name"] for i in auto_complete(FakeAutoCompleteConfig(own)).as_dict()["input"]].count("text_input") == 1


@pytest.mark.parametrize("model", sorted(p.name for p in MODEL_REPOSITORY.iterdir()
                                         if (p / "config.pbtxt").is_file() and p.name != "ensemble"))
def test_shipped_configs_declare_what_auto_complete_would(model):
    """The shipped config.pbtxt files spell their inputs and outputs out for readers; they must
    be exactly the role's, or the two would drift."""
    from backend.serving.python_backend import ROLES, auto_complete, role_of
    config = read_pbtxt(MODEL_REPOSITORY / model / "config.pbtxt")
    assert config["backend"] == "nightdraft"
    role = role_of(config)
    assert specs(config["input"]) == specs(ROLES[role]["inputs"])
    assert specs(config["output"]) == specs(ROLES[role]["outputs"])
    done = auto_complete(FakeAutoCompleteConfig(config)).as_dict()
    assert len(done["input"]) == len(config["input"]) and len(done["output"]) == len(config["output"])
    assert not list((MODEL_REPOSITORY / model).rglob("*.py")), f"{model}: a model folder holds configuration only"


def test_roles_name_the_models_the_backend_builds():
    from backend.serving import ROLE_NAMES
    from backend.serving.python_backend import ROLES, role_of
    assert set(ROLES) == set(ROLE_NAMES)
    assert role_of({"parameters": {}}) == "text"
    assert role_of({"parameters": {"role": {"string_value": "tokens"}}}) == "tokens"
    with pytest.raises(ValueError, match="role.*one of.*'text'.*got 'txt'"):
        role_of({"name": "m", "parameters": {"role": {"string_value": "txt"}}})


def test_an_input_the_role_does_not_read_is_refused_at_load():
    """The vLLM backend reads an `image` input; nightdraft serves text, and would ignore it."""
    from backend.serving.python_backend import backend_model

    class Pb:
        class TritonModelException(Exception):
            pass
    model = backend_model(Pb)()
    config = {"name": "m", "input": [{"name": "text_input"}, {"name": "image"}], "parameters": {}}
    with pytest.raises(Pb.TritonModelException, match=r"declares input\(s\) \['image'\].*'text' role"):
        model.initialize({"model_config": json.dumps(config), "model_version": "1", "model_repository": "/x"})


def run_backend_model_py(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    """Import a laid-out backends/nightdraft/model.py as the stub would, without site-packages
    (``python -S``: the nightdraft package is not installed) and with a stand-in pb_utils."""
    from client.backend_dir import install_backend
    model_py = install_backend(tmp_path / "backends")
    stub = tmp_path / "stub"
    stub.mkdir(exist_ok=True)
    (stub / "triton_python_backend_utils.py").write_text("class TritonModelException(Exception):\n    pass\n")
    code = (f"import sys; sys.path[:0] = [{str(stub)!r}, {str(model_py.parent)!r}]; import model; "
            "cls = model.TritonPythonModel; print(callable(cls.auto_complete_config), sys.modules['backend'].__file__)")
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_backend_model_py_finds_an_uninstalled_checkout_in_nightdraft_root(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NIGHTDRAFT_ROOT"}
    out = run_backend_model_py(tmp_path, {**env, "NIGHTDRAFT_ROOT": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(REPO / "backend" / "__init__.py")]
    out = run_backend_model_py(tmp_path, env)
    assert out.returncode != 0 and "NIGHTDRAFT_ROOT (unset) does not name a nightdraft checkout" in out.stderr


def fake_ngc_server(root: Path) -> Path:
    """A server laid out as in an NGC image: bin/tritonserver and backends/{python,onnxruntime}."""
    binary = root / "opt" / "tritonserver" / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    for backend in ("python", "onnxruntime"):
        (root / "opt" / "tritonserver" / "backends" / backend).mkdir(parents=True)
    (root / "opt" / "tritonserver" / "backends" / "python" / "libtriton_python.so").write_text("")
    return binary


def test_a_server_without_the_backend_gets_an_overlay_and_one_with_it_its_own(tmp_path, monkeypatch):
    from client import launcher
    from client.backend_dir import BACKEND_MODEL, install_backend, is_installed
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    binary = fake_ngc_server(tmp_path)
    own = launcher.server_backend_dir(binary)
    placed = launcher.with_nightdraft_backend(launcher.find_tritonserver(binary))
    overlay = placed.backend_dir
    assert overlay is not None and overlay.is_relative_to(tmp_path / "cache")
    assert is_installed(overlay) and not is_installed(own)       # the server's files untouched
    assert (overlay / "python").resolve() == (own / "python").resolve()
    assert (overlay / "onnxruntime").is_symlink()
    assert f"--backend-directory={overlay}" in launcher.TritonServer(tmp_path, tritonserver=binary).command()
    # `nightdraft install-backend` into the server's own directory: no overlay any more.
    install_backend(own)
    assert (own / "nightdraft" / "model.py").read_bytes() == BACKEND_MODEL.read_bytes()
    assert launcher.with_nightdraft_backend(launcher.find_tritonserver(binary)).backend_dir is None


def test_install_backend_cli_writes_model_py(tmp_path):
    from client.cli import main
    assert main(["install-backend", "--backend-directory", str(tmp_path / "backends")]) == 0
    from client.backend_dir import is_installed
    assert is_installed(tmp_path / "backends")


def test_the_pytriton_layout_holds_the_backend():
    from client import launcher
    from client.backend_dir import is_installed
    try:
        install = launcher.find_tritonserver()
    except launcher.LauncherError as e:
        pytest.skip(str(e))
    if install.source != "pytriton":
        pytest.skip("tritonserver is not the nvidia-pytriton wheel's")
    assert is_installed(install.backend_dir) and (install.backend_dir / "python" / "libtriton_python.so").is_file()


@pytest.mark.slow
def test_the_nightdraft_folder_alone_serves_in_an_empty_repository(tmp_path):
    """The usual way to add a model to a Triton repository: copy its folder. The bundled folder,
    unchanged, in a repository of its own, serves the same greedy text as the engine in process."""
    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine
    from backend.sampling.params import SamplingParams
    from client.launcher import LauncherError, TritonServer, find_tritonserver, free_port
    from client.triton_client import HttpClient
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")
    repo = tmp_path / "repository"
    repo.mkdir()
    shutil.copytree(MODEL_REPOSITORY / "nightdraft", repo / "nightdraft")
    prompts = ["def fibonacci(n):", "import os\n"]
    engine = Engine(EngineConfig.from_file(repo / "nightdraft" / "1" / "engine.json"))
    try:
        expected = [c.text for c in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))]
    finally:
        engine.close()
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=tmp_path / "tritonserver.log", exit_timeout_s=10)
    start_ready(server, 240)
    try:
        client = HttpClient(server.http_url)
        got = [client.generate(p, max_tokens=12, temperature=0.0, exclude_input_in_output=True).text for p in prompts]
    finally:
        server.stop(timeout_s=60)
    assert got == expected and all(got)
