"""The decoding modes and proposer kinds: the one place their names are spelt.

Configuration (engine.json, model.json's vLLM arguments, the planner's settings, a bench's
command line) names them as strings; those are parsed here at the boundary, and everything past
it compares members. A member is a ``str`` too, so it serialises as its name (JSON, metrics
labels: ``mode.value``).
"""
from __future__ import annotations

import enum
from typing import Iterable


class Mode(enum.StrEnum):
    AR = "ar"          # plain decoding: one token per sequence per step
    SD = "sd"          # sequential speculative decoding: draft in line, then verify
    PSD = "psd"        # batch-parallel SD: the drafter drafts one sub-batch while the target verifies the other
    NGRAM = "ngram"    # sequential SD with prompt-lookup drafts beside a drafter model (mode auto's arm)
    AUTO = "auto"      # configured only: the planner picks the step's mode and gamma

    @classmethod
    def parse(cls, value: "str | Mode", allowed: Iterable["Mode"] | None = None, what: str = "mode") -> "Mode":
        """`value` as a member (of `allowed`, when given); ValueError naming the choices otherwise."""
        choices = tuple(allowed) if allowed is not None else tuple(cls)
        try:
            mode = cls(value)
        except ValueError:
            mode = None
        if mode not in choices:
            raise ValueError(f"{what}: must be one of {[m.value for m in choices]}, got {value!r}")
        return mode

    @property
    def speculative(self) -> bool:
        return self is not Mode.AR

    @property
    def uses_drafter(self) -> bool:
        """Does a step in this mode need the drafter model (its catch-up, its device)?"""
        return self in DRAFTER_MODES


CONFIGURED_MODES = (Mode.AR, Mode.SD, Mode.PSD, Mode.AUTO)    # what an engine may be set to run
STEP_MODES = (Mode.AR, Mode.SD, Mode.PSD, Mode.NGRAM)         # what one step runs (the planner's arms)
DRAFTER_MODES = frozenset({Mode.SD, Mode.PSD})


class ProposerKind(enum.StrEnum):
    """What proposes drafts."""
    DRAFTER = "drafter"    # the drafter checkpoint
    NGRAM = "ngram"        # prompt lookup: no model, no device, no KV
    BOTH = "both"          # a drafter model and an n-gram proposer beside it (mode auto picks per step)

    @classmethod
    def parse(cls, value: "str | ProposerKind") -> "ProposerKind":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"proposer: must be one of {[p.value for p in cls]}, got {value!r}") from None
