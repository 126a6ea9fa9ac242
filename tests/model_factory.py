"""Small checkpoints built on the fly for tests (Hugging Face format, loaded like any other)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY_TARGET = REPO / "models" / "tiny-target"
TINY_DRAFTER = REPO / "models" / "tiny-drafter"


BOS = "<s>"


def save_random_llama(path: Path, *, tokenizer_from: Path = TINY_TARGET, hidden: int = 64,
                      layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                      zero_layers_from: int | None = None, max_positions: int = 512,
                      adds_bos: bool = False) -> Path:
    """A random Llama sharing the tiny pair's tokenizer.

    zero_layers_from=k zeroes the output projections of layers k.. so they add nothing to the
    residual stream: the model then equals its own first k layers (the alpha = 1 fixture).
    adds_bos: the tokenizer gains a BOS token of its own (the last id of a vocabulary one larger)
    and a post-processor that puts it before every prompt, as Llama's does.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    eos = json.loads((tokenizer_from / "config.json").read_text()).get("eos_token_id")
    bos = eos
    if adds_bos:
        bos, vocab = vocab, vocab + 1
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      eos_token_id=eos, bos_token_id=bos, tie_word_embeddings=False)
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
    if adds_bos:
        add_bos_token(path, bos)
    return path


def add_bos_token(path: Path, bos_id: int) -> None:
    """Give the checkpoint's tokenizer a BOS token with id ``bos_id`` that it adds before every
    prompt (a TemplateProcessing post-processor, as Llama's tokenizer.json has)."""
    from tokenizers import AddedToken, Tokenizer, processors

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(BOS, special=True, normalized=False)])
    assert tok.token_to_id(BOS) == bos_id, (tok.token_to_id(BOS), bos_id)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    tok.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(bos_token=BOS, add_bos_token=True)
    cfg.setdefault("added_tokens_decoder", {})[str(bos_id)] = {
        "content": BOS, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


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
