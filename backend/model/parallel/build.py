"""The engine's target runner: one device, or a tensor-parallel group (see the package)."""
from __future__ import annotations

import logging
import os

import torch

from backend.errors import ConfigError
from backend.model.config import ModelConfig
from backend.model.kv_cache import PagedKVCache
from backend.model.linear import pack_linears
from backend.model.loader import load_model
from backend.model.runner import ModelRunner, capture_for

log = logging.getLogger("nightdraft.tensor_parallel")


def rank_devices(device: str, size: int, devices: list[str] | None) -> list[str]:
    """Each rank's torch device (the driver's first). CPU: every rank "cpu". CUDA: `devices` as
    given (a list may name one GPU twice: ranks then share it), else the engine's GPU and the
    size-1 after it (cuda:0..size-1 for "cuda"), which must exist."""
    if not str(device).startswith("cuda"):
        return ["cpu"] * size
    if devices is not None:
        return list(devices)
    first = default_first_gpu(device)
    count = torch.cuda.device_count()
    if count < first + size:
        raise ConfigError(f"tensor_parallel_size {size} on {device} needs cuda:{first}..cuda:{first + size - 1}, "
                          f"{count} GPU(s) visible; list tensor_parallel_devices to place ranks "
                          "(e.g. two on one GPU)")
    return [f"cuda:{first + i}" for i in range(size)]


def default_first_gpu(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


def _cpu_shares(size: int, threads: int | None) -> tuple[list[list[int]], int]:
    """Each rank's cores and its thread count, from this process's cores: an equal share each
    where there are enough, else every rank on all of them, one thread each. (Always named: a
    rank forked from the fork server would inherit the server's affinity, not this process's.)"""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= size:
        k = len(cores) // size
        return [cores[i * k:(i + 1) * k] for i in range(size)], threads or k
    return [cores] * size, threads or 1


def build_target_runner(config, dtype: torch.dtype) -> ModelRunner:
    """The target's runner for engine configuration `config` (loaded, its KV pool allocated)."""
    size = config.tensor_parallel_size
    if size == 1:
        model = load_model(config.target, device=config.device, dtype=dtype, attention=config.attention)
        if config.linear_kernels == "auto":
            pack_linears(model)
        kv = PagedKVCache.for_model(model.config, config.kv_cache_bytes, block_size=config.block_size,
                                    dtype=dtype, device=config.device)
        return ModelRunner(model, kv, capture_for(model, kv, config.compile, "target",
                                                  max_query_len=config.gamma_max + 1))
    return _tensor_parallel_runner(config, dtype, size)


def _tensor_parallel_runner(config, dtype: torch.dtype, size: int) -> ModelRunner:
    from backend.model.parallel.driver import ShardedKVCache, TargetGroup, TensorParallelRunner
    from backend.model.parallel.group import RankSpec
    from backend.model.parallel.shard import check_divisible, load_shard

    check_divisible(ModelConfig.from_pretrained(config.target), size)
    devices = rank_devices(config.device, size, config.tensor_parallel_devices)
    on_cuda = devices[0].startswith("cuda")
    # NCCL refuses two ranks on one GPU: those (and CPU ranks) all-reduce over gloo.
    backend = "nccl" if on_cuda and len(set(devices)) == size else "gloo"
    cores, threads = _cpu_shares(size, config.num_threads) if not on_cuda else ([None] * size, 1)
    if not on_cuda:
        torch.set_num_threads(threads)
    if config.compile == "on":
        log.warning("compile 'on': a tensor-parallel target runs op by op (its all-reduces are not "
                    "inside a compiled step)")
    model = load_shard(config.target, 0, size, device=devices[0], dtype=dtype, attention=config.attention)
    if config.linear_kernels == "auto":
        pack_linears(model)
    kv = ShardedKVCache.for_model(model.config, config.kv_cache_bytes, block_size=config.block_size,
                                  dtype=dtype, device=devices[0])
    specs = [RankSpec(path=config.target, size=size, device=devices[i], dtype=str(dtype).removeprefix("torch."),
                      attention=config.attention, block_size=config.block_size, num_blocks=kv.num_blocks,
                      pack_linears=config.linear_kernels == "auto", port=0,
                      timeout_s=config.tensor_parallel_timeout_s, backend=backend,
                      cores=cores[i], threads=threads)
             for i in range(size)]
    group = TargetGroup(model, kv, specs)
    log.info("target in a tensor-parallel group of %d (%s, %s all-reduce; ranks %s), %d KV blocks "
             "of its heads on each", size, ", ".join(devices), backend, group.pids, kv.num_blocks)
    return TensorParallelRunner(model, kv, group)
