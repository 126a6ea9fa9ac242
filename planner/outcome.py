"""What the engine tells the planner after a step: what the step cost and committed.

The planner observes the decision it issued together with this outcome. ``ran`` differs from
the issued decision only where the step could not run it (the drafter still on its way back,
or no sequence got drafts: plain decoding; batch-parallel SD with nothing overlapped:
sequential SD); the arm that ran is the one scored. A step in which no sequence decoded (it fed
only prompts) is no arm's sample: nothing could be drafted, and its time is nearly all prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.arms import Decision


@dataclass(frozen=True)
class StepOutcome:
    step_wall_s: float                 # the step's wall time (its caller's share included)
    tokens_committed: int              # over all sequences
    batch_size: int                    # sequences the step advanced
    ran: Decision | None = None        # what actually ran; None: the issued decision
    drafter_rebuild_s: float = 0.0     # the drafter's catch-up, when speculation resumed
    drafter_reload_s: float = 0.0      # its weights' trip back, when they just arrived
    memory_s: float = 0.0              # the drafter's memory moved before the step (an offload and
                                       # the KV pool grown, or the pool shrunk for a reload)
    prefill_tokens: int = 0            # prompt tokens fed this step (their time is not the arm's)
    forward_tokens: int = 0            # tokens the target's forward took ...
    forward_s: float = 0.0             # ... and its time
    forward_cores: int = 0             # ... and the cores it ran on (0: one placement, not told)
    ngram_matched: int = 0             # positions the n-gram lookup's drafts would have matched ...
    ngram_compared: int = 0            # ... of those checked against this step's tokens
    decoded: bool = True               # a sequence decoded: False for a step that fed only prompts
    # plain decoding on the cores the engine is trying for its lending choice, not those it
    # keeps (backend/engine/core_lending.py): counted as played, no sample of the arm's cost
    trying_cores: bool = False
