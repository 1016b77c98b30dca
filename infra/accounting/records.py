"""What the ETT calculator reports (infra/accounting/ett.py): the buckets of a job's wall time
and the records of its attempts, failures, standbys and restores.

Apart from the calculator so that everything that only shows a report (the terminal, the
Prefect artifacts, MLflow, the fleet view) reads these types without the algorithm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from infra.accounting.clocks import ClockCheck
from infra.accounting.ledger_format import CheckpointTier, ResumeHow
from infra.exit_codes import Outcome


class Bucket(StrEnum):
    """Where each instant of a job's wall time went (docs/ett.md); in report order."""

    EFFECTIVE_TRAINING = "effective_training"
    WASTED_TRAINING = "wasted_training"
    CHECKPOINT_BLOCKING = "checkpoint_blocking"
    STARTUP = "startup"
    RECOVERY = "recovery"
    EVAL = "eval"
    SHUTDOWN = "shutdown"
    UNKNOWN = "unknown"
    OTHER = "other"


BUCKETS = tuple(Bucket)
# Highest first: an instant covered by several spans/windows goes to the first of them.
PRIORITY = (
    Bucket.CHECKPOINT_BLOCKING,
    Bucket.EVAL,
    Bucket.EFFECTIVE_TRAINING,
    Bucket.WASTED_TRAINING,
    Bucket.SHUTDOWN,
    Bucket.UNKNOWN,
    Bucket.RECOVERY,
    Bucket.STARTUP,
    Bucket.OTHER,
)
FAILURE_BUCKETS = (Bucket.WASTED_TRAINING, Bucket.RECOVERY)


@dataclass(frozen=True)
class StandbyRecord:
    """A warm standby that was promoted: its pre-warm ran beside another attempt."""

    attempt: int
    prewarm_s: float  # its first event -> parked (standby_ready)
    parked_s: float  # parked -> promoted
    promoted_at: float  # seconds from W's start


@dataclass(frozen=True)
class LostStandby:
    """A warm standby that died before it was needed; another was started behind it."""

    attempt: int
    lost_at: float  # seconds from W's start, when the orchestrator saw it gone
    parked: bool  # it had finished its init and parked
    cause: str


@dataclass(frozen=True)
class ResumeRecord:
    """One restore of training state (a ``resume`` mark of rank 0)."""

    attempt: int
    at: float  # seconds from W's start
    step: int
    how: ResumeHow
    url: str
    newest_step: int | None  # the newest committed checkpoint when it looked
    skipped: tuple[tuple[int, str, bool], ...] = ()  # (step, why, quarantined), newest first
    tier: CheckpointTier = CheckpointTier.DURABLE  # where the state came from

    def describe(self) -> str:
        """``attempt 2 (promoted standby) resumed from step 125, newest 150 quarantined:
        checksum mismatch in __1_0.distcp``."""
        who = {ResumeHow.PROMOTED: "promoted standby", ResumeHow.IN_PROCESS: "in process"}.get(
            self.how, "cold"
        )
        text = f"attempt {self.attempt} ({who}) resumed from step {self.step}"
        if self.tier == CheckpointTier.MEMORY:
            text += " (in-memory copy)"
        for step, why, quarantined in self.skipped:
            verb = "quarantined" if quarantined else "skipped"
            text += f", step {step} {verb}: {why}"
        return text


@dataclass(frozen=True)
class ResizeRecord:
    """An attempt that resumed on another number of ranks than its checkpoint's writers (a
    ``resize`` mark of rank 0): the tables and the data position were resharded."""

    attempt: int
    at: float  # seconds from W's start
    step: int
    from_ranks: int
    to_ranks: int

    def describe(self) -> str:
        """``attempt 2 resized at step 10: 2 -> 1 ranks (resharded from the checkpoint)``."""
        return (
            f"attempt {self.attempt} resized at step {self.step}: {self.from_ranks} -> "
            f"{self.to_ranks} ranks (resharded from the checkpoint)"
        )


def short_reason(reason: str) -> str:
    """A checkpoint error without the checkpoint's URL, which the record names already:
    ``checkpoint s3://b/j/step-000000150 is corrupt: checksum mismatch in x`` -> ``checksum
    mismatch in x``."""
    for marker in (" is corrupt: ", " is "):
        if reason.startswith("checkpoint ") and marker in reason:
            return reason.split(marker, 1)[1]
    return reason


