"""Linear layers that use the faster of two CPU kernels for each number of rows.

On the CPU, MKL's ``F.linear`` and a oneDNN linear on a prepacked weight
(``torch.ops.mkldnn._linear_pointwise``) cost differently by row count. Measured here on the
6.9 M-parameter target, one thread, all layers: 1 row 3.1 ms either way; 2 rows 4.7 against
3.5 ms; 5 rows 5.0 against 4.1 ms; 32 rows 9.0 against 9.3 ms; 64 rows 15.4 against 11.6 ms.
Verification feeds gamma + 1 rows per sequence, so the choice decides its cost.

``pack_linears(model)`` times both kernels on the model's own layers for a ladder of row counts
and lets each layer use the faster one; nothing changes where oneDNN is unavailable, on CUDA
(where ``F.linear`` is cuBLAS), or for other dtypes than float32 and bfloat16. The verdicts are
kept on disk (under ``$XDG_CACHE_HOME/nightdraft/kernels``), keyed by the layers' shapes, the
thread count, torch and the CPU, so only the first engine of a kind pays the second it takes.

The verdicts hold for one thread count: on the 2-core host, one thread's verdicts for the
bundled target chose MKL for most row counts and two threads' chose the packed kernel for all
(`benchmarks/results/lent-kernels/`). A target built at one thread beside a CPU drafter also
runs forwards on two, on the drafter's lent or borrowed cores: the prompts of a step that feeds
only prompts, a big forward, and every step where compiling is off (a compiled step picks its
own GEMMs). It adds that count's verdicts with ``add_thread_verdicts``, and each forward uses
the verdicts of the thread count in force.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROW_LADDER = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoints) that may also hold a prepacked copy of
    its weight and the row counts for which that copy is faster."""

    packed: torch.Tensor | None = None
    _use_packed: tuple[bool, ...] = ()      # per ROW_LADDER rung, at the thread count packed at
    _by_threads: dict[int, tuple[bool, ...]] = {}    # other thread counts' verdicts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A compiled step picks its own GEMM (the row count is symbolic there). The compiler's
        # test comes first so that tracing never reads `packed`: read, it would be guarded, and
        # packing the weights for another thread count after the compile (where one thread's
        # verdicts had packed nothing) would compile the step again at the first lent step.
        if not torch.compiler.is_compiling() and self.packed is not None:
            use = self._by_threads.get(torch.get_num_threads(), self._use_packed) if self._by_threads \
                else self._use_packed
            if use[_rung(x.shape[0])]:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def drop_packed(self) -> None:
        self.packed, self._use_packed, self._by_threads = None, (), {}


def _rung(rows: int) -> int:
    return min(bisect.bisect_left(ROW_LADDER, rows), len(ROW_LADDER) - 1)


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


@torch.inference_mode()
def pack_linears(model: nn.Module, reps: int = 7) -> dict[int, str]:
    """Pack every ``Linear`` of `model` and keep, per row count, the faster kernel over all its
    layers together (they stream their weights one after another, as in a forward). Returns
    {rows: "packed" | "mkl"} for the rungs of the ladder."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers or not packing_supported(layers[0].weight):
        return {}
    _pack(layers)
    choice = _verdicts(layers, reps)
    for lin in layers:
        lin._use_packed = tuple(choice)
        if not any(choice):
            lin.packed = None        # (its verdicts kept: another thread count may pack again)
    return _kernels(choice)


@torch.inference_mode()
def add_thread_verdicts(model: nn.Module, reps: int = 7) -> dict[int, str]:
    """After :func:`pack_linears`, the verdicts for the thread count in force now (the caller
    has placed this thread on the cores it will run them on): forwards on this many threads
    use them. Returns them as :func:`pack_linears` does ({} where nothing was packed)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers or not packing_supported(layers[0].weight) or not layers[0]._use_packed:
        return {}
    if layers[0].packed is None:         # dropped: no rung used it at the first thread count
        _pack(layers)
    choice = _verdicts(layers, reps)
    for lin in layers:
        lin._by_threads = {**lin._by_threads, torch.get_num_threads(): tuple(choice)}
    return _kernels(choice)


def _pack(layers: list["Linear"]) -> None:
    for lin in layers:
        lin.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)


def _kernels(choice: list[bool]) -> dict[int, str]:
    return {rows: "packed" if c else "mkl" for rows, c in zip(ROW_LADDER, choice)}


def _verdicts(layers: list["Linear"], reps: int) -> list[bool]:
    """Per ROW_LADDER rung, is the packed kernel faster at the thread count in force (from the
    disk cache where this kind was measured before)."""
    cache = _cache_file(layers)
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        choice = [_packed_is_faster(layers, rows, reps) for rows in ROW_LADDER]
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(choice))
        except OSError:
            pass                     # a read-only home: measure again next time
        return choice


def _packed_is_faster(layers: list[Linear], rows: int, reps: int) -> bool:
    """Both kernels timed in turns (so a noisy moment hits both), best of `reps` each; packed
    only when clearly faster, as a wrong pick costs more than a missed one."""
    xs = {lin.in_features: torch.randn(rows, lin.in_features, dtype=lin.weight.dtype) for lin in layers}
    kernels = (lambda: [F.linear(xs[lin.in_features], lin.weight, lin.bias) for lin in layers],
               lambda: [torch.ops.mkldnn._linear_pointwise(xs[lin.in_features], lin.packed, lin.bias,
                                                            "none", [], "") for lin in layers])
    best = [float("inf"), float("inf")]
    for k in kernels:
        k()                                  # warm
    for _ in range(reps):
        for i, k in enumerate(kernels):
            t0 = time.perf_counter()
            k()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[1] < 0.95 * best[0]


def _cache_file(layers: list[Linear]) -> Path:
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    key = json.dumps([[list(lin.weight.shape) for lin in layers], str(layers[0].weight.dtype),
                      torch.get_num_threads(), torch.__version__, cpu, ROW_LADDER])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nightdraft" / "kernels"
    return base / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def drop_packed(model: nn.Module) -> None:
    """Forget the packed copies (the weights are about to move or change)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.drop_packed()
