"""The step contract: a plan goes down, a result comes up.

Every step runs one frozen :class:`StepPlan` (the mode and gamma, from the fixed configuration
or the planner): the mode names the strategy and its proposer, gamma bounds each sequence's
drafts. The strategy schedules, drafts and overlaps by the plan and reports what its drafting
did (:class:`Drafting`); the engine's forward, verification and commit report their counts; the
engine puts both into one :class:`StepResult`, which it accounts from and the planner learns
from. Nothing of a step's plan is kept in shared mutable state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.mode import STEP_MODES, Mode


@dataclass(frozen=True)
class StepPlan:
    mode: Mode          # one of STEP_MODES: the strategy (and proposer) the step runs
    gamma: int          # drafts per sequence at most; 0 iff the mode is AR

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode.parse(self.mode, STEP_MODES))
        if (self.gamma == 0) != (self.mode is Mode.AR) or self.gamma < 0:
            raise ValueError(f"a step plan's gamma is 0 iff its mode is AR, got {self.mode.value}, {self.gamma}")

    def draft_length(self, seq, max_model_len: int) -> int:
        """How many drafts `seq` gets: gamma, bounded by its remaining tokens and context."""
        if self.gamma == 0 or not seq.speculates:
            return 0
        room_tokens = seq.params.max_tokens - seq.num_output_tokens - 1
        room_context = max_model_len - len(seq) - 1
        return max(0, min(self.gamma, room_tokens, room_context))


PLAIN = StepPlan(Mode.AR, 0)


@dataclass(frozen=True)
class Drafting:
    """What a strategy's drafting did in one step, and where the target's forward ran meanwhile."""
    draft_s: float = 0.0          # drafting in line (PSD: the worker's time, overlapped)
    transport_s: float = 0.0      # PSD: handing the other sub-batch to the worker and back
    overlapped: bool = False      # PSD drafted the other sub-batch while the target ran
    forward_cores: int = 0        # the forward borrowed the idle drafter's cores: the cores it
                                  # ran on (0: the step's placement, no borrowing)

    def __add__(self, other: "Drafting") -> "Drafting":
        return Drafting(self.draft_s + other.draft_s, self.transport_s + other.transport_s,
                        self.overlapped or other.overlapped, max(self.forward_cores, other.forward_cores))


def ran(plan: StepPlan, drafted: int, overlapped: bool) -> Mode:
    """What a step of `plan` actually ran: without drafts (drafter down, no room) it decoded
    plainly; batch-parallel SD without an overlapped draft was sequential SD."""
    if overlapped:
        return Mode.PSD
    if not drafted:
        return Mode.AR
    return Mode.NGRAM if plan.mode is Mode.NGRAM else Mode.SD


@dataclass
class PassCounts:
    """The target pass's counts for one step (forward -> verify -> commit), added up as its
    (possibly bisected) batches run; the step's result carries them."""
    num_prefill_tokens: int = 0
    num_recompute_tokens: int = 0     # of those, re-fed after a preemption
    num_forward_tokens: int = 0       # tokens fed to the target's forward (prefill + decode + drafts)
    num_context_tokens: int = 0       # tokens whose K/V the target's attention read (every context)
    tokens_committed: int = 0
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0             # decode/verify forwards that committed tokens
    decode_tokens: int = 0            # committed by decode/verify calls (prefill's first token excluded)
    # Where the pass's time went (t_verify_s spans prepare + forward + decide + commit):
    t_verify_s: float = 0.0
    t_prepare_s: float = 0.0          # the forward's inputs: token lists, layout, tensors
    t_forward_s: float = 0.0          # the target's forward alone (its launch, on CUDA)
    t_decide_s: float = 0.0           # sampling and verification of drafts
    t_commit_s: float = 0.0           # appending tokens, stop rules, detokenizing, outputs
    verified: list[tuple[int, int]] = field(default_factory=list)   # per draft verified: (drafted, accepted)


@dataclass
class StepResult(PassCounts):
    """What one engine step did (the target pass's counts, then the step's own); the engine's
    accounts and the planner learn from it. Made once, at the step's end, and not changed."""
    plan: StepPlan = PLAIN
    mode: Mode = Mode.AR              # what ran (see `ran`)
    gamma: int = 0                    # the plan's
    batch_size: int = 0
    t_schedule_s: float = 0.0         # admission, the planner, scheduling
    t_draft_s: float = 0.0            # drafting in line (PSD: the worker's time, overlapped)
    t_transport_s: float = 0.0        # PSD: handing the other sub-batch to the worker and back
    t_step_s: float = 0.0
    t_cycle_s: float = 0.0            # from the end of the previous step while busy (its caller's
                                      # handling of the outputs included); t_step_s after idling
    overlapped: bool = False          # batch-parallel SD drafted the other sub-batch meanwhile
    forward_cores: int = 0            # the forward borrowed the drafter's cores: those it ran on
    num_outputs: int = 0              # outputs the step emitted (through a server: responses)

    @property
    def overlap(self) -> float:
        """(T_draft + T_verify) / T_step: 1 = no overlap, 2 = perfect overlap."""
        return (self.t_draft_s + self.t_verify_s) / self.t_step_s if self.t_step_s else 0.0

    @property
    def decoded(self) -> bool:
        """A sequence decoded (the forward fed more than prompt chunks): False for a step that
        fed only prompts, in which nothing could be drafted."""
        return self.num_forward_tokens > self.num_prefill_tokens
