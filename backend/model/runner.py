"""The model runner: one model's forward, with everything it needs.

It owns the KV cache the model writes, builds each forward's inputs (where the flat tokens go:
positions, cache slots, block tables, lengths) once per forward, or advances them to the next
draft position without reading the block tables again, and runs the forward: the captured step
where it covers the batch (decode and verification; the target's prompt chunks too), the eager
model otherwise (the drafter's prompts, or everything when nothing is captured). The engine and
the proposers say which sequences feed which tokens; nothing else builds tensors for a forward.
"""
from __future__ import annotations

import logging
import time

import torch

from backend.model.attention.base import AttentionMetadata
from backend.model.captured import COMPILE_ERRORS, CompiledStep
from backend.model.kv_cache import PagedKVCache
from backend.model.llama import CausalLM

log = logging.getLogger("nightdraft.runner")


def _reason(e: BaseException) -> str:
    """A compiler error's first line for the log (its messages run to pages)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class ModelRunner:
    def __init__(self, model: CausalLM, kv: PagedKVCache, captured: CompiledStep | None = None):
        self.model = model
        self.kv = kv
        self.captured = captured
        self._meta: AttentionMetadata | None = None      # the last forward's, for advance()
        self.captured_forwards = 0
        self.eager_forwards = 0
        self.last_prepare_s = 0.0      # the last forward's layout and input tensors

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def close(self) -> None:
        """Release what the runner holds beyond its tensors (a tensor-parallel group's ranks)."""

    def with_cache(self, kv: PagedKVCache) -> "ModelRunner":
        """A runner of the same model and captured step over another KV cache (calibration's
        throw-away pools)."""
        return ModelRunner(self.model, kv, self.captured)

    def forward(self, seq_ids: list, num_cached: list[int], num_new: list[int], input_ids: list[int],
                logits_indices: list[int] | None = None, lookahead: int = 0) -> torch.Tensor:
        """Logits ``[N, vocab]`` (float32) of one forward in which ``seq_ids[b]`` has
        ``num_cached[b]`` tokens cached and feeds ``num_new[b]`` of the flat `input_ids`; rows at
        `logits_indices` (flat token indices; None: each sequence's last token). `lookahead`:
        tokens the following :meth:`advance` calls will feed per sequence."""
        t0 = time.perf_counter()
        meta = self.model.prepare(self.kv, seq_ids, num_cached, num_new, lookahead)
        if logits_indices is None:
            idx = meta.last_token_indices
        else:
            idx = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        self.last_prepare_s = time.perf_counter() - t0
        return self._run(ids, meta, idx)

    def advance(self, keep: list[int], tokens: list[int]) -> torch.Tensor:
        """The next position after the last forward: its sequences `keep` (row numbers) feed one
        token each (`tokens`, in that order); logits ``[len(keep), vocab]``."""
        meta = self.model.attention.advance(self.kv, self._meta, keep)
        return self._run(torch.tensor(tokens, dtype=torch.long, device=self.device), meta,
                         meta.last_token_indices)

    def _run(self, input_ids: torch.Tensor, meta: AttentionMetadata, idx: torch.Tensor) -> torch.Tensor:
        self._meta = meta
        if self.captured is not None and self.captured.covers(meta):
            try:
                logits = self.captured(input_ids, meta, self.kv.kv, idx)
                self.captured_forwards += 1
                return logits
            except COMPILE_ERRORS as e:
                # The compiler gave up on a new shape (it traces before it runs anything): serve
                # on, op by op, rather than fail requests for a speed-up.
                log.error("the captured step failed to compile (%s); running op by op from now on", _reason(e))
                self.captured = None
        self.eager_forwards += 1
        return self.model(input_ids, meta, self.kv.kv, idx)


def capture_for(model: CausalLM, kv: PagedKVCache, setting: str, role: str,
                max_query_len: int) -> CompiledStep | None:
    """The captured step `setting` (EngineConfig.compile) asks for `model` (the "target" or the
    "drafter"), compiled now, or None ("auto" and "on" compile both wherever attention is the paged
    kernel, i.e. on the CPU). The target's graph is frozen (its weights pre-packed as constants:
    compiled without that it was slower than op by op from batch 16); the drafter's is not,
    because an offload moves its weights (docs/executor.md has the figures)."""
    if setting == "off":
        return None
    if model.attention.name != "paged":
        if setting == "auto":
            return None
        log.warning("compile %r: the %s's attention (%s) cannot run inside a compiled step; "
                    "it runs op by op", setting, role, model.attention.name)
        return None
    step = CompiledStep(model, max_query_len, freeze=role == "target")
    try:
        seconds = step.warm_up(kv)
    except COMPILE_ERRORS as e:
        # A compiler that cannot run here (no C++ toolchain, an environment it cannot read its own
        # files in) costs speed, never the model's load.
        log.error("could not compile the %s's decode step (%s); it runs op by op",
                  role, _reason(e))
        return None
    log.info("compiled the %s's decode and verification step (up to %d tokens a sequence) in %.1f s",
             role, max_query_len, seconds)
    return step
