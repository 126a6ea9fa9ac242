"""postprocessing: the ensemble's detokenizer (output_ids window -> text_output delta).

A thin adapter: the code lives in the installed ``backend`` package (``backend.triton_ensemble``).
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

from backend.triton_ensemble import make_postprocessing_model  # noqa: E402

TritonPythonModel = make_postprocessing_model(pb_utils)
