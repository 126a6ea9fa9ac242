"""The floor of a forward: its matmuls alone, at the forward's shapes.

What no step can beat on this hardware: every linear layer of the model applied to ``rows``
input rows (the tokens the forward feeds), plus the output projection on ``logits_rows`` rows,
with each layer's own weights (streamed from memory as in a real forward, not one small matrix
kept hot in cache), timed with the fastest kernel the model itself uses for that shape
(:mod:`backend.model.linear`). Attention, norms, rope, the metadata, sampling and everything in
Python are what a step adds on top.
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
