"""Exact verification of drafted tokens (Leviathan et al. 2023), for a whole batch at once.

Greedy requests accept a draft while it equals the target's argmax. Sampled requests accept draft
x with probability min(1, p(x)/q(x)) and, on the first rejection, resample from the normalised
residual max(0, p - q); when every draft is accepted a bonus token is drawn from p. The committed
tokens then follow the target's distribution exactly, whatever the drafter proposed.

:func:`verify_sampled` decides every sampled request of a step with a handful of tensor
operations on the logits' device and one transfer of the result to the host (no per-row
``.item()``); each request draws its random numbers from its own generator, so a seeded request
is reproducible whatever else is in the batch.
"""
from __future__ import annotations

import numpy as np
import torch


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


INVALID = -1     # what sample_rows draws from a row that is not a distribution


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `weights` ``[N, V]`` (non-negative, not necessarily normalised), by
    inverse CDF with ``uniforms`` ``[N]`` in [0, 1). A token of weight 0 is never drawn: the
    search takes the first token whose cumulative weight exceeds u x total, capped at the last
    token with weight (where rounding puts u x total on the total). A row whose total is not
    finite and positive (NaN logits, an overflowed temperature) draws :data:`INVALID`, for the
    caller to fail that row's request once the tokens are on the host."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    drawn = torch.searchsorted(cdf, uniforms.to(torch.float64)[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    valid = torch.isfinite(total) & (total > 0)
    return torch.where(valid, torch.minimum(drawn, last), INVALID).squeeze(1)


def check_drawn(tokens: list[int]) -> list[int]:
    if INVALID in tokens:
        raise ValueError("the sampling distribution is not finite (or has no mass)")
    return tokens


def draw_uniforms(counts: list[int], generators: list[torch.Generator | None], device) -> torch.Tensor:
    """``counts[r]`` uniforms from each request's own generator, concatenated."""
    return torch.cat([torch.rand(n, generator=g, device=device) for n, g in zip(counts, generators)])


def verify_sampled(p: torch.Tensor, p_first: list[int], q: torch.Tensor | None,
                   drafts: list[list[int]], uniforms: torch.Tensor) -> list[list[int]]:
    """The tokens each sampled request commits.

    Request r owns the target distributions ``p[p_first[r] : p_first[r] + g_r + 1]`` (one per
    draft position and the bonus; g_r = len(drafts[r]), 0 for plain sampling), the next g_r rows
    of `q` (the draft distributions, requests in order), and the next g_r + 1 `uniforms` (one per
    acceptance test, then one for the token it samples).
    """
    dev = p.device
    R = len(drafts)
    g = np.array([len(d) for d in drafts], dtype=np.int64)
    u_start = np.cumsum(g + 1) - (g + 1)
    q_start = np.cumsum(g) - g
    firsts = np.asarray(p_first, dtype=np.int64)
    G = int(g.sum())
    accepted = torch.as_tensor(g, device=dev)           # leading accepted drafts per request
    if G:
        owner = np.repeat(np.arange(R), g)
        j = np.arange(G) - q_start[owner]                # draft position within its request
        x = torch.as_tensor([t for d in drafts for t in d], device=dev)
        p_x = p[torch.as_tensor(firsts[owner] + j, device=dev), x]
        q_x = q[torch.arange(G, device=dev), x]
        u = uniforms[torch.as_tensor(u_start[owner] + j, device=dev)]
        # u < p/q, written without the division so q_x == 0 (impossible for a sampled draft) can't NaN.
        rejected_at = torch.where(u * q_x < p_x, torch.as_tensor(g[owner], device=dev),
                                  torch.as_tensor(j, device=dev))
        accepted = accepted.scatter_reduce(0, torch.as_tensor(owner, device=dev), rejected_at, "amin")
    rows = torch.as_tensor(firsts, device=dev) + accepted
    final = p[rows]
    rejected = accepted < torch.as_tensor(g, device=dev)
    if G and bool(rejected.any()):
        q_rows = (torch.as_tensor(q_start, device=dev) + accepted).clamp(max=G - 1)
        residual = (final - q[q_rows]).clamp_min_(0.0)
        # p == q leaves no residual, where rejection has probability 0; guard anyway with p.
        usable = rejected & (residual.sum(dim=-1) > 0)
        final = torch.where(usable[:, None], residual, final)
    tokens = sample_rows(final, uniforms[torch.as_tensor(u_start + g, device=dev)])
    accepted_n, tokens_n = torch.stack((accepted, tokens)).tolist()
    check_drawn(tokens_n)
    return [d[:k] + [t] for d, k, t in zip(drafts, accepted_n, tokens_n)]


def verify_rejection(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     generator: torch.Generator | None) -> list[int]:
    """One request: ``p`` ``[g + 1, V]`` target distributions at each draft position and the
    bonus, ``q`` ``[g, V]`` the draft distributions the drafts were sampled from."""
    uniforms = draw_uniforms([len(drafts) + 1], [generator], p.device)
    return verify_sampled(p, [0], q if drafts else None, [list(drafts)], uniforms)[0]
