"""The KV pool's size from vLLM's memory arguments (``gpu_memory_utilization``,
``kv_cache_memory_bytes``, ``num_gpu_blocks_override``), as vLLM sizes its own.

On a GPU, vLLM takes ``gpu_memory_utilization`` (default 0.9) of the device's *total* memory for
this instance, and what is left of that after the model's own memory (weights, the peak
activations of a profiling forward, CUDA's own allocations) is KV cache, shared by the target and
the draft model's layers. It refuses to start when less than that fraction is free. nightdraft
does the same arithmetic without a profiling run: the weights are counted exactly from the
checkpoints' tensor shapes; the activations are estimated from ``max_num_batched_tokens`` (the
widest forward), the logits rows a step can hold, and a fixed 512 MiB for the CUDA context and
kernel workspaces. The KV budget is split between the target's pool and, when the drafter shares
the device, the drafter's pool, so both hold the same number of tokens (nightdraft's default).

On a CPU host there is no device memory to take a fraction of. vLLM's CPU backend ignores
``gpu_memory_utilization`` and sizes its pool from ``$VLLM_CPU_KVCACHE_SPACE`` (GiB); nightdraft
does the same when that variable is set, and otherwise keeps its own default pool (64 MiB: the
pool is resident host memory, and vLLM's CPU default of 4 GiB would be taken from every instance
on a shared host).

``kv_cache_memory_bytes`` (when set, vLLM ignores ``gpu_memory_utilization``) is the budget as
given; ``num_gpu_blocks_override`` sets the target pool's block count.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from backend.errors import ConfigError
from backend.model.config import ModelConfig

GiB = 1 << 30
RUNTIME_RESERVE_BYTES = 512 << 20     # CUDA context, cuBLAS/attention workspaces, allocator slack
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """The checkpoint's weights at ``dtype`` (the tensors the loader reads, by their shapes)."""
    from backend.model.loader import hf_tensor_shapes
    n = 0
    for shape in hf_tensor_shapes(cfg).values():
        size = 1
        for d in shape:
            size *= d
        n += size
    return n * DTYPE_BYTES[dtype]


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def activation_bytes(cfg: ModelConfig, dtype: str, *, max_num_batched_tokens: int, max_logit_rows: int) -> int:
    """An upper estimate of one forward's transient memory: hidden states, q/k/v, the MLP's
    gate/up, the logits of the rows a step samples (float32, with probabilities and a copy)."""
    per_token = (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + 3 * cfg.intermediate_size)
    return (max_num_batched_tokens * per_token * DTYPE_BYTES[dtype]
            + 3 * max_logit_rows * cfg.vocab_size * 4 + RUNTIME_RESERVE_BYTES)


@dataclass(frozen=True)
class KVSize:
    target_bytes: int | None     # None: nightdraft's default
    rule: str                    # how it was sized, for the load log


def cuda_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver reports them."""
    import torch
    return torch.cuda.mem_get_info(torch.device(device))


def size_kv_pool(args: dict, *, device: str, dtype: str, target: ModelConfig,
                 drafter: ModelConfig | None, drafter_shares_device: bool, block_size: int,
                 max_num_batched_tokens: int, max_num_seqs: int, gamma_max: int,
                 device_memory: Callable[[str], tuple[int, int]] = cuda_memory,
                 env: dict[str, str] | None = None, tensor_parallel_size: int = 1) -> KVSize:
    """The target pool's bytes from vLLM's memory arguments ``args`` (see the module's text).
    With tensor parallelism, each rank's pool (of its own kv heads) on each rank's device, beside
    its share of the weights (the replicated embedding counted as split: a slight overestimate
    of the room)."""
    env = os.environ if env is None else env
    tp = tensor_parallel_size
    per_token_t = kv_bytes_per_token(target, dtype) // tp
    per_token_d = kv_bytes_per_token(drafter, dtype) if drafter is not None and drafter_shares_device else 0
    share = per_token_t / (per_token_t + per_token_d)   # the target's part of a shared budget

    blocks = args.get("num_gpu_blocks_override")
    if blocks is not None:
        return KVSize(int(blocks) * block_size * per_token_t,
                      f"num_gpu_blocks_override: {int(blocks)} blocks of {block_size} tokens")
    given = args.get("kv_cache_memory_bytes")
    if given is not None:
        return KVSize(int(given * share), f"kv_cache_memory_bytes {int(given)}"
                      + (f", {share:.0%} of it the target's (the drafter shares the device)" if per_token_d else ""))

    if not str(device).startswith("cuda"):
        space = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if space:
            try:
                budget = int(float(space) * GiB)
            except ValueError:
                raise ConfigError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
            return KVSize(int(budget * share), f"VLLM_CPU_KVCACHE_SPACE={space} GiB (CPU host)")
        return KVSize(None, "nightdraft's default pool: on a CPU host gpu_memory_utilization has no "
                            "device to take a fraction of (set VLLM_CPU_KVCACHE_SPACE, GiB, as for vLLM's CPU backend)")

    util = float(args.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION))
    if not 0 < util <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    free, total = device_memory(device)
    requested = int(util * total)
    if free < requested:
        raise ConfigError(
            f"gpu_memory_utilization {util}: {device} has {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB, "
            f"less than the {requested / GiB:.1f} GiB asked for (as vLLM, the fraction is of the device's "
            "total memory, for this instance): lower it, or free the device")
    models = weight_bytes(target, dtype) // tp
    if drafter is not None and drafter_shares_device:
        models += weight_bytes(drafter, dtype)
    rows = max_num_seqs * (gamma_max + 1)
    transient = activation_bytes(target, dtype, max_num_batched_tokens=max_num_batched_tokens, max_logit_rows=rows)
    budget = requested - models - transient
    if budget < block_size * (per_token_t + per_token_d):
        raise ConfigError(
            f"gpu_memory_utilization {util} of {device} ({requested / GiB:.2f} GiB) leaves no KV cache: "
            f"weights {models / GiB:.2f} GiB and activations (estimated) {transient / GiB:.2f} GiB; raise it")
    return KVSize(int(budget * share),
                  f"gpu_memory_utilization {util} of {total / GiB:.1f} GiB on {device}, less weights "
                  f"{models / GiB:.2f} GiB and activations (estimated) {transient / GiB:.2f} GiB"
                  + (f"; {share:.0%} of the KV budget is the target's" if per_token_d else ""))
