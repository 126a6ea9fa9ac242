"""nightdraft_tokens: the decoupled token-level generation model inside the ensemble; the code is in backend.serving."""
import runpy
from pathlib import Path

_bootstrap = runpy.run_path(str(Path(__file__).absolute().parents[2] / "bootstrap.py"))
TritonPythonModel = _bootstrap["triton_python_model"]("tokens")
