"""Row-parallel linears: each rank multiplies its slice of the input features, and one
all-reduce (``torch.distributed.all_reduce`` over the group) sums the partial outputs.

A rank's o and down projections become row-parallel in place (their class changes; parameters,
checkpoint names and the CPU kernel choice of :class:`~backend.model.linear.Linear` stay), so the
decoder code is the same as on one device: two all-reduces a layer, after attention and after
the MLP. The bias, where there is one, is the driver's only (the loader zeroes the others'), so
it is added once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from backend.model.linear import Linear


class RowParallelLinear(Linear):
    group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out, group=self.group)
        return out


def make_row_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Turn `model`'s o_proj and down_proj into row-parallel linears over `group`."""
    for layer in model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.__class__ = RowParallelLinear
            lin.group = group
