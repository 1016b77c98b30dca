"""Whether a job goes on after an attempt ends, and how long it waits before the next one.

One decision in one class, from the ``recovery`` section: success ends the job; a fatal
outcome (bad config or data, an incompatible checkpoint, a job id in use) ends it, since a
relaunch cannot fix it; a preemption goes on until ``max_preemptions`` is exceeded and never
counts towards ``max_failures``; any other failure goes on until ``max_failures`` is
exceeded. Preemptions and the first failure of a kind relaunch at once; the same kind failing
again waits ``backoff_s``, doubling per repeat up to ``backoff_max_s`` (a failure that keeps
coming back is not retried in a tight loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from infra.exit_codes import Outcome
from infra.settings import RecoveryConfig
from tasks.attempt import AttemptReport


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended: whether it succeeded, the one line that says why, its attempts."""

    succeeded: bool
    message: str
    attempts: tuple[AttemptReport, ...]

    @property
    def failures(self) -> int:
        return sum(1 for a in self.attempts if a.outcome.counts_as_failure)

    @property
    def preemptions(self) -> int:
        return sum(1 for a in self.attempts if a.outcome == Outcome.PREEMPTED)

    def to_dict(self) -> dict[str, Any]:
        return {
            "succeeded": self.succeeded,
            "message": self.message,
            "attempts": [asdict(a) for a in self.attempts],
        }


def backoff_s(recovery: RecoveryConfig, outcome: Outcome, repeats: int) -> float:
    """The wait before relaunching after ``outcome``, the ``repeats``-th time in a row."""
    if outcome == Outcome.PREEMPTED or repeats < 1 or recovery.backoff_s <= 0:
        return 0.0
    return min(recovery.backoff_s * 2 ** (repeats - 1), recovery.backoff_max_s)


class RetryPolicy:
    """The job's retry decisions; ``failures`` counts the attempts that failed so far."""

    def __init__(self, recovery: RecoveryConfig) -> None:
        self.recovery = recovery
        self.failures = 0

    def decide(self, reports: Sequence[AttemptReport]) -> JobOutcome | None:
        """The job's outcome after its last attempt (``reports[-1]``), or None: it goes on."""
        report, every = reports[-1], tuple(reports)
        preemptions = sum(1 for r in every if r.outcome == Outcome.PREEMPTED)
        if report.outcome == Outcome.SUCCESS:
            return JobOutcome(
                True,
                f"succeeded on attempt {report.attempt} after {self.failures} failure(s) and "
                f"{preemptions} preemption(s)",
                every,
            )
        if report.fatal:
            return JobOutcome(
                False, f"{report.describe()}: not retried, a relaunch cannot fix it", every
            )
        rec = self.recovery
        if report.outcome == Outcome.PREEMPTED:
            if preemptions > rec.max_preemptions:
                return JobOutcome(
                    False,
                    f"preempted {preemptions} times, more than "
                    f"max_preemptions={rec.max_preemptions}",
                    every,
                )
            return None
        self.failures += 1
        if self.failures > rec.max_failures:
            return JobOutcome(
                False,
                f"{self.failures} failures exceed max_failures={rec.max_failures}; last "
                f"{report.describe()}",
                every,
            )
        return None

    def delay_s(self, reports: Sequence[AttemptReport]) -> float:
        """The wait before the attempt after ``reports[-1]``: its outcome's repeats in a row."""
        outcome, repeats = reports[-1].outcome, 0
        for earlier in reversed(reports[:-1]):
            if earlier.outcome != outcome:
                break
            repeats += 1
        return backoff_s(self.recovery, outcome, repeats)

    def describe(self) -> str:
        """``failures 2/3``: for the log line of a relaunch."""
        return f"failures {self.failures}/{self.recovery.max_failures}"
