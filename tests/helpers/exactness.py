"""Is sampled decoding exact? Each generated token against the target's own conditional.

A run is one request's generated tokens. For every token at position k >= 1 of a run (the first
comes from the prefill, which no draft decides), the target's distribution given the prompt and
the run's own tokens before it is computed by transformers on the same checkpoint, with the
request's temperature, in one forward per run. The token's randomised probability integral
transform under that distribution, for some ranking of the vocabulary,

    u = P(tokens ranked above t) + V * p(t),    V ~ Uniform(0, 1) from a fixed seed,

is exactly Uniform(0, 1) when the token was drawn from that distribution, whatever came before it
and whatever the ranking, as long as the ranking depends on the context alone (Rosenblatt's
transform: the u of one run's successive tokens are independent too). So all u of all runs are
pooled and tested for uniformity with Kolmogorov-Smirnov, for two rankings:

- by the target's probability: sees mass moved between the target's likelier and less likely
  tokens (a temperature the target side skipped, a drafter's flatter distribution leaking in);
- by the ratio p / q of the target's probability to a reference drafter's (the tiny drafter,
  computed the same way): sees mass moved towards or away from what the drafter favours, the
  direction in which a verification bug errs (a wrong residual, a wrong acceptance ratio).

The reported p-value is the smaller of the two, doubled (Bonferroni), against P_MIN = 1e-3. Each
KS then runs at 5e-4 and rejects with power at least 0.9 (simulated) when the pooled CDF of u
departs from the diagonal by about 2.7/sqrt(n) (0.039 at n = 4800 values; 0.10 at n = 700):
that much of the sampled mass on the wrong side of one cut through a ranking.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import numpy as np
import torch

from model_factory import TINY_DRAFTER, TINY_TARGET

P_MIN = 1e-3          # significance of every exactness test


@functools.lru_cache(maxsize=4)
def load_hf(path: str):
    """transformers' model of a checkpoint (float32, as the engine runs on CPU)."""
    from client import bench_vllm
    return bench_vllm.load_hf(path)


def load_target_hf(path: str = str(TINY_TARGET)):
    return load_hf(path)


def prompt_ids(prompt: str, path: str = str(TINY_TARGET)) -> list[int]:
    from backend.model.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(path).encode(prompt)


def conditionals(hf, prompt: list[int], runs: list[list[int]], temperature: float = 1.0,
                 positions=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's distribution of each run's tokens at `positions(i, run)` (default: all but the
    first) given the prompt and the run's tokens before them: ([n, V] probabilities, [n] the
    tokens), runs in order, positions in order within a run. One forward per run (batched by
    length)."""
    want = {i: list(range(1, len(r))) if positions is None else list(positions(i, r))
            for i, r in enumerate(runs)}
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(runs):
        if want[i]:
            by_len[len(r)].append(i)
    rows: dict[int, torch.Tensor] = {}
    base = len(prompt) - 1                      # logits[base + k] predict a run's token k
    with torch.no_grad():
        for idx in by_len.values():
            for c in range(0, len(idx), 256):
                chunk = idx[c:c + 256]
                logits = hf(torch.tensor([prompt + runs[i][:-1] for i in chunk])).logits.float()
                for j, i in enumerate(chunk):
                    rows[i] = torch.softmax(logits[j, [base + k for k in want[i]]] / temperature, dim=-1)
    probs = torch.cat([rows[i] for i in range(len(runs)) if want[i]])
    tokens = torch.tensor([runs[i][k] for i in range(len(runs)) for k in want[i]])
    return probs, tokens


def randomised_pit(probs: torch.Tensor, tokens: torch.Tensor, rank_by: torch.Tensor | None = None,
                   seed: int = 0) -> np.ndarray:
    """u per row: the probability of the tokens ranked above the drawn one (by `rank_by`,
    descending, ties by id; default: by `probs` itself) plus a uniform fraction of the drawn
    token's own."""
    key = probs if rank_by is None else rank_by
    k_t = key.gather(1, tokens[:, None])
    ids = torch.arange(probs.shape[1])[None]
    above = (key > k_t) | ((key == k_t) & (ids < tokens[:, None]))
    below = (probs * above).sum(dim=1, dtype=torch.float64)
    p_t = probs.gather(1, tokens[:, None])[:, 0].double()
    v = torch.rand(len(tokens), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (below + v * p_t).clamp(0.0, 1.0).numpy()


def exactness_p(hf, prompt: list[int], runs: list[list[int]], temperature: float = 1.0,
                positions=None, reference: str = str(TINY_DRAFTER)) -> tuple[float, int]:
    """(the Bonferroni p-value of the two KS tests, how many tokens they tested)."""
    from scipy import stats
    p, tokens = conditionals(hf, prompt, runs, temperature, positions)
    q, _ = conditionals(load_hf(reference), prompt, runs, temperature, positions)
    pvalues = [stats.kstest(randomised_pit(p, tokens, rank_by=key), "uniform").pvalue
               for key in (p, p / q.clamp_min(1e-30))]
    return min(1.0, 2 * float(min(pvalues))), len(tokens)


def assert_exact(hf, prompt: list[int], runs: list[list[int]], label: str, temperature: float = 1.0,
                 positions=None) -> float:
    """Fail unless the runs' tokens are consistent with the target's conditionals (p > P_MIN)."""
    p, n = exactness_p(hf, prompt, runs, temperature, positions)
    assert p > P_MIN, f"{label}: tokens against the target's conditionals: KS p={p:.2g} over {n} tokens"
    return p
