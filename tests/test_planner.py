"""The adaptive planner: the contextual bandit on synthetic cost environments, and the planner on a
synthetic engine where speculation wins at small batches and plain decoding at large ones."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from backend.mode import Mode
from planner.arms import arm_str
from planner.bandit import ContextualBandit
from planner.cost_model import CostProfile, expected_tokens_per_call
from planner import AR, Decision, Planner, PlannerConfig, StepOutcome, batch_bin
from planner.signals import LoadSignals

from helpers.planner_sim import ServerCosts, ServerSim, speculative_share_at_batch_1


# ---------------------------------------------------------------------------------------------
# bandit on synthetic environments: loss = f(context, arm) * (1 + noise)


def simulate(bandit, f, T, context=lambda t: 0, noise=0.1, seed=0):
    """Run T steps; return (arms played, per-step regret against the best arm of the context)."""
    rng = np.random.default_rng(seed)
    played, regret = [], np.zeros(T)
    for t in range(T):
        c = context(t)
        a = bandit.select(c)
        mu = f(c, a, t)
        regret[t] = mu - min(f(c, x, t) for x in bandit.arms)
        bandit.update(c, a, mu * (1.0 + noise * rng.standard_normal()))
        played.append(a)
    return played, regret


ARMS6 = list(range(6))


def two_contexts(c, a, t):
    best = 1 if c == 0 else 4           # each context has its own best arm
    return 1.0 + 0.15 * abs(a - best)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bandit_converges_to_best_arm_per_context(seed):
    b = ContextualBandit(ARMS6, seed=seed)
    ctx = lambda t: (t // 250) % 2       # noqa: E731 - contexts alternate in visits of 250 steps
    played, _ = simulate(b, two_contexts, 8000, context=ctx, seed=seed)
    assert b.best(0) == 1 and b.best(1) == 4
    tail = [(ctx(t), a) for t, a in enumerate(played)][-2000:]
    for c, best in ((0, 1), (1, 4)):
        arms = [a for cc, a in tail if cc == c]
        assert np.mean([a == best for a in arms]) > 0.9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bandit_regret_is_sublinear(seed):
    # stationary environment, no discounting: regret of the second half << regret of the first
    b = ContextualBandit(ARMS6, seed=seed, discount=1.0)
    _, regret = simulate(b, two_contexts, 20000, context=lambda t: (t // 500) % 2, seed=seed)
    first, second = regret[:10000].sum(), regret[10000:].sum()
    assert first > 0
    assert second < 0.3 * first, (first, second)
    # with the default (discounted, so it keeps re-probing) regret(T)/T still falls
    b = ContextualBandit(ARMS6, seed=seed)
    _, regret = simulate(b, two_contexts, 20000, context=lambda t: (t // 500) % 2, seed=seed)
    assert regret[:20000].mean() < 0.5 * regret[:1000].mean()


def near_equal(c, a, t):
    return 1.0 if a == "ar" else 1.01   # within noise of each other


@pytest.mark.parametrize("growth", [1.0, 2.0])
def test_switching_cost_suppresses_thrashing(growth):
    T = 4000 if growth == 1.0 else 20000   # (no blocks: a decision every step, slower)
    def switches(cost):
        out = []
        for seed in range(3):
            b = ContextualBandit(["ar", "sd"], seed=seed, switch_cost=cost, block_growth=growth)
            simulate(b, near_equal, T, noise=0.2, seed=seed)
            out.append(b.switches)
        return np.mean(out)

    free = switches(None)
    costly = switches(lambda a, b: 5.0 if a != b else 0.0)
    if growth == 1.0:         # no blocks: plain UCB flips whenever the two indices cross
        assert free > 150
        assert costly < free / 10
    else:                     # blocks alone keep switches O(log T); the cost halves them again
        assert costly < free / 2
    # blocks alone already keep a growing-block bandit far below one switch per step
    assert free < T / 5


def _speculating_at_batch_8(seed: int = 0) -> tuple[Planner, float]:
    """A planner that has settled on sd:2, measured 8 % cheaper a token than plain decoding at
    batch 8 (4.4 ms for 8 tokens against 8.1 ms for 16), with a catch-up of 50 us a token."""
    # without the policy check: at batch 8 one of its trials of plain decoding may be under way
    # when the 400 steps end (tests/test_policy_check.py tests it)
    p = Planner(PlannerConfig(modes=("ar", "sd"), rebuild_s_per_token=5e-5, policy_check=False), gamma_max=2,
                psd_available=False, seed=seed)
    rng, t = np.random.default_rng(seed), 0.0
    cost = {AR: (0.0044, 8), Decision("sd", 1): (0.0064, 11), Decision("sd", 2): (0.0081, 16)}
    for _ in range(400):
        t += 0.01
        d = p.decide(LoadSignals(batch_size=8, drafter_lag_tokens=0, now=t))
        wall, tokens = cost[d]
        p.observe(d, StepOutcome(step_wall_s=wall * (1 + 0.02 * rng.standard_normal()),
                                 tokens_committed=tokens, batch_size=8))
    return p, t


def test_after_an_idle_engine_plain_decoding_is_current_and_speculating_pays_the_new_prompts_catch_up():
    """A step with nothing running only feeds prompts: it runs plain, and after it plain
    decoding is current, not the arm that ran before the engine idled. Speculating then pays
    the drafter's catch-up of the new prompts as a turn-on: where that outweighs what
    speculation saves, plain decoding runs; where the catch-up is small, speculation does."""
    for lag, expected in ((8000, AR), (16, Decision("sd", 2))):
        p, t = _speculating_at_batch_8()
        assert p.current == Decision("sd", 2)
        assert p.decide(LoadSignals(batch_size=0, waiting=8, now=t + 1.0)) == AR
        assert p.bandit.current == AR.arm
        # the next step: 8 new sequences, whose prompts (`lag` tokens) the drafter has not seen
        assert p.decide(LoadSignals(batch_size=8, drafter_lag_tokens=lag, now=t + 1.01)) == expected, lag
    # While the same arm keeps running, the same lag does not move it (nothing to turn on).
    p, t = _speculating_at_batch_8()
    assert p.decide(LoadSignals(batch_size=8, drafter_lag_tokens=8000, now=t + 0.01)) == Decision("sd", 2)


def test_a_block_held_for_another_arm_does_not_resume_once_an_arm_is_assumed_current():
    """After the engine idled plain decoding runs whatever the bandit chose last: a speculative
    block still held in the bin does not go on from there, the next choice is made afresh and
    pays the switch back to speculation."""
    def held_sd_block():
        turn_on = [0.0]
        b = ContextualBandit(["ar", "sd"], seed=0, initial_block=64, max_block=64,
                             switch_cost=lambda a, c: turn_on[0] if (a, c) == ("ar", "sd") else 0.0)
        for t in range(40):       # ar measured, then sd played in a long block, still held
            a = b.select(0, allowed=["ar"] if t < 20 else ["sd"])
            b.update(0, a, 1.05 if a == "ar" else 1.0)
        assert b.current == "sd" and b._bin(0).block_left > 0
        turn_on[0] = 50.0         # from now on turning the drafter on costs
        return b
    running = held_sd_block()
    assert running.select(0) == "sd"
    idle = held_sd_block()
    idle.assume_current("ar")
    assert idle.select(0) == "ar"


def test_bandit_block_lengths_grow_in_a_context():
    lengths = []

    class Recording(ContextualBandit):
        def _block_len(self, b, i):
            n = super()._block_len(b, i)
            lengths.append((self.arms[i], n))
            return n

    b = Recording(["a", "b"], seed=0, max_block=64)
    f = lambda c, a, t: 1.0 if a == "a" else 1.3   # noqa: E731
    simulate(b, f, 3000, noise=0.05)
    a_blocks = [n for a, n in lengths if a == "a"]
    assert a_blocks[0] <= 2 and a_blocks[-1] == 64             # explore early, settle later
    assert a_blocks[:6] == sorted(a_blocks[:6])                 # growing (doubling) blocks
    assert len(lengths) < 3000 / 20                             # a decision only at block ends
    assert max(n for a, n in lengths if a == "b") <= 16         # the bad arm: short probes


@pytest.mark.parametrize("seed", range(5))
def test_bandit_readapts_when_the_incumbent_gets_worse(seed):
    f = lambda c, a, t: 1.0 + 0.15 * abs(a - (1 if t < 6000 else 4))   # noqa: E731
    b = ContextualBandit(ARMS6, seed=seed)
    played, _ = simulate(b, f, 8000, seed=seed)
    after = np.array(played[6000:]) == 4
    follow = next(i for i in range(len(after) - 100) if after[i:i + 100].mean() >= 0.9)
    assert follow <= 300, follow
    assert b.shifts >= 1


@pytest.mark.parametrize("seed", range(3))
def test_bandit_finds_an_arm_that_improved_while_unplayed(seed):
    # the incumbent does not change, so only discounting (re-probing) can find the new best
    f = lambda c, a, t: 1.0 + 0.15 * abs(a - 1) - (0.6 if (a == 4 and t >= 5000) else 0.0)  # noqa
    b = ContextualBandit(ARMS6, seed=seed)
    played, _ = simulate(b, f, 15000, seed=seed)
    after = np.array(played[5000:]) == 4
    follow = next(i for i in range(0, len(after) - 100, 10) if after[i:i + 100].mean() >= 0.9)
    assert follow <= 6000, follow
    assert after[-2000:].mean() > 0.9


def test_stale_context_is_reexplored():
    b = ContextualBandit(ARMS6, seed=0, stale_after=1000)
    simulate(b, two_contexts, 3000, context=lambda t: 0)
    simulate(b, two_contexts, 2000, context=lambda t: 1)
    assert b.stale_resets == 0
    simulate(b, two_contexts, 10, context=lambda t: 0)
    assert b.stale_resets == 1


def test_prior_warm_start_reduces_regret_and_survives_a_wrong_scale():
    f = lambda c, a, t: 1.0 + 0.15 * abs(a - 3)           # noqa: E731
    totals = {}
    for name, prior in (("none", None), ("good", lambda c, a: f(c, a, 0)),
                        ("scaled", lambda c, a: 3.0 * f(c, a, 0))):   # right ordering, wrong scale
        r = []
        for seed in range(3):
            b = ContextualBandit(ARMS6, seed=seed, prior=prior)
            played, regret = simulate(b, f, 3000, seed=seed)
            assert b.best(0) == 3
            r.append(regret.sum())
        totals[name] = np.mean(r)
    assert totals["good"] < totals["none"]
    assert totals["scaled"] < totals["none"]


def test_a_prior_that_misses_one_modes_cost_is_corrected_for_all_its_gammas():
    """The prior ranks the four speculative arms ahead of plain decoding; measured, each costs
    1.9x what it predicts, and plain decoding (measured first, as the engine starts with it) costs
    what it predicts. Calibrated per mode (the planner's grouping), the first measured speculative
    arm corrects its siblings; with one calibration over all arms, plain decoding's exact
    measurements pull the ratio back towards 1 and each sibling is played before it is believed."""
    arms = [("ar", 0)] + [("sd", g) for g in (1, 2, 3, 4)]
    predicted = lambda c, a: 1.0 if a[0] == "ar" else 0.8 + 0.01 * a[1]      # noqa: E731
    true = lambda c, a, t: 1.0 if a[0] == "ar" else 1.9 * predicted(c, a)     # noqa: E731
    spec_steps, tried = {}, {}
    for grouped in (False, True):
        steps, arms_tried = [], []
        for seed in range(3):
            b = ContextualBandit(arms, seed=seed, prior=predicted,
                                 prior_group=(lambda a: a[0]) if grouped else None)
            for _ in range(10):
                b.update(0, ("ar", 0), 1.0)
            played, _ = simulate(b, true, 400, seed=seed)
            steps.append(sum(a[0] == "sd" for a in played))
            arms_tried.append(len({a for a in played if a[0] == "sd"}))
            assert b.best(0) == ("ar", 0)
        spec_steps[grouped], tried[grouped] = np.mean(steps), np.mean(arms_tried)
    assert tried[False] == 4 and tried[True] < 2, tried
    assert spec_steps[True] <= 0.5 * spec_steps[False], spec_steps


SD8 = [("ar", 0)] + [("sd", g) for g in range(1, 9)]


def unimodal_sd(best_gamma):
    """Plain decoding at 1.0, sequential SD's per-token cost falling to 0.7 at `best_gamma`
    and rising 4 % a gamma on either side of it."""
    return lambda c, a, t: 1.0 if a[0] == "ar" else 0.7 * (1.0 + 0.04 * abs(a[1] - best_gamma))


@pytest.mark.parametrize("seed", range(3))
def test_unimodal_groups_explore_a_modes_gammas_around_its_best(seed):
    """With a prior that ranks the eight SD gammas well, a bare bandit still tries nearly all of
    them (their priors are within its confidence width); walking from the leader, the planner's
    bandit tries the best gamma and a few beside it, and loses less on the way."""
    truth = unimodal_sd(3)
    tried, regret = {}, {}
    for unimodal in (False, True):
        b = ContextualBandit(SD8, seed=seed, prior=lambda c, a: truth(c, a, 0), prior_group=lambda a: a[0],
                             unimodal=unimodal, min_hold=4, hysteresis=0.03)
        played, steps_regret = simulate(b, truth, 200, seed=seed)
        tried[unimodal] = {a for a in played if a[0] == "sd"}
        regret[unimodal] = steps_regret.sum()
        assert b.best(0) == ("sd", 3)
    assert len(tried[False]) >= 6 and len(tried[True]) <= 4, tried
    assert tried[True] <= {("sd", g) for g in (2, 3, 4, 5)}
    assert regret[True] < 0.85 * regret[False], regret


@pytest.mark.parametrize("seed", range(3))
def test_unimodal_groups_walk_off_a_wrong_prior_to_the_best_gamma(seed):
    """The prior puts the best gamma at 8; the truth at 2. One gamma at a time, the leader walks
    down to 2, and the tail plays it and its neighbours (4 % dearer, within the noise)."""
    truth = unimodal_sd(2)
    wrong = lambda c, a: 1.0 if a[0] == "ar" else 0.7 * (1.0 + 0.04 * (8 - a[1]))  # noqa: E731
    b = ContextualBandit(SD8, seed=seed, prior=wrong, prior_group=lambda a: a[0], unimodal=True,
                         min_hold=4, hysteresis=0.03)
    played, _ = simulate(b, truth, 1500, seed=seed)
    assert b.best(0) == ("sd", 2)
    near = {("sd", g) for g in (1, 2, 3)}
    assert np.mean([a in near for a in played[-500:]]) > 0.9, Counter(played[-500:]).most_common(3)


def test_the_bandit_reads_the_prior_again_only_when_its_inputs_change():
    """A decision reads every arm's prior; with ``prior_inputs`` a bin reads it once per change
    of those inputs and otherwise decides exactly as a bandit that reads it every time."""
    f = lambda c, a, t: 1.0 + 0.15 * abs(a - 3)           # noqa: E731
    reads, inputs = [], {"alpha": 0.6}
    def prior(c, a):
        reads.append(a)
        return f(c, a, 0) * (1.0 + inputs["alpha"])
    played = {}
    for cached in (False, True):
        reads.clear()
        inputs["alpha"] = 0.6
        b = ContextualBandit(ARMS6, seed=0, prior=prior,
                             prior_inputs=(lambda: inputs["alpha"]) if cached else None)
        first, _ = simulate(b, f, 300, seed=0)
        reads_before_change = len(reads)
        inputs["alpha"] = 0.7                              # what the prior is computed from moved
        second, _ = simulate(b, f, 300, seed=1)
        played[cached] = first + second
        if cached:
            assert reads_before_change == len(ARMS6)       # one reading for all its decisions
            assert len(reads) == 2 * len(ARMS6)           # and one more after the change
        else:
            assert reads_before_change > 5 * len(ARMS6)
    assert played[True] == played[False]


def test_a_few_rejected_drafts_at_batch_1_leave_the_acceptance_near_its_prior():
    """At batch 1 one step is one sequence's luck: four steps whose first drafts were all
    rejected do not set the acceptance near 0 (the prior weighs 8 sequences), where the prior
    would rank every drafter arm last; one step of 64 sequences outweighs the prior."""
    from planner.acceptance import AcceptanceEstimate
    unlucky = AcceptanceEstimate(0.6)
    for _ in range(4):
        unlucky.observe_step(2, 1, 1)
    assert 0.3 < unlucky.alpha() < 0.6
    large = AcceptanceEstimate(0.6)
    large.observe_step(2, round(64 * expected_tokens_per_call(0.9, 2)), 64)
    assert large.alpha() > 0.85


@pytest.mark.parametrize("rejected", [4, 6])
def test_a_few_rejected_drafts_at_batch_1_do_not_rank_speculation_below_plain_decoding(rejected):
    """At batch 1 SD at gamma 2-4 costs about 0.7x plain decoding a token here, but a step's
    tokens are one sequence's luck: with the first drafts all rejected, scored as they came,
    speculation looked dearer than plain decoding and some seeds never drafted again. Scored
    shrunk towards the gamma's estimate, every seed speculates on most steps after that start."""
    shares = [speculative_share_at_batch_1(seed, rejected) for seed in range(12)]
    assert min(shares) > 0.5, shares


@pytest.mark.parametrize("prompted, prompt_tokens", [(2, 150), (3, 100)])
def test_prompts_fed_before_the_forwards_line_is_fitted_do_not_set_speculations_level(
        prompted, prompt_tokens):
    """An engine's first speculative steps may feed a joining request's prompt (in the warm-up,
    at concurrency 1); before the forward's cost line is fitted (16 steps) the prompt's share of
    the step cannot be taken off, and charged to the arm it made speculation look dearer than
    plain decoding, where at batch 1 SD costs about 0.7x a token: some engines never drafted
    again. Counted as played, not measured, those steps leave every seed speculating."""
    shares = [speculative_share_at_batch_1(seed, 0, prompted=prompted, prompt_tokens=prompt_tokens)
              for seed in range(12)]
    assert min(shares) > 0.5, shares


def test_a_step_with_prompts_before_the_line_is_fitted_is_played_not_measured():
    """The arm that ran such a step is counted as played and keeps no sample of its time; once
    the line is fitted, a step with prompts is measured with their share taken off."""
    p = Planner(gamma_max=4, psd_available=False, seed=0,
                cost_profile=CostProfile({(1, n): 0.004 + 0.0001 * n for n in range(1, 6)},
                                         {1: 0.001}))
    sd2 = Decision(Mode.SD, 2)
    first = StepOutcome(step_wall_s=0.03, tokens_committed=3, batch_size=1, prefill_tokens=150,
                        forward_tokens=153, forward_s=0.02)
    p.decide(LoadSignals(batch_size=1))
    p.observe(sd2, first)
    assert p.bandit.context_stats("b1").plays == {sd2.arm: 1}
    assert sd2.arm not in p.bandit.measured("b1")
    for i in range(30):              # the line learns from every step's forward past the turn-off's
        p.decide(LoadSignals(batch_size=1))
        p.observe(AR, StepOutcome(step_wall_s=0.005 + 0.0001 * i, tokens_committed=1,
                                  batch_size=1, forward_tokens=1 + 10 * i,
                                  forward_s=0.004 + 0.0001 * (1 + 10 * i)))
    assert p.forward_cost.seconds_per_token is not None
    p.decide(LoadSignals(batch_size=1))
    p.observe(sd2, first)
    loss, evidence = p.bandit.measured("b1")[sd2.arm]
    whole = 0.03 / p._acceptance.expected_tokens(2, 3, 1)      # the step's time, per scored token
    assert evidence > 0 and 0.4 * whole < loss < 0.6 * whole     # half of it was the prompt's


def test_psd_steps_measure_the_acceptance_when_their_drafts_were_made_at_their_gamma():
    """A PSD step verifies drafts made the step before: consecutive steps of one PSD arm measure
    the acceptance (so that it, and the pruner's guard on it, follow the text while the planner
    plays PSD alone); a PSD step after another arm does not (its drafts had another gamma)."""
    def run(arms):
        p = Planner(gamma_max=4, psd_available=True, seed=0)
        for k in range(24):
            d = Decision(*arms[k % len(arms)])
            tokens = round(8 * expected_tokens_per_call(0.95, d.gamma))
            p.observe(d, StepOutcome(step_wall_s=0.01, tokens_committed=tokens, batch_size=8))
        return p.alpha_estimate()
    assert run([("psd", 3)]) > 0.85
    assert run([("psd", 2), ("psd", 3)]) == pytest.approx(0.6)


def test_the_acceptance_is_inverted_again_only_for_the_gamma_that_moved(monkeypatch):
    import planner.acceptance as acceptance
    inverted = []
    real = acceptance.alpha_for_tokens_per_call
    monkeypatch.setattr(acceptance, "alpha_for_tokens_per_call",
                        lambda e, g: inverted.append(g) or real(e, g))
    est = acceptance.AcceptanceEstimate(0.6)
    for g in (2, 4):
        for _ in range(8):
            est.observe_step(g, 3 * expected_tokens_per_call(0.7, g), 3)
    est.alpha()
    assert sorted(inverted) == [2, 4]
    for _ in range(8):
        est.observe_step(4, 3 * expected_tokens_per_call(0.5, 4), 3)
    inverted.clear()
    alpha = est.alpha()
    assert inverted == [4]
    expected = (real(est._e_hat[2], 2) + real(est._e_hat[4], 4)) / 2
    assert alpha == pytest.approx(expected, rel=1e-12)


def test_a_decision_prices_the_drafters_turn_on_once_for_all_its_arms(monkeypatch):
    """The turn-on's cost is the same for every drafter arm: a decision after plain decoding
    estimates it once, not once per arm the bandit weighs."""
    p = Planner(gamma_max=8, psd_available=True, cost_profile=profile(), seed=0)
    eng = FakeEngine(p, seed=0)
    estimates = []
    real = p.estimated_switch_cost_s
    monkeypatch.setattr(p, "estimated_switch_cost_s", lambda *a: estimates.append(1) or real(*a))
    decisions = 0
    for _ in range(4):
        for _ in range(50):
            eng.step(96)                               # plain decoding: the drafter falls behind
        for _ in range(100):
            before = len(estimates)
            eng.step(2)
            assert len(estimates) - before <= 1
            decisions += len(estimates) > before
    assert decisions >= 3 and p.mode_switches >= 1     # it was asked, and it did switch


def test_min_hold_spaces_switches():
    b = ContextualBandit(ARMS6, seed=0, min_hold=8, block_growth=1.0)
    played, _ = simulate(b, two_contexts, 3000, context=lambda t: (t // 3) % 2)
    idx = [t for t in range(1, len(played)) if played[t] != played[t - 1]]
    assert idx and min(np.diff(idx)) >= 8


def test_bandit_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ContextualBandit([])
    with pytest.raises(ValueError):
        ContextualBandit(["a", "a"])
    with pytest.raises(ValueError):
        ContextualBandit(["a"], initial_block=0)
    with pytest.raises(ValueError):
        ContextualBandit(["a"], discount=0.0)



def test_bandit_means_are_the_discounted_sums_through_every_rescale(monkeypatch):
    # A bin keeps its sums divided by the discount applied since its last rescale; rescaling
    # every few steps here (the threshold raised) must not move what it reports.
    from planner import bandit as bandit_module
    monkeypatch.setattr(bandit_module._Bin, "_MIN_SCALE", 0.99)
    arms, d = ["a", "b", "c"], 0.97
    b = ContextualBandit(arms, discount=d, detect_min_n=10 ** 9, seed=0)
    rng = np.random.default_rng(0)
    n, s = {a: 0.0 for a in arms}, {a: 0.0 for a in arms}
    for step in range(300):
        arm, loss, w = arms[step % 3 if step < 150 else 0], float(rng.uniform(1, 2)), float(rng.uniform(0.5, 2))
        b.update("ctx", arm, loss, w)
        for a in arms:
            n[a], s[a] = n[a] * d, s[a] * d
        n[arm], s[arm] = n[arm] + w, s[arm] + w * loss
    measured = b.measured("ctx")
    assert set(measured) == set(arms)
    for a in arms:
        assert measured[a][0] == pytest.approx(s[a] / n[a], rel=1e-12)
        assert measured[a][1] == pytest.approx(n[a], rel=1e-12)
    assert measured["b"][1] < measured["a"][1] / 10      # 150 steps of discount on b's evidence

# ---------------------------------------------------------------------------------------------
# planner on a synthetic engine: verification compute grows with b * (gamma + 1), so speculation
# wins when the target is idle (small batches) and loses when it is busy (large batches)

ALPHA = 0.7
C0, C1, D0, D1 = 0.020, 0.0006, 0.002, 0.00005


def t_verify(b, n):
    return C0 + C1 * b * n


def t_draft(b):
    return D0 + D1 * b


def true_step(mode, gamma, b):
    """(wall seconds, expected tokens, sequences advanced) of one step."""
    if mode == "psd" and b < 2:
        mode = "sd"
    if mode == "ar":
        return t_verify(b, 1), b, b
    e = expected_tokens_per_call(ALPHA, gamma)
    if mode == "sd":
        return gamma * t_draft(b) + t_verify(b, gamma + 1), b * e, b
    h = int(np.ceil(b / 2))
    return max(gamma * t_draft(b / 2), t_verify(h, gamma + 1)), h * e, h


def profile() -> CostProfile:
    bs = [1, 2, 4, 8, 16, 32, 64, 128]
    return CostProfile({(b, n): t_verify(b, n) for b in bs for n in range(1, 8)},
                       {b: t_draft(b) for b in bs})


class FakeEngine:
    """Runs the planner's decisions on the synthetic costs, with sampled acceptances, noisy step
    times, a drafter catch-up that costs `rebuild_per_token` per token it missed (at most 200 per
    running sequence), and an optional offload/reload of the drafter."""

    def __init__(self, planner, seed=0, noise=0.1, rebuild_per_token=2e-5, reload_s=0.5):
        self.p, self.rng, self.noise = planner, np.random.default_rng(seed), noise
        self.rebuild_per_token, self.reload_s = rebuild_per_token, reload_s
        self.t, self.lag, self.offloaded = 0.0, 0, False
        self.offloads = 0

    def step(self, batch, waiting=0, kv_usage=0.3):
        s = LoadSignals(batch_size=batch, waiting=waiting, kv_usage=kv_usage, now=self.t,
                        drafter_offloaded=self.offloaded)
        d = self.p.decide(s)
        wall, tokens, nseq = true_step(d.mode, d.gamma, batch)
        wall *= 1.0 + self.noise * self.rng.standard_normal()
        if d.mode != "ar":
            acc = np.minimum(self.rng.geometric(1 - ALPHA, size=nseq) - 1, d.gamma)
            tokens = int((acc + 1).sum())
        rebuild = reload = 0.0
        if d.mode == "ar":
            self.lag = min(self.lag + tokens, 200 * batch)
        else:
            if self.offloaded:
                reload, self.offloaded = self.reload_s, False
            rebuild, self.lag = self.rebuild_per_token * self.lag, 0
        self.p.observe(d, StepOutcome(step_wall_s=wall + rebuild, tokens_committed=int(tokens),
                       drafter_rebuild_s=rebuild, drafter_reload_s=reload, batch_size=nseq))
        if d.mode == "ar" and not self.offloaded and self.p.wants_offload(s):
            self.offloaded = True
            self.offloads += 1
        self.t += wall + rebuild
        return d, wall + rebuild, tokens


def best_arm(b, arms):
    return min(arms, key=lambda a: true_step(a[0], a[1], b)[0] / true_step(a[0], a[1], b)[1])


def test_synthetic_environment_has_the_real_life_shape():
    arms = [("ar", 0)] + [(m, g) for m in ("sd", "psd") for g in range(1, 7)]
    assert best_arm(2, arms)[0] != "ar"
    assert best_arm(96, arms) == ("ar", 0)


@pytest.mark.parametrize("with_profile", [False, True])
def test_planner_follows_the_batch_size(with_profile):
    p = Planner(gamma_max=6, psd_available=True, cost_profile=profile() if with_profile else None,
                seed=0)
    eng = FakeEngine(p, seed=0)
    rng = np.random.default_rng(1)
    phases = [(2, 2500), (96, 2500), (2, 2500)]
    for k, (b, n) in enumerate(phases):
        decisions, wall, tokens, oracle = [], 0.0, 0, 0.0
        for i in range(n):
            bb = max(1, b + int(rng.integers(-(b // 4), b // 4 + 1)))
            d, w, tok = eng.step(bb)
            decisions.append(d)
            wall += w
            tokens += tok
            a = best_arm(bb, p.arms)
            oracle += true_step(*a, bb)[0] / true_step(*a, bb)[1]
        tail = decisions[-1000:]
        spec = np.mean([d.speculative for d in tail])
        if b == 2:
            assert spec > 0.9, (k, spec)
        else:
            assert spec < 0.1, (k, spec)
        # achieved per-token latency within 10 % of the per-step oracle over the whole phase
        assert (wall / tokens) < 1.1 * oracle / n, (k, wall / tokens, oracle / n)
    st = p.stats()
    assert st["mode_switches"] < 60
    assert st["switches"] < 400
    assert set(st["per_context"]) >= {"b2-3", "b64-127"}
    assert st["per_context"]["b64-127"]["best"] == "ar"
    assert st["per_context"]["b2-3"]["best"].startswith(("sd", "psd"))
    assert abs(st["alpha_estimate"] - ALPHA) < 0.08


def test_planner_measures_the_switching_cost_and_charges_it():
    p = Planner(gamma_max=4, psd_available=False, seed=0)
    assert p.stats()["switch_cost"]["rebuild_s_per_token"] is None   # nothing assumed
    eng = FakeEngine(p, seed=0, rebuild_per_token=3e-5)
    for b in [96] * 600 + [2] * 600:
        eng.step(b)
    sc = p.stats()["switch_cost"]
    assert sc["rebuild_samples"] >= 1
    # the engine's lag is capped at 200 tokens per sequence and so is the planner's estimate
    assert sc["rebuild_s_per_token"] == pytest.approx(3e-5, rel=0.35)

    # a bin on the border: AR and SD nearly equal; an expensive catch-up makes it stick to one
    def mode_switches(rebuild):
        p = Planner(gamma_max=3, psd_available=False, seed=0)
        eng = FakeEngine(p, seed=0, rebuild_per_token=rebuild)
        rng = np.random.default_rng(0)
        for _ in range(6000):
            eng.step(int(rng.integers(40, 64)))
        return p.stats()["mode_switches"]

    assert mode_switches(1e-3) < mode_switches(0.0)


def test_wall_time_without_the_catchup_is_the_arms_loss():
    p = Planner(PlannerConfig.from_dict({"initial_block": 1}), gamma_max=2, psd_available=False,
                seed=0)
    s = LoadSignals(batch_size=4, now=0.0)
    d = Decision("sd", 2)
    p.decide(s)
    p.observe(d, StepOutcome(step_wall_s=1.0, tokens_committed=10, drafter_rebuild_s=0.9, batch_size=4))
    mean, _ = p.bandit.means("b4-7")[("sd", 2)]
    # its 10 tokens as scored: shrunk towards 4 sequences' yield at the prior (4 sequences' weight)
    scored = 4 * (10 + 4 * expected_tokens_per_call(0.6, 2)) / (4 + 4)
    assert mean == pytest.approx(0.1 / scored * p.bins.norm("b4-7", 4))


def test_a_step_that_fed_only_prompts_is_no_arms_sample():
    """Its time is nearly all prefill; scored, it lands on plain decoding (what ran, since nothing
    was drafted) as a loss far above plain decoding's own, and steers the bandit to speculate."""
    p = Planner(PlannerConfig.from_dict({"initial_block": 1}), gamma_max=2, psd_available=False,
                seed=0)
    s = LoadSignals(batch_size=4, now=0.0)
    for fed in range(4, 24):        # enough points for the forward's cost line to be fitted
        p.decide(s)
        p.observe(AR, StepOutcome(step_wall_s=0.01, tokens_committed=4, batch_size=4, forward_tokens=fed,
                                  forward_s=0.005 + 0.001 * fed))
    before = p.bandit.means("b4-7")[AR.arm]
    fitted = p.forward_cost.seconds_per_token
    p.decide(s)
    p.observe(Decision("sd", 2), StepOutcome(step_wall_s=0.5, tokens_committed=4, batch_size=4, ran=AR,
                                             prefill_tokens=400, forward_tokens=400, forward_s=0.45,
                                             decoded=False))
    assert p.bandit.means("b4-7")[AR.arm] == before
    assert fitted is not None and p.forward_cost.seconds_per_token != fitted, \
        "the forward's cost line did not learn from it"


def test_the_drafters_memory_moving_before_a_step_is_not_the_arms_cost():
    """An offload (the drafter's weights out, the KV pool grown: a copy of the pool) runs
    before the plain step that follows it and inside its wall time; it is taken off."""
    p = Planner(PlannerConfig.from_dict({"initial_block": 1}), gamma_max=2, psd_available=False,
                seed=0)
    s = LoadSignals(batch_size=4, now=0.0)
    for _ in range(20):
        p.decide(s)
        p.observe(AR, StepOutcome(step_wall_s=0.01, tokens_committed=4, batch_size=4))
    before = p.bandit.means("b4-7")[AR.arm][0]
    p.decide(s)
    p.observe(AR, StepOutcome(step_wall_s=0.31, tokens_committed=4, batch_size=4, memory_s=0.3))
    assert p.bandit.means("b4-7")[AR.arm][0] == pytest.approx(before)


def test_wants_offload_only_after_sustained_ar_under_memory_pressure():
    p = Planner(PlannerConfig(offload_after_steps=50, offload_after_s=0.5), gamma_max=3,
                psd_available=False, seed=0)
    eng = FakeEngine(p, seed=0)
    for _ in range(300):                 # small batch: speculation, never offload
        eng.step(2, waiting=3, kv_usage=0.95)
        assert not p.wants_offload(LoadSignals(batch_size=2, waiting=3, kv_usage=0.95, now=eng.t))
    # large batch, no memory pressure: gamma = 0 but nothing to gain from offloading
    for _ in range(400):
        eng.step(96, waiting=0, kv_usage=0.5)
    assert p.current == AR
    assert not p.wants_offload(LoadSignals(batch_size=96, waiting=0, kv_usage=0.5, now=eng.t))
    assert eng.offloads == 0
    # pressure (requests waiting) -> yes; and (kv usage above threshold) -> yes
    assert p.wants_offload(LoadSignals(batch_size=96, waiting=5, kv_usage=0.5, now=eng.t))
    assert p.wants_offload(LoadSignals(batch_size=96, waiting=0, kv_usage=0.97, now=eng.t))
    # not sustained: a fresh gamma = 0 run under pressure is not enough
    q = Planner(PlannerConfig(modes=("ar",), offload_after_steps=50, offload_after_s=0.5),
                gamma_max=3, psd_available=False, seed=0)
    for i in range(49):
        q.decide(LoadSignals(batch_size=8, waiting=5, now=i * 0.1))
        assert not q.wants_offload(LoadSignals(batch_size=8, waiting=5, now=i * 0.1))
    q.decide(LoadSignals(batch_size=8, waiting=5, now=4.9))
    assert q.wants_offload(LoadSignals(batch_size=8, waiting=5, now=4.9))
    # steps alone are not enough either: the seconds must have passed too
    r = Planner(PlannerConfig(modes=("ar",), offload_after_steps=10, offload_after_s=5.0),
                gamma_max=3, psd_available=False, seed=0)
    for i in range(100):
        r.decide(LoadSignals(batch_size=8, waiting=5, now=i * 0.01))
    assert not r.wants_offload(LoadSignals(batch_size=8, waiting=5, now=0.99))
    r.decide(LoadSignals(batch_size=8, waiting=5, now=5.5))
    assert r.wants_offload(LoadSignals(batch_size=8, waiting=5, now=5.5))


def test_offload_and_reload_feed_the_switch_cost():
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0), gamma_max=3,
                psd_available=False, seed=0)
    eng = FakeEngine(p, seed=0, reload_s=0.4)
    for _ in range(500):
        eng.step(96, waiting=4)
    assert eng.offloads == 1 and p.drafter_offloaded
    assert p.stats()["offload_requests"] == 1
    for _ in range(1500):
        eng.step(2)
    sc = p.stats()["switch_cost"]
    assert sc["reload_samples"] == 1 and sc["reload_s"] == pytest.approx(0.4)
    assert not p.drafter_offloaded
    spec = [eng.step(2)[0].speculative for _ in range(300)]
    assert np.mean(spec) > 0.9


def test_arms_and_decisions():
    p = Planner(gamma_max=3, psd_available=False)
    assert p.arms == [("ar", 0), ("sd", 1), ("sd", 2), ("sd", 3)]
    q = Planner(gamma_max=2, psd_available=True)
    assert q.arms == [("ar", 0), ("sd", 1), ("sd", 2), ("psd", 1), ("psd", 2)]
    assert Planner(gamma_max=0, psd_available=True).arms == [("ar", 0)]
    with pytest.raises(ValueError):
        Decision("sd", 0)
    with pytest.raises(ValueError):
        Decision("ar", 2)
    with pytest.raises(ValueError):
        Decision("fast", 1)
    assert str(Decision("psd", 3)) == "psd:3" and AR.gamma == 0
    assert batch_bin(1) == (1, 1) and batch_bin(5) == (4, 7) and batch_bin(64) == (64, 127)


def test_waiting_queue_context_bins():
    p = Planner(PlannerConfig(context_bins="batch_waiting"), gamma_max=2, psd_available=False)
    for w in (0, 2, 9):
        d = p.decide(LoadSignals(batch_size=5, waiting=w, now=0.0))
        p.observe(d, StepOutcome(step_wall_s=0.01, tokens_committed=5, batch_size=5))
    assert set(p.stats()["per_context"]) == {"b4-7|w0", "b4-7|w1-3", "b4-7|w4-15"}
    q = Planner(PlannerConfig(context_bins=lambda s: s.batch_size > 10), gamma_max=2,
                psd_available=False)
    q.decide(LoadSignals(batch_size=30))
    assert list(q.stats()["per_context"]) == ["True"]


def test_stats_and_bounded_timeline():
    p = Planner(PlannerConfig(timeline_max=64, timeline_every=5), gamma_max=3, psd_available=True,
                seed=0)
    eng = FakeEngine(p, seed=0)
    for i in range(3000):
        eng.step(2 if (i // 500) % 2 == 0 else 96)
    st = p.stats()
    for key in ("switches", "mode_switches", "per_context", "arm_counts", "timeline", "switch_cost",
                "offload_requests", "alpha_estimate", "current"):
        assert key in st
    tl = st["timeline"]
    assert 16 <= len(tl) <= 64
    assert tl[0][1] == 1 and tl[-1][1] > 2500          # still covers the whole run
    assert all(len(e) == 5 and e[2] in ("ar", "sd", "psd") for e in tl)
    assert [e[1] for e in tl] == sorted(e[1] for e in tl)
    assert sum(st["arm_counts"].values()) == 3000
    assert st["switches"] >= st["mode_switches"] >= 5


def test_stats_report_the_bandit_through_its_public_api():
    p = Planner(gamma_max=3, psd_available=True, seed=0)
    eng = FakeEngine(p, seed=0)
    for i in range(1200):
        eng.step(2 if i < 600 else 96)
    assert p.switches == p.bandit.switches == p.summary()["switches"] > 0
    st = p.stats()
    for ctx in p.bandit.contexts:
        cs = p.bandit.context_stats(ctx)
        assert cs.best == p.bandit.best(ctx) and cs.means == p.bandit.means(ctx)
        per = st["per_context"][str(ctx)]
        assert per["steps"] == cs.steps == sum(cs.plays.values())
        assert per["best"] == str(Decision(*cs.best)) and per["held"] == str(Decision(*cs.held))
        assert per["mean_loss"] == {str(Decision(*a)): m for a, (m, _) in cs.means.items()}
    assert p.bandit.context_stats("never seen") is None


def test_timeline_times_count_from_the_first_decision():
    p = Planner(PlannerConfig(timeline_every=1), gamma_max=2, psd_available=False, seed=0)
    for i in range(5):
        d = p.decide(LoadSignals(batch_size=4, now=0.5 * i))     # the first decision at t = 0
        p.observe(d, StepOutcome(step_wall_s=0.01, tokens_committed=4, batch_size=4))
    assert [(t, step) for t, step, *_ in p.timeline()] == [(0.5 * i, i + 1) for i in range(5)]


def test_planner_config_from_engine_json():
    # engine.json's flat "planner" object: the planner's keys and the bandit's side by side
    cfg = PlannerConfig.from_dict({"offload_after_steps": 3, "kv_pressure": 0.5, "explore": 1,
                                   "min_hold_steps": 2, "stale_after": 100, "modes": ["ar", "sd"]})
    assert (cfg.offload_after_steps, cfg.kv_pressure, cfg.modes) == (3, 0.5, ("ar", "sd"))
    assert (cfg.bandit.explore, cfg.bandit.min_hold, cfg.bandit.stale_after) == (1.0, 2, 100)
    assert isinstance(cfg.bandit.explore, float)
    assert cfg.bandit.hysteresis == 0.03            # the planner's default, not the bandit's
    assert cfg.bandit.unimodal                      # likewise
    assert not PlannerConfig.from_dict({"unimodal": False}).bandit.unimodal
    assert PlannerConfig.from_dict(cfg.to_dict()) == cfg
    assert PlannerConfig.from_dict(None) == PlannerConfig.from_dict({}) == PlannerConfig()
    keys = PlannerConfig.known_keys()
    assert {"offload_after_steps", "kv_pressure", "explore", "min_hold_steps", "stale_after",
            "detect_rel", "timeline_every"} <= set(keys)
    assert not {"min_hold", "bandit", "seed", "gamma_max", "psd_available", "clock"} & set(keys)
    with pytest.raises(TypeError, match="PlannerConfig.from_dict"):
        Planner({"kv_pressure": 0.5}, gamma_max=2, psd_available=False)


@pytest.mark.parametrize("settings, message", [
    ({"offload_after_stepz": 3},
     r"unknown setting\(s\) \['offload_after_stepz'\]; known: \[.*'kv_pressure'"),
    ({"kv_pressure": 1.5}, r"^kv_pressure: must be in \(0, 1\], got 1.5$"),
    ({"kv_pressure": "0.9"}, r"^kv_pressure: must be a finite number"),
    ({"offload_after_steps": 0}, r"^offload_after_steps: must be >= 1, got 0$"),
    ({"offload_after_steps": 2.5}, r"^offload_after_steps: must be an integer"),
    ({"min_hold_steps": 0}, r"^min_hold_steps: must be >= 1, got 0$"),
    ({"discount": 0}, r"^discount: must be in \(0, 1\], got 0$"),
    ({"initial_block": 8, "max_block": 4}, r"^max_block: must be >= initial_block"),
    ({"alpha_prior": 1.0}, r"^alpha_prior: must be in \(0, 1\)"),
    ({"modes": ["ar", "fast"]}, r"^modes: unknown mode\(s\) \['fast'\]"),
    ({"context_bins": "queue"}, r"^context_bins: must be one of"),
    ({"wall_includes_rebuild": 1}, r"^wall_includes_rebuild: must be true or false"),
    ({"reload_s": -1.0}, r"^reload_s: must be >= 0"),
    ({"explore": float("inf")}, r"^explore: must be a finite number"),
    ({"unimodal": 1}, r"^unimodal: must be true or false"),
])
def test_planner_config_refuses_what_it_cannot_run(settings, message):
    with pytest.raises(ValueError, match=message):
        PlannerConfig.from_dict(settings)


def test_decide_handles_a_new_context_bin_almost_every_step():
    # (What a decision costs is measured by scripts/time_planner_decide.py, not asserted here.)
    p = Planner(gamma_max=8, psd_available=True, cost_profile=profile(), seed=0)
    rng = np.random.default_rng(0)
    batches = rng.integers(1, 100, size=4000)     # worst case: a different bin almost every step
    arms = set(p.arms)
    for i, b in enumerate(batches):
        d = p.decide(LoadSignals(batch_size=int(b), now=i * 0.01))
        assert d.arm in arms, d
        p.observe(d, StepOutcome(step_wall_s=0.02, tokens_committed=int(b), batch_size=int(b)))
    assert p.steps == len(batches)


# ---------------------------------------------------------------------------------------------
# memory-aware offloading: KV blocks, not compute, limit the batch. Speculation wins at the batch
# that fits with the drafter on the device (8), plain decoding at the batch the drafter's memory
# would admit as KV cache (8 x growth): only the memory-aware rule finds that.

def turn_off_slowdown(since_drafting: int, x: float) -> float:
    """The turn-off's transient, as measured through tritonserver on a CPU host: the first four
    plain steps after a drafting one cost x, the next three half that extra."""
    k = since_drafting
    return x if 0 < k <= 4 else (1 + x) / 2 if 4 < k <= 7 else 1.0


class KVBoundEngine:
    """`demand` requests want to run; the pool holds `base` of them with the drafter on the
    device and `base * growth` with it offloaded. The planner's decisions run on the synthetic
    costs; an offload takes effect at once, a reload on the next step."""

    def __init__(self, planner, base=8, growth=1.75, seed=0, report_growth=True,
                 offloaded_slowdown=1.0, demand_tok_s=None, steady=False, turn_off=1.0):
        self.p, self.base, self.growth = planner, base, growth
        # turn_off: the first four plain steps after a drafting one cost this x, the next three
        # half that extra (the turn-off's transient, as measured through tritonserver on a CPU)
        self.turn_off, self._since_drafting = turn_off, 99
        # steady: as the engine's controller does, skip the snapshot and call decide_held for
        # the steps Planner.steady grants while the load stays quiet (nothing waiting, the
        # drafter where it was, the KV usage under the line)
        self.steady, self._steady_left, self._steady_load = steady, 0, None
        self.demand_tok_s = demand_tok_s               # what the engine's demand estimate reports
        self.offloaded_slowdown = offloaded_slowdown   # a cost the planner cannot predict
        self.rng = np.random.default_rng(seed)
        self.report_growth = report_growth
        self.t, self.offloaded = 0.0, False
        self.offloads = self.reloads = 0

    def step(self, demand):
        cap = int(self.base * self.growth) if self.offloaded else self.base
        b = max(1, min(demand, cap))
        s = LoadSignals(batch_size=b, waiting=max(demand - b, 0), kv_usage=b / cap, now=self.t,
                        drafter_offloaded=self.offloaded, batch_limit=64,
                        kv_usage_at_base=b / self.base, demand_tok_s=self.demand_tok_s,
                        waiting_tokens=0 if self.demand_tok_s is not None else None,
                        kv_growth_if_offloaded=(self.growth if self.report_growth and not self.offloaded
                                                else None))
        d = None
        if (self._steady_left > 0 and not s.waiting and self.offloaded == self._steady_load[0]
                and s.kv_usage < self._steady_load[1]):
            d = self.p.decide_held(s.now, b)
        held = d is not None
        if held:
            self._steady_left -= 1
        else:
            self._steady_left = 0
            d = self.p.decide(s)
        if d.speculative and self.offloaded:        # the weights come back; this step runs plainly
            self.offloaded, d_ran = False, AR
            self.reloads += 1
        else:
            d_ran = d
        wall, tokens, nseq = true_step(d_ran.mode, d_ran.gamma, b)
        self._since_drafting = 0 if d_ran.uses_drafter else self._since_drafting + 1
        slow = turn_off_slowdown(self._since_drafting, self.turn_off)
        wall *= slow * (1.0 + 0.05 * self.rng.standard_normal())
        if self.offloaded:
            wall *= self.offloaded_slowdown
        fed = nseq * (d_ran.gamma + 1)
        self.p.observe(d_ran, StepOutcome(step_wall_s=wall, tokens_committed=int(round(tokens)), batch_size=nseq,
                       forward_tokens=fed, forward_s=slow * t_verify(nseq, d_ran.gamma + 1)))
        if not d_ran.speculative and not self.offloaded and not held and self.p.wants_offload(s):
            self.offloaded = True
            self.offloads += 1
        elif self.steady and not held:
            self._steady_left, kv_below = self.p.steady(s)
            self._steady_load = (self.offloaded, kv_below)
        self.t += wall
        return d_ran, b


def test_kv_bound_shape_of_the_synthetic_costs():
    per_token = lambda m, g, b: true_step(m, g, b)[0] / true_step(m, g, b)[1]   # noqa: E731
    best_spec_at_8 = min(per_token("sd", g, 8) for g in range(1, 5))
    assert best_spec_at_8 < per_token("ar", 0, 8)           # the bandit alone prefers speculation
    assert per_token("ar", 0, 14) * 1.05 < best_spec_at_8   # ... but the offloaded batch wins


def test_memory_aware_offload_holds_ar_under_pressure_and_reloads_after():
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, reload_after_s=0.05),
                gamma_max=4, psd_available=False, seed=0)
    eng = KVBoundEngine(p)
    for _ in range(300):                      # low load: speculation, no pressure, no offload
        eng.step(2)
    assert eng.offloads == 0
    high = [eng.step(30) for _ in range(1500)]
    assert eng.offloads == 1, "sustained KV pressure with a paying bigger pool did not offload"
    assert p.stats()["memory"]["last_offload_gain"] > 1.05
    after = high[-1000:]
    assert all(not d.speculative for d, _ in after), "speculated while the load needed the pool"
    assert np.mean([b for _, b in after]) == 14     # the grown pool runs the bigger batch
    assert p.stats()["ar_hold_steps"] >= 1000
    low = [eng.step(2)[0] for _ in range(1500)]
    assert eng.reloads == 1, "the drafter did not come back when the load fitted again"
    assert np.mean([d.speculative for d in low[-500:]]) > 0.9
    assert eng.offloads == 1                  # no bouncing


@pytest.mark.parametrize("psd_available, policy_check", [(False, False), (True, False), (False, True)])
def test_steady_blocks_held_without_a_snapshot_decide_exactly_as_every_step_decided(psd_available,
                                                                                     policy_check):
    # Two planners, one deciding every step and one skipping the snapshot on the steps
    # Planner.steady grants (the engine's controller does so): through speculation, plain
    # decoding with the batch moving inside its bin, memory pressure with an offload, its
    # reload, plain decoding again while the pressure level decays and the batch crosses a
    # bin's edge, and speculation at a batch that moves, their decisions, offloads and every
    # statistic are the same, and the second held most of its steps in both plain phases. With
    # the policy check on, a held plain decoding it gives up mid-block ends the held steps too.
    def run(steady):
        p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, reload_after_s=0.05,
                                  policy_check=policy_check),
                    gamma_max=4, psd_available=psd_available, seed=0)
        eng = KVBoundEngine(p, base=128, steady=steady)
        load = ([2] * 200 + [80, 90, 85] * 200 + [200] * 400 + [2] * 300 + [60, 60, 60, 70] * 150
                + [3, 2] * 100)
        steps, held = [], []
        for demand in load:
            before = p.held_steps
            steps.append(eng.step(demand))
            held.append(p.held_steps > before)
        return steps, (eng.offloads, eng.reloads), p, held

    every, moves, p_every, _ = run(False)
    held, held_moves, p_held, was_held = run(True)
    assert held == every and held_moves == moves
    assert moves[0] >= 1 and moves[1] >= 1, "the pressure did not move the drafter both ways"
    assert p_held.stats() | {"held_steps": 0} == p_every.stats()
    assert p_held.offload_policy.level == p_every.offload_policy.level > 0
    steady_plain = sum(not d.speculative for d, _ in every[200:800] + every[1500:2100])
    assert p_every.held_steps == 0 and p_held.held_steps > 0.5 * steady_plain > 400
    assert sum(h and d.speculative for (d, _), h in zip(held, was_held)) > 100, "no speculative step held"


def test_an_idle_engine_gets_its_drafter_back_after_reload_after_s_with_the_pressure_forgotten():
    # No step, no decision: an engine with no request asks the planner instead. Before
    # reload_after_s of idleness the weights stay off; after it they come back, and the burst's
    # pressure is over (the level was an average over steps, and no step has run since), so the
    # low load after the idle speculates and does not offload again.
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, reload_after_s=0.05),
                gamma_max=4, psd_available=False, seed=0)
    eng = KVBoundEngine(p)
    for _ in range(1500):
        eng.step(30)
    assert eng.offloads == 1 and p.offload_policy.level > 0.5
    assert not p.reload_while_idle(0.04)
    assert p.offload_policy.level > 0.5
    assert p.reload_while_idle(0.05)
    assert p.offload_policy.level == 0.0
    eng.offloaded, eng.reloads = False, eng.reloads + 1      # the engine reloads
    low = [eng.step(2)[0] for _ in range(300)]
    assert eng.offloads == 1 and eng.reloads == 1
    assert np.mean([d.speculative for d in low[-100:]]) > 0.9


def test_an_offloaded_drafters_demand_gate_is_weighed_every_few_steps_and_still_holds():
    # Offloaded, with room in the pool to reload, plain decoding is held while demand exceeds
    # the speculative arms' capacity. Weighing that reads every arm's estimate from the bandit
    # (0.7 ms a step on two CPU cores, a tenth of a small batch's step), so it is weighed every
    # gain_check_every steps; between, the last verdict holds. (An offload on pressure alone,
    # with no growth reported: no offload check of its own to end the hold.)
    per_token_spec = min(true_step("sd", g, 8)[0] / true_step("sd", g, 8)[1] for g in range(1, 5))
    cfg = PlannerConfig(offload_after_steps=1, offload_after_s=0.0, reload_after_s=0.05)
    p = Planner(cfg, gamma_max=4, psd_available=False, seed=0)
    eng = KVBoundEngine(p, demand_tok_s=3 / per_token_spec, report_growth=False)
    for _ in range(300):
        eng.step(2)
    for _ in range(100):
        eng.step(30)
    assert eng.offloads == 1
    weighed = []
    weigh = p._memory.demand_over
    p._memory.demand_over = lambda s, speculative: weighed.append(s.now) or weigh(s, speculative=speculative)
    low = [eng.step(2)[0] for _ in range(400)]           # the pool has room, demand is still high
    assert p._memory.policy.may_reload(eng.t)
    assert eng.reloads == 0 and not any(d.speculative for d in low)
    assert 0 < len(weighed) <= 400 / cfg.gain_check_every + 1
    eng.demand_tok_s = 0.2 / per_token_spec               # demand falls: speculation comes back
    waited = next(i for i in range(100) if eng.step(2) and eng.reloads)
    assert waited < cfg.gain_check_every


def test_an_offloads_verdict_is_final_once_its_window_is_measured():
    """The verdict is plain decoding's per-token latency over the window after the offload; the
    steps after it (the load moved on, e.g. to a small batch whose tokens cost more each) must
    not turn a paid offload into a missed one, which would end the hold it justified."""
    from planner.offload_policy import OffloadCheck
    chk = OffloadCheck(baseline_s_per_token=0.010, settle_steps=4, verify_steps=8)
    for _ in range(12):
        chk.observe(0.040, 8)                 # 5 ms a token: paid
    assert chk.verdict is True
    delivered = chk.delivered_s_per_token
    for _ in range(500):
        chk.observe(0.030, 1)                 # 30 ms a token at batch 1, long after the window
    assert chk.verdict is True and chk.delivered_s_per_token == delivered


@pytest.mark.parametrize("growth, report", [(1.2, True), (1.75, False)])
def test_no_offload_when_the_bigger_pool_does_not_pay_or_is_unknown(growth, report):
    # growth 1.2: the batch the freed memory admits (9-10) is not enough to beat speculation at 8;
    # no growth reported (no memory manager, or offloading disabled): nothing to weigh
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0), gamma_max=4,
                psd_available=False, seed=0)
    eng = KVBoundEngine(p, growth=growth, report_growth=report)
    tail = [eng.step(30)[0] for _ in range(1500)][-500:]
    assert eng.offloads == 0
    assert np.mean([d.speculative for d in tail]) > 0.8
    assert p.stats()["ar_hold_steps"] == 0


