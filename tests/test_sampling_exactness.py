"""Sampled speculation is exact at engine level: the tokens that drafts decide (the 2nd and 3rd
generated; the 1st comes from the prefill) follow the target's own distribution, in sd, psd and
auto modes, and after the drafter worker is killed and replaced mid-run.

Each request is the same prompt with its own seed, at temperature 1. The second token's counts
are tested (chi-square) against its exact marginal under the target, sum over t1 of
p(t1) p(t2 | t1), computed by transformers on the same checkpoint for every t1 in the vocabulary;
the third token's, among requests whose first token is the most common one, against the sum over
t2 of p(t2 | t1) p(t3 | t1, t2). The seeds are fixed, so a run is reproducible.
"""
from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.config import EngineConfig
from backend.sampling.params import SamplingParams
from model_factory import TINY_DRAFTER, TINY_TARGET

pytestmark = pytest.mark.slow

scipy_stats = pytest.importorskip("scipy.stats")

PROMPT = "print("
N = 1200
P_MIN = 1e-3


def load_target_hf():
    from client import bench_vllm
    torch.set_num_threads(1)
    return bench_vllm.load_hf(str(TINY_TARGET))


@pytest.fixture(scope="module")
def hf():
    return load_target_hf()


def next_probs(hf, prefixes: list[list[int]]) -> torch.Tensor:
    """[len(prefixes), V]: the target's next-token distribution after each (equal-length) prefix."""
    out = []
    with torch.no_grad():
        for i in range(0, len(prefixes), 512):
            logits = hf(torch.tensor(prefixes[i:i + 512])).logits[:, -1].float()
            out.append(torch.softmax(logits, dim=-1))
    return torch.cat(out)


def marginal_after(hf, prefix: list[int]) -> torch.Tensor:
    """Distribution of the token after next: sum over x of p(x | prefix) p(. | prefix + x)."""
    p_next = next_probs(hf, [prefix])[0]
    vocab = p_next.shape[0]
    return p_next @ next_probs(hf, [prefix + [x] for x in range(vocab)])


def chi_square_p(observed: Counter, probs: torch.Tensor) -> float:
    n = sum(observed.values())
    expected = (probs * n).tolist()
    keep = [t for t, e in enumerate(expected) if e >= 5]
    obs = [observed.get(t, 0) for t in keep]
    exp = [expected[t] for t in keep]
    obs.append(n - sum(obs))                   # everything else, one bin
    exp.append(n - sum(exp))
    if exp[-1] < 5:                            # too thin to stand alone: fold into the last kept
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    assert len(obs) >= 3, "too few categories to test"
    return float(scipy_stats.chisquare(obs, exp).pvalue)


def sample_runs(engine: Engine, seeds=range(N), on_step=None) -> list[list[int]]:
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    out = engine.generate([PROMPT] * len(params), params, max_concurrency=48, on_step=on_step)
    assert all(len(c.output_ids) == 3 for c in out)
    return [c.output_ids for c in out]


@pytest.fixture(scope="module")
def exact(hf):
    """(prompt ids, marginal of t2, the most likely t1, marginal of t3 given that t1)."""
    from backend.model.tokenizer import Tokenizer
    ids = Tokenizer.from_pretrained(str(TINY_TARGET)).encode(PROMPT)
    t1 = int(next_probs(hf, [ids])[0].argmax())
    return ids, marginal_after(hf, ids), t1, marginal_after(hf, ids + [t1])


def check(exact, runs: list[list[int]], label: str) -> None:
    _, m2, t1, m3 = exact
    p2 = chi_square_p(Counter(r[1] for r in runs), m2)
    after1 = [r for r in runs if r[0] == t1]
    p3 = chi_square_p(Counter(r[2] for r in after1), m3)
    assert p2 > P_MIN and p3 > P_MIN, f"{label}: 2nd token p={p2:.2g} (n={len(runs)}), 3rd p={p3:.2g} (n={len(after1)})"


def engine_for(mode: str, **kw) -> Engine:
    drafter_device = "cpu" if mode in ("psd", "auto") or kw.pop("worker", False) else None
    return Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode=mode, gamma=3,
                               gamma_max=4, drafter_device=drafter_device, kv_cache_bytes=32 << 20,
                               drafter_restart_s=0.2, **kw))


@pytest.mark.parametrize("mode", ["sd", "psd", "auto"])
def test_sampled_tokens_follow_the_target(mode, exact):
    engine = engine_for(mode)
    try:
        runs = sample_runs(engine)
        stats = engine.stats()
        if mode != "auto":
            assert stats.drafted_tokens > 0 and 0 < stats.acceptance_rate < 1, \
                "the test needs drafts that are sometimes rejected"
        check(exact, runs, mode)
    finally:
        engine.close()


def test_sampled_tokens_follow_the_target_across_a_worker_restart(exact):
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
        check(exact, runs, "psd across a restart")
    finally:
        engine.close()


def test_the_chi_square_check_catches_a_wrong_distribution(exact):
    """The check has power: samples of the drafter's distribution (not the target's) fail it."""
    engine = Engine(EngineConfig(target=str(TINY_DRAFTER), mode="ar", kv_cache_bytes=32 << 20))
    runs = sample_runs(engine)
    with pytest.raises(AssertionError, match="p="):
        check(exact, runs, "drafter as target")
