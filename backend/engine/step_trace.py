"""Every engine step as one line of JSON: what ran, on which cores and threads, and where its time
went. For the cases a profiler cannot follow, an engine inside a tritonserver's Python stub
above all, where the stub's process inherits what its server was started with.

    NIGHTDRAFT_STEP_TRACE=/tmp/trace nightdraft serve ...     # or any command that runs an engine

Each engine process appends to ``<folder>/steps-<pid>.jsonl`` (a server's instances are
processes of their own; the engines one process builds one after another, a benchmark's
configurations, are told apart by each line's ``engine``, numbered from 0), in batches of
``FLUSH_EVERY`` steps and when the engine closes; ``scripts/step_trace_summary.py`` sums such
files up. Off (no cost but one ``None`` check a step) unless the variable is set. A folder that
cannot be made fails the engine's start with the variable named; a write that fails later
(a full disk) ends the trace with a warning, never the step that wrote it.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import fields
from pathlib import Path

import torch

from backend.speculation.placement import CpuPlacement
from backend.step import StepResult

log = logging.getLogger("nightdraft.step_trace")

VARIABLE = "NIGHTDRAFT_STEP_TRACE"
# StepResult's fields that are not numbers, or are lists: written as their own keys below.
_SKIPPED = {"plan", "mode", "verified"}
_NUMBERS = [f.name for f in fields(StepResult) if f.name not in _SKIPPED]


def where(placement: CpuPlacement | None) -> str:
    """Where the target's thread ran: `none` (no drafter worker on CPU cores: where the process
    runs), `pinned` (the target's own cores), `open` (its own thread count on every core) or
    `lent` (the drafter's cores too, one more thread each)."""
    if placement is None:
        return "none"
    return "lent" if placement.lent else "open" if placement.open else "pinned"


class StepTrace:
    FLUSH_EVERY = 200
    _engines = 0           # engines traced in this process so far: each line names its engine

    def __init__(self, folder: Path):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{VARIABLE}={folder}: cannot make that folder for the step trace: {e}") from e
        self.pid = os.getpid()
        self.path = folder / f"steps-{self.pid}.jsonl"
        self.engine = StepTrace._engines
        StepTrace._engines += 1
        self._lines: list[str] = []
        self.failed = False        # a write failed: nothing more is traced
        log.info("tracing every step of engine %d to %s", self.engine, self.path)

    @classmethod
    def from_env(cls, env=os.environ) -> "StepTrace | None":
        folder = env.get(VARIABLE)
        return cls(Path(folder)) if folder else None

    def record(self, step: StepResult, placement: CpuPlacement | None) -> None:
        if self.failed:
            return
        line = {"t": time.time(), "pid": self.pid, "engine": self.engine, "mode": step.mode.value,
                "plan_mode": step.plan.mode.value}
        line.update((name, getattr(step, name)) for name in _NUMBERS)
        line.update(threads=torch.get_num_threads(), cores=sorted(os.sched_getaffinity(0)),   # at the step's end
                    placement=where(placement))
        self._lines.append(json.dumps(line))
        if len(self._lines) >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        try:
            with self.path.open("a") as f:
                f.write("\n".join(self._lines) + "\n")
        except OSError as e:
            log.warning("step trace %s: writing failed (%s); tracing no more steps", self.path, e)
            self.failed = True
        self._lines.clear()
