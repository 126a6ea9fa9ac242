"""What the planner chooses between: a :class:`Decision` (mode, gamma) per step, and the arms.

Arms are ``(Mode.AR, 0)``, ``(Mode.SD, g)`` for g in gamma_min..gamma_max and, when a drafter has its
own device, ``(Mode.PSD, g)``; when the engine also holds an n-gram proposer, ``(Mode.NGRAM, g)``
(sequential SD with prompt-lookup drafts: no drafter model, so turning to it costs no catch-up
and the drafter's cores may serve the target meanwhile). ``modes`` restricts them (plain
decoding is always there when gamma_max is 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.mode import STEP_MODES, Mode

Arm = tuple[Mode, int]


@dataclass(frozen=True)
class Decision:
    mode: Mode   # one of STEP_MODES (a name parses)
    gamma: int   # 0 iff mode is AR
    # Derived once: the controller reads them several times a step, right after the forward,
    # where each property call costs (cold caches) what a few dozen do in a loop.
    arm: Arm = field(init=False, repr=False, compare=False)
    speculative: bool = field(init=False, repr=False, compare=False)
    uses_drafter: bool = field(init=False, repr=False, compare=False)   # needs the drafter model

    def __post_init__(self):
        mode = Mode.parse(self.mode, STEP_MODES)
        if (self.gamma == 0) != (mode is Mode.AR) or self.gamma < 0:
            raise ValueError(f"gamma must be 0 iff mode is {Mode.AR.value!r} (got {mode.value!r}, {self.gamma})")
        for name, value in (("mode", mode), ("arm", (mode, self.gamma)),
                            ("speculative", mode.speculative), ("uses_drafter", mode.uses_drafter)):
            object.__setattr__(self, name, value)

    def __str__(self) -> str:
        return arm_str(self.arm)


AR = Decision(Mode.AR, 0)


def arm_mode(arm: Arm) -> Mode:
    """The arm's mode: the group whose gammas share one calibration of the cost-model prior."""
    return Mode(arm[0])


def arm_str(arm: Arm) -> str:
    """``ar``, ``sd:3``, ``psd:2``."""
    mode = arm_mode(arm)
    return mode.value if mode is Mode.AR else f"{mode.value}:{arm[1]}"


def make_arms(gamma_max: int, psd_available: bool, modes: tuple[Mode, ...] | None = None,
              gamma_min: int = 1, ngram_available: bool = False) -> list[Arm]:
    if gamma_max < 0:
        raise ValueError("gamma_max must be >= 0")
    modes = modes if modes is not None else STEP_MODES
    gammas = range(max(gamma_min, 1), gamma_max + 1)
    arms: list[Arm] = []
    if Mode.AR in modes or gamma_max == 0:
        arms.append(AR.arm)
    if Mode.SD in modes:
        arms += [(Mode.SD, g) for g in gammas]
    if psd_available and Mode.PSD in modes:
        arms += [(Mode.PSD, g) for g in gammas]
    if ngram_available and Mode.NGRAM in modes:
        arms += [(Mode.NGRAM, g) for g in gammas]
    if not arms:
        raise ValueError("no arms: check gamma_max, gamma_min and modes")
    return arms
