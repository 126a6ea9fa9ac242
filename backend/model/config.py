"""Model configuration: the few fields of a Hugging Face ``config.json`` the executor needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF ``architectures`` entries we accept, by the architecture they select.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# Keys of a rope-parameters dict that describe plain RoPE, not a scaling scheme.
_PLAIN_ROPE_KEYS = {"rope_type", "type", "rope_theta"}


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config in transformers 4 (``rope_theta`` + ``rope_scaling``)
    or transformers 5 (``rope_parameters``) form. rope_scaling is None for plain RoPE, else a copy
    of the scaling dict with its type under ``"rope_type"``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    params = dict(params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("type", None)
    rope_type = params.get("rope_type", rope_type) or "default"
    if rope_type == "default" or not (params.keys() - _PLAIN_ROPE_KEYS):
        return theta, None
    params.pop("rope_theta", None)
    params["rope_type"] = rope_type
    return theta, params


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if archs:
        for name in archs:
            if name in _HF_ARCHITECTURES:
                return _HF_ARCHITECTURES[name]
    elif model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    raise ValueError(
        f"unsupported model architecture {archs or model_type!r} (model_type={model_type!r}); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"({', '.join(_HF_ARCHITECTURES)})"
    )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None = plain RoPE; else has "rope_type"
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # as stored in config.json, e.g. "bfloat16"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_dict(cls, cfg: dict, generation_config: dict | None = None) -> "ModelConfig":
        arch = _architecture(cfg)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only silu (SwiGLU) is implemented")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _rope_settings(cfg)

        eos = list(_as_id_tuple(cfg.get("eos_token_id")))
        bos = cfg.get("bos_token_id")
        if generation_config:
            for t in _as_id_tuple(generation_config.get("eos_token_id")):
                if t not in eos:
                    eos.append(t)
            if bos is None:
                bos = generation_config.get("bos_token_id")

        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=tuple(eos),
            bos_token_id=bos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` if present) in directory ``path``."""
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_dict(cfg, gen)
