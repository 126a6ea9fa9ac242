"""Attention backends: how a forward's attention runs over the paged KV cache.

A backend builds its metadata once per forward (``prepare``: the new tokens' positions and cache
slots, plus whatever its kernel needs) and runs attention in every layer (``attend``, which also
writes the new tokens' K/V into the cache). The model calls only these two, so a fused kernel (a
CUDA paged-attention library, say) is one new module implementing them, named in ``BACKENDS``.
"""
from __future__ import annotations

from backend.model.attention.base import AttentionBackend, AttentionMetadata
from backend.model.attention.sdpa import SdpaBackend

BACKENDS = {"sdpa": SdpaBackend}


def get_backend(name: str | AttentionBackend = "sdpa") -> AttentionBackend:
    if not isinstance(name, str):
        return name
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}") from None


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "SdpaBackend", "get_backend"]
