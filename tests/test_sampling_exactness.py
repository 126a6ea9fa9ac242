"""Sampled speculation is exact at engine level: every token that verification decides follows
the target's own distribution, in sd and psd, in auto with each of its arms run, and after the
drafter worker is killed and replaced mid-run; and the check has the power to see the subtle
verification bugs that would break that.

Each request is the same prompt with its own seed, at temperature 0.8 (so that a verifier that
skips the request's processing on one side is visible), 5 tokens: the first comes from the
prefill, then gamma 3 drafts decide the 2nd to 4th and the bonus or a later step the 5th. Every
token after the first is tested against the target's conditional distribution given the run's
own earlier tokens (tests/helpers/exactness.py: randomised probability integral transforms under
two rankings of the vocabulary, by target probability and by target/drafter ratio,
Kolmogorov-Smirnov over the N x 4 = 4800 pooled values, significance 1e-3 with Bonferroni). At
n = 4800 each KS rejects with power at least 0.9 a departure of the pooled CDF by 0.039: about
4 % of the sampled mass on the wrong side of one cut through a ranking.

Power is shown, not assumed: ``test_the_check_rejects_a_subtly_broken_verifier`` runs the same
engine, requests and check with one verifier bug each (monkeypatched into the verification seam
that the engine calls, backend.engine.verify.verify_sampled) and requires the check to reject it.
Measured (seeds 0-1199): the real verifier p = 0.47; resampling from p instead of the residual
4e-18; acceptance on the next row below 1e-300; the drafter's rows off by one 2e-42; the
temperature on the drafter only 4e-81. (Ranking by target probability alone missed the first:
p = 0.0017 and 0.45 on two seed sets.)
The seeds are fixed, so every run is reproducible.
"""
from __future__ import annotations

import time

import pytest
import torch

from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from backend.sampling.verification import check_drawn, sample_rows, verify_sampled
from helpers.arms import StepModes, force_arms
from helpers.engines import tiny_engine
from helpers.exactness import P_MIN, assert_exact, exactness_p, load_target_hf, prompt_ids

pytestmark = pytest.mark.slow

pytest.importorskip("scipy.stats")

PROMPT = "print("
N = 1200
TEMPERATURE = 0.8
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def hf():
    torch.set_num_threads(1)
    return load_target_hf()


@pytest.fixture(scope="module")
def prompt():
    return prompt_ids(PROMPT)


def sample_runs(engine: Engine, seeds=range(N), on_step=None) -> list[list[int]]:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=s, ignore_eos=True)
              for s in seeds]
    out = engine.generate([PROMPT] * len(params), params, max_concurrency=48, on_step=on_step)
    assert all(len(c.output_ids) == MAX_TOKENS for c in out)
    return [c.output_ids for c in out]


def check(hf, prompt, runs: list[list[int]], label: str) -> float:
    return assert_exact(hf, prompt, runs, label, temperature=TEMPERATURE)


def engine_for(mode: str) -> Engine:
    """sd: the drafter in the engine's process; psd and auto: in its own worker."""
    return tiny_engine(mode, gamma=3, gamma_max=3, kv_cache_bytes=32 << 20, drafter_restart_s=0.2)


def assert_drafts_decided(engine: Engine) -> None:
    st = engine.stats()
    assert st.drafted_tokens > 0 and 0 < st.acceptance_rate < 1, \
        "the test needs drafts that are sometimes rejected"


@pytest.mark.parametrize("mode", ["sd", "psd"])
def test_sampled_tokens_follow_the_target(mode, hf, prompt):
    engine = engine_for(mode)
    try:
        modes = StepModes(engine)
        runs = sample_runs(engine, on_step=modes)
        assert_drafts_decided(engine)
        if mode == "psd":
            assert modes["psd"] > 0 and engine.stats().psd_overlapped_steps > 0, modes
        check(hf, prompt, runs, mode)
    finally:
        engine.close()


def test_sampled_tokens_follow_the_target_in_auto_with_every_arm(hf, prompt):
    """Mode auto, its arms forced in turn (plain decoding, sd, psd; each for 3 steps), so that
    requests move between arms mid-generation and every kind of step decides tokens."""
    engine = engine_for("auto")
    try:
        force_arms(engine, [("ar", 0), ("sd", 3), ("psd", 3)])
        modes = StepModes(engine)
        runs = sample_runs(engine, on_step=modes)
        assert modes["ar"] > 0 and modes["sd"] > 0 and modes["psd"] > 0, modes
        assert_drafts_decided(engine)
        check(hf, prompt, runs, "auto")
    finally:
        engine.close()


