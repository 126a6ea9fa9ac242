"""Captured steps: decode and verification forwards run as compiled graphs.

A decode or verification forward (every sequence feeds 1..``max_query_len`` tokens) spends most
of a small model's time outside its matmuls when it runs op by op: each PyTorch op costs a few
microseconds of dispatch, about a hundred ops a layer. :class:`CompiledStep` compiles the model's
forward once with inductor (the CPU path): the norms, rotary embedding, activations and residual
adds fuse into a few C++ loops, the GEMMs stay library calls, and attention stays its own kernel
(``torch.ops.nightdraft.paged_attention``, opaque to the compiler: compiling attention itself was
2x slower than the kernel at batch 32).

The graph has dynamic token, sequence and logits-row counts, so one compilation covers every
batch. Sizes of 1 are special to the compiler (it specialises on them): the step pads the
sequence count, the block-table width and the logits rows to at least 2 (an empty sequence, a
zero column, a repeated row: the kernel skips the first, never reads the second, and the third is
dropped), and marks the token count as one the compiler may not read, so a one-token step
(batch-1 decode) runs the same graph. The frozen target's graph serves prompt chunks as well (the
attention kernel takes any query length): on the bundled target a prompt's forward took
0.58-0.90x its time op by op, from 10 to 1,000 tokens, the fixed cost of dispatch gone and the
pre-packed GEMMs kept (benchmarks/results/captured-prompts/). The drafter's graph, whose GEMMs
are not pre-packed, tied its model op by op there, and keeps to decode and verification.

The frozen target's graph also serves every thread count: its loops take the thread count at
run time (inductor's ``cpp.dynamic_threads``) and the compiler's guard on it is dropped
(:func:`_any_thread_count`), so the step that runs on the drafter's lent cores (more threads
than the target was built at) runs the graph made at build. That leaves one graph per model (a
second graph of the frozen target would hold a second packed copy of its weights). The
drafter's step runs at one thread count and keeps loops planned for it.
Compiled code is cached on disk by inductor (``$TORCHINDUCTOR_CACHE_DIR``, by default
``~/.cache/nightdraft/inductor``), so a restart traces again (seconds) but builds no C++ again;
the frozen target's graph, whose pre-packed weights the cache cannot store, is lowered again too
(docs/executor.md has what a start costs).
"""
from __future__ import annotations

import contextlib
import locale
import logging
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from backend.model.attention.base import AttentionMetadata
from backend.model.kv_cache import PagedKVCache

log = logging.getLogger("nightdraft.captured")


class StepTensors(NamedTuple):
    """The attention metadata a compiled step reads: tensors only (no Python-side fields, which a
    compiled graph would have to guard on)."""
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor


def step_tensors(meta: AttentionMetadata) -> StepTensors:
    """`meta` padded to at least two sequences and two block-table columns (see the module)."""
    tables, starts, lens = meta.block_tables, meta.query_start, meta.context_lens
    if tables.shape[1] < 2:
        tables = torch.cat((tables, tables.new_zeros(tables.shape[0], 2 - tables.shape[1])), dim=1)
    if lens.shape[0] < 2:      # an empty sequence: no tokens, no context
        tables = torch.cat((tables, tables.new_zeros(1, tables.shape[1])))
        starts = torch.cat((starts, starts[-1:]))
        lens = torch.cat((lens, lens.new_zeros(1)))
    return StepTensors(meta.positions, meta.slot_mapping, tables, starts, lens)


# Every model instance of the same shapes shares its compiled graphs (they guard on shapes, not
# on the instance); each further shape (another checkpoint) adds a graph to the same code.
RECOMPILE_LIMIT = 64
# The token count inductor plans its loops for (the token dimension has no size to read at
# tracing, see CompiledStep.warm_up): a decode step of a few sequences.
TOKENS_HINT = 4
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError)


def _utf8_files() -> None:
    """The compiler reads its own UTF-8 sources with Python's default encoding. An embedded
    interpreter under a C locale (Triton's backend stub) gets ASCII there, where a standalone
    python3 would have coerced the locale: coerce it the same way here."""
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue
    log.warning("no UTF-8 locale to read the compiler's files with; compiling may fail")


def _configure_compiler() -> None:
    _utf8_files()
    # Compiled code outlives the process here, not in /tmp (inductor's default), so that a
    # restart (or the drafter worker a restart brings) loads it instead of compiling again.
    # (Inductor sets the variable to its default on first use: replace that, not a user's choice.)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nightdraft" / "inductor")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # Equal sizes (a block table two wide, a model two layers deep) must not become a guard that
    # two unrelated dimensions stay equal.
    torch.fx.experimental._config.use_duck_shape = False
    # A model's floats (its norms' epsilon, the embedding's norm type) are constants of the
    # model. Traced as inputs (a dynamic compile's default), they could not be turned into
    # tensors, so the tracer specialised them and started over: every start traced the step
    # twice (about 3 s of the bundled target's, benchmarks/results/trace-once/).
    torch._dynamo.config.specialize_float = True


