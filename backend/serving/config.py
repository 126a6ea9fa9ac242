"""What Triton hands a model's ``initialize``: its configuration, its parameters, and the engine
configuration they name (shared by the generation models and the ensemble's ends).

Model parameters are strings (``parameters { key: "..." value: { string_value: "..." } }`` in
config.pbtxt); an empty value counts as unset. Paths are relative to the model's version
directory unless absolute.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.engine.config import ConfigError, EngineConfig


class ModelArgs:
    """The ``args`` of ``initialize``, read once."""

    def __init__(self, pb: Any, args: dict[str, str]):
        self.pb = pb
        self.model_config: dict = json.loads(args["model_config"])
        self.name: str = args.get("model_name", self.model_config.get("name", "nightdraft"))
        self.version = str(args["model_version"])
        self.version_dir = Path(args["model_repository"]) / self.version

    def fail(self, message: str) -> Exception:
        """The exception that refuses the load, naming this model."""
        return self.pb.TritonModelException(f"{self.name}: {message}")

    def param(self, key: str, default: str = "") -> str:
        entry = (self.model_config.get("parameters") or {}).get(key)
        if isinstance(entry, dict) and entry.get("string_value") not in (None, ""):
            return str(entry["string_value"])
        return default

    def flag(self, key: str, default: bool) -> bool:
        return self.param(key, "true" if default else "false").lower() in ("1", "true", "yes")

    def seconds(self, key: str, default: float) -> float:
        try:
            return float(self.param(key, str(default)))
        except ValueError:
            raise self.fail(f"parameter {key} must be a number of seconds") from None

    def path(self, key: str, default: str = "") -> Path | None:
        """A path parameter, resolved against the version directory; None when unset."""
        raw = self.param(key, default)
        if not raw:
            return None
        path = Path(raw)
        return path if path.is_absolute() else self.version_dir / path

    def decoupled(self) -> bool:
        return bool(self.pb.using_decoupled_model_transaction_policy(self.model_config))


def load_engine_config(margs: ModelArgs, default: str) -> tuple[EngineConfig, Path]:
    """The engine configuration named by the ``engine_config`` parameter (``default`` if unset),
    or the load refused with a message naming the file and the problem."""
    path = margs.path("engine_config", default)
    if not path.is_file():
        raise margs.fail(f"engine configuration {path} not found")
    try:
        return EngineConfig.from_file(path), path
    except ConfigError as e:
        raise margs.fail(f"{path}: {e}") from None
    except Exception as e:
        raise margs.fail(f"cannot read {path}: {e}") from None
