"""Mode auto with its arms forced: every kind of step a test claims to cover really runs.

Left to itself, the planner picks what is fastest on this machine, which may be plain decoding
all along; a test of auto would then compare plain decoding with itself. `force_arms` keeps the
whole auto path (the planner still decides and learns every step, the controller applies the
arm: cores, memory, strategy switches) but runs the scripted arm in its place, each held for
`hold` steps in turn. `StepModes` counts what each step actually ran (engine.stats().last_step).
"""
from __future__ import annotations

import itertools
from collections import Counter

from planner import Decision


def force_arms(engine, arms: list[tuple[str, int]], hold: int = 3) -> None:
    planner = engine.adaptive.planner
    real_decide = planner.decide
    script = itertools.cycle([Decision(mode, gamma) for mode, gamma in arms for _ in range(hold)])

    def scripted(signals):
        real_decide(signals)
        return next(script)
    planner.decide = scripted
    planner.steady = lambda signals: (0, 0.0)     # every step is scripted: none is held


class StepModes:
    """An `on_step` callback counting each step's mode ("ar", "sd", "psd", "ngram"); read it as a
    Counter (``modes["sd"]``). Not a Counter itself: an empty one is falsy, and callers test
    ``if on_step:``."""

    def __init__(self, engine):
        self.counts: Counter = Counter()
        self._engine = engine
        self._steps = engine.stats().steps

    def __call__(self, _outputs) -> None:
        st = self._engine.stats()
        if st.steps != self._steps:          # (a call without a step repeats the last one)
            self._steps = st.steps
            self.counts[st.last_step.mode] += 1

    def __getitem__(self, mode: str) -> int:
        return self.counts[mode]

    def __repr__(self) -> str:
        return f"steps by mode: {dict(self.counts)}"
