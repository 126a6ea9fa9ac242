"""Prompts are tokenized as vLLM and transformers tokenize them, BOS included where the
tokenizer adds one, and greedy outputs from text equal transformers' ``generate``.

Three tokenizer conventions, on checkpoints made here (tests/model_factory.py):

- no BOS: the bundled tiny pair (GPT-2-style byte-level BPE, no post-processor);
- BOS: a random Llama pair whose tokenizer.json has a TemplateProcessing post-processor that
  puts ``<s>`` (an id of its own) before every prompt, as Llama's does;
- disagreeing files: tokenizer_config.json says ``add_bos_token: true`` but tokenizer.json adds
  none. transformers 5 (what vLLM runs on, and the oracle here) follows tokenizer.json; so does
  nightdraft, and it logs the disagreement.
"""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from model_factory import BOS, TINY_DRAFTER, TINY_TARGET, save_random_llama

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def bos_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bos-pair")
    target = save_random_llama(root / "target", hidden=64, layers=2, seed=3, adds_bos=True)
    drafter = save_random_llama(root / "drafter", hidden=32, layers=1, heads=2, kv_heads=1, seed=4, adds_bos=True)
    return target, drafter


@pytest.fixture(scope="module")
def disagreeing_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagree")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(TINY_TARGET / name, path / name)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def prompts():
    from client.prompts import load_prompts
    return [p[:120] for p in load_prompts(n=6)] + ["x", " leading space", "emoji \N{GRINNING FACE}"]


def transformers_ids(path, texts):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize("which", ["no_bos", "bos", "disagreeing"])
def test_prompt_ids_equal_transformers_encoding(which, bos_pair, disagreeing_tokenizer, prompts, caplog):
    from backend.model.tokenizer import Tokenizer
    path = {"no_bos": TINY_TARGET, "bos": bos_pair[0], "disagreeing": disagreeing_tokenizer}[which]
    with caplog.at_level(logging.WARNING, logger="nightdraft.model"):
        ours = Tokenizer.from_pretrained(path)
    expected = transformers_ids(path, prompts)
    assert [ours.encode(p) for p in prompts] == expected
    bos_id = ours._tok.token_to_id(BOS)
    starts_with_bos = {ids[0] == bos_id for ids in expected}
    assert starts_with_bos == {which == "bos"}, "the fixture lost its convention"
    # Long prompts take the GIL-free path; the same ids.
    long = prompts[0] * 40
    assert ours.encode(long) == transformers_ids(path, [long])[0]
    disagreement = [r for r in caplog.records if "add_bos_token" in r.getMessage()]
    assert bool(disagreement) == (which == "disagreeing")


@pytest.mark.parametrize("which", ["no_bos", "bos"])
def test_greedy_output_from_text_equals_transformers_generate(which, bos_pair, prompts):
    """Text in, through the engine's own tokenization, with sequential SD: the same tokens as
    transformers' greedy generate on transformers' encoding of the same text."""
    from backend.engine.config import EngineConfig
    from backend.engine.engine import Engine
    from backend.sampling.params import SamplingParams
    from client.bench_vllm import load_hf, transformers_greedy
    target, drafter = (TINY_TARGET, TINY_DRAFTER) if which == "no_bos" else bos_pair
    texts = prompts[:4]
    engine = Engine(EngineConfig(target=str(target), drafter=str(drafter), mode="sd", gamma=3,
                                 dtype="float32", kv_cache_bytes=8 << 20, num_threads=1))
    try:
        ours = engine.generate(texts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        engine.close()
    hf_ids = transformers_ids(target, texts)
    assert [c.prompt_ids for c in ours] == hf_ids
    assert [c.output_ids for c in ours] == transformers_greedy(load_hf(str(target)), hf_ids, MAX_TOKENS)
