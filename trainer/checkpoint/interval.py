"""The checkpointer's interval, fixed by the config or chosen by the advisor.

``checkpoint.every_steps: auto`` (the default) picks the interval from what a checkpoint
really costs this job, measured as it trains:

- **Cost of one checkpoint** = the time the loop blocks for it (the save call and the wait
  for its staging copy) + what its background commit takes from the training steps while it
  runs: the steps that overlap a commit are slower than the steps that do not (on a small
  CPU host the commit competes for the cores), and the difference, summed over those steps,
  is part of the price.
- **Before any failure is known**, the interval spends a fixed share of training time on
  checkpoints: ``interval = cost / checkpoint.cost_budget`` (1% by default).
- **Once failures are observed** (the orchestrator tells the attempt how many the job has
  had and since when, those recovered in process included; an in-process restart also
  counts at once in its own attempt), Young's optimum from the measured cost and the
  observed MTBF:
  ``interval = sqrt(2 x cost x MTBF)`` (infra/whatif/advisor.py).
- **Never shorter than the upload**: at most one checkpoint is in flight, so an interval
  below the commit time would only make the next save wait.

Every change of interval is a ``checkpoint_interval`` ledger mark with its reason and inputs,
so the report shows what was chosen and why. With ``every_steps: N`` and/or
``every_seconds: S`` the interval is fixed, as configured.

The in-memory tier (memory_tier.py) has a policy of its own, the same one: its cost is its
own copies' blocking and overlap, its fields ``checkpoint.memory_tier.every_steps``,
``every_seconds`` and ``cost_budget``; its marks say ``tier: memory``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import CheckpointTier, Mark
from infra.settings import CheckpointConfig, CheckpointMode
from infra.whatif.advisor import young_interval

FIRST_AUTO_CHECKPOINT_S = 1.0  # training time before the first measured checkpoint
_WINDOW = 64  # recent measurements the medians are taken over


class IntervalReason(StrEnum):
    FIXED = "fixed"  # every_steps / every_seconds from the config
    FIRST = "first"  # auto, nothing measured yet
    BUDGET = "budget"  # auto: cost / cost_budget
    YOUNG = "young"  # auto: sqrt(2 cost MTBF) from observed failures
    UPLOAD = "upload"  # auto: raised to the commit time (one checkpoint in flight)


@dataclass(frozen=True)
class FailureHistory:
    """What the orchestrator knows of the job's failures when it starts an attempt."""

    failures: int = 0
    job_started_at: float | None = None  # Unix time of the job's first attempt

    def after_failure(self, now: float) -> FailureHistory:
        """The history once one more failure happened at ``now`` (an in-process restart:
        the attempt goes on, and its interval must now follow the observed MTBF)."""
        return FailureHistory(self.failures + 1, self.job_started_at or now)

    def mtbf_s(self, now: float) -> float | None:
        if self.failures < 1 or self.job_started_at is None:
            return None
        return max(now - self.job_started_at, 1e-3) / self.failures


