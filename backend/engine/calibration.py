"""Timing bare forwards into a cost profile: what the planner's warm start and the cost model read.

A :class:`~planner.cost_model.CostProfile` holds T_verify(b, n), one target forward over b
sequences feeding n tokens each, and a proposal's cost for b sequences: its call's own part and
what each draft position adds, from proposals of one position and of the longest. Both are
measured here on throw-away KV pools with ~128 tokens of context per sequence, medians of a few
repetitions after a warm-up; the engine's own pool and sequences are never touched.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from planner.cost_model import CostProfile

from backend.mode import ProposerKind
from backend.engine.config import ConfigError
from backend.model.config import ModelConfig
from backend.model.kv_cache import PagedKVCache
from backend.model.runner import ModelRunner
from backend.speculation.drafter import Drafter
from backend.speculation.ngram import NgramProposer

CONTEXT_TOKENS = 128
BLOCK = 16


def time_forward(runner: ModelRunner, *, batch: int, tokens: int, device, dtype, reps: int = 5) -> float:
    """Median seconds of one forward of `runner`'s model (as the engine runs it: its attention,
    its captured step) over `batch` sequences x `tokens` new tokens, logits on every token."""
    config = runner.model.config
    per_seq = (CONTEXT_TOKENS + tokens) // BLOCK + 1
    budget = batch * per_seq * PagedKVCache.bytes_per_block(config, BLOCK, dtype)
    runner = runner.with_cache(PagedKVCache.for_model(config, budget, block_size=BLOCK, dtype=dtype, device=device))
    ids = [f"calibrate{i}" for i in range(batch)]
    for s in ids:
        if not runner.kv.ensure_capacity(s, CONTEXT_TOKENS + tokens):
            raise RuntimeError("calibration KV pool too small")   # sized above: cannot happen
    rng = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        for r in range(reps + 1):                     # the first run warms up
            x = torch.randint(0, config.vocab_size, (batch * tokens,), generator=rng).tolist()
            t0 = time.perf_counter()
            runner.forward(ids, [CONTEXT_TOKENS] * batch, [tokens] * batch, x, list(range(batch * tokens)))
            if str(device).startswith("cuda"):
                torch.cuda.synchronize(device)
            if r:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_proposing(proposer, *, batch: int, vocab_size: int, gamma: int = 1, reps: int = 5) -> float:
    """Median seconds a :class:`~backend.speculation.proposer.Proposer` takes to propose `gamma`
    tokens for each of `batch` sequences of ~128 tokens, one committed token after the last
    round, as in steady decoding: what a proposal costs the engine, the proposer's own
    bookkeeping and the draft distributions included (a sampled request's)."""
    from backend.sampling.params import SamplingParams
    from backend.speculation.proposer import DraftRequest

    params = SamplingParams(max_tokens=reps + 2, temperature=1.0, seed=0)
    rng = torch.Generator().manual_seed(0)
    seqs = {f"calibrate{i}": torch.randint(0, vocab_size, (CONTEXT_TOKENS,), generator=rng).tolist()
            for i in range(batch)}
    times, sent = [], {s: 0 for s in seqs}
    try:
        for r in range(reps + 2):        # the first round prefills, the second warms up
            reqs = [DraftRequest(s, toks[sent[s]:], gamma, params, start=sent[s]) for s, toks in seqs.items()]
            t0 = time.perf_counter()
            proposer.propose(reqs)
            if r >= 2:
                times.append(time.perf_counter() - t0)
            for s, toks in seqs.items():
                sent[s] = len(toks)
                toks.append(int(torch.randint(0, vocab_size, (1,), generator=rng)))
    finally:
        for s in seqs:
            proposer.free(s)
    return statistics.median(times)


def measure_cost_profile(target: ModelRunner, proposer=None, *, batches, token_counts, device, dtype,
                         reps: int = 5, longest_proposal: int = 1) -> CostProfile:
    """Target forwards at every (batch, tokens) pair (the engine's runner), and with a proposer,
    at every batch, proposals of one position and of `longest_proposal` (see
    :func:`time_proposing`): the difference over the extra positions is what a position adds,
    the rest of a one-position proposal the call's own cost (a proposal of gamma positions is
    not gamma one-position calls: at batch 1 the call's own part is most of one)."""
    profile = CostProfile()
    vocab = target.model.config.vocab_size
    for b in batches:
        for n in token_counts:
            profile.verify[(b, n)] = time_forward(target, batch=b, tokens=n, device=device,
                                                  dtype=dtype, reps=reps)
        if proposer is None:
            continue
        one = time_proposing(proposer, batch=b, vocab_size=vocab, reps=reps)
        if longest_proposal <= 1:
            profile.draft[b] = one
            continue
        longest = time_proposing(proposer, batch=b, vocab_size=vocab, gamma=longest_proposal, reps=reps)
        # (noise can make the longer proposal look no dearer: a position then costs at least
        # a tenth of a one-position proposal)
        per_position = max((longest - one) / (longest_proposal - 1), 0.1 * one)
        profile.draft[b] = per_position
        profile.draft_call[b] = max(one - per_position, 0.0)
    return profile


def calibration_drafter(path: str, config, dtype, *, max_batch: int, longest: int) -> Drafter:
    """A throw-away drafter from `path`, run as `config`'s engine runs one (device, attention,
    captured step), in this process, with a pool for :func:`time_proposing`'s `max_batch`
    sequences and a proposal of `longest` positions."""
    per_seq = (CONTEXT_TOKENS + 16 + longest) // BLOCK + 1
    dcfg = ModelConfig.from_pretrained(path)
    return Drafter.load(path, device=config.device, dtype=dtype, block_size=BLOCK,
                        kv_cache_bytes=max_batch * per_seq * PagedKVCache.bytes_per_block(dcfg, BLOCK, dtype),
                        attention=config.attention, compile=config.compile, max_query_len=longest + 1)


def planner_cost_profile(config, target: ModelRunner, dtype, lending=None) -> CostProfile | None:
    """The cost profile mode auto's planner starts from, as ``config.planner_cost_profile`` says:
    None ("off"), a file's, or one measured now over the batch sizes and draft lengths the planner
    can choose (a short calibration: a few forwards per point). With `lending` (the CPU placement
    whose drafter cores join the target while plain decoding runs), the one-token forwards, which
    only plain decoding runs, are timed on the lent cores, as they will run."""
    source = config.planner_cost_profile
    if source == "off":
        return None
    if source != "calibrate":
        try:
            raw = json.loads(Path(source).read_text())
            return CostProfile.from_dict(raw.get("profile", raw))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ConfigError(f"planner_cost_profile: {source}: not a cost profile ({e})") from None
    batches = sorted({1, 4, 16, config.max_num_seqs})
    longest = config.gamma_max + 1                  # a verify of gamma_max drafts + the bonus token
    tokens = sorted({n for n in (1, 2, 3, 5) if n < longest} | {longest})
    vocab = target.model.config.vocab_size
    if config.proposer is ProposerKind.NGRAM:
        proposer = NgramProposer(vocab, config.ngram_min, config.ngram_max, device=config.device)
    else:     # a throw-away in-process drafter, timed where the target runs (a worker's core is alike)
        proposer = calibration_drafter(config.drafter, config, dtype, max_batch=max(batches),
                                       longest=config.gamma_max)
    # (both proposers live in this process: nothing to stop afterwards)
    profile = measure_cost_profile(target, proposer, batches=batches, token_counts=tokens,
                                   device=config.device, dtype=dtype, reps=3,
                                   longest_proposal=config.gamma_max)
    if lending is not None:
        lending.lend_drafter_cores()
        try:
            for b in batches:
                profile.verify[(b, 1)] = time_forward(target, batch=b, tokens=1, device=config.device,
                                                      dtype=dtype, reps=3)
        finally:
            lending.take_back_drafter_cores()
    return profile
