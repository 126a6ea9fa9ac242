"""A server's processes, read from /proc: its descendants and its drafter workers."""
from __future__ import annotations

from pathlib import Path


def parent(pid: int) -> int | None:
    """pid's parent process (None: pid is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below pid (the Python backend stub, the fork server, the drafter worker)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (ppid := parent(int(d.name))) is not None:
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def drafter_workers(pid: int) -> list[int]:
    """The drafter worker processes below pid (by the name the worker gives itself)."""
    from backend.speculation.worker import WORKER_NAME
    found = []
    for p in sorted(descendants(pid)):
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() == WORKER_NAME:
                found.append(p)
        except OSError:     # gone meanwhile
            continue
    return found


def is_fork_server(pid: int) -> bool:
    """Is pid the fork server the engine's helpers are started from (backend.process_start)?"""
    from backend.process_start import HELPER_PREFIX
    try:
        return b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes() \
            and not Path(f"/proc/{pid}/comm").read_text().startswith(HELPER_PREFIX)
    except OSError:
        return False
