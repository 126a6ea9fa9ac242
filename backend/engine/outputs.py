"""What the engine hands back: per-request deltas and engine-wide statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.mode import Mode
from backend.step import StepResult


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the distribution that decided it."""
    token: int
    logprob: float
    rank: int                              # 1 = the most likely token
    top: list[tuple[int, float]]           # the `logprobs` most likely tokens, in rank order


@dataclass
class RequestOutput:
    """One step's news for one request. Exactly one output per request has finished=True."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Clock readings (time.perf_counter) for latency metrics; set on the final output.
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_drafted: int = 0                  # drafts proposed for this request so far
    num_accepted: int = 0                 # ... and accepted by verification
    error: str | None = None              # set with finish_reason == "error"
    logprobs: list[TokenLogprob] | None = None   # per new token, when the request asked
    cumulative_logprob: float | None = None      # over every token so far, when it asked
    # The prompt's tokens under the target (None for the first), when it asked: on its first output
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_total_blocks: int = 0
    kv_free_blocks: int = 0
    kv_usage: float = 0.0
    drafter_kv_usage: float = 0.0
    mode: Mode = Mode.AR                   # the plan steps run now (mode auto: the planner's last)
    gamma: int = 0
    # "none" | "on_device" | "offloaded" | "reloading" | "failed" (down, waiting to restart) | "restarting"
    drafter_state: str = "none"
    drafter_failures: int = 0
    drafter_restarts: int = 0
    drafter_restart_failures: int = 0      # restart attempts that did not bring a drafter up
    drafter_next_restart_s: float | None = None   # while "failed": seconds to the next attempt
    drafter_request_failures: int = 0      # requests the drafter could not serve (decoded plainly)
    request_errors: int = 0                # requests failed alone by a fault in a batched step
    drafter_catchup_tokens: int = 0        # tokens re-fed to rebuild the drafter's KV cache
    drafter_cpu_s: float = 0.0             # CPU seconds of the drafter's worker processes (0: in process)
    tensor_parallel_failures: int = 0      # the target's tensor-parallel group failed (a rank died or hung)
    tensor_parallel_restarts: int = 0      # ... and was brought back
    compiled_graphs: int = 0               # graphs torch.compile made in this process (compiled_graphs())
    draft_ahead: dict = field(default_factory=dict)   # pre-draft hits by accepted length (draft_ahead.py)
    offloads: int = 0                      # drafter weights moved to host (elastic memory)
    reloads: int = 0
    offload_failures: int = 0              # the pool could not grow (out of memory): nothing lent
    reload_failures: int = 0               # the pool could not shrink back: the drafter stays off
    planner_switches: int = 0
    psd_steps: int = 0
    psd_fallback_steps: int = 0            # verified sub-batch had no proposals: drafted in line
    psd_unbalanced_steps: int = 0          # one sub-batch empty while the other held >= 2
    psd_overlapped_steps: int = 0          # a draft of the other sub-batch overlapped the verify
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0                    # proposals verified (one per sequence per step)
    accepted_per_position: list[int] = field(default_factory=list)   # drafts accepted at position 0, 1, ...
    target_calls: int = 0                  # decode/verify forwards that committed tokens
    decode_tokens: int = 0                 # tokens committed by those calls
    preemptions: int = 0
    last_step: StepResult = field(default_factory=StepResult)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_tokens_per_target_call(self) -> float:
        return self.decode_tokens / self.target_calls if self.target_calls else 0.0