@dataclass(frozen=True)
class FailureRecord:
    """One failed attempt; times are seconds from W's start.

    The recovery window runs from ``died_at`` (the attempt's last own event) to ``resumed_at``
    (the first train_step of a later attempt), cut short where the next failure's window
    begins, so the windows are disjoint and their sum is the total Time to Recover.
    """

    attempt: int
    cause: str
    last_step: int | None
    died_at: float
    detected_at: float | None
    resumed_at: float | None
    time_to_recover_s: float
    in_process: bool = False  # recovered inside the living attempt (no new process)


@dataclass(frozen=True)
class InitBreakdown:
    """Startup sub-stages of one attempt: their sum, their union and the critical path."""

    attempt: int
    stages: dict[str, float]
    sum_s: float
    union_s: float
    wall_s: float | None  # the attempt's first event -> its first train_step
    critical_path: tuple[str, ...]
    critical_path_s: float


@dataclass(frozen=True)
class AttemptSummary:
    attempt: int
    start: float  # seconds from W's start
    end: float
    # SUCCESS (job_end), the cause of its failure mark, STOPPED (a planned restart: its
    # shutdown without job_end), or UNFINISHED (still running, or its end not recorded)
    outcome: Outcome
    first_step: int | None
    last_step: int | None
    ranks: int | None = None  # its world size (its model_flops mark; None before it had one)


@dataclass(frozen=True)
class EttReport:
    """Everything the calculator derives from one job's ledger (times in seconds)."""

    start_time: float
    wall_s: float
    buckets: dict[str, float]
    ett_pct: float
    failure_pct: float
    idleness_pct: float
    time_to_start_s: float | None
    num_failures: int
    failures: tuple[FailureRecord, ...]
    time_to_recover_total_s: float
    observed_unsaved_s: float
    train_loop_s: float
    num_steps: int
    num_step_executions: int
    step_time_median_s: float | None
    step_time_mad_s: float | None
    checkpoint_blocking_total_s: float
    checkpoint_blocking_mean_s: float | None
    num_checkpoints_committed: int
    checkpoint_interval_s: float | None
    checkpoint_interval_steps: float | None
    commit_latency_s: float | None
    predicted_unsaved_s: float | None
    predicted_blocking_s: float | None
    attempts: tuple[AttemptSummary, ...]
    init: tuple[InitBreakdown, ...]
    rank_step_median_s: dict[int, float]
    finished: bool
    standbys: tuple[StandbyRecord, ...] = ()
    checkpoint_interval_reason: str | None = None  # the last interval the trainer chose
    lost_standbys: tuple[LostStandby, ...] = ()
    resumes: tuple[ResumeRecord, ...] = ()
    fallback_redone_s: float = 0.0  # of wasted_training: redone because a fallback went back
    # Of wasted_training, by the tier of the restore that sent the job back over those steps.
    redone_by_tier: dict[str, float] = field(default_factory=dict)
    memory_copies: int = 0  # in-memory copies written (checkpoint_blocking has their blocking)
    memory_blocking_total_s: float = 0.0
    memory_interval_s: float | None = None  # the in-memory tier's last chosen interval
    resizes: tuple[ResizeRecord, ...] = ()  # attempts that ran on another number of ranks
    # Durable commits by kind (full, delta): (commits, median bytes written).
    commit_bytes: dict[str, tuple[int, float]] = field(default_factory=dict)
    clock: ClockCheck = field(default_factory=ClockCheck)
    segments: tuple[tuple[float, float, str], ...] = field(repr=False, default=())

    def bucket_pct(self) -> dict[str, float]:
        return {b: 100.0 * v / self.wall_s if self.wall_s else 0.0 for b, v in self.buckets.items()}

    def to_dict(self, include_segments: bool = False) -> dict[str, Any]:
        """JSON-able dict (int keys become strings); segments only on request (they are long)."""
        out = asdict(self)
        out["rank_step_median_s"] = {str(k): v for k, v in self.rank_step_median_s.items()}
        out["bucket_pct"] = self.bucket_pct()
        if not include_segments:
            out.pop("segments")
        return out

    def to_metrics(self) -> dict[str, float]:
        """Flat numeric metrics (MLflow-style): headline numbers, buckets, L1 metrics."""
        scalars = {
            k: float(v)
            for k, v in self.to_dict().items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        return scalars | {f"bucket_{k}_s": v for k, v in self.buckets.items()}
