"""Where the drafter runs on a CPU host: cores of its own for the worker, the rest for the target.

The plan is made before the target's process pins itself (a worker started later inherits its
parent's affinity), and undone when the engine closes. What is pinned is the thread that runs
the target's forwards (the engine's steps), not the process: the constructing thread is pinned
while the engine builds (its warm-up and calibration forwards) and then given its cores back,
and each step pins the thread that runs it. A thread inherits its creator's affinity, so
pinning the constructing thread for good would also pin every thread a front end starts after
it (a server's request intake and response sending) to the target's core, where their work
queues behind the forward while the drafter's core idles.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

log = logging.getLogger("nightdraft.placement")


def parse_cores(spec: str) -> list[int]:
    """'1' -> [1]; '0,2' -> [0, 2]; '2-3' -> [2, 3]."""
    cores: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            cores += range(int(lo), int(hi) + 1)
        elif part:
            cores.append(int(part))
    return cores


def plan_cpu_placement(drafter_device: str) -> tuple[list[int], list[int]]:
    """(drafter cores, target cores) for a `cpu` or `cpu:CORES` drafter device."""
    available = sorted(os.sched_getaffinity(0))
    if drafter_device == "cpu":
        drafter = available[-1:]
    else:
        drafter = parse_cores(drafter_device.split(":", 1)[1])
        missing = set(drafter) - set(available)
        if missing:
            raise ValueError(f"drafter_device {drafter_device!r}: cores {sorted(missing)} are not "
                             f"available to this process (have {available})")
    target = [c for c in available if c not in drafter] or available
    if set(target) & set(drafter):
        log.warning("drafter_device %r: only cores %s are available to this process, so the "
                    "drafter worker shares the target's core (another engine in this process may "
                    "have pinned it); the two will not run in parallel", drafter_device, available)
    return drafter, target


class CpuPlacement:
    """The target process pinned to its share of the cores; `drafter_cores` for the worker."""

    def __init__(self, drafter_device: str, num_threads: int | None):
        self.drafter_cores, self.target_cores = plan_cpu_placement(drafter_device)
        self._saved = (os.sched_getaffinity(0), torch.get_num_threads())
        os.sched_setaffinity(0, self.target_cores)
        if not num_threads:
            torch.set_num_threads(len(self.target_cores))
        self.target_threads = num_threads or len(self.target_cores)   # the engine sets num_threads
        self.lent = False          # the drafter's cores serve the target now
        self.open = False          # the target's threads may run on the drafter's cores

    def lend_drafter_cores(self) -> None:
        """While nothing drafts (plain decoding for a while, or the drafter offloaded), the
        target's forward runs on the drafter's cores too, one more thread per core; the worker
        stays pinned to them, idle. Call from the thread that runs the forwards."""
        if self._saved is not None and set(self.drafter_cores) - set(self.target_cores):
            self.lent = True
            self.place()

    def take_back_drafter_cores(self) -> None:
        """Before the drafter drafts again: the target back on its own cores and threads."""
        if self._saved is not None:
            self.lent = self.open = False
            self.place()

    def open_drafter_cores(self) -> None:
        """Plain decoding that does not lend: the target keeps its threads, but they are not
        pinned, the drafter's idle cores open to them too. Beside a server's front end a thread
        pinned to one core waits whenever the front end runs there; an unpinned one can move to
        the core the front end leaves. With nothing else running it stays where it was."""
        if self._saved is not None and set(self.drafter_cores) - set(self.target_cores):
            self.lent, self.open = False, True
            self.place()

    @contextmanager
    def borrowing(self):
        """For one forward while the drafter idles (its worker waits for the next request) and
        its cores are not lent: the drafter's cores too, then the placement it had."""
        was_open = self.open
        self.lend_drafter_cores()
        try:
            yield
        finally:
            self.lent, self.open = False, was_open
            self.place()

    def place(self) -> None:
        """Before a step, from the thread that runs it: that thread on the target's cores (and
        the drafter's, while lent or open) with the target's threads (and one more per drafter
        core while lent)."""
        if self._saved is None:
            return
        if self.lent:
            self._apply(self.target_cores + self.drafter_cores, self.target_threads + len(self.drafter_cores))
        elif self.open:
            self._apply(self.target_cores + self.drafter_cores, self.target_threads)
        else:
            self._apply(self.target_cores, self.target_threads)

    def release_thread(self) -> None:
        """The constructing thread back on the cores it had, once the engine is built: the
        threads it starts later (a front end's) must not inherit the target's core. The
        thread count stays the target's (torch's is one per process)."""
        if self._saved is not None and os.sched_getaffinity(0) != self._saved[0]:
            os.sched_setaffinity(0, self._saved[0])

    def target_cores_now(self) -> int:
        """The cores the target's forward runs on now (its own, or with the drafter's lent)."""
        return len(self.target_cores) + (len(self.drafter_cores) if self.lent else 0)

    @staticmethod
    def _apply(cores: list[int], threads: int) -> None:
        # Compared with what is in force, not with what this object last set: a caller (a
        # benchmark placing its configurations) may have moved the thread meanwhile.
        if os.sched_getaffinity(0) != set(cores):
            os.sched_setaffinity(0, cores)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    @classmethod
    def for_config(cls, drafter_device: str | None, num_threads: int | None) -> "CpuPlacement | None":
        """A placement when the drafter is a worker on CPU cores; None otherwise."""
        if drafter_device is None or not drafter_device.startswith("cpu"):
            return None
        return cls(drafter_device, num_threads)

    def restore(self) -> None:
        """Give the process its cores and thread count back (the engine is closing)."""
        if self._saved is not None:
            os.sched_setaffinity(0, self._saved[0])
            torch.set_num_threads(self._saved[1])
            self._saved = None


def pin_worker(device: str, cores: list[int] | None) -> str:
    """In the worker process: pin it to its cores (CPU) and return the torch device to use."""
    if not device.startswith("cpu"):
        return device
    cores = cores or plan_cpu_placement(device)[0]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return "cpu"
