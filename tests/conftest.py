"""Shared fixtures. ``triton_server``: a real tritonserver on free loopback ports.

The server runs the project's model repository, copied to a temporary directory whose
``nightdraft/1/engine.json`` points at the committed tiny pair with a small KV pool (one torch
thread per engine: the two engines, nightdraft and the ensemble's nightdraft_tokens, share the
2 CI cores with the test process). It starts once per session, on first use, and stops at the
end; its log is kept in the temporary directory and its tail is printed if it fails to start.

Environment knobs (for development): ``NIGHTDRAFT_TEST_TARGET`` / ``NIGHTDRAFT_TEST_DRAFTER``
use other checkpoints; ``NIGHTDRAFT_TEST_SERVER_LOG`` writes the server log there.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

# Engines compile their captured steps only in the tests that test them (tests/test_captured.py
# asks for it by name): tens of seconds per model otherwise, in every engine of the suite.
os.environ.setdefault("NIGHTDRAFT_COMPILE", "off")

REPO = Path(__file__).resolve().parent.parent
TINY_TARGET = Path(os.environ.get("NIGHTDRAFT_TEST_TARGET", REPO / "models" / "tiny-target"))
TINY_DRAFTER = Path(os.environ.get("NIGHTDRAFT_TEST_DRAFTER", REPO / "models" / "tiny-drafter"))

SERVER_READY_TIMEOUT_S = 240
# KV blocks per engine in the test server: enough for 16+ concurrent short requests.
TEST_KV_BLOCKS = 192
TEST_BLOCK_SIZE = 16


def _kv_bytes_per_block(ckpt: Path, block_size: int, dtype_bytes: int = 4) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * block_size


def test_engine_config() -> dict:
    """The engine configuration the test server uses (also for offline reference runs)."""
    return {
        "target": str(TINY_TARGET.resolve()),
        "drafter": str(TINY_DRAFTER.resolve()),
        "device": "cpu",
        "dtype": "auto",
        "mode": "sd",
        "gamma": 4,
        "block_size": TEST_BLOCK_SIZE,
        "kv_cache_bytes": TEST_KV_BLOCKS * _kv_bytes_per_block(TINY_TARGET, TEST_BLOCK_SIZE),
        "max_num_seqs": 32,
        "num_threads": 1,
    }


test_engine_config.__test__ = False  # a helper, not a test


@dataclass
class ServerInfo:
    server: object            # client.launcher.TritonServer
    repository: Path
    engine_config: dict
    log_file: Path

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def grpc_url(self) -> str:
        return self.server.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url


def start_ready(server, timeout_s: float) -> None:
    """Start a TritonServer and wait until it is ready; fail the test with the reason if not."""
    from client.launcher import LauncherError
    server.start()
    try:
        server.wait_ready(timeout_s)
    except LauncherError as e:
        server.stop(timeout_s=20)
        pytest.fail(f"tritonserver did not start: {e}", pytrace=False)


@pytest.fixture
def tritonserver_runnable() -> None:
    """Skips the test where no tritonserver can run (the pytriton wheel's layout is missing)."""
    from client.launcher import LauncherError, find_tritonserver
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")


@contextlib.contextmanager
def nightdraft_only_server(tmp: Path, engine_config: dict, ready_timeout_s: float = 240, *,
                           env: dict[str, str] | None = None, parameters: dict[str, str] | None = None):
    """A real tritonserver of its own serving only the ``nightdraft`` model (explicit model
    control), configured by `engine_config` (the repository laid out by the dynamic benchmark's
    ``write_repository``) and the model `parameters` of config.pbtxt, started in `env` (default:
    this process's); skips without a runnable tritonserver, fails with the reason if it does not
    start."""
    from client.dynamic_server import MODEL, set_model_parameter, write_repository
    from client.launcher import LauncherError, TritonServer, find_tritonserver, free_port
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")
    repo = write_repository(tmp, engine_config)
    pbtxt = repo / MODEL / "config.pbtxt"
    for key, value in (parameters or {}).items():
        pbtxt.write_text(set_model_parameter(pbtxt.read_text(), key, value))
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          host="127.0.0.1", log_file=tmp / "tritonserver.log", models=[MODEL],
                          exit_timeout_s=10, env=env)
    start_ready(server, ready_timeout_s)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    from client.launcher import LauncherError, TritonServer, find_tritonserver, free_port

    for ckpt in (TINY_TARGET, TINY_DRAFTER):
        if not (ckpt / "config.json").is_file():
            pytest.skip(f"no checkpoint at {ckpt} (make the tiny pair: make tiny-models)")
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")

    tmp = tmp_path_factory.mktemp("triton")
    repo = tmp / "model_repository"
    shutil.copytree(REPO / "model_repository", repo,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cfg = test_engine_config()
    (repo / "nightdraft" / "1" / "engine.json").write_text(json.dumps(cfg, indent=2))
    log_file = Path(os.environ.get("NIGHTDRAFT_TEST_SERVER_LOG", tmp / "tritonserver.log"))
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          host="127.0.0.1", log_file=log_file, exit_timeout_s=10)
    start_ready(server, SERVER_READY_TIMEOUT_S)
    info = ServerInfo(server=server, repository=repo, engine_config=cfg, log_file=log_file)
    yield info
    rc = server.stop(timeout_s=60)
    if rc not in (0, None):
        print(f"\ntritonserver exited with code {rc}; log: {log_file}\n{server.log_tail(40)}")


# ---- engine tests: prompts and the plain-decoding reference -----------------------------------
#
# A module that uses them says which prompts (PROMPT_CUTS = (n, first, stride, span): see
# helpers.engines.code_prompts) and which greedy parameters (GREEDY); modules that ask for the
# same get the same lists, decoded once per session.

_plain_outputs_cache: dict = {}


@pytest.fixture(scope="module")
def prompts(request):
    from helpers.engines import code_prompts
    cuts = getattr(request.module, "PROMPT_CUTS", None)
    if cuts is None:
        pytest.fail(f"{request.module.__name__} uses `prompts` without PROMPT_CUTS", pytrace=False)
    return code_prompts(*cuts)


@pytest.fixture(scope="module")
def ar_outputs(request, prompts):
    """Plain decoding's tokens for `prompts` with the module's GREEDY parameters."""
    from helpers.engines import plain_outputs
    params = request.module.GREEDY
    key = (tuple(prompts), params)
    if key not in _plain_outputs_cache:
        _plain_outputs_cache[key] = plain_outputs(prompts, params)
    return [list(o) for o in _plain_outputs_cache[key]]
