"""Attention backends: how a forward's attention runs over the paged KV cache.

A backend builds its metadata once per forward (``prepare``: the new tokens' positions and cache
slots, plus whatever its kernel needs) and runs attention in every layer (``attend``, which also
writes the new tokens' K/V into the cache). The model calls only these two, so a fused kernel (a
CUDA paged-attention library, say) is one new module implementing them, named in ``BACKENDS``.
"""
from __future__ import annotations

import torch

from backend.model.attention import kernels
from backend.model.attention.base import AttentionBackend, AttentionMetadata
from backend.model.attention.paged import PagedBackend
from backend.model.attention.sdpa import SdpaBackend

BACKENDS = {"paged": PagedBackend, "sdpa": SdpaBackend}
ATTENTION_CHOICES = ("auto", *BACKENDS)


def resolve(name: str, device: str | torch.device) -> str:
    """The backend `name` means on `device`: "auto" is the paged kernel on the CPU where it could
    be built, else the reference (sdpa)."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_CHOICES)}")
        return name
    return "paged" if torch.device(device).type == "cpu" and kernels.load() else "sdpa"


_instances: dict[str, AttentionBackend] = {}


def get_backend(name: str | AttentionBackend = "sdpa", device: str | torch.device = "cpu") -> AttentionBackend:
    """The backend `name` means on `device`. Backends hold no state: one instance each, shared by
    every model (so that same-shaped models share their compiled steps, which see the backend)."""
    if not isinstance(name, str):
        return name
    name = resolve(name, device)
    if name not in _instances:
        _instances[name] = BACKENDS[name]()
    return _instances[name]


__all__ = ["ATTENTION_CHOICES", "AttentionBackend", "AttentionMetadata", "BACKENDS", "PagedBackend",
           "SdpaBackend", "get_backend", "resolve"]
