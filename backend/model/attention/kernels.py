"""The C++ kernels of the CPU path, built once per machine and loaded as torch ops.

``csrc/paged_attention.cpp`` registers ``torch.ops.nightdraft.paged_attention``. The install
(``scripts/install.sh``) builds it, so that a server starts with it at hand; a process that finds
no build builds it then (about 20 s with two cores), and one that cannot build it (no compiler)
says why and runs on the reference attention instead.

Builds live under ``$XDG_CACHE_HOME/nightdraft/ext/<key>``, keyed by the source, torch and the
CPU (they are compiled for the machine's own instruction set): a copied cache from another
machine is never loaded.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("nightdraft.kernels")

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}     # "ok": bool, "error": str


def _cpu_name() -> str:
    """The CPU's model and instruction-set flags (the build uses -march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "\n".join(next((l for l in lines if l.startswith(k)), "") for k in ("model name", "flags"))


def build_dir() -> Path:
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, sys.version,
                                    _cpu_name()]).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nightdraft" / "ext"
    return base / key


def load(build: bool = True) -> bool:
    """Load the kernels (building them first if needed and `build`); True when
    ``torch.ops.nightdraft.paged_attention`` is there. Never raises: why it failed is in
    :func:`error`."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        try:
            _state["ok"] = _load(build) and _register_fake()
        except Exception as e:  # noqa: BLE001 - a missing compiler must not stop the server
            _state["ok"] = False
            _state["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
            log.warning("the paged attention kernel is unavailable (%s); using the reference "
                        "attention (sdpa)", _state["error"].splitlines()[0])
        return bool(_state["ok"])


def error() -> str | None:
    return _state.get("error")


def _load(build: bool) -> bool:
    if hasattr(torch.ops, "nightdraft") and hasattr(torch.ops.nightdraft, "paged_attention"):
        return True
    where = build_dir()
    library = where / "nightdraft_kernels.so"
    if not library.is_file():
        if not build:
            _state["error"] = f"not built ({library} is missing)"
            return False
        from torch.utils import cpp_extension
        where.mkdir(parents=True, exist_ok=True)
        log.info("building the paged attention kernel for this machine (once; about 20 s) in %s", where)
        t0 = time.perf_counter()
        cpp_extension.load(name="nightdraft_kernels", sources=[str(SOURCE)], build_directory=str(where),
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
        log.info("built the paged attention kernel in %.1f s", time.perf_counter() - t0)
        return True
    torch.ops.load_library(str(library))
    return True


def _register_fake() -> bool:
    """What a compiler needs to trace through the op: its output's shape and dtype."""
    @torch.library.register_fake("nightdraft::paged_attention")
    def _(q, k, v, kv_cache, layer, slot_mapping, block_tables, query_start_loc, seq_lens, scale):
        return q.new_empty(q.shape)
    return True


if __name__ == "__main__":      # scripts/install.sh: build now, say what happened
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = load()
    print(f"paged attention kernel: {'ready in ' + str(build_dir()) if ok else 'unavailable: ' + str(error())}")