def _offload_gain_after_blocks(turn_off: float, settle_steps: int = 7) -> tuple[float, float]:
    """(the offload's predicted gain, the bandit's mean for plain decoding) at batch 8 under
    pressure, after SD and plain decoding ran in alternate blocks of 12 steps, the first four
    plain steps after each SD block costing `turn_off` x, the next three half that extra (the
    turn-off's transient, as measured through tritonserver on a CPU host)."""
    p = Planner(PlannerConfig(plain_settle_steps=settle_steps), gamma_max=4, psd_available=False, seed=0)
    rng = np.random.default_rng(0)
    sd2, t, since_drafting = Decision(Mode.SD, 2), 0.0, 99
    s = LoadSignals(batch_size=8, waiting=10, kv_usage=1.0, kv_growth_if_offloaded=1.75)
    for ran in ([sd2] * 12 + [AR] * 12) * 30:
        s = replace(s, now=t)
        p.decide(s)                  # the arms run on a schedule, whatever the planner would pick
        wall, tokens, nseq = true_step(ran.mode.value, ran.gamma, 8)
        since_drafting = 0 if ran.uses_drafter else since_drafting + 1
        slow = turn_off_slowdown(since_drafting, turn_off)
        wall *= slow * (1.0 + 0.03 * rng.standard_normal())
        fed = nseq * (ran.gamma + 1)
        p.observe(ran, StepOutcome(step_wall_s=wall, tokens_committed=int(round(tokens)), batch_size=nseq,
                                   forward_tokens=fed, forward_s=slow * t_verify(nseq, ran.gamma + 1)))
        t += wall
    ctx = p.bins.context(s)
    return p._memory.estimate(s)[0], p.bandit.means(ctx)[AR.arm][0]


