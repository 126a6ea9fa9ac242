"""The vLLM backend's ``model.json`` (vLLM engine arguments) as an engine configuration.

Every argument of vLLM's ``EngineArgs`` (those of vLLM 0.6 to 0.32 that model.json files carry)
is in :data:`ARGS`, in one of three kinds:

- **mapped**: it has a nightdraft meaning and becomes engine configuration (``model`` ->
  ``target``, ``speculative_config`` -> ``drafter`` / ``proposer`` / ``gamma``, the memory
  arguments -> ``kv_cache_bytes`` through ``kv_sizing``, ...);
- **ignored**: nothing in nightdraft corresponds and leaving it out changes no output (logging,
  compilation, prefix caching, multimodal limits, ...): accepted, with a warning in the load log
  when it asks for something other than vLLM's default;
- **refused**: leaving it out would change results or the deployment (tensor parallelism,
  quantization, LoRA, rope overrides, other speculative methods, ...): the load fails with the
  reason, unless its value asks for nothing (``tensor_parallel_size: 1``).

An argument that is not in the table is refused by name, as vLLM refuses arguments it does not
know. docs/migrating-from-vllm-backend.md lists the table for readers (a test keeps the two
alike).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from backend.engine.config import EngineConfig
from backend.engine.kv_sizing import size_kv_pool
from backend.engine.paths import resolve_checkpoint
from backend.errors import ConfigError
from backend.mode import ProposerKind
from backend.model.config import ModelConfig

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"


def _neutral(*values: Any) -> Callable[[Any], bool]:
    """Values (compared as text, case-insensitively) that ask for nothing."""
    texts = {str(v).lower() for v in values}
    return lambda v: v is None or str(v).lower() in texts or v in ([], {}, "")


_OFF = _neutral(False, 0, "false", "none")          # a flag that is off, or an empty setting
_ANY = lambda v: True                                 # noqa: E731  (ignored whatever it says)


@dataclass(frozen=True)
class Arg:
    kind: str
    why: str
    neutral: Callable[[Any], bool] = _OFF


def _m(why: str) -> Arg:
    return Arg(MAPPED, why, _ANY)


def _i(why: str, neutral: Callable[[Any], bool] = _OFF) -> Arg:
    return Arg(IGNORED, why, neutral)


def _r(why: str, neutral: Callable[[Any], bool] = _OFF) -> Arg:
    return Arg(REFUSED, why, neutral)


_LOGGING = "logging and tracing of vLLM's own engine; nightdraft logs through Triton and exports metrics"
_STRUCTURED = "structured outputs are always compiled with xgrammar (docs/structured-outputs.md)"
_STRUCTURED_DEFAULTS = ("engine-wide defaults that change what a constrained request generates (whitespace, extra "
                        "properties); nightdraft takes them per request, in structured_outputs")


def _no_output_defaults(v: Any) -> bool:
    """A structured_outputs_config that changes no output: only the backend and its fallback."""
    return _OFF(v) or (isinstance(v, dict) and not any(
        v.get(k) for k in ("disable_any_whitespace", "disable_additional_properties")))


_PERF = "a performance setting of vLLM's executor; outputs do not depend on it"
_MM = "multimodal input; nightdraft serves text models (a multimodal architecture is refused by the loader)"
_LORA = "LoRA adapters; used only with enable_lora, which is refused"
_PARALLEL = "distributed execution across processes or nodes; nightdraft runs one engine per instance"
_MOE = "expert parallelism for mixture-of-experts models, which nightdraft does not load"
_POOLING = "pooling (embedding) models; nightdraft generates text"
_SPEC_LEGACY = "vLLM's pre-0.7 speculative arguments, read as speculative_config"

ARGS: dict[str, Arg] = {
    # ---- the model and its files
    "model": _m("the target checkpoint (`target`): a local directory, relative to model.json, or a "
                "Hugging Face id found in the local cache"),
    "tokenizer": _m("the tokenizer's directory (`tokenizer`), like `model`"),
    "revision": _m("the revision of `model` looked up in the Hugging Face cache"),
    "tokenizer_revision": _m("the revision of `tokenizer` looked up in the Hugging Face cache"),
    "download_dir": _m("a Hugging Face cache to look `model` up in before the default one"),
    "dtype": _m("`dtype`; `auto` is the checkpoint's dtype on a GPU (float32 checkpoints: bfloat16), "
                "as vLLM, and float32 on a CPU host, nightdraft's CPU reference"),
    "seed": _m("`seed`"),
    "max_model_len": _m("`max_model_len`"),
    "max_num_seqs": _m("`max_num_seqs`"),
    "max_num_batched_tokens": _m("`max_num_batched_tokens`"),
    "block_size": _m("`block_size`"),
    "gpu_memory_utilization": _m("the KV pool's size, as vLLM sizes it (backend/engine/kv_sizing.py)"),
    "kv_cache_memory_bytes": _m("the KV budget in bytes (as in vLLM, gpu_memory_utilization is then ignored)"),
    "num_gpu_blocks_override": _m("the target KV pool's block count"),
    "device": _m("the target's device when the instance group leaves it to the model (KIND_MODEL): "
                 "`cuda` / `cpu`, `auto` = cuda when there is one"),
    "enforce_eager": _m("the engine's `compile: \"off\"` (no compiled steps)"),
    "speculative_config": _m("`drafter` (method draft_model, or a `model` without a method) or "
                             "`proposer: \"ngram\"` (method ngram: prompt_lookup_min/max -> ngram_min/max), "
                             "num_speculative_tokens -> `gamma`"),
    "disable_log_stats": _m("with REPORT_CUSTOM_METRICS, true turns the vllm:* metric families off, as in the vLLM backend"),
    "generation_config": _m("`vllm` (vLLM's own sampling defaults) is nightdraft's behaviour; `auto` (the default) "
                            "or a folder is refused when that generation_config.json sets sampling defaults, "
                            "which nightdraft does not apply"),
    "tensor_parallel_size": _m("`tensor_parallel_size`: the target's layers split over that many ranks "
                               "(the instance's GPU and the N-1 after it; the KV pool sized per rank)"),
    "pipeline_parallel_size": _r("pipeline parallelism is not implemented", _neutral(1)),
    "data_parallel_size": _r("data parallelism inside one engine is not implemented; run more instances "
                             "(instance_group count) or replicas", _neutral(1)),
    "decode_context_parallel_size": _r("context parallelism is not implemented", _neutral(1)),
    "quantization": _r("quantized checkpoints are not loaded (unquantized safetensors only)"),
    "kv_cache_dtype": _r("the KV cache is kept in the model's dtype (fp8 KV changes outputs)", _neutral("auto")),
    "calculate_kv_scales": _i("fp8 KV scales; the KV cache is never fp8 here"),
    "load_format": _r("nightdraft loads safetensors only", _neutral("auto", "safetensors")),
    "config_format": _r("nightdraft reads Hugging Face config.json only", _neutral("auto", "hf")),
    "hf_config_path": _r("a config.json from elsewhere than the checkpoint is not supported"),
    "hf_overrides": _r("overriding the checkpoint's config changes the model"),
    "rope_scaling": _r("overriding RoPE changes the model (RoPE scaling in config.json itself is read)"),
    "rope_theta": _r("overriding RoPE changes the model"),
    "override_attention_dtype": _r("attention runs in the model's dtype"),
    "tokenizer_mode": _r("nightdraft uses the checkpoint's tokenizer.json (the fast tokenizer)",
                         _neutral("auto", "hf")),
    "skip_tokenizer_init": _r("nightdraft's schema is text: it needs the tokenizer"),
    "task": _r("nightdraft generates text", _neutral("auto", "generate")),
    "runner": _r("nightdraft generates text", _neutral("auto", "generate")),
    "convert": _r("nightdraft generates text", _neutral("auto", "none")),
    "enable_lora": _r("LoRA adapters are not supported (the vLLM backend's multi_lora.json is not read)"),
    "enable_prompt_adapter": _r("prompt adapters are not supported"),
    "qlora_adapter_name_or_path": _r("QLoRA adapters are not supported"),
    "override_generation_config": _r("nightdraft applies no default sampling parameters; send them per request"),
    "logprobs_mode": _r("nightdraft's logprobs are those of the distribution it samples from "
                        "(processed_logprobs; for greedy requests, the raw log-softmax)",
                        _neutral("processed_logprobs")),
    "logits_processors": _r("custom logits processors (code) are not run"),
    "worker_cls": _r("custom vLLM worker classes are not run", _neutral("auto")),
    "worker_extension_cls": _r("custom vLLM worker classes are not run", _neutral("auto")),
    "scheduler_cls": _r("custom vLLM scheduler classes are not run",
                        _neutral("vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler")),
    "kv_transfer_config": _r("disaggregated prefill/decode (KV transfer) is not implemented"),
    "kv_events_config": _r("KV cache events are not published"),
    "spec_decoding_acceptance_method": _r("only exact rejection sampling keeps the target's distribution",
                                          _neutral("rejection_sampler")),
    # ---- accepted, no effect on outputs
    "served_model_name": _i("Triton names the model (its folder or config.pbtxt's name)"),
    "trust_remote_code": _i("nightdraft runs no code from checkpoints; supported architectures load without it"),
    "code_revision": _i("no code is loaded from checkpoints"),
    "hf_token": _i("nightdraft never downloads"),
    "allowed_local_media_path": _i(_MM),
    "allowed_media_domains": _i(_MM),
    "safetensors_load_strategy": _i(_PERF, _neutral("lazy")),
    "max_parallel_loading_workers": _i(_PERF),
    "model_loader_extra_config": _i("loader options of vLLM"),
    "ignore_patterns": _i("files nightdraft reads are config.json, safetensors and tokenizer files only"),
    "use_tqdm_on_load": _i(_LOGGING, _neutral(True, "true")),
    "pt_load_map_location": _i("nightdraft loads safetensors only", _neutral("cpu")),
    "model_impl": _i("nightdraft has one implementation of each architecture", _neutral("auto", "vllm")),
    "max_logprobs": _i("nightdraft's limit is 20 logprobs per token (vLLM's default)", _neutral(20)),
    "enable_prefix_caching": _i("nightdraft has no prefix cache; outputs are the same without one"),
    "prefix_caching_hash_algo": _i("nightdraft has no prefix cache", _ANY),
    "enable_chunked_prefill": _i("nightdraft always prefills in chunks of max_num_batched_tokens",
                                 _neutral(True, "true")),
    "max_num_partial_prefills": _i(_PERF, _neutral(1)),
    "max_long_partial_prefills": _i(_PERF, _neutral(1)),
    "long_prefill_token_threshold": _i(_PERF, _neutral(0)),
    "num_lookahead_slots": _i(_PERF),
    "scheduling_policy": _i("requests are served first come, first served", _neutral("fcfs")),
    "scheduler_delay_factor": _i(_PERF),
    "preemption_mode": _i("nightdraft preempts by recomputation"),
    "async_scheduling": _i(_PERF),
    "swap_space": _i("nightdraft preempts by recomputation, it does not swap", _ANY),
    "cpu_offload_gb": _i("weights stay on the device (mode auto may offload the drafter, not the target)"),
    "disable_sliding_window": _i("sliding-window models are refused by the loader"),
    "disable_cascade_attn": _i(_PERF),
    "disable_custom_all_reduce": _i(_PARALLEL),
    "distributed_executor_backend": _i(_PARALLEL, _ANY),
    "ray_workers_use_nsight": _i(_PARALLEL),
    "data_parallel_rank": _i(_PARALLEL, _ANY),
    "data_parallel_start_rank": _i(_PARALLEL, _ANY),
    "data_parallel_size_local": _i(_PARALLEL, _ANY),
    "data_parallel_address": _i(_PARALLEL, _ANY),
    "data_parallel_rpc_port": _i(_PARALLEL, _ANY),
    "data_parallel_hybrid_lb": _i(_PARALLEL),
    "data_parallel_backend": _i(_PARALLEL, _ANY),
    "disable_nccl_for_dp_synchronization": _i(_PARALLEL),
    "enable_expert_parallel": _i(_MOE),
    "all2all_backend": _i(_MOE, _ANY),
    "enable_eplb": _i(_MOE),
    "eplb_config": _i(_MOE, _ANY),
    "expert_placement_strategy": _i(_MOE, _ANY),
    "num_redundant_experts": _i(_MOE, _ANY),
    "eplb_window_size": _i(_MOE, _ANY),
    "eplb_step_interval": _i(_MOE, _ANY),
    "eplb_log_balancedness": _i(_MOE),
    "enable_dbo": _i(_PERF),
    "dbo_decode_token_threshold": _i(_PERF, _ANY),
    "dbo_prefill_token_threshold": _i(_PERF, _ANY),
    "compilation_config": _i(_PERF, _ANY),
    "cuda_graph_sizes": _i(_PERF, _ANY),
    "cudagraph_capture_sizes": _i(_PERF, _ANY),
    "max_cudagraph_capture_size": _i(_PERF, _ANY),
    "max_seq_len_to_capture": _i(_PERF, _ANY),
    "disable_async_output_proc": _i(_PERF),
    "num_scheduler_steps": _i(_PERF, _neutral(1)),
    "multi_step_stream_outputs": _i(_PERF, _ANY),
    "use_v2_block_manager": _i(_PERF, _ANY),
    "kv_sharing_fast_prefill": _i(_PERF),
    "disable_hybrid_kv_cache_manager": _i(_PERF),
    "mamba_cache_dtype": _i("state-space models are not loaded", _ANY),
    "mamba_ssm_cache_dtype": _i("state-space models are not loaded", _ANY),
    "mamba_block_size": _i("state-space models are not loaded", _ANY),
    "enable_sleep_mode": _i("sleep mode (freeing the device between uses) is not implemented"),
    "additional_config": _i("platform plugins' settings"),
    "disable_log_requests": _i(_LOGGING, _ANY),
    "enable_log_requests": _i(_LOGGING, _ANY),
    "aggregate_engine_logging": _i(_LOGGING, _ANY),
    "show_hidden_metrics_for_version": _i(_LOGGING, _ANY),
    "otlp_traces_endpoint": _i(_LOGGING),
    "collect_detailed_traces": _i(_LOGGING),
    "structured_outputs_config": _r(_STRUCTURED_DEFAULTS, _no_output_defaults),
    "guided_decoding_backend": _i(_STRUCTURED, _ANY),
    "guided_decoding_disable_fallback": _i(_STRUCTURED, _ANY),
    "guided_decoding_disable_any_whitespace": _r(_STRUCTURED_DEFAULTS),
    "guided_decoding_disable_additional_properties": _r(_STRUCTURED_DEFAULTS),
    "reasoning_parser": _i("reasoning parsing belongs to an OpenAI-compatible front end", _ANY),
    "logits_processor_pattern": _i("custom logits processors are not run; the pattern only allows them"),
    "pooler_config": _i(_POOLING),
    "override_pooler_config": _i(_POOLING),
    "io_processor_plugin": _i(_POOLING),
    "enable_prompt_embeds": _i("prompt embeddings as input are not accepted; requests carry text"),
    "external_parameters": _i("parameters for a custom vLLM scheduler", _ANY),
    "limit_mm_per_prompt": _i(_MM, _ANY),
    "enable_mm_embeds": _i(_MM),
    "interleave_mm_strings": _i(_MM),
    "media_io_kwargs": _i(_MM, _ANY),
    "mm_processor_kwargs": _i(_MM, _ANY),
    "disable_mm_preprocessor_cache": _i(_MM, _ANY),
    "mm_processor_cache_gb": _i(_MM, _ANY),
    "mm_processor_cache_type": _i(_MM, _ANY),
    "mm_shm_cache_max_object_size_mb": _i(_MM, _ANY),
    "mm_encoder_tp_mode": _i(_MM, _ANY),
    "mm_encoder_attn_backend": _i(_MM, _ANY),
    "skip_mm_profiling": _i(_MM, _ANY),
    "video_pruning_rate": _i(_MM, _ANY),
    "enable_multimodal_encoder_data_parallel": _i(_MM, _ANY),
    "disable_chunked_mm_input": _i(_MM, _ANY),
    "max_loras": _i(_LORA, _ANY),
    "max_lora_rank": _i(_LORA, _ANY),
    "default_mm_loras": _i(_LORA, _ANY),
    "fully_sharded_loras": _i(_LORA, _ANY),
    "max_cpu_loras": _i(_LORA, _ANY),
    "lora_dtype": _i(_LORA, _ANY),
    "lora_extra_vocab_size": _i(_LORA, _ANY),
    "enable_lora_bias": _i(_LORA, _ANY),
    "long_lora_scaling_factors": _i(_LORA, _ANY),
    "max_prompt_adapters": _i("prompt adapters are refused (enable_prompt_adapter)", _ANY),
    "max_prompt_adapter_token": _i("prompt adapters are refused (enable_prompt_adapter)", _ANY),
    "tokenizer_pool_size": _i(_PERF, _ANY),
    "tokenizer_pool_type": _i(_PERF, _ANY),
    "tokenizer_pool_extra_config": _i(_PERF, _ANY),
    "intial_incremental_detokenization_offset": _i("nightdraft's detokenizer never splits a character", _ANY),
    "override_neuron_config": _i("AWS Neuron devices are not supported", _ANY),
    # ---- vLLM's pre-0.7 speculative arguments, read as speculative_config
    "speculative_model": _m(f"{_SPEC_LEGACY}: `model`"),
    "num_speculative_tokens": _m(f"{_SPEC_LEGACY}: `num_speculative_tokens`"),
    "ngram_prompt_lookup_max": _m(f"{_SPEC_LEGACY}: `prompt_lookup_max`"),
    "ngram_prompt_lookup_min": _m(f"{_SPEC_LEGACY}: `prompt_lookup_min`"),
    "speculative_draft_tensor_parallel_size": _r("the drafter runs on one device (tensor parallelism is the target's)", _neutral(1)),
    "speculative_model_quantization": _r("quantized checkpoints are not loaded"),
    "speculative_max_model_len": _i("speculation is lossless whatever the length", _ANY),
    "speculative_disable_by_batch_size": _i("speculation is lossless; mode `auto` is nightdraft's answer to load", _ANY),
    "speculative_disable_mqa_scorer": _i(_PERF, _ANY),
    "typical_acceptance_sampler_posterior_threshold": _i("used only by the typical acceptance sampler, which is refused", _ANY),
    "typical_acceptance_sampler_posterior_alpha": _i("used only by the typical acceptance sampler, which is refused", _ANY),
    "disable_logprobs_during_spec_decoding": _i("logprobs are exact under speculation", _ANY),
}

# speculative_config's own keys (vLLM's SpeculativeConfig).
SPEC_ARGS: dict[str, Arg] = {
    "method": _m("`ngram` (also `ngram_gpu`, `[ngram]`) -> `proposer: \"ngram\"`; `draft_model` -> `drafter`; "
                 "other methods (eagle, eagle3, medusa, mlp_speculator, mtp, suffix) are refused: "
                 "they need model heads nightdraft does not run"),
    "model": _m("the draft checkpoint (`drafter`), like `model`; `ngram` means method ngram"),
    "num_speculative_tokens": _m("`gamma` (and `gamma_max` when larger than 8)"),
    "prompt_lookup_min": _m("`ngram_min` (vLLM's defaults: both 5 when neither is given, else equal)"),
    "prompt_lookup_max": _m("`ngram_max`"),
    "revision": _m("the revision of the draft `model` looked up in the Hugging Face cache"),
    "draft_tensor_parallel_size": _r("the drafter runs on one device (tensor parallelism is the target's)", _neutral(1)),
    "tensor_parallel_size": _r("the drafter runs on one device (tensor parallelism is the target's)", _neutral(1)),
    "quantization": _r("quantized checkpoints are not loaded"),
    "acceptance_method": _r("only exact rejection sampling keeps the target's distribution",
                            _neutral("rejection_sampler")),
    "enforce_eager": _i(_PERF, _ANY),
    "max_model_len": _i("speculation is lossless whatever the length", _ANY),
    "code_revision": _i("no code is loaded from checkpoints", _ANY),
    "disable_by_batch_size": _i("speculation is lossless; mode `auto` is nightdraft's answer to load", _ANY),
    "num_speculative_tokens_per_batch_size": _i("a speculation length per batch-size band; mode `auto` "
                                                "chooses the length per step from measurements", _ANY),
    "disable_padded_drafter_batch": _i(_PERF, _ANY),
    "speculative_token_tree": _i("drafts are a chain; a tree changes acceptance, not outputs", _ANY),
    "parallel_drafting": _i("drafts are proposed one position after another", _ANY),
    "draft_sample_method": _i("drafts are sampled from the drafter's distribution; verification is exact "
                              "either way", _ANY),
    "draft_load_config": _i("the draft checkpoint loads like the target's", _ANY),
    "suffix_decoding_max_tree_depth": _i("used only by method suffix, which is refused", _ANY),
    "suffix_decoding_max_cached_requests": _i("used only by method suffix, which is refused", _ANY),
    "suffix_decoding_max_spec_factor": _i("used only by method suffix, which is refused", _ANY),
    "suffix_decoding_min_token_prob": _i("used only by method suffix, which is refused", _ANY),
    "disable_mqa_scorer": _i(_PERF, _ANY),
    "disable_logprobs": _i("logprobs are exact under speculation", _ANY),
    "posterior_threshold": _i("used only by the typical acceptance sampler, which is refused", _ANY),
    "posterior_alpha": _i("used only by the typical acceptance sampler, which is refused", _ANY),
}

NGRAM_METHODS = ("ngram", "[ngram]", "ngram_gpu")
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                         "presence_penalty", "frequency_penalty", "max_new_tokens")
_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}


@dataclass
class VllmEngineArgs:
    """What a model.json asks of nightdraft: engine configuration keys (``defaulted``: those that
    come from vLLM's defaults, not from a value model.json gives), the serving switch
    ``disable_log_stats``, and warnings for the load log."""
    engine: dict[str, Any] = field(default_factory=dict)
    defaulted: set[str] = field(default_factory=set)
    disable_log_stats: bool = False
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_model_json(path: Path) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object of vLLM engine arguments")
    return raw


def vllm_device(args: dict) -> str | None:
    """The device model.json asks for: ``cuda:0``, ``cpu``, or None (``auto``: the caller picks)."""
    device = str(args.get("device") or "auto").lower()
    if device == "auto":
        return None
    if device == "cuda" or device.startswith("cuda:"):
        return "cuda:0" if device == "cuda" else device
    if device == "cpu":
        return "cpu"
    raise ConfigError(f"device: {args['device']!r} is not supported (cuda, cpu or auto)")


def _check_table(args: dict, table: dict[str, Arg], where: str) -> tuple[list[str], list[str]]:
    """(refusals, warnings) for the arguments of one table."""
    refused, warned = [], []
    unknown = sorted(k for k in args if k not in table)
    if unknown:
        refused.append(f"{where}{', '.join(unknown)}: not vLLM engine argument(s) nightdraft knows "
                       "(check the spelling; docs/migrating-from-vllm-backend.md lists them)")
    for key, value in args.items():
        arg = table.get(key)
        if arg is None or arg.kind == MAPPED or arg.neutral(value):
            continue
        line = f"{where}{key}={json.dumps(value)}: {arg.why}"
        (refused if arg.kind == REFUSED else warned).append(line)
    return refused, warned


def _int(key: str, v: Any) -> int:
    try:
        if isinstance(v, bool):
            raise ValueError
        if isinstance(v, float) and v.is_integer():
            return int(v)
        return int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: an integer, got {v!r}") from None


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("true", "1", "false", "0"):
        return str(v).lower() in ("true", "1")
    raise ConfigError(f"{key}: true or false, got {v!r}")


def _speculative_config(args: dict) -> dict | None:
    sc = args.get("speculative_config")
    if isinstance(sc, str):
        try:
            sc = json.loads(sc)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative_config: not valid JSON: {e}") from None
    if sc is not None and not isinstance(sc, dict):
        raise ConfigError("speculative_config: must be an object")
    legacy = {"model": args.get("speculative_model"), "num_speculative_tokens": args.get("num_speculative_tokens"),
              "prompt_lookup_max": args.get("ngram_prompt_lookup_max"),
              "prompt_lookup_min": args.get("ngram_prompt_lookup_min")}
    legacy = {k: v for k, v in legacy.items() if v is not None}
    if legacy and sc:
        raise ConfigError("speculative_config and the pre-0.7 speculative arguments "
                          f"({', '.join(sorted(legacy))}) both given: keep speculative_config")
    return dict(sc) if sc else (legacy or None)


def _speculation(sc: dict, base_dir: Path, download_dirs: tuple) -> dict:
    """speculative_config -> engine keys (drafter or n-gram proposer, gamma)."""
    method = sc.get("method")
    model = sc.get("model")
    n = sc.get("num_speculative_tokens")
    out: dict[str, Any] = {}
    if method in NGRAM_METHODS or (method is None and model in ("ngram", "[ngram]")):
        lo, hi = sc.get("prompt_lookup_min"), sc.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5                      # vLLM's defaults
        lo = _int("speculative_config.prompt_lookup_min", hi if lo is None else lo)
        hi = _int("speculative_config.prompt_lookup_max", lo if hi is None else hi)
        out.update(proposer=ProposerKind.NGRAM, ngram_min=lo, ngram_max=hi)
    elif method in (None, "draft_model") and model:
        out["drafter"] = str(resolve_checkpoint("speculative_config.model", str(model), base_dir,
                                                revision=sc.get("revision"), cache_dirs=download_dirs))
    elif method:
        raise ConfigError(f"speculative_config.method {method!r}: nightdraft drafts with a draft model "
                          "(draft_model) or prompt lookup (ngram); this method needs model heads nightdraft "
                          "does not run")
    else:
        raise ConfigError("speculative_config: name a draft `model` or a `method`")
    if n is None:
        raise ConfigError("speculative_config.num_speculative_tokens: required (the speculation length)")
    gamma = _int("speculative_config.num_speculative_tokens", n)
    out["gamma"] = gamma
    if gamma > 8:
        out["gamma_max"] = gamma
    return out


def _generation_defaults(args: dict, target: Path, base_dir: Path) -> None:
    """Refuse when vLLM would apply sampling defaults from a generation_config.json."""
    setting = args.get("generation_config") or "auto"
    if str(setting).lower() == "vllm":
        return
    folder = target if str(setting).lower() == "auto" else (base_dir / str(setting)).resolve()
    path = folder / "generation_config.json"
    if not path.is_file():
        return
    try:
        gen = json.loads(path.read_text())
    except json.JSONDecodeError:
        return
    defaults = {k: gen[k] for k in SAMPLING_DEFAULT_KEYS if k in gen}
    if defaults:
        raise ConfigError(
            f"generation_config {setting!r}: {path} sets {json.dumps(defaults)}, which vLLM applies as "
            "default sampling parameters and nightdraft does not: set \"generation_config\": \"vllm\" "
            "in model.json to serve with vLLM's own defaults (nightdraft's), or send these parameters "
            "with the requests")


def _dtype(args: dict, device: str, target_cfg: ModelConfig) -> str:
    raw = str(args.get("dtype") or "auto").lower()
    if raw != "auto":
        if raw not in _DTYPES:
            raise ConfigError(f"dtype: {args['dtype']!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[raw]
    if not device.startswith("cuda"):
        return "float32"
    stored = str(target_cfg.torch_dtype or "float32").replace("torch.", "")
    return stored if stored in ("bfloat16", "float16") else "bfloat16"


def engine_keys_from_vllm(args: dict, *, base_dir: Path, device: str, drafter_device: str | None = None,
                          device_memory: Callable | None = None, env: dict | None = None) -> VllmEngineArgs:
    """Map vLLM engine arguments (a model.json in ``base_dir``) to engine configuration keys, for
    a target on ``device`` and a drafter on ``drafter_device`` (None: in the target's process)."""
    out = VllmEngineArgs()
    refused, warned = _check_table(args, ARGS, "")
    sc = _speculative_config(args)
    if sc:
        r, w = _check_table(sc, SPEC_ARGS, "speculative_config.")
        refused += r
        warned += w
    if refused:
        raise ConfigError("model.json asks for what nightdraft does not do:\n  " + "\n  ".join(refused))
    out.warnings = warned

    if not args.get("model"):
        raise ConfigError("model: required (the target checkpoint: a local directory or a Hugging Face id "
                          "in the local cache)")
    download_dirs = (args["download_dir"],) if args.get("download_dir") else ()
    target = resolve_checkpoint("model", str(args["model"]), base_dir, revision=args.get("revision"),
                                cache_dirs=download_dirs)
    if not (target / "config.json").is_file():
        raise ConfigError(f"model: no config.json in {target}")
    e = out.engine
    e["target"] = str(target)
    if args.get("tokenizer") and args["tokenizer"] != args["model"]:
        e["tokenizer"] = str(resolve_checkpoint("tokenizer", str(args["tokenizer"]), base_dir,
                                                revision=args.get("tokenizer_revision"), cache_dirs=download_dirs))
    _generation_defaults(args, target, base_dir)
    target_cfg = ModelConfig.from_pretrained(target)
    e["dtype"] = _dtype(args, device, target_cfg)
    if str(args.get("dtype") or "auto").lower() == "auto":
        out.defaulted.add("dtype")
    for key in ("seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                "tensor_parallel_size"):
        if args.get(key) is not None:
            e[key] = _int(key, args[key])
    if sc:
        e.update(_speculation(sc, base_dir, download_dirs))
    if args.get("enforce_eager") is not None and _bool("enforce_eager", args["enforce_eager"]):
        e["compile"] = "off"
    out.disable_log_stats = _bool("disable_log_stats", args.get("disable_log_stats", False))

    memory_args = {k: args[k] for k in ("gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override")
                   if args.get(k) is not None}
    for k in memory_args:
        memory_args[k] = float(memory_args[k]) if k == "gpu_memory_utilization" else _int(k, memory_args[k])
    drafter_cfg = ModelConfig.from_pretrained(e["drafter"]) if e.get("drafter") else None
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    kwargs = {} if device_memory is None else {"device_memory": device_memory}
    kv = size_kv_pool(
        memory_args, device=device, dtype=e["dtype"], target=target_cfg, drafter=drafter_cfg,
        drafter_shares_device=drafter_device is None or drafter_device == device,
        block_size=e.get("block_size", defaults["block_size"]),
        max_num_batched_tokens=e.get("max_num_batched_tokens", defaults["max_num_batched_tokens"]),
        max_num_seqs=e.get("max_num_seqs", defaults["max_num_seqs"]),
        gamma_max=e.get("gamma_max", defaults["gamma_max"]), env=env,
        tensor_parallel_size=e.get("tensor_parallel_size", 1), **kwargs)
    if kv.target_bytes is not None:
        e["kv_cache_bytes"] = kv.target_bytes
        if not memory_args:
            out.defaulted.add("kv_cache_bytes")
    out.notes.append(f"KV pool: {kv.rule}")
    return out
