"""The Triton model's arguments as the Python backend hands them over, for tests of
backend/serving/config.py without a server: a stand-in for ``pb_utils`` and a model folder."""
from __future__ import annotations

import json
from pathlib import Path


class Pb:
    class TritonModelException(Exception):
        pass


def model_args(model_dir: Path, kind: str = "MODEL", device_id: int = 0, **params):
    from backend.serving.config import ModelArgs
    config = {"name": "m", "parameters": {k: {"string_value": v} for k, v in params.items()}}
    return ModelArgs(Pb, {"model_config": json.dumps(config), "model_version": "1", "model_repository": str(model_dir),
                          "model_instance_kind": kind, "model_instance_device_id": str(device_id)})


def write(model_dir: Path, engine: dict | None = None, model: dict | None = None) -> Path:
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    if engine is not None:
        (model_dir / "1" / "engine.json").write_text(json.dumps(engine))
    if model is not None:
        (model_dir / "1" / "model.json").write_text(json.dumps(model))
    return model_dir
