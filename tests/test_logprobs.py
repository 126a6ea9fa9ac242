"""Logprobs are the target's, whatever proposed the tokens: SD, PSD and auto give what plain
decoding gives, and the values are the target model's own (checked against transformers)."""
import pytest
import torch

from backend.engine.engine import Engine
from backend.sampling.params import SamplingParams
from helpers.arms import StepModes, force_arms
from helpers.engines import tiny_engine
from model_factory import TINY_DRAFTER, TINY_TARGET

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):\n"]
GREEDY_LP = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)


def run(engine: Engine, params: SamplingParams, on_step=None) -> dict[int, tuple[list[int], list, float]]:
    out = {i: ([], [], None) for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            ids, lps, _ = out[int(o.request_id)]
            out[int(o.request_id)] = (ids + o.new_token_ids, lps + (o.logprobs or []), o.cumulative_logprob)
        if on_step is not None:
            on_step(outs)
    return out


def engine(mode: str) -> Engine:
    return tiny_engine(mode, None if mode == "ar" else TINY_DRAFTER, gamma=4)


@pytest.fixture(scope="module")
def plain():
    return run(engine("ar"), GREEDY_LP)


def assert_same_logprobs(got, want, label: str) -> None:
    for i in want:
        ids, lps, cum = got[i]
        assert ids == want[i][0], f"{label}: tokens differ"
        assert len(lps) == len(ids)
        for a, b in zip(lps, want[i][1]):
            assert a.token == b.token and a.rank == b.rank, label
            assert abs(a.logprob - b.logprob) < 1e-4, f"{label}: {a.logprob} vs {b.logprob}"
            assert [t for t, _ in a.top] == [t for t, _ in b.top], label
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top)), label
        assert abs(cum - want[i][2]) < 1e-3 and abs(cum - sum(t.logprob for t in lps)) < 1e-3


def test_sd_gives_plain_decodings_logprobs(plain):
    got = run(engine("sd"), GREEDY_LP)
    assert_same_logprobs(got, plain, "sd")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["psd", "auto"])
def test_psd_and_auto_give_plain_decodings_logprobs(mode, plain):
    """auto with its arms forced in turn (plain decoding, sd, psd), so each kind of step decides
    some of the tokens whose logprobs are compared."""
    e = engine(mode)
    try:
        if mode == "auto":
            force_arms(e, [("ar", 0), ("sd", 4), ("psd", 4)], hold=2)
        modes = StepModes(e)
        assert_same_logprobs(run(e, GREEDY_LP, on_step=modes), plain, mode)
        assert modes["psd"] > 0, modes
        if mode == "auto":
            assert modes["ar"] > 0 and modes["sd"] > 0, modes
    finally:
        e.close()


def test_logprobs_are_the_target_models_own(plain):
    """Against transformers on the same checkpoint: each token's log-softmax, its rank, the top 3."""
    from client import bench_vllm
    from backend.model.tokenizer import Tokenizer
    hf = bench_vllm.load_hf(str(TINY_TARGET))
    tok = Tokenizer.from_pretrained(TINY_TARGET)
    for i, p in enumerate(PROMPTS):
        ids, lps, _ = plain[i]
        seq = tok.encode(p) + ids
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, len(seq) - len(ids) - 1:-1].float()
        ref = torch.log_softmax(logits, dim=-1)
        for j, t in enumerate(lps):
            assert t.token == ids[j] and abs(t.logprob - ref[j, ids[j]].item()) < 1e-3
            assert t.rank == int((ref[j] > ref[j, ids[j]]).sum()) + 1
            assert [x for x, _ in t.top] == ref[j].topk(3).indices.tolist()


def test_a_sampled_tokens_logprob_is_of_the_distribution_it_was_drawn_from():
    """At temperature 0.5 and top_k 5 the logprobs are those of the processed distribution:
    every token is among the top 5, and their probabilities over the top 5 sum to one."""
    params = SamplingParams(max_tokens=12, temperature=0.5, top_k=5, seed=3, ignore_eos=True, logprobs=5)
    got = run(engine("sd"), params)
    for ids, lps, _ in got.values():
        for t in lps:
            assert t.rank <= 5
            assert abs(sum(torch.tensor([lp for _, lp in t.top]).exp().tolist()) - 1.0) < 1e-4


def test_no_logprobs_unless_asked():
    got = run(engine("sd"), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(lps == [] and cum is None for _, lps, cum in got.values())