def test_the_offloads_gain_is_weighed_on_settled_plain_steps_not_the_turn_offs_transient():
    # Plain decoding's first steps after drafting run slower (through tritonserver on a CPU host,
    # 1.3-1.4x for four steps); played in short blocks between drafting ones, the bandit's mean
    # carries that. An offload holds plain decoding for the overload: what it would buy is
    # weighed on the settled steps, so the transient moves the bandit's mean, not the gain.
    gain, plain_mean = _offload_gain_after_blocks(1.0)
    gain_t, plain_mean_t = _offload_gain_after_blocks(1.4)
    assert plain_mean_t > 1.12 * plain_mean              # the transient is in the bandit's mean
    assert gain_t == pytest.approx(gain, rel=0.03)
    # counting every plain step as settled, the transient would keep the drafter on its device
    gain_all, _ = _offload_gain_after_blocks(1.4, settle_steps=0)
    assert gain_all < 0.95 * gain
    assert gain_all < PlannerConfig().offload_gain <= gain_t


@pytest.mark.parametrize("turn_off, seed", [(1.4, 2), (1.4, 3), (1.6, 2), (1.6, 3)])
def test_a_settled_probe_finds_the_offload_the_turn_offs_transient_hid(turn_off, seed):
    # Plain decoding played in short blocks at the batch that fits carries the turn-off's
    # transient in its mean, so the bigger pool's gain is weighed below the line. A probe (plain
    # decoding for plain_settle_steps + gain_min_obs steps, once in the overload) measures it
    # settled, and the drafter leaves; without the probe (floor 0) it stays on its device.
    def overload(floor):
        p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, settled_probe_floor=floor),
                    gamma_max=4, psd_available=False, seed=seed)
        eng = KVBoundEngine(p, turn_off=turn_off, seed=seed)
        for _ in range(300):
            eng.step(2)
        for _ in range(1500):
            eng.step(30)
        return eng.offloads, p.stats()["memory"]

    offloads, memory = overload(PlannerConfig().settled_probe_floor)
    assert offloads == 1
    [w] = memory["offload_weighings"]
    assert w["probed"] and 0 < memory["settled_probe_steps"] <= 11
    assert overload(0.0)[0] == 0


