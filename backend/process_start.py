"""How the engine starts its helper processes (the drafter worker, tensor-parallel ranks).

From a fork server: a process started once, at the first helper's start, that imports torch and
the model code and then forks each helper on request. A fresh interpreter (multiprocessing's
"spawn") spends seconds importing torch before a helper can load its weights; a fork of the
server starts at once, so a drafter (or rank) that crashed is replaced that much sooner
(``scripts/time_worker_start.py`` times both; the first helper's start, which starts the server,
is not faster). The server is a single-threaded process that has only imported modules, so
forking it copies no thread, lock or device context of the engine's: as safe as spawning.

What a helper inherits comes from the server as it was when it started, not from the engine
now: the environment and the CPU affinity. Helpers therefore get their cores and settings in
their spec (``WorkerSpec``, ``RankSpec``), never by inheritance.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from multiprocessing.context import BaseContext

# Imported once in the fork server: what every helper would otherwise import itself.
PRELOAD = ["torch", "backend.speculation.drafter", "backend.model.parallel.group"]

# What every helper's process name starts with (ps, top, /proc/PID/comm).
HELPER_PREFIX = "nd-"

_PR_SET_NAME = 15


def helper_context() -> BaseContext:
    """The multiprocessing context that starts helpers (the fork server's)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)     # read when the server starts; later calls are no-ops
    return ctx


def helper_name(role: str) -> str:
    """The process name of the helper that plays `role` ("drafter", "tp-rank1", ...)."""
    return HELPER_PREFIX + role


def name_this_process(name: str) -> None:
    """The name ps, top and /proc/PID/comm show for this process (Linux keeps 15 bytes): a
    helper forked from the fork server would otherwise carry the server's command line."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):    # not Linux: the name is cosmetic
        pass
