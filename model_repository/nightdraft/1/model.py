"""nightdraft: the decoupled text-generation model (vLLM-backend request schema).

A thin adapter: everything lives in the installed ``backend`` package (``backend.triton_model``).
"""
import os
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

try:
    import backend  # noqa: F401  (installed: pip install -e .)
except ImportError:  # a source checkout without the install: the package sits above the repository
    for _root in [os.environ.get("NIGHTDRAFT_ROOT", ""), *map(str, Path(__file__).resolve().parents)]:
        if _root and Path(_root, "backend", "__init__.py").is_file():
            sys.path.insert(0, _root)
            break

from backend.triton_model import make_triton_model  # noqa: E402

TritonPythonModel = make_triton_model(pb_utils, kind="text")
