"""Load a Hugging Face Llama / Qwen2 / Qwen3 checkpoint (safetensors) into :class:`CausalLM`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from backend.model.attention import get_backend
from backend.model.llama import CausalLM
from backend.model.config import ModelConfig

# Checkpoint tensors that carry no weights (buffers some old exports saved).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``config`` must hold, with its shape."""
    H, V, I, d = config.hidden_size, config.vocab_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q_out, H),
            p + "self_attn.k_proj.weight": (kv_out, H),
            p + "self_attn.v_proj.weight": (kv_out, H),
            p + "self_attn.o_proj.weight": (H, q_out),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
            if config.architecture != "qwen2":
                shapes[p + "self_attn.o_proj.bias"] = (H,)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def checkpoint_tensors(path: Path, config: ModelConfig):
    """(name, slice) of every tensor ``config`` expects (HF names), file by file, names and shapes
    validated; a safetensors slice reads nothing until it is indexed (``part[:]`` is the whole)."""
    files = _checkpoint_files(path)
    expected = hf_tensor_shapes(config)
    present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    missing = sorted(expected.keys() - present)
    unexpected = sorted(present - expected.keys())
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError(f"checkpoint {path} does not match its config: " + "; ".join(parts))

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for fname, names in by_file.items():
        with safe_open(fname, framework="pt") as f:
            for name in names:
                part = f.get_slice(name)
                if tuple(part.get_shape()) != expected[name]:
                    raise ValueError(
                        f"tensor {name} in {fname.name} has shape {tuple(part.get_shape())}, "
                        f"config expects {expected[name]}"
                    )
                yield name, part


def _read_checkpoint(path: Path, config: ModelConfig, device, dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (HF names), validated against ``config`` and converted."""
    return {name: part[:].to(device=device, dtype=dtype) for name, part in checkpoint_tensors(path, config)}


def _interleave_rope_dims(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output dims from HF's rotate-half halves [x1 | x2] to pairs
    (x1[i], x2[i]), so rotary embedding is one complex multiply (see backend.model.llama). q and
    k are reordered alike, so their dot products, and so attention, do not change."""
    half = head_dim // 2
    order = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)
    return t.view(heads, head_dim, *t.shape[1:])[:, order].reshape(t.shape)


def _to_model_state(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF tensors to :class:`CausalLM` names, fusing q/k/v and gate/up, and reorder q/k
    dims for the model's rotary embedding."""
    state = {
        "embed_tokens.weight": hf.pop("model.embed_tokens.weight"),
        "norm.weight": hf.pop("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = hf.pop("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        d = config.head_dim
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = (hf.pop(f"{attn}{p}_proj.{kind}") for p in "qkv")
            q = _interleave_rope_dims(q, config.num_heads, d)
            k = _interleave_rope_dims(k, config.num_kv_heads, d)
            state[f"{dst}self_attn.qkv_proj.{kind}"] = torch.cat([q, k, v], dim=0)
        if config.qk_norm:   # per-dim norm weights follow the dims they scale
            for norm in ("q_norm", "k_norm"):
                name = f"{attn}{norm}.weight"
                state[f"{dst}self_attn.{norm}.weight"] = _interleave_rope_dims(hf.pop(name), 1, d)
        state[f"{dst}mlp.gate_up_proj.weight"] = torch.cat(
            [hf.pop(src + "mlp.gate_proj.weight"), hf.pop(src + "mlp.up_proj.weight")], dim=0
        )
        # Everything else keeps its name, minus the "model." prefix.
        for name in [n for n in hf if n.startswith(src)]:
            state[dst + name[len(src) :]] = hf.pop(name)
    assert not hf, f"unmapped tensors {sorted(hf)}"
    return state


def load_model(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    attention: str = "sdpa",
) -> CausalLM:
    """Build a :class:`CausalLM` from the HF checkpoint directory ``path`` (``config.json`` and
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``), in eval mode, no grads,
    with the attention backend `attention` ("auto": the fastest one available on `device`)."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    state = _to_model_state(_read_checkpoint(path, config, device, dtype), config)
    backend = get_backend(attention, device)
    with torch.device("meta"):  # no memory or random init for weights we overwrite anyway
        model = CausalLM(config, backend)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device=device, dtype=dtype)  # moves the RoPE table, the only non-loaded tensor
    return model.eval().requires_grad_(False)
