"""nightdraft, a Triton Python-based backend: this file is ``<backend directory>/nightdraft/model.py``.

``nightdraft install-backend`` copies it there (``nightdraft serve`` lays out a backend directory
with it for the server it starts), and Triton's Python backend runs it for every model whose
config.pbtxt says ``backend: "nightdraft"``; model folders hold configuration only. The code is
the ``backend`` package of the nightdraft distribution, installed in the Python environment the
backend stub runs (the first ``python3`` on the server's ``PATH``), or, for a source checkout that
is not installed, the directory ``$NIGHTDRAFT_ROOT`` names.
"""
import os
import sys

try:
    import backend.serving.python_backend  # noqa: F401
except ImportError:
    _root = os.environ.get("NIGHTDRAFT_ROOT", "")
    if not os.path.isfile(os.path.join(_root, "backend", "serving", "python_backend.py")):
        raise ImportError(
            "nightdraft backend: the nightdraft package is not installed in the Python environment "
            f"of the backend stub ({sys.prefix}), and $NIGHTDRAFT_ROOT ({_root or 'unset'}) "
            "does not name a nightdraft checkout: pip install it there, or set NIGHTDRAFT_ROOT") from None
    sys.path.insert(0, _root)

import triton_python_backend_utils as pb_utils  # noqa: E402  (the stub provides it)

from backend.serving.python_backend import backend_model  # noqa: E402

TritonPythonModel = backend_model(pb_utils)