@pytest.mark.parametrize("seed", [2, 3])
def test_a_settled_probe_does_not_make_an_offload_that_does_not_pay(seed):
    # growth 1.3: the batch the freed memory admits (10) does not beat speculation at 8
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0), gamma_max=4,
                psd_available=False, seed=seed)
    eng = KVBoundEngine(p, growth=1.3, turn_off=1.4, seed=seed)
    for _ in range(300):
        eng.step(2)
    tail = [eng.step(30)[0] for _ in range(1500)][-500:]
    assert eng.offloads == 0
    assert p.stats()["memory"]["settled_probe_steps"] == 11        # probed once in the overload
    assert np.mean([d.speculative for d in tail]) > 0.8


def test_plain_steps_issued_as_speculation_are_not_settled_plain_decoding():
    # With the drafter away (reloading, restarting) a step issued as SD runs plainly: not plain
    # decoding as an offload would hold it, so the offload's estimate does not learn from it
    p = Planner(PlannerConfig(plain_settle_steps=2), gamma_max=4, psd_available=False, seed=0)
    s = LoadSignals(batch_size=8, waiting=10, kv_usage=1.0, kv_growth_if_offloaded=1.75)
    ctx = p.bins.context(s)

    def run(issued, wall, steps=20):
        for i in range(steps):
            p.decide(replace(s, now=i * 0.01))
            p.observe(issued, StepOutcome(step_wall_s=wall, tokens_committed=8, batch_size=8,
                                          forward_tokens=8, forward_s=0.8 * wall, ran=AR))

    run(Decision(Mode.SD, 2), 0.02)
    assert p._memory.settled_plain.loss(ctx, 1) is None
    run(AR, 0.01)                    # issued plainly: settled after the first two steps
    assert p._memory.settled_plain.loss(ctx, 1) == pytest.approx(0.01 / 8 * p.bins.norm(ctx, 8))


