"""Whether the engine can still serve, for the model's readiness and ``nightdraft_engine_healthy``.

Unhealthy means one of:

- the engine loop gave up: its steps failed ``EngineLoop.MAX_CONSECUTIVE_FAILURES`` times in a
  row and it refuses every request (for good);
- the target's tensor-parallel group is down: a rank died or hung, and the group is restarting
  (``TensorParallelRunner.down_reason``); healthy again once it is back;
- the drafter could not be brought back: it has been down (state ``failed`` or ``restarting``)
  through ``drafter_down_s`` seconds during which the engine had requests to serve. Restarts
  are attempted only while the engine steps, so idle time does not count; a drafter that comes
  back makes the engine healthy again. ``drafter_down_s`` <= 0 never counts a drafter as
  unhealthy.

With the model parameter ``ENABLE_VLLM_HEALTH_CHECK`` (``model.GenerationModel``), an unhealthy
engine makes the model unload itself, as the vLLM backend's switch does, so its readiness
(``/v2/models/<model>/ready``) stops answering 200.
"""
from __future__ import annotations

import time
from typing import Any

DRAFTER_DOWN_STATES = ("failed", "restarting")
DEFAULT_DRAFTER_DOWN_S = 120.0


class EngineHealth:
    def __init__(self, loop: Any, engine: Any, drafter_down_s: float = DEFAULT_DRAFTER_DOWN_S,
                 clock=time.monotonic):
        self.loop, self.engine = loop, engine
        self.drafter_down_s = drafter_down_s
        self._clock = clock
        self._down_busy_s = 0.0          # the drafter's time down while there was work
        self._last: float | None = None

    def check(self) -> str | None:
        """None while the engine serves; else why it cannot."""
        if not self.loop.healthy:
            fatal = self.loop.fatal
            return f"the engine loop stopped after consecutive failing steps{f': {fatal}' if fatal else ''}"
        target_down = getattr(getattr(self.engine, "runner", None), "down_reason", None)
        if target_down:
            return target_down
        now = self._clock()
        last, self._last = self._last, now
        if self.drafter_down_s <= 0 or not self._drafter_down():
            self._down_busy_s = 0.0
            return None
        if last is not None and self.loop.num_inflight > 0:
            self._down_busy_s += now - last
        if self._down_busy_s >= self.drafter_down_s:
            return f"the drafter could not be restarted within {self.drafter_down_s:g} s of serving"
        return None

    def _drafter_down(self) -> bool:
        drafter = getattr(self.engine, "drafter", None)
        if drafter is None:
            return False
        try:
            return drafter.state in DRAFTER_DOWN_STATES
        except Exception:   # noqa: BLE001 - a state that cannot be read is not a verdict
            return False
