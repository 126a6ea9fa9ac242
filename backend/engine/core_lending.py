"""Whether plain decoding borrows the drafter's idle CPU cores: measured, not assumed.

With the drafter a worker on CPU cores of its own, those cores idle while plain decoding runs,
and the target's forward can run on them too (`CpuPlacement.lend_drafter_cores`). In process
that is faster: plain decoding on both cores of this host 1.2x-1.5x on one at concurrency
4-64. Through tritonserver it can be slower: the front end (the server's threads, the Python
backend's stub and its IPC) runs on the same cores, and a forward split over threads waits for
the one the front end preempts. Plain decoding on one core was the faster there at concurrency
4 and 16 (`bench levels`, benchmarks/results/levels.json). Which holds depends on the host, the
path and the load, so the engine measures both sides instead of assuming one. The side that
does not lend keeps the target's thread count, unpinned (`CpuPlacement.open_drafter_cores`): a
thread pinned to one core waits there whenever the front end runs on it.

Per batch-size bin (powers of two), each side's seconds per token over whole plain-decoding
steps: the step's cycle, which holds the gap before it in which the front end took the previous
step's outputs. Each side is tried for ``min_steps`` steps first (lent first, as an engine
without this choice runs); then the faster side runs, and the slower one is measured again for
``probe_steps`` steps every ``probe_every`` plain steps of the bin, from those steps alone, so a
change of load or host is followed within one probe. A probe that confirms the choice doubles
the bin's interval to the next, up to ``probe_every_max`` steps; when the choice turns (a probe
found the other side faster, or the running side's own steps grew slower) it starts again from
``probe_every``: where one side is the faster for good (lending on an idle host, 1.5x at
concurrency 16), the slower side's steps fall from 1.6 % of plain decoding's to 0.2 %, and a
change is followed within ``probe_every_max`` steps (seconds at most). The engine leaves out
the steps that are not plain decoding's alone to price: one that fed a prompt, one that follows
a drafting step (the turn-off's) and the first after the placement changed. A step on the side
that measures slower so far (:meth:`CoreLending.keeps`) is not plain decoding's cost as it
will run: the controller tells the planner (``StepOutcome.trying_cores``), which counts the
step as played but leaves it out of the arm's mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The values of `lend_drafter_cores` (EngineConfig), besides true (always) and false (never).
MEASURED = "measured"


@dataclass
class _Side:
    seconds: float = 0.0       # forgetting sums: seconds per token = seconds / tokens
    tokens: float = 0.0
    steps: int = 0

    def add(self, seconds: float, tokens: int, forget: float) -> None:
        self.seconds = forget * self.seconds + seconds
        self.tokens = forget * self.tokens + tokens
        self.steps += 1

    def forget_costs(self) -> None:
        self.seconds = self.tokens = 0.0

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens > 0 else float("inf")


@dataclass
class _Bin:
    sides: dict = field(default_factory=lambda: {True: _Side(), False: _Side()})
    probe_left: int = 0        # steps of the slower side still to measure in the current probe ...
    probe_side: bool = False   # ... and that side
    interval: int = 0          # measured steps from one probe's start to the next's
    since_probe: int = 0       # measured steps since the last probe started
    # kept as each step is added: read before and after every plain step
    fastest: bool = True       # faster(), as of the last step added
    known: bool = False        # each side has min_known steps ...
    tried: bool = False        # ... and min_steps

    def faster(self) -> bool:
        return self.sides[True].per_token <= self.sides[False].per_token


class CoreLending:
    def __init__(self, min_steps: int = 8, probe_every: int = 512, probe_steps: int = 8,
                 forget: float = 0.97, probe_every_max: int = 4096):
        self.min_steps = int(min_steps)
        self.min_known = min(2, self.min_steps)
        self.probe_every = int(probe_every)
        self.probe_every_max = max(int(probe_every_max), self.probe_every)
        self.probe_steps = int(probe_steps)
        self.forget = float(forget)
        self._bins: dict[int, _Bin] = {}

    @staticmethod
    def _bin_of(batch: int) -> int:
        return max(int(batch), 1).bit_length()

    def _bin(self, batch: int) -> _Bin:
        k = self._bin_of(batch)
        b = self._bins.get(k)
        if b is None:
            b = self._bins[k] = _Bin(interval=self.probe_every)
        return b

    def lend(self, batch: int) -> bool:
        """Should a plain-decoding step of `batch` sequences run on the drafter's cores too?"""
        b = self._bin(batch)
        if not b.tried:
            return b.sides[True].steps < self.min_steps
        return b.probe_side if b.probe_left > 0 else b.fastest

    def keeps(self, batch: int) -> bool:
        """The side plain decoding of `batch` sequences is expected to keep: the faster so far
        once each side has ``min_known`` steps (lent before). A step on the other side is a
        try or a probe, not plain decoding's cost as it will run. Decided from the first steps
        and not after all the tries, because where plain decoding is played rarely (between
        speculative blocks) the tries take long, and meanwhile the slower side's steps would
        make it look dearer than it will run."""
        b = self._bins.get(self._bin_of(batch))
        return b is None or not b.known or b.fastest

    def observe(self, lent: bool, batch: int, seconds: float, tokens: int) -> None:
        """One plain-decoding step that ran `lent` (or not) with `batch` sequences: its cycle's
        `seconds` and the `tokens` it committed."""
        if not (seconds > 0 and tokens > 0):
            return
        b = self._bin(batch)
        measuring, before = b.tried, b.fastest
        b.sides[lent].add(seconds, tokens, self.forget)
        choice = b.fastest = b.faster()
        if not measuring:
            steps = min(b.sides[True].steps, b.sides[False].steps)
            b.known, b.tried = steps >= self.min_known, steps >= self.min_steps
            return
        b.since_probe += 1
        if choice != before:            # turned, by a probe or by the running side's own steps
            b.interval = self.probe_every
            if b.probe_left == 0:       # the side left behind was measured just now
                b.since_probe = 0
        if b.probe_left > 0:
            b.probe_left -= lent == b.probe_side
            if b.probe_left == 0 and choice != b.probe_side:      # the probe confirmed it
                b.interval = min(2 * b.interval, self.probe_every_max)
        elif b.since_probe >= b.interval:
            b.since_probe = 0
            b.probe_left, b.probe_side = self.probe_steps, not choice
            b.sides[b.probe_side].forget_costs()     # the probe's own steps decide
            b.fastest = b.faster()

    def summary(self) -> dict:
        """Per bin (its smallest batch size): each side's seconds per token and steps, and the
        side chosen now."""
        out = {}
        for k, b in sorted(self._bins.items()):
            out[str(1 << (k - 1))] = {
                "lent_s_per_token": _finite(b.sides[True].per_token), "lent_steps": b.sides[True].steps,
                "own_s_per_token": _finite(b.sides[False].per_token), "own_steps": b.sides[False].steps,
                "lends": b.faster(), "probe_interval": b.interval}
        return out


def _finite(x: float) -> float | None:
    return x if x != float("inf") else None
