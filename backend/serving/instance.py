"""Where Triton put a model instance, and the engine devices that follow.

Triton tells each instance its kind and device in ``initialize``'s args
(``model_instance_kind``: ``GPU`` / ``CPU`` / ``MODEL``, ``model_instance_device_id``). Each
instance is its own engine (its own weights, KV pool and drafter), so ``count: 2`` means two
engines, and Triton spreads requests over them. The target goes where the instance is:

- ``KIND_MODEL``: the model places itself: engine.json's ``device``, else model.json's, else
  (model.json only, as vLLM's ``device: auto``) ``cuda:0`` when there is a GPU, the CPU otherwise;
  for engine.json alone the CPU (EngineConfig's default).
- ``KIND_CPU``: the CPU. engine.json may say ``device: "cpu"`` or nothing.
- ``KIND_GPU``: ``cuda:<the instance's device id>``. engine.json may say ``device: "cuda"``, that
  same ``cuda:N``, or nothing; one config then serves every GPU of the group (``gpus: [0, 2]``).

The drafter's device (``drafter_device``) is unset (in the target's process, on its device),
named (``cuda:N``, ``cpu``, ``cpu:CORES``), or relative to the target's GPU (``cuda:+K``: K GPUs
after it, so each instance of a KIND_GPU group gets the GPU beside its own). A layout that cannot
work is refused at load with a message: a GPU that is not there, a relative drafter for a target
on the CPU, a kind that contradicts engine.json's device.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from backend.errors import ConfigError

_CUDA = re.compile(r"cuda(?::(\d+))?")
_CUDA_RELATIVE = re.compile(r"cuda:\+(\d+)")


@dataclass(frozen=True)
class Placement:
    device: str
    drafter_device: str | None
    why: str            # one line for the load log


def _cuda_index(device: str) -> int | None:
    m = _CUDA.fullmatch(device)
    if m is None:
        return None
    return int(m.group(1) or 0)


def place(kind: str, device_id: int, *, engine_device: str | None, engine_drafter_device: str | None,
          vllm_device: str | None, model_json_only: bool, cuda_count: int) -> Placement:
    """The target's and the drafter's devices for an instance of ``kind`` on ``device_id``."""
    kind = (kind or "MODEL").upper()
    if kind == "GPU":
        if cuda_count == 0:
            raise ConfigError("instance group KIND_GPU, but no CUDA device is visible to this process")
        if engine_device is not None:
            idx = _cuda_index(engine_device)
            if idx is None or (engine_device != "cuda" and idx != device_id):
                raise ConfigError(
                    f"the instance group puts this instance on GPU {device_id} (KIND_GPU), but the engine "
                    f"configuration says device {engine_device!r}: leave `device` out (or \"cuda\") to follow "
                    "the instance group, or use KIND_MODEL to place the engine yourself")
        device, why = f"cuda:{device_id}", f"KIND_GPU instance on GPU {device_id}"
    elif kind == "CPU":
        if engine_device is not None and engine_device != "cpu":
            raise ConfigError(f"the instance group is KIND_CPU, but the engine configuration says device "
                              f"{engine_device!r}: use KIND_GPU or KIND_MODEL for a GPU")
        device, why = "cpu", "KIND_CPU instance"
    else:
        if engine_device is not None:
            device, why = engine_device, "KIND_MODEL: engine.json's device"
        elif vllm_device is not None:
            device, why = vllm_device, "KIND_MODEL: model.json's device"
        elif model_json_only and cuda_count > 0:
            device, why = "cuda:0", "KIND_MODEL: device auto, a GPU is visible"
        else:
            device, why = "cpu", "KIND_MODEL: device auto, no GPU" if model_json_only else "KIND_MODEL: the default device"
    target_idx = _cuda_index(device)
    if target_idx is not None and target_idx >= cuda_count:
        raise ConfigError(f"the target's device {device} is not there: {cuda_count} CUDA device(s) visible")

    drafter = engine_drafter_device
    if drafter is not None:
        rel = _CUDA_RELATIVE.fullmatch(drafter)
        if rel is not None:
            if target_idx is None:
                raise ConfigError(f"drafter_device {drafter!r} is relative to the target's GPU, but the "
                                  f"target is on {device}")
            drafter = f"cuda:{target_idx + int(rel.group(1))}"
        idx = _cuda_index(drafter)
        if idx is not None and idx >= cuda_count:
            raise ConfigError(f"drafter_device {engine_drafter_device!r} is {drafter} for the target on {device}, "
                              f"but {cuda_count} CUDA device(s) are visible")
        why += f"; drafter on {drafter}"
    return Placement(device, drafter, why)
