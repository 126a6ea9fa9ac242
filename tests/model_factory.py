"""Small checkpoints built on the fly for tests (Hugging Face format, loaded like any other)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY_TARGET = REPO / "models" / "tiny-target"
TINY_DRAFTER = REPO / "models" / "tiny-drafter"


def save_random_llama(path: Path, *, tokenizer_from: Path = TINY_TARGET, hidden: int = 64,
                      layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                      zero_layers_from: int | None = None, max_positions: int = 512) -> Path:
    """A random Llama sharing the tiny pair's tokenizer.

    zero_layers_from=k zeroes the output projections of layers k.. so they add nothing to the
    residual stream: the model then equals its own first k layers (the alpha = 1 fixture).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    eos = json.loads((tokenizer_from / "config.json").read_text()).get("eos_token_id")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      eos_token_id=eos, bos_token_id=eos, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():   # larger weights: peaked distributions, fewer argmax ties
            p.mul_(3.0) if p.dim() > 1 else None
        if zero_layers_from is not None:
            for layer in model.model.layers[zero_layers_from:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


def truncated_copy(src: Path, dst: Path, keep_layers: int) -> Path:
    """The first `keep_layers` layers of a checkpoint, as a checkpoint of its own."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = keep_layers
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    keep = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep_layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst
