"""Offline use: run a list of prompts to completion on an engine, stepping it in this thread."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from backend.engine.outputs import RequestOutput
from backend.sampling.params import SamplingParams


@dataclass
class Completion:
    """A finished request, as `generate` returns it."""
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str | None
    drafted: int
    accepted: int
    latency_s: float = 0.0         # arrival to finish
    ttft_s: float = 0.0            # arrival to first token
    prompt_logprobs: list | None = None    # when the request asked for them


def generate(engine, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams],
             on_step: Callable[[list[RequestOutput]], None] | None = None,
             max_concurrency: int | None = None) -> list[Completion]:
    """Run prompts to completion (at most `max_concurrency` in flight); results in input order."""
    prompts = list(prompts)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    pending: dict[str, Completion] = {}
    done: dict[str, Completion] = {}
    pieces: dict[str, list[str]] = {}       # text deltas, joined at the end (+= is quadratic)
    limit = max_concurrency or len(prompts)
    next_i = 0
    while len(done) < len(prompts):
        while next_i < len(prompts) and next_i - len(done) < limit:
            prompt = prompts[next_i]
            prompt_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            engine.add_request(ids[next_i], prompt_ids, plist[next_i])
            pending[ids[next_i]] = Completion(ids[next_i], prompt_ids, [], "", None, 0, 0)
            pieces[ids[next_i]] = []
            next_i += 1
        outs = engine.step()
        for o in outs:
            c = pending.get(o.request_id)
            if c is None:
                continue
            c.output_ids += o.new_token_ids
            pieces[o.request_id].append(o.new_text)
            if o.prompt_logprobs is not None:
                c.prompt_logprobs = o.prompt_logprobs
            if o.finished:
                c.text = "".join(pieces.pop(o.request_id))
                c.finish_reason, c.drafted, c.accepted = o.finish_reason, o.num_drafted, o.num_accepted
                c.latency_s = o.finish_time - o.arrival_time
                c.ttft_s = (o.first_token_time or o.finish_time) - o.arrival_time
                done[o.request_id] = pending.pop(o.request_id)
        if on_step:
            on_step(outs)
    return [done[i] for i in ids]
