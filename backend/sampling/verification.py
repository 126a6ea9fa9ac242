"""Exact verification of drafted tokens (Leviathan et al. 2023).

Greedy requests accept a draft while it equals the target's argmax. Sampled requests accept draft
x with probability min(1, p(x)/q(x)) and, on the first rejection, resample from the normalised
residual max(0, p - q); when every draft is accepted a bonus token is drawn from p. The committed
tokens then follow the target's distribution exactly, whatever the drafter proposed.
"""
from __future__ import annotations

import torch

from backend.sampling.sampler import sample


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """target_argmax has len(drafts) + 1 entries; returns accepted drafts + one target token."""
    out: list[int] = []
    for draft, target in zip(drafts, target_argmax):
        if draft != target:
            out.append(target)
            return out
        out.append(draft)
    out.append(target_argmax[len(drafts)])
    return out


def verify_rejection(
    p: torch.Tensor,             # [g + 1, V] target distributions at each draft position + bonus
    q: torch.Tensor,             # [g, V] draft distributions the drafts were sampled from
    drafts: list[int],
    generator: torch.Generator | None,
) -> list[int]:
    g = len(drafts)
    if g == 0:
        return [sample(p[0], generator)]
    idx = torch.tensor(drafts, device=p.device)
    rows = torch.arange(g, device=p.device)
    p_x = p[rows, idx]
    q_x = q[rows, idx]
    u = torch.rand(g, generator=generator, device=p.device)
    # u < p/q, written without the division so q_x == 0 (impossible for a sampled draft) can't NaN.
    accepted = (u * q_x < p_x).tolist()
    out: list[int] = []
    for j, ok in enumerate(accepted):
        if not ok:
            residual = (p[j] - q[j]).clamp_min_(0.0)
            total = residual.sum()
            # total == 0 only when p == q, where rejection has probability 0; guard anyway.
            out.append(sample(residual / total if total > 0 else p[j], generator))
            return out
        out.append(drafts[j])
    out.append(sample(p[g], generator))
    return out
