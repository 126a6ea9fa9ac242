"""Engine configuration: what to load, where, and how to decode. Validated at load time."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from backend.engine.core_lending import MEASURED
from backend.engine.paths import resolve_checkpoint, resolve_local
from backend.errors import ConfigError
from backend.mode import CONFIGURED_MODES, Mode, ProposerKind

ATTENTION_CHOICES = ("auto", "paged", "sdpa")
COMPILE_CHOICES = ("auto", "on", "off")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    target: str
    drafter: str | None = None
    tokenizer: str | None = None                # default: the target's directory
    device: str = "cpu"
    # Where the drafter runs. None: in the target's process on `device`. "cuda:N": a worker
    # process on that GPU. "cpu" / "cpu:CORES" (e.g. "cpu:1", "cpu:2-3"): a worker process pinned
    # to those cores (default: the last core), with the target kept on the others.
    drafter_device: str | None = None
    drafter_timeout_s: float = 10.0             # a worker silent this long is declared hung
    drafter_restart_s: float = 2.0              # wait this long after a failure before restarting,
    drafter_restart_max_s: float = 60.0         # twice as long after each failure before it served, up to this
    drafter_reload_timeout_s: float = 60.0      # offloaded weights not back by then: the drafter failed
    # How a worker's draft probabilities travel: "shared_buffer" (CPU default) or "tensor"
    # (CUDA default: CUDA IPC; on CPU, shared-memory file descriptors).
    drafter_probs_transport: str | None = None
    # Tensor parallelism of the target: its layers split over this many ranks (the engine's
    # process drives rank 0; the others are processes of their own). CPU: every rank on this
    # host's cores (an equal share each where there are enough). CUDA: rank i on
    # tensor_parallel_devices[i] (default: `device` and the N-1 GPUs after it; a list may name
    # one GPU twice). A rank
    # whose collective does not complete within tensor_parallel_timeout_s fails the group, which
    # restarts. kv_cache_bytes is each rank's pool (of its own heads).
    tensor_parallel_size: int = 1
    tensor_parallel_devices: list[str] | None = None
    tensor_parallel_timeout_s: float = 10.0
    dtype: str = "auto"                         # auto: bfloat16 on CUDA, float32 on CPU
    kv_cache_bytes: int = 64 << 20
    drafter_kv_cache_bytes: int | None = None   # default: sized to hold as many tokens as the target's
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048          # prefill chunk budget per step
    max_model_len: int | None = None            # default: the target's max_position_embeddings,
                                                # capped at what the KV pool holds
    # Admission limits. A prompt longer than max_prompt_bytes (default: the most bytes
    # max_model_len tokens can spell) is refused before it is tokenized; beyond max_waiting
    # queued requests or max_waiting_bytes of queued prompt text the server answers "busy".
    max_prompt_bytes: int | None = None
    max_waiting: int = 256
    max_waiting_bytes: int = 64 << 20
    mode: Mode | None = None                    # default: SD with a drafter, else AR (a name parses)
    # What proposes drafts (ProposerKind): DRAFTER (the drafter checkpoint), NGRAM (prompt lookup: the
    # continuation of the latest earlier occurrence of the last n tokens, n in
    # [ngram_min, ngram_max]; no model, no device, no KV), or BOTH (mode auto: the planner
    # picks the drafter model, n-gram drafts or none, per step).
    proposer: ProposerKind = ProposerKind.DRAFTER
    ngram_min: int = 1
    ngram_max: int = 4
    gamma: int = 4
    gamma_max: int = 8
    # Mode.AUTO: the adaptive planner picks mode and gamma every step.
    offload: bool = True                        # ... and may move the drafter off the device
    planner: dict | None = None                 # Planner settings (planner/planner.py), e.g.
                                                # {"offload_after_steps": 50, "kv_pressure": 0.9}
    # ... starting from a cost model: "calibrate" (time the target's and the drafter's forwards
    # at load, 1-3 s on a small CPU), "off" (the bandit starts cold), or a JSON file with a
    # cost profile ({"verify": [[b, n, s], ...], "draft": [[b, s], ...]}, at the top level or
    # under "profile", as `nightdraft bench compare` writes it).
    planner_cost_profile: str = "calibrate"
    # ... and, with the drafter a worker on CPU cores of its own, those cores join the target's
    # forward (one more torch thread each) while plain decoding runs, and go back before drafting.
    # true: always; "measured" (the default): where plain decoding measures faster with them,
    # per batch size (backend/engine/core_lending.py); false: never.
    lend_drafter_cores: bool | str = MEASURED
    # With the drafter a worker on its own device: after each in-line proposal it drafts the
    # next round while the target verifies, betting on every draft accepted (PEARL; used when
    # the bet wins, dropped when not). Sequential SD and batch-parallel SD's in-line fallback
    # (a sub-batch with nothing drafted, e.g. a single running request) use it.
    draft_ahead: bool = False
    seed: int = 0
    num_threads: int | None = None              # torch intra-op threads for this process
    # CPU linear kernels: "auto" measures MKL against prepacked oneDNN per row count (once,
    # cached) and uses the faster; "mkl" keeps F.linear everywhere.
    linear_kernels: str = "auto"
    # Attention: "paged" (a C++ kernel that reads each sequence's K/V through its block table
    # once; CPU), "sdpa" (PyTorch's scaled_dot_product_attention over gathered contexts: the
    # reference, any device), "auto" (paged where it runs, else sdpa).
    attention: str = "auto"
    # Captured decode/verify steps (vLLM's enforce_eager is compile "off"): "on" compiles the
    # target's and the drafter's steps, "off" runs everything op by op, "auto" compiles where
    # that measured faster (the drafter on the CPU: docs/executor.md). Compiling takes tens of
    # seconds per model on a first start; inductor caches the code on disk for the next.
    # $NIGHTDRAFT_COMPILE sets the default (the test suite runs with "off" but where it tests this).
    compile: str = dataclasses.field(default_factory=lambda: os.environ.get("NIGHTDRAFT_COMPILE", "auto"))

    def __post_init__(self) -> None:
        try:
            self.proposer = ProposerKind.parse(self.proposer)
            if self.mode is None:
                self.mode = Mode.SD if self.drafter or self.proposer is ProposerKind.NGRAM else Mode.AR
            self.mode = Mode.parse(self.mode, CONFIGURED_MODES)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.dtype == "auto":
            self.dtype = "bfloat16" if str(self.device).startswith("cuda") else "float32"
        self.validate()

    def ngram_only(self) -> "EngineConfig":
        """This configuration's n-gram proposer alone (proposer "both" holds it beside the drafter)."""
        return dataclasses.replace(self, proposer=ProposerKind.NGRAM, drafter=None, drafter_device=None, mode=Mode.SD,
                                   draft_ahead=False)

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(isinstance(self.target, str) and bool(self.target), "target: a checkpoint directory is required")
        need(Path(self.target, "config.json").is_file(), f"target: no config.json in {self.target!r}")
        if self.tokenizer is not None:
            need(Path(self.tokenizer, "tokenizer.json").is_file(), f"tokenizer: no tokenizer.json in {self.tokenizer!r}")
        if self.drafter is not None:
            need(Path(self.drafter, "config.json").is_file(), f"drafter: no config.json in {self.drafter!r}")
        need(self.mode in CONFIGURED_MODES and self.proposer in ProposerKind,
             f"mode, proposer: {self.mode!r}, {self.proposer!r} are not a mode and a proposer kind")
        if self.proposer is ProposerKind.NGRAM:
            need(self.drafter is None, f"proposer {ProposerKind.NGRAM.value!r} takes no drafter checkpoint")
            need(self.mode is not Mode.PSD, f"mode {Mode.PSD.value!r} needs a drafter model on its own device; n-gram "
                 "proposals cost nothing to overlap")
            need(_is_int(self.ngram_min) and _is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max <= 16,
                 "ngram_min, ngram_max: integers with 1 <= ngram_min <= ngram_max <= 16")
        else:
            need(self.mode is Mode.AR or self.drafter is not None,
                 f"mode {self.mode.value!r} needs a drafter checkpoint")
        if self.proposer is ProposerKind.BOTH:
            need(self.drafter is not None and self.mode is Mode.AUTO,
                 f"proposer {ProposerKind.BOTH.value!r} (drafter model and n-gram, chosen per step) needs "
                 f"a drafter checkpoint and mode {Mode.AUTO.value!r}")
        need(self.mode is not Mode.PSD or self.drafter_device is not None,
             f"mode {Mode.PSD.value!r} needs the drafter on its own device: set drafter_device "
             "(e.g. \"cpu\" for a worker pinned to its own core, or \"cuda:1\")")
        if self.drafter_device is not None:
            need(isinstance(self.drafter_device, str) and (
                self.drafter_device == "cpu" or self.drafter_device.startswith(("cpu:", "cuda"))),
                f"drafter_device: 'cpu', 'cpu:CORES' or 'cuda:N', got {self.drafter_device!r}")
        need(isinstance(self.drafter_timeout_s, (int, float)) and self.drafter_timeout_s > 0,
             "drafter_timeout_s: must be > 0")
        need(isinstance(self.drafter_restart_s, (int, float)) and self.drafter_restart_s >= 0,
             "drafter_restart_s: must be >= 0")
        need(isinstance(self.drafter_restart_max_s, (int, float)) and self.drafter_restart_max_s >= 0,
             "drafter_restart_max_s: must be >= 0 (below drafter_restart_s, it is drafter_restart_s)")
        need(isinstance(self.drafter_reload_timeout_s, (int, float)) and self.drafter_reload_timeout_s > 0,
             "drafter_reload_timeout_s: must be > 0")
        need(self.drafter_probs_transport in (None, "shared_buffer", "tensor"),
             "drafter_probs_transport: 'shared_buffer' or 'tensor'")
        need(isinstance(self.offload, bool), "offload: must be true or false")
        need(isinstance(self.lend_drafter_cores, bool) or self.lend_drafter_cores == MEASURED,
             'lend_drafter_cores: true, false or "measured"')
        need(isinstance(self.draft_ahead, bool), "draft_ahead: must be true or false")
        need(not self.draft_ahead or (self.drafter_device is not None and self.proposer is ProposerKind.DRAFTER),
             "draft_ahead: needs a drafter model on its own device (set drafter_device); drafting "
             "ahead in line would only delay the step")
        need(self.linear_kernels in ("auto", "mkl"), "linear_kernels: 'auto' or 'mkl'")
        need(self.attention in ATTENTION_CHOICES, f"attention: one of {ATTENTION_CHOICES}, got {self.attention!r}")
        need(self.compile in COMPILE_CHOICES, f"compile: one of {COMPILE_CHOICES}, got {self.compile!r}")
        need(self.max_prompt_bytes is None or (_is_int(self.max_prompt_bytes) and self.max_prompt_bytes >= 1),
             "max_prompt_bytes: must be a positive integer")
        need(_is_int(self.max_waiting) and self.max_waiting >= 1, "max_waiting: must be an integer >= 1")
        need(_is_int(self.max_waiting_bytes) and self.max_waiting_bytes >= 1,
             "max_waiting_bytes: must be a positive integer")
        need(isinstance(self.planner_cost_profile, str) and (
            self.planner_cost_profile in ("calibrate", "off") or Path(self.planner_cost_profile).is_file()),
            f"planner_cost_profile: 'calibrate', 'off' or a cost profile JSON file, got {self.planner_cost_profile!r}")
        if self.planner is not None:
            need(isinstance(self.planner, dict), "planner: must be an object of planner settings")
            from planner import PlannerConfig
            try:
                PlannerConfig.from_dict(self.planner)
            except ValueError as e:
                raise ConfigError(f"planner: {e}") from None
        need(self.dtype in DTYPES, f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        need(_is_int(self.kv_cache_bytes) and self.kv_cache_bytes > 0, "kv_cache_bytes: must be a positive integer")
        need(self.drafter_kv_cache_bytes is None or (_is_int(self.drafter_kv_cache_bytes) and self.drafter_kv_cache_bytes > 0),
             "drafter_kv_cache_bytes: must be a positive integer")
        need(_is_int(self.block_size) and 1 <= self.block_size <= 1024, "block_size: must be in [1, 1024]")
        need(_is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs: must be >= 1")
        need(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens: must be >= 1")
        need(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
             "max_model_len: must be >= 2")
        need(_is_int(self.gamma_max) and 0 <= self.gamma_max <= 32, "gamma_max: must be in [0, 32]")
        need(_is_int(self.gamma) and 0 <= self.gamma <= self.gamma_max,
             f"gamma: must be in [0, gamma_max={self.gamma_max}], got {self.gamma!r}")
        need(self.num_threads is None or (_is_int(self.num_threads) and self.num_threads >= 1),
             "num_threads: must be >= 1")
        self._validate_tensor_parallel(need)

    def _validate_tensor_parallel(self, need) -> None:
        tp = self.tensor_parallel_size
        need(_is_int(tp) and tp >= 1, "tensor_parallel_size: must be an integer >= 1")
        need(isinstance(self.tensor_parallel_timeout_s, (int, float)) and self.tensor_parallel_timeout_s > 0,
             "tensor_parallel_timeout_s: must be > 0")
        devices = self.tensor_parallel_devices
        on_cuda = str(self.device).startswith("cuda")
        if devices is not None:
            need(isinstance(devices, list) and len(devices) == tp and all(
                isinstance(d, str) and (d == "cpu" if not on_cuda else d.startswith("cuda:")) for d in devices),
                f"tensor_parallel_devices: a list of tensor_parallel_size ({tp}) devices, "
                f"{'cuda:N' if on_cuda else 'cpu'} each, got {devices!r}")
            need(not on_cuda or devices[0] == (self.device if ":" in self.device else "cuda:0"),
                 f"tensor_parallel_devices: the first is the driver's, which runs on device {self.device!r}")
        if tp == 1:
            return
        from backend.model.config import ModelConfig
        from backend.model.parallel.shard import check_divisible
        try:
            model = ModelConfig.from_pretrained(self.target)
        except (KeyError, ValueError, OSError):
            model = None            # not a model config the loader reads: the load says why
        if model is not None:
            check_divisible(model, tp)    # ConfigError if not
        if on_cuda and devices is None:
            from backend.model.parallel.build import rank_devices
            rank_devices(self.device, tp, None)     # ConfigError when the GPUs are not there

    @classmethod
    def from_dict(cls, raw: dict[str, Any], base_dir: str | Path | None = None) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown engine config key(s) {unknown}; known: {sorted(known)}")
        values = dict(raw)
        # Checkpoint paths: relative to the file, $VARIABLES expanded, or a Hugging Face id in the
        # local cache (backend/engine/paths.py).
        for key in ("target", "drafter", "tokenizer"):
            if isinstance(values.get(key), str):
                values[key] = str(resolve_checkpoint(key, values[key], base_dir))
        if isinstance(values.get("planner_cost_profile"), str) and values["planner_cost_profile"] not in ("calibrate", "off"):
            values["planner_cost_profile"] = str(resolve_local("planner_cost_profile", values["planner_cost_profile"], base_dir))
        if "target" not in values:
            raise ConfigError("target: a checkpoint directory is required")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> "EngineConfig":
        path = Path(path)
        return cls.from_dict(read_json_object(path), base_dir=path.parent)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_json_object(path: Path) -> dict:
    """A configuration file's JSON object, or a ConfigError naming the file."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return raw
