"""What-if simulator: replay a job under another checkpoint interval or blocking time.

The model (all times in seconds). The job needs ``work_s`` of training progress. Every
``interval_s`` of progress it checkpoints: training stops for ``blocking_s`` (sync: the whole
save; async: staging only), then the upload runs for ``upload_s`` in the background and the
checkpoint is committed when it ends. At most one upload is in flight, so when the interval is
shorter than the upload the next checkpoint first waits for the previous one (counted as
blocking). Eval and gaps between steps cost ``loop_overhead`` wall seconds per progress second.
A failure loses the progress since the last *committed* checkpoint; the job then spends
``restart_s`` (detection, scheduling, init, restore) before training again. The first attempt
spends ``startup_s`` before its first step and the job ``shutdown_s`` after its last.

``replay`` is deterministic for a given failure schedule; ``what_if`` replays an observed job's
own failures under changed parameters; ``monte_carlo`` draws exponential schedules for an MTBF;
``steady_state_waste`` is the long-run wasted fraction (a vectorised renewal estimate: every
restart from a committed checkpoint starts afresh), used to brute-force the best interval.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from infra.ett import EttReport


@dataclass(frozen=True)
class JobModel:
    """The parameters of one job; ``with_changes`` makes the what-if variant."""

    work_s: float
    interval_s: float
    blocking_s: float
    upload_s: float = 0.0
    startup_s: float = 0.0
    restart_s: float = 0.0
    shutdown_s: float = 0.0
    loop_overhead: float = 0.0
    step_time_s: float | None = None

    def with_changes(self, **changes: float) -> JobModel:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_report(cls, report: EttReport) -> JobModel:
        """Calibrate from an observed job: its surviving work, interval, costs and overheads."""
        b = report.buckets
        work = b["effective_training"]
        block = report.checkpoint_blocking_mean_s or 0.0
        if report.checkpoint_interval_steps and report.step_time_median_s:
            interval = report.checkpoint_interval_steps * report.step_time_median_s
        elif report.checkpoint_interval_s:
            interval = max(report.checkpoint_interval_s - block, 1e-9)
        else:
            interval = 2 * work + 1.0  # never checkpointed: no checkpoint ever fires
        recovered = [f.time_to_recover_s for f in report.failures if f.resumed_at is not None]
        return cls(
            work_s=work,
            interval_s=interval,
            blocking_s=block,
            upload_s=report.commit_latency_s or 0.0,
            startup_s=report.time_to_start_s or 0.0,
            restart_s=float(np.mean(recovered)) if recovered else 0.0,
            shutdown_s=b["shutdown"],
            loop_overhead=(b["eval"] + b["other"]) / work if work > 0 else 0.0,
            step_time_s=report.step_time_median_s,
        )


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


def segment(
    y: float | np.ndarray, tau: float, c: float, u: float = 0.0, q: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training for ``y`` wall seconds from a committed state until a failure (y may be an array).

    Cycles are: train tau*(1+q), wait w = max(0, u - tau*(1+q)) for the previous upload (not in
    the first cycle), block c; checkpoint k ends blocking at k*L - w and commits u later.
    Returns (committed progress, training wall, blocking wall incl. upload waits).
    """
    a = tau * (1.0 + q)
    w = max(0.0, u - a)
    big_l = a + w + c
    m = np.floor((np.asarray(y) + w) / big_l)
    start = np.where(m >= 1, m * big_l - w, 0.0)
    r = y - start
    train = m * a + np.minimum(r, a)
    # Partial cycle: whatever of r is past its training is upload wait + blocking.
    block = m * c + np.maximum(m - 1, 0) * w + np.clip(r - a, 0.0, None)
    n = np.clip(np.minimum(m, np.floor((y + w - u) / big_l)), 0, None)
    return n * tau, train, block


def time_to_finish(remaining: float, tau: float, c: float, u: float = 0.0, q: float = 0.0) -> float:
    """Wall time to make ``remaining`` progress without a failure (no checkpoint at the end)."""
    if remaining <= 0:
        return 0.0
    k = max(0, math.ceil(remaining / tau - 1e-12) - 1)
    w = max(0.0, u - tau * (1.0 + q))
    return remaining * (1.0 + q) + k * c + max(0, k - 1) * w


def replay(model: JobModel, failure_times: Iterable[float]) -> SimResult:
    """Run the job once; failures strike at the given wall times (seconds from job start)."""
    m = model
    fails = failure_times if isinstance(failure_times, Iterator) else iter(sorted(failure_times))
    t = progress = wasted = blocking = recovery = startup = 0.0
    overhead, first, failures = m.startup_s, True, 0
    while True:
        nxt = next((f for f in fails if f >= t), math.inf)
        seg = nxt - t
        if seg < overhead:  # failed again before training resumed
            if first:
                startup += seg
            else:
                recovery += seg
            t, first, overhead, failures = nxt, False, m.restart_s, failures + 1
            continue
        if first:
            startup += overhead
        else:
            recovery += overhead
        remaining = m.work_s - progress
        need = time_to_finish(remaining, m.interval_s, m.blocking_s, m.upload_s, m.loop_overhead)
        if seg - overhead >= need:
            blocking += need - remaining * (1.0 + m.loop_overhead)
            t += overhead + need
            break
        done, train, block = segment(
            seg - overhead, m.interval_s, m.blocking_s, m.upload_s, m.loop_overhead
        )
        done = min(float(done), remaining)
        wasted += float(train) - done * (1.0 + m.loop_overhead)
        blocking += float(block)
        progress += done
        t, first, overhead, failures = nxt, False, m.restart_s, failures + 1
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
        failures=failures,
    )


def what_if(report: EttReport, **changes: float) -> SimResult:
    """Replay an observed job's own failures (when each attempt died) under changed
    parameters, e.g. ``what_if(report, interval_s=900)`` or ``blocking_s=2, upload_s=60``."""
    model = JobModel.from_report(report).with_changes(**changes)
    return replay(model, [f.died_at for f in report.failures])


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


def steady_state_waste(
    interval_s: float,
    blocking_s: float,
    mtbf_s: float,
    upload_s: float = 0.0,
    restart_s: float = 0.0,
    n_failures: int = 100_000,
    seed: int = 0,
) -> float:
    """Long-run fraction of wall time not turned into committed progress.

    Each inter-failure gap is an independent renewal cycle (restart, then training from a
    committed state), so 1 - sum(committed) / sum(gaps) over many gaps estimates the waste.
    The same seed gives the same gaps for every interval (common random numbers).
    """
    gaps = np.random.default_rng(seed).exponential(mtbf_s, n_failures)
    return _waste(gaps, interval_s, blocking_s, upload_s, restart_s)


def _waste(gaps: np.ndarray, tau: float, c: float, u: float, restart_s: float) -> float:
    done, _, _ = segment(np.maximum(gaps - restart_s, 0.0), tau, c, u)
    return float(1.0 - done.sum() / gaps.sum())


def sweep(
    intervals: Iterable[float],
    blocking_s: float,
    mtbf_s: float,
    upload_s: float = 0.0,
    restart_s: float = 0.0,
    n_failures: int = 100_000,
    seed: int = 0,
) -> list[tuple[float, float]]:
    """(interval, steady-state waste) per interval, all on the same failure gaps."""
    gaps = np.random.default_rng(seed).exponential(mtbf_s, n_failures)
    return [(i, _waste(gaps, i, blocking_s, upload_s, restart_s)) for i in intervals]
