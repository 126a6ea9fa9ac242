"""The floor of a forward: its matmuls alone at the forward's shapes, and one read of the K/V it attends.

What no step can beat on this hardware: every linear layer of the model applied to ``rows``
input rows (the tokens the forward feeds), plus the output projection on ``logits_rows`` rows,
with each layer's own weights (streamed from memory as in a real forward, not one small matrix
kept hot in cache), timed with the fastest kernel the model itself uses for that shape
(:mod:`backend.model.linear`); and attention's unavoidable work, one read of the K/V of every
context the forward attends, at the copy bandwidth measured for a buffer of that size
(:func:`kv_read_floor`). Norms, rope, the metadata, sampling and everything in Python are what a
step adds on top.
"""
from __future__ import annotations

import statistics
import time

import torch

from backend.model.linear import linear
from backend.model.llama import CausalLM


def _weights(model: CausalLM) -> list:
    out = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
    return out


@torch.inference_mode()
def forward_floor(model: CausalLM, rows: int, logits_rows: int | None = None, reps: int = 15) -> float:
    """Median seconds of the matmuls of one forward over `rows` tokens (logits on
    `logits_rows` of them, default all)."""
    logits_rows = rows if logits_rows is None else logits_rows
    layers = _weights(model)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    dtype, device = head.dtype, head.device
    inputs = {lin.in_features: torch.randn(rows, lin.in_features, dtype=dtype, device=device)
              for lin in layers}
    x_head = torch.randn(max(logits_rows, 1), head.shape[1], dtype=dtype, device=device)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        for lin in layers:
            lin(inputs[lin.in_features])
        if logits_rows:
            linear(x_head, head)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def kv_bytes_per_token(model: CausalLM) -> int:
    """Bytes of K and V one token holds in the cache, all layers, in the model's dtype."""
    c = model.config
    elem = next(model.parameters()).element_size()
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * elem


def copy_bandwidth(nbytes: int, device="cpu", reps: int = 15) -> float:
    """Bytes a second a copy of an `nbytes` buffer moves (it reads them and writes them), median
    of `reps`: the memory speed attention's one read of the K/V it attends is held to."""
    n = max(nbytes // 4, 1024)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.device.type == "cuda":
            torch.cuda.synchronize(src.device)
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times[2:])


def kv_read_floor(model: CausalLM, context_tokens: int, bandwidth: float) -> float:
    """Seconds to read the K/V of `context_tokens` tokens once at `bandwidth` (copy_bandwidth):
    what attention cannot beat, however its kernel is written."""
    return context_tokens * kv_bytes_per_token(model) / bandwidth
