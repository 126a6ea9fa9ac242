"""The load shapes of `nightdraft bench dynamic`: when requests arrive, and how long each is.

A shape is a list of phases; a phase has a name, an arrival rate (a multiple of the capacity
that plain decoding sustains, in tokens: a phase of requests twice as long at the same multiple
has half the requests per second), a length (a multiple of the base phase length) and a mix of
request lengths (multiples of ``--max-tokens`` with their shares). Arrivals within a phase are
Poisson. The shapes:

  steps   low -> high -> low: 0.25x, 1.6x, 0.25x capacity (the high phase 1.5x as long)
  ramp    0.2x -> 0.5x -> 0.9x -> 1.3x capacity, rising in equal steps
  bursty  a two-state Markov-modulated Poisson process: "on" (1.8x) and "off" (0.1x) periods
          alternate, each lasting an exponentially distributed time (mean 0.6 and 0.8 of the
          base length); six periods, drawn from the seed
  mixed   short chats (a quarter of --max-tokens, 75 % of requests) and long generations (twice
          --max-tokens, 25 %) together, at 0.3x then 1.2x capacity
"""
from __future__ import annotations

import random
from dataclasses import dataclass

SHAPES = ("steps", "ramp", "bursty", "mixed")
ONE_LENGTH = ((1.0, 1.0),)                 # every request asks for --max-tokens
CHAT_AND_LONG = ((0.25, 0.75), (2.0, 0.25))


@dataclass(frozen=True)
class Phase:
    name: str
    rate_x: float                          # token demand, x plain decoding's capacity
    length_x: float                        # x the base phase length
    lengths: tuple[tuple[float, float], ...] = ONE_LENGTH    # (x max_tokens, share)


@dataclass
class Arrival:
    t: float
    phase: int
    prompt: str
    max_tokens: int


def phases(shape: str, seed: int = 0) -> list[Phase]:
    if shape == "steps":
        return [Phase("low", 0.25, 1.0), Phase("high", 1.6, 1.5), Phase("low", 0.25, 1.0)]
    if shape == "ramp":
        return [Phase(f"{x:g}x", x, 0.75) for x in (0.2, 0.5, 0.9, 1.3)]
    if shape == "bursty":
        rng = random.Random(seed ^ 0x5EED)
        out = []
        for i in range(6):
            on = i % 2 == 1
            mean = 0.6 if on else 0.8
            # clipped so that no period is too short to measure or swallows the run
            length = min(max(rng.expovariate(1.0 / mean), 0.35 * mean), 2.5 * mean)
            out.append(Phase("on" if on else "off", 1.8 if on else 0.1, length))
        return out
    if shape == "mixed":
        return [Phase("low", 0.3, 1.5, CHAT_AND_LONG), Phase("high", 1.2, 1.5, CHAT_AND_LONG)]
    raise ValueError(f"unknown load shape {shape!r}; choose from {SHAPES}")


def schedule(shape: str, prompts: list[str], capacity_req_s: float, max_tokens: int,
             base_phase_s: float, seed: int) -> tuple[list[Arrival], list[tuple[float, float]], list[Phase]]:
    """Arrivals (time-ordered), each phase's (start, end) and the phases themselves.
    `capacity_req_s` is plain decoding's capacity in requests of `max_tokens` tokens."""
    rng = random.Random(seed)
    plan = phases(shape, seed)
    arrivals, bounds, t0 = [], [], 0.0
    for i, ph in enumerate(plan):
        length = base_phase_s * ph.length_x
        mean_x = sum(x * share for x, share in ph.lengths)
        rate = ph.rate_x * capacity_req_s / mean_x
        t = t0
        while True:
            t += rng.expovariate(rate)
            if t >= t0 + length:
                break
            x = _pick(rng, ph.lengths)
            arrivals.append(Arrival(t, i, prompts[len(arrivals) % len(prompts)],
                                    max(1, round(x * max_tokens))))
        bounds.append((t0, t0 + length))
        t0 += length
    return arrivals, bounds, plan


def _pick(rng: random.Random, mix) -> float:
    if len(mix) == 1:          # no draw: a one-length shape's arrival times stay what they were
        return mix[0][0]
    r, acc = rng.random(), 0.0
    for x, share in mix:
        acc += share
        if r < acc:
            return x
    return mix[-1][0]