@pytest.mark.parametrize("growth, demand_x", [(1.2, None), (1.75, 1.1), (1.75, 1.5)])
def test_each_sustained_overload_records_why_the_drafter_stayed_or_when_it_left(growth, demand_x):
    # growth 1.2: the bigger pool never pays; demand 1.1x what speculation delivers: the gain
    # pays but the demand gate holds the drafter; 1.5x: both pay and the drafter leaves
    per_token_spec = min(true_step("sd", g, 8)[0] / true_step("sd", g, 8)[1] for g in range(1, 5))
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0), gamma_max=4,
                psd_available=False, seed=0)
    eng = KVBoundEngine(p, growth=growth,
                        demand_tok_s=None if demand_x is None else demand_x / per_token_spec)
    for _ in range(300):
        eng.step(2)
    assert p.stats()["memory"]["offload_weighings"] == []      # no pressure, nothing weighed
    for _ in range(1500):
        eng.step(30)
    [w] = p.stats()["memory"]["offload_weighings"]
    assert w["weighs"] >= 1
    left = eng.offloads == 1
    assert left == (demand_x == 1.5)
    if left:
        assert w["paid_after_s"] is not None and w["paid_after_s"] >= 0
        assert w["gain_max"] >= 1.05 and w["demand_ratio_max"] >= 1.25
    else:
        assert w["paid_after_s"] is None
        assert w["weighs"] > 100              # weighed all through the overload, every few steps
        short = w["short"]
        assert short["gain"] + short["demand"] >= w["weighs"] - short["no_estimate"] > 0
        if growth == 1.2:                     # the gain never paid: demand was not weighed
            assert short["gain"] == w["weighs"] - short["no_estimate"] and short["demand"] == 0
        else:                                 # demand weighed where the gain paid, and short
            assert short["demand"] > 0
    if growth == 1.2:
        assert w["gain_max"] < 1.05
    if demand_x == 1.1:
        assert w["gain_median"] >= 1.05 and w["demand_ratio_max"] < 1.25


