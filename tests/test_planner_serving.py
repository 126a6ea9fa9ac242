"""Costs as the server pays them: the serving path's cost per step and per response, measured
from the running loop (planner/serving_cost.py), in the cost model's predictions, the bandit's
prior and the offload's gain estimate."""
from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.engine.loop import EngineLoop
from backend.sampling.params import SamplingParams
from helpers.planner_sim import ServerCosts
from model_factory import TINY_DRAFTER, TINY_TARGET
from planner import Planner
from planner.cost_model import StepOverhead, predict
from planner.serving_cost import ServingCost
from planner.signals import LoadSignals
from planner.step_costs import ForwardCost

COSTS = ServerCosts()
ARMS = [("ar", 0)] + [(m, g) for m in ("sd", "psd") for g in range(1, 5)]


def ranked(overhead, batch=32, alpha=COSTS.alpha):
    profile = COSTS.calibration()
    return sorted(ARMS, key=lambda a: 1.0 / predict(a[0], batch, a[1], alpha, profile, overhead).tokens_per_s)


def test_a_cost_per_response_moves_the_ranking_towards_more_tokens_per_response():
    alone = ranked(None)
    served = ranked(StepOverhead(COSTS.per_step, COSTS.per_response))
    assert alone[0] == ("ar", 0)                        # the forwards alone: plain decoding first
    assert served.index(("ar", 0)) == len(ARMS) - 1     # one token per response: now the last
    # within a mode, a longer gamma (more tokens per response) gains on a shorter one
    for mode in ("sd", "psd"):
        assert served.index((mode, 4)) - served.index((mode, 1)) < alone.index((mode, 4)) - alone.index((mode, 1))
    # and the prediction is what the serving path pays
    for a in ARMS:
        p = predict(a[0], 32, a[1], COSTS.alpha, COSTS.calibration(),
                    StepOverhead(COSTS.per_step, COSTS.per_response))
        assert 1.0 / p.tokens_per_s == pytest.approx(COSTS.per_token(a, 32), rel=1e-9)


def test_a_cost_per_step_alone_amortises_over_the_batch():
    profile = COSTS.calibration()
    o = StepOverhead(per_step_s=0.01)
    small = predict("ar", 2, 0, 0.7, profile, o).step_s - predict("ar", 2, 0, 0.7, profile).step_s
    big = predict("ar", 64, 0, 0.7, profile, o).step_s - predict("ar", 64, 0, 0.7, profile).step_s
    assert small == pytest.approx(big) == pytest.approx(0.01)
    # PSD emits half the responses a step, and its drafter's time overlaps them
    o = StepOverhead(per_response_s=0.001)
    psd = predict("psd", 32, 2, 0.7, profile, o).step_s
    assert psd == pytest.approx(max(2 * COSTS.t_draft(16), COSTS.t_verify(16, 3) + 0.016))


def feed(cost, per_step, per_response, steps, rng, responses=(8, 16, 24, 32), noise=0.1):
    for _ in range(steps):
        r = int(rng.choice(responses))
        cost.observe((per_step + per_response * r) * (1 + noise * rng.standard_normal()), r)


def test_the_serving_cost_is_split_per_step_and_per_response():
    cost, rng = ServingCost(), np.random.default_rng(0)
    assert cost.estimate() is None
    feed(cost, 0.002, 0.0003, 400, rng)
    est = cost.estimate()
    assert est.per_step_s == pytest.approx(0.002, rel=0.3)
    assert est.per_response_s == pytest.approx(0.0003, rel=0.1)


def test_the_serving_cost_estimate_tracks_a_changed_cost():
    cost, rng = ServingCost(), np.random.default_rng(1)
    feed(cost, 0.0005, 0.0001, 500, rng)
    assert cost.estimate().per_response_s == pytest.approx(0.0001, rel=0.15)
    feed(cost, 0.0005, 0.0006, 400, rng)                 # responses got six times dearer
    assert cost.estimate().per_response_s == pytest.approx(0.0006, rel=0.1)
    feed(cost, 0.0005, 0.0002, 400, rng)                 # and cheaper again
    assert cost.estimate().per_response_s == pytest.approx(0.0002, rel=0.15)


def test_one_stalled_step_does_not_move_the_estimate():
    cost, rng = ServingCost(), np.random.default_rng(3)
    feed(cost, 0.0005, 0.0001, 300, rng)
    before = cost.estimate().seconds(16)
    cost.observe(0.5, 16)                       # e.g. an offload started in that step
    feed(cost, 0.0005, 0.0001, 8, rng)
    assert cost.estimate().seconds(16) == pytest.approx(before, rel=0.15)


