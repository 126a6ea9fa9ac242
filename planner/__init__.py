"""The adaptive planner (Nightjar): a contextual bandit over (mode, gamma), load signals from the
engine and Triton's metrics endpoint, and a cost model of AR / SD / PSD. Engine-agnostic: it
depends on measurements only."""
from .bandit import ContextualBandit
from .cost_model import CostProfile, expected_tokens_per_call, predict
from .planner import AR, Decision, Planner, batch_bin
from .signals import EngineSignals, LoadSignals, TritonMetricsSignals, parse_metrics

__all__ = ["AR", "ContextualBandit", "CostProfile", "Decision", "EngineSignals", "LoadSignals",
           "Planner", "TritonMetricsSignals", "batch_bin", "expected_tokens_per_call",
           "parse_metrics", "predict"]