@pytest.mark.parametrize("demand_x, offloads", [(0.6, 0), (1.1, 0), (1.5, 1)])
def test_offload_needs_demand_above_the_running_arms_capacity(demand_x, offloads):
    # The same KV-bound overload whose bigger pool pays, but the engine reports the demand: at
    # 0.6x what speculation delivers at the batch that fits, the queue drains without the
    # drafter's memory (an offload would only make each request's TPOT worse), at 1.5x it grows.
    # At 1.1x the default margin (offload_demand_ratio 1.25) holds it: through the server an
    # offload taken at about the capacity cost every request TPOT for capacity it did not need.
    per_token_spec = min(true_step("sd", g, 8)[0] / true_step("sd", g, 8)[1] for g in range(1, 5))
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, reload_after_s=0.05),
                gamma_max=4, psd_available=False, seed=0)
    eng = KVBoundEngine(p, demand_tok_s=demand_x / per_token_spec)
    for _ in range(300):                      # low load first: every arm has been measured
        eng.step(2)
    tail = [eng.step(30)[0] for _ in range(1500)][-500:]
    assert eng.offloads == offloads
    ratio = p.stats()["memory"]["last_demand_ratio"]
    assert ratio == pytest.approx(demand_x, rel=0.25)     # the planner's own capacity estimate
    if not offloads:
        assert np.mean([d.speculative for d in tail]) > 0.8


def test_backlog_counts_as_demand():
    # No arrivals any more, but a backlog that would take far longer than backlog_clear_s to
    # drain at the running arm's capacity: that is demand too
    per_token_spec = min(true_step("sd", g, 8)[0] / true_step("sd", g, 8)[1] for g in range(1, 5))
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, backlog_clear_s=5.0),
                gamma_max=4, psd_available=False, seed=0)
    eng = KVBoundEngine(p, demand_tok_s=0.0)
    s = LoadSignals(batch_size=8, waiting=22, kv_usage=1.0, demand_tok_s=0.0,
                    waiting_tokens=int(3 * 5.0 / per_token_spec))
    for _ in range(300):
        eng.step(30)
    assert p._memory.demand_over(s, speculative=True) is True
    assert p._memory.demand_over(replace(s, waiting_tokens=int(0.3 * 5.0 / per_token_spec)),
                                 speculative=True) is False
    assert p._memory.demand_over(replace(s, demand_tok_s=None), speculative=True) is None


def test_offload_gain_zero_offloads_on_sustained_pressure_alone():
    p = Planner(PlannerConfig(offload_after_steps=5, offload_after_s=0.0, offload_gain=0.0),
                gamma_max=4, psd_available=False, seed=0)
    eng = KVBoundEngine(p, growth=1.2)
    for _ in range(40):
        eng.step(30)
    assert eng.offloads == 1


def test_forward_cost_line_is_learned_and_prefill_is_not_charged_to_the_arm():
    from planner.step_costs import ForwardCost
    fc = ForwardCost()
    rng = np.random.default_rng(0)
    assert fc.seconds_per_token is None and fc.per_token_at(8, 16, 1e-3) is None
    assert fc.prefill_seconds(50) is None               # no line yet: the prompts have no price
    for _ in range(400):
        n = int(rng.integers(8, 200))
        fc.observe(n, 0.004 + 2e-4 * n * (1 + 0.05 * rng.standard_normal()))
    assert fc.seconds_per_token == pytest.approx(2e-4, rel=0.1)
    assert fc.prefill_seconds(50) == pytest.approx(0.01, rel=0.1)
    # per-token forward at batch 8: 0.004/8 + 2e-4 = 7e-4; at 16: 4.5e-4. A wall time of just the
    # forward scales with it; 3e-4 more per token (say, one streamed response per request) stays.
    assert fc.per_token_at(8, 16, 7e-4) == pytest.approx(4.5e-4, rel=0.1)
    assert fc.per_token_at(8, 16, 1e-3) == pytest.approx(4.5e-4 + 3e-4, rel=0.1)

    # An arm's loss is its decode cost, whatever prefill rode along in its steps.
    p = Planner(PlannerConfig(modes=("ar",)), gamma_max=2, psd_available=False, seed=0)
    decode_tokens = 8
    for i in range(400):
        prefill = int(rng.integers(0, 160)) if i % 2 else 0
        d = p.decide(LoadSignals(batch_size=decode_tokens, now=i * 0.01))
        fwd = 0.004 + 2e-4 * (decode_tokens + prefill)
        p.observe(d, StepOutcome(step_wall_s=fwd + 0.001, tokens_committed=decode_tokens, batch_size=decode_tokens,
                  prefill_tokens=prefill, forward_tokens=decode_tokens + prefill, forward_s=fwd))
    mean, _ = p.bandit.means("b8-15")[("ar", 0)]
    clean = ((0.004 + 2e-4 * decode_tokens + 0.001) / decode_tokens
             * p.bins.norm("b8-15", decode_tokens))
    assert mean == pytest.approx(clean, rel=0.1)


