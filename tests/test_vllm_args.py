"""The vLLM backend's model.json as nightdraft's engine configuration (backend/engine/vllm_args.py,
backend/engine/kv_sizing.py, backend/engine/paths.py, backend/serving/config.py).

Every argument is mapped, ignored with a warning, or refused with the reason; gpu_memory_utilization
sizes the KV pool from the device's memory as vLLM does (a stand-in device here: no GPU on these
machines), and on a CPU host follows vLLM's CPU rule; Hugging Face ids resolve from the local
cache layout and are never downloaded.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from backend.engine.config import ConfigError, EngineConfig
from backend.engine.kv_sizing import GiB, activation_bytes, kv_bytes_per_token, weight_bytes
from backend.engine.vllm_args import ARGS, IGNORED, MAPPED, REFUSED, SPEC_ARGS, engine_keys_from_vllm
from backend.model.config import ModelConfig
from helpers.model_args import Pb, model_args, write
from model_factory import TINY_DRAFTER, TINY_TARGET

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "migrating-from-vllm-backend.md"


def mapped(args: dict, tmp_path: Path, device: str = "cpu", **kw):
    return engine_keys_from_vllm(args, base_dir=tmp_path, device=device, **kw)


def config_of(args: dict, tmp_path: Path, device: str = "cpu", **kw) -> EngineConfig:
    keys = mapped(args, tmp_path, device, **kw).engine
    return EngineConfig.from_dict({**keys, "device": device})


def test_the_vllm_samples_model_json_maps(tmp_path):
    """samples/model_repository/vllm_model/1/model.json, pointed at a local checkpoint."""
    out = mapped({"model": str(TINY_TARGET), "gpu_memory_utilization": 0.1, "enforce_eager": True}, tmp_path)
    assert out.engine["target"] == str(TINY_TARGET.resolve()) and out.engine["dtype"] == "float32"
    assert "kv_cache_bytes" not in out.engine and out.warnings == []
    assert any("gpu_memory_utilization has no device" in n for n in out.notes)
    assert out.engine["compile"] == "off"


def test_arguments_with_a_nightdraft_meaning_become_engine_configuration(tmp_path):
    cfg = config_of({"model": str(TINY_TARGET), "tokenizer": str(TINY_DRAFTER), "dtype": "half", "seed": "7",
                     "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                     "block_size": 32, "kv_cache_memory_bytes": 8 << 20}, tmp_path)
    assert (cfg.tokenizer, cfg.dtype, cfg.seed, cfg.max_model_len) == (str(TINY_DRAFTER.resolve()), "float16", 7, 512)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size, cfg.kv_cache_bytes) == (8, 256, 32, 8 << 20)
    # A model path relative to model.json, as engine.json's are.
    rel = os.path.relpath(TINY_TARGET, tmp_path)
    assert mapped({"model": rel}, tmp_path).engine["target"] == str(TINY_TARGET.resolve())


@pytest.mark.parametrize("stored,device,expected", [
    ("bfloat16", "cuda:0", "bfloat16"), ("float16", "cuda:0", "float16"), ("float32", "cuda:0", "bfloat16"),
    ("bfloat16", "cpu", "float32")])
def test_dtype_auto_follows_vllm_on_a_gpu_and_stays_float32_on_a_cpu(stored, device, expected, tmp_path):
    ckpt = copy_checkpoint(TINY_TARGET, tmp_path / "t")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = stored
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = mapped({"model": str(ckpt), "dtype": "auto"}, tmp_path, device, device_memory=lambda d: (80 * GiB, 80 * GiB))
    assert out.engine["dtype"] == expected


def test_speculative_config_becomes_a_drafter_or_the_ngram_proposer(tmp_path):
    base = {"model": str(TINY_TARGET)}
    draft = mapped(base | {"speculative_config": {"model": str(TINY_DRAFTER), "num_speculative_tokens": 3}}, tmp_path).engine
    assert (draft["drafter"], draft["gamma"]) == (str(TINY_DRAFTER.resolve()), 3)
    assert EngineConfig.from_dict(draft).mode == "sd"
    ngram = mapped(base | {"speculative_config": {"method": "ngram", "num_speculative_tokens": 10}}, tmp_path).engine
    assert (ngram["proposer"], ngram["ngram_min"], ngram["ngram_max"]) == ("ngram", 5, 5)   # vLLM's defaults
    assert ngram["gamma"] == 10 and ngram["gamma_max"] == 10   # longer than the default bound
    one = mapped(base | {"speculative_config": '{"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 2}'},
                 tmp_path).engine
    assert (one["ngram_min"], one["ngram_max"]) == (3, 3)      # vLLM: the missing bound equals the given one
    legacy = mapped(base | {"speculative_model": "[ngram]", "num_speculative_tokens": 4,
                            "ngram_prompt_lookup_max": 4, "ngram_prompt_lookup_min": 2}, tmp_path).engine
    assert (legacy["proposer"], legacy["ngram_min"], legacy["ngram_max"], legacy["gamma"]) == ("ngram", 2, 4, 4)
    for sc, message in [({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "model heads"),
                        ({"model": str(TINY_DRAFTER)}, "num_speculative_tokens: required"),
                        ({"num_speculative_tokens": 2}, "name a draft `model` or a `method`"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical_acceptance_sampler"},
                         "exact rejection sampling")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            mapped(base | {"speculative_config": sc}, tmp_path)


def test_arguments_whose_absence_would_change_results_are_refused_with_the_reason(tmp_path):
    base = {"model": str(TINY_TARGET)}
    assert mapped(base | {"tensor_parallel_size": 1, "quantization": None, "enable_lora": False}, tmp_path).engine
    with pytest.raises(ConfigError) as e:
        mapped(base | {"pipeline_parallel_size": 2, "quantization": "awq", "enable_lora": True,
                       "rope_theta": 1e6, "kv_cache_dtype": "fp8"}, tmp_path)
    text = str(e.value)
    for line in ("pipeline_parallel_size=2: pipeline parallelism is not implemented",
                 'quantization="awq"', "enable_lora=true: LoRA adapters are not supported",
                 "rope_theta=1000000.0", 'kv_cache_dtype="fp8"'):
        assert line in text, text


def test_harmless_arguments_are_accepted_with_a_warning(tmp_path):
    out = mapped({"model": str(TINY_TARGET), "enable_prefix_caching": True, "max_logprobs": 5,
                  "disable_log_requests": True, "swap_space": 16, "trust_remote_code": False,
                  "served_model_name": "opt"}, tmp_path)
    assert sorted(w.split("=")[0] for w in out.warnings) == ["enable_prefix_caching", "max_logprobs", "served_model_name"]
    assert all(": " in w for w in out.warnings)


def test_an_argument_vllm_does_not_have_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"modle: not vLLM engine argument"):
        mapped({"model": str(TINY_TARGET), "modle": "x"}, tmp_path)
    with pytest.raises(ConfigError, match=r"model: required"):
        mapped({"dtype": "auto"}, tmp_path)


def test_disable_log_stats_is_the_vllm_metrics_switch(tmp_path):
    assert mapped({"model": str(TINY_TARGET), "disable_log_stats": True}, tmp_path).disable_log_stats
    assert not mapped({"model": str(TINY_TARGET)}, tmp_path).disable_log_stats


def test_a_checkpoints_sampling_defaults_are_refused_unless_generation_config_is_vllm(tmp_path):
    ckpt = copy_checkpoint(TINY_TARGET, tmp_path / "t")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "temperature": 0.6, "top_p": 0.9}))
    with pytest.raises(ConfigError, match=r'"temperature": 0.6, "top_p": 0.9.*"generation_config": "vllm"'):
        mapped({"model": str(ckpt)}, tmp_path)
    assert mapped({"model": str(ckpt), "generation_config": "vllm"}, tmp_path).engine["target"] == str(ckpt)


# ---- the KV pool from the device's memory


def sized(args: dict, tmp_path, device="cuda:0", free=80 * GiB, total=80 * GiB, env=None, **kw) -> dict:
    return mapped({"model": str(TINY_TARGET)} | args, tmp_path, device,
                  device_memory=lambda d: (free, total), env=env or {}, **kw).engine


def test_gpu_memory_utilization_sizes_the_kv_pool_as_vllm_does(tmp_path):
    target = ModelConfig.from_pretrained(TINY_TARGET)
    e = sized({"gpu_memory_utilization": 0.5}, tmp_path)
    dtype = e["dtype"]
    rest = int(0.5 * 80 * GiB) - weight_bytes(target, dtype) - activation_bytes(
        target, dtype, max_num_batched_tokens=2048, max_logit_rows=64 * 9)
    assert e["kv_cache_bytes"] == rest
    # vLLM's default fraction is 0.9 when model.json does not say.
    assert sized({}, tmp_path)["kv_cache_bytes"] > e["kv_cache_bytes"] * 1.7
    # A drafter on the same device: its weights come off too, and the budget is split so both
    # pools hold the same number of tokens.
    drafter = ModelConfig.from_pretrained(TINY_DRAFTER)
    both = sized({"gpu_memory_utilization": 0.5, "speculative_config": {"model": str(TINY_DRAFTER),
                                                                         "num_speculative_tokens": 4}}, tmp_path)
    budget = rest - weight_bytes(drafter, dtype)
    t, d = kv_bytes_per_token(target, dtype), kv_bytes_per_token(drafter, dtype)
    assert both["kv_cache_bytes"] == int(budget * t / (t + d))
    # ... and not when the drafter has a device of its own.
    apart = sized({"gpu_memory_utilization": 0.5, "speculative_config": {"model": str(TINY_DRAFTER),
                                                                          "num_speculative_tokens": 4}},
                  tmp_path, drafter_device="cuda:1")
    assert apart["kv_cache_bytes"] == rest


def test_gpu_memory_utilization_is_refused_when_the_device_has_less_free(tmp_path):
    with pytest.raises(ConfigError, match=r"has 30.0 GiB free of 80.0 GiB, less than the 40.0 GiB"):
        sized({"gpu_memory_utilization": 0.5}, tmp_path, free=30 * GiB)
    with pytest.raises(ConfigError, match=r"leaves no KV cache"):
        sized({"gpu_memory_utilization": 0.001}, tmp_path, free=1 * GiB, total=1 * GiB)
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        sized({"gpu_memory_utilization": 1.5}, tmp_path)


def test_on_a_cpu_host_the_pool_follows_vllms_cpu_rule(tmp_path):
    assert "kv_cache_bytes" not in sized({"gpu_memory_utilization": 0.9}, tmp_path, device="cpu")
    e = sized({"gpu_memory_utilization": 0.9}, tmp_path, device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": "0.25"})
    assert e["kv_cache_bytes"] == GiB // 4
    blocks = sized({"num_gpu_blocks_override": 100, "block_size": 16}, tmp_path, device="cpu")
    assert blocks["kv_cache_bytes"] == 100 * 16 * kv_bytes_per_token(ModelConfig.from_pretrained(TINY_TARGET), "float32")


# ---- checkpoints by Hugging Face id, from the local cache


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def hf_cache_entry(cache: Path, repo_id: str, revision: str = "a" * 40, ref: str = "main") -> Path:
    """A model in the Hugging Face cache layout (what huggingface-cli download writes)."""
    entry = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = entry / "snapshots" / revision
    shutil.copytree(TINY_TARGET, snapshot)
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / ref).write_text(revision)
    return snapshot


def test_a_hugging_face_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    main = hf_cache_entry(tmp_path / "hf" / "hub", "acme/tiny")
    v2 = hf_cache_entry(tmp_path / "hf" / "hub", "acme/tiny", revision="b" * 40, ref="v2")
    assert mapped({"model": "acme/tiny"}, tmp_path).engine["target"] == str(main)
    assert mapped({"model": "acme/tiny", "revision": "v2"}, tmp_path).engine["target"] == str(v2)
    elsewhere = hf_cache_entry(tmp_path / "dl", "acme/tiny", revision="c" * 40)
    assert mapped({"model": "acme/tiny", "download_dir": str(tmp_path / "dl")}, tmp_path).engine["target"] == str(elsewhere)


def test_a_model_that_is_not_on_disk_is_refused_without_a_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ConfigError) as e:
        mapped({"model": "facebook/opt-125m"}, tmp_path)
    text = str(e.value)
    assert "not a local directory" in text and "nightdraft never downloads" in text
    assert str(tmp_path / "hf" / "hub" / "models--facebook--opt-125m") in text
    assert "huggingface-cli download facebook/opt-125m" in text


# ---- engine.json and model.json together (backend/serving/config.py)


def test_model_json_beside_engine_json_merges_and_conflicts_are_refused(tmp_path):
    from backend.serving.config import load_engine_config
    d = write(tmp_path / "m", engine={"mode": "auto", "drafter_device": "cpu"},
              model={"model": str(TINY_TARGET), "speculative_config": {"model": str(TINY_DRAFTER), "num_speculative_tokens": 4}})
    source = load_engine_config(model_args(d), "engine.json", cuda_count=0)
    cfg = source.config
    assert (cfg.target, cfg.drafter, cfg.mode, cfg.drafter_device, cfg.gamma) == (
        str(TINY_TARGET.resolve()), str(TINY_DRAFTER.resolve()), "auto", "cpu", 4)
    assert [p.name for p in source.files] == ["engine.json", "model.json"]
    d = write(tmp_path / "c", engine={"gamma": 2}, model={"model": str(TINY_TARGET), "speculative_config": {
        "model": str(TINY_DRAFTER), "num_speculative_tokens": 4}})
    with pytest.raises(Pb.TritonModelException, match=r"gamma: engine.json says 2, model.json means 4"):
        load_engine_config(model_args(d), "engine.json", cuda_count=0)
    # model.json's defaults (dtype auto, the KV pool from vLLM's default memory rule) give way to
    # what engine.json says; what model.json gives explicitly does not.
    d = write(tmp_path / "d", engine={"dtype": "bfloat16", "kv_cache_bytes": 1 << 20}, model={"model": str(TINY_TARGET)})
    cfg = load_engine_config(model_args(d), "engine.json", cuda_count=0).config
    assert (cfg.dtype, cfg.kv_cache_bytes) == ("bfloat16", 1 << 20)
    d = write(tmp_path / "e", engine={"dtype": "bfloat16"}, model={"model": str(TINY_TARGET), "dtype": "float16"})
    with pytest.raises(Pb.TritonModelException, match=r"dtype: engine.json says 'bfloat16', model.json means 'float16'"):
        load_engine_config(model_args(d), "engine.json", cuda_count=0)
    # The same value in both is no conflict (paths compared resolved).
    d = write(tmp_path / "s", engine={"target": str(TINY_TARGET)}, model={"model": str(TINY_TARGET)})
    assert load_engine_config(model_args(d), "engine.json", cuda_count=0).config.target == str(TINY_TARGET.resolve())
    with pytest.raises(Pb.TritonModelException, match=r"no engine configuration: neither .*engine.json nor .*model.json"):
        load_engine_config(model_args(write(tmp_path / "none")), "engine.json", cuda_count=0)


def test_model_json_warnings_reach_the_load_log(tmp_path):
    from backend.serving.config import load_engine_config
    d = write(tmp_path / "m", model={"model": str(TINY_TARGET), "enable_prefix_caching": True})
    lines = load_engine_config(model_args(d), "engine.json", cuda_count=0).log_lines
    assert any(line.startswith("model.json: enable_prefix_caching=true") and "(ignored)" in line for line in lines)


# ---- the migration guide lists every argument


def test_the_migration_guide_lists_every_argument_with_its_kind():
    text = GUIDE.read_text()
    rows = dict(re.findall(r"^\| `([a-z_0-9.]+)` \| (mapped|ignored|refused) \|", text, re.M))
    table = {**ARGS, **{f"speculative_config.{k}": v for k, v in SPEC_ARGS.items()}}
    missing = sorted(set(table) - set(rows))
    assert not missing, f"not in {GUIDE.name}: {missing}"
    wrong = sorted(k for k, a in table.items() if rows[k] != a.kind)
    assert not wrong, f"{GUIDE.name} gives another kind for {wrong}"
    assert not sorted(set(rows) - set(table)), "the guide lists arguments the code does not know"
    assert {a.kind for a in table.values()} == {MAPPED, IGNORED, REFUSED}



@pytest.mark.parametrize("key,value", [
    ("structured_outputs_config", {"disable_any_whitespace": True}),
    ("guided_decoding_disable_any_whitespace", True),
    ("guided_decoding_disable_additional_properties", True),
])
def test_engine_wide_structured_output_defaults_that_change_outputs_are_refused(tmp_path, key, value):
    with pytest.raises(ConfigError, match=key):
        mapped({"model": str(TINY_TARGET), key: value}, tmp_path)


def test_a_structured_outputs_backend_choice_is_ignored(tmp_path):
    out = mapped({"model": str(TINY_TARGET), "structured_outputs_config": {"backend": "xgrammar"}}, tmp_path)
    assert out.engine
