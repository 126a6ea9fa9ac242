"""What the planner chooses between: a :class:`Decision` (mode, gamma) per step, and the arms.

Arms are ``("ar", 0)``, ``("sd", g)`` for g in gamma_min..gamma_max and, when a drafter has its
own device, ``("psd", g)``; when the engine also holds an n-gram proposer, ``("ngram", g)``
(sequential SD with prompt-lookup drafts: no drafter model, so turning to it costs no catch-up
and the drafter's cores may serve the target meanwhile). ``modes`` restricts them (plain
decoding is always there when gamma_max is 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.config import DRAFTER_MODES, MODES

Arm = tuple[str, int]


@dataclass(frozen=True)
class Decision:
    mode: str    # "ar" | "sd" | "psd" | "ngram"
    gamma: int   # 0 iff mode == "ar"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if (self.gamma == 0) != (self.mode == "ar") or self.gamma < 0:
            raise ValueError(f"gamma must be 0 iff mode is 'ar' (got {self.mode!r}, {self.gamma})")

    @property
    def arm(self) -> Arm:
        return (self.mode, self.gamma)

    @property
    def speculative(self) -> bool:
        return self.mode != "ar"

    @property
    def uses_drafter(self) -> bool:
        """Does this arm need the drafter model (its catch-up, its device)?"""
        return self.mode in DRAFTER_MODES

    def __str__(self) -> str:
        return arm_str(self.arm)


AR = Decision("ar", 0)


def arm_str(arm: Arm) -> str:
    """``"ar"``, ``"sd:3"``, ``"psd:2"``."""
    return "ar" if arm[0] == "ar" else f"{arm[0]}:{arm[1]}"


def make_arms(gamma_max: int, psd_available: bool, modes: tuple[str, ...] | None = None,
              gamma_min: int = 1, ngram_available: bool = False) -> list[Arm]:
    if gamma_max < 0:
        raise ValueError("gamma_max must be >= 0")
    modes = modes if modes is not None else MODES
    gammas = range(max(gamma_min, 1), gamma_max + 1)
    arms: list[Arm] = []
    if "ar" in modes or gamma_max == 0:
        arms.append(("ar", 0))
    if "sd" in modes:
        arms += [("sd", g) for g in gammas]
    if psd_available and "psd" in modes:
        arms += [("psd", g) for g in gammas]
    if ngram_available and "ngram" in modes:
        arms += [("ngram", g) for g in gammas]
    if not arms:
        raise ValueError("no arms: check gamma_max, gamma_min and modes")
    return arms