def _any_thread_count(guards) -> list[bool]:
    """The guards a compiled step keeps: all but dynamo's GLOBAL_STATE guard, whose one part
    that changes around a step is torch's thread count (the lent cores run the step on more
    threads than it was built at; the loops read the count at run time). What else that guard
    covers cannot change a step's graph here: grad mode (the weights never require grad, and
    the step runs in inference mode, which the tensors' own guards check), and autocast, the
    deterministic algorithms and the torch-function mode keep guards of their own."""
    return [g.guard_type != "GLOBAL_STATE" for g in guards]


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (every model's, warm-ups included):
    one that rises while requests run is a recompilation, which costs a step seconds. 0 when
    nothing was compiled (the compiler is not even imported then)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


class CompiledStep:
    """The model's decode and verification forwards (the frozen target's prompt chunks too),
    compiled with inductor (see the module)."""

    kind = "inductor"

    def __init__(self, model: torch.nn.Module, max_query_len: int, freeze: bool = False):
        _configure_compiler()
        self.model = model
        self.max_query_len = max_query_len
        self.frozen = freeze
        self.compile_s = 0.0          # spent in warm_up (a later recompilation: compiled_graphs())
        # Freezing makes the weights constants of the graph, which lets inductor pre-pack them for
        # oneDNN's GEMMs (about 1.2-1.4x a decode step of the bundled target, docs/executor.md).
        # The graph then holds its own copy of the weights: only for a model whose weights never
        # move (the drafter's are offloaded and reloaded).
        # Its loops then ask OpenMP for the thread count when they run, not a count fixed when
        # they were generated, and the guard on the count goes: one graph runs at one thread and
        # on the lent cores (see _any_thread_count). Not the drafter's: it runs at one count, and
        # with run-time thread counts its step came to 5.0x its floor at batch 16 in `bench
        # profile`, against 3.4-4.1x with loops planned for the count
        # (benchmarks/results/one-graph-all-threads/).
        # (As a config patch around every call: the compiler reads the flags when it traces, which
        # is at the first call of each new shape; torch.compile's `options` did not reach them,
        # where the tracer's own hook, the guard filter, is read.)
        self._fn = torch.compile(model.forward, fullgraph=True, dynamic=True,
                                 options={"guard_filter_fn": _any_thread_count} if freeze else {})
        self._config = (torch._inductor.config.patch({"freezing": True, "cpp.dynamic_threads": True})
                        if freeze else contextlib.nullcontext())

    def covers(self, meta: AttentionMetadata) -> bool:
        # The frozen target's graph takes prompt chunks too (see the module); the drafter's
        # keeps to decode and verification, where it pays.
        return ((self.frozen or meta.max_query_len <= self.max_query_len)
                and meta.block_tables.device.type == "cpu")

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: torch.Tensor,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids, step_tensors(meta), kv, logits_indices)

    def _run(self, input_ids: torch.Tensor, tensors: StepTensors, kv: torch.Tensor,
             logits_indices: torch.Tensor) -> torch.Tensor:
        n = logits_indices.shape[0]
        if n < 2:
            logits_indices = torch.cat((logits_indices, logits_indices[:1].expand(2 - n)))
        with self._config:
            logits = self._fn(input_ids, tensors, kv, logits_indices)
        return logits[:n] if n < 2 else logits

    @torch.inference_mode()
    def warm_up(self, kv: PagedKVCache, batch: int = 3) -> float:
        """Compile now, on throw-away sequences in `kv` (freed again): one graph, run at one token,
        at one token a sequence and at the most. Returns the seconds it took."""
        t0 = time.perf_counter()
        ids = [f"__warm_up_{i}" for i in range(batch)]
        try:
            for sid in ids:
                if not kv.ensure_capacity(sid, 2 * kv.block_size + self.max_query_len):
                    raise RuntimeError("the KV pool is too small to compile the decode step in")
            for b, q in ((1, 1), (batch, 1), (batch, self.max_query_len)):
                meta = self.model.prepare(kv, ids[:b], [kv.block_size + 1] * b, [q] * b)
                tokens = torch.zeros(b * q, dtype=torch.long, device=kv.device)
                tensors = step_tensors(meta)
                for per_token in (tokens, tensors.positions, tensors.slot_mapping):
                    # A token count the compiler may not specialise on: one token (batch-1
                    # decode) then runs the graph of every other count (see the module). Read
                    # when it traces, so marked where it traces: here (about 40 us a step if
                    # marked on every call).
                    torch._dynamo.decorators.mark_unbacked(per_token, 0, shape_id="tokens",
                                                           hint_override=TOKENS_HINT)
                self._run(tokens, tensors, kv.kv, torch.arange(b * q, device=kv.device))
        finally:
            for sid in ids:
                kv.free(sid)
        seconds = time.perf_counter() - t0
        self.compile_s += seconds
        return seconds
