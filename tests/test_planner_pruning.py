"""Fewer arms while requests wait (planner/pruning.py), on a synthetic serving path whose
responses cost what an in-process calibration does not see (tests/helpers/planner_sim.py).

The scenario an earlier attempt failed: under a growing queue, speculation is better, yet
narrowing exploration locked the planner onto plain decoding."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from planner import Planner, PlannerConfig
from planner.config import PLANNER_BANDIT
from planner.pruning import ArmPruner
from planner.signals import LoadSignals
from helpers.planner_sim import ServerCosts, ServerSim

BATCH = 32
SD_WINS = ServerCosts()                                   # speculation wins through the server
AR_WINS = replace(SD_WINS, alpha=0.45, per_step=0.0002, per_response=0.00005, d0=0.002, d1=0.0001)


def run(planner, costs, steps=3000, report_serving=True, seed=0, batch=BATCH):
    sim = ServerSim(planner, costs, seed=seed, report_serving=report_serving)
    out = [sim.step(batch) for _ in range(steps)]
    return [d for d, _, _ in out], sum(w for _, w, _ in out[steps // 2:]) / sum(t for _, _, t in out[steps // 2:])


def planner_for(costs, config=None, seed=0):
    return Planner(config or PlannerConfig(), gamma_max=4, psd_available=True, seed=seed,
                   cost_profile=costs.calibration())


def oracle(costs, arms, batch=BATCH):
    return min(costs.per_token(a, batch) for a in arms)


def test_the_scenario_has_the_shape_of_the_failure():
    arms = [("ar", 0)] + [(m, g) for m in ("sd", "psd") for g in range(1, 5)]
    in_process = replace(SD_WINS, per_step=0.0, per_response=0.0)
    # what the calibration sees: plain decoding first; what the server pays: speculation far ahead
    assert min(arms, key=lambda a: in_process.per_token(a, BATCH)) == ("ar", 0)
    assert SD_WINS.per_token(("ar", 0), BATCH) > 1.3 * oracle(SD_WINS, arms)
    assert min(arms, key=lambda a: AR_WINS.per_token(a, BATCH)) == ("ar", 0)
    assert AR_WINS.per_token(("ar", 0), BATCH) * 1.2 < min(AR_WINS.per_token(a, BATCH) for a in arms[1:])


@pytest.mark.parametrize("seed", range(3))
def test_narrowed_exploration_blind_to_the_serving_cost_locks_onto_plain_decoding(seed):
    # The failure reproduced: exploration narrowed, no pruning guards, and a prior that knows only
    # the in-process forwards. Its scale is calibrated on plain decoding's measurements, so every
    # untried speculative arm looks worse, and it never measures one.
    narrow = PlannerConfig(prune=False, bandit=replace(PLANNER_BANDIT, explore=0.05))
    decisions, _ = run(planner_for(SD_WINS, narrow, seed), SD_WINS, report_serving=False, seed=seed)
    assert np.mean([not d.speculative for d in decisions[1500:]]) > 0.9


@pytest.mark.parametrize("report_serving", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_under_a_growing_queue_the_planner_does_not_settle_on_plain_decoding(seed, report_serving):
    # With the serving cost measured, the prior ranks the arms as the server pays them; without
    # it (a cost the loop does not see), the probes still measure every mode before any pruning.
    p = planner_for(SD_WINS, seed=seed)
    decisions, per_token = run(p, SD_WINS, report_serving=report_serving, seed=seed)
    tail = decisions[1500:]
    assert np.mean([not d.speculative for d in tail]) < 0.05, Counter(map(str, tail)).most_common(3)
    assert per_token < 1.12 * oracle(SD_WINS, p.arms), (per_token, oracle(SD_WINS, p.arms))
    s = p.summary()["pruning"]
    assert s["pruned_steps"] > 2000          # pruning was on nearly all along
    assert s["probes"] >= 1
    assert len(s["pruned"]["b32-63"]) >= 3   # fewer arms: at most six of nine left


@pytest.mark.parametrize("seed", range(3))
def test_where_plain_decoding_is_better_the_planner_settles_there(seed):
    p = planner_for(AR_WINS, seed=seed)
    decisions, per_token = run(p, AR_WINS, seed=seed)
    assert np.mean([not d.speculative for d in decisions[1500:]]) > 0.9
    assert per_token < 1.05 * oracle(AR_WINS, p.arms)
    assert p.summary()["pruning"]["pruned_steps"] > 2000


def test_pruning_cuts_the_exploration_of_losing_arms():
    # The same run with and without pruning: with it, the arms that cost over 10 % more per token
    # than the best (the simulation knows every arm's true cost) are played far less once the
    # pressure has lasted. Every gamma stays a candidate (no unimodal rule), so what is cut is
    # pruning's doing.
    every_gamma = replace(PLANNER_BANDIT, unimodal=False)
    def losers_played(prune):
        p = planner_for(SD_WINS, PlannerConfig(prune=prune, bandit=every_gamma))
        decisions, _ = run(p, SD_WINS, seed=1)
        best = oracle(SD_WINS, p.arms)
        return sum(SD_WINS.per_token(d.arm, BATCH) > 1.1 * best for d in decisions[500:])
    unpruned = losers_played(False)
    assert unpruned >= 20                      # without pruning they are explored
    assert losers_played(True) < 0.5 * unpruned


def test_a_pruned_arm_returns_when_the_acceptance_changes():
    # Low acceptance: short gammas win and psd:4 is set aside; then the drafter's acceptance rises
    # (other text) and long gammas win: the acceptance estimate moves, the arms come back, and
    # the planner plays a long gamma.
    low = replace(SD_WINS, alpha=0.5)
    high = replace(SD_WINS, alpha=0.92)
    assert min([("psd", g) for g in range(1, 5)] + [("sd", g) for g in range(1, 5)],
               key=lambda a: low.per_token(a, BATCH))[1] <= 2
    assert min([("psd", g) for g in range(1, 5)] + [("sd", g) for g in range(1, 5)],
               key=lambda a: high.per_token(a, BATCH))[1] == 4
    p = planner_for(low)
    sim = ServerSim(p, low, seed=0)
    for _ in range(2000):
        sim.step(BATCH)
    signals = LoadSignals(batch_size=BATCH, waiting=5, kv_usage=0.97)
    assert ("psd", 4) in p.pruned_arms(signals)
    restores = p.summary()["pruning"]["restores"]
    sim.costs = high
    tail = [sim.step(BATCH)[0] for _ in range(2500)][-1000:]
    assert p.summary()["pruning"]["restores"] > restores
    assert p.alpha_estimate() > 0.65
    assert ("psd", 4) not in p.pruned_arms(signals)
    assert np.mean([d.gamma >= 3 for d in tail]) > 0.8, Counter(map(str, tail)).most_common(3)


# ---------------------------------------------------------------------------------------------
# the pruner alone: what brings an arm back

ARMS = [("ar", 0), ("sd", 1), ("sd", 2), ("sd", 3)]
MEASURED = {("ar", 0): (1.0, 50.0), ("sd", 1): (0.7, 50.0), ("sd", 2): (0.8, 50.0), ("sd", 3): (1.2, 50.0)}


def ask(pruner, ctx="b32-63", pressure=True, alpha=0.6, demand=100.0, measured=MEASURED):
    return pruner.allowed(ctx, pressure=pressure, alpha=alpha, demand=demand,
                          measured=lambda: measured, estimated=lambda: measured,
                          prior=lambda a: measured[a][0])


def test_the_pruner_keeps_the_best_of_every_mode_and_what_ranked_first():
    pr = ArmPruner(ARMS, check_every=1)
    assert set(ask(pr)) == {("ar", 0), ("sd", 1)}
    assert pr.pruned("b32-63") == {("sd", 2), ("sd", 3)}
    # an arm that the measurements rank first once stays, even when it falls behind later
    pr = ArmPruner(ARMS, check_every=1)
    ask(pr, measured=MEASURED | {("sd", 2): (0.6, 50.0)})
    assert ("sd", 2) in ask(pr)


def test_nothing_is_pruned_before_the_best_arm_is_measured_and_every_mode_is_probed():
    pr = ArmPruner(ARMS, check_every=1, min_obs=8)
    thin = {a: (m, 2.0) for a, (m, _) in MEASURED.items()}
    assert ask(pr, measured=thin) is None                # the bandit's own choices come first
    # plain decoding measured, the speculative arms on their prior alone: the best of them is
    # probed (played alone for min_obs steps) before anything is pruned
    only_ar = thin | {("ar", 0): (1.0, 20.0)}
    for _ in range(8):
        assert ask(pr, measured=only_ar) == (("sd", 1),)
    assert pr.probes == 1
    assert ask(pr, measured=only_ar) is None             # sd:1, the best, not measured enough
    assert ask(pr) == (("ar", 0), ("sd", 1))             # measured: the losing gammas go
    assert pr.probes == 1                                # once per mode, bin and episode


@pytest.mark.parametrize("change", ["pressure", "alpha", "demand", "bin"])
def test_a_pruned_arm_returns_when_the_context_changes(change):
    pr = ArmPruner(ARMS, check_every=1)
    assert ("sd", 2) not in ask(pr)
    restores = pr.restores
    # another bin prunes by its own measurements (there, sd:2 is the best)
    kw = {"pressure": {"pressure": False}, "alpha": {"alpha": 0.8}, "demand": {"demand": 200.0},
          "bin": {"ctx": "b4-7", "measured": MEASURED | {("sd", 2): (0.5, 50.0)}}}[change]
    allowed = ask(pr, **kw)
    assert allowed is None or ("sd", 2) in allowed
    if change != "bin":
        assert pr.restores == restores + 1
        assert pr.pruned("b32-63") == frozenset()
        for _ in range(4 * pr.check_every - 1):    # the bandit re-measures before any pruning
            assert ask(pr, **kw) is None
    # small moves keep them pruned
    pr2 = ArmPruner(ARMS, check_every=1)
    ask(pr2)
    assert ("sd", 2) not in ask(pr2, alpha=0.65, demand=120.0)


def test_a_pruned_arm_returns_when_the_cost_model_ranks_it_first():
    pr = ArmPruner(ARMS, check_every=1)
    ask(pr)
    assert ("sd", 3) in pr.pruned("b32-63")
    allowed = pr.allowed("b32-63", pressure=True, alpha=0.6, demand=100.0,
                         measured=lambda: MEASURED, estimated=lambda: MEASURED,
                         prior=lambda a: 0.1 if a == ("sd", 3) else MEASURED[a][0])
    assert ("sd", 3) in allowed


def test_pruning_can_be_switched_off():
    pr = ArmPruner(ARMS, check_every=1, enabled=False)
    assert ask(pr) is None
    assert PlannerConfig.from_dict({"prune": False}).prune is False
    with pytest.raises(ValueError, match="prune_demand_shift"):
        PlannerConfig.from_dict({"prune_demand_shift": 1.0})
