"""The planner's settings: two typed, validated, frozen dataclasses.

* :class:`BanditConfig` — the contextual bandit's own knobs (:mod:`planner.bandit`), with the
  bandit's defaults.
* :class:`PlannerConfig` — everything else the planner is tuned by (arms, contexts, the loss,
  the switching cost, elastic memory, reporting), plus the :class:`BanditConfig` it runs its bandit
  with (``bandit``; by default the planner's bandit holds decisions for 4 steps, asks a
  challenger to win by 3 % and explores a mode's gammas around its best one, where a bare bandit
  does none of these).

``engine.json``'s ``"planner"`` object is flat: ``PlannerConfig.from_dict`` takes the planner's
keys and the bandit's side by side (``{"offload_after_steps": 3, "explore": 1.0, ...}``); the
bandit's ``min_hold`` is spelt ``min_hold_steps`` there. Every value is checked when a config is
made (directly or through ``from_dict``), and a bad one is refused with a ``ValueError`` that
names the key and its rule (``"kv_pressure: must be in (0, 1], got 1.5"``); an unknown key is
refused with the list of the known ones. The engine's ``seed``, ``gamma_max`` and whether a
drafter has a device of its own are not settings: the engine passes them to the
:class:`~planner.planner.Planner` itself.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from backend.mode import STEP_MODES, Mode
CONTEXT_BINS = ("batch", "batch_waiting")


# ---------------------------------------------------------------------------------- rules

def _ge(lo):
    return f">= {lo}", lambda v: v >= lo


def _gt(lo):
    return f"> {lo}", lambda v: v > lo


def _unit(lo_open: bool, hi_open: bool):
    text = f"in {'(' if lo_open else '['}0, 1{')' if hi_open else ']'}"
    return text, lambda v: (v > 0 if lo_open else v >= 0) and (v < 1 if hi_open else v <= 1)


_ANY = ("a finite number", lambda v: True)


def _setting(default, kind: str, rule=_ANY):
    """A dataclass field with its type (``int``, ``float``, ``bool``, ``float?``: a float or
    None, or ``other``: checked by the class) and range rule, read by :func:`_check`."""
    return field(default=default, metadata={"kind": kind, "rule": rule})


def _coerce(name: str, kind: str, v: Any) -> Any:
    is_num = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "bool":
        if not isinstance(v, bool):
            raise ValueError(f"{name}: must be true or false, got {v!r}")
        return v
    if kind == "int":
        if not (isinstance(v, int) and not isinstance(v, bool)):
            raise ValueError(f"{name}: must be an integer, got {v!r}")
        return v
    if kind == "float?" and v is None:
        return None
    if not is_num or not math.isfinite(v):
        alt = " or null" if kind == "float?" else ""
        raise ValueError(f"{name}: must be a finite number{alt}, got {v!r}")
    return float(v)


def _check(cfg) -> None:
    """Type-check, normalise (ints stay ints, numbers become floats) and range-check every
    field of a frozen settings dataclass that declares its kind and rule."""
    for f in dataclasses.fields(cfg):
        kind = f.metadata.get("kind")
        if kind is None or kind == "other":
            continue
        raw = getattr(cfg, f.name)
        v = _coerce(f.name, kind, raw)
        text, ok = f.metadata["rule"]
        if v is not None and not ok(v):
            raise ValueError(f"{f.name}: must be {text}, got {raw!r}")
        object.__setattr__(cfg, f.name, v)


# ---------------------------------------------------------------------------------- bandit

@dataclass(frozen=True)
class BanditConfig:
    """:class:`~planner.bandit.ContextualBandit`'s settings; see that module for the rule."""
    explore: float = _setting(1.0, "float", _ge(0))          # width of the confidence bound
    initial_block: int = _setting(1, "int", _ge(1))          # shortest block
    block_growth: float = _setting(2.0, "float", _ge(1))     # block: (this - 1) x arm evidence
    max_block: int = _setting(256, "int", _ge(1))            # longest block
    prior_weight: float = _setting(2.0, "float", _ge(0))     # pseudo-observations of a prior
    min_hold: int = _setting(1, "int", _ge(1))               # steps between two switches
    hysteresis: float = _setting(0.0, "float", _ge(0))       # a challenger's margin, x the mean
    switch_horizon: int = _setting(256, "int", _ge(1))       # longest amortisation of a switch
    visit_gap: int = _setting(16, "int", _ge(1))             # steps away that end a visit
    discount: float = _setting(0.9995, "float", _unit(True, False))   # per step of a bin
    stale_after: int = _setting(5000, "int", _ge(0))         # steps away that make a bin stale
    shrink_to: float = _setting(4.0, "float", _gt(0))        # evidence kept by a stale bin
    shift_keep: float = _setting(0.3, "float", _gt(0))       # evidence kept after a shift
    detect_sigmas: float = _setting(5.0, "float", _ge(0))    # a shift: standard errors ...
    detect_rel: float = _setting(0.15, "float", _ge(0))      # ... and fraction of the mean
    detect_alpha: float = _setting(0.1, "float", _unit(True, False))  # the recent level's EWMA
    detect_min_n: float = _setting(20.0, "float", _ge(0))    # evidence before detecting
    noise_floor: float = _setting(0.02, "float", _ge(0))     # least noise, x the best mean
    noise_prior: float = _setting(0.2, "float", _ge(0))      # assumed noise, x the best mean
    unimodal: bool = _setting(False, "bool")                 # a group's leader and neighbours only

    def __post_init__(self):
        _check(self)
        if self.max_block < self.initial_block:
            raise ValueError(f"max_block: must be >= initial_block ({self.initial_block}), "
                             f"got {self.max_block}")