def _lent_plain_then_unlent_sd(planner, placed: bool, rng):
    """Plain decoding on both cores (prompts fed in their own steps there), then a long run of
    sequential SD on the target's one core with prompts riding in half its steps, at twice the
    per-token cost.
    Returns SD's decode-only and with-excess-prefill per-token costs (seconds)."""
    lent, own = (2, 1) if placed else (0, 0)
    for i in range(100):                     # plain decoding; every 5th step feeds only prompts
        planner.decide(LoadSignals(batch_size=16, now=i * 0.01))
        if i % 5 == 0:
            fwd = 0.004 + 1e-4 * 800
            planner.observe(AR, StepOutcome(step_wall_s=fwd, tokens_committed=0, batch_size=16,
                                            prefill_tokens=800, forward_tokens=800, forward_s=fwd,
                                            forward_cores=lent, decoded=False))
        else:
            fwd = 0.004 + 1e-4 * 16
            planner.observe(AR, StepOutcome(step_wall_s=fwd + 0.0008, tokens_committed=16, batch_size=16,
                                            forward_tokens=16, forward_s=fwd, forward_cores=lent))
    sd, prefills = Decision("sd", 1), []
    for i in range(1000):            # long enough for a single line to forget plain decoding's points
        planner.decide(LoadSignals(batch_size=16, now=1 + i * 0.01))
        prefill = int(rng.integers(0, 200)) if i % 2 else 0
        prefills.append(prefill)
        fwd = 0.003 + 2e-4 * (32 + prefill)
        planner.observe(sd, StepOutcome(step_wall_s=fwd + 0.001, tokens_committed=28, batch_size=16,
                                        prefill_tokens=prefill, forward_tokens=32 + prefill,
                                        forward_s=fwd, forward_cores=own))
    decode_only = (0.003 + 2e-4 * 32 + 0.001) / 28
    return decode_only, decode_only + 1e-4 * float(np.mean(prefills)) / 28


def test_an_arm_on_fewer_cores_keeps_the_extra_its_prefill_costs_there():
    """On CPU plain decoding borrows the drafter's cores and a speculative step leaves them to
    the drafter, so prompts fed inside speculative steps cost twice as much. Only the prefill's
    cost on the cheapest placement is no arm's doing: SD keeps the rest, and its mean is then
    worse than plain decoding's. With the placement not told, one line prices every step's
    prefill; as SD's steps replace plain decoding's points it takes SD's own rate and the excess
    drops out of SD's loss."""
    means = {}
    for placed in (True, False):
        p = Planner(PlannerConfig(modes=("ar", "sd")), gamma_max=1, psd_available=False, seed=0)
        decode_only, with_excess = _lent_plain_then_unlent_sd(p, placed, np.random.default_rng(0))
        m = p.bandit.means("b16-31")
        norm = p.bins.norm("b16-31", 16)
        means[placed] = (m[AR.arm][0] / norm, m[Decision("sd", 1).arm][0] / norm)
    ar_placed, sd_placed = means[True]
    assert ar_placed == pytest.approx((0.004 + 1e-4 * 16 + 0.0008) / 16, rel=0.05)
    assert sd_placed == pytest.approx(with_excess, rel=0.05)
    assert sd_placed > 1.2 * ar_placed > 1.2 * decode_only
    _, sd_one_line = means[False]
    assert sd_one_line < 0.9 * sd_placed


def test_the_cost_lines_are_kept_per_placement():
    from planner.step_costs import ForwardCost
    fc = ForwardCost()
    for n in range(8, 400, 8):
        fc.observe(n, 0.004 + 1e-4 * n, cores=2)
        fc.observe(n, 0.003 + 2e-4 * n, cores=1)
    assert fc.seconds_per_token == pytest.approx(1e-4)          # the cheapest placement's
    assert fc.prefill_seconds(100) == pytest.approx(0.01)
    # plain decoding's forward at batch 8 on one core: 0.003/8 + 2e-4; at 16: 0.003/16 + 2e-4
    assert fc.per_token_at(8, 16, 0.003 / 8 + 2e-4, cores=1) == pytest.approx(0.003 / 16 + 2e-4)
    assert fc.per_token_at(8, 16, 0.004 / 8 + 1e-4, cores=2) == pytest.approx(0.004 / 16 + 1e-4)
    assert fc.per_token_at(8, 16, 0.004 / 8 + 1e-4, cores=4) == pytest.approx(0.004 / 16 + 1e-4)   # unknown: the cheapest


def test_select_restricted_to_allowed_arms():
    b = ContextualBandit(["a", "b", "c"], seed=0)
    for _ in range(30):
        arm = b.select(0)
        b.update(0, arm, {"a": 1.0, "b": 0.5, "c": 2.0}[arm])
    assert b.select(0) == "b"
    assert all(b.select(0, allowed=["a", "c"]) == "a" for _ in range(20))   # the best allowed one
    b.interrupt()
    assert b.select(0) == "b"
    with pytest.raises(ValueError):
        b.select(0, allowed=[])


def test_no_batch_parallel_arm_for_a_single_sequence():
    # With one running sequence the engine can only run PSD as sequential SD, and reports it so:
    # a PSD arm would never be scored there, and as untried arms are picked first, the planner
    # would keep picking PSD arms, i.e. a random gamma, instead of settling on the best one.
    p = Planner(gamma_max=4, psd_available=True, seed=0)
    rng = np.random.default_rng(0)
    ran = []
    for i in range(600):
        d = p.decide(LoadSignals(batch_size=1, now=i * 0.02))
        if d.mode == "psd":
            d = Decision("sd", d.gamma)            # what the engine runs and reports
        wall, _, _ = true_step(d.mode, d.gamma, 1)
        tokens = int(min(rng.geometric(1 - ALPHA) - 1, d.gamma) + 1) if d.speculative else 1
        p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=1))
        ran.append((p.current, d))
    assert not any(asked.mode == "psd" for asked, _ in ran), "picked a PSD arm for one sequence"
    # per-token cost at batch 1: sd:2..4 within 5 % of each other, sd:1 20 % and ar 80 % behind
    tail = [d for _, d in ran[-300:]]
    assert np.mean([d.mode == "sd" and d.gamma >= 2 for d in tail]) > 0.8


def test_an_offload_that_does_not_deliver_is_given_back():
    # Plain decoding with the grown pool turns out 40 % slower than predicted (a cost per step
    # the forward-cost line does not see): the offload is measured, found not to pay, and undone;
    # the memory-aware road stays closed for the rest of that overload.
    p = Planner(PlannerConfig(offload_after_steps=20, offload_after_s=0.0, reload_after_s=0.05),
                gamma_max=4, psd_available=False, seed=0)
    eng = KVBoundEngine(p, offloaded_slowdown=1.4)
    for _ in range(300):
        eng.step(2)
    high = [eng.step(30)[0] for _ in range(1500)]
    assert eng.offloads == 1 and eng.reloads == 1, (eng.offloads, eng.reloads)
    assert p.stats()["memory"]["offload_verdicts"] == {"paid": 0, "missed": 1}
    # what it promised and what it delivered, in the summary the Triton model logs at unload
    (claim,) = p.summary()["memory"]["offload_claims"]
    assert claim["predicted_gain"] >= 1.05 and claim["paid"] is False
    assert claim["delivered_s_per_token"] > claim["baseline_s_per_token"]
    assert "timeline" not in p.summary() and "per_context" not in p.summary()
    assert np.mean([d.speculative for d in high[-500:]]) > 0.8
    p.offload_policy.last_gain = None
    for _ in range(300):
        eng.step(30)
    assert p.offload_policy.last_gain is None, "the road reopened within the same overload"
    # the overload ends and comes back: the offload is weighed again (with what was learnt:
    # plain decoding at that batch is slow, so it is not worth it now)
    for _ in range(600):
        eng.step(2)
    for _ in range(300):
        eng.step(30)
    assert p.offload_policy.last_gain is not None and p.offload_policy.last_gain < 1.05
    assert eng.offloads == 1



def test_ngram_arms_are_offered_only_with_an_ngram_proposer():
    without = Planner(gamma_max=2, psd_available=True, seed=0)
    assert {a[0] for a in without.arms} == {"ar", "sd", "psd"}
    both = Planner(gamma_max=2, psd_available=True, seed=0, ngram_available=True)
    assert [a for a in both.arms if a[0] == "ngram"] == [("ngram", 1), ("ngram", 2)]
    only = Planner(PlannerConfig(modes=("ar", "ngram")), gamma_max=2, psd_available=True, seed=0,
                   ngram_available=True)
    assert {a[0] for a in only.arms} == {"ar", "ngram"}


def test_ngram_steps_leave_the_drafter_behind_and_turning_it_back_on_costs():
    p = Planner(PlannerConfig(rebuild_s_per_token=1e-3), gamma_max=2, psd_available=False, seed=0,
                ngram_available=True)
    s = LoadSignals(batch_size=4, now=0.0)
    p.decide(s)
    p.observe(Decision("ngram", 2), StepOutcome(step_wall_s=0.01, tokens_committed=12, batch_size=4))
    p.observe(Decision("ngram", 2), StepOutcome(step_wall_s=0.01, tokens_committed=12, batch_size=4))
    assert p.lag_tokens() == 24                       # the drafter model saw none of them
    assert p.estimated_switch_cost_s() == pytest.approx(24e-3)
    assert p._switch_cost(("ngram", 2), ("sd", 2)) > 0        # its catch-up is a switching cost
    assert p._switch_cost(("ar", 0), ("ngram", 2)) == 0       # n-gram drafts need no catch-up
    assert p._switch_cost(("sd", 2), ("psd", 2)) == 0
    assert Decision("ngram", 2).speculative and not Decision("ngram", 2).uses_drafter


def test_ngram_arms_get_plain_decodings_prior_until_their_matches_are_measured():
    # Without one they would be the only untried arms without a prior, and tried first.
    from planner.acceptance import AcceptanceEstimate, CostModelPrior, MatchRate
    from planner.contexts import ContextBins
    prof = profile()
    bins = ContextBins("batch", prof, 0.5)
    matches = MatchRate()
    prior = CostModelPrior(prof, AcceptanceEstimate(0.6), bins, matches)
    ctx = bins.context(LoadSignals(batch_size=4))
    assert prior(ctx, ("ngram", 3)) == prior(ctx, ("ar", 0))
    assert np.isfinite(prior(ctx, ("ngram", 1)))
    # text that repeats its context: the drafts would have matched 9 positions in 10, for free
    for _ in range(10):
        matches.observe(9, 10)
    assert prior(ctx, ("ngram", 3)) < prior(ctx, ("sd", 3)) < prior(ctx, ("ar", 0))
    # text that does not: the shadow drafts missed; an n-gram arm now costs more than plain decoding
    for _ in range(300):
        matches.observe(0, 4)
    assert matches.alpha() < 0.05
    assert prior(ctx, ("ngram", 3)) > prior(ctx, ("ar", 0))


