"""The GPU path: the same engine with device placement from the configuration.

Marked `gpu`; skipped (with the reason) where torch sees no CUDA device. scripts/gpu_check.sh runs
these on a GPU machine (`pytest -m gpu`). Checked: the weights and the KV cache land on the device
named in the configuration, greedy speculation stays lossless on CUDA with the drafter in the
target's process, in a second process on the same GPU, and on a second GPU; sampled speculation
passes the engine-level exactness check there too; and bf16 (the GPU default) serves whole
requests without leaking KV blocks.
"""
from __future__ import annotations

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.mode import CONFIGURED_MODES, Mode
from backend.sampling.params import SamplingParams
from model_factory import TINY_DRAFTER, TINY_TARGET

CUDA = torch.cuda.is_available()
NUM_GPUS = torch.cuda.device_count() if CUDA else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason=f"needs an NVIDIA GPU and a CUDA build of torch "
                                        f"(this torch: {torch.__version__}, CUDA {torch.version.cuda})"),
    pytest.mark.skipif(not (TINY_TARGET / "config.json").is_file() or not (TINY_DRAFTER / "config.json").is_file(),
                       reason="the tiny model pair is missing (make tiny-models)"),
]
two_gpus = pytest.mark.skipif(NUM_GPUS < 2, reason=f"needs 2 GPUs for the drafter's own device (found {NUM_GPUS})")

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def make_engine(**kw):
    from backend.engine.engine import Engine
    kw.setdefault("device", "cuda:0")
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_bytes", 64 << 20)
    kw.setdefault("drafter", str(TINY_DRAFTER))
    kw.setdefault("mode", "sd" if kw["drafter"] else "ar")
    return Engine(EngineConfig(target=str(TINY_TARGET), **kw))


PROMPT_CUTS = (12, 40, 29, 300)      # the conftest's `prompts`


@pytest.fixture(scope="module")
def ar_outputs(prompts):
    engine = make_engine(drafter=None)
    try:
        return [c.output_ids for c in engine.generate(prompts, GREEDY, max_concurrency=6)]
    finally:
        engine.close()


def run(engine, prompts, concurrency=6):
    try:
        out = [c.output_ids for c in engine.generate(prompts, GREEDY, max_concurrency=concurrency)]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks, "target KV blocks leaked"
        assert not engine.has_unfinished()
        return out, engine.stats()
    finally:
        engine.close()


def test_weights_and_kv_on_the_configured_device():
    engine = make_engine(drafter=None, dtype="bfloat16")
    try:
        params = list(engine.target.parameters())
        assert params and all(p.device == torch.device("cuda:0") for p in params)
        assert all(p.dtype == torch.bfloat16 for p in params if p.is_floating_point())
        kv = [t for t in vars(engine.kv).values() if isinstance(t, torch.Tensor)]
        kv += [t for v in vars(engine.kv).values() if isinstance(v, (list, tuple))
               for t in v if isinstance(t, torch.Tensor)]
        assert kv and all(t.is_cuda for t in kv), "the KV cache is not on the GPU"
    finally:
        engine.close()


def test_greedy_sd_in_process_equals_ar(prompts, ar_outputs):
    out, stats = run(make_engine(gamma=4), prompts)
    assert out == ar_outputs
    assert stats.drafted_tokens > 0


def test_greedy_sd_drafter_second_process_same_gpu(prompts, ar_outputs):
    out, stats = run(make_engine(gamma=4, drafter_device="cuda:0"), prompts)
    assert out == ar_outputs
    assert stats.drafted_tokens > 0


@two_gpus
def test_greedy_sd_drafter_on_second_gpu(prompts, ar_outputs):
    out, stats = run(make_engine(gamma=4, drafter_device="cuda:1"), prompts)
    assert out == ar_outputs
    assert stats.drafted_tokens > 0


@pytest.mark.skipif(Mode.PSD not in CONFIGURED_MODES, reason="the engine has no batch-parallel mode")
@pytest.mark.parametrize("drafter_device", ["cuda:0", pytest.param("cuda:1", marks=two_gpus)])
def test_greedy_psd_equals_ar(drafter_device, prompts, ar_outputs):
    out, stats = run(make_engine(gamma=4, mode="psd", drafter_device=drafter_device), prompts, concurrency=8)
    assert out == ar_outputs
    assert stats.drafted_tokens > 0


def test_bf16_serves_whole_requests(prompts):
    out, stats = run(make_engine(gamma=4, dtype="bfloat16"), prompts, concurrency=12)
    assert [len(o) for o in out] == [GREEDY.max_tokens] * len(prompts)
    assert stats.drafted_tokens > 0 and 0.0 <= stats.accepted_tokens <= stats.drafted_tokens


@pytest.mark.parametrize("drafter_device", [None, "cuda:0"], ids=["drafter_in_process", "drafter_own_process"])
def test_sampled_tokens_follow_the_target_on_cuda(drafter_device):
    """Sampled speculation on CUDA (the device's generators, the drafter's probabilities as CUDA
    IPC tensors when it has its own process) passes the engine-level exactness check of
    tests/test_sampling_exactness.py: every token verification decided, against the target's
    conditional computed by transformers on the CPU (KS at 1e-3 over 4800 values)."""
    pytest.importorskip("scipy.stats")
    from helpers.exactness import assert_exact, load_target_hf, prompt_ids
    prompt, temperature, n = "print(", 0.8, 1200
    engine = make_engine(gamma=3, gamma_max=3, drafter_device=drafter_device)
    try:
        params = [SamplingParams(max_tokens=5, temperature=temperature, seed=s, ignore_eos=True) for s in range(n)]
        runs = [c.output_ids for c in engine.generate([prompt] * n, params, max_concurrency=48)]
        st = engine.stats()
        assert st.drafted_tokens > 0 and 0 < st.acceptance_rate < 1
    finally:
        engine.close()
    assert_exact(load_target_hf(), prompt_ids(prompt), runs, f"cuda, drafter {drafter_device or 'in process'}",
                 temperature=temperature)