def test_without_spread_in_responses_the_cost_goes_on_the_responses():
    cost, rng = ServingCost(), np.random.default_rng(2)
    feed(cost, 0.001, 0.0002, 100, rng, responses=(32,), noise=0.0)
    est = cost.estimate()
    assert est.per_step_s == 0.0
    assert est.per_response_s == pytest.approx((0.001 + 0.0064) / 32)


def test_the_prior_ranks_the_arms_as_the_server_pays_them():
    p = Planner(gamma_max=4, psd_available=True, cost_profile=COSTS.calibration())
    s = LoadSignals(batch_size=32, waiting=4)
    ctx = p.bins.context(s)
    p.decide(s)
    prior = p.bandit.prior
    assert min(ARMS, key=lambda a: prior(ctx, a)) == ("ar", 0)
    rng = np.random.default_rng(0)
    feed(p.serving_cost, COSTS.per_step, COSTS.per_response, 200, rng, responses=(16, 32))
    assert min(ARMS, key=lambda a: prior(ctx, a))[0] == "psd"
    assert max(ARMS, key=lambda a: prior(ctx, a)) == ("ar", 0)
    assert p.summary()["serving_cost"]["per_response_s"] == pytest.approx(COSTS.per_response, rel=0.1)
    # the responses get cheap again (a lighter front end): the prior follows within a few hundred steps
    feed(p.serving_cost, 0.0001, 0.00001, 500, rng, responses=(16, 32))
    assert min(ARMS, key=lambda a: prior(ctx, a)) == ("ar", 0)


def test_the_offload_gain_counts_what_amortises_and_what_does_not():
    fc = ForwardCost()
    for b in (4, 8, 16, 32, 64) * 8:
        fc.observe(b, 0.004 + 0.0001 * b)
    wall = (0.004 + 0.0001 * 16 + 0.002 + 0.0004 * 16) / 16      # AR per token at 16, served
    plain = fc.per_token_at(16, 32, wall)                          # the rest carried as it is
    all_on_responses = fc.per_token_at(16, 32, wall, StepOverhead(0.0, (0.002 + 0.0064) / 16))
    per_response = fc.per_token_at(16, 32, wall, StepOverhead(0.002, 0.0004))
    truth = (0.004 + 0.0001 * 32 + 0.002 + 0.0004 * 32) / 32
    assert per_response == pytest.approx(truth)
    assert per_response < plain                # the per-step part amortises over the bigger batch
    assert all_on_responses == pytest.approx(plain)   # a cost per response does not amortise


# ---------------------------------------------------------------------------------------------
# measured from the running loop: a front end that pays per response, on the loop thread

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPT_CUTS = (16, 20, 29, 250)      # helpers.engines.code_prompts


def serve(loop, prompts, per_response_s):
    done = threading.Semaphore(0)

    def on_output(out):
        if per_response_s:
            time.sleep(per_response_s)
        if out.finished:
            done.release()
    for i, prompt in enumerate(prompts):
        loop.submit(f"r{per_response_s}-{i}", prompt, GREEDY, on_output)
    for _ in prompts:
        assert done.acquire(timeout=120)


def test_the_engine_loop_measures_the_cost_of_each_response(prompts):
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode="auto",
                                 gamma_max=4, planner_cost_profile="off",
                                 max_num_seqs=8))
    loop = EngineLoop(engine)
    try:
        serve(loop, prompts[:16], 0.0)
        cheap = engine.planner.serving_cost.estimate()
        assert cheap is not None and cheap.seconds(8) < 0.002     # in process: next to nothing
        # 2 ms a response, served until the cheap steps' weight in the fit has decayed below
        # 5 % (forget 0.99 a step: 299 steps), however many steps a round takes on this host
        fit = engine.planner.serving_cost
        settle = math.ceil(math.log(0.05) / math.log(fit.line.forget))
        changed_at = fit.points
        for _ in range(12):
            serve(loop, prompts[:16], 0.002)
            if fit.points - changed_at >= settle:
                break
        assert fit.points - changed_at >= settle
        dear = engine.planner.serving_cost.estimate()
        assert dear.per_response_s == pytest.approx(0.002, rel=0.25)
        assert engine.planner.summary()["serving_cost"]["steps"] > 50
    finally:
        loop.shutdown()
        engine.close()
