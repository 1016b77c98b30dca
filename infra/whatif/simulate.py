"""What-if simulator: replay a job under another checkpoint interval or blocking time.

The model (all times in seconds; infra/whatif/simulated_job.py). The job needs ``work_s`` of
training progress. Every ``interval_s`` of progress it checkpoints: training stops for
``blocking_s`` (sync: the whole save; async: staging only), then the upload runs for ``upload_s`` in
the background and the checkpoint is committed when it ends. At most one upload is in flight, so
when the interval is shorter than the upload the next checkpoint first waits for the previous one
(counted as blocking). Checkpoints fall at multiples of ``interval_s`` of the job's progress (every
N steps), also after a preemption resumed between two of them. Eval and gaps between steps cost
``loop_overhead`` wall seconds per trained second (infra/whatif/checkpoint_cycles.py has the closed
forms of these cycles). A failure loses the progress since the last *committed* checkpoint, except a
preemption, which saves at the step boundary before it exits and loses nothing; the job then spends
its restart cost (detection, scheduling, init, restore; per failure kind when measured) before
training again. The first attempt spends ``startup_s`` before its first step and the job
``shutdown_s`` after its last (the final anchor save included).

``replay`` is deterministic for a given failure schedule; ``what_if`` replays an observed job's
own failures under changed parameters, and ``validate`` sets a replay of them, placed where
in the job each struck, beside what was measured; ``monte_carlo`` draws exponential
schedules for an MTBF. The long-run waste per interval is ``checkpoint_cycles.sweep``.
Projecting a job to many GPUs is ``infra/whatif/projection.py``'s job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from infra.accounting.records import Bucket, EttReport
from infra.whatif.checkpoint_cycles import segment, time_to_finish, time_to_reach
from infra.whatif.simulated_job import FailureEvent, JobModel

# A replay that sees this many failures makes no progress (restarts outlast the MTBF).
MAX_FAILURES = 200_000


@dataclass(frozen=True)
class SimResult:
    """Where a simulated job's wall time went (same bucket names as the calculator)."""

    wall_s: float
    effective_s: float
    wasted_s: float
    blocking_s: float
    startup_s: float
    recovery_s: float
    shutdown_s: float
    other_s: float
    failures: int

    @property
    def ett_pct(self) -> float:
        return 100.0 * self.effective_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def failure_pct(self) -> float:
        return 100.0 * (self.wasted_s + self.recovery_s) / self.wall_s if self.wall_s else 0.0


@dataclass(frozen=True)
class MonteCarloResult:
    runs: int
    ett_pct_mean: float
    ett_pct_std: float
    ett_pct_p5: float
    ett_pct_p95: float
    failures_mean: float
    wall_s_mean: float


_NEVER = FailureEvent(math.inf)  # what comes after the last failure


def _events(failures: Iterable[float | FailureEvent]) -> Iterator[FailureEvent]:
    """Failures in order: wall times are sorted; a lazy iterator, or a list with failures
    placed by progress, is taken in the order given."""
    items = list(failures) if not isinstance(failures, Iterator) else failures
    if isinstance(items, list) and not any(
        isinstance(f, FailureEvent) and f.at_progress_s is not None for f in items
    ):
        items = sorted(items, key=lambda f: f.at_s if isinstance(f, FailureEvent) else float(f))
    for f in items:
        yield f if isinstance(f, FailureEvent) else FailureEvent(float(f))


