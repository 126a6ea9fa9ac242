"""The one bootstrap of this model repository: every ``<model>/1/model.py`` runs it.

The Python backend stub puts only a model's version directory on ``sys.path``, so this finds the
``backend`` package: installed (``pip install -e .``), else in ``$NIGHTDRAFT_ROOT`` (``nightdraft
serve`` sets it), else in a directory above this file (a source checkout). Then
``backend.serving.python_model`` builds the model's ``TritonPythonModel`` class.

model.py runs this file (``runpy.run_path``) rather than importing it: an import would leave a
``__pycache__`` folder at the top of the model repository, which Triton would take for a model.
"""
import os
import sys
from pathlib import Path


def find_backend() -> None:
    """Make ``import backend`` work, or say where it was looked for."""
    try:
        import backend  # noqa: F401  (installed)
        return
    except ImportError:
        pass
    roots = [os.environ.get("NIGHTDRAFT_ROOT", ""), *map(str, Path(__file__).resolve().parents)]
    for root in roots:
        if root and Path(root, "backend", "__init__.py").is_file():
            sys.path.insert(0, root)
            return
    raise ImportError("nightdraft: the backend package is not installed, and neither "
                      f"$NIGHTDRAFT_ROOT nor a directory above {__file__} holds it")


def triton_python_model(flavour: str) -> type:
    """The ``TritonPythonModel`` class for a model.py (flavour: text, tokens, preprocessing,
    postprocessing; see ``backend.serving``)."""
    find_backend()
    import triton_python_backend_utils as pb_utils

    from backend.serving import python_model
    return python_model(flavour, pb_utils)
