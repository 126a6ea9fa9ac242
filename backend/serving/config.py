"""What Triton hands a model's ``initialize``: its configuration, its parameters, where the
instance runs, and the engine configuration they name (shared by the generation models and the
ensemble's ends).

Model parameters are strings (``parameters { key: "..." value: { string_value: "..." } }`` in
config.pbtxt); an empty value counts as unset. Paths are relative to the model's version
directory unless absolute.

The engine configuration is ``engine.json`` (the ``engine_config`` parameter names it) and/or the
vLLM backend's ``model.json`` (vLLM engine arguments, ``backend.engine.vllm_args``) in the same
directory. With both, each key may come from one of them or from both with the same value; a key
they set differently is refused. The instance's placement (``instance``) decides the devices.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.engine.config import ConfigError, EngineConfig, read_json_object
from backend.engine.prompt_limit import default_max_prompt_bytes
from backend.engine.paths import resolve_checkpoint
from backend.engine.vllm_args import engine_keys_from_vllm, read_model_json, vllm_device
from backend.serving.instance import place

MODEL_JSON = "model.json"


class ModelArgs:
    """The ``args`` of ``initialize``, read once."""

    def __init__(self, pb: Any, args: dict[str, str]):
        self.pb = pb
        self.model_config: dict = json.loads(args["model_config"])
        self.name: str = args.get("model_name", self.model_config.get("name", "nightdraft"))
        self.version = str(args["model_version"])
        self.version_dir = Path(args["model_repository"]) / self.version
        self.instance_kind = str(args.get("model_instance_kind") or "MODEL").upper()
        self.device_id = int(args.get("model_instance_device_id") or 0)

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


@dataclass
class EngineSource:
    """An engine configuration and what it came from."""
    config: EngineConfig
    files: list[Path]
    disable_log_stats: bool = False        # model.json's: no vllm:* families (as the vLLM backend)
    log_lines: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return " + ".join(str(f) for f in self.files)


def cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def load_engine_config(margs: ModelArgs, default: str, cuda_count: int | None = None) -> EngineSource:
    """The engine configuration of this model instance: the ``engine_config`` parameter's
    engine.json (``default`` if unset) and/or ``model.json`` beside it, placed where Triton put
    the instance; or the load refused with a message naming the file and the problem."""
    path = margs.path("engine_config", default)
    model_json = path.parent / MODEL_JSON
    files = [f for f in (path, model_json) if f.is_file()]
    if not files:
        raise margs.fail(f"no engine configuration: neither {path} nor {model_json} exists")
    try:
        raw = read_json_object(path) if path.is_file() else {}
        vargs = read_model_json(model_json) if model_json.is_file() else None
        placement = place(margs.instance_kind, margs.device_id, engine_device=raw.get("device"),
                          engine_drafter_device=raw.get("drafter_device"),
                          vllm_device=vllm_device(vargs) if vargs is not None else None,
                          model_json_only=not raw, cuda_count=cuda_device_count() if cuda_count is None else cuda_count)
        merged, disable_log_stats, lines = dict(raw), False, []
        if vargs is not None:
            mapped = engine_keys_from_vllm(vargs, base_dir=path.parent, device=placement.device,
                                           drafter_device=placement.drafter_device)
            merged = _merge(mapped.engine, raw, path.parent, defaulted=mapped.defaulted)
            disable_log_stats = mapped.disable_log_stats
            lines += [f"model.json: {w} (ignored)" for w in mapped.warnings]
            lines += [f"model.json: {n}" for n in mapped.notes]
        merged["device"] = placement.device
        merged.pop("drafter_device", None)
        if placement.drafter_device is not None:
            merged["drafter_device"] = placement.drafter_device
        lines.append(f"placement: {placement.why}")
        config = EngineConfig.from_dict(merged, base_dir=path.parent)
        return EngineSource(config, files, disable_log_stats, lines)
    except ConfigError as e:
        raise margs.fail(f"{' + '.join(map(str, files))}: {e}") from None
    except Exception as e:
        raise margs.fail(f"cannot read {' + '.join(map(str, files))}: {type(e).__name__}: {e}") from None


def _merge(from_model_json: dict, from_engine_json: dict, base_dir: Path, defaulted: set[str] = frozenset()) -> dict:
    """Both files' keys; a key both set to different values is refused, unless model.json's
    value is only vLLM's default (``defaulted``): then engine.json's stands."""
    merged = dict(from_model_json)
    for key, value in from_engine_json.items():
        if key in merged and key not in defaulted:
            mine = value
            if key in ("target", "drafter", "tokenizer") and isinstance(value, str):
                mine = str(resolve_checkpoint(key, value, base_dir))
            if mine != merged[key]:
                raise ConfigError(f"{key}: engine.json says {value!r}, model.json means {merged[key]!r}; "
                                  "set it in one of them")
        merged[key] = value
    return merged


def tokenizer_dir(margs: ModelArgs, default: str) -> Path:
    """The tokenizer of the engine configuration the ``engine_config`` parameter names (the
    ensemble's ends): engine.json's ``tokenizer`` or ``target``, else model.json's ``tokenizer`` or
    ``model``. Nothing is placed or sized: these models hold no engine."""
    path = margs.path("engine_config", default)
    model_json = path.parent / MODEL_JSON
    try:
        raw = read_json_object(path) if path.is_file() else {}
        name = raw.get("tokenizer") or raw.get("target")
        if name:
            return resolve_checkpoint("tokenizer", str(name), path.parent)
        if model_json.is_file():
            vargs = read_model_json(model_json)
            name = vargs.get("tokenizer") or vargs.get("model")
            revision = vargs.get("tokenizer_revision") if vargs.get("tokenizer") else vargs.get("revision")
            if name:
                return resolve_checkpoint("tokenizer", str(name), path.parent, revision=revision,
                                          cache_dirs=(vargs["download_dir"],) if vargs.get("download_dir") else ())
    except ConfigError as e:
        raise margs.fail(f"{path.parent}: {e}") from None
    raise margs.fail(f"no tokenizer: neither {path} (target) nor {model_json} (model) names one")


# The context assumed for the byte limit when neither engine.json nor the checkpoint says one.
FALLBACK_CONTEXT = 131072


def prompt_byte_limit(margs: ModelArgs, default: str, max_token_bytes: int) -> int:
    """The most prompt bytes the engine of this configuration accepts (its ``max_prompt_bytes``,
    or the default for the context it allows: engine.json's ``max_model_len``, else the target's
    ``max_position_embeddings``), for the ensemble's preprocessing to refuse longer text before
    tokenizing it, as the engine does."""
    path = margs.path("engine_config", default)
    try:
        raw = read_json_object(path) if path.is_file() else {}
        if raw.get("max_prompt_bytes"):
            return int(raw["max_prompt_bytes"])
        context = raw.get("max_model_len")
        if not context:
            cfg = tokenizer_dir(margs, default) / "config.json"
            context = json.loads(cfg.read_text()).get("max_position_embeddings") if cfg.is_file() else None
        return default_max_prompt_bytes(int(context or FALLBACK_CONTEXT), max_token_bytes)
    except (ConfigError, ValueError, TypeError) as e:
        raise margs.fail(f"{path}: {e}") from None