def test_sampled_tokens_follow_the_target_across_a_worker_restart(hf, prompt):
    engine = engine_for("psd")
    killed = {}

    def kill_once(_outs):
        st = engine.stats()
        if not killed and st.steps >= 3:
            killed["pid"] = engine.drafter.drafter.pid
            engine.drafter.drafter.kill()
    try:
        runs = sample_runs(engine, range(N // 2), on_step=kill_once)      # killed in flight
        assert killed, "the worker was never killed"
        deadline = time.monotonic() + 60
        while engine.drafter.state != "on_device" and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.05)
        drafted = engine.stats().drafted_tokens
        runs += sample_runs(engine, range(N // 2, N))                    # with its replacement
        st = engine.stats()
        assert st.drafted_tokens > drafted
        assert st.drafter_failures >= 1 and st.drafter_restarts >= 1, "no replacement worker drafted"
        assert engine.drafter.drafter.pid != killed["pid"]
        check(hf, prompt, runs, "psd across a restart")
    finally:
        engine.close()


# ------------------------------------------------------------------ negative controls (power)
#
# Each is verify_sampled with one bug, as the engine calls it (p: the target's processed rows,
# p_first: each request's first row, q: the drafter's rows, drafts, uniforms: one per acceptance
# test and one for the token sampled at the end). The engine runs unchanged around it.

def _loop_verifier(bug: str):
    """verify_sampled written out per request, with `bug`:
    "resample_from_p": after a rejection the token is drawn from p, not the residual max(0, p - q);
    "accept_on_next_row": the acceptance test min(1, p/q) reads p at the next position's row."""
    def verify(p, p_first, q, drafts, uniforms):
        out, qi, ui = [], 0, 0
        for r, d in enumerate(drafts):
            first, g, k = p_first[r], len(d), 0
            while k < g:
                p_row = p[first + k + 1] if bug == "accept_on_next_row" else p[first + k]
                if not uniforms[ui + k] * q[qi + k, d[k]] < p_row[d[k]]:
                    break
                k += 1
            final = p[first + k]
            if k < g and bug != "resample_from_p":
                residual = (final - q[qi + k]).clamp_min(0.0)
                if residual.sum() > 0:
                    final = residual
            token = check_drawn(sample_rows(final[None], uniforms[ui + g][None]).tolist())[0]
            out.append(list(d[:k]) + [token])
            qi, ui = qi + g, ui + g + 1
        return out
    return verify


def _q_off_by_one(p, p_first, q, drafts, uniforms):
    """Draft j is judged by the drafter's distribution at position j + 1 (the last by its own)."""
    if q is not None:
        rows, start = [], 0
        for d in drafts:
            rows += [start + min(j + 1, len(d) - 1) for j in range(len(d))]
            start += len(d)
        q = q[torch.tensor(rows, device=q.device)]
    return verify_sampled(p, p_first, q, drafts, uniforms)


def _target_without_temperature(p, p_first, q, drafts, uniforms):
    """The drafter sampled at the request's temperature; the target side of verification skips
    it (p_T ** T renormalised is the distribution at temperature 1), plain sampling keeps it."""
    p = p.clone()
    for r, d in enumerate(drafts):
        if d:
            rows = slice(p_first[r], p_first[r] + len(d) + 1)
            untempered = p[rows].double() ** TEMPERATURE
            p[rows] = (untempered / untempered.sum(dim=-1, keepdim=True)).to(p.dtype)
    return verify_sampled(p, p_first, q, drafts, uniforms)


BROKEN_VERIFIERS = {
    "resample_from_p": _loop_verifier("resample_from_p"),
    "accept_on_next_row": _loop_verifier("accept_on_next_row"),
    "drafter_probs_off_by_one": _q_off_by_one,
    "temperature_on_drafter_only": _target_without_temperature,
}


def test_the_loop_verifier_without_a_bug_is_the_real_one():
    """The per-request verifier the controls are built on decides exactly what verify_sampled
    decides when it has no bug (so a control fails for its bug alone)."""
    g = torch.Generator().manual_seed(0)
    vocab, drafts, firsts = 50, [[3, 7, 1], [], [9], [4, 4]], [0, 4, 5, 7]
    p = torch.softmax(torch.randn(10, vocab, generator=g) * 2, dim=-1)
    q = torch.softmax(torch.randn(6, vocab, generator=g) * 2, dim=-1)
    for trial in range(200):
        u = torch.rand(4 + 1 + 2 + 3, generator=g)
        assert _loop_verifier("none")(p, firsts, q, drafts, u) == verify_sampled(p, firsts, q, drafts, u), trial


@pytest.mark.parametrize("bug", sorted(BROKEN_VERIFIERS))
def test_the_check_rejects_a_subtly_broken_verifier(bug, hf, prompt, monkeypatch):
    """The engine of test_sampled_tokens_follow_the_target (mode sd), the same requests and the
    same check, with one verification bug: the check must reject it at the test's significance."""
    import backend.engine.verify as engine_verify
    broken, calls = BROKEN_VERIFIERS[bug], []

    def counting(p, p_first, q, drafts, uniforms):
        calls.append(sum(map(len, drafts)))
        return broken(p, p_first, q, drafts, uniforms)
    monkeypatch.setattr(engine_verify, "verify_sampled", counting)
    engine = engine_for("sd")
    try:
        runs = sample_runs(engine)
        assert_drafts_decided(engine)
        drafted = engine.stats().drafted_tokens
    finally:
        engine.close()
    assert sum(calls) == drafted, "the broken verifier did not decide the drafts"
    p, n = exactness_p(hf, prompt, runs, TEMPERATURE)
    print(f"{bug}: KS p={p:.3g} over {n} tokens")
    assert p < P_MIN, f"{bug}: the check did not see the bug (KS p={p:.3g} over {n} tokens)"
