"""One bin of the planner's bandit at concurrency 1 after a single early SD step, as one `bench
levels` engine had it (benchmarks/results/planner-scores/): the SD step (a first drafter call)
measured at twice its prior, then 200 plain steps at 1.35x their prior, then a detected shift
cut the bin's evidence. From there the bin runs on, noisy, with SD at `sd_over_plain` of plain
decoding's true cost."""
from __future__ import annotations

import numpy as np

from planner.bandit import ContextualBandit
from planner.config import BanditConfig

ARMS = [("ar", 0)] + [("sd", g) for g in range(1, 9)]
PLAIN_PRIOR, PLAIN_TRUE = 2.62, 1.35 * 2.62


def prior(context, arm) -> float:
    return PLAIN_PRIOR if arm[0] == "ar" else 2.35 + 0.05 * abs(arm[1] - 4)


def run_after_outlier(config: BanditConfig, seed: int, *, sd_over_plain: float = 0.85,
                      outlier: float | None = 2.0, steps: int = 2000, noise: float = 0.1) -> list:
    """The arms the bin played after the shift. `outlier`: the first SD step's loss over its
    prior (None: its true cost)."""
    def truth(arm) -> float:
        return PLAIN_TRUE if arm[0] == "ar" else sd_over_plain * PLAIN_TRUE * (1 + 0.04 * abs(arm[1] - 4))

    b = ContextualBandit(ARMS, config, seed=seed, prior=prior, prior_group=lambda a: a[0])
    b.select(0)
    first = ("sd", 4)
    b.update(0, first, outlier * prior(0, first) if outlier is not None else truth(first), weight=0.6)
    for _ in range(200):
        b.select(0)
        b.update(0, ARMS[0], PLAIN_TRUE)
    b._on_shift(b._bins[0], 0)
    rng, played = np.random.default_rng(seed), []
    for _ in range(steps):
        a = b.select(0)
        b.update(0, a, truth(a) * (1.0 + noise * rng.standard_normal()))
        played.append(a)
    return played
