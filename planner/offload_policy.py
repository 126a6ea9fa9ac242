"""When the drafter's memory should become KV cache, and when it may come back (Nightjar).

Offloading the drafter (weights to host memory, its KV pool released, the target's KV pool grown
by the freed bytes) pays only while requests are short of KV blocks, and costs a reload, a
catch-up prefill and a shrink of the pool when speculation returns. So the policy acts on
*sustained* memory pressure only: the pressure level is an exponential average of the per-step
indicator "requests wait, or the pool is at least ``kv_pressure`` full" (or the GPU's memory at
``gpu_memory_pressure``), with a window of ``offload_after_steps`` steps; it is sustained once the
level has stayed above one half for ``offload_after_s`` seconds.

Under sustained pressure the planner asks for an offload when either

* its bandit has run plain decoding for ``offload_after_steps`` steps (speculation does not pay
  at this batch size, so its memory is better spent on KV), or
* plain decoding at the batch the grown pool would admit is predicted to beat the best
  speculative arm at the batch that fits now by ``offload_gain`` or more (with KV the
  bottleneck, a speculative arm can win per step yet lose to the bigger batch). The planner
  makes that prediction from what it measured (:meth:`Planner.offload_gain`);
  ``offload_gain <= 0`` offloads on sustained pressure alone.

Once offloaded, plain decoding is held while the load would not fit the drafter-on pool (a
reload then would shrink the pool under running requests and preempt them): the pressure level
must have fallen below ``clear_level`` and the used blocks below ``reload_kv_usage`` of that pool
(default: 0.8 x ``kv_pressure``, room for the running requests to grow), for ``reload_after_s``
seconds. Then the bandit may choose speculation again and the engine reloads. The thresholds
apart (a level of one half to offload, ``clear_level`` to come back; ``kv_pressure`` against
``reload_kv_usage``) are the hysteresis that keeps the drafter from bouncing.
"""
from __future__ import annotations

from .signals import LoadSignals


class OffloadPolicy:
    def __init__(self, *, offload_after_steps: int = 50, offload_after_s: float = 1.0,
                 kv_pressure: float = 0.9, gpu_memory_pressure: float = 0.95,
                 offload_gain: float = 1.05, reload_after_s: float = 1.0,
                 clear_level: float = 0.2, reload_kv_usage: float | None = None):
        if offload_after_steps < 1:
            raise ValueError("offload_after_steps must be >= 1")
        if not 0.0 < kv_pressure <= 1.0:
            raise ValueError("kv_pressure must be in (0, 1]")
        if not 0.0 <= clear_level < 0.5:
            raise ValueError("clear_level must be in [0, 0.5)")
        self.offload_after_steps = int(offload_after_steps)
        self.offload_after_s = float(offload_after_s)
        self.kv_pressure = float(kv_pressure)
        self.gpu_memory_pressure = float(gpu_memory_pressure)
        self.offload_gain = float(offload_gain)
        self.reload_after_s = float(reload_after_s)
        self.clear_level = float(clear_level)
        self.reload_kv_usage = 0.8 * self.kv_pressure if reload_kv_usage is None else float(reload_kv_usage)
        self.level = 0.0                       # EWMA of the pressure indicator
        self._alpha = 1.0 / self.offload_after_steps
        self._high_since: float | None = None  # when the level last rose above one half
        self._clear_since: float | None = None  # when the load last started to fit the base pool
        self.last_gain: float | None = None    # the last predicted gain of an offload

    def memory_pressure(self, s: LoadSignals) -> bool:
        """This step's indicator: requests wait, or the target's pool (or GPU) is nearly full."""
        if s.waiting > 0 or s.kv_usage >= self.kv_pressure:
            return True
        frac = s.gpu_memory_fraction
        return frac is not None and frac >= self.gpu_memory_pressure

    def update(self, s: LoadSignals, now: float) -> None:
        """Once per step, before deciding."""
        self.level += self._alpha * (float(self.memory_pressure(s)) - self.level)
        if self.level >= 0.5:
            if self._high_since is None:
                self._high_since = now
        else:
            self._high_since = None
        usage_at_base = s.kv_usage_at_base if s.kv_usage_at_base is not None else s.kv_usage
        if self.level < self.clear_level and usage_at_base < self.reload_kv_usage:
            if self._clear_since is None:
                self._clear_since = now
        else:
            self._clear_since = None

    def sustained(self, now: float) -> bool:
        return self._high_since is not None and now - self._high_since >= self.offload_after_s

    def gain_pays(self, gain: float | None) -> bool:
        """Is an offload worth it, given the planner's predicted gain (None: no prediction)?"""
        self.last_gain = gain
        if self.offload_gain <= 0:
            return True
        return gain is not None and gain >= self.offload_gain

    def may_reload(self, now: float) -> bool:
        """Would the load fit the drafter-on pool, and has it for ``reload_after_s``?"""
        return self._clear_since is not None and now - self._clear_since >= self.reload_after_s


class OffloadCheck:
    """Did a memory-aware offload pay? It was decided to beat a per-token latency: the best
    speculative arm's at the batch that fitted. After ``settle_steps`` steps (for the grown pool
    to fill), plain decoding's own per-token latency over the next ``verify_steps`` steps is the
    verdict: paid if it is lower. A prediction that missed is given back, not held through the
    whole overload."""

    def __init__(self, baseline_s_per_token: float, settle_steps: int, verify_steps: int):
        self.baseline = float(baseline_s_per_token)
        self.settle_steps = int(settle_steps)
        self.verify_steps = int(verify_steps)
        self.steps = 0
        self.counted = False           # the planner has tallied the verdict
        self._wall = 0.0
        self._tokens = 0

    def observe(self, wall_s: float, tokens: int) -> None:
        self.steps += 1
        if self.steps > self.settle_steps:
            self._wall += wall_s
            self._tokens += tokens

    @property
    def delivered_s_per_token(self) -> float | None:
        return self._wall / self._tokens if self._tokens else None

    @property
    def verdict(self) -> bool | None:
        """True (paid), False (did not), None (still measuring)."""
        if self.steps < self.settle_steps + self.verify_steps or not self._tokens:
            return None
        return self.delivered_s_per_token < self.baseline