def replace_settings(cfg, changes: Mapping[str, Any]):
    """``dataclasses.replace(cfg, **changes)``, refusing an unknown name with a ValueError that
    lists the known ones."""
    if not changes:
        return cfg
    known = sorted(f.name for f in dataclasses.fields(cfg))
    unknown = sorted(set(changes) - set(known), key=str)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; known: {known}")
    return dataclasses.replace(cfg, **changes)


# engine.json's flat planner settings spell the bandit's min_hold as min_hold_steps
_FLAT_NAME = {"min_hold": "min_hold_steps"}
_BANDIT_KEYS = {_FLAT_NAME.get(f.name, f.name): f.name for f in dataclasses.fields(BanditConfig)}
# the planner's bandit defaults (unimodal: a mode's gammas, see planner.bandit)
PLANNER_BANDIT = BanditConfig(min_hold=4, hysteresis=0.03, unimodal=True)


# ---------------------------------------------------------------------------------- planner

@dataclass(frozen=True)
class PlannerConfig:
    """The planner's settings (see :mod:`planner.planner` and docs/adaptive.md)."""
    # arms and contexts
    modes: tuple[str, ...] | None = _setting(None, "other")  # arms' modes (None: all)
    gamma_min: int = _setting(1, "int", _ge(1))              # smallest speculative gamma
    context_bins: str | Callable = _setting("batch", "other")  # or "batch_waiting", or a callable
    # the loss and the cost-model prior
    alpha_prior: float = _setting(0.6, "float", _unit(True, True))
    batch_exponent: float = _setting(0.5, "float")           # per-token cost ~ batch ** this
    # switching cost
    rebuild_s_per_token: float | None = _setting(None, "float?", _ge(0))   # None: measured
    reload_s: float | None = _setting(None, "float?", _ge(0))              # None: measured
    reload_weight: float = _setting(1.0, "float", _ge(0))
    lag_cap_steps: int = _setting(256, "int", _ge(0))
    wall_includes_rebuild: bool = _setting(True, "bool")
    cost_ewma: float = _setting(0.3, "float", _unit(True, False))
    # elastic memory
    offload_after_steps: int = _setting(50, "int", _ge(1))
    offload_after_s: float = _setting(1.0, "float", _ge(0))
    kv_pressure: float = _setting(0.9, "float", _unit(True, False))
    gpu_memory_pressure: float = _setting(0.95, "float", _unit(True, False))
    offload_gain: float = _setting(1.05, "float")             # <= 0: offload on pressure alone
    reload_after_s: float = _setting(1.0, "float", _ge(0))
    gain_check_every: int = _setting(8, "int", _ge(1))
    gain_min_obs: float = _setting(3.0, "float", _ge(0))
    plain_settle_steps: int = _setting(7, "int", _ge(0))      # plain steps after drafting: the turn-off's
    settled_probe_floor: float = _setting(0.6, "float", _ge(0))   # x offload_gain: probe plain decoding settled
    offload_demand_ratio: float = _setting(1.25, "float")      # <= 0: offload whatever the demand
    demand_tau_s: float = _setting(2.0, "float", _gt(0))        # time constant of the demand estimate
    backlog_clear_s: float = _setting(5.0, "float", _gt(0))     # the waiting requests' tokens, due in
    # fewer arms under sustained pressure (planner.pruning)
    prune: bool = _setting(True, "bool")
    prune_margin: float = _setting(0.05, "float", _ge(0))     # a pruned arm's loss above the best's
    prune_min_obs: float = _setting(8.0, "float", _ge(0))     # measured evidence before pruning
    prune_check_every: int = _setting(16, "int", _ge(1))      # steps of a bin between checks
    prune_alpha_shift: float = _setting(0.1, "float", _gt(0))   # acceptance move that restores
    prune_demand_shift: float = _setting(1.5, "float", _gt(1))  # demand factor that restores
    # plain decoding against the bandit's choice over whole stretches (planner.policy_check)
    policy_check: bool = _setting(True, "bool")
    policy_check_min_batch: int = _setting(8, "int", _ge(1))       # running sequences before a check
    policy_check_margin: float = _setting(0.05, "float", _unit(False, True))   # a challenger's win
    policy_check_after_steps: int = _setting(96, "int", _ge(1))    # the first check, and after a swap
    policy_check_max_interval: int = _setting(4096, "int", _ge(1))  # steps between checks, at most
    policy_check_seq_tokens: int = _setting(48, "int", _ge(1))     # a stretch's tokens a sequence
    # reporting
    timeline_max: int = _setting(4096, "int", _ge(16))
    timeline_every: int = _setting(25, "int", _ge(1))
    # the bandit
    bandit: BanditConfig = field(default=PLANNER_BANDIT, metadata={"kind": "other"})

    def __post_init__(self):
        _check(self)
        modes = self.modes
        if modes is not None:
            if isinstance(modes, str) or not isinstance(modes, (list, tuple)):
                raise ValueError(f"modes: must be a list of modes out of {[m.value for m in STEP_MODES]}, "
                                 f"got {modes!r}")
            bad = [m for m in modes if m not in STEP_MODES]
            if bad:
                raise ValueError(f"modes: unknown mode(s) {bad}; known: {[m.value for m in STEP_MODES]}")
            object.__setattr__(self, "modes", tuple(Mode(m) for m in modes))
        if not (callable(self.context_bins) or self.context_bins in CONTEXT_BINS):
            raise ValueError(f"context_bins: must be one of {list(CONTEXT_BINS)} or a callable, "
                             f"got {self.context_bins!r}")
        if not isinstance(self.bandit, BanditConfig):
            raise ValueError(f"bandit: must be a BanditConfig, got {self.bandit!r}")

    @classmethod
    def known_keys(cls) -> list[str]:
        """The keys :meth:`from_dict` takes (the planner's and the bandit's), sorted."""
        own = {f.name for f in dataclasses.fields(cls) if f.name != "bandit"}
        return sorted(own | set(_BANDIT_KEYS))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "PlannerConfig":
        """The config for engine.json's flat ``"planner"`` object (None or {}: the defaults)."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"must be an object of planner settings, got {d!r}")
        known = cls.known_keys()
        unknown = sorted(set(d) - set(known), key=str)
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; known: {known}")
        own = {k: v for k, v in d.items() if k not in _BANDIT_KEYS}
        tuned = {_BANDIT_KEYS[k]: v for k, v in d.items() if k in _BANDIT_KEYS}
        try:
            bandit = dataclasses.replace(PLANNER_BANDIT, **tuned)
        except ValueError as e:     # name the key as the caller spelt it
            name, _, rest = str(e).partition(":")
            raise ValueError(f"{_FLAT_NAME.get(name, name)}:{rest}") from None
        return cls(**own, bandit=bandit)

    def to_dict(self) -> dict[str, Any]:
        """The flat form :meth:`from_dict` reads (a callable ``context_bins`` stays as it is)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "bandit"}
        out.update({key: getattr(self.bandit, name) for key, name in _BANDIT_KEYS.items()})
        if self.modes is not None:
            out["modes"] = [m.value for m in self.modes]
        return out