class IntervalPolicy:
    """Whether the interval has passed (by step count, or by the clock), and what
    checkpoints cost; the schedule (schedule.py) weighs it with the other reasons to save."""

    def __init__(
        self,
        config: CheckpointConfig,
        total_steps: int,
        ledger: Ledger,
        history: FailureHistory = FailureHistory(),  # noqa: B008 - frozen
        clock: Callable[[], float] = time.time,
        tier: CheckpointTier = CheckpointTier.DURABLE,
    ) -> None:
        self.config, self.total_steps, self.ledger = config, total_steps, ledger
        self.history, self.clock, self.tier = history, clock, tier
        # The same policy for either tier, each from its own fields and measurements.
        own = config.memory_tier if tier == CheckpointTier.MEMORY else config
        self.every_steps, self.every_seconds = own.every_steps, own.every_seconds
        self.cost_budget = own.cost_budget
        self.off = config.mode == CheckpointMode.OFF or (
            tier == CheckpointTier.MEMORY and not config.memory_tier.enabled
        )
        self.auto = self.every_steps == "auto"
        self.interval_s: float | None = FIRST_AUTO_CHECKPOINT_S if self.auto else None
        self.reason = IntervalReason.FIRST if self.auto else IntervalReason.FIXED
        self._last_save = clock()
        self._blocking: deque[float] = deque(maxlen=_WINDOW)  # per checkpoint
        self._interference: deque[float] = deque(maxlen=_WINDOW)  # per checkpoint
        self._commit: deque[float] = deque(maxlen=_WINDOW)  # save -> committed
        self._quiet_steps: deque[float] = deque(maxlen=_WINDOW)  # no commit running
        # (save time, the durations of the steps the commit overlapped so far)
        self._open: tuple[float, list[float]] | None = None
        if not self.auto:
            self._mark(cost_s=None)

    # -- deciding --------------------------------------------------------------------------
    def due_at(self, step: int) -> bool:
        """Checkpoint after ``step`` by the step count (``every_steps: N``): every rank
        computes the same answer. The last step never is: it gets the anchor."""
        if self.off or step >= self.total_steps:
            return False
        every = self.every_steps
        return not self.auto and isinstance(every, int) and step % every == 0

    def due_by_clock(self) -> bool:
        """Checkpoint now by the clock (``auto``, ``every_seconds``)? Ranks differ in their
        clocks: only rank 0's answer counts, agreed through trainer/consensus.py."""
        if self.off:
            return False
        elapsed = self.clock() - self._last_save
        if self.auto:
            return self.interval_s is not None and elapsed >= self.interval_s
        secs = self.every_seconds
        return secs is not None and elapsed >= secs

    # -- measuring -------------------------------------------------------------------------
    def saved(self, blocking_s: float) -> None:
        """A checkpoint was started; the loop blocked ``blocking_s`` for the save call."""
        now = self.clock()
        self._last_save = now
        self._blocking.append(blocking_s)
        self._open = (now, [])

    def taken_elsewhere(self) -> None:
        """A copy of this tier came with the other tier's save (a durable save writes the
        in-memory copy too): the interval starts again, and nothing is measured."""
        self._last_save = self.clock()

    def staged(self, blocking_s: float) -> None:
        """The loop blocked ``blocking_s`` more, waiting for the staging copy."""
        if self._blocking:
            self._blocking[-1] += blocking_s
            self._last_save = self.clock()

    def step_done(self, duration_s: float, commit_running: bool, quiet: bool = True) -> None:
        """One training step took ``duration_s``; was a checkpoint of this tier committing
        during any part of it (at its start or at its end)? ``quiet``: nor one of the other
        tier (only a quiet step is the baseline the overlap is measured against). Called
        every step, on the loop's time: the overlap is summed once the commit has ended (the
        baseline cannot move meanwhile, as no step is quiet while a commit runs)."""
        if commit_running:
            if self._open is not None:
                self._open[1].append(duration_s)
            return
        if quiet:
            self._quiet_steps.append(duration_s)
        if self._open is not None:  # the commit ended during the previous step
            start, overlapped = self._open
            self._open = None
            self._commit.append(self.clock() - start)
            extra = 0.0
            if self._quiet_steps:
                baseline = statistics.median(self._quiet_steps)
                extra = sum(max(d - baseline, 0.0) for d in overlapped)
            self._interference.append(extra)
            self._update()

    def failures_seen(self, history: FailureHistory) -> None:
        """The orchestrator's latest count (a promoted standby learns it late)."""
        self.history = history
        self._update()

    # -- choosing --------------------------------------------------------------------------
    def cost_s(self) -> float | None:
        if not self._blocking or not self._interference:
            return None
        return statistics.median(self._blocking) + statistics.median(self._interference)

    def _update(self) -> None:
        cost = self.cost_s()
        if not self.auto or cost is None:
            return
        mtbf = self.history.mtbf_s(self.clock())
        if mtbf is not None:
            interval, reason = young_interval(cost, mtbf), IntervalReason.YOUNG
        else:
            interval, reason = cost / self.cost_budget, IntervalReason.BUDGET
        upload = statistics.median(self._commit) if self._commit else 0.0
        if upload > interval:
            interval, reason = upload, IntervalReason.UPLOAD
        changed = self.interval_s is None or abs(interval - self.interval_s) > 0.1 * self.interval_s
        if changed or reason != self.reason:
            self.interval_s, self.reason = interval, reason
            self._mark(cost, mtbf, upload)

    def _mark(
        self, cost_s: float | None, mtbf_s: float | None = None, upload_s: float | None = None
    ) -> None:
        step_s = statistics.median(self._quiet_steps) if self._quiet_steps else None
        steps = None
        if self.auto and self.interval_s and step_s:
            steps = max(1, math.ceil(self.interval_s / step_s))
        elif not self.auto and isinstance(self.every_steps, int):
            steps = self.every_steps
        self.ledger.mark(
            Mark.CHECKPOINT_INTERVAL,
            tier=str(self.tier),
            reason=str(self.reason),
            interval_s=self.interval_s if self.auto else self.every_seconds,
            interval_steps=steps,
            cost_s=cost_s,
            blocking_s=statistics.median(self._blocking) if self._blocking else None,
            interference_s=statistics.median(self._interference) if self._interference else None,
            upload_s=upload_s,
            mtbf_s=mtbf_s,
            failures=self.history.failures,
            budget=self.cost_budget if self.auto else None,
        )
