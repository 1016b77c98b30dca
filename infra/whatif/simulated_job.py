"""The what-if simulator's model of a job: its costs per event, and the failures it meets.

A ``JobModel`` is calibrated from a measured job (``from_report``): step time, blocking per
checkpoint, upload, startup, restart cost per failure kind, shutdown, and overhead per trained
second. A ``FailureEvent`` places one failure in a replay (infra/whatif/simulate.py), by wall time
or by where in the job's progress it struck.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infra.accounting.records import Bucket, EttReport
from infra.exit_codes import Outcome


@dataclass(frozen=True)
class JobModel:
    """The parameters of one job; ``with_changes`` makes the what-if variant.

    ``interval_s`` is training progress between checkpoints; ``restart_s`` is the restart cost
    of a failure of unknown kind, ``restart_by_cause`` the measured one per failure cause.
    """

    work_s: float
    interval_s: float
    blocking_s: float
    upload_s: float = 0.0
    startup_s: float = 0.0
    restart_s: float = 0.0
    shutdown_s: float = 0.0
    loop_overhead: float = 0.0
    step_time_s: float | None = None
    restart_by_cause: Mapping[str, float] = field(default_factory=dict)

    def with_changes(self, **changes: Any) -> JobModel:
        return dataclasses.replace(self, **changes)

    def restart_for(self, cause: str) -> float:
        return self.restart_by_cause.get(cause, self.restart_s)

    @classmethod
    def from_report(cls, report: EttReport) -> JobModel:
        """Calibrate from an observed job: its costs per event, not its totals.

        The step time is the mean kept step (effective training / steps), so the modelled
        checkpoints fall where the real ones did. Eval and gaps are spread over every trained
        second, redone ones included. The final anchor save is nested in the shutdown span but
        counted as blocking, so one blocking is added to the shutdown.
        """
        b = report.buckets
        work = b[Bucket.EFFECTIVE_TRAINING]
        trained = work + b[Bucket.WASTED_TRAINING]  # redone steps have their gaps and evals too
        overhead = (b[Bucket.EVAL] + b[Bucket.OTHER]) / trained if trained > 0 else 0.0
        measured_block = report.checkpoint_blocking_mean_s or 0.0
        step = work / report.num_steps if report.num_steps else report.step_time_median_s
        if report.checkpoint_interval_steps and step:
            interval = report.checkpoint_interval_steps * step
        elif report.checkpoint_interval_s:
            interval = max(report.checkpoint_interval_s - measured_block, 1e-9)
        else:
            interval = 2 * work + 1.0  # never checkpointed: no checkpoint ever fires
        upload = max(report.commit_latency_s or 0.0, 0.0)
        block = _blocking_without_waits(report, max(0.0, upload - interval * (1 + overhead)))
        restart_s, by_cause = _restart_costs(report)
        return cls(
            work_s=work,
            interval_s=interval,
            blocking_s=block,
            upload_s=upload,
            startup_s=report.time_to_start_s or 0.0,
            restart_s=restart_s,
            shutdown_s=b[Bucket.SHUTDOWN] + (block if report.num_checkpoints_committed else 0.0),
            loop_overhead=overhead,
            step_time_s=step,
            restart_by_cause=by_cause,
        )


def _blocking_without_waits(report: EttReport, wait_s: float) -> float:
    """Blocking per checkpoint, without the waits for the previous upload.

    When uploads outlast the interval, every checkpoint but an attempt's first waits
    ``wait_s`` inside its blocking span; the model adds that wait itself.
    """
    mean = report.checkpoint_blocking_mean_s or 0.0
    if wait_s <= 0 or mean <= 0:
        return mean
    count = round(report.checkpoint_blocking_total_s / mean)
    waited = max(count - len(report.attempts), 0)
    own = (report.checkpoint_blocking_total_s - waited * wait_s) / count
    return own if own > 0 else mean


def _restart_costs(report: EttReport) -> tuple[float, dict[str, float]]:
    """Time to Recover averaged per cause, and over the unplanned failures (preemptions only
    when there is nothing else): the cost of a failure whose kind is not given."""
    by_cause: dict[str, list[float]] = {}
    for f in report.failures:
        if f.resumed_at is not None:
            by_cause.setdefault(f.cause, []).append(f.time_to_recover_s)
    unplanned = [t for c, ts in by_cause.items() if c != Outcome.PREEMPTED for t in ts]
    recovered = unplanned or [t for ts in by_cause.values() for t in ts]
    mean = float(np.mean(recovered)) if recovered else 0.0
    return mean, {c: float(np.mean(ts)) for c, ts in sorted(by_cause.items())}


@dataclass(frozen=True)
class FailureEvent:
    """One failure in a replay: when, what it costs to restart, whether progress survives.

    It strikes at the wall time ``at_s`` (seconds from the job's start) or, when
    ``at_progress_s`` is set, once the attempt has trained up to that much of the job's
    progress (after the checkpoint due there, if any): where in the job a measured failure
    struck, whatever the machine's speed in that attempt. ``resume_s``, when set, is the
    progress the next attempt resumed from (the newest committed checkpoint at the failure),
    instead of the model's own.
    """

    at_s: float
    restart_s: float | None = None  # None: the model's restart_s
    keeps_progress: bool = False  # a preemption saves at the step boundary before exiting
    at_progress_s: float | None = None
    resume_s: float | None = None

    @classmethod
    def of_cause(cls, at_s: float, cause: str, model: JobModel, **where: float) -> FailureEvent:
        preempted = cause == Outcome.PREEMPTED
        return cls(at_s, model.restart_for(cause), preempted, **where)
