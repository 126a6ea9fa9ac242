"""Greedy tokens across implementations, on the committed tiny pair, in float32.

- Always: nightdraft's greedy tokens (plain decoding, and SD with the drafter in-process) equal
  transformers' greedy `generate` on the same prompt ids: the independent oracle when vLLM is absent.
- With the vLLM environment (`.venv-vllm/`, made by `nightdraft bench vllm --setup-only`): vLLM's
  greedy tokens equal both. Skipped otherwise; CI does not build that environment.
- The bench's own bookkeeping (vLLM specs, ratio rows, divergence report) and the runner's
  import discipline (stdlib and vLLM only), which need neither.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from client import bench_vllm
from client.prompts import load_prompts

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("NIGHTDRAFT_TEST_TARGET", REPO / "models" / "tiny-target"))
DRAFTER = Path(os.environ.get("NIGHTDRAFT_TEST_DRAFTER", REPO / "models" / "tiny-drafter"))
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
NUM_PROMPTS = 4
MAX_TOKENS = 24

needs_pair = pytest.mark.skipif(not (TARGET / "config.json").is_file() or not (DRAFTER / "config.json").is_file(),
                                reason=f"the tiny pair is not at {TARGET} / {DRAFTER} (make tiny-models)")


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    from backend.model.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(str(TARGET))
    return [tok.encode(p) for p in load_prompts(None, NUM_PROMPTS)]


@pytest.fixture(scope="module")
def hf_model():
    import torch
    torch.set_num_threads(1)   # two intra-op threads crawl when the 2-core machine is busy
    return bench_vllm.load_hf(str(TARGET))


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids) -> list[list[int]]:
    return bench_vllm.transformers_greedy(hf_model, prompt_ids, MAX_TOKENS)


def _nightdraft_greedy(prompt_ids: list[list[int]], **cfg) -> list[list[int]]:
    from backend.engine.engine import Engine
    from backend.engine.config import EngineConfig
    from backend.sampling.params import SamplingParams

    engine = Engine(EngineConfig(target=str(TARGET), dtype="float32", kv_cache_bytes=32 << 20,
                                 num_threads=1, **cfg))
    try:
        out = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                         ignore_eos=True), max_concurrency=NUM_PROMPTS)
    finally:
        engine.close()
    return [c.output_ids for c in out]


def _explain(hf_model, prompt_ids, ref, got) -> str:
    rep = bench_vllm.equality_report(hf_model, prompt_ids, ref, got)
    return f"{rep['identical']}/{rep['total']} identical; first differences: {rep['divergences']}"


@needs_pair
@pytest.mark.parametrize("cfg", [dict(mode="ar"), dict(mode="sd", drafter=str(DRAFTER), gamma=4)],
                         ids=["ar", "sd-gamma4"])
def test_nightdraft_greedy_equals_transformers(cfg, prompt_ids, reference, hf_model):
    got = _nightdraft_greedy(prompt_ids, **cfg)
    assert all(len(g) == MAX_TOKENS for g in got)
    assert got == reference, _explain(hf_model, prompt_ids, reference, got)


@needs_pair
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(),
                    reason=f"no vLLM environment at {VLLM_PYTHON.parent.parent} "
                           "(make it with `nightdraft bench vllm --setup-only`; CI does not)")
def test_vllm_greedy_equals_nightdraft_and_transformers(prompt_ids, reference, hf_model, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    spec = dict(model=str(TARGET), tokenizer=str(TARGET), dtype="float32", seed=0, max_model_len=1024,
                max_num_seqs=8, enforce_eager=True, enable_prefix_caching=False)
    env = bench_vllm.vllm_environ(cores, kv_gib=1, placement="all")
    with open(tmp_path / "vllm.log", "w") as log:
        runner = bench_vllm.VllmRunner("vllm-ar", str(VLLM_PYTHON), spec, env, cores, log)
        try:
            res = runner.request({"cmd": "run", "prompts": prompt_ids, "max_tokens": MAX_TOKENS,
                                  "temperature": 0.0, "seed": 0, "concurrency": NUM_PROMPTS})
            theirs = runner.request({"cmd": "tokenize", "texts": load_prompts(None, NUM_PROMPTS)})["ids"]
        finally:
            runner.close()
    got = res["outputs"]
    assert theirs == prompt_ids, "vLLM's tokenizer encodes the prompts differently"
    assert got == reference, _explain(hf_model, prompt_ids, reference, got)
    assert got == _nightdraft_greedy(prompt_ids, mode="ar")


# ---- the bench's bookkeeping: no models needed ------------------------------------------------

def test_runner_imports_only_stdlib_and_vllm():
    import sys
    tree = ast.parse((REPO / "client" / "vllm_runner.py").read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add((node.module or "").split(".")[0])
    foreign = {m for m in mods if m and m != "vllm" and m not in sys.stdlib_module_names}
    assert not foreign, f"vllm_runner.py must import only the standard library and vllm: {foreign}"


def test_vllm_specs_and_schedule():
    import argparse
    args = argparse.Namespace(target="/t", drafter="/d", dtype="auto", device="cpu", vllm_eager=False,
                              ngram="1-4", schedule="1-4:4,5-16:2,17-1024:0",
                              vllm_draft_sampling="probabilistic")
    specs = bench_vllm.vllm_specs(args, [2, 4], ["vllm-ar", "vllm-sd", "vllm-ngram", "vllm-sched"], 64)
    assert set(specs) == {"vllm-ar", "vllm-sd-g2", "vllm-sd-g4", "vllm-ngram", "vllm-sched"}
    assert "speculative_config" not in specs["vllm-ar"]
    assert specs["vllm-sd-g4"]["speculative_config"]["num_speculative_tokens"] == 4
    assert specs["vllm-sd-g2"]["speculative_config"]["model"] == "/d"
    ng = specs["vllm-ngram"]["speculative_config"]
    assert (ng["method"], ng["prompt_lookup_min"], ng["prompt_lookup_max"]) == ("ngram", 1, 4)
    sched = specs["vllm-sched"]["speculative_config"]
    assert sched["num_speculative_tokens_per_batch_size"] == [[1, 4, 4], [5, 16, 2], [17, 1024, 0]]
    assert sched["num_speculative_tokens"] == 4
    assert all(not s["enable_prefix_caching"] for s in specs.values())
    # nightdraft's "auto" is float32 on CPU; vLLM's "auto" would take the checkpoint's bfloat16
    assert all(s["dtype"] == "float32" for s in specs.values())


def test_vllm_environ_gives_vllm_all_cores():
    env = bench_vllm.vllm_environ([0, 1], kv_gib=2, placement="all")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in bench_vllm.vllm_environ([0, 1], 1, "default")


def test_ratio_rows_pairs_and_best():
    def row(cfg, tps, lat):
        return {"temperature": 0.0, "concurrency": 8, "config": cfg, "tokens_per_s": tps,
                "mean_latency_s": lat, "mean_ttft_s": lat / 4}
    rows = [row("nd-ar", 100, 1.0), row("nd-psd", 300, 0.5), row("vllm-ar", 200, 0.8),
            row("vllm-sd", 150, 1.0), row("vllm-ngram", 250, 0.6)]
    ratios = bench_vllm.ratio_rows(rows, [4])
    by = {(r["nightdraft"], r["vllm"], r["best_vs_best"]): r for r in ratios}
    assert by[("nd-ar", "vllm-ar", False)]["throughput_ratio"] == pytest.approx(0.5)
    assert by[("nd-psd", "vllm-sd", False)]["latency_ratio"] == pytest.approx(0.5)
    best = by[("nd-psd", "vllm-ngram", True)]
    assert best["throughput_ratio"] == pytest.approx(1.2)


def test_equality_report_finds_first_difference():
    import torch

    class Fake(torch.nn.Module):    # next-token logits: token (last + 1) % 8 wins, (last + 2) a hair behind
        def forward(self, ids):
            last = ids[0, -1].item()
            logits = torch.full((1, ids.shape[1], 8), -5.0)
            logits[0, -1, (last + 1) % 8] = 1.0
            logits[0, -1, (last + 2) % 8] = 1.0 - 1e-5
            return type("Out", (), {"logits": logits})

    ref = [[2, 3, 4], [5, 6, 7]]
    got = [[2, 3, 4], [5, 7, 0]]
    rep = bench_vllm.equality_report(Fake(), [[1], [4]], ref, got)
    assert (rep["identical"], rep["total"]) == (1, 2)
    (d,) = rep["divergences"]
    assert d["position"] == 1 and d["ref_token"] == 6 and d["other_token"] == 7
    assert d["gap"] == pytest.approx(1e-5, abs=1e-6) and d["other_is_ref_second"]
    assert rep["near_ties"] == 1
    assert rep["tokens_matching_prefix_fraction"] == pytest.approx(4 / 6)


def test_histogram_test_separates_equal_from_different():
    import random
    rng = random.Random(0)
    tokens = list(range(20))
    a = [rng.choice(tokens) for _ in range(2000)]
    b = [rng.choice(tokens) for _ in range(2000)]
    skewed = [rng.choice(tokens[:5]) for _ in range(2000)]
    same, diff = bench_vllm.histogram_test(a, b), bench_vllm.histogram_test(a, skewed)
    assert same["tv"] < 0.1 and diff["tv"] > 0.5
    if same["p_value"] is not None:          # scipy present (the test extra has it)
        assert same["p_value"] > 1e-3 and diff["p_value"] < 1e-10