def replay(model: JobModel, failures: Iterable[float | FailureEvent]) -> SimResult:
    """Run the job once; failures strike at the given wall times (seconds from job start), or
    where in the job's progress a ``FailureEvent`` places them.

    Plain times are failures that lose the unsaved work and cost ``model.restart_s``.
    """
    m = model
    events = _events(failures)
    t = progress = wasted = blocking = recovery = startup = 0.0
    overhead, first, count = m.startup_s, True, 0
    while True:
        nxt = next((f for f in events if f.at_progress_s is not None or f.at_s >= t), _NEVER)
        phase = math.fmod(progress, m.interval_s)
        phase = 0.0 if m.interval_s - phase < 1e-9 * m.interval_s else phase
        cycles = (m.interval_s, m.blocking_s, m.upload_s, m.loop_overhead, phase)
        if nxt.at_progress_s is not None:  # where the attempt has got to, in model time
            reach = time_to_reach(max(nxt.at_progress_s - progress, 0.0), *cycles)
            nxt = dataclasses.replace(nxt, at_s=t + overhead + reach)
        seg = nxt.at_s - t
        if count > MAX_FAILURES:
            raise ValueError(
                f"the job makes no progress: {count} failures before it finished "
                f"(restart {m.restart_s:.0f} s, interval {m.interval_s:.0f} s)"
            )
        if seg < overhead:  # failed again before training resumed
            if first:
                startup += seg
            else:
                recovery += seg
            t, first, count = nxt.at_s, False, count + 1
            overhead = _restart(m, nxt)
            continue
        if first:
            startup += overhead
        else:
            recovery += overhead
        remaining = m.work_s - progress
        need = time_to_finish(remaining, *cycles)
        if seg - overhead >= need:
            blocking += need - remaining * (1.0 + m.loop_overhead)
            t += overhead + need
            break
        committed, train, block = segment(seg - overhead, *cycles)
        train, block = float(train), float(block)
        if nxt.keeps_progress:  # the exit save blocks, then everything trained is kept
            exit_save = min(m.blocking_s, train)
            train, block = train - exit_save, block + exit_save
            done = min(train / (1.0 + m.loop_overhead), remaining)
        elif nxt.resume_s is not None:
            done = min(max(nxt.resume_s - progress, 0.0), train / (1.0 + m.loop_overhead))
        else:
            done = min(float(committed), remaining)
        wasted += train - done * (1.0 + m.loop_overhead)
        blocking += block
        progress += done
        t, first, count = nxt.at_s, False, count + 1
        overhead = _restart(m, nxt)
    other = m.work_s * m.loop_overhead
    return SimResult(
        wall_s=t + m.shutdown_s,
        effective_s=m.work_s,
        wasted_s=wasted,
        blocking_s=blocking,
        startup_s=startup,
        recovery_s=recovery,
        shutdown_s=m.shutdown_s,
        other_s=other,
        failures=count,
    )


def _restart(model: JobModel, failure: FailureEvent) -> float:
    return model.restart_s if failure.restart_s is None else failure.restart_s


def observed_failures(
    report: EttReport, model: JobModel, by_step: bool = False
) -> list[FailureEvent]:
    """The job's own failures, in order, each with its kind's restart cost and loss.

    Each strikes when its attempt died or, with ``by_step``, right after the last step it made
    and loses the work back to the step the next attempt resumed from (a failure at a
    checkpoint's step struck after that save if the job resumed from it, else before it).
    """
    step = model.step_time_s or 0.0
    resumed_from = {a.attempt: a.first_step for a in report.attempts}
    events = []
    for f in report.failures:
        where: dict[str, float] = {}
        after = resumed_from.get(f.attempt + 1)
        if by_step and f.last_step is not None and after is not None and step:
            at, resume = f.last_step * step, (after - 1) * step
            due = abs(at / model.interval_s - round(at / model.interval_s)) < 1e-6
            if due and resume < at:
                at -= 1e-6 * model.interval_s  # before the save at this step
            where = {"at_progress_s": at, "resume_s": resume}
        events.append(FailureEvent.of_cause(f.died_at, f.cause, model, **where))
    return events


def what_if(report: EttReport, **changes: float) -> SimResult:
    """Replay an observed job's own failures (when each attempt died, and of what kind) under
    changed parameters, e.g. ``what_if(report, interval_s=900)`` or ``blocking_s=2, upload_s=60``.
    A changed ``restart_s`` applies to every failure, whatever its kind."""
    model = JobModel.from_report(report)
    if "restart_s" in changes:
        model = model.with_changes(restart_by_cause={})
    model = model.with_changes(**changes)
    return replay(model, observed_failures(report, model))


