"""The planner's decisions over time, bounded: an entry at every change of decision and every
``every`` steps; past ``max_len`` entries every other one is dropped and the stride doubles, so
the whole run stays covered at half the resolution."""
from __future__ import annotations


class Timeline:
    def __init__(self, max_len: int = 4096, every: int = 25):
        self.max_len = max_len
        self.every = every
        self._entries: list[tuple] = []
        self._stride = 1
        self._last_step = -10 ** 9
        self._t0: float | None = None

    def note(self, now: float, step: int, mode: str, gamma: int, batch: int, changed: bool) -> None:
        """One decision; recorded if it changed or the stride has passed since the last entry."""
        if self._t0 is None:
            self._t0 = now
        if not changed and step - self._last_step < self.every * self._stride:
            return
        self._entries.append((round(now - self._t0, 6), step, mode, gamma, int(batch)))
        self._last_step = step
        if len(self._entries) > self.max_len:
            self._entries = self._entries[::2]
            self._stride *= 2

    def entries(self) -> list[tuple]:
        """[(t_s since the first decision, step, mode, gamma, batch_size)]"""
        return list(self._entries)
