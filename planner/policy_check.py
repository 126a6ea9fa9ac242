"""Plain decoding against the planner's own choice, compared over whole stretches of steps.

The bandit scores every step in its batch bin, so it compares arms at the same batch. What a
user sees is different: the time a whole stretch of serving takes per token, and a mode changes
which batches the server runs at. Through the server at concurrency 16, a speculating engine
spends a third of its steps at batch 14-15 (a finished request's replacement on its way, the
front end busy on the same cores), while plain decoding, its requests in lockstep, spends
nearly all of them at 16; in the bin of 8-15 plain decoding is seen only on its few turnover
steps and looks dear there, while over the stretch it served a quarter more tokens a second
(`benchmarks/results/centred-bins/`, `benchmarks/results/batch-15/`).

So :class:`PolicyCheck` compares two policies, the bandit's choice ("bandit") and plain decoding
alone ("plain"), the way a user meets them. One of them is the incumbent (the bandit, to begin
with). Every so often, while the batch is at least ``min_batch``, the other runs for a stretch
(the challenger's trial), between a stretch of the incumbent before it and one after it; the
cost of each stretch is its steps' busy wall time (forwards, prompts, the serving path: each
step's cycle) over the tokens it committed. A challenger whose cost is below ``1 - margin``
times the mean of the incumbent's two becomes the incumbent. The stretch after the trial is
there so that a load that moves during the check moves both sides of the ratio.

* Each stretch leaves out its first ``settle`` steps (the switch's transient: the turn-off, the
  drafter's catch-up, the pipeline's fill) and any plain step on the cores the engine is only
  trying (its lending choice: not plain decoding as it will run), and lasts at least
  ``seq_tokens`` tokens per running sequence and ``min_steps`` steps.
* The first check comes ``first_after`` steps after the start (or a swap); each time the
  incumbent holds, the next comes twice as many steps later, up to ``max_interval``: a policy
  that keeps winning is checked ever more rarely, and so costs ever less.
* No check while auto already decodes plainly (under a tenth of its stretch's steps
  speculative): there is nothing to compare.
* Held plain decoding gives way to the bandit as soon as the batch moves a factor 2 from where the
  verdict was taken: at another load the bandit's bins decide again, from the next check on.
* No verdict where the incumbent's stretches before and after the trial ran at batches more
  than ``max_batch_drift`` (a quarter) apart: the load moved under the check (between two
  levels of a closed loop, say), and as a stretch's cost a token falls with its batch, the
  mean of the two is no measure of the trial's middle (a challenger run while the load rises
  looks cheap). The next check comes after the same gap.
* Nothing while requests queue (admission has turned some away, :meth:`note_queue`): no check
  starts, a check under way is dropped and held plain decoding gives way to the bandit. A
  stretch's cost a token is what a closed loop of requests meets; under a queue a user meets the
  queue's wait, and the load moves under the check (the batch grows as the queue is admitted,
  and a stretch's cost a token falls with its batch, so a challenger run while it rises looks
  cheap). Holding plain decoding there is the planner's known failure, settling on plain
  decoding under a queue: through the server under mixed load the check without this rule
  swapped to plain decoding as the high phase began and held it, and the run's goodput fell to
  0.68x the planner's without the check (`benchmarks/results/policy-check/`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

BANDIT, PLAIN = "bandit", "plain"
_RUN, _TRIAL, _AFTER = "run", "trial", "after"


@dataclass
class Stretch:
    """Steps summed: busy wall time, tokens committed, steps, running sequences, speculative steps."""
    wall_s: float = 0.0
    tokens: int = 0
    steps: int = 0
    batch_sum: int = 0
    speculative: int = 0

    def add(self, wall_s: float, tokens: int, batch: int, speculative: bool) -> None:
        self.wall_s += wall_s
        self.tokens += tokens
        self.steps += 1
        self.batch_sum += batch
        self.speculative += bool(speculative)

    @property
    def cost(self) -> float:
        """Seconds per committed token."""
        return self.wall_s / self.tokens if self.tokens else float("inf")

    @property
    def mean_batch(self) -> float:
        return self.batch_sum / self.steps if self.steps else 0.0


class PolicyCheck:
    def __init__(self, enabled: bool = True, *, min_batch: int = 8, margin: float = 0.05,
                 first_after: int = 96, max_interval: int = 4096, seq_tokens: int = 48,
                 min_steps: int = 16, settle: int = 7, max_verdicts: int = 64,
                 max_batch_drift: float = 0.25):
        self.enabled = bool(enabled)
        self.max_batch_drift = float(max_batch_drift)
        self.min_batch = int(min_batch)
        self.margin = float(margin)
        self.first_after = int(first_after)
        self.max_interval = max(int(max_interval), self.first_after)
        self.seq_tokens = int(seq_tokens)
        self.min_steps = int(min_steps)
        self.settle = int(settle)
        self.incumbent = BANDIT
        self._phase = _RUN
        self._interval = self.first_after
        self._since_check = 0          # steps of the incumbent's run since the last check
        self._to_settle = 0            # steps of the current phase still left out
        self._recent: deque = deque(maxlen=2048)   # the incumbent's run: (wall, tokens, batch, speculative)
        self._before: Stretch | None = None
        self._trial: Stretch | None = None
        self._acc = Stretch()
        self._target_tokens = 0
        self._level = 0.0              # the batch the last verdict for plain decoding was taken at
        self._batch_avg = 0.0
        self.checks = self.swaps = self.skipped = self.left_on_load = self.left_on_queue = 0
        self.moved = 0
        self._queued = False
        self.verdicts: deque = deque(maxlen=max_verdicts)
        self._step = 0

    # ------------------------------------------------------------------ what the planner reads

    def plain_only(self) -> bool:
        """Must the next step decode plainly (plain decoding is the incumbent, or on trial)?"""
        if not self.enabled:
            return False
        return (self.incumbent == PLAIN) != (self._phase == _TRIAL)

    def steps_left(self) -> int:
        """Steps for which :meth:`plain_only` cannot change (0: ask every step)."""
        if not self.enabled:
            return 1 << 30
        if self._phase != _RUN:
            return 0
        return max(self._interval - self._since_check, 0)

    # ------------------------------------------------------------------ what it is told

    def note_queue(self, queued: bool) -> None:
        """Whether requests queue now (admission has turned some away): while they do, the
        check stands aside (the module's docstring)."""
        if not self.enabled:
            return
        self._queued = bool(queued)
        if self._queued and (self._phase != _RUN or self.incumbent == PLAIN):
            self._record("queue", None)
            self.left_on_queue += 1
            self._start_run(BANDIT, self.first_after if self.incumbent == PLAIN else self._interval)

    def observe(self, wall_s: float, tokens: int, batch: int, speculative: bool,
                priced: bool = True) -> None:
        """One step: its busy wall time, the tokens it committed, the sequences it ran, whether
        it speculated (drafter or n-gram drafts); `priced` false for a step that is not its
        policy as it will run (plain decoding on the cores the engine is only trying): left out
        of every stretch."""
        if not self.enabled:
            return
        self._step += 1
        if not priced:
            return
        if self._to_settle > 0:
            self._to_settle -= 1
            return
        if self._phase == _RUN:
            self._run_step(wall_s, tokens, batch, speculative)
            return
        self._acc.add(wall_s, tokens, batch, speculative)
        if self._acc.tokens < self._target_tokens or self._acc.steps < self.min_steps:
            return
        if self._phase == _TRIAL:
            self._trial, self._acc = self._acc, Stretch()
            self._phase, self._to_settle = _AFTER, self.settle
        else:
            self._verdict(self._acc)

    def _run_step(self, wall_s: float, tokens: int, batch: int, speculative: bool) -> None:
        self._recent.append((wall_s, tokens, batch, speculative))
        self._since_check += 1
        self._batch_avg += 0.05 * (batch - self._batch_avg)
        if self.incumbent == PLAIN and not self._level / 2 <= self._batch_avg <= self._level * 2:
            self._record("left", None)
            self.left_on_load += 1
            self._start_run(BANDIT, self.first_after)
            return
        if self._since_check >= self._interval:
            self._maybe_start_trial()

    def _maybe_start_trial(self) -> None:
        if self._queued:
            self.skipped += 1
            self._since_check = 0       # requests queue: no check now, look again later
            return
        before = self._tail()
        if before is None:
            return                      # not enough of the incumbent yet: ask again next step
        if before.mean_batch < self.min_batch or (
                self.incumbent == BANDIT and before.speculative < 0.1 * before.steps):
            self.skipped += 1
            self._since_check = 0       # nothing to compare at this load: look again later
            return
        self.checks += 1
        self._before, self._acc = before, Stretch()
        self._target_tokens = round(self.seq_tokens * before.mean_batch)
        self._phase, self._to_settle = _TRIAL, self.settle

    def _tail(self) -> Stretch | None:
        """The incumbent's most recent steps, as many as one stretch needs (None: too few)."""
        s = Stretch()
        for wall_s, tokens, batch, speculative in reversed(self._recent):
            s.add(wall_s, tokens, batch, speculative)
            if s.steps >= self.min_steps and s.tokens >= self.seq_tokens * s.mean_batch:
                return s
        return None

    def _verdict(self, after: Stretch) -> None:
        incumbent_cost = (self._before.cost + after.cost) / 2
        ratio = self._trial.cost / incumbent_cost
        challenger = PLAIN if self.incumbent == BANDIT else BANDIT
        level = (self._before.mean_batch + after.mean_batch) / 2
        low, high = sorted((self._before.mean_batch, after.mean_batch))
        if high > low * (1.0 + self.max_batch_drift):
            # the load moved under the check: a stretch's cost a token falls with its batch, so
            # the mean of the two sides is no measure of the middle (no verdict, the same gap)
            self.moved += 1
            self._record("moved", ratio, level, self._trial.mean_batch)
            self._start_run(self.incumbent, self._interval, settle=False)
            return
        if ratio < 1.0 - self.margin:
            self.swaps += 1
            self._record(challenger, ratio, level, self._trial.mean_batch)
            self._level = self._batch_avg = level
            self._start_run(challenger, self.first_after)
        else:
            self._record(self.incumbent, ratio, level, self._trial.mean_batch)
            self._start_run(self.incumbent, min(self._interval * 2, self.max_interval), settle=False)

    def _start_run(self, incumbent: str, interval: int, settle: bool = True) -> None:
        self.incumbent, self._phase, self._interval = incumbent, _RUN, interval
        self._since_check = 0
        self._recent.clear()
        self._to_settle = self.settle if settle else 0

    def _record(self, kept: str, ratio: float | None, batch: float | None = None,
                trial_batch: float | None = None) -> None:
        """A verdict: the policy kept (or why there was none: "left", "queue", "moved"), the
        challenger's cost over the incumbent's, and the running batch: the incumbent's stretches'
        mean and the challenger's (a verdict), else the incumbent's recent average."""
        self.verdicts.append({"step": self._step, "kept": kept,
                              "challenger_over_incumbent": None if ratio is None else round(ratio, 4),
                              "batch": round(self._batch_avg if batch is None else batch, 1),
                              "trial_batch": None if trial_batch is None else round(trial_batch, 1)})

    def summary(self) -> dict:
        """The counters and the last verdict (small enough for a log line)."""
        return {"enabled": self.enabled, "incumbent": self.incumbent, "checks": self.checks,
                "swaps": self.swaps, "skipped": self.skipped, "left_on_load": self.left_on_load,
                "left_on_queue": self.left_on_queue, "moved": self.moved,
                "last_verdict": self.verdicts[-1] if self.verdicts else None}

    def stats(self) -> dict:
        """:meth:`summary` with the last ``max_verdicts`` verdicts, oldest first."""
        return self.summary() | {"verdicts": list(self.verdicts)}
