"""One rank's slice of the target: its config, and its weights read from the checkpoint.

Tensor parallelism over ``size`` ranks splits every layer the Megatron way: q/k/v and gate/up are
column-parallel (rank r computes heads ``r*h/size ..`` and the matching kv heads, and its share
of the MLP's intermediate units), o and down are row-parallel (each rank multiplies its columns;
an all-reduce sums the partial outputs: :mod:`backend.model.parallel.layers`). A rank's slice is
a model of the same architecture with fewer heads and a narrower MLP, so it is built from a
:class:`ModelConfig` with those counts and runs the unchanged :class:`CausalLM` code.

The embedding is replicated and the output head lives on the driver (rank 0) only: every rank
needs the whole hidden state anyway (the all-reduces leave it replicated), and only the driver
samples, so a vocab-parallel head would add a gather of the logits to the driver on every step
for no saving in compute the driver does not already do. Ranks other than the driver feed the
head zero rows, and an untied head is not even read there. The price is the embedding table in
every rank's memory.

Loading reads only the rank's slice of each tensor (``safe_open(...).get_slice``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from backend.errors import ConfigError
from backend.model.attention import get_backend
from backend.model.config import ModelConfig
from backend.model.llama import CausalLM
from backend.model.linear import Linear
from backend.model.loader import _to_model_state, checkpoint_tensors


def check_divisible(config: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size that does not split the heads, kv heads and MLP evenly."""
    for what, n in (("attention heads", config.num_heads), ("kv heads", config.num_kv_heads),
                    ("intermediate_size", config.intermediate_size)):
        if n % size:
            raise ConfigError(f"tensor_parallel_size {size} does not divide the target's {what} ({n})")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's slice (same architecture; 1/size of the heads and MLP units)."""
    check_divisible(config, size)
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size)


def _slices(config: ModelConfig, rank: int, size: int) -> dict[str, tuple[int, slice]]:
    """HF tensor-name suffix -> (dim, slice) of rank `rank`; tensors not named are replicated."""
    d = config.head_dim
    q = config.num_heads // size * d
    kv = config.num_kv_heads // size * d
    inter = config.intermediate_size // size
    rows = lambda n: (0, slice(rank * n, (rank + 1) * n))      # noqa: E731
    cols = lambda n: (1, slice(rank * n, (rank + 1) * n))      # noqa: E731
    return {"self_attn.q_proj.weight": rows(q), "self_attn.q_proj.bias": rows(q),
            "self_attn.k_proj.weight": rows(kv), "self_attn.k_proj.bias": rows(kv),
            "self_attn.v_proj.weight": rows(kv), "self_attn.v_proj.bias": rows(kv),
            "self_attn.o_proj.weight": cols(q),
            "mlp.gate_proj.weight": rows(inter), "mlp.up_proj.weight": rows(inter),
            "mlp.down_proj.weight": cols(inter)}


def read_shard(path: Path, config: ModelConfig, rank: int, size: int, device, dtype) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every checkpoint tensor (HF names), reading nothing else."""
    slices = _slices(config, rank, size)
    head = rank == 0 or config.tie_word_embeddings
    out: dict[str, torch.Tensor] = {}
    for name, part in checkpoint_tensors(path, config):
        if name == "lm_head.weight" and not head:
            out[name] = torch.empty(0, config.hidden_size, device=device, dtype=dtype)
            continue
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if suffix in slices:
            dim, sl = slices[suffix]
            t = part[sl] if dim == 0 else part[:, sl]
        elif suffix == "self_attn.o_proj.bias":
            # Added once after the all-reduce's sum: the driver's copy alone.
            t = part[:] if rank == 0 else torch.zeros(part.get_shape())
        else:
            t = part[:]
        out[name] = t.to(device=device, dtype=dtype)
    return out


def load_shard(path: str | Path, rank: int, size: int, *, device="cpu", dtype=torch.float32,
               attention: str = "sdpa") -> CausalLM:
    """Rank `rank`'s slice of the checkpoint at `path` as a :class:`CausalLM` (eval, no grads).
    Its o and down projections are plain linears here: :func:`~backend.model.parallel.layers.
    make_row_parallel` joins them to a group."""
    path = Path(path)
    full = ModelConfig.from_pretrained(path)
    config = shard_config(full, size)
    state = _to_model_state(read_shard(path, full, rank, size, device, dtype), config)
    with torch.device("meta"):
        model = CausalLM(config, get_backend(attention, device))
        if model.lm_head is not None and rank != 0:
            model.lm_head = Linear(config.hidden_size, 0, bias=False)     # the driver's alone
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device=device, dtype=dtype)
    model.full_config = full
    return model.eval().requires_grad_(False)
