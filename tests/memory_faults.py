"""Out of memory, on demand: the KV cache's allocations fail as on a full device.

``allocations_fail(monkeypatch)`` is a context manager; inside it every new tensor that
:mod:`backend.model.kv_cache` asks torch for (a pool, or a copy of one) raises torch's
out-of-memory error, as an allocation on a GPU without room does. Nothing else is affected.
"""
from __future__ import annotations

import contextlib

import torch

OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", RuntimeError)
_ALLOCATORS = ("zeros", "empty", "zeros_like", "empty_like", "full", "ones")


def _no_memory(*args, **kwargs):
    raise OUT_OF_MEMORY("injected: the device is out of memory")


class _TorchWithoutMemory:
    """Stands for `torch` inside backend.model.kv_cache."""

    def __getattr__(self, name):
        return _no_memory if name in _ALLOCATORS else getattr(torch, name)


@contextlib.contextmanager
def allocations_fail(monkeypatch, *, tensor_copies: bool = True):
    """`tensor_copies`: Tensor.clone fails too (everywhere, while inside: keep the block short)."""
    import backend.model.kv_cache as kv_cache_module
    with monkeypatch.context() as m:
        m.setattr(kv_cache_module, "torch", _TorchWithoutMemory())
        if tensor_copies:
            m.setattr(torch.Tensor, "clone", _no_memory)
        yield