@dataclass(frozen=True)
class Validation:
    """A measured job beside the model's replays of it: its own failures, of the same kinds,
    placed where in the job each struck (``predicted``) or when (``predicted_at_times``)."""

    label: str
    measured: EttReport
    predicted: SimResult
    predicted_at_times: SimResult
    model: JobModel

    @property
    def error_pts(self) -> float:
        """Predicted minus measured ETT, in percentage points."""
        return self.predicted.ett_pct - self.measured.ett_pct

    def within(self, tolerance_pts: float) -> bool:
        return abs(self.error_pts) <= tolerance_pts

    def rows(self) -> list[tuple[str, float, float]]:
        """(quantity, measured, predicted): wall time, ETT% and the buckets the model predicts."""
        b, p = self.measured.buckets, self.predicted
        return [
            ("ETT %", self.measured.ett_pct, p.ett_pct),
            ("wall s", self.measured.wall_s, p.wall_s),
            ("effective training s", b[Bucket.EFFECTIVE_TRAINING], p.effective_s),
            ("wasted training s", b[Bucket.WASTED_TRAINING], p.wasted_s),
            ("checkpoint blocking s", b[Bucket.CHECKPOINT_BLOCKING], p.blocking_s),
            (
                "startup + recovery s",
                b[Bucket.STARTUP] + b[Bucket.RECOVERY],
                p.startup_s + p.recovery_s,
            ),
            (
                "eval + other + shutdown s",
                b[Bucket.EVAL] + b[Bucket.OTHER] + b[Bucket.SHUTDOWN],
                p.other_s + p.shutdown_s,
            ),
            (
                "ETT % (failures at their wall times)",
                self.measured.ett_pct,
                self.predicted_at_times.ett_pct,
            ),
        ]


def validate(report: EttReport, label: str = "job") -> Validation:
    """The model calibrated from a finished job, replayed on the job's own failures.

    The model takes the job's per-event costs (step time, blocking per checkpoint, upload,
    startup, restart per failure kind, shutdown, overhead per training second); the wasted
    training, the blocking, and so the wall time and ETT% are predicted, not copied. Each
    failure strikes where in the job it struck (after the attempt's last step): a shared
    machine runs one attempt faster than another, so at the same wall time the model's job
    would be elsewhere. The replay at the failures' wall times is kept beside it.
    """
    if not report.finished:
        raise ValueError(f"{label}: the job did not finish (no job_end): nothing to compare")
    model = JobModel.from_report(report)
    by_step = replay(model, observed_failures(report, model, by_step=True))
    at_times = replay(model, observed_failures(report, model))
    return Validation(label, report, by_step, at_times, model)


def exponential_schedule(mtbf_s: float, rng: np.random.Generator) -> Iterator[float]:
    """Failure times of a Poisson process, drawn lazily in blocks."""
    t = 0.0
    while True:
        times = t + np.cumsum(rng.exponential(mtbf_s, 64))
        yield from times.tolist()
        t = float(times[-1])


def monte_carlo(model: JobModel, mtbf_s: float, runs: int = 500, seed: int = 0) -> MonteCarloResult:
    """Replay ``runs`` times with exponential failures (seeded, so reproducible)."""
    rng = np.random.default_rng(seed)
    results = [replay(model, exponential_schedule(mtbf_s, rng)) for _ in range(runs)]
    ett = np.array([r.ett_pct for r in results])
    return MonteCarloResult(
        runs=runs,
        ett_pct_mean=float(ett.mean()),
        ett_pct_std=float(ett.std()),
        ett_pct_p5=float(np.percentile(ett, 5)),
        ett_pct_p95=float(np.percentile(ett, 95)),
        failures_mean=float(np.mean([r.failures for r in results])),
        wall_s_mean=float(np.mean([r.wall_s for r in results])),
    )
