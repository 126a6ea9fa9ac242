"""Where tritonserver finds the nightdraft backend: ``<backend directory>/nightdraft/model.py``.

nightdraft is a Python-based backend: Triton runs ``backends/nightdraft/model.py`` (a copy of
``backend/serving/backend_model.py``) with its Python backend (``backends/python``) for every
model whose config.pbtxt says ``backend: "nightdraft"``. This module puts the file there:

- ``nightdraft install-backend [--backend-directory DIR]`` copies it into a server's backend
  directory (an NGC image's ``/opt/tritonserver/backends``; the Dockerfile runs it at build time);
- ``nightdraft serve`` uses the server's own directory when it holds the current copy, and
  otherwise a backend directory of its own in the cache: the server's backends (symlinked) plus
  ``nightdraft`` (:func:`overlay_backend_dir`), so it needs no write access to the server's
  installation. For the nvidia-pytriton wheel's server it lays out the Python backend there too
  (``client.launcher.layout_python_backend``).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import backend.serving

BACKEND_NAME = "nightdraft"
BACKEND_MODEL = Path(backend.serving.__file__).resolve().parent / "backend_model.py"
# An NGC image's tritonserver keeps its backends here (bin/tritonserver's ../backends).
NGC_BACKEND_DIR = Path("/opt/tritonserver/backends")


def backend_model_digest() -> str:
    return hashlib.sha256(BACKEND_MODEL.read_bytes()).hexdigest()[:12]


def is_installed(backends_dir: Path) -> bool:
    """``backends_dir/nightdraft/model.py`` is the current copy."""
    installed = Path(backends_dir) / BACKEND_NAME / "model.py"
    return installed.is_file() and installed.read_bytes() == BACKEND_MODEL.read_bytes()


def install_backend(backends_dir: Path) -> Path:
    """Copy the backend's model.py to ``backends_dir/nightdraft/model.py`` (atomically: a server
    starting meanwhile reads the old file or the new one); returns its path."""
    dest = Path(backends_dir) / BACKEND_NAME
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".model.py.", dir=dest)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(BACKEND_MODEL.read_bytes())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest / "model.py")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest / "model.py"


def overlay_backend_dir(server_backends: Path, cache_root: Path) -> Path:
    """A backend directory with every backend of ``server_backends`` (symlinked) and nightdraft:
    for a server whose own directory lacks the current nightdraft copy and may not be writable.
    Built once per source directory and backend version."""
    server_backends = Path(server_backends).resolve()
    key = hashlib.sha256(f"{server_backends}:{backend_model_digest()}".encode()).hexdigest()[:12]
    dest = Path(cache_root) / f"triton-backends-overlay-{key}"
    if is_installed(dest) and (dest / "python").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        for entry in server_backends.iterdir():
            if entry.name != BACKEND_NAME:
                (tmp / entry.name).symlink_to(entry)
        install_backend(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:   # another process built it first, or an outdated copy is in the way
            if not is_installed(dest):
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# --------------------------------------------------------------------------------------------
# nightdraft install-backend


def add_install_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "install-backend", help="copy the nightdraft backend into a Triton backend directory",
        description="Copy nightdraft's model.py to BACKEND_DIRECTORY/nightdraft/model.py, where "
                    "tritonserver looks for a Python-based backend named in config.pbtxt "
                    "(backend: \"nightdraft\"). Default: the backend directory of the tritonserver "
                    "`nightdraft serve` would start (an NGC image's /opt/tritonserver/backends; for "
                    "the nvidia-pytriton wheel's server, the directory laid out in the cache).")
    p.add_argument("--backend-directory", default=None,
                   help="the server's --backend-directory (default: see above)")
    p.add_argument("--tritonserver", default=None, help="the tritonserver binary whose backends to use")
    p.set_defaults(func=install_main)
    return p


def default_backend_dir(tritonserver: str | None = None) -> Path:
    """The backend directory of the server ``nightdraft serve`` would find: its own, or for the
    pytriton wheel's server the one laid out in the cache."""
    from client.launcher import find_tritonserver, server_backend_dir
    install = find_tritonserver(tritonserver)
    return install.backend_dir or server_backend_dir(install.binary)


def install_main(args: argparse.Namespace) -> int:
    from client.launcher import LauncherError
    try:
        target = Path(args.backend_directory) if args.backend_directory else default_backend_dir(args.tritonserver)
    except LauncherError as e:
        print(f"nightdraft install-backend: {e}", file=sys.stderr)
        return 2
    if not (target / "python").exists():
        print(f"nightdraft install-backend: warning: {target} has no Python backend (python/); "
              "a nightdraft model loads only where Triton's Python backend is", file=sys.stderr)
    try:
        path = install_backend(target)
    except OSError as e:
        print(f"nightdraft install-backend: cannot write {target / BACKEND_NAME}: {e}", file=sys.stderr)
        return 1
    print(f"installed {path}")
    return 0
