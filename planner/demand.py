"""How much work is arriving: requests and tokens per second, known within seconds.

The offload gate asks one question of it: would the queue grow without more capacity? That is
demand (tokens asked for per second) against what the running arm delivers (tokens per second
at the batch that fits). A 10 s sliding window answers a change of load 10 s late; here each
arrival counts ``exp(-age / tau_s) / tau_s`` (an exponentially weighted rate with a time constant
of ``tau_s``, 2 s by default), so a step in the arrival rate shows within about ``tau_s``, and a
burst of arrivals decays smoothly instead of falling off a window's edge. While the estimator is
younger than a few ``tau_s`` the sum is divided by ``1 - exp(-age / tau_s)``, which removes the
bias of a start from zero.

Tokens: a request asks for up to ``max_tokens``; with end-of-sequence tokens it often produces
fewer. The token demand is the weighted sum of ``max_tokens`` times the share of their budget that
finished requests actually used (an average over the last ~32 finishes; 1 until one finishes).
"""
from __future__ import annotations

import math
import threading


class DemandEstimate:
    MIN_AGE_S = 0.5

    def __init__(self, tau_s: float = 2.0, used_share_window: int = 32):
        if not tau_s > 0:
            raise ValueError("tau_s must be > 0")
        self.tau_s = float(tau_s)
        self._alpha_used = 1.0 / max(int(used_share_window), 1)
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._req = 0.0            # sum of exp(-age / tau) over arrivals, as of _t_last
        self._tok = 0.0            # the same, weighted by max_tokens
        self.used_share = 1.0      # generated / max_tokens of finished requests (EWMA)
        self._finished = 0
        self._lock = threading.Lock()

    def _decay_to(self, now: float) -> None:
        if self._t_last is not None and now > self._t_last:
            f = math.exp(-(now - self._t_last) / self.tau_s)
            self._req *= f
            self._tok *= f
        if self._t_last is None or now > self._t_last:
            self._t_last = now

    def arrived(self, now: float, max_tokens: int, n: int = 1) -> None:
        with self._lock:
            if self._t_first is None:
                self._t_first = now
            self._decay_to(now)
            self._req += n
            self._tok += n * max(int(max_tokens), 0)

    def finished(self, generated: int, max_tokens: int) -> None:
        """A request ended having generated `generated` of its `max_tokens` budget."""
        if max_tokens <= 0:
            return
        share = min(max(generated / max_tokens, 0.0), 1.0)
        with self._lock:
            self._finished += 1
            a = max(self._alpha_used, 1.0 / self._finished)     # a plain mean over the first few
            self.used_share += a * (share - self.used_share)

    def rates(self, now: float) -> tuple[float, float]:
        """(requests/s, tokens/s) arriving around `now`; (0, 0) before the first arrival."""
        with self._lock:
            if self._t_first is None:
                return 0.0, 0.0
            self._decay_to(now)
            # the first half second counts as half a second (one arrival is no rate of 1/epsilon)
            warm = 1.0 - math.exp(-max(now - self._t_first, self.MIN_AGE_S) / self.tau_s)
            scale = 1.0 / (self.tau_s * warm)
            return self._req * scale, self._tok * scale * self.used_share
