"""Sampled speculation with penalties is exact at engine level: the 2nd and 3rd generated tokens
(decided by drafts in SD and PSD) follow the target's *processed* distribution, the one plain
sampling with the same penalties draws from.

As in test_sampling_exactness.py: each request is the same prompt with its own seed; the 2nd
token's counts are tested (chi-square) against its exact marginal, sum over t1 of
p(t1) p(t2 | t1), where every p is transformers' distribution on the same checkpoint with vLLM's
penalties applied for that prefix (repetition over the prompt and the output, frequency and
presence over the output); the 3rd token's among requests whose first token is the most common.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.engine import Engine
from backend.model.tokenizer import Tokenizer
from backend.sampling.params import SamplingParams
from model_factory import TINY_DRAFTER, TINY_TARGET
from helpers.exactness import P_MIN, load_target_hf

scipy_stats = pytest.importorskip("scipy.stats")

pytestmark = pytest.mark.slow

N = 800
# Repetitive text: the model would repeat prompt tokens, which the penalties make unlikely.
PROMPT = "x = 1\nx = 1\nx ="
PENALTIES = dict(repetition_penalty=2.0, presence_penalty=2.0, frequency_penalty=1.0)


@pytest.fixture(scope="module")
def hf():
    return load_target_hf()


def penalised_probs(hf, prompt: list[int], outputs: list[list[int]]) -> torch.Tensor:
    """[len(outputs), V]: the processed next-token distribution after prompt + each output
    (equal lengths), vLLM's penalties written out per row."""
    rows = []
    with torch.no_grad():
        for i in range(0, len(outputs), 512):
            chunk = outputs[i:i + 512]
            logits = hf(torch.tensor([prompt + o for o in chunk])).logits[:, -1].float()
            rep, freq, pres = (PENALTIES[k] for k in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
            for x, out in zip(logits, chunk):
                for t in set(prompt) | set(out):
                    x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
                for t in set(out):
                    x[t] -= freq * out.count(t) + pres
                rows.append(torch.softmax(x, dim=-1))
    return torch.stack(rows)


def marginal_after(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    p_next = penalised_probs(hf, prompt, [out])[0]
    vocab = p_next.shape[0]
    return p_next @ penalised_probs(hf, prompt, [out + [x] for x in range(vocab)])


@pytest.fixture(scope="module")
def exact(hf):
    ids = Tokenizer.from_pretrained(str(TINY_TARGET)).encode(PROMPT)
    t1 = int(penalised_probs(hf, ids, [[]])[0].argmax())
    return marginal_after(hf, ids, []), t1, marginal_after(hf, ids, [t1])


def runs(engine: Engine) -> list[list[int]]:
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True, **PENALTIES)
              for s in range(N)]
    out = engine.generate([PROMPT] * N, params, max_concurrency=48)
    return [c.output_ids for c in out]


def check(exact, got: list[list[int]], label: str) -> None:
    m2, t1, m3 = exact
    p2 = chi_square_p(Counter(r[1] for r in got), m2)
    after1 = [r for r in got if r[0] == t1]
    p3 = chi_square_p(Counter(r[2] for r in after1), m3)
    assert p2 > P_MIN and p3 > P_MIN, f"{label}: 2nd token p={p2:.2g}, 3rd p={p3:.2g} (n={len(after1)})"


@pytest.mark.parametrize("mode", ["sd", "psd"])
def test_sampled_speculation_with_penalties_follows_the_processed_target(mode, exact):
    engine = Engine(EngineConfig(target=str(TINY_TARGET), drafter=str(TINY_DRAFTER), mode=mode, gamma=3,
                                 drafter_device="cpu" if mode == "psd" else None, kv_cache_bytes=32 << 20))
    try:
        got = runs(engine)
        st = engine.stats()
        assert st.drafted_tokens > 0 and 0 < st.acceptance_rate < 1
        check(exact, got, mode)
    finally:
        engine.close()


def test_the_check_sees_penalties_missing(exact):
    """Power: plain sampling without the penalties fails the check."""
    engine = Engine(EngineConfig(target=str(TINY_TARGET), kv_cache_bytes=32 << 20))
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(N)]
    got = [c.output_ids for c in engine.generate([PROMPT] * N, params, max_concurrency=48)]
    with pytest.raises(AssertionError, match="p="):
        check(exact, got, "no penalties")


def chi_square_p(observed: Counter, probs: torch.Tensor) -> float:
    """Chi-square p-value of token counts against a distribution (bins with >= 5 expected, the
    rest in one bin)."""
    n = sum(observed.values())
    expected = (probs * n).tolist()
    keep = [t for t, e in enumerate(expected) if e >= 5]
    obs = [observed.get(t, 0) for t in keep]
    exp = [expected[t] for t in keep]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    if exp[-1] < 5:
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    assert len(obs) >= 3, "too few categories to test"
    return float(scipy_stats.chisquare(obs, exp).pvalue)
