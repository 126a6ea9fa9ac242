"""What turning the drafter back on costs, measured.

When the drafter comes back after a gamma = 0 period the engine reports the catch-up prefill
time (``drafter_rebuild_s``) and, if its weights had been offloaded, the reload time
(``drafter_reload_s``). :class:`SwitchCost` keeps running averages (weight ``cost_ewma``) of the
rebuild time per token the drafter missed and of the reload time, and prices a turn-on now as
``rebuild_per_token * lag + reload_weight * reload (if offloaded)`` seconds. The lag is
``LoadSignals.drafter_lag_tokens`` when the engine reports it, else the tokens committed while
the drafter was off, at most ``batch x lag_cap_steps`` (sequences that finished meanwhile need
no catch-up; a sequence rarely runs longer than the cap). Before the first measurement the
rebuild estimate is the configured ``rebuild_s_per_token``, else the cost profile's drafter
time per token at its largest measured batch (an upper bound of a prefill's per-token cost),
else zero. The planner charges it, in loss units, to any ar -> sd/psd switch.

Turning the drafter off costs too: the first plain step after a drafting one runs slower than
the plain steps after it (the drafter's cores change hands, a pipelined draft is let go; on the
2-core CPU host at batch 8, about +9 ms after PSD on a 6 ms step: ``scripts/turn_off_cost.py``).
``SwitchCost.turn_off`` (a :class:`FirstStepExtra`) measures that extra against the other plain
steps (an EWMA of their time per token, at the same weight) and the planner charges it to any
sd/psd -> ar switch instead of to plain decoding's mean: a plain-decoding arm measured in short
blocks between speculative ones would otherwise carry every turn-off in its own cost.

Batch-parallel SD has a switch of its own: its first step after another mode has no drafts in
hand for the sub-batch it verifies, so it drafts them in line, not overlapped (the pipeline's
fill; through the server at concurrency 4 about +4 ms on a 6 ms step). ``SwitchCost.psd_fill``
measures that extra against the other PSD steps the same way, and the planner charges it to any
switch into PSD from another mode instead of to PSD's mean: PSD tried in short blocks between
sequential SD's would otherwise carry a fill in every block and rank below SD where its steady
steps are cheaper.
"""
from __future__ import annotations

from planner.config import PlannerConfig
from planner.cost_model import CostProfile
from planner.step_costs import ewma


def initial_rebuild_per_token(cfg: PlannerConfig, profile: CostProfile | None) -> float | None:
    if cfg.rebuild_s_per_token is not None or profile is None or not profile.draft:
        return cfg.rebuild_s_per_token
    bmax = max(profile.draft)
    return profile.t_propose(bmax, 1) / bmax


class FirstStepExtra:
    """What the first step of a run of steps costs beyond the run's other steps: an EWMA of the
    others' time per token, and one of the first steps' time over it (unclipped: noise averages
    out; the planner charges only a positive mean)."""

    def __init__(self, weight: float):
        self.extra_s: float | None = None
        self.samples = 0
        self._weight = weight
        self._s_per_token: float | None = None

    def observe(self, wall_s: float, tokens: int, *, first: bool) -> None:
        tokens = max(int(tokens), 1)
        if not first:
            self._s_per_token = ewma(self._s_per_token, wall_s / tokens, self._weight)
        elif self._s_per_token is not None:
            self.extra_s = ewma(self.extra_s, wall_s - tokens * self._s_per_token, self._weight)
            self.samples += 1

    @property
    def charge_s(self) -> float:
        return max(self.extra_s or 0.0, 0.0)


class SwitchCost:
    def __init__(self, cfg: PlannerConfig, profile: CostProfile | None = None):
        self.rebuild_s_per_token: float | None = initial_rebuild_per_token(cfg, profile)
        self.reload_s: float | None = cfg.reload_s
        self.rebuild_samples = 0
        self.reload_samples = 0
        self.engine_lag: int | None = None     # the engine's own count, once it reports one
        self._cfg = cfg
        self._lag_tokens = 0                   # tokens committed while the drafter was off
        self._off_steps = 0                    # ar steps since the drafter last drafted
        self._lag_at_turn_on: int | None = None
        self.turn_off = FirstStepExtra(cfg.cost_ewma)   # the first plain step's after drafting
        self.psd_fill = FirstStepExtra(cfg.cost_ewma)   # the first PSD step's after another mode

    def lag_tokens(self) -> int:
        """Tokens the drafter would have to catch up on if turned on now."""
        if self.engine_lag is not None:
            return self.engine_lag
        per_step = self._lag_tokens / max(self._off_steps, 1)
        return int(min(self._lag_tokens, per_step * min(self._off_steps, self._cfg.lag_cap_steps)))

    def estimate_s(self, offloaded: bool) -> float:
        """Seconds a drafter turn-on would cost now (catch-up + reload if offloaded)."""
        c = (self.rebuild_s_per_token or 0.0) * self.lag_tokens()
        if offloaded:
            c += self._cfg.reload_weight * (self.reload_s or 0.0)
        return c

    def turned_on(self) -> None:
        """Speculation was chosen after plain decoding: the lag its catch-up will be for."""
        self._lag_at_turn_on = self.lag_tokens()

    def observe_off(self, tokens_committed: int) -> None:
        """A plain-decoding step: the drafter falls behind by the tokens it committed."""
        self._lag_tokens += int(tokens_committed)
        self._off_steps += 1

    def observe_on(self, rebuild_s: float) -> None:
        """A speculative step, with the catch-up it began with (0: none)."""
        if rebuild_s > 0:
            lag = self._lag_at_turn_on if self._lag_at_turn_on is not None else self.lag_tokens()
            if lag and lag > 0:
                self.rebuild_s_per_token = (
                    rebuild_s / lag if self.rebuild_samples == 0
                    else ewma(self.rebuild_s_per_token, rebuild_s / lag, self._cfg.cost_ewma))
                self.rebuild_samples += 1
        self._lag_tokens = 0
        self._off_steps = 0
        self._lag_at_turn_on = None

    def observe_reload(self, reload_s: float) -> None:
        self.reload_s = (reload_s if self.reload_samples == 0
                         else ewma(self.reload_s, reload_s, self._cfg.cost_ewma))
        self.reload_samples += 1

    def summary(self, offloaded: bool) -> dict:
        return {"rebuild_s_per_token": self.rebuild_s_per_token, "reload_s": self.reload_s,
                "rebuild_samples": self.rebuild_samples, "reload_samples": self.reload_samples,
                "lag_tokens": self.lag_tokens(), "turn_on_cost_s_now": self.estimate_s(offloaded),
                "turn_off_s": self.turn_off.extra_s, "turn_off_samples": self.turn_off.samples,
                "psd_fill_s": self.psd_fill.extra_s, "psd_fill_samples": self.psd_fill.samples,
                "drafter_offloaded": offloaded}
