"""A request's life inside the engine: its tokens, how much of it the target has cached, its clock."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from backend.sampling.params import SamplingParams
from backend.model.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]               # prompt followed by everything generated so far
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    # Tokens whose K/V the target cache holds. The last token of a decoding sequence is never
    # cached: it is the input of the next forward.
    num_computed: int = 0
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    drafted: int = 0
    accepted: int = 0
    num_preemptions: int = 0
    times_bypassed: int = 0            # later requests admitted ahead of it while it did not fit
    emitted_text_len: int = 0          # text already handed out (stop strings may hold some back)
    stop_text_at: int | None = None    # where a stop string begins in the text (it is cut there)
    spec_disabled: bool = False        # the drafter could not serve this request: decode plainly
    prompt_bytes: int = 0              # size of the prompt text (queue budget)
    cumulative_logprob: float = 0.0    # of the tokens generated so far (when it asks for logprobs)
    # When it asks for prompt_logprobs: None for the first prompt token, then each prompt token's
    # (filled in as prefill chunks run); handed out once, with its first output.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    grammar: object | None = None      # structured outputs: its matcher (backend.sampling.grammar)

    @property
    def speculates(self) -> bool:
        return self.params.speculative and not self.spec_disabled

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
