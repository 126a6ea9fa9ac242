#!/usr/bin/env bash
# The one install recipe: the Makefile (README set-up) and the container image both run it.
#   scripts/install.sh [VENV_DIR | --system] [EXTRAS]
# VENV_DIR defaults to .venv; EXTRAS to serve,test,bench.
# --system installs into the first python3 on PATH (or $PYTHON) instead of a virtual environment.
# docker/Dockerfile uses it: in an NGC Triton image the Python backend stub is built for the
# image's system Python, and a tritonserver is already on PATH (`nightdraft serve` prefers it).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
extras="${2:-serve,test,bench}"
if [[ "$venv" == "--system" ]]; then
    py="${PYTHON:-python3}"
    where="the system Python ($("$py" -c 'import sys; print(sys.prefix)'))"
else
    python3 -m venv "$venv"
    py="$venv/bin/python"
    where="$venv"
fi
"$py" -m pip install --quiet --upgrade pip
# torch is pinned in pyproject.toml (2.13.0); on our CPU machines pip takes the CPU build that
# lies on disk, on a GPU image the CUDA build from the registry.
"$py" -m pip install --quiet -e ".[${extras}]"
# The CPU paged-attention kernel, compiled for this machine (about 20 s); a server that finds no
# build makes one at start, and one that cannot says why and uses the reference attention.
"$py" -m backend.model.attention.kernels || echo "install: the paged attention kernel was not built (see above)"
echo "installed nightdraft into $where (extras: ${extras})"
# nightdraft is a Python-based Triton backend: put its model.py in the backend directory of the
# tritonserver `nightdraft serve` finds (an NGC image's /opt/tritonserver/backends; the
# nvidia-pytriton wheel's server gets a backend directory laid out in ~/.cache/nightdraft).
if ! "$py" -m client.cli install-backend; then
    echo "note: no tritonserver to install the backend into yet; run 'nightdraft install-backend' once there is one"
fi
