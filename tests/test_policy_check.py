"""Plain decoding against the bandit's choice over whole stretches (planner.policy_check)."""
from __future__ import annotations

import numpy as np
import pytest

from planner import LoadSignals, Planner, StepOutcome
from planner.config import PlannerConfig
from planner.policy_check import BANDIT, PLAIN, PolicyCheck


class TurnoverServer:
    """A server whose batch depends on the policy, as at concurrency 16 through tritonserver:
    while it speculates it runs at 15 (a finished request's replacement on its way), and
    `lockstep_after` plain steps in a row bring its requests into lockstep at 16. Per-token
    costs by (mode, batch) make the bandit's per-bin view mislead: a speculative step costs less
    than a plain one at both batches (`costs`), so a bandit that speculates never leaves 15."""

    def __init__(self, planner: Planner, costs: dict, *, lockstep_after: int = 12, seed: int = 0):
        self.p, self.costs, self.lockstep_after = planner, costs, lockstep_after
        self.rng = np.random.default_rng(seed)
        self.plain_run = 0
        self.t = 0.0
        self.forced_batch: int | None = None
        self.queued = 0               # requests admission has turned away
        self.log: list[tuple[str, float, int]] = []   # (mode, wall, tokens) a step

    def batch(self) -> int:
        if self.forced_batch is not None:
            return self.forced_batch
        return 16 if self.plain_run >= self.lockstep_after else 15

    def step(self) -> None:
        b = self.batch()
        d = self.p.decide(LoadSignals(batch_size=b, now=self.t, waiting=self.queued, left_waiting=self.queued))
        mode = "ar" if not d.speculative else "sd"
        tokens = b if mode == "ar" else 2 * b
        wall = tokens * self.costs[mode, b] * (1 + 0.05 * self.rng.standard_normal())
        self.p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=b))
        self.plain_run = self.plain_run + 1 if mode == "ar" else 0
        self.t += wall
        self.log.append((mode, wall, tokens))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def cost_per_token(self, last: int) -> float:
        tail = self.log[-last:]
        return sum(w for _, w, _ in tail) / sum(t for *_, t in tail)

    def plain_share(self, last: int) -> float:
        return sum(m == "ar" for m, *_ in self.log[-last:]) / last


# speculation beats plain decoding step for step at 15 and at 16 (s a token), but it keeps the
# server at 15, and plain decoding in lockstep at 16 beats it over a stretch
LOCKSTEP_PAYS = {("ar", 15): 1.5e-3, ("sd", 15): 1.0e-3, ("ar", 16): 0.7e-3, ("sd", 16): 0.65e-3,
                 ("ar", 2): 1.5e-3, ("sd", 2): 0.6e-3}
SPECULATION_PAYS = {("ar", 15): 0.7e-3, ("sd", 15): 0.5e-3, ("ar", 16): 0.7e-3, ("sd", 16): 0.5e-3}


