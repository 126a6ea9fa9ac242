"""The adaptive planner (Nightjar): a contextual bandit over (mode, gamma), load signals from the
engine and the serving front end, and a cost model of AR / SD / PSD. Engine-agnostic: it
depends on measurements only.

The engine needs :class:`Planner` (its one controller; the module map is in
:mod:`planner.planner`), :class:`PlannerConfig` (its settings, from engine.json's ``"planner"``
object through :meth:`PlannerConfig.from_dict`), :class:`Decision` / :data:`AR` (what it decides), :class:`StepOutcome` (what it observes), and
:class:`LoadSignals` with :class:`EngineSignals` to make them.
"""
from planner.arms import AR, Decision
from planner.bandit import ContextStats, ContextualBandit
from planner.config import BanditConfig, PlannerConfig
from planner.contexts import batch_bin
from planner.cost_model import CostProfile, expected_tokens_per_call, predict
from planner.outcome import StepOutcome
from planner.planner import Planner
from planner.signals import EngineSignals, LoadSignals

__all__ = ["AR", "BanditConfig", "ContextStats", "ContextualBandit", "CostProfile", "Decision",
           "EngineSignals", "LoadSignals", "Planner", "PlannerConfig", "StepOutcome",
           "batch_bin", "expected_tokens_per_call", "predict"]
