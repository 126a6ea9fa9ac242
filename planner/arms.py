"""What the planner chooses between: a :class:`Decision` (mode, gamma) per step, and the arms.

Arms are ``("ar", 0)``, ``("sd", g)`` for g in gamma_min..gamma_max and, when a drafter has its
own device, ``("psd", g)``; ``modes`` restricts them (plain decoding is always there when
gamma_max is 0).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.config import MODES

Arm = tuple[str, int]


@dataclass(frozen=True)
class Decision:
    mode: str    # "ar" | "sd" | "psd"
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

    def __str__(self) -> str:
        return arm_str(self.arm)


AR = Decision("ar", 0)


def arm_str(arm: Arm) -> str:
    """``"ar"``, ``"sd:3"``, ``"psd:2"``."""
    return "ar" if arm[0] == "ar" else f"{arm[0]}:{arm[1]}"


def make_arms(gamma_max: int, psd_available: bool, modes: tuple[str, ...] | None = None,
              gamma_min: int = 1) -> list[Arm]:
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
    if not arms:
        raise ValueError("no arms: check gamma_max, gamma_min and modes")
    return arms