def planner(policy_check: bool, seed: int = 0) -> Planner:
    return Planner(PlannerConfig(modes=("ar", "sd"), policy_check=policy_check),
                   gamma_max=2, psd_available=False, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_decoding_that_wins_over_a_stretch_is_held_though_its_steps_lose_in_their_bin(seed):
    without, with_check = (TurnoverServer(planner(flag, seed), LOCKSTEP_PAYS, seed=seed)
                           for flag in (False, True))
    without.run(3000)
    with_check.run(3000)
    # the bandit alone stays on speculation at 15: a token costs it about 1 ms
    assert without.plain_share(1000) < 0.2
    assert without.cost_per_token(1000) > 0.95e-3
    # the check tried plain decoding over a stretch, found it cheaper and holds it
    check = with_check.p.stats()["policy_check"]
    assert check["incumbent"] == PLAIN and check["swaps"] >= 1
    # the verdict shows why: the bandit's stretches ran at 15, plain decoding's trial at 16
    swap = next(v for v in check["verdicts"] if v["kept"] == PLAIN)
    assert swap["batch"] == 15.0 and swap["trial_batch"] > 15.5
    assert with_check.plain_share(1000) > 0.9
    assert with_check.cost_per_token(1000) < 0.8e-3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_speculation_wins_over_the_stretch_too_plain_trials_do_not_take_over(seed):
    sim = TurnoverServer(planner(True, seed), SPECULATION_PAYS, seed=seed)
    sim.run(3000)
    check = sim.p.stats()["policy_check"]
    assert check["incumbent"] == BANDIT and check["swaps"] == 0
    assert check["checks"] >= 2
    # plain decoding measured dearer every time (0.7 / 0.5 a step), and its trials, ever further
    # apart, cost the run little
    assert all(v["challenger_over_incumbent"] > 1.3 for v in check["verdicts"])
    # after a trial the bandit decides afresh: no block of plain decoding grown by the forced
    # plays goes on (with one, plain decoding ran 18 % of the steps here and the run cost 4 % more)
    assert sim.plain_share(3000) < 0.09
    alone = TurnoverServer(planner(False, seed), SPECULATION_PAYS, seed=seed)
    alone.run(3000)
    assert sim.cost_per_token(3000) < 1.02 * alone.cost_per_token(3000)


def test_held_plain_decoding_gives_way_to_the_bandit_when_the_batch_moves():
    sim = TurnoverServer(planner(True), LOCKSTEP_PAYS)
    sim.run(1500)
    assert sim.p.summary()["policy_check"]["incumbent"] == PLAIN
    sim.forced_batch = 2          # another load: two requests left
    sim.run(300)
    check = sim.p.summary()["policy_check"]
    assert check["incumbent"] == BANDIT and check["left_on_load"] == 1
    assert sim.plain_share(100) < 0.2      # at batch 2 speculation pays, and the bandit plays it


def test_while_requests_queue_no_check_runs_and_held_plain_decoding_gives_way_to_the_bandit():
    # the planner's known failure is settling on plain decoding under a queue: the check must
    # not hold it there, nor try it, whatever a stretch would say
    sim = TurnoverServer(planner(True), LOCKSTEP_PAYS)
    sim.run(1500)
    assert sim.p.summary()["policy_check"]["incumbent"] == PLAIN
    checks = sim.p.summary()["policy_check"]["checks"]
    sim.queued = 5
    sim.run(1000)
    check = sim.p.summary()["policy_check"]
    assert check["incumbent"] == BANDIT and check["left_on_queue"] == 1
    assert check["last_verdict"]["kept"] == "queue"
    assert check["checks"] == checks           # 1,000 steps, 96 after the last: none started
    assert sim.plain_share(500) < 0.2          # the bandit alone, as without the check
    sim.queued = 0                             # the queue gone, the check takes up again
    sim.run(1500)
    assert sim.p.summary()["policy_check"]["incumbent"] == PLAIN


def test_a_check_under_way_is_dropped_when_requests_start_to_queue():
    pc = PolicyCheck(first_after=20, seq_tokens=4, min_steps=4, settle=2)
    steps = 0
    while not pc.plain_only():                 # run the bandit until plain decoding's trial
        pc.observe(wall_s=16e-3, tokens=32, batch=16, speculative=True)
        steps += 1
    assert pc.checks == 1 and steps < 100
    pc.note_queue(True)
    assert not pc.plain_only()
    assert pc.left_on_queue == 1 and pc.verdicts[-1]["kept"] == "queue" and pc.swaps == 0
    for _ in range(500):                       # still queued: nothing more
        pc.note_queue(True)
        assert not pc.plain_only()
        pc.observe(wall_s=16e-3, tokens=32, batch=16, speculative=True)
    assert pc.checks == 1 and pc.left_on_queue == 1


@pytest.mark.parametrize("after_batch, swaps", [(16, 1), (4, 0)])
def test_no_verdict_when_the_load_moved_between_the_stretches_around_a_trial(after_batch, swaps):
    # plain decoding costs 0.9x speculation a token at the same batch (a swap), but a stretch at
    # batch 4 costs four times one at 16: a load that moves from 16 to 4 across the trial would
    # make the incumbent look 2.5x dearer than it is
    def cost(plain, batch):
        return (0.9 if plain else 1.0) * 1e-3 * 16 / batch
    pc = PolicyCheck(first_after=20, seq_tokens=4, min_steps=4, settle=2)
    phase = "before"
    while not pc.verdicts:
        plain = pc.plain_only()
        if plain:
            phase = "trial"
        elif phase == "trial":
            phase = "after"
        batch = after_batch if phase == "after" else 16
        tokens = batch * (1 if plain else 2)
        pc.observe(wall_s=tokens * cost(plain, batch), tokens=tokens, batch=batch, speculative=not plain)
    assert pc.swaps == swaps
    assert pc.moved == 1 - swaps
    v = pc.verdicts[-1]
    assert v["kept"] == (PLAIN if swaps else "moved")
    assert not pc.plain_only() if not swaps else pc.plain_only()


def test_the_checks_come_twice_as_far_apart_each_time_the_incumbent_holds():
    pc = PolicyCheck(first_after=100, max_interval=400, seq_tokens=4, min_steps=4, settle=2)
    trial_starts, was_plain = [], False
    for step in range(4000):
        plain = pc.plain_only()
        if plain and not was_plain:
            trial_starts.append(step)
        was_plain = plain
        # a step of 16 ms either way: plain decoding commits 16 tokens, speculation 32
        pc.observe(wall_s=16e-3, tokens=16 if plain else 32, batch=16, speculative=not plain)
    assert pc.swaps == 0 and pc.incumbent == BANDIT
    # a trial and the stretch after it take 2 x (settle 2 + 4 steps) = 12 steps; the incumbent
    # then runs 100, 200, 400, 400 ... steps before the next
    gaps = list(np.diff(trial_starts))
    assert gaps[:4] == [212, 412, 412, 412]
    assert [v["challenger_over_incumbent"] for v in pc.verdicts][:3] == [2.0, 2.0, 2.0]


def test_no_check_below_the_batch_it_is_for_or_while_auto_already_decodes_plainly():
    small = PolicyCheck(first_after=10, min_batch=8)
    for _ in range(500):
        assert not small.plain_only()
        small.observe(wall_s=1e-3, tokens=8, batch=4, speculative=True)
    assert small.checks == 0 and small.skipped > 0
    plain = PolicyCheck(first_after=10)
    for _ in range(500):
        assert not plain.plain_only()
        plain.observe(wall_s=1e-3, tokens=16, batch=16, speculative=False)
    assert plain.checks == 0 and plain.skipped > 0


def test_a_planner_without_the_check_reports_it_idle_and_plays_as_the_bandit_alone():
    sim = TurnoverServer(planner(False), LOCKSTEP_PAYS)
    sim.run(600)
    # on this server a check would have held plain decoding by now (the test above)
    assert sim.plain_share(300) < 0.2
    check = sim.p.summary()["policy_check"]
    assert check == {"enabled": False, "incumbent": BANDIT, "checks": 0, "swaps": 0, "skipped": 0,
                     "left_on_load": 0, "left_on_queue": 0, "moved": 0, "last_verdict": None}


def test_plain_steps_on_cores_the_engine_is_only_trying_are_left_out_of_the_stretches():
    def verdict(trying_wall_s: float) -> float:
        pc = PolicyCheck(first_after=50, seq_tokens=4, min_steps=4, settle=2)
        step = 0
        while not pc.verdicts:
            plain = pc.plain_only()
            trying = plain and step % 3 == 0      # the lending choice's other side, now and then
            pc.observe(wall_s=trying_wall_s if trying else 16e-3, tokens=16 if plain else 32,
                       batch=16, speculative=not plain, priced=not trying)
            step += 1
        return pc.verdicts[0]["challenger_over_incumbent"]

    # whatever the tried side's steps cost, the trial's cost is plain decoding's as it will run
    assert verdict(16e-3) == verdict(1.0) == 2.0
