"""Turning logits into distributions and tokens.

The same `processed_probs` defines the distribution for plain sampling, for the drafter's
proposals and for the target side of verification: rejection sampling is exact only if all three
agree on temperature, min_p, top-k and top-p (and on the logits processors before them:
:mod:`backend.sampling.processors`).
"""
from __future__ import annotations

import torch

from backend.sampling.params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row i of `logits` [N, V] -> the distribution request params[i] samples from (float32).

    Greedy rows (temperature 0) become one-hot on the argmax, so that verification code can
    treat greedy as the degenerate case of sampling.
    """
    logits = logits.float()
    n, vocab = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)

    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        # vLLM's min_p: after temperature, tokens less likely than min_p times the most likely
        # one are dropped (greedy rows are unaffected: they take the argmax below).
        scaled_probs = torch.softmax(scaled, dim=-1)
        floor = scaled_probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, dtype=torch.float32,
                                                                         device=logits.device).unsqueeze(1)
        scaled = scaled.masked_fill(scaled_probs < floor, float("-inf"))

    top_ks = [p.top_k for p in params]
    if any(0 < k < vocab for k in top_ks):
        k_tensor = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k_tensor - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))

    probs = torch.softmax(scaled, dim=-1)

    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        p_tensor = torch.tensor(top_ps, dtype=torch.float32, device=logits.device).unsqueeze(1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= p_tensor, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from a single distribution [V] (as the batched samplers do)."""
    from backend.sampling.verification import check_drawn, sample_rows
    u = torch.rand(1, generator=generator, device=probs.device)
    return check_drawn(sample_rows(probs[None], u).tolist())[0]


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