def test_the_planner_picks_ngram_drafts_when_they_would_have_matched():
    # The n-gram shadow measurement, reported with every step, turns the planner to the n-gram
    # arms before any n-gram step has run; the measured steps then keep it there. Without it the
    # n-gram arms look like plain decoding and, at this load, are not tried within 40 steps.
    def run(shadow: bool) -> tuple[Planner, Counter]:
        p = Planner(gamma_max=3, psd_available=False, seed=0, ngram_available=True,
                    cost_profile=profile())
        modes = Counter()
        for step in range(40):
            d = p.decide(LoadSignals(batch_size=4, now=0.01 * step))
            modes[d.mode] += 1
            committed = 4 * (d.gamma + 1) if d.mode == "ngram" else 4 * 2
            wall = 0.012 if d.mode == "ngram" else 0.02
            p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=committed, batch_size=4,
                      ngram_matched=12 if shadow else 0, ngram_compared=12 if shadow else 0))
        return p, modes
    p, modes = run(shadow=True)
    assert p.summary()["ngram_alpha_estimate"] > 0.9
    assert modes["sd"] > 0                            # first: the drafter at alpha 0.6, before the matches add up
    assert p.current == Decision("ngram", 3) and modes["ngram"] > 30
    p, modes = run(shadow=False)
    assert p.summary()["ngram_alpha_estimate"] is None and modes["ngram"] == 0


def _plain_blocks_between_drafting(turn_off_s: float, rounds: int = 40) -> Planner:
    """sd:2 for 4 steps then plain decoding for 8, `rounds` times, at batch 8: plain steps take
    4.4 ms for 8 tokens, sd steps 8 ms for 16, and the first plain step after drafting
    `turn_off_s` more (scripts/turn_off_cost.py: about +9 ms after PSD on the 2-core host)."""
    p = Planner(PlannerConfig(modes=("ar", "sd")), gamma_max=3, psd_available=False, seed=0)
    sd, t = Decision("sd", 2), 0.0
    for _ in range(rounds):
        for i, d in enumerate([sd] * 4 + [AR] * 8):
            t += 0.005
            p.decide(LoadSignals(batch_size=8, now=t))
            wall, tokens = (0.008, 16) if d is sd else (0.0044 + (turn_off_s if i == 4 else 0.0), 8)
            p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=8))
    return p


def test_the_first_plain_step_after_drafting_prices_the_turn_off_not_plain_decoding():
    """Plain decoding measured in short blocks between speculative ones used to carry every
    turn-off's extra in its own mean (at batch 4 it then looked worse than speculation, which
    it beats); the extra is the switch's cost, charged to a speculative -> plain switch."""
    p = _plain_blocks_between_drafting(turn_off_s=0.010)
    ctx = p.bins.context(LoadSignals(batch_size=8))
    measured = p.bandit.measured(ctx)
    ratio = measured[AR.arm][0] / measured[Decision("sd", 2).arm][0]
    assert ratio == pytest.approx(0.0044 / 8 / (0.008 / 16), rel=0.03), \
        f"plain decoding's mean carries the turn-off: {ratio:.3f} of sd's"
    assert p.stats()["switch_cost"]["turn_off_s"] == pytest.approx(0.010, rel=0.05)
    assert p._switch_cost(Decision("sd", 2).arm, AR.arm) > 0
    assert p._switch_cost(AR.arm, AR.arm) == 0.0
    assert sum(p.bandit.arm_counts().values()) == 40 * 12, "a turn-off step still counts as played"
    # without a turn-off extra nothing is charged
    q = _plain_blocks_between_drafting(turn_off_s=0.0)
    assert abs(q.stats()["switch_cost"]["turn_off_s"]) < 1e-6
    assert q._switch_cost(Decision("sd", 2).arm, AR.arm) == 0.0


def _psd_blocks_between_sd(fill_s: float, rounds: int = 40) -> Planner:
    """sd:2 for 4 steps then psd:4 for 4, `rounds` times, at batch 4: sd steps take 8 ms for 10
    tokens, psd steps (a sub-batch of 2) 5 ms for 8, and the first psd step after sd `fill_s`
    more (its sub-batch drafted in line: through the server at concurrency 4 about +4 ms)."""
    p = Planner(PlannerConfig(modes=("ar", "sd", "psd")), gamma_max=4, psd_available=True, seed=0)
    sd, psd, t = Decision("sd", 2), Decision("psd", 4), 0.0
    for _ in range(rounds):
        for i, d in enumerate([sd] * 4 + [psd] * 4):
            t += 0.005
            p.decide(LoadSignals(batch_size=4, now=t))
            wall, tokens, batch = (0.008, 10, 4) if d is sd else (0.005 + (fill_s if i == 4 else 0.0), 8, 2)
            p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=batch))
    return p


def test_the_first_psd_step_after_another_mode_prices_the_fill_not_psd():
    """PSD tried in short blocks between sequential SD's used to carry, in its own mean, every
    block's first step, which drafts its sub-batch in line (through the server at concurrency 4
    PSD then ranked below SD, which it beats by a tenth); the extra is the switch's cost,
    charged to a switch into PSD from another mode."""
    p, q = _psd_blocks_between_sd(fill_s=0.006), _psd_blocks_between_sd(fill_s=0.0)
    ctx = p.bins.context(LoadSignals(batch_size=4))
    psd, sd = Decision("psd", 4).arm, Decision("sd", 2).arm
    with_fill, without = p.bandit.measured(ctx)[psd][0], q.bandit.measured(ctx)[psd][0]
    assert with_fill == pytest.approx(without, rel=1e-9), \
        f"PSD's mean carries the fill: {with_fill / without:.3f}x its steady steps'"
    assert p.stats()["switch_cost"]["psd_fill_s"] == pytest.approx(0.006, rel=0.25)
    assert p.stats()["switch_cost"]["psd_fill_samples"] == 40 - 1    # the first block's has nothing to compare
    assert p._switch_cost(sd, psd) > 0 and p._switch_cost(AR.arm, psd) > p._switch_cost(AR.arm, sd)
    assert p._switch_cost(Decision("psd", 3).arm, psd) == 0.0        # a gamma change keeps the pipeline
    assert p._switch_cost(psd, sd) == 0.0
    assert sum(p.bandit.arm_counts().values()) == 40 * 8, "a fill step still counts as played"
    assert abs(q.stats()["switch_cost"]["psd_fill_s"]) < 0.001


def test_without_a_fill_psd_steps_that_cost_the_same_a_token_price_no_fill():
    """The fill is the first PSD step's time over the later ones' time a token, in committed
    tokens on both sides: scored (shrunk towards the gamma's yield) for the later steps only,
    their varying tokens put a fill of their own into it."""
    p = Planner(PlannerConfig(modes=("ar", "sd", "psd")), gamma_max=4, psd_available=True, seed=0)
    sd, psd, t = Decision("sd", 2), Decision("psd", 4), 0.0
    rng = np.random.default_rng(0)
    for _ in range(40):
        for d in [sd] * 4 + [psd] * 4:
            t += 0.005
            p.decide(LoadSignals(batch_size=4, now=t))
            tokens = 10 if d is sd else int(rng.integers(2, 5))     # 2-4 for a sub-batch of 2
            wall = 0.008 if d is sd else 0.00125 * tokens            # PSD: 1.25 ms a token, always
            p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=4 if d is sd else 2))
    fill = p.stats()["switch_cost"]["psd_fill_s"]
    assert p.stats()["switch_cost"]["psd_fill_samples"] == 40 - 1
    assert abs(fill) < 1e-5, f"a fill of {1e3 * fill:.3f} ms where there is none"


def test_psd_that_beats_sd_but_fills_its_pipeline_on_every_entry_is_still_chosen():
    """Through a serving path where PSD's steady steps cost about 7 % less a token than SD's at
    batch 4 and entering PSD costs one 6 ms fill: the planner settles on PSD for every seed.
    With the fill in PSD's mean (its short exploration blocks each carry one) three seeds of
    eight settled on SD."""
    costs = ServerCosts(d0=0.002)
    best = {m: min(costs.per_token((m, g), 4) for g in range(1, 7)) for m in ("sd", "psd")}
    assert best["psd"] < 0.95 * best["sd"]
    shares = []
    for seed in range(8):
        p = Planner(gamma_max=6, psd_available=True, cost_profile=costs.calibration(), seed=seed)
        sim = ServerSim(p, costs, seed=seed, psd_fill_s=0.006)
        modes = Counter(sim.step(4, queue_growth=0.0)[0].mode for _ in range(1200))
        shares.append(modes[Mode.PSD] / 1200)
    assert min(shares) > 0.4 and np.median(shares) > 0.7, shares


def test_a_plain_step_on_cores_only_being_tried_counts_as_played_but_not_in_the_mean():
    """The engine tries plain decoding on the other placement for its lending choice
    (backend/engine/core_lending.py); those steps, 1.5x slower here, are not plain decoding's
    cost as it runs: with them in its mean it would look dearer than it is."""
    def planner(trials_in_the_mean: bool) -> Planner:
        p = Planner(PlannerConfig(modes=("ar", "sd")), gamma_max=3, psd_available=False, seed=0)
        t = 0.0
        for step in range(400):
            t += 0.005
            d = p.decide(LoadSignals(batch_size=8, now=t))
            trying = not d.speculative and step % 4 == 0            # a quarter of them
            wall, tokens = (0.008, 12) if d.speculative else (0.006 * (1.5 if trying else 1.0), 8)
            p.observe(d, StepOutcome(step_wall_s=wall, tokens_committed=tokens, batch_size=8,
                                     trying_cores=trying and not trials_in_the_mean))
        return p
    p = planner(trials_in_the_mean=False)
    ctx = p.bins.context(LoadSignals(batch_size=8))
    plain = p.bandit.measured(ctx)[AR.arm][0]
    assert sum(p.bandit.arm_counts().values()) == 400, "a step on cores being tried still counts as played"
    q = planner(trials_in_the_mean=True)        # the same trials, in the mean: dearer
    assert q.bandit.measured(ctx)[AR.arm][0] > 1.05 * plain
    # and without them the mean is the steady steps' alone: the same as a planner that saw no trial
    r = Planner(PlannerConfig(modes=("ar", "sd")), gamma_max=3, psd_available=False, seed=0)
    r.decide(LoadSignals(batch_size=8, now=0.005))
    r.observe(AR, StepOutcome(step_wall_s=0.006, tokens_committed=8, batch_size=8))
    assert plain == pytest.approx(r.bandit.measured(ctx)[AR.arm][0], rel=1e-6)


def test_the_planner_record_keeps_each_bins_measurements_apart_from_its_prior():
    """``stats()`` per bin: each arm's measured mean alone (with its evidence) and the cost
    model's prior before the bin calibrates it, so a record read after a run says which of the
    two an arm's mean came from. Without a profile there is no prior to show."""
    p = Planner(gamma_max=4, psd_available=True, cost_profile=profile(), seed=0)
    eng = FakeEngine(p, seed=0, noise=0.0)
    for _ in range(400):
        eng.step(96)
    rec = p.stats()["per_context"]["b64-127"]
    ref = p.bins.ref_batch(next(c for c in p.bandit.contexts if str(c) == "b64-127"))
    assert set(rec["prior_loss"]) == {arm_str(a) for a in p.arms}
    assert rec["prior_loss"]["ar"] == pytest.approx(t_verify(round(ref), 1) / round(ref), rel=1e-6)
    assert set(rec["measured_loss"]) <= set(rec["plays"]) and "ar" in rec["measured_loss"]
    mean, evidence = rec["measured_loss"]["ar"]
    assert evidence > 10 and mean == pytest.approx(rec["prior_loss"]["ar"], rel=0.1)   # the profile is the truth here
    cold = Planner(gamma_max=4, psd_available=True, cost_profile=None, seed=0)
    FakeEngine(cold, seed=0).step(96)
    assert all(not c["prior_loss"] for c in cold.stats()["per_context"].values())
