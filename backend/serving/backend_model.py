"""nightdraft, a Triton Python-based backend: this file is ``<backend directory>/nightdraft/model.py``.

``nightdraft install-backend`` copies it there (``nightdraft serve`` lays out a backend directory
with it for the server it starts), and Triton's Python backend runs it for every model whose
config.pbtxt says ``backend: "nightdraft"``; model folders hold configuration only. The code is
the ``backend`` package of the checkout ``$NIGHTDRAFT_ROOT`` names, when it is set to one (``nightdraft
serve`` and the benchmarks set it to the tree they run from, so a server runs the same code as
the client that started it, even beside an installed copy), else the nightdraft distribution
installed in the Python environment of the backend stub (the first ``python3`` on the server's
``PATH``).
"""
import os
import sys

_root = os.environ.get("NIGHTDRAFT_ROOT", "")
if os.path.isfile(os.path.join(_root, "backend", "serving", "python_backend.py")):
    sys.path.insert(0, _root)     # ahead of an installed (or editable) copy
try:
    import backend.serving.python_backend  # noqa: F401
except ModuleNotFoundError as e:
    if e.name not in ("backend", "backend.serving", "backend.serving.python_backend"):
        raise                     # the package is there; something it needs is not
    raise ImportError(
        "nightdraft backend: the nightdraft package is not installed in the Python environment "
        f"of the backend stub ({sys.prefix}), and $NIGHTDRAFT_ROOT ({_root or 'unset'}) "
        "does not name a nightdraft checkout: pip install it there, or set NIGHTDRAFT_ROOT") from None

import triton_python_backend_utils as pb_utils  # noqa: E402  (the stub provides it)

from backend.serving.python_backend import backend_model  # noqa: E402

TritonPythonModel = backend_model(pb_utils)
