"""Tensor parallelism of the target over a group of devices (torch.distributed).

:func:`build_target_runner` is where an engine gets its target: a plain
:class:`~backend.model.runner.ModelRunner` on one device, or with ``tensor_parallel_size`` > 1
the driver's :class:`~backend.model.parallel.driver.TensorParallelRunner` over a group of rank
processes. Nothing else in the engine knows the difference.
"""
from backend.model.parallel.build import build_target_runner, rank_devices

__all__ = ["build_target_runner", "rank_devices"]
