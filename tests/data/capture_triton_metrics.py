"""Capture real ``tritonserver`` ``/metrics`` text for the planner's signal tests.

Starts the server from the nvidia-pytriton wheel (through ``client.launcher``) on free loopback
ports with a throw-away model repository holding two trivial Python-backend models (``echo``
and ``echo_b``), sends a known number of inference requests, and scrapes ``/metrics`` twice,
a measured time apart. Writes:

    tests/data/triton_metrics.txt        first scrape (after FIRST requests)
    tests/data/triton_metrics_later.txt  second scrape (after FIRST + SECOND more)
    tests/data/triton_metrics.json       what was sent, and the seconds between the scrapes

Run from the repository root:  .venv/bin/python tests/data/capture_triton_metrics.py
The same helpers start the live server for the slow test in tests/test_signals.py.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL_PY = '''\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
'''

CONFIG = '''\
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''

MODELS = ("echo", "echo_b")


def make_repository(root: Path) -> Path:
    for name in MODELS:
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
        (root / name / "1" / "model.py").write_text(MODEL_PY)
    return root


def start_server(repo: Path):
    """A started, ready ``client.launcher.TritonServer`` on free loopback ports."""
    from client.launcher import TritonServer, free_port
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), host="127.0.0.1", exit_timeout_s=5)
    server.__enter__()
    return server


def infer(server, model: str, n: int) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32",
                                   "data": [1.0, 2.0, 3.0]}]}).encode()
    for _ in range(n):
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()


def scrape(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        return r.read().decode()


def main() -> int:
    first, second = {"echo": 5, "echo_b": 2}, {"echo": 12, "echo_b": 3}
    with tempfile.TemporaryDirectory(prefix="nd-metrics-repo-") as d:
        server = start_server(make_repository(Path(d)))
        try:
            for m, n in first.items():
                infer(server, m, n)
            t0 = time.monotonic()
            text0 = scrape(server)
            time.sleep(1.0)
            for m, n in second.items():
                infer(server, m, n)
            t1 = time.monotonic()
            text1 = scrape(server)
        finally:
            server.stop(timeout_s=20)
    (HERE / "triton_metrics.txt").write_text(text0)
    (HERE / "triton_metrics_later.txt").write_text(text1)
    (HERE / "triton_metrics.json").write_text(json.dumps(
        {"server": "tritonserver 2.51 (nvidia-pytriton 0.7.0 wheel), CPU-only host, "
                   "--allow-gpu-metrics=false",
         "requests_before_first_scrape": first, "requests_between_scrapes": second,
         "seconds_between_scrapes": round(t1 - t0, 4)}, indent=2) + "\n")
    print(f"wrote {HERE}/triton_metrics*.txt ({len(text0)} and {len(text1)} chars), "
          f"{t1 - t0:.3f} s apart")
    return 0


if __name__ == "__main__":
    sys.exit(main())
