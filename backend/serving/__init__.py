"""The Triton adapter: Triton's Python backend over the engine.

nightdraft is a Triton *Python-based backend*: ``backend_model.py`` is laid out as
``<backend directory>/nightdraft/model.py`` and runs for every model whose config.pbtxt says
``backend: "nightdraft"`` (``python_backend``). It passes ``pb_utils``
(``triton_python_backend_utils``) in, so importing ``backend`` never needs Triton and every module
here is testable with a fake.

=====================  ========================================================================
``python_backend``     the backend's one model class: roles, config auto-complete
``model``              the decoupled generation models' life cycle: initialize, execute, finalize
``request``            what every request in flight holds (sender, timing), and the registry
``text_request``       the vLLM-backend schema (model ``nightdraft``): parse, build responses
``token_request``      the TensorRT-LLM-style token schema (model ``nightdraft_tokens``)
``inputs``             reading input tensors and request parameters (values via backend.values)
``responses``          the response/cancel thread, the one error builder, coalescing of outputs
``drain``              shutdown is a drain: notice the unload, let requests finish, end the rest
``health``             the model's readiness, asked over the server's own HTTP endpoint
``engine_health``      whether the engine can serve (readiness follows with ENABLE_VLLM_HEALTH_CHECK)
``metrics``            the model's Prometheus families through ``pb_utils.MetricFamily``
``planner_io``         the planner's link to the server: Triton's metrics in, its summary out
``ensemble``           the ensemble's stateless ends: preprocessing and postprocessing
``config``             model parameters and the engine configuration, shared by every model
``instance``           where Triton placed an instance, and the engine devices that follows
``log_bridge``         the ``nightdraft`` loggers into Triton's log
=====================  ========================================================================
"""
from __future__ import annotations

from typing import Any

ROLE_NAMES = ("text", "tokens", "preprocessing", "postprocessing")


def python_model(role: str, pb_utils: Any) -> type:
    """The model class of a role (one of :data:`ROLE_NAMES`, see ``python_backend``)."""
    if role in ("text", "tokens"):
        from backend.serving.model import generation_model
        if role == "text":
            from backend.serving.text_request import TextRequest as request_class
        else:
            from backend.serving.token_request import TokenRequest as request_class
        return generation_model(pb_utils, request_class)
    if role in ("preprocessing", "postprocessing"):
        from backend.serving.ensemble import ensemble_model
        return ensemble_model(pb_utils, role)
    raise ValueError(f"role must be one of {ROLE_NAMES}, got {role!r}")
