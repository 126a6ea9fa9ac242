"""What a step costs the serving path outside its forwards, measured while the engine runs.

The calibration (:mod:`backend.engine.calibration`) times bare forwards in process. A running
step costs more: scheduling and admission before the forward, committing tokens into one output
per sequence it advanced, and, between the end of one step and the start of the next, the loop
handing those outputs to the front end (through tritonserver: queueing one response per request
per step for the stub's IPC) and taking in new requests. In process that is small; through the
server it grows with every response.

The engine reports, for every busy step, those seconds (its scheduling and commit time plus the
gap before the next step) and the outputs the step emitted. :class:`ServingCost` fits
``seconds ~ per_step + per_response * responses`` to them, a least-squares line with
exponential forgetting (``forget`` per step: it follows a cost that changes within a few
hundred steps). While the response counts have too little spread to separate the two (a batch
that does not change), the whole cost is put on the responses (the ratio of the means): at the
batch it was measured at that is exact, and a cost that grows with the batch is the larger
risk to leave out. A step that takes far longer than the fit predicts (an offload started in
its scheduling, a pause of the process) counts as ``outlier`` times the prediction: a changed
cost still pulls the fit up within tens of steps, one stall does not. The result, a :class:`~planner.cost_model.StepOverhead`, is what the cost
model's prior and the offload's gain estimate add to every step they predict.
"""
from __future__ import annotations

import math

from planner.cost_model import StepOverhead
from planner.step_costs import RunningLine


class ServingCost:
    def __init__(self, forget: float = 0.99, min_points: int = 16, refresh_every: int = 8,
                 outlier: float = 4.0):
        self.outlier = float(outlier)
        self.line = RunningLine(forget=forget, min_points=min_points, min_rel_spread=0.1)
        self.min_points = int(min_points)
        self.refresh_every = int(refresh_every)
        self._current: StepOverhead | None = None
        self._at = -1

    @property
    def points(self) -> int:
        return self.line.points

    def observe(self, seconds: float, responses: int) -> None:
        """One busy step: its seconds outside the forwards and the outputs it emitted."""
        if not (seconds >= 0 and math.isfinite(seconds) and responses >= 0):
            return
        est = self.estimate()
        if est is not None:
            seconds = min(seconds, self.outlier * max(est.seconds(responses), 1e-4))
        self.line.add(float(responses), float(seconds))

    def estimate(self) -> StepOverhead | None:
        """The current per-step and per-response seconds (None until ``min_points`` steps were
        seen). Refreshed every ``refresh_every`` steps, so that what the prior caches on it
        stays valid in between."""
        if self.line.points < self.min_points:
            return None
        if self._current is None or self.line.points - self._at >= self.refresh_every:
            self._current, self._at = self._fit(), self.line.points
        return self._current

    def _fit(self) -> StepOverhead:
        mx, my = self.line.means()
        my = max(my, 0.0)
        fit = self.line.fit()
        if fit is not None:
            a, c = fit
            if c <= 0:                     # no growth with the responses: a cost per step
                return StepOverhead(my, 0.0)
            if a >= 0:
                return StepOverhead(a, c)
        if mx <= 0:
            return StepOverhead(my, 0.0)
        return StepOverhead(0.0, my / mx)

    def summary(self) -> dict:
        est = self.estimate()
        return {"per_step_s": est.per_step_s if est else None,
                "per_response_s": est.per_response_s if est else None,
                "steps": self.line.points}
