"""A synthetic serving path for the planner: forwards that cost what a calibration measures, plus
a cost per step and per response that only the running loop sees (as through tritonserver), a
queue that grows, and sampled acceptances. Drives Planner.decide / observe / observe_serving as
the engine's adaptive controller does."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner import Planner
from planner.cost_model import CostProfile, expected_tokens_per_call, responses_per_step
from planner.outcome import StepOutcome
from planner.signals import LoadSignals


@dataclass
class ServerCosts:
    c0: float = 0.004        # target forward: c0 + c1 x tokens fed
    c1: float = 0.0001
    d0: float = 0.001        # one draft position: d0 + d1 x sequences
    d1: float = 0.00005
    per_step: float = 0.0005       # the serving path's cost outside the forwards
    per_response: float = 0.0004
    alpha: float = 0.7

    def t_verify(self, b: float, n: int) -> float:
        return self.c0 + self.c1 * b * n

    def t_draft(self, b: float) -> float:
        return self.d0 + self.d1 * b

    def outside(self, responses: float) -> float:
        return self.per_step + self.per_response * responses

    def step_s(self, mode: str, gamma: int, b: int) -> float:
        """A step's wall time through the serving path: its forwards and its own cost."""
        if mode == "ar":
            return self.t_verify(b, 1) + self.outside(b)
        if mode == "psd" and b >= 2:
            h = -(-b // 2)
            return max(gamma * self.t_draft(b / 2), self.t_verify(h, gamma + 1) + self.outside(h))
        return gamma * self.t_draft(b) + self.t_verify(b, gamma + 1) + self.outside(b)

    def per_token(self, arm, b: int, alpha: float | None = None) -> float:
        mode, gamma = arm
        e = expected_tokens_per_call(self.alpha if alpha is None else alpha, gamma)
        return self.step_s(mode, gamma, b) / (responses_per_step(mode, b) * e)

    def calibration(self) -> CostProfile:
        """What an in-process calibration measures: the forwards alone."""
        bs = [1, 2, 4, 8, 16, 32, 64]
        return CostProfile({(b, n): self.t_verify(b, n) for b in bs for n in range(1, 8)},
                           {b: self.t_draft(b) for b in bs})


class ServerSim:
    """Runs a planner's decisions at `batch` running requests with a queue that grows by
    `queue_growth` requests a step (pressure all along); `report_serving` feeds the planner the
    serving path's cost outside the forwards, as the engine's adaptive controller does. The
    drafter falls behind by what plain decoding commits (sequences of about `seq_tokens` tokens:
    at most that many per running sequence) and catches up at `rebuild_per_token` seconds a
    token when a drafter arm follows. The first PSD step after another mode costs `psd_fill_s`
    more (its sub-batch drafted in line: the pipeline's fill)."""

    def __init__(self, planner: Planner, costs: ServerCosts, *, seed: int = 0, noise: float = 0.1,
                 report_serving: bool = True, demand_tok_s: float | None = None,
                 rebuild_per_token: float = 2e-5, seq_tokens: int = 64, psd_fill_s: float = 0.0):
        self.p, self.costs = planner, costs
        self.rng = np.random.default_rng(seed)
        self.noise = noise
        self.report_serving = report_serving
        self.demand_tok_s = demand_tok_s
        self.rebuild_per_token, self.seq_tokens = rebuild_per_token, seq_tokens
        self.t, self.waiting = 0.0, 0.0
        self.off_steps = 0
        self.psd_fill_s, self._last_mode = psd_fill_s, None

    def step(self, batch: int, queue_growth: float = 0.05):
        self.waiting += queue_growth
        lag = batch * min(self.off_steps, self.seq_tokens)
        s = LoadSignals(batch_size=batch, waiting=int(self.waiting) + 1, kv_usage=0.97, now=self.t,
                        demand_tok_s=self.demand_tok_s, waiting_tokens=64 * (int(self.waiting) + 1),
                        drafter_lag_tokens=lag)
        d = self.p.decide(s)
        c = self.costs
        mode = "sd" if d.mode == "psd" and batch < 2 else d.mode
        responses = responses_per_step(mode, batch)
        if mode == "ar":
            tokens = responses
        else:
            acc = np.minimum(self.rng.geometric(1 - c.alpha, size=responses) - 1, d.gamma)
            tokens = int((acc + 1).sum())
        wall = c.step_s(mode, d.gamma, batch) * max(1.0 + self.noise * self.rng.standard_normal(), 0.2)
        rebuild = 0.0
        if d.uses_drafter:
            rebuild, self.off_steps = self.rebuild_per_token * lag, 0
        else:
            self.off_steps += 1
        wall += rebuild
        if mode == "psd" and self._last_mode != "psd":
            wall += self.psd_fill_s
        self._last_mode = mode
        self.p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=responses,
                                      drafter_rebuild_s=rebuild))
        if self.report_serving:
            outside = c.outside(responses) * max(1.0 + self.noise * self.rng.standard_normal(), 0.2)
            self.p.observe_serving(outside, responses)
        self.t += wall
        return d, wall, tokens


def speculative_share_at_batch_1(seed: int, rejected: int, steps: int = 1500, *,
                                 prompted: int = 0, prompt_tokens: int = 100) -> float:
    """The share of steps after the first third that used the drafter, at batch 1 where SD at
    gamma 2-4 costs about 0.7x plain decoding a token, with the first `rejected` drafts all
    rejected (one sequence's bad luck at the start), and the first `prompted` speculative steps
    also feeding a prompt of `prompt_tokens` tokens (a request joining in an engine's first
    steps). Every step reports its target forward, as the engine does."""
    costs = ServerCosts()
    p = Planner(gamma_max=8, psd_available=True, cost_profile=costs.calibration(), seed=seed)
    rng, t, drafts, late = np.random.default_rng(seed), 0.0, 0, []
    for step in range(steps):
        d = p.decide(LoadSignals(batch_size=1, now=t))
        tokens, fed, wall = 1, 1, costs.step_s("ar", 0, 1)
        prefill = 0
        if d.uses_drafter:
            accepted = 0 if drafts < rejected else min(rng.geometric(1 - costs.alpha) - 1, d.gamma)
            tokens, fed, wall = accepted + 1, d.gamma + 1, costs.step_s("sd", d.gamma, 1)
            prefill = prompt_tokens if drafts < prompted else 0
            drafts += 1
        noise = 1 + 0.05 * rng.standard_normal()
        forward_s = costs.t_verify(1, fed + prefill) * noise
        wall = (wall + costs.c1 * prefill) * noise
        p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=1,
                                 prefill_tokens=prefill, forward_tokens=fed + prefill,
                                 forward_s=forward_s))
        p.observe_serving(costs.outside(1), 1)
        t += wall
        if step >= steps // 3:
            late.append(d.uses_drafter)
    return float(np.mean(late))
